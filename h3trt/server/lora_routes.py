"""The LoRA adapters' routes of `h3trt serve` (issue 38 item 2), behind the API key like every /v1 route:

    GET    /v1/loras          the adapters a job's `lora` field may name now: rank, targets, size, sha256
    POST   /v1/loras          load one: {"name", "file" (inside --lora-dir), "scale"}; its file is read and checked
                              whole before the answer, on a worker thread (never the event loop)
    DELETE /v1/loras/{name}   unload one: new jobs naming it get a 400; jobs queued with it still run with it

The set and its rules are adapters/catalog.py; the service's side (fields, errors, log) server/service.py.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from .service import ApiError, Service
from .wire import ERRORS, LORA_BODY, Lora, LoraDeleted, LoraList, LoraSkipped


LORAS = APIRouter()  # behind the API key (server/app.py create_app)


@LORAS.get("/v1/loras", response_model=LoraList, responses=ERRORS)
def list_loras(service: Service) -> LoraList:
    """The LoRA adapters a job's `lora` field may name (h3trt serve --adapter, --lora-dir, POST /v1/loras)."""
    return LoraList(data=[Lora(**info) for info in service.loras()],
                    skipped=[LoraSkipped(**s) for s in service.skipped_loras()])


@LORAS.post("/v1/loras", response_model=Lora, responses=ERRORS, openapi_extra={"requestBody": LORA_BODY})
async def load_lora(request: Request, service: Service) -> Lora:
    """Load an adapter of the server's --lora-dir while it runs (read and checked before the answer)."""
    fields = await _json_object(request)
    return Lora(**await run_in_threadpool(service.load_lora, fields))


@LORAS.delete("/v1/loras/{name}", response_model=LoraDeleted, responses=ERRORS)
def unload_lora(name: str, service: Service) -> LoraDeleted:
    """Unload an adapter: new jobs may no longer name it; jobs queued with it still run with it."""
    service.unload_lora(name)
    return LoraDeleted(name=name)


async def _json_object(request: Request) -> dict:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(400, f"Content-Type {kind or '(none)'} is not accepted; send application/json.")
    try:
        fields = json.loads(await request.body())
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"The body is not valid JSON ({e}).") from None
    if not isinstance(fields, dict):
        raise ApiError(400, f"The body must be a JSON object, got {type(fields).__name__}.")
    return fields
