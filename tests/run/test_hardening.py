"""`h3trt run` as someone trying to break it, with real processes: a target that appears while a run writes it,
Ctrl-C and SIGKILL during decode and mux, a read-only folder, a full disk (at the preflight and while writing), and a
batch interrupted between requests. Each case: one line, the exit status it promises, nothing half-written left."""

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from h3trt.cli import main

from helpers import REPO, fill_disk, small_filesystem

SMALL = ["--width", "128", "--height", "32", "--steps", "2", "--quiet"]  # the cheapest clip: 5 s, one evaluation


def _env(tiny_cache) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(tiny_cache))


def _start(args, cwd: Path, tiny_cache) -> subprocess.Popen:
    """`h3trt run ...` in its own process group, as a terminal starts it (Ctrl-C reaches the whole group)."""
    return subprocess.Popen([sys.executable, "-m", "h3trt.cli", "run", *args], cwd=cwd, env=_env(tiny_cache),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(pattern: str, proc: subprocess.Popen | None = None, timeout: float = 300) -> list[str]:
    deadline = time.monotonic() + timeout
    while not (found := glob.glob(pattern)):
        assert proc is None or proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{pattern} never appeared"
        time.sleep(0.005)
    return found


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.strip().splitlines() if "tiny default model" not in line]


@pytest.mark.multiproc
def test_a_target_that_appears_meanwhile_is_left_alone(tmp_path, tiny_root, capsys):
    """Another process writes clip.mp4 while this run decodes: the run fails at its commit with one line, exit 1,
    and leaves the other file as it was and nothing of its own."""
    watcher = subprocess.Popen([sys.executable, "-c", "import glob, sys, time\n"
                                "while not glob.glob(sys.argv[1] + '/.clip.mp4.*.partial'): time.sleep(0.002)\n"
                                "open(sys.argv[1] + '/clip.mp4', 'wb').write(b'theirs')", str(tmp_path)])
    try:
        code = main(["run", "--prompt", "a fox", "--output", str(tmp_path / "clip.mp4"), *SMALL])
    finally:
        watcher.kill()
    err = _errors(capsys.readouterr().err)
    assert code == 1 and len(err) == 1 and "clip.mp4 appeared while this run was writing it" in err[0], err
    assert sorted(os.listdir(tmp_path)) == ["clip.mp4"] and (tmp_path / "clip.mp4").read_bytes() == b"theirs"


@pytest.mark.multiproc
def test_ctrl_c_and_sigkill_during_decode_leave_nothing(tmp_path, tiny_root, tiny_cache):
    """SIGKILL mid-mux leaves a temporary file (nothing can run on SIGKILL); the next run removes it. Ctrl-C mid-mux
    exits 130 (never 134, SIGABRT), says no output was written, and leaves nothing."""
    killed = _start(["--prompt", "a fox", "--output", "clip.mp4", *SMALL], tmp_path, tiny_cache)
    _wait_for(str(tmp_path / ".clip.mp4.*.partial"), killed)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.communicate()
    assert glob.glob(str(tmp_path / ".clip.mp4.*.partial"))  # the leftover of a killed run

    run = _start(["--prompt", "a fox", "--output", "clip.mp4", *SMALL], tmp_path, tiny_cache)
    partial = None
    deadline = time.monotonic() + 300
    while partial is None:  # this run's own temporary file (the killed one's is gone by now: preflight removed it)
        mine = [p for p in glob.glob(str(tmp_path / ".clip.mp4.*.partial")) if f"-{run.pid}-" in p]
        partial = mine[0] if mine else None
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.005)
    time.sleep(0.2)  # into the encode
    os.killpg(run.pid, signal.SIGINT)
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 130, stderr
    assert _errors(stderr)[-1] == "h3trt: interrupted; no output was written (temporary files removed).", stderr
    assert "Traceback" not in stderr and "terminate called" not in stderr
    assert os.listdir(tmp_path) == []


def test_unwritable_and_full_folders_are_refused_before_any_load(tmp_path, tiny_root, no_model_load, capsys):
    with (small_filesystem(tmp_path / "ro", "1m", read_only=True) as ro,
          small_filesystem(tmp_path / "small", "300k") as small):
        assert main(["run", "--prompt", "x", "--output", str(ro / "c.mp4"), *SMALL]) == 2
        assert main(["run", "--prompt", "x", "--output", str(small / "c.mp4"), *SMALL]) == 2
        requests = tmp_path / "b.jsonl"
        requests.write_text(json.dumps({"id": "a", "task": "t2va", "prompt": "x", "resolution": "128x32"}) + "\n")
        assert main(["run", "--requests", str(requests), "--out-dir", str(small / "out"), "--quiet"]) == 2
        err = _errors(capsys.readouterr().err)
        assert len(err) == 3, err
        assert f"the folder {ro} is not writable" in err[0]
        assert "MB free, and the clip may need up to" in err[1] and "MB free, and the clip may need" in err[2]
        assert os.listdir(small) == []  # the --out-dir the refused batch created is gone again


