"""The tiny model's cache under concurrent first runs (real processes) and when it cannot be written."""

import os
import subprocess
import sys

import pytest

from h3trt.models import tiny

from helpers import REPO

# A first run whose build takes a while (a stand-in for the real ~10 s build, same protocol: a temporary folder,
# the marker written last, renamed into place). It records which process built.
FIRST_RUN = """
import sys, time
from pathlib import Path
from h3trt.models import tiny

def slow_build(root):
    # Build until the other process has started (it writes its marker before it asks for the model), so it must find
    # this build under way and wait, however the two processes are scheduled.
    others = [p for p in Path(sys.argv[1]).parent.glob("started-*") if p.name != f"started-{sys.argv[2]}"]
    deadline = time.monotonic() + 30
    while not others and time.monotonic() < deadline:
        time.sleep(0.05)
        others = [p for p in Path(sys.argv[1]).parent.glob("started-*") if p.name != f"started-{sys.argv[2]}"]
    time.sleep(0.5)
    (root / "weights.bin").write_bytes(sys.argv[2].encode())
    (root / "h3trt_tiny.json").write_text("{}")
    return root

tiny.write_tiny_checkpoint = slow_build
(Path(sys.argv[1]).parent / f"started-{sys.argv[2]}").write_text("")
target = tiny.ensure_tiny_checkpoint(Path(sys.argv[1]))
print((target / "weights.bin").read_text())
"""


@pytest.mark.multiproc
def test_concurrent_first_runs_build_once_and_never_delete_a_finished_cache(tmp_path):
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", FIRST_RUN, str(cache), f"p{i}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
             for i in range(2)]
    results = [(p.wait(60), *p.communicate()) for p in procs]
    assert all(code == 0 for code, _, _ in results), results
    built = {out.strip() for _, out, _ in results}
    assert len(built) == 1  # one process built; the others waited and used it, none deleted it under another
    assert sum("waiting for another process" in err for _, _, err in results) >= 1
    assert sorted(p.name for p in cache.iterdir()) == [f".tiny-v{tiny.TINY_VERSION}.lock",
                                                        f"tiny-v{tiny.TINY_VERSION}"]


def test_leftovers_are_cleared_and_a_finished_model_kept(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    target = cache / f"tiny-v{tiny.TINY_VERSION}"
    (cache / ".tiny-build-killed").mkdir(parents=True)  # a build killed half-way
    target.mkdir()  # without its marker: not a finished model

    def build(root):
        (root / "h3trt_tiny.json").write_text("{}")
        return root

    monkeypatch.setattr(tiny, "write_tiny_checkpoint", build)
    assert tiny.ensure_tiny_checkpoint(cache) == target and (target / "h3trt_tiny.json").exists()
    assert not (cache / ".tiny-build-killed").exists()
    monkeypatch.setattr(tiny, "write_tiny_checkpoint", lambda root: pytest.fail("a finished model was rebuilt"))
    (cache / ".tiny-build-other").mkdir()
    assert tiny.ensure_tiny_checkpoint(cache) == target  # finished: nothing is touched, not even leftovers


def test_a_read_only_cache_is_one_line_naming_xdg_cache_home(tmp_path, capsys, monkeypatch):
    from h3trt.cli import main

    cache = tmp_path / "ro"
    cache.mkdir()
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(cache)],
                                 capture_output=True)
        if mounted.returncode:
            pytest.skip(f"cannot mount a read-only tmpfs: {mounted.stderr.decode().strip()}")
    else:
        cache.chmod(0o555)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    try:
        code = main(["run", "--prompt", "x", "--output", str(tmp_path / "c.mp4"), "--quiet"])
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(cache)], check=True)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "tiny default model" not in line]
    assert code == 2 and len(err) == 1, err
    assert f"the tiny model's cache {cache / 'h3trt'} is not writable" in err[0] and "XDG_CACHE_HOME" in err[0]
    assert not (tmp_path / "c.mp4").exists() and not (tmp_path / "c.json").exists()
