"""The HTTP API of `h3trt serve` (FastAPI): OpenAI's Videos job API, the operations endpoints and the page.

    POST   /v1/videos                      create a job (JSON, or multipart with input_reference / last_image / refs)
    GET    /v1/videos                      list jobs (after, limit, order)
    GET    /v1/videos/{id}                 a job: status, progress, stage, timings, error
    GET    /v1/videos/{id}/content         the MP4 (variant=video) or its first frame (variant=thumbnail)
    DELETE /v1/videos/{id}                 cancel it if queued or running, then remove its files and record
    POST   /v1/videos/{id}/cancel          cancel it (a running job stops at its next denoise step)
    GET    /health  /ready  /metrics  /

Every route that touches the store or the disk runs on a worker thread (sync handlers, FileResponse), so the event
loop never waits on them, and nothing here touches the GPU (the job loop runs in other processes). Errors are
OpenAI's envelope: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from importlib import resources
from typing import Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.profiles import PROFILE_NAMES
from .service import ApiError, Upload, VideoService
from .store import JobRow

JOB_ID = re.compile(r"/v1/videos/(video_[0-9a-f]{32})")
POLL_AFTER_MS = 500  # what GET tells the SDK's poll() to wait before asking again


# --- the wire format (the OpenAPI schema clients and schemathesis read) ------------------------------------------------

class VideoError(BaseModel):
    code: str
    message: str


class Evaluations(BaseModel):
    done: int = Field(description="denoise evaluations finished on the device")
    total: int = Field(description="denoise evaluations of the job (0 until it starts)")


class Video(BaseModel):
    """OpenAI's video job object, with H3's own fields after `size`."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    progress: int = Field(ge=0, le=100, description="percent: denoise evaluations finished on the device, then "
                                                    "decode; monotonic")
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    prompt: str
    seconds: str
    size: str
    error: VideoError | None = None
    remixed_from_video_id: str | None = None
    task: str
    seed: int
    steps: int
    stage: str
    evaluations: Evaluations
    started_at: int | None = None
    attempts: int
    cancel_requested: bool
    timings: dict[str, float] | None = Field(None, description="seconds per stage (the clip's record)")
    stage_spans: dict[str, list[float]] | None = Field(None, description="each stage's [start, end], Unix seconds")
    manifest_sha256: str | None = Field(None, description="the served bundle's manifest hash")


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(BaseModel):
    error: ErrorBody


class Ready(BaseModel):
    ready: bool
    draining: bool
    groups_serving: int
    groups: list[dict]
    model: str


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    uptime_s: float


CREATE_FIELDS = {
    "prompt": {"type": "string", "description": "what to generate (UTF-8, at most 1024 tokens)"},
    "model": {"type": "string", "description": "the served model id (optional)"},
    "seconds": {"type": "string", "description": "duration, 5 to 14.375, as a string: \"5\""},
    "size": {"type": "string", "description": "WIDTHxHEIGHT, multiples of 32 within H3's canvas"},
    "task": {"type": "string", "enum": ["t2va", "fl2va", "ref2va"]},
    "seed": {"type": "integer"},
    "steps": {"type": "integer", "minimum": 2},
    "negative_prompt": {"type": "string"},
    "guidance": {"type": "number", "minimum": 1},
    "video_shift": {"type": "number", "exclusiveMinimum": 0},
    "audio_shift": {"type": "number", "exclusiveMinimum": 0},
    "profile": {"type": "string", "enum": list(PROFILE_NAMES),
                "description": "speed profile: step reuse and sparse attention by name (README, 'Speed profiles')"},
    "cache": {"type": "string", "enum": ["first-block"], "description": "step cache (overrides the profile's)"},
    "cache_threshold": {"type": "number", "minimum": 0},
    "cache_warmup": {"type": "integer", "minimum": 0},
    "cache_max_skip": {"type": "integer", "minimum": 1},
}
FILE = {"type": "string", "format": "binary"}
CREATE_BODY = {
    "required": True,
    "content": {
        "application/json": {"schema": {"type": "object", "required": ["prompt"], "properties": CREATE_FIELDS,
                                        "additionalProperties": False}},
        "multipart/form-data": {"schema": {"type": "object", "required": ["prompt"],
                                           "properties": {**CREATE_FIELDS, "input_reference": FILE,
                                                          "last_image": FILE,
                                                          "refs": {"type": "array", "items": FILE}}}},
    },
}
ERRORS = {status: {"model": ErrorEnvelope, "description": text} for status, text in (
    (400, "a field is wrong (the message names it and the fix)"), (401, "missing or wrong API key"),
    (404, "no such job"), (409, "the job has no content yet"), (413, "the body is over the limit"),
    (429, "the queue is full (Retry-After)"), (503, "the server is draining (Retry-After)"))}


