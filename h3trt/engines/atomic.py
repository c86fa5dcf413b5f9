"""Writing outputs that are never lost, mixed up or left half-written, whoever writes them: the primitives under a
clip's commit (media/output_files.py) and a bundle's swap into place (build/output.py).

  * Temporary names are unique per process and live in the target's own folder: `.<name>.<host>-<pid>-<token>.partial`
    (hidden, on the target's filesystem so the final step is a rename). Two writers of one target never share a
    temporary, and a later run can tell a dead process's leftovers (`remove_leftovers`) from a live one's.
  * Renames that never clobber (`rename_noreplace`) and that swap two names at once (`rename_exchange`).
  * Signals held back while a commit runs (`interrupts_held`): SIGINT by default, SIGTERM too where a half-done
    commit would lose the old output and the new one.
  * A lock whose file names its holder (`HolderLock`): pid, host, start time and command, for the refusal to quote.
  * A written file's sha256 (`sha256_file`): what a clip's record, a bundle's files and a timeline say of their bytes,
    so a reader can tell its file from another one put under the same name.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..parallel.leftovers import HOST as _HOST, alive as _alive

TEMP_SUFFIX = ".partial"
# .<target name>.<host>-<pid>-<token>.partial
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-(?P<token>[0-9a-f]{8})\.partial$")


class OutputError(RuntimeError):
    """A target that cannot be written (one line: the file, what happened, what to do). Nothing was left behind."""


class OutputRefused(OutputError, UserError):
    """A preflight refusal, before any model loaded: the user's to fix (another path, room on the disk), so a
    UserError (exit 2, as for any bad input) that `except OutputError` still catches."""


# ----------------------------------------------------------------------------------------------------------------------
# Temporary names, and the leftovers of killed runs


_LIVE: set[Path] = set()  # this process's temporary files not yet committed or removed
_LIVE_LOCK = threading.Lock()


def temp_path(target: Path) -> Path:
    """A fresh temporary name for `target` in its folder, registered so an interrupt can remove it."""
    target = Path(target)
    path = target.with_name(f".{target.name}.{_HOST}-{os.getpid()}-{secrets.token_hex(4)}{TEMP_SUFFIX}")
    with _LIVE_LOCK:
        _LIVE.add(path)
    return path


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def discard(path: Path) -> None:
    """Remove a temporary file (if it exists) and forget it."""
    try:
        os.unlink(path)
    except OSError:
        if os.path.lexists(path):  # a read-only filesystem answers EROFS even for a file that is not there
            raise
    forget(path)


def forget(path: Path) -> None:
    """Stop tracking a temporary name: it was committed, or its owner removes it."""
    with _LIVE_LOCK:
        _LIVE.discard(Path(path))


def remove_own_temps() -> list[Path]:
    """Remove every temporary file this process still has (called on the way out of an interrupt)."""
    with _LIVE_LOCK:
        paths = sorted(_LIVE)
        _LIVE.clear()
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink(missing_ok=True)
    return paths


def remove_leftovers(folder: Path) -> list[Path]:
    """Remove the temporary files and folders that runs on this host left in `folder` when they were killed (their
    process is gone). A live process's, another host's, and anything not named like ours are left alone."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_NAME.match(entry.name)
        if m is None or m["host"] != _HOST or int(m["pid"]) == os.getpid() or _alive(int(m["pid"])):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


# ----------------------------------------------------------------------------------------------------------------------
# Renames that never clobber, or swap


RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
AT_FDCWD = -100
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_renameat2 = getattr(_libc, "renameat2", None)


