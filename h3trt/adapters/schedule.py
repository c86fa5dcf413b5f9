"""An adapter's own schedule (issue 38, item 3: Turbo per request). A few-step LoRA is distilled for its own steps and
sigma shifts (an 8-point grid at video shift 5, say), so one server serves H3's 50-step schedule and the Turbo one
side by side: a request that names the adapter and leaves the schedule out runs the adapter's.

An adapter's schedule, key by key, the later source winning:
  1. its file's safetensors `__metadata__` (METADATA_KEYS: "h3trt.steps", "h3trt.video_shift", "h3trt.audio_shift",
     each a number written as text, as safetensors metadata is), so a Turbo file carries what it was trained for;
  2. its `--adapter NAME=FILE[:SCALE]@steps=8,video_shift=5` (after the last '@': KEY=VALUE pairs, comma-separated,
     keys of SCHEDULE_KEYS).

A request's schedule, key by key: the request's own value; else the value the adapters it names give; else the
model's default (request/parts.py `ScheduleChoice.resolve`, which records which: `ScheduleFrom`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterable

from safetensors import SafetensorError, safe_open

from ..errors import UserError
from ..models.sampler import SCHEDULE_KEYS, ScheduleValues, schedule_value

METADATA_KEYS = {key: f"h3trt.{key}" for key in SCHEDULE_KEYS}  # an adapter file's __metadata__ keys


def split_spec(text: str, where: str) -> tuple[str, ScheduleValues]:
    """An --adapter's FILE[:SCALE] and its schedule: the part after the last '@' when it holds a KEY=VALUE pair (a
    file name with an '@' and no '=' after it is a file name)."""
    head, at, tail = text.rpartition("@")
    if not at or "=" not in tail:
        return text, ScheduleValues()
    return head, ScheduleValues.parse(tail, where)


def file_schedule(path: Path) -> ScheduleValues:
    """The schedule an adapter file's `__metadata__` gives (METADATA_KEYS; none: nothing given). Read once per file
    version: admission asks for it on every request, and a header read is a file open."""
    stat = Path(path).stat()
    return _file_schedule(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _file_schedule(path: str, size: int, mtime_ns: int) -> ScheduleValues:
    try:
        with safe_open(path, "pt") as f:  # the header only: no tensor is read
            meta = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({e}); an adapter is a LoRA .safetensors.") from None
    where = f"{path}: __metadata__"
    return ScheduleValues(**{key: schedule_value(key, meta[name], f"{where} {name}")
                             for key, name in METADATA_KEYS.items() if name in meta})


def adapter_schedules(specs: Iterable) -> dict[str, ScheduleValues]:
    """{name: its schedule} of resident adapters (spec.py AdapterSpec: name, path, schedule), the spec's
    values over its file's; an adapter that gives none is left out."""
    schedules = {s.name: s.schedule.over(file_schedule(s.path)) for s in specs}
    return {name: values for name, values in schedules.items() if values.given()}
