"""`h3trt build` as someone trying to break it, with real processes: Ctrl-C while --overwrite replaces the old bundle,
two builds of one output, a killed build's leftovers, a disk without room (before the build, and filling during it),
a user's mistake, a read-only key folder. Each case: the exit status it promises, one line when it fails, and either
the old complete bundle or the new complete bundle in place, nothing else. Also: what a build prints while it compiles
and checks, and a manifest that reads back exactly as the builder wrote it."""

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from h3trt.cli import main
from h3trt.engines.bundle_files import verify_files
from h3trt.engines.manifest import MANIFEST, content_sha256, hash_tree, read_manifest

from helpers import PLAIN_BUNDLE, REPO, fill_disk, small_filesystem

# The tiny default, a short schedule (~1 min): the shared plain bundle's flags, so that its kernels are the ones the
# session's C++ compile cache holds already (conftest.py)
BUILD = ["--model", "tiny", "--device", "cpu", *PLAIN_BUNDLE]
PAD_FILES = 20_000  # an old bundle this many files larger takes a moment to delete: long enough to interrupt


def _start(args, cwd: Path) -> subprocess.Popen:
    """`h3trt build ...` in its own process group, as a terminal starts it (Ctrl-C reaches the whole group)."""
    return subprocess.Popen([sys.executable, "-m", "h3trt.cli", "build", *BUILD, *args], cwd=cwd,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(pattern: str, proc: subprocess.Popen, timeout: float = 300) -> list[str]:
    deadline = time.monotonic() + timeout
    while not (found := glob.glob(pattern, include_hidden=True)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{pattern} never appeared"
        time.sleep(0.01)
    return found


def _error_line(stderr: str) -> str:
    """The one error line h3trt printed (after any `h3trt build:` progress lines), and no traceback."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.strip().splitlines() if line.startswith("h3trt: ")]
    assert len(errors) == 1 and stderr.strip().splitlines()[-1] == errors[0], stderr
    return errors[0]


def _intact(out: Path) -> str:
    """The manifest_sha256 of the complete bundle at `out` (every file listed, present and matching)."""
    manifest = read_manifest(out)
    assert verify_files(out, manifest) == []
    return manifest.manifest_sha256


@pytest.fixture(scope="module")
def built(bundle_cache):
    """A tiny bundle and its build's stderr (`h3trt build` in its own process): conftest's shared plain bundle."""
    bundle = bundle_cache.get(*PLAIN_BUNDLE)
    return bundle.path, bundle.stderr


def _old_bundle(built: Path, out: Path, pad_files: int = 0) -> str:
    """A complete bundle at `out`: a copy of `built`, with `pad_files` more (empty) files listed in its manifest.
    Returns its manifest_sha256."""
    shutil.copytree(built, out)
    if pad_files:
        (out / "pad").mkdir()
        for i in range(pad_files):
            (out / "pad" / str(i)).touch()
        data = json.loads((out / MANIFEST).read_text())
        data["files"] = hash_tree(out)
        data["manifest_sha256"] = content_sha256(data)
        (out / MANIFEST).write_text(json.dumps(data))
    return _intact(out)


@pytest.mark.build
def test_ctrl_c_while_the_old_bundle_is_deleted_leaves_the_new_one(built, tmp_path):
    """--overwrite: the new bundle is swapped in and the old one deleted with Ctrl-C held back; Ctrl-C while the old
    one's files disappear exits 130 once the swap is over, naming the new bundle, which is complete."""
    out = tmp_path / "b"
    old = _old_bundle(built[0], out, PAD_FILES)
    proc = _start(["--output", str(out), "--overwrite"], tmp_path)
    _wait_for(str(tmp_path / "*partial" / MANIFEST), proc, timeout=900)  # finished and checked: the swap is next
    deadline = time.monotonic() + 60
    while True:  # Ctrl-C as soon as the old bundle's files start to disappear, wherever it is
        counts = []
        for entry in os.scandir(tmp_path):
            with contextlib.suppress(OSError):
                counts.append(sum(1 for _ in os.scandir(Path(entry.path) / "pad")))
        if any(n < PAD_FILES for n in counts):
            os.killpg(proc.pid, signal.SIGINT)
            break
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert _error_line(stderr) == f"h3trt: interrupted after writing {out}.", stderr
    assert _intact(out) != old and not (out / "pad").exists()
    assert os.listdir(tmp_path) == ["b"]


@pytest.mark.build
def test_two_builds_of_one_output_the_second_is_refused_naming_the_first(built, tmp_path):
    """Two `h3trt build --overwrite` of one output 50 ms apart: one holds the output and the other is refused (one
    line naming the holder, exit 2); Ctrl-C stops the holder, and the old bundle is whole and said to be."""
    out = tmp_path / "b"
    old = _old_bundle(built[0], out)
    first = _start(["--output", str(out), "--overwrite"], tmp_path)
    time.sleep(0.05)
    second = _start(["--output", str(out), "--overwrite"], tmp_path)
    deadline = time.monotonic() + 300
    while first.poll() is None and second.poll() is None:
        assert time.monotonic() < deadline, "neither build was refused"
        time.sleep(0.01)
    loser, holder = (first, second) if first.poll() is not None else (second, first)
    _, stderr = loser.communicate()
    assert loser.returncode == 2, stderr
    line = _error_line(stderr)
    assert f"{out} is being built by another h3trt build (pid {holder.pid} on " in line and "started" in line, line
    os.killpg(holder.pid, signal.SIGINT)
    _, stderr = holder.communicate(timeout=300)
    assert holder.returncode == 130, stderr
    assert f"h3trt build: interrupted: {out} is the previous bundle, unchanged" in stderr, stderr
    assert _intact(out) == old
    assert os.listdir(tmp_path) == ["b"]


@pytest.mark.multiproc
def test_a_killed_builds_leftovers_are_removed_by_the_next_build(tmp_path, tiny_root):
    """SIGKILL leaves a build's temporary folder (nothing runs on SIGKILL): hidden, named for its host and pid. The
    next build removes it before it loads anything."""
    killed = _start(["--output", str(tmp_path / "b")], tmp_path)
    (leftover,) = _wait_for(str(tmp_path / ".b.*-*-*.partial"), killed)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.communicate()
    assert os.path.isdir(leftover)
    run = _start(["--output", str(tmp_path / "b")], tmp_path)
    deadline = time.monotonic() + 300
    while os.path.exists(leftover):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.01)
    os.killpg(run.pid, signal.SIGINT)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 130, stderr
    assert _error_line(stderr) == "h3trt: interrupted; no output was written (temporary files removed).", stderr
    assert os.listdir(tmp_path) == []


def test_a_disk_without_room_for_the_bundle_is_refused_before_any_load(tmp_path, tiny_root, monkeypatch, capsys):
    import h3trt.build.builder as builder
    import h3trt.build.plan as plan

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(builder, "load_dit", refuse)
    # This pytest worker may have served a bundle in an earlier test file, which a build refuses first (plan.py):
    # this test is about the disk.
    monkeypatch.setattr(plan, "bundle_activated", lambda: None)
    with small_filesystem(tmp_path / "disk", "2m") as disk:
        assert main(["build", *BUILD, "--output", str(disk / "b")]) == 2
        line = _error_line(capsys.readouterr().err)
        assert re.search(rf"--output {disk / 'b'}: {disk} has [\d.]+ MB free, and the bundle needs about [\d.]+ MB",
                         line), line
        assert os.listdir(disk) == []


@pytest.mark.multiproc
def test_a_disk_that_fills_during_the_build_is_one_line(tmp_path, tiny_root):
    """The disk passes the check, then another process fills it while the build writes: one line, exit 1, nothing of
    the build left."""
    with small_filesystem(tmp_path / "disk", "64m") as disk:
        run = _start(["--output", str(disk / "b")], tmp_path)
        _wait_for(str(disk / "*partial"), run)
        fill_disk(disk)
        _, stderr = run.communicate(timeout=300)
        assert run.returncode == 1, stderr
        line = _error_line(stderr)
        assert f"--output {disk / 'b'}: the disk filled up while building" in line and "No space left" in line, line
        assert os.listdir(disk) == ["filler"]


def test_a_kernel_this_device_cannot_run_is_one_line(tmp_path, tiny_root, capsys):
    """A user's mistake (a GPU kernel on the CPU): one line naming the fix, exit 2, nothing written."""
    assert main(["build", *BUILD, "--output", str(tmp_path / "b"), "--precision", "bf16", "--attention", "fa3"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line.startswith("h3trt: error: --attention fa3: the fa3 bf16 attention kernel needs a CUDA GPU"), line
    assert os.listdir(tmp_path) == []


def test_keygen_into_a_read_only_folder_is_one_line(tmp_path, capsys):
    with small_filesystem(tmp_path / "keys", "1m", read_only=True) as keys:
        assert main(["keygen", str(keys / "k")]) == 2
        line = _error_line(capsys.readouterr().err)
        assert f"cannot write the key {keys / 'k'}: the folder {keys} is not writable" in line, line
        assert os.listdir(keys) == []


@pytest.mark.build
def test_a_build_says_what_it_does_before_each_long_step(built):
    """The first compile (34 s on the H200) and the fresh-process check (11 s) each start with a line and end with one
    that gives the seconds."""
    lines = [line for line in built[1].splitlines() if line.startswith("h3trt build: ")]

    def first(pattern: str) -> int:
        return next(i for i, line in enumerate(lines) if re.match(pattern, line))

    assert first(r"h3trt build: compiling 6 segments \(inductor\)") < first(r"h3trt build: compiled embed ")
    assert first(r"h3trt build: compiled video_decoder_out") < first(
        r"h3trt build: checking 6 segments in a fresh process") < first(
        r"h3trt build: checked 6 segments in a fresh process in [\d.]+ s")


@pytest.mark.build
def test_the_manifest_reads_back_as_the_builder_wrote_it(built, tmp_path):
    """The builder serializes the typed Manifest the loader reads: every field it wrote is in the type, and what it
    writes reads back equal."""
    from h3trt.engines.manifest import write_manifest

    manifest = read_manifest(built[0])
    assert json.loads(json.dumps(manifest.to_dict())) == json.loads((built[0] / MANIFEST).read_text())
    copy = tmp_path / "b"
    shutil.copytree(built[0], copy)
    assert read_manifest(copy) == write_manifest(copy, manifest) == manifest


def test_an_interrupt_as_the_temporary_folder_is_made_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C right after the bundle's temporary folder is made (the next bytecode: __enter__ has not returned, so
    no __exit__ runs) removes the folder and the lock; test_a_killed_builds_leftovers_are_removed_by_the_next_build's
    SIGINT, sent the moment the sweep removed the killed build's folder, met that window in CI."""
    from h3trt.build.output import BundleOutput
    from h3trt.build.plan import BundleSize

    real_mkdir = Path.mkdir

    def mkdir_then_interrupted(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        if self.name.endswith(".partial"):
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", mkdir_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        with BundleOutput(tmp_path / "b", False, BundleSize(1, 0, 0, 0), log=lambda m: None):
            pass
    assert os.listdir(tmp_path) == []
