"""Resident LoRA adapters, chosen per request (issue 38, items 2 and 4: a checkpoint, the embedded tiny model, or a
bundle built with --lora-slots N --lora-max-rank R, whose slots are the bundle's own: `check_bundle_specs`).

  - `AdapterSpec`: one `--adapter NAME=FILE[:SCALE]` of `h3trt serve` / `h3trt run` (SCALE: the adapter's default
    strength). Unlike `--lora FILE[:SCALE]`, which merges a LoRA into the weights for every request, an adapter stays
    beside the weights (models/lora_slots.py) and only the requests that name it get it. It may bring its own
    schedule (a Turbo LoRA's steps and shifts: `@steps=8,video_shift=5`, or its file's metadata), which a request
    that names it and leaves those out runs (pipeline/adapter_schedule.py).
  - `AdapterUse` (h3trt/adapters/use.py): one entry of a request's `lora` field, [{"name": ..., "scale": ...}]
    (scale left out: the adapter's default), read by its module's `parse_lora_field` and checked against the
    resident set by `check_adapters` (admission). A server's admission resolves it (pipeline/adapter_catalog.py):
    the file and its sha256 as they were when the job was admitted, which the job runs with whatever the set becomes
    meanwhile.
  - `SlotShape`: how many adapters the slots hold at once (one evaluation carries at most that many) and their max
    rank: from the flags, else fitted to the adapters at start (`h3trt serve --lora-slots / --lora-max-rank`).
  - `ResidentAdapters`: the LoraSlots of one pipeline, used as a cache of adapters keyed by their file's sha256:
    filled with the adapters at start, an adapter a request names loaded on demand into a free slot, else into the
    least recently used slot that the same evaluation does not use. Every rank of a replica group (sp and cfg ranks)
    takes the same decisions: they are a function of the sequence of requests, which every rank of a group runs in
    the same order. `select` is what a request's DiT evaluations carry (None for a request without adapters: the
    base model, bit for bit).

Batches: one evaluation carries one adapter set (lora_slots' module doc), so the adapter set is part of the key of
requests that may share a batched denoise (adapters/use.py `batch_key`).
"""

from __future__ import annotations

import argparse
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..adapters.use import AdapterUse  # its home since issue 48; importers here move in its phase 2
from ..engines.caps import NO_LORA_SLOTS
from ..errors import UserError
from ..models.config import H3Config
from ..models.distilled.families import turbo_alpha
from ..models.lora import SCALE_RANGE, LoraScaleError, LoraSpec, native_target, route
from ..models.lora_file import LoraError, LoraFile, read_lora
from ..models.lora_slots import BLOCK_TARGETS, LoraRun, LoraSlots, SlotRecord
from ..request.parts import ScheduleValues
from .adapter_schedule import file_schedule, split_spec

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# `h3trt serve --lora-dir`'s slots when the flags leave them out: room to load adapters while it runs (the set may
# change), at least as many and as large as the adapters it starts with.
SERVE_SLOTS, SERVE_MAX_RANK = 4, 64
BUNDLE_REFUSAL = NO_LORA_SLOTS  # a bundle's caps say it (engines/caps.py)
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
    # A --lora-dir file: a server that cannot use it starts without it (skipped, and says why); an --adapter's
    # refusal stops the start instead (the operator named that file)
    from_folder: bool = False

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
            raise AdapterSpecError(f"--adapter {text!r}: the scale must be {SCALE_RANGE}.") from None
        except UserError as e:  # argparse shows an ArgumentTypeError's own words
            raise AdapterSpecError(str(e)) from None
        return cls(name, file.path, file.scale, schedule)


def folder_specs(folder: Path) -> tuple[AdapterSpec, ...]:
    """`--lora-dir DIR`: every *.safetensors in DIR, named by its file stem, at scale 1.0 (sorted by name). Nothing
    is read here: the server's catalog checks each file at start and skips those it cannot use
    (pipeline/adapter_catalog.py)."""
    if not folder.is_dir():
        raise UserError(f"--lora-dir {folder}: not a folder; pass the folder that holds the LoRA .safetensors files.")
    return tuple(AdapterSpec(path.stem, path, from_folder=True) for path in sorted(folder.glob("*.safetensors")))


