"""The adapters resident in one pipeline's slots (`ResidentAdapters`): the slots used as a cache of adapters keyed
by their file's sha256, filled with the adapters at start, an adapter a request names loaded on demand into a free slot,
else into the least recently used slot that the same evaluation does not use. Every rank of a replica group (sp and cfg
ranks) takes the same decisions: they are a function of the sequence of requests, which every rank of a group runs in
the same order. `select` is what a request's DiT evaluations carry (None for a request without adapters: the base
model, bit for bit).

Batches: one evaluation carries one adapter set (slots.py's module doc), so the adapter set is part of the key of
requests that may share a batched denoise (use.py `batch_key`).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from ..models.config import H3Config
from ..models.distilled.families import turbo_alpha
from ..models.lora_format import LoraError, LoraFile, read_lora
from .info import adapter_rank
from .merge import LoraSpec
from .shape import SlotShape
from .slots import AdapterRun, AdapterSlots
from .spec import AdapterSpec
from .use import AdapterUse

MERGED_NAME = "--lora"  # a bundle's --lora FILE: an adapter on every request, named so in records (never by requests)


class ResidentAdapters:
    """One pipeline's adapter slots, a cache keyed by sha256 (module doc): the adapters at start (`specs`) loaded
    first, as many as fit; any other loaded on demand from the file a request's resolved use names.

    `slots`: a bundle's (engines/bundle.py, allocated at its load), used instead of slots of `shape`; `pinned`: a
    bundle's --lora files, each pinned in a slot of its own (never evicted) and carried by every evaluation."""

    def __init__(self, specs: tuple[AdapterSpec, ...], cfg: H3Config, task: str, dtype: torch.dtype,
                 device: torch.device, shape: SlotShape | None = None, slots: AdapterSlots | None = None,
                 pinned: tuple[LoraSpec, ...] = ()):
        self.cfg, self.task = cfg, task
        self._start = {s.name: s for s in specs}
        self.specs: dict[str, AdapterUse] = {}  # a start adapter's name -> its file and sha256, once read
        self._read: dict[str, LoraFile] = {}  # files read to learn their sha256, until a slot takes them
        self.slots = slots  # None until made below: files are read on the host until then
        pinned_files = [self._read_file(m.path) for m in pinned]
        if self.slots is None:
            if shape is None:  # fitted to the adapters at start: one slot each, so every one is read now anyway
                shape = SlotShape.fitted([adapter_rank(self._file_of(s.name), task) for s in specs]
                                         + [adapter_rank(f, task) for f in pinned_files])
            self.slots = AdapterSlots(cfg, task, shape.num_slots + len(pinned), shape.max_rank, dtype, device,
                                   shape.targets)
        # slot, scale, record of each --lora file: the first slots, held for good
        self.pinned = [(i, m.scale, self.slots.load(i, f)) for i, (m, f) in enumerate(zip(pinned, pinned_files))]
        self._held: OrderedDict[str, int] = OrderedDict()  # sha256 -> slot, the least recently used first
        # The adapters at start fill the free slots; the others are read when a request first names one (a server's
        # --lora-dir may hold many more than its slots, and every rank would read them all at start).
        for spec in specs:
            if len(self._held) >= self.slots.num_slots - len(self.pinned):
                break
            self._slot_of(self._use_of(spec.name), busy=set())
        self._read.clear()

    def _read_file(self, path: Path) -> LoraFile:
        """A LoRA file read once: onto the slots' device, hashed as it is read (AdapterSlots.read), once they exist."""
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

    def select(self, uses: tuple[AdapterUse, ...]) -> AdapterRun | None:
        """What every DiT evaluation of a request with `uses` carries, a bundle's --lora files included (None: none),
        each adapter in a slot first."""
        chosen, busy = [], set()
        for use in self.resolved(uses):
            slot = self._slot_of(use, busy)
            busy.add(slot)
            chosen.append((slot, use.scale))
        return self.slots.select(chosen + [(slot, scale) for slot, scale, _ in self.pinned])

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
        held = set(self._held.values()) | {slot for slot, _, _ in self.pinned}
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
                   for _, scale, r in self.pinned]) or None


def read_resolved(use: AdapterUse, read) -> LoraFile:
    """The file a resolved use names (read by `read`: AdapterSlots.read), only if it still has the sha256 it had when
    its job was admitted: a job never runs another adapter than the one it was admitted with (the file was replaced or
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


def select_adapters(adapters: ResidentAdapters | None, uses: tuple[AdapterUse, ...]) -> AdapterRun | None:
    """A request's adapters on a pipeline that may hold none (then a request naming one is refused)."""
    if adapters is not None and adapters.pinned:
        return adapters.select(uses)
    if not uses:
        return None
    if adapters is None:
        raise ValueError(f"the request asks for LoRA adapters {[u.name for u in uses]}, but this worker holds none "
                         "(start it with --adapter NAME=FILE[:SCALE] or --lora-dir DIR).")
    return adapters.select(uses)
