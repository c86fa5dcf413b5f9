"""The API side of a server, behind its HTTP routes (server/app.py), none of it on the event loop; the same for
`h3trt serve` on one node and a fleet's ingress (h3trt/fleet/):

  - admit a job: its fields mapped onto the one request schema (request/fields.py, the one `run --requests` reads),
    its uploads saved to storage, the request admitted as every front door admits one (jobs/admission.py: every
    input read and checked, what the model serves), then stored queued (server/store.py); a bad request never
    reaches the queue, and its 400 names the field the error is about (UserError.field, in the API's name)
  - read jobs and their content, request cancels (a running job's worker sees them in the store)
  - keep storage true to the store: a finished job's MP4, record and thumbnail expire with its row (--retention)
  - a job row's request: what the API side stores when it admits a job (`row_request`), and the one reading of it
    (`stored_request`, by the worker side, server/queue.py: "A job row's request" below)

The worker side (the store-fed JobQueue, events -> rows, recovery) is server/queue.py.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

from fastapi import Depends
from fastapi import Request as HTTPRequest

from ..adapters.catalog import AdapterCatalog
from ..adapters.use import AdapterUse
from ..errors import UserError
from ..jobs.admission import admit
from ..jobs.model_source import Entry
from ..models.packing import DEFAULT_DURATION
from ..request.fields import API_WORDS, H3_FIELDS, OPENAI_FIELDS, UPLOADS, api_name
from ..request.parse import RequestDefaults, form_value, parse_object, schema_values
from ..request.request import Admitted, BatchKey, Request, ScheduleChoice
from .log import SERVER_LOG
from .metrics import Groups, Metrics
from .options import ServeOptions
from .storage import Storage, clip_key, job_keys, thumbnail_key, uploads_key
from .store import JobRow, JobStatus, JobStore, is_disk_full

SERVED_MODEL = "minimax-h3"


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
    replicas), the metrics and the set of LoRA adapters jobs may name (`adapters`; None: none, for good); `fleet`: a
    fleet's ingress (which serves the adapters it was deployed with), else one node's API."""

    def __init__(self, entry: Entry, options: ServeOptions, store: JobStore, storage: Storage, groups: Groups,
                 metrics: Metrics, guidance_branches: int = 1, log=None, adapters: AdapterCatalog | None = None,
                 fleet: bool = False):
        self.entry, self.options, self.store, self.storage = entry, options, store, storage
        self.groups, self.metrics, self.guidance_branches = groups, metrics, guidance_branches
        self.log = log or SERVER_LOG
        self.model_id = SERVED_MODEL + ("-tiny" if entry.model.tiny else "")
        self.manifest_sha256 = entry.model.manifest.manifest_sha256 if entry.model.manifest is not None else None
        self.draining = threading.Event()
        self._admit = threading.Lock()  # the queue bound: count and insert as one step (per process)
        self.started = time.time()
        self.adapters, self.fleet = adapters, fleet

    def defaults(self) -> RequestDefaults:
        return request_defaults(self.entry, self.adapters)

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
            request = parse_sent(schema, folder, self.defaults())
            # Admitted as every front door admits a request (jobs/admission.py), in the API's words; its inputs are
            # read here and again by the worker that runs it (run_work: a rank rebuilds the decoded inputs it needs).
            prepared = admit(self.entry, request, API_WORDS, guidance_branches=self.guidance_branches,
                             adapters=self.adapters)
            with self._admit:
                queued = self.store.queued()
                if queued >= self.options.max_queue:
                    wait = self.metrics.retry_after(queued, self.groups.serving())
                    raise ApiError(429, f"The queue is full ({queued} jobs waiting, --max-queue "
                                        f"{self.options.max_queue}); retry in about {wait} s.",
                                   kind="rate_limit_exceeded", headers={"Retry-After": str(wait)})
                self.storage.publish(uploads_key(job_id))  # before its row: a worker may take it at once
                # The request as admission resolved it (its adapters' files and hashes, its schedule): the job runs
                # with those whatever the set becomes before a worker takes it (row_request).
                admitted = Admitted(prepared.request, prepared.geometry)
                key = admitted.batch_key  # the claim matches it in SQL: jobs of one key share a batched denoise
                row = self.store.create(job_id, row_request(admitted, schema, openai_fields, folder),
                                        batch_key=key.digest() if key is not None else None)
        except ApiError:
            self.storage.remove(uploads_key(job_id))
            raise
        except Exception as e:
            self.storage.remove(uploads_key(job_id))
            if is_disk_full(e):  # SQLite's "database or disk is full", or an upload's ENOSPC: not the client's fault
                raise disk_full_error() from None
            if not isinstance(e, (UserError, OSError)):
                raise
            # the one schema's and admission's messages name the field and the fix; the error carries the field
            field = getattr(e, "field", None)  # an OSError carries none
            raise ApiError(400, _as_sent(" ".join(str(e).split()), sent), api_name(field) if field else None) from None
        self.metrics.created.inc()
        self.log("queued", job=job_id, task=request.task, seed=request.inputs.seed)
        return row

    def _to_schema(self, fields: dict, uploads: list[Upload], folder: Path, multipart: bool,
                   sent: dict[Path, str]) -> tuple[dict, dict]:
        """OpenAI's fields and H3's extras -> the one request schema (request/fields.py: its table says each field's
        key, API name and type), uploads saved (`sent`: each saved file's path -> its field and the client's file
        name); and OpenAI's fields as the job's GET echoes them."""
        unknown = sorted(set(fields) - set(OPENAI_FIELDS) - set(H3_FIELDS))
        if unknown:
            raise ApiError(400, f"unknown field(s) {unknown}; OpenAI's are {list(OPENAI_FIELDS)} and H3's own (extra "
                                f"fields) {list(H3_FIELDS)}.", unknown[0])
        if multipart:
            fields = {k: form_value(k, v) for k, v in fields.items()}
        model = fields.get("model")
        if model is not None and model not in (self.model_id, SERVED_MODEL):
            raise ApiError(400, f"model {model!r} is not served here; this server serves {self.model_id!r} (or leave "
                                "model out).", "model")
        schema = schema_values(fields)
        for name in UPLOADS:
            if fields.get(name) is not None:
                if name == "input_reference" and isinstance(fields[name], dict):
                    raise ApiError(400, "input_reference as a file_id or image_url is not supported: upload the image "
                                        "as a multipart file field input_reference.", name)
                raise ApiError(400, f"{name} must be uploaded as a file (multipart/form-data), not sent as a value.",
                               name)
        schema.update(_save_uploads(uploads, folder, sent))
        # As the job's GET echoes them: text (OpenAI's types), whatever JSON type they came as.
        openai_fields = {k: str(fields[k]) for k in ("model", "size") if fields.get(k) is not None}
        if "duration" in schema:
            seconds = fields["seconds"]
            openai_fields["seconds"] = seconds.strip() if isinstance(seconds, str) else f"{schema['duration']:g}"
        return schema, openai_fields

    # --- the adapters: GET /v1/loras and the admin calls (server/lora_routes.py) -------------------------------------

    def loras(self) -> list[dict]:
        """The current set of adapters, as GET /v1/loras lists them."""
        return [info.to_json() for info in self.adapters.infos()] if self.adapters is not None else []

    def skipped_loras(self) -> list[dict]:
        """The adapters the server started without, and why (GET /v1/loras's `skipped`)."""
        return [s.to_json() for s in self.adapters.skipped()] if self.adapters is not None else []

    def load_lora(self, fields: dict) -> dict:
        """POST /v1/loras {"name", "file", "scale"}: a file of --lora-dir joins the set once read and checked whole
        (on this worker thread); a 400 names the field at fault."""
        unknown = sorted(set(fields) - {"name", "file", "scale"})
        if unknown:
            raise ApiError(400, f"unknown field(s) {unknown}; POST /v1/loras takes name, file and scale.", unknown[0])
        missing = [key for key in ("name", "file") if key not in fields]
        if missing:
            raise ApiError(400, f"{missing[0]} is required: POST /v1/loras takes {{\"name\": ..., \"file\": a "
                                ".safetensors in the server's --lora-dir, \"scale\": its default strength}}.",
                           missing[0])
        if self.entry.model.adapters_refusal is not None:
            raise ApiError(400, f"file: {self.entry.model.adapters_refusal}", "file")
        if self.adapters is None or self.adapters.folder is None:
            reason = ("a fleet (h3trt serve --ray) loads no adapter while it serves: it serves those it was deployed "
                      "with; deploy it again with --adapter NAME=FILE[:SCALE] to add one" if self.fleet else
                      "this server loads adapters only from its --lora-dir, and it was started without one; start "
                      "it with --lora-dir DIR")
            raise ApiError(400, f"file: {reason}", "file")
        try:
            info = self.adapters.load(fields["name"], fields["file"], fields.get("scale", 1.0))
        except UserError as e:
            raise ApiError(400, " ".join(str(e).split()), e.field) from None
        self.log("lora_loaded", name=info.name, file=info.file, sha256=info.sha256, rank=info.rank)
        return info.to_json()

    def unload_lora(self, name: str) -> None:
        """DELETE /v1/loras/{name}: the name leaves the set; jobs queued with it still run with it."""
        try:
            if self.adapters is None:
                raise KeyError(name)
            self.adapters.unload(name)
        except KeyError:
            raise ApiError(404, f"No adapter named {name!r} is loaded here (GET /v1/loras lists them).", "name",
                           kind="not_found_error") from None
        self.log("lora_unloaded", name=name)

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
        if row.status != JobStatus.COMPLETED:
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
        if row.status == JobStatus.QUEUED:
            self.store.end(job_id, "cancelled", self.options.retention_s, error=("cancelled", "cancelled by request"))
            self.storage.remove(*job_keys(job_id, row.attempts))
        elif row.status == JobStatus.IN_PROGRESS:
            self.store.request_cancel(job_id, delete_after=delete)
            self.log("cancel_requested", job=job_id)
            return self.store.get(job_id) if not delete else None
        if delete:
            self.storage.remove(*job_keys(job_id, row.attempts))
            self.store.remove(job_id)
            self.log("deleted", job=job_id)
            return None
        return self.store.get(job_id)