def check_specs(specs: tuple[AdapterSpec, ...]) -> None:
    """The --adapter flags (not --lora-dir's files, which the server checks and may skip): distinct names, files
    that exist, each file's own schedule valid; refused before any model loads."""
    flags = [s for s in specs if not s.from_folder]
    seen = set()
    for s in flags:
        if s.name in seen:
            raise UserError(f"--adapter {s.name}: the name is given twice; each resident adapter needs its own name.")
        seen.add(s.name)
        if not s.path.is_file():
            raise UserError(f"--adapter {s.name}={s.path}: no such file (a LoRA .safetensors).")
    for s in flags:
        file_schedule(s.path)  # its __metadata__ schedule, if any, valid


def check_adapters(uses: tuple[AdapterUse, ...], specs: tuple[AdapterSpec, ...], refusal: str | None = None,
                   slots: int | None = None) -> None:
    """Admission's check of a request's `lora` against what the model holds resident, and at most `slots` adapters
    (one evaluation's); UserError naming `lora`. `refusal`: why this model serves no adapters at all (a bundle without
    slots), None where it may."""
    if not uses:
        return
    if refusal is not None:
        raise UserError(f"lora: {refusal}", field="lora")
    resident = [s.name for s in specs]
    if len(uses) > len(specs):
        raise UserError(f"lora asks for {len(uses)} adapters, but this model holds {len(specs)} resident "
                        f"({resident or 'none: start it with --adapter NAME=FILE[:SCALE]'}).", field="lora")
    if slots is not None and len(uses) > slots:
        raise UserError(f"lora asks for {len(uses)} adapters, but one evaluation carries at most {slots} (the "
                        "model's LoRA slots); ask for fewer.", field="lora")
    unknown = [u.name for u in uses if u.name not in resident]
    if unknown:
        raise UserError(f"lora names {unknown}, not resident here; the resident adapters are "
                        f"{resident or 'none (start the model with --adapter NAME=FILE[:SCALE])'}.", field="lora")


def check_bundle_sparse(uses: tuple[AdapterUse, ...], sparse_attention: float, segments: dict) -> None:
    """A bundle runs a sparse evaluation's adapters in its halves' twins (block_pre_lora, block_post_lora: h3trt build
    --sparse-attention with --lora-slots); one built by an earlier h3trt has the halves and the slots but not those
    twins, so a request with both is refused there (by admission, naming `lora`) rather than run without its
    adapters or dense unasked. `segments`: the bundle's manifest's."""
    if uses and sparse_attention > 0 and "block_pre" in segments and "block_lora" in segments \
            and "block_pre_lora" not in segments:
        raise UserError(f"lora: this bundle was built by an earlier h3trt, whose block-sparse halves have no adapter "
                        f"slots, and this request's sparse attention is {sparse_attention:g} (its own, its profile's "
                        "or the bundle's default); rebuild it with this h3trt (h3trt build ... --sparse-attention S "
                        "--lora-slots N --lora-max-rank R), or pass sparse_attention 0 (--sparse-attention 0, or a "
                        "dense profile) with lora.", field="lora")


def check_bundle_specs(specs: tuple[AdapterSpec, ...], merged: tuple[LoraSpec, ...], slots, cfg: H3Config,
                       task: str, folder: Path | None = None) -> None:
    """`--adapter` (and `--lora`, an adapter on every request) against a bundle's LoRA slots (`slots`: its manifest's
    LoraSlotsRecord, None without any), each file read and routed as the slots will load it; before any model
    loads. One line naming the flag and the fix. `folder`: --lora-dir, whose files the server's catalog checks (and
    skips), but which needs the slots too."""
    adapter_flags = [(f"--adapter {s.name}={s.path}", s.path) for s in specs if not s.from_folder]
    flags = adapter_flags + [(f"--lora {m.path}", m.path) for m in merged]
    wanted = [f for f, _ in flags] + ([f"--lora-dir {folder}"] if folder is not None else [])
    if not wanted:
        return
    if slots is None:
        raise UserError(f"{wanted[0]}: {BUNDLE_REFUSAL}")
    # --lora files hold a slot each for good; the adapters share the rest, loaded on demand (ResidentAdapters)
    adapters = len(wanted) > len(merged)
    if len(merged) + adapters > slots.slots:
        needs = f", and {'--adapter' if adapter_flags else '--lora-dir'} needs one more" if adapters else ""
        raise UserError(f"--lora: {len(merged)} file(s) held on every request, but this bundle has {slots.slots} LoRA "
                        f"slot(s){needs}; pass fewer, or rebuild it with h3trt build ... --lora-slots "
                        f"{len(merged) + adapters}.")
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


