"""The wire format of `h3trt serve`'s API (server/app.py): the pydantic models of its answers and the OpenAPI schema
of what POST /v1/videos takes (CREATE_FIELDS, CREATE_BODY) and of its errors (ERRORS), which clients and
schemathesis read. Errors are OpenAI's envelope: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ..runtime.profiles import PROFILE_NAMES
from ..runtime.request import MAX_PROMPT_BYTES, MAX_PROMPT_TOKENS, MAX_STEPS


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


CREATE_FIELDS = {
    "prompt": {"type": "string", "description": f"what to generate (UTF-8, at most {MAX_PROMPT_TOKENS} tokens and "
                                                f"{MAX_PROMPT_BYTES} bytes)"},
    "model": {"type": "string", "description": "the served model id (optional)"},
    "seconds": {"type": ["string", "number"], "description": "duration, 5 to 14.375, as a string (\"5\", OpenAI's "
                                                            "type) or a number"},
    "size": {"type": "string", "description": "WIDTHxHEIGHT, multiples of 32 within H3's canvas"},
    "task": {"type": "string", "enum": ["t2va", "fl2va", "ref2va"]},
    "seed": {"type": "integer"},
    "steps": {"type": "integer", "minimum": 2, "maximum": MAX_STEPS},
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
    "sparse_attention": {"type": "number", "minimum": 0, "exclusiveMaximum": 1,
                         "description": "block-sparse attention: fraction of key blocks skipped (0: dense)"},
    "sparse_dense_steps": {"type": "integer", "minimum": 0, "description": "leading steps kept dense (default 10)"},
    "sparse_min_seq": {"type": "integer", "minimum": 1, "description": "shorter attentions stay dense (4096)"},
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
    (429, "the queue is full (Retry-After)"),
    (503, "the server is draining, or its job store is unreachable (Retry-After)"),
    (507, "the server's data disk is full (Retry-After)"))}