@pytest.mark.multiproc
def test_a_disk_that_fills_while_writing_is_one_line(tmp_path, tiny_root, tiny_cache):
    """The disk passes the preflight, then another process fills it while the clip is written: one line, exit 1,
    no temporary file, no abort."""
    with small_filesystem(tmp_path / "disk", "2m") as disk:
        run = _start(["--prompt", "a fox", "--output", str(disk / "clip.mp4"), *SMALL], tmp_path, tiny_cache)
        _wait_for(str(disk / ".clip.mp4.*.partial"), run)
        fill_disk(disk)
        _, stderr = run.communicate(timeout=300)
        err = _errors(stderr)
        assert run.returncode == 1 and len(err) == 1, stderr
        assert "writing the clip failed (No space left on device)" in err[0] or "No space left" in err[0], err
        assert sorted(os.listdir(disk)) == ["filler"]


def test_an_interrupted_batch_says_what_finished(tmp_path, tiny_root, capsys, monkeypatch):
    """Ctrl-C while the second of three requests decodes: exit 130, and the message names what is done; the first
    clip and its record are whole, the second left nothing."""
    from h3trt.pipeline.h3_pipeline import H3Pipeline

    calls = []
    decode = H3Pipeline._decode_and_mux  # what every clip's decode goes through, batched or not

    def interrupted_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(H3Pipeline, "_decode_and_mux", interrupted_second)
    requests = tmp_path / "b.jsonl"
    requests.write_text("".join(json.dumps({"id": i, "task": "t2va", "prompt": "x", "resolution": "128x32",
                                            "steps": 2}) + "\n" for i in ("a", "b", "c")))
    out = tmp_path / "out"
    assert main(["run", "--requests", str(requests), "--out-dir", str(out), "--quiet"]) == 130
    err = _errors(capsys.readouterr().err)
    assert err[-1].startswith(f"h3trt: interrupted: 1 of 3 requests are done in {out} (a), each with its record")
    names = sorted(os.listdir(out))
    assert names == [".h3trt-batch.lock", "a.json", "a.mp4", "timeline.json", "timeline.png"], names
    assert json.loads((out / "a.json").read_text())["status"] == "done"


def test_an_interrupted_run_removes_the_folders_it_created_for_nothing(tmp_path, tiny_root, capsys, monkeypatch):
    """Ctrl-C before the clip is written: the output folders the run created (nested here) are removed again; a
    folder that existed stays (a refused run's: test_unwritable_and_full_folders_are_refused_before_any_load)."""
    from h3trt.pipeline.h3_pipeline import H3Pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(H3Pipeline, "_decode_and_mux", interrupted)
    assert main(["run", "--prompt", "x", "--output", str(tmp_path / "new" / "deeper" / "c.mp4"), *SMALL]) == 130
    assert os.listdir(tmp_path) == []
    (tmp_path / "kept").mkdir()
    assert main(["run", "--prompt", "x", "--output", str(tmp_path / "kept" / "c.mp4"), *SMALL]) == 130
    assert os.listdir(tmp_path) == ["kept"]
    assert capsys.readouterr().err.count("h3trt: interrupted; no output was written") == 2


def test_the_audio_vae_loads_without_torchs_weight_norm_warning(tiny_root):
    """diffusers builds the audio VAE with torch.nn.utils.weight_norm, whose FutureWarning every run used to print."""
    import warnings

    from h3trt.models.checkpoint.vae import load_audio_vae

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_audio_vae(tiny_root / "FL2VA")
    assert not [w for w in caught if "weight_norm" in str(w.message)]


def test_one_denoise_bar_open_only_over_the_steps(capsys):
    from h3trt.jobs.job import Event
    from h3trt.run.commands import ClipQueue

    queue = ClipQueue(None, quiet=False)
    queue.report(Event("clip", "started", "text_encode"))
    assert capsys.readouterr().err == ""  # nothing before the first step (text encode, loading)
    for i in range(1, 4):
        queue.report(Event("clip", "progress", "denoise", 30 * i, evaluations=(i, 3)))
    assert queue.bar is None  # closed at the last step, before the decode
    err = capsys.readouterr().err
    assert err.count("denoise") >= 1 and "3/3" in err.split("\r")[-1]
    queue.report(Event("clip", "progress", "decode", 97))  # the decode's progress draws no bar
    queue.close()  # closing again (the caller's finally) draws nothing
    assert capsys.readouterr().err == ""