@dataclass(frozen=True)
class SlotShape:
    """LoRA slots: how many adapters they hold at once (one evaluation carries at most that many) and their max rank
    (an adapter of a larger rank is refused)."""

    num_slots: int
    max_rank: int
    targets: tuple[str, ...] = BLOCK_TARGETS  # the block linears they adapt (a bundle's: its manifest's)

    def __post_init__(self):
        if self.num_slots < 1 or self.max_rank < 1:
            raise UserError(f"--lora-slots {self.num_slots} / --lora-max-rank {self.max_rank}: both must be >= 1.")

    @classmethod
    def fitted(cls, ranks: list[int], num_slots: int | None = None, max_rank: int | None = None,
               room: bool = False, targets: tuple[str, ...] = BLOCK_TARGETS) -> "SlotShape":
        """The flags' values, else slots for the adapters at start (their `ranks`): exactly them, or with `room`
        (a set that may change while it serves) at least SERVE_SLOTS of rank SERVE_MAX_RANK."""
        floor_slots, floor_rank = (SERVE_SLOTS, SERVE_MAX_RANK) if room else (1, 1)
        return cls(num_slots or max(floor_slots, len(ranks)), max_rank or max([floor_rank, *ranks]), tuple(targets))


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


def adapter_rank(lora: LoraFile, task: str) -> int:
    """The largest rank of a LoRA file's modules in `task`'s partition (what its slot must hold)."""
    return max(f.down.shape[0] for f in route(lora, task)[1].values())


def info_of(spec: AdapterSpec, record: SlotRecord) -> AdapterInfo:
    """What GET /v1/loras lists of an adapter, from its slot record (LoraSlots.load: rank, targets and size as the
    slots read them)."""
    return AdapterInfo(spec.name, spec.path.name, record.sha256, spec.scale, record.rank, record.targets, record.nbytes,
                       spec.schedule.over(file_schedule(spec.path)).given())


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
    """One pipeline's adapter slots, a cache keyed by sha256 (module doc): the adapters at start (`specs`) loaded
    first, as many as fit; any other loaded on demand from the file a request's resolved use names.

    `slots`: a bundle's (engines/bundle.py, allocated at its load), used instead of slots of `shape`; `merged`: a
    bundle's --lora files, each pinned in a slot of its own (never evicted) and carried by every evaluation."""

    def __init__(self, specs: tuple[AdapterSpec, ...], cfg: H3Config, task: str, dtype: torch.dtype,
                 device: torch.device, shape: SlotShape | None = None, slots: LoraSlots | None = None,
                 merged: tuple[LoraSpec, ...] = ()):
        self.cfg, self.task = cfg, task
        self._start = {s.name: s for s in specs}
        self.specs: dict[str, AdapterUse] = {}  # a start adapter's name -> its file and sha256, once read
        self._read: dict[str, LoraFile] = {}  # files read to learn their sha256, until a slot takes them
        self.slots = slots  # None until made below: files are read on the host until then
        merged_files = [self._read_file(m.path) for m in merged]
        if self.slots is None:
            if shape is None:  # fitted to the adapters at start: one slot each, so every one is read now anyway
                shape = SlotShape.fitted([adapter_rank(self._file_of(s.name), task) for s in specs]
                                         + [adapter_rank(f, task) for f in merged_files])
            self.slots = LoraSlots(cfg, task, shape.num_slots + len(merged), shape.max_rank, dtype, device,
                                   shape.targets)
        # slot, scale, record of each --lora file: the first slots, held for good
        self.merged = [(i, m.scale, self.slots.load(i, f)) for i, (m, f) in enumerate(zip(merged, merged_files))]
        self._held: OrderedDict[str, int] = OrderedDict()  # sha256 -> slot, the least recently used first
        # The adapters at start fill the free slots; the others are read when a request first names one (a server's
        # --lora-dir may hold many more than its slots, and every rank would read them all at start).
        for spec in specs:
            if len(self._held) >= self.slots.num_slots - len(self.merged):
                break
            self._slot_of(self._use_of(spec.name), busy=set())
        self._read.clear()

    def _read_file(self, path: Path) -> LoraFile:
        """A LoRA file read once: onto the slots' device, hashed as it is read (LoraSlots.read), once they exist."""
        return self.slots.read(path) if self.slots is not None else read_lora(path, self.cfg.head_dim)

    def _file_of(self, name: str) -> LoraFile:
        """A start adapter's file, read once to learn its sha256; kept for the slot that takes it."""
        spec = self._start[name]
        lora = self._read[name] = self._read_file(spec.path)
        self.specs[name] = AdapterUse(name, spec.scale, str(spec.path), lora.sha256)
        return lora

    def _use_of(self, name: str) -> AdapterUse:
        if name not in self.specs:
            self._file_of(name)
        return self.specs[name]

    def resolved(self, uses: tuple[AdapterUse, ...]) -> list[AdapterUse]:
        """Each use with its file, sha256 and scale: as admission resolved it, or by name against the adapters at
        start (a left-out scale the adapter's default); refuses a name it cannot resolve (the last-line guard:
        admission checked it against the model that admitted the request)."""
        unknown = [u.name for u in uses if u.sha256 is None and u.name not in self._start]
        if unknown:
            raise ValueError(f"lora names {unknown}, not resident on this worker (it holds {list(self._start)}).")
        out = []
        for u in uses:
            known = u if u.sha256 is not None else self._use_of(u.name)
            out.append(AdapterUse(u.name, known.scale if u.scale is None else u.scale, known.file, known.sha256))
        return out

    def select(self, uses: tuple[AdapterUse, ...]) -> LoraRun | None:
        """What every DiT evaluation of a request with `uses` carries, a bundle's --lora files included (None: none),
        each adapter in a slot first."""
        chosen, busy = [], set()
        for use in self.resolved(uses):
            slot = self._slot_of(use, busy)
            busy.add(slot)
            chosen.append((slot, use.scale))
        return self.slots.select(chosen + [(slot, scale) for slot, scale, _ in self.merged])

    def _slot_of(self, use: AdapterUse, busy: set[int]) -> int:
        read = self._read.pop(use.name, None)  # a start adapter read to learn its hash: not read again
        if use.sha256 in self._held:
            self._held.move_to_end(use.sha256)
            return self._held[use.sha256]
        if read is None or read.sha256 != use.sha256:
            read = read_resolved(use, self.slots.read)
        return self._put(read, busy)

    def _put(self, lora: LoraFile, busy: set[int]) -> int:
        """Load `lora` into a free slot, else into the least recently used one outside `busy` (this evaluation's)."""
        held = set(self._held.values()) | {slot for slot, _, _ in self.merged}
        free = [slot for slot in range(self.slots.num_slots) if slot not in held]
        if not free:
            victims = [sha for sha, slot in self._held.items() if slot not in busy]
            if not victims:
                raise ValueError(f"one evaluation asks for more adapters than the {self.slots.num_slots} slot(s) hold "
                                 "(admission bounds it by --lora-slots).")
            free = [self._held.pop(victims[0])]
        # a Turbo file at its family's alpha (an alpha-less one: 8 / rank), as --distilled fuses it
        self.slots.load(free[0], turbo_alpha(lora))  # checked whole before the slot is written
        self._held[lora.sha256] = free[0]
        return free[0]

    def record(self, uses: tuple[AdapterUse, ...]) -> list[dict] | None:
        """A clip record's `adapters`: name, file, sha256 and the scale used, for each (None: none)."""
        return ([u.shown() for u in self.resolved(uses)]
                + [{"name": MERGED_NAME, "file": r.file, "sha256": r.sha256, "scale": scale}
                   for _, scale, r in self.merged]) or None


