"""A request parsed, once, where it is admitted: the API's values read as the schema's (`schema_values`, a multipart
form's text by `form_value`), one request object turned into its `Request` (`parse_object`), its profile and
step-cache keys into the request's fields (`request_profile_fields`, `profile_fields`: the profiles themselves are
request/fields.py's `PROFILES`), and the requests file of `h3trt run --requests` and `h3trt eval --requests`: one
schema, one parser.

JSON lines, one object per line (blank lines skipped), UTF-8:

    {"id": "fox", "task": "t2va", "prompt": "a red fox runs", "seed": 42, "steps": 50, "resolution": "1344x768",
     "duration": 5, "image": "first.png", "last_image": "last.png", "refs": ["a.png", "b.wav"],
     "video_shift": 12, "audio_shift": 3, "guidance": 1, "negative_prompt": "...", "profile": "balanced",
     "cache": "first-block", "cache_threshold": 0.1, "cache_warmup": 4, "cache_max_skip": 3,
     "lora": [{"name": "style", "scale": 0.8}]}

`profile` (request/fields.py `PROFILES`) and the first-block step-cache keys: a key stated overrides the profile's
value.
`lora`: resident adapters by name (`--adapter NAME=FILE[:SCALE]`; scale left out: the adapter's default), adapters/
use.py; an adapter with its own schedule gives a line that names it the steps and shifts it leaves out
(request/request.py ScheduleChoice.resolve).

`run` needs id (it names OUT/<id>.mp4), task and prompt; `eval` needs prompt (it also takes id and task, so a run
file evaluates as it is). `width` and `height` may stand in for `resolution`. A stated task must be the one its inputs
make (t2va: none; fl2va: image and/or last_image; ref2va: refs). Relative paths are relative to the file, so a batch
folder can move as a whole (read from a pipe, `--requests <(...)`, to the current folder). A UTF-8 byte-order mark is
skipped. Every line is checked before any model loads; every bad line is reported at once, each
with its line number and what is wrong with it.
"""

from __future__ import annotations

import codecs
import json
import math
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from ..adapters.use import parse_lora_field
from ..engines.manifest import Manifest
from ..errors import UserError
from ..models.checkpoint.reader import TASKS
from ..models.packing import DEFAULT_DURATION
from ..models.sampler import DEFAULT_GUIDANCE, DEFAULT_SEED, DEFAULT_STEPS, ScheduleValues
from ..models.sparse.plan import SparseSettings, sparse_settings
from ..models.step_cache import DEFAULT_THRESHOLDS, StepCacheConfig, check_knob
from .fields import (FIELDS, FORM_NUMBERS, KEY_WORDS, KEYS, PROFILE_NAMES, PROFILES, Names,  # the one table's
                     Table, value_fields)
from .request import Request, ScheduleChoice, task_of

RUN_REQUIRED = ("id", "task", "prompt")
EVAL_REQUIRED = ("prompt",)
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_LISTED_ERRORS = 20  # a file with hundreds of bad lines lists the first 20 and counts the rest


class RequestsFileError(UserError):
    """A requests file that cannot be run as a whole; the message lists every bad line."""


@dataclass(frozen=True)
class RequestDefaults:
    """What a line that leaves a field out gets: `run` (and `serve`) take a bundle's baked steps, its default sparse
    settings and the model's canvas; `eval` the engine's first profile and schedule, and no default sparsity: it
    compares what its lines (or --profile) state."""

    steps: int = DEFAULT_STEPS
    width: int | None = None  # None (with height None): the model picks the canvas
    height: int | None = None
    duration: float = DEFAULT_DURATION
    sparse: SparseSettings | None = None  # a bundle's --sparse-attention defaults (with_bundle_sparse)
    # The resident adapters' own schedules, by name (adapters/schedule.py adapter_schedules): a line naming one in its
    # "lora" and leaving steps or a shift out takes the adapter's
    adapter_schedules: Mapping[str, ScheduleValues] = field(default_factory=dict)

    @classmethod
    def of_bundle(cls, manifest: Manifest) -> "RequestDefaults":
        profile = manifest.profiles[0]
        return cls(manifest.schedule.steps, profile.width, profile.height, profile.seconds)


