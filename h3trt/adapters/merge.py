"""Merged LoRAs (`--lora FILE[:SCALE]`): LoRA files merged into the H3 DiT's native weights, with diffusers 0.42.1's
`MiniMaxH3LoraLoaderMixin`'s partition routing. Each file is read and normalised to diffusers module names with its
per-module scaling by models/lora_format.py (steps 1-3: every layout that loader reads, with its alpha rules); then

  4. routed to the one partition this model serves (FL2VA = `transformer`, Ref2VA = `transformer_ref`), and each module
     to its native weight (models/lora_targets.py)
  5. merge W += scale * scaling * B @ A in fp32, rounded once to the weight's dtype, mapped back to native names
     (to_q / to_k / to_v -> rows of qkv_proj, ff.net.0.proj -> mlp.fc1 with its halves swapped)

Merging bakes the LoRA into every downstream artifact (AdaLN tables, FP8 scales, compiled segments' weights), which
is why a bundle takes its merged LoRAs at build time. Shapes: A (down) [r, in], B (up) [out, r].
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.config import H3Config
from ..models.lora_format import REF2VA_COMPONENT, LoraError, pruned_message, read_lora
from ..models.lora_targets import TASK_COMPONENTS, native_target, route
from ..models.weight_layout import swap_halves
from .use import SCALE_RANGE, scale_in_range


class LoraScaleError(LoraError, argparse.ArgumentTypeError):
    """A scale that is not finite or out of range. An ArgumentTypeError too: `LoraSpec.parse` is argparse's type for --lora, and
    argparse shows only that class's message (a ValueError becomes "invalid parse value")."""


@dataclass(frozen=True)
class LoraSpec:
    """One `--lora FILE[:SCALE]`: the file and the strength it is merged at (1.0: as trained)."""

    path: Path
    scale: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "LoraSpec":
        """FILE or FILE:SCALE; a path that itself contains ':' keeps it unless the last part parses as a float (then
        it is the scale, and must be finite: `f.safetensors:nan` is refused, not read as a file of that name)."""
        head, sep, tail = str(text).rpartition(":")
        try:
            scale = float(tail) if sep else None
        except ValueError:
            scale = None
        return cls(Path(text)) if scale is None else cls(Path(head), scale)

    def __post_init__(self):
        if not scale_in_range(self.scale):
            raise LoraScaleError(f"--lora {self.path}:{self.scale}: the scale must be {SCALE_RANGE}, got "
                                 f"{self.scale}; pass {self.path}:SCALE, or {self.path} alone for 1.0.")


@torch.no_grad()
def merge_loras(model: torch.nn.Module, specs: list[LoraSpec] | tuple[LoraSpec, ...], task: str) -> list[dict]:
    """Merge every LoRA into `model` (an H3DiT) in place, in order; returns one record per file for the manifest or
    the clip record. Each delta, up [out, r] @ down [r, in] * scaling * scale onto a weight (or its rows) [out, in],
    is computed in fp32 and the weight rounded once, after all LoRAs are added."""
    params = dict(model.named_parameters())
    merge = LoraMerge(specs, task, model.cfg, {name: tuple(p.shape) for name, p in params.items()})
    for name in merge.targets:
        params[name].data = merge.merged(name, params[name].data)
    return merge.records


class LoraMerge:
    """The LoRA files of a merge, read, routed and checked against the model's weight shapes (every refusal before any
    weight changes), each weight's delta made when that weight is merged: `merge_loras` merges them all at once, a
    build that materializes one block at a time (h3trt/build/stream.py) merges each block's as it arrives. Either way
    a weight's delta sums its LoRAs' terms in the same order, so the merged bytes are the same."""

    def __init__(self, specs: list[LoraSpec] | tuple[LoraSpec, ...], task: str, cfg: H3Config,
                 shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes
        self.targets: dict[str, list[tuple]] = {}  # weight -> [(factors, rows, swap, scale)], in merge order
        self.records = []
        for spec in specs:
            lora = read_lora(spec.path, cfg.head_dim)
            prefix, modules = route(lora, task)
            for module, factors in modules.items():
                name, rows, swap = native_target(module, cfg)
                if name not in shapes:
                    raise LoraError(f"--lora {spec.path}: {prefix}.{module} names no Linear of the H3 DiT (it would be "
                                    f"{name}); is this a LoRA for another model?")
                target = shapes[name] if rows is None else (rows.stop - rows.start, *shapes[name][1:])
                shape = (factors.up.shape[0], factors.down.shape[1])
                if shape != tuple(target):
                    if ".adaln_proj." in name and factors.down.shape[1] != cfg.time_embed_dim:
                        raise LoraError(pruned_message(spec.path, f"its {name.removesuffix('.weight')} LoRA takes "
                                                        f"{factors.down.shape[1]} inputs; the unpruned adaln_proj "
                                                        f"takes {cfg.time_embed_dim}"))
                    raise LoraError(f"--lora {spec.path}: {prefix}.{module} is [{shape[0]}, {shape[1]}] but the "
                                    f"model's {name}{'' if rows is None else ' rows'} are {list(target)}; this LoRA "
                                    "is for another model size.")
                self.targets.setdefault(name, []).append((factors, rows, swap, spec.scale))
            self.records.append({"file": spec.path.name, "path": str(spec.path), "sha256": lora.sha256,
                                 "scale": spec.scale, "layout": lora.layout, "alpha": lora.alpha_rule,
                                 "component": prefix,
                                 "partition": "Ref2VA" if TASK_COMPONENTS[task] == REF2VA_COMPONENT else "FL2VA",
                                 "modules": len(modules)})

    def delta(self, name: str) -> torch.Tensor:
        """The fp32 sum of every LoRA's term on weight `name`, in merge order: [out, in]."""
        full = torch.zeros(self.shapes[name], dtype=torch.float32)
        for factors, rows, swap, scale in self.targets[name]:
            delta = (factors.up.float() @ factors.down.float()) * (factors.scaling * scale)
            if swap:
                delta = swap_halves(delta)
            if rows is None:
                full += delta
            else:
                full[rows] += delta
        return full

    @torch.no_grad()
    def merged(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """`weight` with the LoRAs added: in fp32 on the weight's device, rounded once to its dtype."""
        return (weight.float() + self.delta(name).to(weight.device)).to(weight.dtype)
