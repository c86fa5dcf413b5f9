"""What `h3trt serve` does behind its HTTP routes (server/app.py), none of it on the event loop:

  - admit a job: its fields mapped onto the one request schema (runtime/requests.py, the one `run --requests`
    reads), its uploads saved, every input read and checked (runtime/request.py `prepare`) and what the model can
    serve checked (Entry.admit), then stored queued (server/store.py); a bad request never reaches the queue
  - feed the job loop: `StoreQueue` is the JobQueue (runtime/jobs.py) the replica groups take work from
    (runtime/workers.py, on a thread of its own); their events become the job's row: progress, stage, the record,
    the error, the end
  - keep the data folder true to the store: a finished job's MP4, record and thumbnail expire with its row
    (--retention); at start, files without a row and jobs interrupted mid-run are dealt with (recover)
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..models.packing import DEFAULT_DURATION
from ..models.text_encoder import check_text_encoder_files
from ..runtime.entry import Entry
from ..runtime.files import remove_leftovers
from ..runtime.jobs import Event, Job
from ..runtime.rank import WorkerSpec
from ..runtime.request import check_prompt_tokens, prepare
from ..runtime.requests import KEYS, RequestDefaults, parse_object
from ..runtime.workers import Workers
from .metrics import Metrics
from .options import ServeOptions
from .store import MAX_ATTEMPTS, JobRow, JobStore, sqlite_url

SERVED_MODEL = "minimax-h3"
FORM_NUMBERS = {"seed": int, "steps": int, "guidance": float, "video_shift": float, "audio_shift": float,
                "duration": float}  # multipart sends every field as text: these are parsed as JSON numbers
FILE_FIELDS = {"input_reference": "image", "last_image": "last_image", "refs": "refs"}
OPENAI_FIELDS = ("prompt", "model", "seconds", "size", "input_reference")
API_NAMES = {"duration": "seconds", "resolution": "size", "width": "size", "height": "size", "image": "input_reference"}
H3_FIELDS = ("task", "seed", "steps", "negative_prompt", "guidance", "video_shift", "audio_shift", "last_image",
             "refs")


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
    """The server's state: the store, the data folder, the workers and their queue, the metrics."""

    def __init__(self, entry: Entry, options: ServeOptions, spec: WorkerSpec, gpus: list[str] | None,
                 log=None):
        self.entry, self.options, self.spec = entry, options, spec
        self.data = Path(options.data_dir)
        self.clips, self.uploads = self.data / "clips", self.data / "uploads"
        for folder in (self.clips, self.uploads):
            folder.mkdir(parents=True, exist_ok=True)
        self.log = log or _log
        self.store = JobStore(sqlite_url(self.data))
        self.metrics = Metrics(self)
        self.model_id = SERVED_MODEL + ("-tiny" if entry.tiny else "")
        self.manifest_sha256 = entry.manifest.manifest_sha256 if entry.manifest is not None else None
        self.draining = threading.Event()
        self._admit = threading.Lock()  # the queue bound: count and insert as one step
        self.queue = StoreQueue(self)
        self.workers = Workers(spec, self.queue, gpus, load_failures_fatal=False,
                               log=lambda m: self.log("worker", message=m))
        self.started = time.time()

    # --- lifecycle --------------------------------------------------------------------------------------------------

    def recover(self) -> None:
        """Before the workers start: the jobs a stopped server was running, the files nobody owns."""
        remove_leftovers(self.clips)  # the partial MP4s of killed workers
        for row in self.store.rows(status="in_progress"):
            if self._committed(row.id):  # its clip was committed before the server died: done, not run again
                self._complete(row.id, json.loads(self.record_path(row.id).read_text()))
        requeued, failed = self.store.recover(self.options.retention_s)
        known = {row.id for row in self.store.rows()}
        orphans = [p for p in list(self.clips.iterdir()) + list(self.uploads.iterdir()) if _job_of(p) not in known]
        for path in orphans:
            _remove(path)
        self.log("recovered", requeued=requeued, failed=failed, orphans_removed=len(orphans),
                 queued=self.store.counts()["queued"])

    def expire(self, now: float | None = None) -> list[str]:
        """Remove ended jobs past their expiry: files first, then the row."""
        gone = []
        for row in self.store.rows(expired_before=now or time.time()):
            self._remove_files(row.id)
            self.store.remove(row.id)
            gone.append(row.id)
        if gone:
            self.log("expired", jobs=gone)
        return gone

    def drain(self, timeout_s: float) -> bool:
        """SIGTERM: refuse new jobs, let the running ones finish (at most `timeout_s`); queued jobs stay queued.
        True when every running job ended within the bound."""
        self.draining.set()
        self.workers.drain()
        deadline = time.monotonic() + timeout_s
        while self.store.counts()["in_progress"] and time.monotonic() < deadline:
            time.sleep(0.2)
        clean = not self.store.counts()["in_progress"]
        if not clean:
            self.log("drain_timeout", message=f"running jobs did not finish within {timeout_s:g} s; they are queued "
                                              "again for the next start")
        self.workers.stop()
        return clean

    # --- admitting a job --------------------------------------------------------------------------------------------

    def create(self, fields: dict, uploads: list[Upload], multipart: bool) -> JobRow:
        if self.draining.is_set():
            raise ApiError(503, "The server is shutting down and takes no new jobs; retry on another replica or "
                                "after it restarts.", kind="server_error", headers={"Retry-After": "30"})
        job_id = f"video_{uuid.uuid4().hex}"
        folder = self.uploads / job_id
        try:
            schema, openai_fields = self._to_schema(fields, uploads, folder, multipart)
            line = parse_object(schema, 0, folder, ("prompt",), self._defaults())
            prepared = prepare(line.request, self.entry.canvas)  # every input read and checked, as `run` does
            self.entry.admit(prepared)  # what a bundle serves (task, canvas, schedule)
            check_text_encoder_files(self.entry.component_root(line.request.task))
            check_prompt_tokens(self.entry.component_root(line.request.task), [
                (w, p) for w, p in (("prompt", line.request.prompt),
                                    ("negative_prompt", line.request.negative_prompt)) if p])
            if self.spec.mesh.cfg == 2 and line.request.guidance == 1.0:
                raise ApiError(400, "This server runs guidance branches on cfg=2 rank groups and needs guidance > 1 "
                                    "with a negative_prompt.", "guidance")
            with self._admit:
                queued = self.store.counts()["queued"]
                if queued >= self.options.max_queue:
                    wait = self.metrics.retry_after(queued)
                    raise ApiError(429, f"The queue is full ({queued} jobs waiting, --max-queue "
                                        f"{self.options.max_queue}); retry in about {wait} s.",
                                   kind="rate_limit_exceeded", headers={"Retry-After": str(wait)})
                row = self.store.create(job_id, {"schema": schema, "openai": openai_fields,
                                                 "geometry": [prepared.geometry.width, prepared.geometry.height]})
        except ApiError:
            _remove(folder)
            raise
        except (ValueError, OSError) as e:  # the one schema's and prepare's messages name the field and the fix
            _remove(folder)
            raise ApiError(400, " ".join(str(e).split()), _param_of(e))
        self.metrics.created.inc()
        self.log("queued", job=job_id, task=line.request.task, seed=line.request.seed)
        return row

    def _defaults(self) -> RequestDefaults:
        return RequestDefaults(steps=self.entry.default_steps, duration=DEFAULT_DURATION)

    def _to_schema(self, fields: dict, uploads: list[Upload], folder: Path, multipart: bool) -> tuple[dict, dict]:
        """OpenAI's fields and H3's extras -> the one request schema (runtime/requests.py), uploads saved."""
        known = set(OPENAI_FIELDS) | set(H3_FIELDS)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ApiError(400, f"unknown field(s) {unknown}; OpenAI's are {list(OPENAI_FIELDS)} and H3's own (extra "
                                f"fields) {list(H3_FIELDS)}.", unknown[0])
        schema: dict = {}
        if multipart:
            fields = {k: _form_value(k, v) for k, v in fields.items()}
        for key in ("prompt", "task", "seed", "steps", "negative_prompt", "guidance", "video_shift", "audio_shift"):
            if key in fields:
                schema[key] = fields[key]
        model = fields.get("model")
        if model is not None and model not in (self.model_id, SERVED_MODEL):
            raise ApiError(400, f"model {model!r} is not served here; this server serves {self.model_id!r} (or leave "
                                "model out).", "model")
        if fields.get("seconds") is not None:
            seconds = fields["seconds"]
            try:
                schema["duration"] = float(seconds) if not isinstance(seconds, bool) else None
            except (TypeError, ValueError):
                schema["duration"] = None
            if schema["duration"] is None:
                raise ApiError(400, f"seconds must be a number of seconds written as a string, such as \"5\"; got "
                                    f"{json.dumps(seconds)}.", "seconds")
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
            saved.setdefault(upload.field, []).append(path.name)
        for field, key in (("input_reference", "image"), ("last_image", "last_image")):
            if field in saved:
                if len(saved[field]) > 1:
                    raise ApiError(400, f"{field} takes one file, got {len(saved[field])}.", field)
                schema[key] = saved[field][0]
        if "refs" in saved:
            schema["refs"] = saved["refs"]
        openai_fields = {k: fields[k] for k in ("model", "seconds", "size") if fields.get(k) is not None}
        return schema, openai_fields

    # --- what the API reads -----------------------------------------------------------------------------------------

    def get(self, job_id: str) -> JobRow:
        row = self.store.get(job_id)
        if row is None or row.deleted:
            raise ApiError(404, f"No video job {job_id!r} here (it never existed, was deleted, or expired).",
                           "video_id", kind="not_found_error")
        return row

    def content(self, job_id: str, variant: str) -> Path:
        row = self.get(job_id)
        if variant not in ("video", "thumbnail"):
            raise ApiError(400, f"variant {variant!r} is not offered; use video or thumbnail.", "variant")
        if row.status != "completed":
            raise ApiError(409, f"Video job {job_id} is {row.status}; its content exists once it is completed "
                                f"(poll GET /v1/videos/{job_id}).", "video_id", kind="invalid_request_error")
        path = self.clip_path(job_id) if variant == "video" else self.thumbnail_path(job_id)
        if not path.is_file():
            raise ApiError(404, f"The {variant} of {job_id} is gone (expired or removed).", "video_id",
                           kind="not_found_error")
        return path

    def cancel(self, job_id: str, delete: bool = False) -> JobRow | None:
        """POST /cancel and DELETE: a queued job ends now; a running one stops at its next denoise step (its files
        and, for DELETE, its row go when its worker confirms); an ended job is only deleted."""
        row = self.get(job_id)
        if row.status == "queued":
            self.store.end(job_id, "cancelled", self.options.retention_s, error=("cancelled", "cancelled by request"))
            self._remove_files(job_id)
        elif row.status == "in_progress":
            self.store.request_cancel(job_id, delete_after=delete)
            self.log("cancel_requested", job=job_id)
            return self.store.get(job_id) if not delete else None
        if delete:
            self._remove_files(job_id)
            self.store.remove(job_id)
            self.log("deleted", job=job_id)
            return None
        return self.store.get(job_id)

    # --- files ------------------------------------------------------------------------------------------------------

    def clip_path(self, job_id: str) -> Path:
        return self.clips / f"{job_id}.mp4"

    def record_path(self, job_id: str) -> Path:
        return self.clips / f"{job_id}.json"

    def thumbnail_path(self, job_id: str) -> Path:
        return self.clips / f"{job_id}.webp"

    def _remove_files(self, job_id: str) -> None:
        for path in (self.clip_path(job_id), self.record_path(job_id), self.thumbnail_path(job_id),
                     self.uploads / job_id):
            _remove(path)

    def _committed(self, job_id: str) -> bool:
        """Whether a job's MP4 and record are in place and agree (the worker commits them together)."""
        from ..engines.manifest import sha256_file

        mp4, record = self.clip_path(job_id), self.record_path(job_id)
        if not (mp4.is_file() and record.is_file()):
            return False
        try:
            return json.loads(record.read_text()).get("mp4_sha256") == sha256_file(mp4)
        except (OSError, ValueError):
            return False

    def _complete(self, job_id: str, record: dict) -> None:
        _thumbnail(self.clip_path(job_id), self.thumbnail_path(job_id))
        row = self.store.end(job_id, "completed", self.options.retention_s, record=record,
                             output=str(self.clip_path(job_id)))
        _remove(self.uploads / job_id)
        if row is not None:
            self.metrics.ended(row)
            self.log("completed", job=job_id, seconds=round(row.completed_at - row.created_at, 3))

    # --- worker events (the workers' thread) ------------------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        row = self.store.get(event.job)
        if row is None:
            return
        if event.kind in ("started", "progress"):
            self.store.progress(event.job, event.progress, event.stage or row.stage, event.evaluations)
            return
        if row.deleted or (event.kind == "done" and row.cancel_requested):
            # DELETE or cancel while it ran: whatever it made goes.
            self._remove_files(event.job)
            if row.deleted:
                self.store.remove(event.job)
                self.log("deleted", job=event.job)
                return
            event = Event(event.job, "cancelled", error="cancelled by request", group=event.group)
        if event.kind == "done":
            self._complete(event.job, event.record)
        elif event.kind == "failed":
            code = _error_code((event.record or {}).get("error_type", ""))
            ended = self.store.end(event.job, "failed", self.options.retention_s, error=(code, event.error))
            self._remove_files(event.job)
            if ended is not None:
                self.metrics.ended(ended)
            self.log("failed", job=event.job, code=code, error=event.error)
        elif event.kind == "cancelled":
            self._remove_files(event.job)
            ended = self.store.end(event.job, "cancelled", self.options.retention_s,
                                   error=("cancelled", event.error or "cancelled by request"))
            if ended is not None:
                self.metrics.ended(ended)
            self.log("cancelled", job=event.job, detail=event.error)