async def service_of(request: HTTPRequest) -> VideoService:
    """The service of the app a request reached (server/app.py create_app keeps it in app.state): what a route's
    `Service` parameter is, so the routes are module-level functions."""
    return request.app.state.service


Service = Annotated[VideoService, Depends(service_of)]


def disk_full_error() -> ApiError:
    """507 in OpenAI's envelope: the server's data disk is full; nothing of the request was kept."""
    return ApiError(507, "The server's data disk is full: the job was not stored. Retry later (the server resumes by "
                         "itself once its operator frees space).", kind="server_error", headers={"Retry-After": "60"})


def parse_sent(schema: dict, uploads: Path, defaults: RequestDefaults) -> Request:
    """A job's fields as sent (the one table's keys, request/fields.py) parsed into the `Request` they state, its
    uploads in `uploads`: once, where the job is admitted (a worker reads the admitted request its row stores)."""
    return parse_object(schema, 0, uploads, ("prompt",), defaults, API_WORDS).request


def request_defaults(entry: Entry, adapters: AdapterCatalog | None = None) -> RequestDefaults:
    """What a request leaves out (the one schema's defaults for this model): the API side admits with them, the
    worker side reads a row of before with them. `adapters`: a server's current set, whose schedules a request
    naming one of them takes (an adapter loaded while it serves included); None: the adapters it started with."""
    schedules = adapters.schedules() if adapters is not None else entry.adapters.schedules
    model = entry.model
    return RequestDefaults(steps=model.default_steps, duration=DEFAULT_DURATION, sparse=model.default_sparse,
                           adapter_schedules=schedules)


