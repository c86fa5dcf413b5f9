"""The API side of a server, behind its HTTP routes (server/app.py), none of it on the event loop; the same for
`h3trt serve` on one node and a fleet's ingress (h3trt/fleet/):

  - admit a job: its fields mapped onto the one request schema (runtime/requests.py, the one `run --requests`
    reads), its uploads saved to storage, every input read and checked (runtime/request.py `prepare`) and what the
    model can serve checked (Entry.admit), then stored queued (server/store.py); a bad request never reaches the queue
  - read jobs and their content, request cancels (a running job's worker sees them in the store)
  - keep storage true to the store: a finished job's MP4, record and thumbnail expire with its row (--retention)

The worker side (the store-fed JobQueue, events -> rows, recovery) is server/queue.py.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..models.packing import DEFAULT_DURATION
from ..models.text_encoder import check_text_encoder_files
from ..runtime.entry import Entry
from ..runtime.profiles import REQUEST_KEYS, SPARSE_KEYS
from ..runtime.request import Names, check_prompt_tokens, prepare
from ..runtime.requests import KEYS, RequestDefaults, parse_object
from .log import SERVER_LOG
from .metrics import Groups, Metrics
from .options import ServeOptions
from .store import JobRow, JobStore, is_disk_full
from .storage import Storage, clip_key, job_keys, thumbnail_key, uploads_key

SERVED_MODEL = "minimax-h3"
# multipart sends every field as text: these are parsed as JSON numbers
FORM_NUMBERS = {"seed": int, "steps": int, "guidance": float, "video_shift": float, "audio_shift": float,
                "duration": float, "cache_threshold": float, "cache_warmup": int, "cache_max_skip": int,
                "sparse_attention": float, "sparse_dense_steps": int, "sparse_min_seq": int}
FILE_FIELDS = {"input_reference": "image", "last_image": "last_image", "refs": "refs"}
OPENAI_FIELDS = ("prompt", "model", "seconds", "size", "input_reference")
API_NAMES = {"duration": "seconds", "resolution": "size", "width": "size", "height": "size", "image": "input_reference"}
# The request's fields as a client sends them, for the errors of the one schema and `prepare` (not the CLI's flags)
API_WORDS = Names("prompt", "negative_prompt", "seed", "steps", "seconds", "size", "guidance", "video_shift",
                  "audio_shift", "input_reference", "last_image", "refs", "the request")
H3_FIELDS = ("task", "seed", "steps", "negative_prompt", "guidance", "video_shift", "audio_shift", "last_image",
             "refs", "profile", *REQUEST_KEYS,
             *SPARSE_KEYS)  # profile and step-cache keys: runtime/profiles.py


class ApiError(UserError):
    """A request the API refuses: the HTTP status, OpenAI's error type, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.headers = status, param, kind, headers or {}


@dataclass(frozen=True)
class Upload:
    """A file sent with a job (multipart)."""

    field: str  # input_reference, last_image or refs
    filename: str
    data: bytes