@dataclass(frozen=True)
class RequestLine:
    """One parsed line."""

    line: int  # 1-based line number in the file
    id: str | None  # None: not given (eval only)
    request: Request

    @property
    def task(self) -> str:
        return self.request.task


def read_request_file(path: Path, required: tuple[str, ...], defaults: RequestDefaults = RequestDefaults(),
                      check: Callable[[RequestLine], object] = lambda line: line) -> list:
    """Every line of a requests file, parsed and passed through `check` (which may raise UserError/OSError: that
    line's error; any other error is a bug and keeps its traceback); raises RequestsFileError listing every bad line,
    or when there are no requests."""
    path = Path(path)
    content, base = _read_once(path)
    items, errors, seen = [], [], {}
    for number, raw in enumerate(content.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            errors.append(f"{path}:{number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                          "save the file as UTF-8.")
            continue
        if not text.strip():
            continue
        try:
            line = parse_line(text, number, base, required, defaults)
            item = check(line)
        except (UserError, OSError) as e:
            errors.append(f"{path}:{number}: {' '.join(str(e).split())}")
            continue
        if line.id is not None and line.id in seen:
            errors.append(f"{path}:{number}: duplicate id {line.id!r} (first on line {seen[line.id]}); ids name the "
                          "output files, so each must be unique.")
            continue
        if line.id is not None:
            seen[line.id] = number
        items.append(item)
    if errors:
        listed = errors[:MAX_LISTED_ERRORS] + ([f"and {len(errors) - MAX_LISTED_ERRORS} more"]
                                               if len(errors) > MAX_LISTED_ERRORS else [])
        raise RequestsFileError(f"{path}: {len(errors)} bad line(s), nothing was run: " + "; ".join(listed))
    if not items:
        raise RequestsFileError(f"{path}: no requests (one JSON object per line).")
    return items


def _read_once(path: Path) -> tuple[bytes, Path]:
    """The file's bytes, without a UTF-8 byte-order mark (editors on Windows write one), and the folder its relative
    paths are relative to. A pipe (`--requests <(...)`, /dev/stdin) is read once, as it can only be, and its relative
    paths are relative to the current folder: it has none of its own."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise RequestsFileError(f"{path}: no such requests file (JSON lines, one request per line).") from None
    except OSError as e:
        raise RequestsFileError(f"{path}: cannot be read ({e.strerror}).") from None
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise RequestsFileError(f"{path} is {'a folder' if stat.S_ISDIR(mode) else 'neither a file nor a pipe'}; "
                                "pass a requests file (JSON lines, one request per line).")
    try:
        content = path.read_bytes()
    except OSError as e:
        raise RequestsFileError(f"{path}: cannot be read ({e.strerror}).") from None
    return content.removeprefix(codecs.BOM_UTF8), path.parent if stat.S_ISREG(mode) else Path.cwd()


def read_eval_requests(path: Path, manifest: Manifest | None) -> list[Request]:
    """`h3trt eval --requests`: the requests, a field left out taking the engine bundle's profile and schedule (an
    eager engine's: the model's canvas and the default schedule)."""
    defaults = RequestDefaults.of_bundle(manifest) if manifest is not None else RequestDefaults()
    return [line.request for line in read_request_file(path, EVAL_REQUIRED, defaults)]


def parse_line(text: str, number: int, base: Path, required: tuple[str, ...],
               defaults: RequestDefaults = RequestDefaults()) -> RequestLine:
    """One line -> its request; UserError names the first thing wrong with it."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"not valid JSON ({e.msg} at column {e.colno}).") from None
    return parse_object(data, number, base, required, defaults)


def task_inputs(task: str, n: Names = KEY_WORDS) -> str:
    """What a task takes, in the user's names."""
    return {"t2va": f"no {n.image}, {n.last_image} or {n.refs}", "fl2va": f"{n.image} and/or {n.last_image}, no "
            f"{n.refs}", "ref2va": f"{n.refs} (and no {n.image}/{n.last_image})"}[task]


def parse_object(data, number: int, base: Path, required: tuple[str, ...],
                 defaults: RequestDefaults = RequestDefaults(), names: Names = KEY_WORDS) -> RequestLine:
    """One request object (a decoded line, or a job the server was sent) -> its request; UserError names the first
    thing wrong with it, in `names` (a requests file's keys, or the server's fields). Relative paths are relative to
    `base`."""
    n = names
    if not isinstance(data, dict):
        raise UserError(f"expected a JSON object, got {type(data).__name__}.")
    missing = [k for k in required if k not in data]
    unknown = sorted(set(data) - set(KEYS))
    if missing or unknown:
        raise UserError(" ".join(filter(None, [f"missing {missing}." if missing else "",
                                               f"unknown key(s) {unknown}; allowed: {list(KEYS)}."
                                               if unknown else ""])), field=(missing or unknown)[0])
    rid = None
    if "id" in data:
        rid = _typed(data, "id", str)
        if not ID_PATTERN.fullmatch(rid) or rid.startswith("timeline"):
            raise UserError(f"id {rid!r} must be 1-128 of [A-Za-z0-9._-], start with a letter or digit (it names "
                            "OUT/<id>.mp4) and not start with 'timeline' (the run's own files).", field="id")
    image, last_image = (_path(data, k, base) for k in ("image", "last_image"))
    refs = data.get("refs", [])
    if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
        raise UserError("refs must be a list of file paths.", field="refs")
    refs = tuple(_resolve(r, base) for r in refs)
    if "task" in data:
        task = _typed(data, "task", str)
        if task not in TASKS:
            raise UserError(f"task {task!r} must be one of {list(TASKS)}.", field="task")
        implied = task_of(image, last_image, refs)
        if implied != task:
            raise UserError(f"task {task!r} takes {task_inputs(task, n)}, but {n.request}'s inputs make it "
                            f"{implied}.", field="task")
    width, height = _canvas(data, defaults)
    prompt, seed = _typed(data, "prompt", str, name=n.prompt), _typed(data, "seed", int, DEFAULT_SEED, n.seed)
    stated = ScheduleValues(_typed(data, "steps", int, name=n.steps) if "steps" in data else None,
                            _optional_float(data, "video_shift", n.video_shift),
                            _optional_float(data, "audio_shift", n.audio_shift))
    lora = parse_lora_field(data["lora"]) if data.get("lora") is not None else ()
    schedule = ScheduleChoice.resolve(stated, tuple(u.name for u in lora), defaults.adapter_schedules, defaults.steps)
    request = Request.of(prompt, image, last_image, refs, seed, schedule.steps, width, height,
                         float(_typed(data, "duration", (int, float), defaults.duration, n.duration)),
                         schedule.video_shift, schedule.audio_shift,
                         float(_typed(data, "guidance", (int, float), DEFAULT_GUIDANCE, n.guidance)),
                         None if data.get("negative_prompt") is None else _typed(data, "negative_prompt", str,
                                                                                 name=n.negative_prompt),
                         **with_bundle_sparse(request_profile_fields(data), defaults.sparse),
                         vsa_sparsity=_vsa_sparsity(data), lora=lora, schedule_from=schedule.origin)
    return RequestLine(number, rid, request)


def _canvas(data: dict, defaults: RequestDefaults) -> tuple[int | None, int | None]:
    """(width, height) from "resolution": "WxH", or "width" and "height", else the defaults."""
    if "resolution" in data:
        if "width" in data or "height" in data:
            raise UserError("give the canvas as resolution 'WIDTHxHEIGHT' or as width and height, not both.",
                            field="resolution")
        match = re.fullmatch(r"(\d+)x(\d+)", str(data["resolution"]))
        if not match:
            raise UserError(f"resolution must be 'WIDTHxHEIGHT' such as '1344x768', got {data['resolution']!r}.",
                            field="resolution")
        return int(match[1]), int(match[2])
    if ("width" in data) != ("height" in data):
        raise UserError("width and height go together: give both, or resolution 'WIDTHxHEIGHT', or neither.",
                        field="width")
    if "width" in data:
        return _typed(data, "width", int), _typed(data, "height", int)
    return defaults.width, defaults.height


def _typed(data: dict, key: str, kind, default=None, name: str | None = None):
    """data[key] (or `default`) as `kind`; `name`: what the user calls the field (default: the key)."""
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, kind):
        what = {str: "a string", int: "an integer"}.get(kind, "a number")
        raise UserError(f"{name or key} must be {what}, got {json.dumps(value)}.", field=key)
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{name or key} must be finite, got {value}.", field=key)
    return value