class StoreQueue:
    """The JobQueue the replica groups take work from (runtime/jobs.py): the store's queued jobs, oldest first."""

    def __init__(self, service: VideoService):
        self.service = service

    def take(self, group: int, limit: int) -> list[Job] | None:
        row = self.service.store.claim(f"group{group}")
        if row is None:
            return []
        try:
            return [self.job_of(row)]
        except (ValueError, OSError) as e:  # its uploads vanished since it was admitted
            self.service.on_event(Event(row.id, "failed", "encode", error=f"encode: {e}", group=group))
            return []

    def job_of(self, row: JobRow) -> Job:
        service = self.service
        line = parse_object(row.request["schema"], 0, service.uploads / row.id, ("prompt",), service._defaults())
        return Job(row.id, line.request, service.clip_path(row.id), overwrite=True, record={"job": row.id})

    def report(self, event: Event) -> None:
        self.service.on_event(event)

    def lost(self, group: int, jobs: list[Job], reason: str, died: bool) -> None:
        store = self.service.store
        for job in jobs:
            row = store.get(job.id)
            if row is None:
                continue
            if row.deleted or row.cancel_requested:
                self.service.on_event(Event(job.id, "cancelled", error="cancelled while its worker stopped"))
            elif died and row.attempts < MAX_ATTEMPTS:
                store.requeue(job.id)
                self.service.log("requeued", job=job.id, reason=reason, attempts=row.attempts)
            else:  # a rank raised `reason` ("OutOfMemoryError: ..."), or the job already ran twice
                kind = reason.split(":", 1)[0] if not died and ":" in reason else "WorkerLost"
                self.service.on_event(Event(job.id, "failed", "worker", error=f"worker: {reason}",
                                            record={"error_type": kind}))

    def cancels(self) -> list[str]:
        return self.service.store.cancels()


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
            match = re.search(rf"(?<![\w-])(--)?{re.escape(key.replace('_', '[-_]'))}(?![\w-])", text)
            if key != "id" and match and (best is None or match.start() < best[0]):
                best = (match.start(), key)
        field = best[1] if best else None
    return API_NAMES.get(field, field)


def _error_code(error_type: str) -> str:
    return {"OutOfMemoryError": "out_of_memory", "FloatingPointError": "numerical_error", "MediaError": "bad_media",
            "WorkerLost": "worker_lost"}.get(error_type, "generation_failed")


def _job_of(path: Path) -> str:
    return path.name.split(".", 1)[0]


def _remove(path: Path) -> None:
    try:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def _thumbnail(mp4: Path, out: Path) -> None:
    """The clip's first frame as WebP (GET /content?variant=thumbnail)."""
    import av

    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with av.open(str(mp4)) as container:
            frame = next(container.decode(video=0))
            frame.to_image().save(tmp, format="WEBP", quality=85)
        tmp.replace(out)
    except Exception as e:  # noqa: BLE001 -- a thumbnail is a convenience: the clip is what was asked for
        _remove(tmp)
        _log("thumbnail_failed", job=_job_of(mp4), error=str(e))


def _log(event: str, **fields) -> None:
    """One JSON line per event on stderr (structured: a log shipper reads it as is)."""
    print(json.dumps({"ts": round(time.time(), 3), "event": event, **fields}, default=str), file=sys.stderr,
          flush=True)

