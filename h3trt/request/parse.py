"""The requests file of `h3trt run --requests` and `h3trt eval --requests`: one schema, one parser.

JSON lines, one object per line (blank lines skipped), UTF-8:

    {"id": "fox", "task": "t2va", "prompt": "a red fox runs", "seed": 42, "steps": 50, "resolution": "1344x768",
     "duration": 5, "image": "first.png", "last_image": "last.png", "refs": ["a.png", "b.wav"],
     "video_shift": 12, "audio_shift": 3, "guidance": 1, "negative_prompt": "...", "profile": "balanced",
     "cache": "first-block", "cache_threshold": 0.1, "cache_warmup": 4, "cache_max_skip": 3,
     "lora": [{"name": "style", "scale": 0.8}]}

`profile` (request/profiles.py) and the first-block step-cache keys: a key stated overrides the profile's value.
`lora`: resident adapters by name (`--adapter NAME=FILE[:SCALE]`; scale left out: the adapter's default), adapters/
use.py; an adapter with its own schedule gives a line that names it the steps and shifts it leaves out
(request/parts.py ScheduleChoice.resolve).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from ..adapters.use import parse_lora_field
from ..engines.manifest import Manifest
from ..errors import UserError
from ..models.checkpoint.reader import TASKS
from ..models.packing import DEFAULT_DURATION
from ..models.sampler import DEFAULT_GUIDANCE, DEFAULT_SEED, DEFAULT_STEPS, ScheduleValues
from ..models.sparse.plan import SparseSettings
from .fields import KEY_WORDS, KEYS, Names  # the schema's keys and their words, from its one table of fields
from .parts import CanvasDefaults, ScheduleChoice, task_of
from .profiles import request_profile_fields, with_bundle_sparse
from .request import Request

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
    compares what its lines (or --profile) state. `canvas`: how the model picks a canvas a request leaves out (its
    geometry is resolved at admission; a server's job row of before is resolved again when it is taken)."""

    steps: int = DEFAULT_STEPS
    width: int | None = None  # None (with height None): the model picks the canvas
    height: int | None = None
    duration: float = DEFAULT_DURATION
    sparse: SparseSettings | None = None  # a bundle's --sparse-attention defaults (profiles.with_bundle_sparse)
    # The resident adapters' own schedules, by name (adapters/schedule.py adapter_schedules): a line naming one in its
    # "lora" and leaving steps or a shift out takes the adapter's
    adapter_schedules: Mapping[str, ScheduleValues] = field(default_factory=dict)
    canvas: CanvasDefaults = CanvasDefaults()

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
