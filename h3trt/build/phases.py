"""The typed records `h3trt build`'s phases return (h3trt/build/builder.py runs them; stream.py is the block-at-a-time
form of load, calibrate and bake)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..calibration.recipe import QuantRecipe
from ..engines.manifest import AdalnRecord
from ..models.checkpoint import TransformerSource
from ..models.dit import H3DiT
from ..models.sampler import Schedule
from .block_loader import BlockLoader


@dataclass(frozen=True)
class LoadedDiT:
    """Phase 1: the model (LoRAs merged), where it came from, and the schedules the bundle bakes."""

    model: H3DiT
    source: TransformerSource
    schedules: tuple[Schedule, ...]  # --steps and the shifts (the checkpoint's unless given); the first: the default
    loras: tuple[dict, ...]  # what merge_loras merged: the manifest's record
    seconds: float
    # A streamed build's blocks (build/stream.py): `model`'s blocks stay on the meta device and this brings each to
    # the device when a phase needs it; None: the whole DiT is on the device.
    blocks: BlockLoader | None = None


@dataclass(frozen=True)
class Calibration:
    """Phase 2: the recipe the compiled blocks quantize with (None: dense, or tensorrt, whose Q/DQ nodes carry the
    scales), and the manifest's quant record (None: not quantized)."""

    recipe: QuantRecipe | None
    quant: dict | None


@dataclass(frozen=True)
class BakedWeights:
    """Phase 3: the bytes of each weights file, and how AdaLN is served."""

    weight_bytes: dict[str, int]
    adaln: AdalnRecord


@dataclass(frozen=True)
class Compiled:
    """Phase 4: each segment's manifest entry; the specs and example inputs the check runs (none for tensorrt)."""

    segments: dict[str, dict]
    specs: dict
    examples: dict[str, list[torch.Tensor]]
    tensorrt: dict | None  # tensorrt: the plans' flavour, version and targets
    seconds: float
