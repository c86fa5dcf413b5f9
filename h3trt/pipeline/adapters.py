"""Resident LoRA adapters, chosen per request (issue 38, items 2 and 4: a checkpoint, the embedded tiny model, or a
bundle built with --lora-slots N --lora-max-rank R, whose slots are the bundle's own: `check_bundle_specs`).

  - `AdapterSpec`: one `--adapter NAME=FILE[:SCALE]` of `h3trt serve` / `h3trt run` (SCALE: the adapter's default
    strength). Unlike `--lora FILE[:SCALE]`, which merges a LoRA into the weights for every request, an adapter stays
    beside the weights (models/lora_slots.py) and only the requests that name it get it. It may bring its own
    schedule (a Turbo LoRA's steps and shifts: `@steps=8,video_shift=5`, or its file's metadata), which a request
    that names it and leaves those out runs (pipeline/adapter_schedule.py).
  - `AdapterUse`: one entry of a request's `lora` field, [{"name": ..., "scale": ...}] (scale left out: the adapter's
    default), read by `parse_lora_field` and checked against the resident set by `check_adapters` (admission).
  - `ResidentAdapters`: the LoraSlots of one pipeline, one slot per resident adapter, loaded once when the rank loads
    its model (every rank of a replica group: sp and cfg ranks hold the same adapters); `select` is what a request's
    DiT evaluations carry (None for a request without adapters: the base model, bit for bit).

Batches: one evaluation carries one adapter set (lora_slots' module doc), so the adapter set is part of the key of
requests that may share a batched denoise (`batch_key`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from ..models.config import H3Config
from ..models.lora import LoraScaleError, LoraSpec, native_target, route
from ..models.lora_file import LoraError, LoraFile, read_lora
from ..models.lora_slots import LoraRun, LoraSlots, SlotRecord
from .adapter_schedule import ScheduleValues, file_schedule, split_spec

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
BUNDLE_REFUSAL = ("this bundle was built without LoRA slots, so it serves no per-request adapters; rebuild it with "
                  "h3trt build ... --lora-slots N --lora-max-rank R, or merge the LoRA at build (h3trt build --lora "
                  "FILE[:SCALE]).")
MERGED_NAME = "--lora"  # a bundle's --lora FILE: an adapter on every request, named so in records (never by requests)


class AdapterSpecError(LoraError, argparse.ArgumentTypeError):
    """A malformed --adapter value (an ArgumentTypeError too: argparse shows its message as the flag's error)."""


@dataclass(frozen=True)
class AdapterSpec:
    """One `--adapter NAME=FILE[:SCALE]`: a resident adapter's name, its file and its default strength."""

    name: str
    path: Path
    scale: float = 1.0
    schedule: ScheduleValues = ScheduleValues()  # @steps=..: over its file's own (pipeline/adapter_schedule.py)

    @classmethod
    def parse(cls, text: str) -> "AdapterSpec":
        """NAME=FILE[:SCALE][@KEY=VALUE,...] (a file whose name holds ':' keeps it unless the last part is a number;
        the schedule's keys: adapter_schedule.SCHEDULE_KEYS)."""
        name, sep, rest = str(text).partition("=")
        if not sep or not NAME_PATTERN.fullmatch(name) or not rest:
            raise AdapterSpecError(f"--adapter {text!r}: expected NAME=FILE[:SCALE][@steps=N,video_shift=S], NAME 1-64 "
                                   "of [A-Za-z0-9._-] (requests pick it by that name), e.g. --adapter "
                                   "style=style.safetensors:0.8.")
        try:
            rest, schedule = split_spec(rest, f"--adapter {text!r}")
            file = LoraSpec.parse(rest)  # FILE[:SCALE] as --lora reads it
        except LoraScaleError:
            raise AdapterSpecError(f"--adapter {text!r}: the scale must be a finite number (1.0: as "
                                   "trained).") from None
        except UserError as e:  # argparse shows an ArgumentTypeError's own words
            raise AdapterSpecError(str(e)) from None
        return cls(name, file.path, file.scale, schedule)


def check_specs(specs: tuple[AdapterSpec, ...]) -> None:
    """Distinct names, files that exist, each file's own schedule valid: refused before any model loads."""
    seen = set()
    for s in specs:
        if s.name in seen:
            raise UserError(f"--adapter {s.name}: the name is given twice; each resident adapter needs its own name.")
        seen.add(s.name)
        if not s.path.is_file():
            raise UserError(f"--adapter {s.name}={s.path}: no such file (a LoRA .safetensors).")
    for s in specs:
        file_schedule(s.path)  # its __metadata__ schedule, if any, valid


@dataclass(frozen=True)
class AdapterUse:
    """One adapter a request asks for: its resident name and strength (None: the adapter's default)."""

    name: str
    scale: float | None = None


def parse_lora_field(value) -> tuple[AdapterUse, ...]:
    """A request's `lora`: a list of {"name": str, "scale": finite number (optional)}, each name once."""
    shape = 'lora must be a list of {"name": ..., "scale": ...} objects'
    if not isinstance(value, list):
        raise UserError(f"{shape}, got {json.dumps(value)}.", field="lora")
    uses = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or set(item) - {"name", "scale"}:
            raise UserError(f"{shape} (name a string, scale optional), got {json.dumps(item)}.", field="lora")
        scale = item.get("scale")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(_as_float(scale))):
            raise UserError(f"lora {item['name']!r}: scale must be a finite number (1.0: as trained), got "
                            f"{json.dumps(scale)}.", field="lora")
        uses.append(AdapterUse(item["name"], None if scale is None else _as_float(scale)))
    names = [u.name for u in uses]
    if len(set(names)) != len(names):
        raise UserError(f"lora names {names}: each adapter once.", field="lora")
    return tuple(uses)