# --- a job row's request ---------------------------------------------------------------------------------------------
# What the API side stores when it admits a job (`row_request`: the admitted request's JSON, request/request.py
# `Admitted.to_json`, its uploads named relative to their folder, beside the fields as sent and OpenAI's echo), and
# the one reading of it (`stored_request`: the worker that takes the job, server/queue.py, which may be another process
# than the one that admitted it, or a later one, with the uploads fetched into another folder). Nothing is parsed
# again: the request runs as admission resolved it (its adapters' files and hashes, its schedule).
#
# A row written before the admitted request was stored (no "admitted": its fields as sent, the adapters and schedule
# admission resolved, the canvas's width and height) is read as it was then: its fields parsed with the model's
# defaults, then the stored adapters and schedule put back. A server restarted on an old jobs database runs its rows.

ADMITTED = "admitted"  # the row's key for the admitted request's JSON


def row_request(admitted: Admitted, schema: dict, openai: dict, uploads: Path) -> dict:
    """A job's stored request: the admitted request (its input files relative to `uploads`), and the fields as sent
    (`schema`, the one table's keys) and OpenAI's fields as the job's GET echoes them."""
    return {"schema": schema, "openai": openai, ADMITTED: admitted.to_json(uploads)}


def stored_request(stored: dict, uploads: Path, defaults: RequestDefaults) -> tuple[Request, BatchKey | None]:
    """The request a row stores (above), its input files in `uploads`, and its batch key (BatchKey.of; None for a
    row of before, which runs alone); `defaults` read a row of before only."""
    if ADMITTED in stored:
        admitted = Admitted.from_json(stored[ADMITTED], uploads)
        return admitted.request, admitted.batch_key
    request = parse_sent(stored["schema"], uploads, defaults)
    if stored.get("adapters"):  # as admission resolved them: the files and hashes of then, not the set now
        request = replace(request, adapters=tuple(AdapterUse.from_json(a) for a in stored["adapters"]))
    if stored.get("schedule"):  # and the schedule they gave it then
        request = replace(request, schedule=ScheduleChoice.from_json(stored["schedule"]))
    return request, None


