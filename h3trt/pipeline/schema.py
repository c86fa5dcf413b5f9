"""The request schema: every field a request may state, in one table (`FIELDS`), and each front door's view of it.

A field's schema key is its key in a requests file's line (`h3trt run --requests`, pipeline/parse.py) and in the
request a server stores in its job row. The HTTP API (server/app.py, server/service.py) takes the same fields, under
OpenAI's names where OpenAI has the field (seconds, size, input_reference), as JSON values, as multipart form text (a
number field's text read as a JSON number) or as uploaded files. Derived from the table, so that a field added there
is in all of them: the requests file's `KEYS`; the API's value fields and their OpenAPI schema (`openapi_fields`),
its file fields (`UPLOADS`), its form coercion (`FORM_NUMBERS`), OpenAI's fields and H3's own extra fields
(`OPENAI_FIELDS`, `H3_FIELDS`), the API's name for every key (`API_NAMES`, an error's `param`) and the words its
errors use (`API_WORDS`); and the API's values as the schema's (`schema_values`). The CLI's flags are argparse's
(cli/parser.py). One parser turns a schema object into a `Request` (pipeline/parse.py `parse_object`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Callable

from ..errors import UserError
from ..models.checkpoint import TASKS
from .profiles import PROFILE_NAMES
from ..models.lora import MAX_LORA_SCALE
from ..models.sampler import MAX_STEPS, MIN_STEPS
from .request import MAX_PROMPT_BYTES, MAX_PROMPT_TOKENS, Names

FILE = {"type": "string", "format": "binary"}  # an uploaded file, in OpenAPI's words


def read_seconds(value) -> float:
    """The API's `seconds` as a duration: OpenAI's string ("5"), or a JSON number (5) as clients also send it;
    finite."""
    duration = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        duration = float(value)
    elif isinstance(value, str):
        try:
            duration = float(value)
        except ValueError:
            pass
    if duration is None or not math.isfinite(duration):
        raise UserError(f"seconds must be a finite number of seconds, as a string such as \"5\" (or a number), "
                        f"got {json.dumps(value)}.", field="duration")
    return duration


def read_lora_text(value):
    """The API's `lora`: JSON as sent, or its JSON text (a multipart form field); the parser checks its shape."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise UserError(f"lora must be a JSON list of {{\"name\": ..., \"scale\": ...}} objects, got "
                            f"{json.dumps(value)}.", field="lora") from None
    return value


@dataclass(frozen=True)
class RequestField:
    """One field of a request."""

    key: str | None  # the schema key (None: the API's own field, not the request's: model)
    schema: dict | None = None  # its OpenAPI schema as an API value (None: the API takes no value for it)
    api: str | None = None  # the API's name for it, where it differs from the key
    upload: dict | None = None  # its OpenAPI schema as an uploaded file field (multipart only)
    openai: bool = False  # one of OpenAI's fields (else, for the API, one of H3's extra fields)
    read: Callable | None = None  # how the API's value becomes the schema's (None: as sent)

    @property
    def api_name(self) -> str:
        return self.api or self.key

    @property
    def many(self) -> bool:
        """It takes a list (of files: refs)."""
        return (self.upload or self.schema or {}).get("type") == "array"


FIELDS = (
    RequestField("id"),  # a requests file's line: it names OUT/<id>.mp4 (the API names its jobs itself)
    RequestField("task", {"type": "string", "enum": list(TASKS)}),
    RequestField("prompt", {"type": "string", "description": f"what to generate (UTF-8, at most {MAX_PROMPT_TOKENS} "
                                                             f"tokens and {MAX_PROMPT_BYTES} bytes)"}, openai=True),
    RequestField(None, {"type": "string", "description": "the served model id (optional)"}, api="model",
                 openai=True),
    RequestField("image", api="input_reference", upload=FILE, openai=True),
    RequestField("last_image", upload=FILE),
    RequestField("refs", upload={"type": "array", "items": FILE}),
    RequestField("seed", {"type": "integer"}),
    RequestField("steps", {"type": "integer", "minimum": MIN_STEPS, "maximum": MAX_STEPS}),  # every door's bound
    RequestField("resolution", {"type": "string", "description": "WIDTHxHEIGHT, multiples of 32 within H3's canvas"},
                 api="size", openai=True),
    RequestField("width", api="size"),  # a requests file's other way to state the canvas
    RequestField("height", api="size"),
    RequestField("duration", {"type": ["string", "number"], "description": "duration, 5 to 14.375, as a string "
                                                                           "(\"5\", OpenAI's type) or a number"},
                 api="seconds", openai=True, read=read_seconds),
    RequestField("video_shift", {"type": "number", "exclusiveMinimum": 0}),
    RequestField("audio_shift", {"type": "number", "exclusiveMinimum": 0}),
    RequestField("guidance", {"type": "number", "minimum": 1}),
    RequestField("negative_prompt", {"type": "string"}),
    # pipeline/profiles.py: a profile, and the step-cache and sparse knobs that override its values
    RequestField("profile", {"type": "string", "enum": list(PROFILE_NAMES), "description": "speed profile: step "
                             "reuse and sparse attention by name (README, 'Speed profiles')"}),
    RequestField("cache", {"type": "string", "enum": ["first-block"], "description": "step cache (overrides the "
                                                                                     "profile's)"}),
    RequestField("cache_threshold", {"type": "number", "minimum": 0}),
    RequestField("cache_warmup", {"type": "integer", "minimum": 0}),
    RequestField("cache_max_skip", {"type": "integer", "minimum": 1}),
    RequestField("sparse_attention", {"type": "number", "minimum": 0, "exclusiveMaximum": 1, "description":
                                      "block-sparse attention: fraction of key blocks skipped (0: dense)"}),
    RequestField("sparse_dense_steps", {"type": "integer", "minimum": 0, "description": "leading steps kept dense "
                                                                                        "(default 10)"}),
    RequestField("sparse_min_seq", {"type": "integer", "minimum": 1, "description": "shorter attentions stay dense "
                                                                                    "(4096)"}),
    RequestField("lora", {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "scale": {"type": "number", "minimum": -MAX_LORA_SCALE, "maximum": MAX_LORA_SCALE}},
        "additionalProperties": False},
        "description": "resident LoRA adapters by name (GET /v1/loras), each with its strength (default: the "
                       "adapter's); a checkpoint, or a bundle built with --lora-slots"}, read=read_lora_text),
)

