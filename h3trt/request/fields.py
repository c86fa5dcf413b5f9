"""The request schema: every field a request may state, in one table (`FIELDS`), and each front door's view of it.

A field's schema key is its key in a requests file's line (`h3trt run --requests`, request/parse.py). The HTTP API
(server/app.py, server/service.py) takes the same fields, under OpenAI's names where OpenAI has the field (seconds,
size, input_reference), as JSON values, as multipart form text (a number field's text read as a JSON number) or as
uploaded files; `h3trt run --prompt` as flags (its `flag`, where it has one). Derived from the table, so that a field
added there is in all of them: the requests file's `KEYS`; the API's value fields and their OpenAPI schema
(`openapi_fields`), its file fields (`UPLOADS`), its form coercion (`FORM_NUMBERS`), OpenAI's fields and H3's own
extra fields (`OPENAI_FIELDS`, `H3_FIELDS`), the API's name for every key (`API_NAMES`, an error's `param`); run's
flag for every key that has one (`FLAG_NAMES`: cli/parser.py declares them by it); the words each front door's errors
use (`Names`: `FLAGS`, `KEY_WORDS`, `API_WORDS`). One parser reads the API's values as the schema's and turns a
schema object into a `Request` (request/parse.py `schema_values`, `parse_object`).

Beside the table, the named speed profiles (`PROFILES`): step reuse and block-sparse attention chosen together, by
one name (`h3trt run --profile`, a request line's or an API job's "profile"). A profile sets a request's step cache
(models/step_cache.py) and its `sparse_attention` / `sparse_dense_steps` (models/sparse/attention.py); a knob stated
explicitly (a flag, a key) wins over the profile's value for that knob, and only for that knob (request/parse.py
`profile_fields`).

| profile  | step cache (first-block, DBCache Fn=1 Bn=0)           | sparse attention           |
|----------|-------------------------------------------------------|----------------------------|
| lossless | none                                                  | none (dense)               |
| quality  | warm-up 4, threshold 0.04, at most 1 skip in a row    | none (dense)               |
| balanced | warm-up 4, threshold 0.12, at most 3 skips in a row   | 0.75, first 10 evals dense |
| fast     | warm-up 4, threshold 0.24, at most 3 skips in a row   | 0.80, first 10 evals dense |

Why these values: the step caches are SGLang's published MiniMax-H3 Cache-DiT profiles (high / medium / low:
SSIM 0.931 / 0.818 / 0.794 against its lossless clip, 4xH200), the peers' starting point. quality keeps attention
dense: it is the profile whose clip should stay closest to lossless, and sparsity adds its own distance on top of the
cache's. balanced adds SubBlock at 0.75, the sparsity SGLang serves H3 with and the one the H200 kernel bars are set
at (a quarter of the key blocks kept); fast adds 0.80, the sparsity of SGLang's fastest published H3 run (SubBlock 0.80
with Cache-DiT). Both keep the first 10 evaluations dense, as SubBlock does (its measurements: 5 dense steps halve the
clip's cosine to dense). What each costs and saves on H3 is measured on the H200 (README, "Speed profiles").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Callable

from ..adapters.use import MAX_LORA_SCALE
from ..errors import UserError
from ..models.checkpoint.reader import TASKS
from ..models.sampler import MAX_STEPS, MIN_STEPS
from ..models.step_cache import StepCacheConfig

# h3trt's budget for a prompt, in the checkpoint's tokens (pipeline/prepare.py check_prompt_tokens). The reference sets
# none; the text rows join every attention of every step, and H3's own prompts run tens to a few hundred tokens.
MAX_PROMPT_TOKENS = 1024
# A prompt's bytes at most: the token budget at 16 bytes a token, far more than any text averages (English about 4,
# CJK about 3), so no prompt within the token budget is refused, and a longer one is refused without tokenizing it.
MAX_PROMPT_BYTES = 16 * MAX_PROMPT_TOKENS

FILE = {"type": "string", "format": "binary"}  # an uploaded file, in OpenAPI's words


DBCACHE_WARMUP = 4  # SGLang's max_warmup_steps for H3's profiles
SPARSE_DENSE_STEPS = 10  # SubBlock's default: the first evaluations stay dense


def _dbcache(threshold: float, max_skip: int) -> StepCacheConfig:
    return StepCacheConfig("first-block", threshold, max_skip_steps=max_skip, warmup=DBCACHE_WARMUP)


@dataclass(frozen=True)
class Profile:
    """One named profile: what it sets on a request."""

    name: str
    cache: StepCacheConfig | None  # None: every block of every evaluation runs
    sparse_attention: float  # fraction of key blocks skipped per (head, video query block); 0: dense
    sparse_dense_steps: int | None  # leading evaluations kept dense (None: dense throughout, nothing to keep)


PROFILES = {p.name: p for p in (
    Profile("lossless", None, 0.0, None),
    Profile("quality", _dbcache(0.04, 1), 0.0, None),
    Profile("balanced", _dbcache(0.12, 3), 0.75, SPARSE_DENSE_STEPS),
    Profile("fast", _dbcache(0.24, 3), 0.80, SPARSE_DENSE_STEPS),
)}
PROFILE_NAMES = tuple(PROFILES)


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
class Names:
    """What a front door calls each request field, for the errors: the CLI's flags (`FLAGS`), a requests file's keys
    (`KEY_WORDS`) or the server's JSON fields (`API_WORDS`), each derived from the table (pipeline/prepare.py and the
    parser word their errors with these)."""

    prompt: str
    negative_prompt: str
    seed: str
    steps: str
    duration: str
    size: str  # the canvas: width and height, or the API's size
    guidance: str
    video_shift: str
    audio_shift: str
    image: str
    last_image: str
    refs: str
    request: str  # what holds the fields, in "the request's inputs make it t2va"


@dataclass(frozen=True)
class RequestField:
    """One field of a request."""

    key: str | None  # the schema key (None: the API's own field, not the request's: model)
    schema: dict | None = None  # its OpenAPI schema as an API value (None: the API takes no value for it)
    api: str | None = None  # the API's name for it, where it differs from the key
    upload: dict | None = None  # its OpenAPI schema as an uploaded file field (multipart only)
    openai: bool = False  # one of OpenAI's fields (else, for the API, one of H3's extra fields)
    read: Callable | None = None  # how the API's value becomes the schema's (None: as sent)
    flag: str | None = None  # `h3trt run`'s flag for it (None: one clip states it no way, or otherwise: run's --lora
    # is a merged LoRA, not the resident adapters a request names)

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
                                                             f"tokens and {MAX_PROMPT_BYTES} bytes)"}, openai=True,
                 flag="--prompt"),
    RequestField(None, {"type": "string", "description": "the served model id (optional)"}, api="model",
                 openai=True),
    RequestField("image", api="input_reference", upload=FILE, openai=True, flag="--image"),
    RequestField("last_image", upload=FILE, flag="--last-image"),
    RequestField("refs", upload={"type": "array", "items": FILE}, flag="--ref"),
    RequestField("seed", {"type": "integer"}, flag="--seed"),
    RequestField("steps", {"type": "integer", "minimum": MIN_STEPS, "maximum": MAX_STEPS},  # every door's bound
                 flag="--steps"),
    RequestField("resolution", {"type": "string", "description": "WIDTHxHEIGHT, multiples of 32 within H3's canvas"},
                 api="size", openai=True),
    RequestField("width", api="size", flag="--width"),  # a requests file's other way to state the canvas
    RequestField("height", api="size", flag="--height"),
    RequestField("duration", {"type": ["string", "number"], "description": "duration, 5 to 14.375, as a string "
                                                                           "(\"5\", OpenAI's type) or a number"},
                 api="seconds", openai=True, read=read_seconds, flag="--duration"),
    RequestField("video_shift", {"type": "number", "exclusiveMinimum": 0}, flag="--video-shift"),
    RequestField("audio_shift", {"type": "number", "exclusiveMinimum": 0}, flag="--audio-shift"),
    RequestField("guidance", {"type": "number", "minimum": 1}, flag="--guidance"),
    RequestField("negative_prompt", {"type": "string"}, flag="--negative-prompt"),
    # PROFILES: a profile, and the step-cache and sparse knobs that override its values
    RequestField("profile", {"type": "string", "enum": list(PROFILE_NAMES), "description": "speed profile: step "
                             "reuse and sparse attention by name (README, 'Speed profiles')"}, flag="--profile"),
    RequestField("cache", {"type": "string", "enum": ["first-block"], "description": "step cache (overrides the "
                                                                                     "profile's)"}, flag="--cache"),
    RequestField("cache_threshold", {"type": "number", "minimum": 0}, flag="--cache-threshold"),
    RequestField("cache_warmup", {"type": "integer", "minimum": 0}, flag="--cache-warmup"),
    RequestField("cache_max_skip", {"type": "integer", "minimum": 1}, flag="--cache-max-skip"),
    RequestField("sparse_attention", {"type": "number", "minimum": 0, "exclusiveMaximum": 1, "description":
                                      "block-sparse attention: fraction of key blocks skipped (0: dense)"},
                 flag="--sparse-attention"),
    RequestField("sparse_dense_steps", {"type": "integer", "minimum": 0, "description": "leading steps kept dense "
                                                                                        "(default 10)"},
                 flag="--sparse-dense-steps"),
    RequestField("sparse_min_seq", {"type": "integer", "minimum": 1, "description": "shorter attentions stay dense "
                                                                                    "(4096)"},
                 flag="--sparse-min-seq"),
    RequestField("vsa_sparsity", {"type": "number", "minimum": 0, "exclusiveMaximum": 1, "description": "a "
                                  "FastH3-VSA model's VSA sparsity (0: dense, the coarse branch kept; default: the "
                                  "model's)"}, flag="--vsa-sparsity"),
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


def flag_names(table: Table = FIELDS) -> dict[str, str]:
    """Each schema key `h3trt run` takes as a flag -> the flag."""
    return {f.key: f.flag for f in table if f.key is not None and f.flag is not None}


FLAG_NAMES = flag_names()


def flag_values(args) -> dict:
    """`h3trt run`'s parsed flags (argparse's namespace: a flag's value under its name without the dashes, '-' as
    '_') as the request fields they state, by schema key."""
    return {key: getattr(args, flag.lstrip("-").replace("-", "_")) for key, flag in FLAG_NAMES.items()}


def _names(word: Callable[[str], str], size: str, request: str) -> Names:
    """Each of Names' fields as `word` says the schema key of the same name; the canvas as `size`."""
    return Names(**{n.name: word(n.name) for n in fields(Names) if n.name not in ("size", "request")}, size=size,
                 request=request)


# The request's fields as each front door states them, for the errors of the one schema and of admission: run's flags,
# a requests file's keys, and the API's fields as a client sends them (the canvas: its size).
FLAGS = _names(FLAG_NAMES.get, f"{FLAG_NAMES['width']} and {FLAG_NAMES['height']}", "the request")
KEY_WORDS = _names(str, "width and height", "the line")
API_WORDS = _names(api_name, api_name("resolution"), "the request")


def openapi_fields(multipart: bool, table: Table = FIELDS) -> dict:
    """The API's create body's properties (OpenAPI): its value fields, and with `multipart` its file fields."""
    return {f.api_name: f.schema if f.schema is not None else f.upload for f in table
            if f.schema is not None or (multipart and f.upload is not None)}