def shown(stored: dict, default_steps: int) -> tuple[int, int, int, list[AdapterUse]]:
    """What a job's GET shows of its stored request before it has a record: its canvas's width and height, its steps
    and its resolved adapters (a row of before: what it stored of them, else the steps as sent or the default)."""
    if ADMITTED in stored:
        data = stored[ADMITTED]
        geometry, request = data["geometry"], data["request"]
        uses = [AdapterUse.from_json(a) for a in request["adapters"]]  # resolved by a server's set, or by name only
        return (geometry["width"], geometry["height"], request["schedule"]["steps"],
                uses if all(u.sha256 for u in uses) else [])
    width, height = stored.get("geometry", [0, 0])
    steps = stored.get("schedule", {}).get("steps", stored["schema"].get("steps", default_steps))
    return width, height, int(steps), [AdapterUse.from_json(a) for a in stored.get("adapters", ())]


def _as_sent(message: str, sent: dict[Path, str]) -> str:
    """An error about a saved upload in its client's words: its field and file name, not the server's path (absolute
    or not)."""
    for path, name in sent.items():
        for text in dict.fromkeys((str(path.resolve()), str(path))):
            message = message.replace(text, name)
    return message


def _save_uploads(uploads: list[Upload], folder: Path, sent: dict[Path, str]) -> dict:
    """The uploaded files saved in `folder`, as the schema's keys and file names (relative to `folder`)."""
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
    schema = {}
    for name, field in UPLOADS.items():
        if name in saved:
            if not field.many and len(saved[name]) > 1:
                raise ApiError(400, f"{name} takes one file, got {len(saved[name])}.", name)
            schema[field.key] = saved[name] if field.many else saved[name][0]
    return schema
