"""The wire format of `h3trt serve`'s API (server/app.py): the pydantic models of its answers and the OpenAPI schema
of what POST /v1/videos takes (CREATE_FIELDS, CREATE_BODY) and of its errors (ERRORS), which clients and
schemathesis read. Errors are OpenAI's envelope: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_serializer

from ..adapters.use import MAX_LORA_SCALE
from ..request.fields import openapi_fields


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
    sparse_attention: dict | None = Field(None, description="block-sparse attention (the clip's record): sparsity "
                                                            "asked, kept_fraction, sparse_evaluations")
    lora: list[dict] | None = Field(None, description="the resident LoRA adapters the job runs with: name and scale "
                                                      "as asked, and once done each file's sha256 and the scale used "
                                                      "(left out for a job without adapters)")

    @model_serializer(mode="wrap")
    def _without_absent_lora(self, handler):
        """A job without adapters is written as before they existed: no `lora` key at all."""
        data = handler(self)
        if data.get("lora") is None:
            data.pop("lora", None)
        return data


class Lora(BaseModel):
    """A resident LoRA adapter (h3trt serve --adapter NAME=FILE[:SCALE], --lora-dir, POST /v1/loras), as GET
    /v1/loras lists it and POST /v1/loras answers."""

    name: str
    file: str
    sha256: str
    scale: float = Field(description="its default strength (a job's lora entry without scale gets it)")
    rank: int
    targets: list[str] = Field(description="the DiT linears it adapts")
    size_bytes: int = Field(description="its low-rank factors, in the file's dtypes")
    schedule: dict[str, int | float] = Field(default_factory=dict, description=(
        "its own schedule, of steps, video_shift and audio_shift (a job naming it that states none of these runs "
        "its values); {}: none"))


class LoraSkipped(BaseModel):
    """A --lora-dir file (or an adapter kept in the data folder's loras.json) the server started without."""

    name: str
    file: str
    reason: str = Field(description="why it cannot be served; a job naming it is refused with it")
    source: str = Field(description="--lora-dir, or loras.json")


class LoraList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Lora]
    skipped: list[LoraSkipped] = Field(default_factory=list, description="what the server started without, and why")


class LoraDeleted(BaseModel):
    name: str
    object: Literal["lora"] = "lora"
    deleted: bool = True


LORA_BODY = {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["name", "file"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "description": "the name jobs pick it by (1-64 of [A-Za-z0-9._-])"},
        "file": {"type": "string", "description": "a .safetensors file inside the server's --lora-dir, relative to it"},
        "scale": {"type": "number", "minimum": -MAX_LORA_SCALE, "maximum": MAX_LORA_SCALE,
                  "description": "its default strength (default 1.0)"}}}}}}


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
    store_reachable: bool  # the job store answers (a fleet's PostgreSQL may be down for a while)
    groups_serving: int
    groups: list[dict]
    model: str


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    uptime_s: float


# The create body's fields, from the request schema's one table (request/fields.py): its value fields as JSON; with
# multipart, its file fields too.
CREATE_FIELDS = openapi_fields(multipart=False)
CREATE_BODY = {
    "required": True,
    "content": {
        "application/json": {"schema": {"type": "object", "required": ["prompt"], "properties": CREATE_FIELDS,
                                        "additionalProperties": False}},
        "multipart/form-data": {"schema": {"type": "object", "required": ["prompt"],
                                           "properties": openapi_fields(multipart=True)}},
    },
}
ERRORS = {status: {"model": ErrorEnvelope, "description": text} for status, text in (
    (400, "a field is wrong (the message names it and the fix)"), (401, "missing or wrong API key"),
    (404, "no such job"), (409, "the job has no content yet"), (413, "the body is over the limit"),
    (429, "the queue is full (Retry-After)"),
    (503, "the server is draining, or its job store is unreachable (Retry-After)"),
    (507, "the server's data disk is full (Retry-After)"))}
