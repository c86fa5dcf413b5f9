"""The typed records `h3trt build`'s phases return (h3trt/build/builder.py runs them; stream.py is the block-at-a-time
form of load, calibrate and bake)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..calibration.recipe import QuantRecipe
from ..engines.manifest import AdalnRecord
from ..models.checkpoint.reader import TransformerSource
from ..models.dit import H3DiT
from ..models.distilled.families import Distilled, load_distilled
from ..models.distilled.pdd import HEAD_WEIGHTS, PDD_PREFIX
from ..models.sampler import Schedule
from .block_loader import BlockLoader
from .config import BuildConfig


@dataclass(frozen=True)
class LoadedDiT:
    """Phase 1: the model (LoRAs merged), where it came from, and the schedules the bundle bakes."""

    model: H3DiT
    source: TransformerSource
    schedules: tuple[Schedule, ...]  # --steps and the shifts (the checkpoint's unless given); the first: the default
    loras: tuple[dict, ...]  # what merge_loras merged: the manifest's record
    seconds: float
    distilled: Distilled | None = None  # the --distilled file fused into the model (PDD: its heads per forward)
    distilled_record: dict | None = None  # the manifest's: that file's, or a full FastH3 export's sidecar
    # A streamed build's blocks (build/stream.py): `model`'s blocks stay on the meta device and this brings each to
    # the device when a phase needs it (its --distilled patches fused as each arrives); None: the whole DiT is on
    # the device.
    blocks: BlockLoader | None = None

    def final_extra(self) -> dict[str, torch.Tensor]:
        """What weights/final.safetensors holds beside the final layer's weights: a PDD file's fused heads, one per
        forward (engines/bundle.py picks one per evaluation)."""
        if self.distilled is None or self.distilled.heads is None:
            return {}
        return {f"{PDD_PREFIX}{name}": self.distilled.heads[name] for name in HEAD_WEIGHTS}


def read_distilled(config: BuildConfig, cfg) -> tuple[Distilled | None, dict | None]:
    """The --distilled file read for a model of `cfg` (None: none given), and the manifest's distilled record: that
    file's, or a full FastH3 export's sidecar (BuildConfig.contract), or None."""
    distilled = (load_distilled(config.distilled, cfg, config.task, config.distilled_serving)
                 if config.distilled is not None else None)
    contract = config.contract
    return distilled, (distilled.record() if distilled is not None else contract[1] if contract is not None else None)


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
