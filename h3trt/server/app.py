"""The HTTP API of `h3trt serve` (FastAPI): OpenAI's Videos job API, the operations endpoints and the page.

    POST   /v1/videos                      create a job (JSON, or multipart with input_reference / last_image / refs)
    GET    /v1/videos                      list jobs (after, limit, order)
    GET    /v1/videos/{id}                 a job: status, progress, stage, timings, error
    GET    /v1/videos/{id}/content         the MP4 (variant=video) or its first frame (variant=thumbnail)
    DELETE /v1/videos/{id}                 cancel it if queued or running, then remove its files and record
    POST   /v1/videos/{id}/cancel          cancel it (a running job stops at its next denoise step)
    GET    /v1/loras                       the LoRA adapters a job may name; POST loads one, DELETE .../{name}
                                           unloads one (server/lora_routes.py)
    GET    /health  /ready  /metrics  /

Every route that touches the store or the disk runs on a worker thread (sync handlers, FileResponse), so the event
loop never waits on them, and nothing here touches the GPU (the job loop runs in other processes). Errors are
OpenAI's envelope: {"error": {"message", "type", "param", "code"}}. The models of what goes over the wire, and the
schema of what POST /v1/videos takes, are server/wire.py.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import traceback
import urllib.parse
from importlib import resources
from typing import Callable, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartParser

from ..pipeline.records import ClipRecord
from ..request.fields import FILE, UPLOADS
from ..request.request import task_of
from .service import ApiError, Service, Upload, VideoService, disk_full_error, shown
from .store import STATUSES, JobRow, JobStatus, is_disk_full, store_unreachable
from .lora_routes import LORAS
from .wire import CREATE_BODY, ERRORS, Evaluations, Health, Ready, Video, VideoDeleted, VideoError, VideoList

JOB_ID = re.compile(r"/v1/videos/(video_[0-9a-f]{32})")
STORE_RETRY_AFTER_S = 5  # what a 503 for an unreachable job store tells clients to wait
POLL_AFTER_MS = 500  # what GET tells the SDK's poll() to wait before asking again


# --- the app -----------------------------------------------------------------------------------------------------------

def create_app(service: VideoService) -> FastAPI:
    app = FastAPI(title="h3trt serve", version="1", description="OpenAI-compatible video jobs over MiniMax-H3.",
                  docs_url=None, redoc_url=None, openapi_url=None)  # served below, behind the key unless --open docs
    app.state.service = service  # what every route's `Service` parameter is (service_of)
    _error_handlers(app, service)
    api, keyed = _authorization(service.options)
    app.include_router(DOCS, dependencies=keyed("docs"))
    app.include_router(VIDEOS, dependencies=api)
    app.include_router(LORAS, dependencies=api)
    app.include_router(OPEN)
    app.include_router(METRICS, dependencies=keyed("metrics"))
    app.add_middleware(AccessLog, service=service)
    app.add_middleware(BodyLimit, limit=service.options.max_body_bytes)
    return app


def _envelope(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
              headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


def _error_handlers(app: FastAPI, service: VideoService) -> None:
    """Every error in OpenAI's envelope, with its status and, where it has one, the field at fault."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _envelope(e.status, str(e), e.kind, e.param, "disk_full" if e.status == 507 else None, e.headers)

    async def disk_full(request: Request, e: Exception):
        """Any route that met a full data disk (a cancel's write, a listing's read of a full WAL): 507 in the
        envelope; anything else stays an error of the server."""
        if not is_disk_full(e):
            raise e
        full = disk_full_error()
        return _envelope(full.status, str(full), full.kind, None, "disk_full", full.headers)

    app.add_exception_handler(OSError, disk_full)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _envelope(400, f"{where or 'request'}: {first.get('msg', 'invalid')}", "invalid_request_error", where)

    @app.exception_handler(SQLAlchemyError)
    async def store_error(request: Request, e: SQLAlchemyError):
        # One handler for every store error (Starlette takes the most specific class, so a second one registered
        # for OperationalError would hide this one): a full disk is 507, an outage 503, anything else a 500.
        if is_disk_full(e):
            return await disk_full(request, e)
        if not store_unreachable(e):
            raise e
        service.log("store_unreachable", path=request.url.path, error=" ".join(str(e).split())[:300])
        return _envelope(503, "The job store is unreachable for the moment; retry in a few seconds.", "server_error",
                         code="store_unreachable", headers={"Retry-After": str(STORE_RETRY_AFTER_S)})

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        # What no other handler answers (a defect, or a fault nothing classifies yet): the client gets the envelope
        # and a code to quote, and the operator's log gets the request and the traceback that explain it.
        service.log("internal_error", method=request.method, path=request.url.path,
                    error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}",
                    trace="".join(traceback.format_exception(e))[-4000:])
        return _envelope(500, "The server failed on this request (logged as internal_error with its traceback); "
                              "retry, and report it if it persists.", "server_error", code="internal_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _envelope(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else
                         "server_error")