def _vsa_sparsity(data: dict) -> float | None:
    sparsity = _optional_float(data, "vsa_sparsity")
    if sparsity is not None and not 0.0 <= sparsity < 1.0:
        raise UserError(f"vsa_sparsity is the share of video key tiles a FastH3-VSA model skips, 0 <= s < 1 (0: "
                        f"dense attention, the coarse branch kept), got {sparsity!r}.", field="vsa_sparsity")
    return sparsity


def _optional_float(data: dict, key: str, name: str | None = None) -> float | None:
    return None if data.get(key) is None else float(_typed(data, key, (int, float), name=name))


def _path(data: dict, key: str, base: Path) -> Path | None:
    return None if data.get(key) is None else _resolve(_typed(data, key, str), base)


def _resolve(value: str, base: Path) -> Path:
    """Relative paths are relative to the requests file, so a batch folder can move as a whole."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


# The API's values as the schema's -------------------------------------------------------------------------------------

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


# Profiles and the step cache's knobs ---------------------------------------------------------------------------------

# A step-cache knob (StepCacheConfig's field) -> the flag that states it; request keys are the flags' names with
# underscores (cache_threshold, ...), where a request may state them (REQUEST_KEYS).
CACHE_FLAGS = {"threshold": "--cache-threshold", "warmup": "--cache-warmup", "max_skip_steps": "--cache-max-skip",
               "retention_ratio": "--cache-retention", "mag_ratios": "--mag-ratios", "calibrate": "--mag-calibrate"}
# What a request line or an API job may state beside the profile. MagCache stays on the command line: it needs the
# model's ratios, measured by an --mag-calibrate run.
REQUEST_KEYS = {"cache": "kind", "cache_threshold": "threshold", "cache_warmup": "warmup",
                "cache_max_skip": "max_skip_steps"}


SPARSE_KEYS = ("sparse_attention", "sparse_dense_steps", "sparse_min_seq")  # request keys, as the flags' names


def profile_fields(profile: str | None, cache: str | None = None, sparse_attention: float | None = None,
                   sparse_dense_steps: int | None = None, sparse_min_seq: int | None = None, where: str = "--",
                   **cache_knobs) -> dict:
    """The request fields (request/request.py Request.of's) a profile and the explicitly stated knobs give: `cache` (the
    step-cache kind, --cache), `cache_knobs` (StepCacheConfig's fields, each None when not stated), the sparsity.
    A knob given explicitly overrides the profile's value for it; `cache` naming another kind than the profile's
    replaces the profile's step cache (its knobs were the other kind's). The sparse values are checked here, before
    any model loads (models/sparse/plan.py; `where` "--" names the flags in a message, "" the request keys)."""
    base = None
    if profile is not None:
        if profile not in PROFILES:
            raise UserError(f"profile {profile!r} is not one of {list(PROFILE_NAMES)} (README, 'Speed profiles').",
                            field="profile")
        base = PROFILES[profile]
    stated = {k: v for k, v in cache_knobs.items() if v is not None}
    unknown = set(stated) - set(CACHE_FLAGS)
    if unknown:
        raise TypeError(f"profile_fields got unknown step-cache knobs {sorted(unknown)}.")
    kind = cache if cache is not None else (base.cache.kind if base is not None and base.cache else None)
    fields = {"profile": profile, "cache": None}
    if kind is None:
        if stated:
            flags = " ".join(CACHE_FLAGS[k] for k in CACHE_FLAGS if k in stated)
            none = f", and --profile {profile} has no step cache" if base is not None else ""
            raise UserError(f"{flags} configure step caching{none}; add --cache first-block or --cache mag.",
                            field="cache")
    else:
        start = {}
        if base is not None and base.cache is not None and base.cache.kind == kind:
            start = {k: v for k, v in asdict(base.cache).items() if k != "kind"}
            start["mag_ratios"] = base.cache.mag_ratios
        start.setdefault("threshold", DEFAULT_THRESHOLDS[kind])
        fields["cache"] = StepCacheConfig(kind, **{**start, **stated})
    for name, given, own in (("sparse_attention", sparse_attention, base.sparse_attention if base else None),
                             ("sparse_dense_steps", sparse_dense_steps, base.sparse_dense_steps if base else None)):
        value = given if given is not None else own
        if value is not None:
            fields[name] = value
    if sparse_min_seq is not None:
        fields["sparse_min_seq"] = sparse_min_seq
    sparse_settings(fields.get("sparse_attention"), fields.get("sparse_dense_steps"), sparse_min_seq, where)
    return fields


def with_bundle_sparse(fields: dict, defaults: SparseSettings | None) -> dict:
    """`fields` (profile_fields' or request_profile_fields' request fields) with a bundle's default sparse settings
    (h3trt build --sparse-attention; None: it has none) filling each sparse knob neither the request nor its profile
    set: an explicit value (a flag, a key, a profile's) > the bundle's default > the built-in default (dense)."""
    if defaults is None:
        return fields
    own = {"sparse_attention": defaults.sparsity, "sparse_dense_steps": defaults.dense_steps,
           "sparse_min_seq": defaults.min_seq}
    return {**{k: v for k, v in own.items() if fields.get(k) is None}, **fields}


def request_profile_fields(data: dict) -> dict:
    """A request object's "profile" and step-cache keys (REQUEST_KEYS), and its sparse keys where it states them, ->
    the request fields (`profile_fields`); {} when it states none of them. UserError names the key at fault."""
    profile = data.get("profile")
    if profile is not None and not isinstance(profile, str):
        raise UserError(f"profile must be one of {list(PROFILE_NAMES)}, got {profile!r}.", field="profile")
    knobs = {}
    for key, knob in REQUEST_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        if knob == "kind":
            if value in ("none", "off", "", False):
                raise UserError(f"cache {value!r} is not a step cache: a request runs none unless it or its profile "
                                "asks for one; leave cache out, with no profile or profile 'lossless'.", field=key)
            if value != "first-block":
                raise UserError(f"cache must be 'first-block' in a request, got {value!r} (MagCache needs the "
                                "model's ratios: h3trt run --cache mag --mag-ratios ...).", field=key)
        elif isinstance(value, bool) or not isinstance(value, (int, float) if knob == "threshold" else int):
            what = "a number" if knob == "threshold" else "a whole number"
            raise UserError(f"{key} must be {what}, got {value!r}.", field=key)
        elif isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{key} must be finite, got {value}.", field=key)
        else:
            check_knob(knob, value, flags=False)
        knobs[knob] = float(value) if knob == "threshold" else value
    sparse = {k: data[k] for k in SPARSE_KEYS if data.get(k) is not None}
    if profile is None and not knobs and not sparse:
        return {}
    kind = knobs.pop("kind", None)
    base = PROFILES.get(profile)  # an unknown name is refused by profile_fields, by name
    if knobs and kind is None and (profile is None or (base is not None and base.cache is None)):
        keys = ", ".join(k for k, f in REQUEST_KEYS.items() if f in knobs)
        none = f", and profile {profile!r} has no step cache" if profile is not None else ""
        raise UserError(f"{keys} configure step caching{none}; add \"cache\": \"first-block\" or a profile "
                        "that caches (quality, balanced, fast).", field=keys.split(", ")[0])
    return profile_fields(profile, kind, **sparse, where="", **knobs)