# --- the app -----------------------------------------------------------------------------------------------------------

def create_app(service: VideoService) -> FastAPI:
    app = FastAPI(title="h3trt serve", version="1", description="OpenAI-compatible video jobs over MiniMax-H3.",
                  docs_url="/docs", redoc_url=None)
    options = service.options

    def envelope(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                            headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return envelope(e.status, str(e), e.kind, e.param, None, e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return envelope(400, f"{where or 'request'}: {first.get('msg', 'invalid')}", "invalid_request_error", where)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return envelope(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else
                        "server_error")

    def authorized(request: Request) -> None:
        if options.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), options.api_key.encode()):
            raise ApiError(401, "Missing or wrong API key: send Authorization: Bearer <key> (the server's --api-key).",
                           kind="invalid_request_error")

    api = [Depends(authorized)]

    @app.post("/v1/videos", response_model=Video, dependencies=api, responses=ERRORS,
              openapi_extra={"requestBody": CREATE_BODY})
    async def create_video(request: Request) -> Video:
        fields, uploads, multipart = await _read_create(request)
        row = await run_in_threadpool(service.create, fields, uploads, multipart)
        return video_of(service, row)

    @app.get("/v1/videos", response_model=VideoList, dependencies=api, responses=ERRORS)
    def list_videos(after: str | None = None, limit: int = Query(20, ge=1, le=100),
                    order: Literal["asc", "desc"] = "desc") -> VideoList:
        try:
            rows, more = service.store.page(after, limit, order)
        except KeyError:
            raise ApiError(400, f"after={after!r} is not a job id here; pass the last id of the previous page.",
                           "after") from None
        data = [video_of(service, r) for r in rows]
        return VideoList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                         has_more=more)

    @app.get("/v1/videos/{video_id}", response_model=Video, dependencies=api, responses=ERRORS)
    def retrieve_video(video_id: str, response: Response) -> Video:
        row = service.get(video_id)
        if row.status in ("queued", "in_progress"):
            response.headers["openai-poll-after-ms"] = str(POLL_AFTER_MS)
        return video_of(service, row)

    @app.get("/v1/videos/{video_id}/content", dependencies=api, responses={
        **ERRORS, 200: {"content": {"video/mp4": {"schema": FILE}, "image/webp": {"schema": FILE}},
                        "description": "the MP4, or its first frame"}}, response_class=Response)
    def video_content(video_id: str, variant: Literal["video", "thumbnail", "spritesheet"] = "video"):
        key = service.content(video_id, variant)
        media = "video/mp4" if variant == "video" else "image/webp"
        filename = f"{video_id}.{'mp4' if variant == 'video' else 'webp'}"
        path = service.storage.local_path(key)
        if path is not None:
            return FileResponse(path, media_type=media, filename=filename)
        # Object storage: streamed through this process (a sync iterator: Starlette reads it on a worker thread).
        return StreamingResponse(service.storage.chunks(key), media_type=media,
                                 headers={"Content-Disposition": f'attachment; filename="{filename}"'})

    @app.delete("/v1/videos/{video_id}", response_model=VideoDeleted, dependencies=api, responses=ERRORS)
    def delete_video(video_id: str) -> VideoDeleted:
        service.cancel(video_id, delete=True)
        return VideoDeleted(id=video_id, deleted=True)

    @app.post("/v1/videos/{video_id}/cancel", response_model=Video, dependencies=api, responses=ERRORS)
    def cancel_video(video_id: str) -> Video:
        return video_of(service, service.cancel(video_id))

    @app.get("/health", response_model=Health)
    def health() -> Health:
        return Health(uptime_s=round(time.time() - service.started, 3))

    @app.get("/ready", response_model=Ready, responses={503: {"model": Ready, "description": "not serving"}})
    def ready():
        serving = service.groups.serving()
        body = Ready(ready=serving > 0 and not service.draining.is_set(), draining=service.draining.is_set(),
                     groups_serving=serving, groups=service.groups.status(), model=service.model_id)
        return JSONResponse(body.model_dump(), 200 if body.ready else 503)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    def metrics():
        return Response(service.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page():
        return HTMLResponse(resources.files("h3trt.server").joinpath("page.html").read_text(encoding="utf-8"))

    app.add_middleware(AccessLog, service=service)
    app.add_middleware(BodyLimit, limit=options.max_body_bytes)
    return app


async def _read_create(request: Request) -> tuple[dict, list[Upload], bool]:
    """POST /v1/videos's fields and files, whichever way they came (the SDK always sends multipart)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json":
        try:
            fields = json.loads(await request.body())
        except ValueError as e:
            raise ApiError(400, f"The body is not valid JSON ({e}).") from None
        if not isinstance(fields, dict):
            raise ApiError(400, f"The body must be a JSON object, got {type(fields).__name__}.")
        return fields, [], False
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            form = await request.form(max_files=16, max_fields=64)
        except Exception as e:  # noqa: BLE001 -- a malformed multipart body is the client's
            raise ApiError(400, f"The form could not be read ({e}).") from None
        fields, uploads = {}, []
        for key, value in form.multi_items():
            key = key[:-2] if key.endswith("[]") else key
            if isinstance(value, UploadFile):
                uploads.append(Upload(key, value.filename or "", await value.read()))
                if key not in ("input_reference", "last_image", "refs"):
                    raise ApiError(400, f"{key} is not a file field; files go in input_reference, last_image or "
                                        "refs.", key)
            elif key in fields:
                raise ApiError(400, f"{key} was sent twice; send it once.", key)
            else:
                fields[key] = value
        return fields, uploads, True
    raise ApiError(400, f"Content-Type {kind or '(none)'} is not accepted; send application/json or "
                        "multipart/form-data.")


def video_of(service: VideoService, row: JobRow) -> Video:
    schema, openai = row.request["schema"], row.request.get("openai", {})
    width, height = row.request.get("geometry", [0, 0])
    record = row.record or {}
    duration = schema.get("duration", None)
    return Video(
        id=row.id, model=openai.get("model", service.model_id), status=row.status, progress=row.progress,
        created_at=int(row.created_at), completed_at=_int(row.completed_at), expires_at=_int(row.expires_at),
        prompt=schema["prompt"], seconds=openai.get("seconds") or f"{duration if duration is not None else 5:g}",
        size=f"{width}x{height}",
        error=VideoError(code=row.error_code or "error", message=row.error_message or "")
        if row.status in ("failed", "cancelled") and row.error_message else None,
        task=record.get("task") or schema.get("task") or _task_of(schema), seed=int(schema.get("seed", 42)),
        steps=int(schema.get("steps", service.entry.default_steps)), stage=row.stage,
        evaluations=Evaluations(done=row.evaluations_done, total=row.evaluations_total),
        started_at=_int(row.started_at), attempts=row.attempts, cancel_requested=row.cancel_requested,
        timings=record.get("timings_s"), stage_spans=record.get("spans_unix"),
        manifest_sha256=service.manifest_sha256)


def _task_of(schema: dict) -> str:
    return "ref2va" if schema.get("refs") else "fl2va" if (schema.get("image") or schema.get("last_image")) else "t2va"


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