class VideoService:
    """The API side of a server (module doc): what the HTTP routes call. Built from its parts: the model that admits
    jobs (`entry`), the store, the storage, the groups /ready describes (this node's `Workers`, or a fleet's worker
    replicas) and the metrics."""

    def __init__(self, entry: Entry, options: ServeOptions, store: JobStore, storage: Storage, groups: Groups,
                 metrics: Metrics, guidance_branches: int = 1, log=None):
        self.entry, self.options, self.store, self.storage = entry, options, store, storage
        self.groups, self.metrics, self.guidance_branches = groups, metrics, guidance_branches
        self.log = log or SERVER_LOG
        self.model_id = SERVED_MODEL + ("-tiny" if entry.tiny else "")
        self.manifest_sha256 = entry.manifest.manifest_sha256 if entry.manifest is not None else None
        self.draining = threading.Event()
        self._admit = threading.Lock()  # the queue bound: count and insert as one step (per process)
        self.started = time.time()

    def defaults(self) -> RequestDefaults:
        return request_defaults(self.entry)

    def expire(self, now: float | None = None) -> list[str]:
        """Remove ended jobs past their expiry: files first, then the row."""
        gone = []
        for row in self.store.rows(expired_before=now or time.time()):
            self.storage.remove(*job_keys(row.id, row.attempts))
            self.store.remove(row.id)
            gone.append(row.id)
        if gone:
            self.log("expired", jobs=gone)
        return gone

    # --- admitting a job --------------------------------------------------------------------------------------------

    def create(self, fields: dict, uploads: list[Upload], multipart: bool) -> JobRow:
        if self.draining.is_set():
            raise ApiError(503, "The server is shutting down and takes no new jobs; retry on another replica or "
                                "after it restarts.", kind="server_error", headers={"Retry-After": "30"})
        job_id = f"video_{uuid.uuid4().hex}"
        folder = self.storage.scratch / uploads_key(job_id)  # in place, or in scratch until it is admitted
        sent: dict[Path, str] = {}  # a saved upload -> how its client knows it (its field and file name)
        try:
            schema, openai_fields = self._to_schema(fields, uploads, folder, multipart, sent)
            line = parse_object(schema, 0, folder, ("prompt",), self.defaults(), API_WORDS)
            prepared = prepare(line.request, self.entry.canvas, API_WORDS)  # every input read and checked, as `run`
            self.entry.admit(prepared)  # what a bundle serves (task, canvas, schedule)
            check_text_encoder_files(self.entry.component_root(line.request.task))
            check_prompt_tokens(self.entry.component_root(line.request.task), [
                (w, p) for w, p in (("prompt", line.request.prompt),
                                    ("negative_prompt", line.request.negative_prompt)) if p])
            if self.guidance_branches == 2 and line.request.guidance == 1.0:
                raise ApiError(400, "This server runs guidance branches on cfg=2 rank groups and needs guidance > 1 "
                                    "with a negative_prompt.", "guidance")
            with self._admit:
                queued = self.store.queued()
                if queued >= self.options.max_queue:
                    wait = self.metrics.retry_after(queued, self.groups.serving())
                    raise ApiError(429, f"The queue is full ({queued} jobs waiting, --max-queue "
                                        f"{self.options.max_queue}); retry in about {wait} s.",
                                   kind="rate_limit_exceeded", headers={"Retry-After": str(wait)})
                self.storage.publish(uploads_key(job_id))  # before its row: a worker may take it at once
                row = self.store.create(job_id, {"schema": schema, "openai": openai_fields,
                                                 "geometry": [prepared.geometry.width, prepared.geometry.height]})
        except ApiError:
            self.storage.remove(uploads_key(job_id))
            raise
        except Exception as e:
            self.storage.remove(uploads_key(job_id))
            if is_disk_full(e):  # SQLite's "database or disk is full", or an upload's ENOSPC: not the client's fault
                raise disk_full_error() from None
            if not isinstance(e, (UserError, OSError)):
                raise
            # the one schema's and prepare's messages name the field and the fix
            message, param = _as_sent(" ".join(str(e).split()), sent)
            raise ApiError(400, message, param or _param_of(e)) from None
        self.metrics.created.inc()
        self.log("queued", job=job_id, task=line.request.task, seed=line.request.seed)
        return row

    def _to_schema(self, fields: dict, uploads: list[Upload], folder: Path, multipart: bool,
                   sent: dict[Path, str]) -> tuple[dict, dict]:
        """OpenAI's fields and H3's extras -> the one request schema (runtime/requests.py), uploads saved (`sent`:
        each saved file's path -> its field and the client's file name)."""
        known = set(OPENAI_FIELDS) | set(H3_FIELDS)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ApiError(400, f"unknown field(s) {unknown}; OpenAI's are {list(OPENAI_FIELDS)} and H3's own (extra "
                                f"fields) {list(H3_FIELDS)}.", unknown[0])
        schema: dict = {}
        if multipart:
            fields = {k: _form_value(k, v) for k, v in fields.items()}
        for key in ("prompt", "task", "seed", "steps", "negative_prompt", "guidance", "video_shift", "audio_shift",
                    "profile", *REQUEST_KEYS, *SPARSE_KEYS):
            if key in fields:
                schema[key] = fields[key]
        model = fields.get("model")
        if model is not None and model not in (self.model_id, SERVED_MODEL):
            raise ApiError(400, f"model {model!r} is not served here; this server serves {self.model_id!r} (or leave "
                                "model out).", "model")
        if fields.get("seconds") is not None:
            schema["duration"] = _seconds(fields["seconds"])
        if fields.get("size") is not None:
            schema["resolution"] = fields["size"]
        for name in ("input_reference", "last_image", "refs"):
            if name in fields and fields[name] is not None:
                value = fields[name]
                if name == "input_reference" and isinstance(value, dict):
                    raise ApiError(400, "input_reference as a file_id or image_url is not supported: upload the image "
                                        "as a multipart file field input_reference.", name)
                raise ApiError(400, f"{name} must be uploaded as a file (multipart/form-data), not sent as a value.",
                               name)
        saved: dict[str, list[str]] = {}
        for i, upload in enumerate(uploads):
            suffix = Path(upload.filename or "").suffix.lower()
            if not suffix or not suffix[1:].isalnum() or len(suffix) > 6:
                raise ApiError(400, f"{upload.field}: the file name {upload.filename!r} has no extension; name it "
                                    "with its type (.png, .jpg, .webp, .wav, .mp3, .mp4, ...).", upload.field)
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{i:02d}-{upload.field}{suffix}"
            path.write_bytes(upload.data)
            sent[path] = f"{upload.field} {upload.filename!r}"
            saved.setdefault(upload.field, []).append(path.name)
        for field, key in (("input_reference", "image"), ("last_image", "last_image")):
            if field in saved:
                if len(saved[field]) > 1:
                    raise ApiError(400, f"{field} takes one file, got {len(saved[field])}.", field)
                schema[key] = saved[field][0]
        if "refs" in saved:
            schema["refs"] = saved["refs"]
        # As the job's GET echoes them: text (OpenAI's types), whatever JSON type they came as.
        openai_fields = {k: str(fields[k]) for k in ("model", "size") if fields.get(k) is not None}
        if "duration" in schema:
            seconds = fields["seconds"]
            openai_fields["seconds"] = seconds.strip() if isinstance(seconds, str) else f"{schema['duration']:g}"
        return schema, openai_fields

    # --- what the API reads -----------------------------------------------------------------------------------------

    def get(self, job_id: str) -> JobRow:
        row = self.store.get(job_id)
        if row is None or row.deleted:
            raise ApiError(404, f"No video job {job_id!r} here (it never existed, was deleted, or expired).",
                           "video_id", kind="not_found_error")
        return row

    def content(self, job_id: str, variant: str) -> str:
        """The storage key of a completed job's MP4 (video) or first frame (thumbnail): the files of the claim its
        row names (storage.py: another claim's files, a late writer's, are never served)."""
        row = self.get(job_id)
        if variant not in ("video", "thumbnail"):
            raise ApiError(400, f"variant {variant!r} is not offered; use video or thumbnail.", "variant")
        if row.status != "completed":
            raise ApiError(409, f"Video job {job_id} is {row.status}; its content exists once it is completed "
                                f"(poll GET /v1/videos/{job_id}).", "video_id", kind="invalid_request_error")
        key = (clip_key if variant == "video" else thumbnail_key)(job_id, row.clip_attempt)
        if not self.storage.exists(key):
            raise ApiError(404, f"The {variant} of {job_id} is gone (expired or removed).", "video_id",
                           kind="not_found_error")
        return key

    def cancel(self, job_id: str, delete: bool = False) -> JobRow | None:
        """POST /cancel and DELETE: a queued job ends now; a running one stops at its next denoise step (its files
        and, for DELETE, its row go when its worker confirms); an ended job is only deleted."""
        row = self.get(job_id)
        if row.status == "queued":
            self.store.end(job_id, "cancelled", self.options.retention_s, error=("cancelled", "cancelled by request"))
            self.storage.remove(*job_keys(job_id, row.attempts))
        elif row.status == "in_progress":
            self.store.request_cancel(job_id, delete_after=delete)
            self.log("cancel_requested", job=job_id)
            return self.store.get(job_id) if not delete else None
        if delete:
            self.storage.remove(*job_keys(job_id, row.attempts))
            self.store.remove(job_id)
            self.log("deleted", job=job_id)
            return None
        return self.store.get(job_id)