def _authorization(options) -> tuple[list, Callable[[str], list]]:
    """The API key's dependency for the routes that need it (none without --api-key), and `keyed(endpoint)`: the
    same, unless the operator opened `endpoint` (--open)."""

    def authorized(request: Request) -> None:
        if options.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), options.api_key.encode()):
            raise ApiError(401, "Missing or wrong API key: send Authorization: Bearer <key> (the server's --api-key).",
                           kind="invalid_request_error")

    api = [Depends(authorized)]

    def keyed(endpoint: str) -> list:
        return [] if endpoint in options.open_endpoints else api

    return api, keyed


# --- the routes: module-level handlers, each taking the app's service (`Service`) -------------------------------------

DOCS = APIRouter()  # /openapi.json and /docs, behind the key unless --open docs
VIDEOS = APIRouter()  # OpenAI's Videos job API (module doc), behind the key
OPEN = APIRouter()  # /health, /ready and the page: never behind the key
METRICS = APIRouter()  # /metrics, behind the key unless --open metrics


@DOCS.get("/openapi.json", include_in_schema=False)
def openapi_schema(request: Request):
    return JSONResponse(request.app.openapi())


@DOCS.get("/docs", include_in_schema=False)
def docs():
    return get_swagger_ui_html(openapi_url="/openapi.json", title="h3trt serve")


@VIDEOS.post("/v1/videos", response_model=Video, responses=ERRORS, openapi_extra={"requestBody": CREATE_BODY})
async def create_video(request: Request, service: Service) -> Video:
    fields, uploads, multipart = await _read_create(request)
    row = await run_in_threadpool(service.create, fields, uploads, multipart)
    return video_of(service, row)


@VIDEOS.get("/v1/videos", response_model=VideoList, responses=ERRORS)
def list_videos(service: Service, after: str | None = None, limit: int = Query(20, ge=1, le=100),
                order: Literal["asc", "desc"] = "desc") -> VideoList:
    try:
        rows, more = service.store.page(after, limit, order)
    except KeyError:
        raise ApiError(400, f"after={after!r} is not a job id here; pass the last id of the previous page.",
                       "after") from None
    data = [video_of(service, r) for r in rows]
    return VideoList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                     has_more=more)


@VIDEOS.get("/v1/videos/{video_id}", response_model=Video, responses=ERRORS)
def retrieve_video(video_id: str, response: Response, service: Service) -> Video:
    row = service.get(video_id)
    if row.status in (JobStatus.QUEUED, JobStatus.IN_PROGRESS):
        response.headers["openai-poll-after-ms"] = str(POLL_AFTER_MS)
    return video_of(service, row)


@VIDEOS.get("/v1/videos/{video_id}/content", responses={
    **ERRORS, 200: {"content": {"video/mp4": {"schema": FILE}, "image/webp": {"schema": FILE}},
                    "description": "the MP4, or its first frame"}}, response_class=Response)
def video_content(video_id: str, service: Service, variant: Literal["video", "thumbnail", "spritesheet"] = "video"):
    key = service.content(video_id, variant)
    media = "video/mp4" if variant == "video" else "image/webp"
    filename = f"{video_id}.{'mp4' if variant == 'video' else 'webp'}"
    path = service.storage.local_path(key)
    if path is not None:
        return FileResponse(path, media_type=media, filename=filename)
    # Object storage: streamed through this process (a sync iterator: Starlette reads it on a worker thread).
    return StreamingResponse(service.storage.chunks(key), media_type=media,
                             headers={"Content-Disposition": f'attachment; filename="{filename}"'})


