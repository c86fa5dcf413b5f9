"""The private folder a serving process copies a bundle's compiled code into and points Inductor at:
`$TMPDIR/h3trt-engine-cache-<host>-<pid>-<start>-<random>`, named for the process that owns it.

Removed on a normal exit (atexit) and on SIGTERM (a launcher stopping its ranks, `kill`): SIGTERM's default action
ends the process without running atexit, so while that default stands a handler removes the folder first and then
dies of the same signal, exit status unchanged. SIGKILL (or a power loss) leaves it behind; the next load on this host
removes every such folder whose owner is gone, as media/output_files.py `remove_leftovers` does for `.partial` files.

An owner is gone when no process has its pid, or when the process that has it started at another time (the pid was
reused): `<start>` is the owner's start time, field 22 of /proc/<pid>/stat (clock ticks since boot; 0 where /proc
cannot be read, and then the pid alone decides).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
from pathlib import Path

from .atomic import interrupts_held

PREFIX = "h3trt-engine-cache-"
HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:64] or "host"
# h3trt-engine-cache-<host>-<pid>-<start>-<mkdtemp's random part: letters, digits, underscores>
_NAME = re.compile(r"^h3trt-engine-cache-(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-(?P<start>\d+)-[A-Za-z0-9_]+$")

_OWN: list[tuple[int, Path]] = []  # (owner pid, folder): a forked child must not remove its parent's folders


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 on (the state first; the start time is [19]), or None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2, the command name, is in parentheses and may hold spaces and ')': the rest follows the last ')'.
    return stat.rpartition(")")[2].split()


def process_start(pid: int) -> int:
    """When process `pid` started, in clock ticks since boot; 0 where /proc cannot tell."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else 0


def owner_gone(pid: int, start: int) -> bool:
    """Whether the process that made a folder named with `pid` and `start` has ended: no process has the pid, it is a
    zombie (ended, not yet reaped), or the process that has it now started at another time."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process: its stat decides below
        pass
    fields = _stat_fields(pid)
    if fields is None:  # no /proc: a live pid keeps its folder
        return False
    return fields[0] == "Z" or (start != 0 and int(fields[19]) != start)


def make_private_cache() -> Path:
    """A new folder in $TMPDIR owned by this process, removed when it exits or is sent SIGTERM. Made and registered
    for removal with Ctrl-C and SIGTERM held back: one arriving in between (the CLI raises KeyboardInterrupt for
    both) left the folder, empty, until the next load; it acts once the folder is registered."""
    pid = os.getpid()
    with interrupts_held((signal.SIGINT, signal.SIGTERM)) as pending:
        path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{HOST}-{pid}-{process_start(pid)}-"))
        _OWN.append((pid, path))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    # Signal handlers belong to the main thread; elsewhere a SIGTERM leaves the folder to the next load.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _remove_then_die)
    for signum in pending:
        signal.raise_signal(signum)
    return path


def remove_leftover_caches(folder: Path | None = None) -> list[Path]:
    """Remove this user's folders in `folder` ($TMPDIR by default) that processes on this host left when they were
    killed (their owner is gone). A live owner's folder, another host's or user's, and anything not named like ours
    are left alone."""
    folder = Path(tempfile.gettempdir()) if folder is None else folder
    removed = []
    for path in folder.glob(f"{PREFIX}{HOST}-*"):  # none when the folder is missing or unreadable
        m = _NAME.match(path.name)
        try:
            info = path.lstat()
        except OSError:  # removed meanwhile (another load's sweep)
            continue
        if m is None or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        if owner_gone(int(m["pid"]), int(m["start"])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _remove_then_die(signum, frame) -> None:
    for pid, path in _OWN:
        if pid == os.getpid():
            shutil.rmtree(path, ignore_errors=True)
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)  # the default action, on this thread: the process ends as SIGTERM would have ended it
