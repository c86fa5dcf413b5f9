"""One user-error class, caught once: a mistake the user can fix (a flag, a file, a request a bundle cannot serve, a
missing optional package) is a UserError, printed by cli.main as one line with exit status 2, whichever layer raised
it; anything else is a bug and propagates with its traceback, as Python does (no broad net turns it into one line)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from h3trt.cli import main
from h3trt.errors import UserError
from h3trt.media.output_files import OutputError, OutputRefused

from helpers import uninstalled
from stand_ins import fake_bundle

pytestmark = pytest.mark.unit


# ----------------------------------------------------------------------------------------------------------------------
# A bug keeps its traceback


@pytest.mark.parametrize("error", [ValueError("boom"), RuntimeError("boom"), FileNotFoundError("boom"),
                                   ImportError("boom"), TypeError("boom")])
def test_an_unexpected_error_in_run_propagates(tmp_path, capsys, monkeypatch, error):
    """The error classes cli.main used to catch wholesale (ValueError, FileNotFoundError, ImportError) now reach
    the user as what they are: main() re-raises them, and nothing prints them as the user's mistake."""
    import h3trt.jobs.admission as admission  # run_clip reads its inputs first, through admission

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(admission, "prepare", broken)
    with pytest.raises(type(error), match="boom") as raised:
        main(["run", "--prompt", "a fox", "--output", str(tmp_path / "clip.mp4")])
    assert not isinstance(raised.value, UserError)
    assert "h3trt: error" not in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_error_a_ctrl_c_caused_is_the_interrupt(tmp_path, capsys, monkeypatch):
    """Ctrl-C inside torch's `with torch.device(...)` makes its exit raise RuntimeError("trying to pop from empty mode
    stack") over the KeyboardInterrupt (seen once in a killed-build test): still the user's interrupt, exit 130, one
    line; a RuntimeError with no interrupt behind it still propagates (the test above)."""
    import h3trt.jobs.admission as admission  # run_clip reads its inputs first, through admission

    def interrupted_cleanup(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("trying to pop from empty mode stack")

    monkeypatch.setattr(admission, "prepare", interrupted_cleanup)
    assert main(["run", "--prompt", "a fox", "--output", str(tmp_path / "clip.mp4")]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "h3trt: interrupted; no output was written (temporary files removed)."]
    assert list(tmp_path.iterdir()) == []


def test_an_error_after_a_ctrl_c_a_library_swallowed_is_the_interrupt(tmp_path, capsys, monkeypatch):
    """safetensors, interrupted inside `get_tensor`, swallows the KeyboardInterrupt and raises its own error, which the
    loader reports as a corrupted file (seen in CI's killed-build test): after the signal arrived, that is the user's
    interrupt, exit 130, not a bad checkpoint and exit 2."""
    import h3trt.jobs.admission as admission  # run_clip reads its inputs first, through admission
    from h3trt.models.checkpoint.reader import CheckpointError

    def swallowed(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            pass  # what a library's native code does with it
        raise CheckpointError("model.safetensors: tensor 'x' cannot be read; the file is corrupted.")

    monkeypatch.setattr(admission, "prepare", swallowed)
    assert main(["run", "--prompt", "a fox", "--output", str(tmp_path / "clip.mp4")]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "h3trt: interrupted; no output was written (temporary files removed)."]

    def corrupted(*args, **kwargs):  # the same error with no interrupt is the file's, exit 2
        raise CheckpointError("model.safetensors: tensor 'x' cannot be read; the file is corrupted.")

    monkeypatch.setattr(admission, "prepare", corrupted)
    assert main(["run", "--prompt", "a fox", "--output", str(tmp_path / "clip.mp4")]) == 2
    assert "the file is corrupted" in capsys.readouterr().err


def test_an_unexpected_error_in_build_propagates(tmp_path, tiny_root, capsys, monkeypatch):
    import h3trt.build.builder as builder

    def broken(*args, **kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(builder, "build", broken)
    with pytest.raises(ValueError, match="boom"):
        main(["build", "--model", "tiny", "--output", str(tmp_path / "bundle"), "--device", "cpu"])
    assert "h3trt: error" not in capsys.readouterr().err


_BROKEN_RUN = """
import sys
import time
import h3trt.jobs.admission as admission
def broken(*args, **kwargs):
    raise ValueError("boom: an internal invariant")
admission.prepare = broken
from h3trt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_user_sees_the_traceback_of_a_bug(tmp_path, tiny_cache):
    """What a user sees: Python's own report (the traceback, exit status 1), not `h3trt: error:` and status 2."""
    proc = subprocess.run([sys.executable, "-c", _BROKEN_RUN, "run", "--prompt", "a fox", "--output",
                           str(tmp_path / "clip.mp4")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.rstrip().endswith("ValueError: boom: an internal invariant")
    assert "h3trt: error" not in proc.stderr


# ----------------------------------------------------------------------------------------------------------------------
# A user's mistake is one line and exit 2, from every layer


def _missing_fastapi(monkeypatch):
    import h3trt.server.main as server

    real = server._importable
    monkeypatch.setattr(server, "_importable", lambda name: name != "fastapi" and real(name))


CASES = {
    # build: BuildConfig (build/config.py)
    "precision_combination": (["build", "--model", "tiny", "--output", "{tmp}/bundle", "--precision", "bf16",
                               "--fp8-attention", "--device", "cpu"],
                              None, "apply to --precision fp8/nvfp4, not bf16"),
    "fp8_without_prompts": (["build", "--model", "tiny", "--output", "{tmp}/bundle", "--precision", "fp8",
                             "--device", "cpu"], None, "needs --calib-prompts FILE"),
    # runtime: the requests file (pipeline/parse.py)
    "missing_requests_file": (["run", "--requests", "{tmp}/missing.jsonl", "--out-dir", "{tmp}/out"],
                              None, "no such requests file"),
    # models: the canvas (models/packing.py)
    "bad_canvas": (["run", "--prompt", "a fox", "--output", "{tmp}/clip.mp4", "--width", "100", "--height", "96"],
                   None, "Unsupported resolution 100x96"),
    "bad_duration": (["run", "--prompt", "a fox", "--output", "{tmp}/clip.mp4", "--duration", "20"],
                     None, "Unsupported duration 20 s"),
    # parallel: the mesh degrees (parallel/mesh.py)
    "bad_cfg_degree": (["run", "--prompt", "a fox", "--output", "{tmp}/clip.mp4", "--cfg", "3"],
                       None, "--cfg must be 1 or 2, got 3"),
    # calibration / server: a missing optional package, with its pip command
    "missing_modelopt": (["build", "--model", "tiny", "--output", "{tmp}/bundle", "--precision", "fp8",
                          "--calib-prompts", "{tmp}/prompts.txt", "--device", "cpu"],
                         lambda monkeypatch: uninstalled(monkeypatch, "nvidia-modelopt"),
                         "pip install 'h3trt[calibration]'"),
    "missing_fastapi": (["serve", "--data-dir", "{tmp}/store", "--device", "cpu"],
                        _missing_fastapi, "pip install 'h3trt[serve]'"),
    # a machine that cannot run what was asked
    "no_cuda": (["run", "--prompt", "a fox", "--output", "{tmp}/clip.mp4", "--device", "cuda"],
                None, "no CUDA device is visible; use --device cpu"),
    # engines: a bundle built for another mesh, refused when it loads (engines/bundle.py)
    "bundle_for_another_mesh": (["run", "--engine", "{tmp}/sp2", "--prompt", "a fox", "--output", "{tmp}/clip.mp4"],
                                None, "This bundle was built for sp=2 x cfg=1"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_user_mistake_is_one_line_and_exit_2(tmp_path, tiny_root, capsys, monkeypatch, case):
    if case == "no_cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    argv, patch, message = CASES[case]
    (tmp_path / "prompts.txt").write_text("a red fox runs\n")
    fake_bundle(tmp_path / "sp2", tiny_root, **{"mesh.sp": 2, "mesh.heads_per_rank": 1})
    if patch is not None:
        patch(monkeypatch)
    before = sorted(tmp_path.rglob("*"))
    code = main([a.format(tmp=tmp_path) for a in argv])
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("h3trt: error: ")]
    assert code == 2 and len(errors) == 1 and message in errors[0], (code, lines)
    # Nothing else but h3trt's one-line notes (the tiny model's random weights, a build's progress): no traceback.
    assert all(line.startswith(("h3trt: ", "h3trt build: ")) for line in lines), lines
    assert sorted(tmp_path.rglob("*")) == before  # refused before anything was written


# ----------------------------------------------------------------------------------------------------------------------
# The classes


def test_output_refused_is_a_user_error_and_still_an_output_error():
    """A preflight refusal (another path, room on the disk) is the user's (exit 2); callers that catch OutputError
    around a write (a batch going on after a full disk) still catch it."""
    error = OutputRefused("x")
    assert isinstance(error, UserError) and isinstance(error, OutputError)
    assert isinstance(error, ValueError) and isinstance(error, RuntimeError)
    try:
        raise OutputRefused("refused")
    except OutputError as caught:
        assert str(caught) == "refused"
