"""One adapter a request asks for (its `lora` field's entries): what the request states, what admission resolved it
to, and what the worker runs (resident.py ResidentAdapters) and a batch keys on; and the `lora` field itself,
read (`parse_lora_field`) and written back (`lora_field`); and the one bound on a LoRA's strength (its scale),
for a merged LoRA (--lora FILE:SCALE) and an adapter (--adapter, a request's `lora`, POST /v1/loras) alike."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import UserError

# A LoRA's strength (its scale) is a finite number at most this far from 0, either sign: well past any strength in use
# (ComfyUI's LoRA loaders offer -20..20 to -100..100), and an adapter at 1e30 held a worker through a whole denoise to
# fail as numerical_error. One bound for --lora, --adapter, a request's `lora` and POST /v1/loras.
MAX_LORA_SCALE = 100.0
SCALE_RANGE = f"a finite number from {-MAX_LORA_SCALE:g} to {MAX_LORA_SCALE:g} (1.0: as trained)"


def scale_in_range(scale: int | float) -> bool:
    """Whether `scale` (a number; an integer past a float's range is not in it) lies in the bound."""
    try:
        value = float(scale)
    except OverflowError:
        return False
    return math.isfinite(value) and abs(value) <= MAX_LORA_SCALE


@dataclass(frozen=True)
class AdapterUse:
    """One adapter a request asks for: its resident name and strength (None: the adapter's default). Resolved (a
    server's admission: AdapterCatalog.resolve), it also names the file and the sha256 it had then, and the scale
    is filled in: the worker runs that file only while it still has that hash. Unresolved (run's front doors, whose
    adapters are fixed for the process), the worker resolves the name against the adapters it started with."""

    name: str
    scale: float | None = None
    file: str | None = None  # the adapter's file, as admission resolved it
    sha256: str | None = None  # that file's sha256 then

    def to_json(self) -> dict:
        """A resolved use as a job's row keeps it (and `from_json` reads it back)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> AdapterUse:
        return cls(data["name"], data["scale"], data["file"], data["sha256"])

    def shown(self) -> dict:
        """A resolved use as a job object and a clip's record show it: the file's name, never the server's path."""
        return {"name": self.name, "file": Path(self.file).name, "sha256": self.sha256, "scale": self.scale}

    @property
    def batch_part(self) -> tuple:
        """What this use adds to a batch key: requests with different adapters or strengths never share a batched
        evaluation (one evaluation carries one adapter set); nor do two files under one name (a reload)."""
        return (self.name, self.scale) if self.sha256 is None else (self.name, self.scale, self.sha256)


def parse_lora_field(value) -> tuple[AdapterUse, ...]:
    """A request's `lora`: a list of {"name": str, "scale": a number in range (optional)}, each name once."""
    shape = 'lora must be a list of {"name": ..., "scale": ...} objects'
    if not isinstance(value, list):
        raise UserError(f"{shape}, got {json.dumps(value)}.", field="lora")
    uses = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or set(item) - {"name", "scale"}:
            raise UserError(f"{shape} (name a string, scale optional), got {json.dumps(item)}.", field="lora")
        scale = item.get("scale")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not scale_in_range(scale)):
            raise UserError(f"lora {item['name']!r}: scale must be {SCALE_RANGE}, got {json.dumps(scale)}.",
                            field="lora")
        uses.append(AdapterUse(item["name"], None if scale is None else float(scale)))
    names = [u.name for u in uses]
    if len(set(names)) != len(names):
        raise UserError(f"lora names {names}: each adapter once.", field="lora")
    return tuple(uses)


def lora_field(uses: tuple[AdapterUse, ...]) -> list[dict]:
    """A request's adapters as its `lora` field (Request.flat: a record's request)."""
    return [{"name": u.name, **({"scale": u.scale} if u.scale is not None else {})} for u in uses]


def batch_key(uses: tuple[AdapterUse, ...]) -> tuple:
    """The part of a batch key an adapter set makes (AdapterUse.batch_part, each use's): BatchKey's and
    jobs/work.py layout_key's."""
    return tuple(u.batch_part for u in uses)
