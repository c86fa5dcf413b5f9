"""`h3trt serve`'s settings: one frozen record, validated once, before anything loads (no web framework imported here,
so the CLI can build its parser without the [serve] extra)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..media.output_files import DEFAULT_CRF

DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 64
DEFAULT_RETENTION = "24h"
DEFAULT_DRAIN_TIMEOUT_S = 600.0
DEFAULT_UPLOAD_MB = 64.0
API_KEY_ENV = "H3TRT_API_KEY"
LOOPBACK = "127.0.0.1"
# Endpoints behind the API key unless named in --open: Prometheus scrapers often send no key (metrics), and a trusted
# network may want the browsable schema (docs: /docs and /openapi.json). /health, /ready and the page are always open.
OPENABLE = ("metrics", "docs")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, flag: str) -> float:
    """'90s', '30m', '24h', '7d' (or plain seconds) -> seconds, > 0."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not match:
        raise UserError(f"{flag} {text!r} is not a duration; write e.g. 90s, 30m, 24h or 7d.")
    seconds = float(match[1]) * _UNITS[match[2] or "s"]
    if not seconds > 0 or not math.isfinite(seconds):
        raise UserError(f"{flag} {text!r} must be a positive duration, e.g. 24h.")
    return seconds


@dataclass(frozen=True)
class ServeOptions:
    """How the server listens, stores and bounds its work."""

    data_dir: Path  # jobs.sqlite3, uploads/, clips/
    host: str = LOOPBACK
    port: int = DEFAULT_PORT
    api_key: str | None = None  # Bearer token; None: no auth, loopback only
    max_queue: int = DEFAULT_MAX_QUEUE  # queued jobs at most (429 beyond)
    retention_s: float = 86400.0  # a finished job's files and row live this long after it ends
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # SIGTERM: running jobs may take this long to finish
    max_body_bytes: int = int(DEFAULT_UPLOAD_MB * 1e6)  # a request body, uploads included
    crf: int = DEFAULT_CRF
    open_endpoints: tuple[str, ...] = ()  # of OPENABLE: served without the key
    max_batch: int = 1  # queued jobs of one batch key a replica group claims at once and denoises together

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port {self.port} is not a TCP port (0..65535; 0 picks a free one).")
        if self.max_queue < 1:
            raise UserError(f"--max-queue must be at least 1, got {self.max_queue}.")
        if not (self.drain_timeout_s >= 0 and math.isfinite(self.drain_timeout_s)):
            raise UserError(f"--drain-timeout must be a finite number of seconds >= 0, got {self.drain_timeout_s}.")
        if self.max_body_bytes < 1:
            raise UserError("--max-upload-mb must be positive.")
        if not 0 <= self.crf <= 51:
            raise UserError(f"--crf {self.crf} is outside H.264's range 0..51.")
        if self.max_batch < 1:
            raise UserError(f"--max-batch must be at least 1, got {self.max_batch}.")
        unknown = sorted(set(self.open_endpoints) - set(OPENABLE))
        if unknown:
            raise UserError(f"--open {unknown[0]} is not an endpoint that can be opened; pick from {list(OPENABLE)}.")
        if self.api_key is not None and not self.api_key.strip():
            raise UserError("--api-key (or $H3TRT_API_KEY) is empty; pass a secret, or leave it out to serve on "
                            "127.0.0.1 only.")
        if self.api_key is None and self.host != LOOPBACK:
            raise UserError(f"--host {self.host} would expose the server without authentication; pass --api-key (or "
                            f"set ${API_KEY_ENV}), or leave --host out to serve on {LOOPBACK} only.")

    @classmethod
    def from_args(cls, args) -> "ServeOptions":
        key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
        return cls(Path(args.data_dir), args.host or LOOPBACK, args.port, key, args.max_queue,
                   parse_duration(args.retention, "--retention"), args.drain_timeout,
                   int(args.max_upload_mb * 1e6) if math.isfinite(args.max_upload_mb) else 0, args.crf,
                   tuple(dict.fromkeys(args.open or ())), args.max_batch)