Table = tuple[RequestField, ...]


def keys(table: Table = FIELDS) -> tuple[str, ...]:
    """A requests file's keys, a stored request's."""
    return tuple(f.key for f in table if f.key is not None)


def api_names(table: Table = FIELDS) -> dict[str, str]:
    """Each schema key the API names otherwise -> the API's name."""
    return {f.key: f.api for f in table if f.key is not None and f.api is not None}


def value_fields(table: Table = FIELDS) -> dict[str, RequestField]:
    """The API's value fields, by their API name."""
    return {f.api_name: f for f in table if f.schema is not None}


def upload_fields(table: Table = FIELDS) -> dict[str, RequestField]:
    """The API's file fields, by their API name."""
    return {f.api_name: f for f in table if f.upload is not None}


def api_fields(table: Table = FIELDS, openai: bool = True) -> tuple[str, ...]:
    """The API's fields that are OpenAI's (`openai`), or H3's own (OpenAI's extra fields)."""
    return tuple(f.api_name for f in table if f.openai == openai and (f.schema or f.upload))


def form_numbers(table: Table = FIELDS) -> frozenset[str]:
    """Multipart sends every field as text: these are read as JSON numbers (seconds has its own reading)."""
    return frozenset(name for name, f in value_fields(table).items() if f.schema["type"] in ("integer", "number"))


KEYS = keys()
API_NAMES = api_names()
VALUES = value_fields()
UPLOADS = upload_fields()
OPENAI_FIELDS = api_fields(openai=True)
H3_FIELDS = api_fields(openai=False)
FORM_NUMBERS = form_numbers()


def api_name(key: str) -> str:
    """What the API calls a schema key (an error's `param`)."""
    return API_NAMES.get(key, key)


# The request's fields as a client sends them, for the errors of the one schema and `prepare` (not the CLI's flags):
# each of Names' fields is the schema key of the same name (size: the canvas, resolution).
API_WORDS = Names(**{n.name: api_name("resolution" if n.name == "size" else n.name) for n in fields(Names)
                     if n.name != "request"}, request="the request")


def openapi_fields(multipart: bool, table: Table = FIELDS) -> dict:
    """The API's create body's properties (OpenAPI): its value fields, and with `multipart` its file fields."""
    return {f.api_name: f.schema if f.schema is not None else f.upload for f in table
            if f.schema is not None or (multipart and f.upload is not None)}


def schema_values(sent: dict, table: Table = FIELDS) -> dict:
    """An API request's value fields (its known fields; the caller refused any other) as the schema's keys and values:
    OpenAI's names become the schema's, a value with its own reading is read (seconds). A renamed field sent as null
    is left out (OpenAI's SDK sends an unset field so); any other null reaches the parser, which names it."""
    schema = {}
    for name, f in value_fields(table).items():
        if f.key is None or name not in sent or (sent[name] is None and f.api is not None):
            continue
        schema[f.key] = f.read(sent[name]) if f.read is not None else sent[name]
    return schema


def form_value(name: str, value):
    """A multipart field's text as its schema type: a number for a number field (so the parser can say what is wrong
    with "1.5" for seed), the text otherwise."""
    if name in FORM_NUMBERS and isinstance(value, str):
        try:
            number = json.loads(value)
        except ValueError:
            return value
        return number if isinstance(number, (int, float)) and not isinstance(number, bool) else value
    return value
