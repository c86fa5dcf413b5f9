"""What an adapter is, read from its file or its slot (`AdapterInfo`: what GET /v1/loras lists): its rank, the
linears it adapts, its size and the schedule it brings."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..models.config import H3Config
from ..models.lora_format import LoraFile, read_lora
from ..models.lora_targets import native_target, route
from .schedule import file_schedule
from .slots import SlotRecord
from .spec import AdapterSpec


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
    schedule: dict = field(default_factory=dict)  # the schedule it brings (schedule.py), by key; {}: none

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
