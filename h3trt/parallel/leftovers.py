"""Scratch folders that name their owner, so that what a killed process left can be swept without touching a live
one's: `$TMPDIR/<prefix><host>-<pid>-<random>` (the rank groups' rendezvous folders, `h3trt-launch-`; object
storage's scratch, `h3trt-scratch-`). A folder is removed only when it is this host's and its process is gone, as
engines/atomic.py `remove_leftovers` does for `.partial` files; folders from before the owner was named (no host and
pid) only when empty and a day old."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path


HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:64] or "host"  # this host, as our names carry it


def alive(pid: int) -> bool:
    """Whether process `pid` on this host runs (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


LAUNCH_PREFIX = "h3trt-launch-"  # a rank group's rendezvous store and error notes (parallel/launch.py)
SCRATCH_PREFIX = "h3trt-scratch-"  # object storage's unpublished files (server/storage.py)
UNNAMED_AGE_S = 86400.0  # an empty folder of ours without an owner in its name is old news after a day


def owned_temp_dir(prefix: str) -> Path:
    """A fresh folder `$TMPDIR/<prefix><host>-<pid>-<random>` for this process."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{HOST}-{os.getpid()}-"))


def sweep_temp_dirs(prefix: str, root: Path | None = None, now: float | None = None) -> list[Path]:
    """Remove the `prefix` folders under `root` ($TMPDIR) whose owner process on this host is gone (module doc)."""
    root = Path(root or tempfile.gettempdir())
    owned = re.compile(rf"^{re.escape(prefix)}(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-[A-Za-z0-9_]+$")
    now = now or time.time()
    removed = []
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return removed
    for entry in entries:
        m = owned.match(entry.name)
        try:
            if m is not None:
                if m["host"] != HOST or int(m["pid"]) == os.getpid() or alive(int(m["pid"])):
                    continue
                shutil.rmtree(entry.path)
            elif not any(os.scandir(entry.path)) and now - entry.stat().st_mtime > UNNAMED_AGE_S:
                os.rmdir(entry.path)
            else:
                continue
        except OSError:  # another sweeper, or not ours to remove: left alone
            continue
        removed.append(Path(entry.path))
    return removed