def read_resolved(use: AdapterUse, read) -> LoraFile:
    """The file a resolved use names (read by `read`: LoraSlots.read), only if it still has the sha256 it had when its
    job was admitted: a job never runs another adapter than the one it was admitted with (the file was replaced or
    removed since: it fails, naming it)."""
    path = Path(use.file)
    if not path.is_file():
        raise LoraError(f"lora {use.name!r}: its file {path} is gone since the job was admitted, so the job cannot "
                        "run with the adapter it asked for; put the file back, or load another and submit again.")
    lora = read(path)
    if lora.sha256 != use.sha256:
        raise LoraError(f"lora {use.name!r}: its file {path} changed since the job was admitted (sha256 "
                        f"{use.sha256[:12]}... then, {lora.sha256[:12]}... now); the job runs only the adapter it was "
                        "admitted with: load the new file under a name and submit again.")
    return lora


def select_adapters(adapters: ResidentAdapters | None, uses: tuple[AdapterUse, ...]) -> LoraRun | None:
    """A request's adapters on a pipeline that may hold none (then a request naming one is refused)."""
    if adapters is not None and adapters.merged:
        return adapters.select(uses)
    if not uses:
        return None
    if adapters is None:
        raise ValueError(f"the request asks for LoRA adapters {[u.name for u in uses]}, but this worker holds none "
                         "(start it with --adapter NAME=FILE[:SCALE] or --lora-dir DIR).")
    return adapters.select(uses)