@VIDEOS.delete("/v1/videos/{video_id}", response_model=VideoDeleted, responses=ERRORS)
def delete_video(video_id: str, service: Service) -> VideoDeleted:
    service.cancel(video_id, delete=True)
    return VideoDeleted(id=video_id, deleted=True)


@VIDEOS.post("/v1/videos/{video_id}/cancel", response_model=Video, responses=ERRORS)
def cancel_video(video_id: str, service: Service) -> Video:
    return video_of(service, service.cancel(video_id))


@OPEN.get("/health", response_model=Health)
def health(service: Service) -> Health:
    return Health(uptime_s=round(time.time() - service.started, 3))


@OPEN.get("/ready", response_model=Ready, responses={503: {"model": Ready, "description": "not serving"}})
def ready(service: Service):
    serving = service.groups.serving()
    store = service.store.reachable()
    draining = service.draining.is_set()
    groups = [g.to_json() for g in service.groups.status()]
    body = Ready(ready=serving > 0 and store and not draining, draining=draining, store_reachable=store,
                 groups_serving=serving, groups=groups, model=service.model_id)
    return JSONResponse(body.model_dump(), 200 if body.ready else 503)


@METRICS.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}, 401: ERRORS[401]})
def metrics(service: Service):
    return Response(service.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


@OPEN.get("/", response_class=HTMLResponse, include_in_schema=False)
def page():
    return HTMLResponse(resources.files("h3trt.server").joinpath("page.html").read_text(encoding="utf-8"))


async def _read_create(request: Request) -> tuple[dict, list[Upload], bool]:
    """POST /v1/videos's fields and files, whichever way they came (the SDK always sends multipart). Text fields are
    UTF-8, as JSON's are: a field that is not is refused, naming it (Starlette would read it as Latin-1)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json":
        try:
            fields = json.loads(await request.body())
        except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser goes
            raise ApiError(400, f"The body is not valid JSON ({e}).") from None
        if not isinstance(fields, dict):
            raise ApiError(400, f"The body must be a JSON object, got {type(fields).__name__}.")
        return fields, [], False
    if kind == "application/x-www-form-urlencoded":
        parts = [part for part in (await request.body()).split(b"&") if part]
        if len(parts) > 64:
            raise ApiError(400, f"The form has {len(parts)} fields; a job takes at most 64.")
        pairs = [[urllib.parse.unquote_to_bytes(x.replace(b"+", b" ")) for x in (*part.split(b"=", 1), b"")[:2]]
                 for part in parts]  # bytes, so a value that is not UTF-8 is seen (parse_qsl would replace it)
        items = [(key.decode("utf-8", "replace"), _utf8(key.decode("utf-8", "replace"), value))
                 for key, value in pairs]
        return _form_fields(items), [], True
    if kind == "multipart/form-data":
        parser = _StrictMultiPart(request.headers, request.stream(), max_files=16, max_fields=64)
        try:
            form = await parser.parse()
        except Exception as e:  # noqa: BLE001 -- a malformed multipart body is the client's
            raise ApiError(400, f"The form could not be read ({e}).") from None
        try:
            items, uploads = [], []
            for key, value in form.multi_items():
                key = key[:-2] if key.endswith("[]") else key
                if isinstance(value, UploadFile):
                    if key not in UPLOADS:
                        *others, last = UPLOADS
                        raise ApiError(400, f"{key} is not a file field; files go in {', '.join(others)} or {last}.",
                                       key)
                    uploads.append(Upload(key, value.filename or "", await value.read()))
                else:
                    items.append((key, _utf8(key, value) if isinstance(value, bytes) else value))
        finally:
            await form.close()
        return _form_fields(items), uploads, True
    raise ApiError(400, f"Content-Type {kind or '(none)'} is not accepted; send application/json or "
                        "multipart/form-data.")


def _form_fields(items: list[tuple[str, str]]) -> dict:
    fields = {}
    for key, value in items:
        key = key[:-2] if key.endswith("[]") else key
        if key in fields:
            raise ApiError(400, f"{key} was sent twice; send it once.", key)
        fields[key] = value
    return fields


def _utf8(name: str, value: bytes) -> str:
    """A form field's bytes as text; refused, naming the field, when they are not UTF-8."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"{name} is not valid UTF-8 (byte 0x{value[e.start]:02x} at position {e.start}); send "
                            "text fields as UTF-8.", name) from None