def disk_full_error() -> ApiError:
    """507 in OpenAI's envelope: the server's data disk is full; nothing of the request was kept."""
    return ApiError(507, "The server's data disk is full: the job was not stored. Retry later (the server resumes by "
                         "itself once its operator frees space).", kind="server_error", headers={"Retry-After": "60"})


def request_defaults(entry: Entry) -> RequestDefaults:
    """What a request leaves out (the one schema's defaults for this model): the API side admits with them, the
    worker side reads the stored request with them."""
    return RequestDefaults(steps=entry.default_steps, duration=DEFAULT_DURATION, sparse=entry.default_sparse)


def _seconds(value) -> float:
    """`seconds` as a duration: OpenAI's string ("5"), or a JSON number (5) as clients also send it; finite."""
    duration = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        duration = float(value)
    elif isinstance(value, str):
        try:
            duration = float(value)
        except ValueError:
            pass
    if duration is None or not math.isfinite(duration):
        raise ApiError(400, f"seconds must be a finite number of seconds, as a string such as \"5\" (or a number), "
                            f"got {json.dumps(value)}.", "seconds")
    return duration


def _as_sent(message: str, sent: dict[Path, str]) -> tuple[str, str | None]:
    """An error about a saved upload in its client's words: its field and file name, not the server's path (absolute
    or not); and that field."""
    param = None
    for path, name in sent.items():
        for text in dict.fromkeys((str(path.resolve()), str(path))):
            if text in message:
                message, param = message.replace(text, name), param or name.split(" ", 1)[0]
    return message, param


def _form_value(key: str, value):
    """A multipart field's text as the schema's type: numbers for numeric fields (so the schema can say what is
    wrong with "1.5" for seed), the text otherwise."""
    if key in FORM_NUMBERS and isinstance(value, str):
        try:
            number = json.loads(value)
        except ValueError:
            return value
        return number if isinstance(number, (int, float)) and not isinstance(number, bool) else value
    return value


def _param_of(error: Exception) -> str | None:
    """The request field an error is about: its own `field` when it carries one, else the field its message names
    first (the schema's and prepare's messages lead with the field they refuse), in the API's names."""
    field = getattr(error, "field", None)
    if field is None:
        text, best = str(error), None
        for key in (*KEYS, "duration", "resolution", "width", "height"):
            match = re.search(rf"(?<![\w-])(--)?{re.escape(key).replace('_', '[-_]')}(?![\w-])", text)
            if key != "id" and match and (best is None or match.start() < best[0]):
                best = (match.start(), key)
        field = best[1] if best else None
    return API_NAMES.get(field, field)
