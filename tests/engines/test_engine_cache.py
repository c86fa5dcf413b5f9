"""The private copy of a bundle's compiled code ($TMPDIR/h3trt-engine-cache-*) never outlives its process for long:
removed at exit and on SIGTERM, and after a SIGKILL by the next load. Real processes get real signals; the loads are
`activate_compiled_cache`, the step of every bundle load that makes the copy, on a stand-in bundle whose
inductor_cache/ holds one file (no compiler runs)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from h3trt.engines.private_cache import HOST, PREFIX, process_start, remove_leftover_caches

from helpers import REPO

# Activates the bundle's cache, says where the copy is, then serves until stdin closes.
LOAD = ("import os, sys\n"
        "from h3trt.engines.loaders import activate_compiled_cache\n"
        "activate_compiled_cache(sys.argv[1])\n"
        "print(os.environ['TORCHINDUCTOR_CACHE_DIR'], flush=True)\n"
        "sys.stdin.read()\n")


@pytest.fixture
def bundle(tmp_path):
    root = tmp_path / "bundle"
    (root / "inductor_cache").mkdir(parents=True)
    (root / "inductor_cache" / "kernel.so").write_bytes(b"\0" * 64)
    return root


@pytest.fixture
def tmpdir_env(tmp_path):
    """A private $TMPDIR for the loads, so the test sees only its own copies."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    return folder, dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(folder))


def _load(bundle, env) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", LOAD, str(bundle)], env=env[1], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line, proc.communicate()
    copy = Path(line)
    assert copy.parent == env[0] and (copy / "kernel.so").is_file()
    return proc, copy


def _copies(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.startswith(PREFIX))


@pytest.mark.multiproc
def test_a_sigkilled_loads_copy_is_removed_by_the_next_load(bundle, tmpdir_env):
    killed, left = _load(bundle, tmpdir_env)
    killed.kill()
    killed.wait()
    assert _copies(tmpdir_env[0]) == [left]  # nothing runs on SIGKILL

    live, mine = _load(bundle, tmpdir_env)  # removes the dead process's copy
    assert _copies(tmpdir_env[0]) == [mine] and f"-{live.pid}-" in mine.name
    other, theirs = _load(bundle, tmpdir_env)  # a live process's copy is left alone
    assert _copies(tmpdir_env[0]) == sorted([mine, theirs])
    for proc in (live, other):
        proc.communicate("")  # a normal exit removes its own
        assert proc.returncode == 0
    assert _copies(tmpdir_env[0]) == []


@pytest.mark.multiproc
def test_a_sigtermed_load_removes_its_copy_and_dies_of_sigterm(bundle, tmpdir_env):
    proc, copy = _load(bundle, tmpdir_env)
    proc.send_signal(signal.SIGTERM)
    proc.communicate()
    assert proc.returncode == -signal.SIGTERM  # the exit status SIGTERM always gave
    assert not copy.exists() and _copies(tmpdir_env[0]) == []


def test_only_copies_of_gone_owners_on_this_host_are_removed(tmp_path):
    """A reused pid (alive, started at another time) counts as gone; the owner's own start time keeps it; another
    host's, an unrelated name and a copy from before owners were named are left alone."""
    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: no process has its pid
    me, start = os.getpid(), process_start(os.getpid())
    assert start > 0
    names = {
        "dead": f"{PREFIX}{HOST}-{ended.pid}-1-abc",
        "reused": f"{PREFIX}{HOST}-{me}-{start + 1}-abc",
        "live": f"{PREFIX}{HOST}-{me}-{start}-abc",
        "other_host": f"{PREFIX}elsewhere-999999999-1-abc",
        "unnamed": f"{PREFIX}k2j4_x9",
        "unrelated": "h3trt-launch-abc",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
    removed = remove_leftover_caches(tmp_path)
    assert sorted(p.name for p in removed) == sorted([names["dead"], names["reused"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for k, n in names.items()
                                                               if k not in ("dead", "reused"))


# A process whose SIGTERM raises KeyboardInterrupt (as the CLI's does), sent SIGTERM the moment its folder exists:
# between the folder's creation and its registration for removal.
SIGNALLED_AT_CREATION = (
    "import os, signal, sys, tempfile\n"
    "from h3trt.engines import private_cache\n"
    "def interrupt(signum, frame):\n"
    "    raise KeyboardInterrupt\n"
    "signal.signal(signal.SIGTERM, interrupt)\n"
    "made = tempfile.mkdtemp\n"
    "def mkdtemp(*args, **kwargs):\n"
    "    path = made(*args, **kwargs)\n"
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
    "    return path\n"
    "tempfile.mkdtemp = mkdtemp\n"
    "try:\n"
    "    private_cache.make_private_cache()\n"
    "except KeyboardInterrupt:\n"
    "    sys.exit(130)\n")


@pytest.mark.multiproc
def test_a_signal_the_moment_the_folder_exists_still_removes_it(tmpdir_env):
    """test_engine.py's killed run sends SIGTERM the moment the copy's folder appears: once (under xdist) that was
    before the folder was registered for removal, and the empty folder stayed."""
    done = subprocess.run([sys.executable, "-c", SIGNALLED_AT_CREATION], env=tmpdir_env[1], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 130, done.stderr
    assert _copies(tmpdir_env[0]) == []