def _as_float(number: int | float) -> float:
    """A JSON number as a float; an integer beyond a float's range is infinite (float() would raise)."""
    try:
        return float(number)
    except OverflowError:
        return math.inf


def lora_field(uses: tuple[AdapterUse, ...]) -> list[dict]:
    """A request's adapters as its `lora` field (request_dict, a record's request)."""
    return [{"name": u.name, **({"scale": u.scale} if u.scale is not None else {})} for u in uses]


def check_adapters(uses: tuple[AdapterUse, ...], specs: tuple[AdapterSpec, ...], refusal: str | None = None) -> None:
    """Admission's check of a request's `lora` against what the model holds resident; UserError naming `lora`.
    `refusal`: why this model serves no adapters at all (a bundle without slots), None where it may."""
    if not uses:
        return
    if refusal is not None:
        raise UserError(f"lora: {refusal}", field="lora")
    resident = [s.name for s in specs]
    if len(uses) > len(specs):
        raise UserError(f"lora asks for {len(uses)} adapters, but this model holds {len(specs)} resident "
                        f"({resident or 'none: start it with --adapter NAME=FILE[:SCALE]'}).", field="lora")
    unknown = [u.name for u in uses if u.name not in resident]
    if unknown:
        raise UserError(f"lora names {unknown}, not resident here; the resident adapters are "
                        f"{resident or 'none (start the model with --adapter NAME=FILE[:SCALE])'}.", field="lora")


def check_bundle_dense(uses: tuple[AdapterUse, ...], sparse_attention: float) -> None:
    """A bundle runs adapters in its fused block's twin only (block_lora): its sparse halves have none, so a request
    with both is refused (by admission, naming `lora`) rather than run without its adapters or dense unasked."""
    if uses and sparse_attention > 0:
        raise UserError(f"lora: a bundle runs LoRA adapters on dense attention only (its block-sparse halves have no "
                        f"adapter slots), and this request's sparse attention is {sparse_attention:g} (its own, its "
                        "profile's or the bundle's default); pass sparse_attention 0 (--sparse-attention 0, or a "
                        "dense profile) with lora, or drop lora.", field="lora")


def check_bundle_specs(specs: tuple[AdapterSpec, ...], merged: tuple[LoraSpec, ...], slots, cfg: H3Config,
                       task: str) -> None:
    """`--adapter` (and `--lora`, an adapter on every request) against a bundle's LoRA slots (`slots`: its manifest's
    LoraSlotsRecord, None without any), each file read and routed as the slots will load it; before any model
    loads. One line naming the flag and the fix."""
    flags = [(f"--adapter {s.name}={s.path}", s.path) for s in specs] + [(f"--lora {m.path}", m.path) for m in merged]
    if not flags:
        return
    if slots is None:
        raise UserError(f"{flags[0][0]}: {BUNDLE_REFUSAL}")
    if len(flags) > slots.slots:
        raise UserError(f"--adapter/--lora: {len(flags)} adapters, but this bundle has {slots.slots} LoRA slot(s); "
                        f"pass at most {slots.slots}, or rebuild it with h3trt build ... --lora-slots {len(flags)}.")
    covered = {f"blocks.{i}.{t}" for i in range(cfg.num_layers) for t in slots.targets}
    for flag, path in flags:
        if not Path(path).is_file():
            raise UserError(f"{flag}: no such file (a LoRA .safetensors).")
        info = describe(AdapterSpec("check", Path(path)), cfg, task)
        if info.rank > slots.max_rank:
            raise UserError(f"{flag}: rank {info.rank}, over this bundle's --lora-max-rank {slots.max_rank}; rebuild "
                            f"it with h3trt build ... --lora-max-rank {info.rank}, or merge it (h3trt build --lora).")
        outside = [t for t in info.targets if t not in covered]
        if outside:
            raise UserError(f"{flag} adapts {outside[0]}, which this bundle's slots do not hold (they adapt "
                            f"{list(slots.targets)} of every block); merge it at build instead (h3trt build --lora).")


def batch_key(uses: tuple[AdapterUse, ...]) -> tuple:
    """The part of a batch key an adapter set makes: requests with different adapters or strengths never share a
    batched evaluation (one evaluation carries one adapter set)."""
    return tuple((u.name, u.scale) for u in uses)


