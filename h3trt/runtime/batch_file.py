"""The requests file of `h3trt run --requests`: one JSON object per line, every line validated (JSON, keys, types, task
against its inputs, then `prepare`: files readable, canvas and duration allowed) before any model loads; every error
names its line, and all errors are reported at once."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from .request import CanvasDefaults, Request, prepare

TASKS = ("t2va", "fl2va", "ref2va")
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
REQUIRED_KEYS = ("id", "task", "prompt")
OPTIONAL_KEYS = ("image", "last_image", "refs", "seed", "steps", "resolution", "duration", "video_shift",
                 "audio_shift")
MAX_LISTED_ERRORS = 20  # a file with hundreds of bad lines lists the first 20 and counts the rest


class BatchFileError(ValueError):
    """A requests file that cannot be run as a whole; the message lists every bad line."""



@dataclass(frozen=True)
class BatchItem:
    """One validated line of a requests file."""

    id: str
    line: int  # 1-based line number in the file
    request: Request
    key: tuple  # (task, height, width, frames, steps, video_shift, audio_shift): requests that may share a batch



def parse_requests(path: Path, canvas: CanvasDefaults, default_steps: int = 50) -> list[BatchItem]:
    """Every line of a JSONL requests file, validated; raises BatchFileError listing every bad line. A line without
    "steps" takes `default_steps` (a bundle's baked schedule, else 50)."""
    path = Path(path)
    if not path.is_file():
        raise BatchFileError(f"{path}: no such requests file.")
    items, errors, seen = [], [], {}
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            errors.append(f"{path}:{number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                          "save the file as UTF-8.")
            continue
        if not text.strip():
            continue
        try:
            item = _parse_line(text, number, path.parent, canvas, default_steps)
        except (ValueError, OSError) as e:
            errors.append(f"{path}:{number}: {' '.join(str(e).split())}")
            continue
        if item.id in seen:
            errors.append(f"{path}:{number}: duplicate id {item.id!r} (first on line {seen[item.id]}); ids name the "
                          "output files, so each must be unique.")
            continue
        seen[item.id] = number
        items.append(item)
    if errors:
        listed = errors[:MAX_LISTED_ERRORS] + ([f"and {len(errors) - MAX_LISTED_ERRORS} more"]
                                               if len(errors) > MAX_LISTED_ERRORS else [])
        raise BatchFileError(f"{path}: {len(errors)} bad line(s), nothing was run: " + "; ".join(listed))
    if not items:
        raise BatchFileError(f"{path}: no requests (one JSON object per line).")
    return items


def _parse_line(text: str, number: int, base: Path, canvas: CanvasDefaults, default_steps: int = 50) -> BatchItem:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno}).") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}.")
    missing = [k for k in REQUIRED_KEYS if k not in data]
    unknown = sorted(set(data) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if missing or unknown:
        raise ValueError(" ".join(filter(None, [f"missing {missing}." if missing else "",
                                                f"unknown key(s) {unknown}; allowed: "
                                                f"{list(REQUIRED_KEYS + OPTIONAL_KEYS)}." if unknown else ""])))
    rid = _typed(data, "id", str)
    if not ID_PATTERN.fullmatch(rid) or rid.startswith("timeline"):
        raise ValueError(f"id {rid!r} must be 1-128 of [A-Za-z0-9._-], start with a letter or digit (it names "
                         "OUT/<id>.mp4) and not start with 'timeline' (the run's own files).")
    task = _typed(data, "task", str)
    if task not in TASKS:
        raise ValueError(f"task {task!r} must be one of {list(TASKS)}.")
    image, last_image = (_path(data, k, base) for k in ("image", "last_image"))
    refs = data.get("refs", [])
    if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
        raise ValueError("refs must be a list of file paths.")
    refs = tuple(_resolve(r, base) for r in refs)
    implied = "ref2va" if refs else "fl2va" if (image or last_image) else "t2va"
    if implied != task:
        needs = {"t2va": "no image, last_image or refs", "fl2va": "image and/or last_image, no refs",
                 "ref2va": "refs (and no image/last_image)"}
        raise ValueError(f"task {task!r} takes {needs[task]}, but the line's inputs make it {implied}.")
    width = height = None
    if "resolution" in data:
        match = re.fullmatch(r"(\d+)x(\d+)", str(data["resolution"]))
        if not match:
            raise ValueError(f"resolution must be 'WIDTHxHEIGHT' such as '1344x768', got {data['resolution']!r}.")
        width, height = int(match[1]), int(match[2])
    request = Request(_typed(data, "prompt", str), image, last_image, refs, _typed(data, "seed", int, 42),
                      _typed(data, "steps", int, default_steps), width, height,
                      float(_typed(data, "duration", (int, float), 5.0)),
                      _optional_float(data, "video_shift"), _optional_float(data, "audio_shift"))
    prepared = prepare(request, canvas)  # inputs readable, canvas and duration allowed; dropped, re-read at run time
    geo = prepared.geometry
    key = (task, geo.height, geo.width, geo.num_frames, request.steps, request.video_shift, request.audio_shift)
    return BatchItem(rid, number, request, key)


def _typed(data: dict, key: str, kind, default=None):
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, kind):
        name = {str: "a string", int: "an integer"}.get(kind, "a number")
        raise ValueError(f"{key} must be {name}, got {json.dumps(value)}.")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key} must be finite, got {value}.")
    return value


def _optional_float(data: dict, key: str) -> float | None:
    return None if data.get(key) is None else float(_typed(data, key, (int, float)))


def _path(data: dict, key: str, base: Path) -> Path | None:
    return None if data.get(key) is None else _resolve(_typed(data, key, str), base)


def _resolve(value: str, base: Path) -> Path:
    """Relative paths are relative to the requests file, so a batch folder can move as a whole."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def check_bundle_batch(manifest: dict, max_batch: int) -> None:
    """Refuse --max-batch > 1 on a bundle whose DiT segments were compiled for batch 1: a segment's first activation
    ([B, ...]) without a dynamic dimension 0 has its batch size baked into the artifact."""
    if max_batch == 1:
        return
    static = sorted(name for name, entry in manifest["segments"].items()
                    if not name.startswith(("video_decoder", "audio_decoder"))
                    and "0" not in {str(d) for d in entry.get("dynamic", {}).get(entry["inputs"][0], {})})
    if static:
        raise ValueError(f"--max-batch {max_batch}: this bundle's DiT segments {static} are compiled for batch 1 (the "
                         "batch dimension is static in the artifacts); pass --max-batch 1 with --engine, or serve "
                         "batches from --model (eager).")