class _StrictMultiPart(MultiPartParser):
    """Starlette's multipart parser, keeping a text field's bytes when they are not in the form's charset (UTF-8
    unless it says otherwise) instead of reading them as Latin-1: `_read_create` refuses them."""

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is not None:
            return super().on_part_end()
        try:
            value = part.data.decode(self._charset)
        except (UnicodeDecodeError, LookupError):
            value = bytes(part.data)
        self.items.append((part.field_name, value))


def video_of(service: VideoService, row: JobRow) -> Video:
    """A job as the API shows it. A row this h3trt did not write as it reads it (an older version's, a hand edit)
    still shows, with what can be read of it and the reason, and is logged: one row never breaks a listing."""
    try:
        return _video_of(service, row)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # pydantic's ValidationError is a ValueError
        reason = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        service.log("unreadable_row", job=row.id, error=reason)
        return Video(
            id=str(row.id), model=service.model_id,
            status=row.status if row.status in STATUSES else "failed",
            progress=min(100, max(0, _int(row.progress) or 0)) if _number(row.progress) else 0,
            created_at=_int(row.created_at) if _number(row.created_at) else 0, prompt="", seconds="", size="",
            error=VideoError(code="unreadable_row", message=f"this job's stored request cannot be read ({reason})"),
            task="", seed=0, steps=0, stage=str(row.stage), evaluations=Evaluations(done=0, total=0),
            attempts=_int(row.attempts) if _number(row.attempts) else 0, cancel_requested=bool(row.cancel_requested))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _video_of(service: VideoService, row: JobRow) -> Video:
    schema, openai = row.request["schema"], row.request.get("openai", {})
    width, height, steps, uses = shown(row.request, service.entry.model.default_steps)
    record = ClipRecord.from_json(row.record or {})
    duration = schema.get("duration", None)
    seconds = openai.get("seconds")  # text since issue 35; an older h3trt stored the number a client sent
    return Video(
        id=row.id, model=openai.get("model", service.model_id), status=row.status, progress=row.progress,
        created_at=int(row.created_at), completed_at=_int(row.completed_at), expires_at=_int(row.expires_at),
        prompt=schema["prompt"],
        seconds=(f"{seconds:g}" if _number(seconds) else seconds) or f"{duration if duration is not None else 5:g}",
        size=f"{width}x{height}",
        error=VideoError(code=row.error_code or "error", message=row.error_message or "")
        if row.status in (JobStatus.FAILED, JobStatus.CANCELLED) and row.error_message else None,
        task=record.task or schema.get("task") or task_of(schema.get("image"), schema.get("last_image"),
                                                          schema.get("refs")), seed=int(schema.get("seed", 42)),
        steps=steps,
        stage=row.stage,
        evaluations=Evaluations(done=row.evaluations_done, total=row.evaluations_total),
        started_at=_int(row.started_at), attempts=row.attempts, cancel_requested=row.cancel_requested,
        timings=record.timings_s, stage_spans=record.spans_unix,
        manifest_sha256=service.manifest_sha256, sparse_attention=record.sparse_attention,
        lora=record.adapters or [u.shown() for u in uses] or schema.get("lora") or None)  # as run, else as admission
    # resolved it (unresolved: as asked)


def _int(value: float | None) -> int | None:
    return int(value) if value is not None else None


class BodyLimit:
    """Refuse a request body over `limit` bytes with 413, by its Content-Length or while it streams in."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _too_large(self.limit, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge()
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await _too_large(self.limit, send)


class _TooLarge(Exception):
    pass


async def _too_large(limit: int, send) -> None:
    body = json.dumps({"error": {"message": f"The request body is over the server's limit of {limit / 1e6:g} MB "
                                            "(--max-upload-mb); send smaller files.",
                                 "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class AccessLog:
    """One structured line per request (method, path, status, milliseconds, the job id it names) and the request
    counter of /metrics."""

    def __init__(self, app, service: VideoService):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def recorded(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recorded)
        finally:
            path = scope.get("path", "")
            route = scope.get("route")
            template = getattr(route, "path", None) or ("unmatched" if status[0] == 404 else path)
            self.service.metrics.http.labels(scope.get("method", ""), template, str(status[0])).inc()
            job = JOB_ID.match(path)
            self.service.log("http", method=scope.get("method"), path=path, status=status[0],
                             ms=round((time.perf_counter() - start) * 1000, 2), **({"job": job[1]} if job else {}))