def _rename2(src: Path, dst: Path, flags: int) -> int:
    """renameat2(src, dst, flags): 0, or the errno (ENOSYS without renameat2 in libc)."""
    if _renameat2 is None:
        return errno.ENOSYS
    if _renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) == 0:
        return 0
    return ctypes.get_errno()


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename `src` onto `dst` only if `dst` does not exist (FileExistsError otherwise), atomically.

    renameat2(RENAME_NOREPLACE) on Linux; where the filesystem or libc lacks it, a hard link (which fails if `dst`
    exists) and an unlink of `src`: the same guarantee, with a moment where both names exist (a folder: a plain rename
    after a check)."""
    err = _rename2(src, dst, RENAME_NOREPLACE)
    if err == 0:
        return
    if err == errno.EEXIST:
        raise FileExistsError(err, os.strerror(err), str(dst))
    if err not in _UNSUPPORTED:
        raise OSError(err, os.strerror(err), str(dst))
    if os.path.isdir(src) and not os.path.islink(src):
        # No hard links to folders; a plain rename fails onto a non-empty folder (ENOTEMPTY) or a file, so all it can
        # replace is an empty folder that appeared in the moment since the check.
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
        os.rename(src, dst)
        return
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP) and not os.path.lexists(dst):
            raise OutputError(f"{dst}: this filesystem supports neither renameat2(RENAME_NOREPLACE) nor hard links, "
                              "so h3trt cannot write it without risking another run's file; write to another "
                              "filesystem, or pass --overwrite.") from None
        raise
    os.unlink(src)


def rename_exchange(a: Path, b: Path) -> bool:
    """Swap the names `a` and `b` in one atomic step (renameat2 RENAME_EXCHANGE: there is no moment when either name
    is missing). False where the filesystem or libc cannot; the caller then renames in two steps."""
    err = _rename2(a, b, RENAME_EXCHANGE)
    if err in _UNSUPPORTED:
        return False
    if err != 0:
        raise OSError(err, os.strerror(err), str(b))
    return True


# ----------------------------------------------------------------------------------------------------------------------
# Signals held back over a commit


class InterruptedAfterCommit(KeyboardInterrupt):
    """Ctrl-C arrived during a commit, which finished first: `targets` were written."""

    def __init__(self, targets: list[Path]):
        super().__init__()
        self.targets = targets


@contextlib.contextmanager
def interrupts_held(signums: tuple[int, ...] = (signal.SIGINT,)):
    """Hold back `signums` (Ctrl-C by default) for the block: each that arrives is appended to the yielded list
    instead of acting, and the handlers are restored after it, for the caller to act on what came. Only the main thread
    receives signals; elsewhere this holds nothing back."""
    pending: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in signums}
    try:
        yield pending
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


# ----------------------------------------------------------------------------------------------------------------------
# A lock that names its holder


class LockHeld(Exception):
    """Another process holds the lock; `holder` says which (pid, host, start time, command)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


HOLDER_WAIT_S = 0.2  # a holder writes its name right after it takes the lock: wait that long to read it


@dataclass
class HolderLock:
    """An exclusive flock on `path` while held, the file's content naming the holder (pid, host, start time, command).
    The lock dies with its process, so a killed holder never blocks the next. `remove`: the file is deleted on release
    (a taker checks that the file it locked is still the one at `path`, so the deletion cannot split the lock);
    otherwise it stays, empty. Busy: LockHeld; the file cannot be made: OSError."""

    path: Path
    remove: bool = False
    _fd: int | None = None

    def __enter__(self) -> HolderLock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise LockHeld(holder) from None
            except OSError:
                os.close(fd)
                raise
            if not self.remove or _same_file(fd, self.path):
                break
            os.close(fd)  # its holder deleted it as we opened it: lock the file now at `path`
        holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "command": " ".join(["h3trt", *sys.argv[1:]])[:1000]})
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if self.remove:
                os.unlink(self.path)
            else:
                os.ftruncate(self._fd, 0)
        os.close(self._fd)  # releases the flock
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev)


def _read_holder(fd: int) -> str:
    """'pid P on HOST, started T: COMMAND' from a held lock file."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        try:
            h = json.loads(text)
            return f"pid {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
        except (ValueError, KeyError, TypeError):
            if time.monotonic() > deadline:
                return "a process that is just starting"
            time.sleep(0.01)