@dataclass(frozen=True)
class AdapterInfo:
    """What `GET /v1/loras` lists of one resident adapter, read from its file (no model loaded)."""

    name: str
    file: str
    sha256: str
    scale: float
    rank: int
    targets: tuple[str, ...]  # the native linears it adapts ("blocks.0.attn.qkv_proj", ...)
    size_bytes: int  # its factors, in the file's dtypes
    schedule: dict = field(default_factory=dict)  # the schedule it brings (adapter_schedule.py), by key; {}: none

    def to_json(self) -> dict:
        return {"name": self.name, "file": self.file, "sha256": self.sha256, "scale": self.scale, "rank": self.rank,
                "targets": list(self.targets), "size_bytes": self.size_bytes, "schedule": self.schedule}


def describe(spec: AdapterSpec, cfg: H3Config, task: str, lora: LoraFile | None = None) -> AdapterInfo:
    """One adapter's rank, targets and size, from its file (or `lora`, that file read already) routed to `task`'s
    partition."""
    lora = lora if lora is not None else read_lora(spec.path, cfg.head_dim)
    _, modules = route(lora, task)
    targets = sorted({native_target(m, cfg)[0].removesuffix(".weight") for m in modules})
    return AdapterInfo(spec.name, spec.path.name, lora.sha256, spec.scale,
                       max(f.down.shape[0] for f in modules.values()), tuple(targets),
                       sum(f.down.nbytes + f.up.nbytes for f in modules.values()),
                       spec.schedule.over(file_schedule(spec.path)).given())


class ResidentAdapters:
    """One pipeline's adapters: a slot per spec, of the largest rank among them, loaded once. `slots`: a bundle's
    (engines/bundle.py, allocated at its load), which the adapters are loaded into instead; `merged`: a bundle's
    --lora files, each in a slot of its own after the specs', on every request (no request names them)."""

    def __init__(self, specs: tuple[AdapterSpec, ...], cfg: H3Config, task: str, dtype: torch.dtype,
                 device: torch.device, slots: LoraSlots | None = None, merged: tuple[LoraSpec, ...] = ()):
        self.specs = {s.name: s for s in specs}
        every = [*specs, *(AdapterSpec(MERGED_NAME, m.path, m.scale) for m in merged)]
        files = [read_lora(s.path, cfg.head_dim) for s in every]  # each read (and hashed) once, on every rank
        if slots is None:
            slots = LoraSlots(cfg, task, len(every), max(describe(s, cfg, task, f).rank for s, f in zip(every, files)),
                              dtype, device)
        self.slots = slots
        loaded = [self.slots.load(i, f) for i, f in enumerate(files)]  # over the slots' count: refused by `load`
        self.records: dict[str, SlotRecord] = {s.name: r for s, r in zip(specs, loaded)}
        self._slot = {s.name: i for i, s in enumerate(specs)}
        self.merged = [(len(specs) + i, m.scale, loaded[len(specs) + i]) for i, m in enumerate(merged)]

    def resolved(self, uses: tuple[AdapterUse, ...]) -> list[tuple[str, float]]:
        """(name, scale) of each use, a left-out scale the adapter's default; refuses a name not resident (the
        last-line guard: admission checked it against the model that admitted the request)."""
        unknown = [u.name for u in uses if u.name not in self.specs]
        if unknown:
            raise ValueError(f"lora names {unknown}, not resident on this worker (it holds {list(self.specs)}).")
        return [(u.name, self.specs[u.name].scale if u.scale is None else u.scale) for u in uses]

    def select(self, uses: tuple[AdapterUse, ...]) -> LoraRun | None:
        """What every DiT evaluation of a request with `uses` carries, a bundle's --lora files included (None:
        none)."""
        return self.slots.select([(self._slot[n], s) for n, s in self.resolved(uses)]
                                 + [(slot, scale) for slot, scale, _ in self.merged])

    def record(self, uses: tuple[AdapterUse, ...]) -> list[dict] | None:
        """A clip record's `adapters`: name, file, sha256 and the scale used, for each (None: none)."""
        named = [(n, s, self.records[n]) for n, s in self.resolved(uses)]
        return [{"name": n, "file": r.file, "sha256": r.sha256, "scale": s}
                for n, s, r in named + [(MERGED_NAME, s, r) for _, s, r in self.merged]] or None


def select_adapters(adapters: ResidentAdapters | None, uses: tuple[AdapterUse, ...]) -> LoraRun | None:
    """A request's adapters on a pipeline that may hold none (then a request naming one is refused)."""
    if adapters is not None and adapters.merged:
        return adapters.select(uses)
    if not uses:
        return None
    if adapters is None:
        raise ValueError(f"the request asks for LoRA adapters {[u.name for u in uses]}, but this worker holds none "
                         "(start it with --adapter NAME=FILE[:SCALE]).")
    return adapters.select(uses)
