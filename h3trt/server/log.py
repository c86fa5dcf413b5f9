"""A server's log: one JSON line per event (structured: a log shipper reads it as is), and the plain lines for the
person at the terminal, written the same way. `h3trt serve` and a fleet's replicas write theirs to stderr
(`SERVER_LOG`); scripts/sim_fleet.py gives each of its processes a file (`JsonLog(path)`), which its audit reads.

Each line and its newline go out in one write under a lock, then flushed: print() writes them in two calls, and two
threads' events were glued onto one line between them (the HTTP threads, the workers', the drain's share stderr).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

_STDERR_LOCK = threading.Lock()  # one writer at a time on stderr, whichever log writes there


class JsonLog:
    """Call it with an event's name and fields: `log("queued", job=job_id)`. On stderr as it is at each write (a test
    may swap it), or appended to `path`."""

    def __init__(self, path: Path | None = None):
        self._file = None if path is None else open(path, "a")
        self._lock = _STDERR_LOCK if path is None else threading.Lock()

    def __call__(self, event: str, **fields) -> None:
        self.say(json.dumps({"ts": round(time.time(), 3), "event": event, **fields}, default=str))

    def say(self, text: str) -> None:
        """A line as it is (for the person at the terminal), whole, between the events."""
        with self._lock:
            stream = self._file or sys.stderr
            stream.write(text + "\n")
            stream.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


SERVER_LOG = JsonLog()  # `h3trt serve`'s and a fleet's, on stderr
