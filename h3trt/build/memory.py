"""How much device memory a build needs, whole or a block at a time, and the fit check that decides between them
before anything loads.

A whole build (the DiT on the device, as `load_dit` puts it) is the fastest where it fits: an H200 holds the full-size
bf16 DiT (66 GB) beside everything else. It does not fit an 80 GB H100: its calibration keeps every block's bf16
weights referenced while each block's FP8 copy is made (ModelOpt's quantizers hold the linears until the end), and it
died there at 76.6 GiB. A streamed build (h3trt/build/stream.py) holds the parts that stay resident (embed, final) and
one block at a time, so its need does not grow with the number of layers. `plan_memory` estimates both from the model
config and the profile (estimates of the largest live sets, not measurements; the build logs what it used), builds
whole where the whole need fits the budget, a block at a time where that fits, and otherwise refuses in one line
naming what it needs and what the device has.

The device's free memory comes from one function (`device_memory`), which the tests replace.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..calibration.recipe import QuantRecipe, layer_segments, read_prompts
from ..errors import UserError
from ..models.checkpoint.reader import TransformerSource
from ..models.checkpoint.stream import safetensors_header
from ..models.config import H3Config
from ..models.dit import build_dit
from .config import BuildConfig
from .examples import example_layout
from .segments import block_weight_specs

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """What the build's device has: free bytes now, and its name for the message."""

    free: int
    name: str


def device_memory(device: torch.device) -> DeviceMemory:
    """The device's free memory: CUDA's own count (mem_get_info), or on the CPU the kernel's MemAvailable (a
    checkpoint in /dev/shm is already subtracted from it)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return DeviceMemory(free, f"{device} ({torch.cuda.get_device_name(device)})")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return DeviceMemory(int(line.split()[1]) * 1024, "cpu (host memory available)")
    except OSError:
        pass
    return DeviceMemory(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "cpu (host memory free)")


@dataclass(frozen=True)
class MemoryNeeds:
    """The parts a build holds on its device, in bytes (estimates from the config and the profile)."""

    layers: int
    rows: int  # the longest profile's packed rows (the example layout: a keyframe's condition rows included)
    resident: int  # embed (projections, time embedder, token refiner) and final: on the device from load to check
    block: int  # the largest main block at the build dtype, its AdaLN projection included
    quantized: int  # a block's quantized linears, made beside its bf16 ones (0: not quantized)
    activations: int  # one block's forward at `rows` (the largest live set: attention's q/k/v or the MLP's)
    calibration_inputs: int  # streamed only: every calibration evaluation's recorded block input
    text_encoder: int  # calibration on data: the prompts' encoder (a streamed build loads it before any block)
    video_decoder: int  # the video VAE, loaded to compile the decoder's tiles
    kept: int  # streamed: blocks held after their pass for the compile's example inputs (block 0, first layers)
    fusion: int = 0  # --distilled: fusing its largest parameter (the fp32 sum and the fp32 weight beside it)

    def whole(self) -> int:
        """The DiT on the device whole: the largest of calibration (text encoder beside it), quantization (every
        block's copy made while ModelOpt still holds the bf16 linears, and a weight's fp32 transient) and compile
        (the video decoder)."""
        dit = self.resident + self.layers * self.block
        return max(dit + self.fusion, dit + self.text_encoder + self.activations,
                   dit + self.layers * self.quantized + (self.block if self.quantized else 0),
                   dit + self.video_decoder + self.activations)

    def streamed(self, inputs_on_host: bool = False) -> int:
        """A block at a time: the prompts' encoding, then each block's pass (the one being worked on, those kept,
        its quantized copy or, as it arrives, its --distilled fusion; the recorded calibration inputs unless they wait
        in host memory), then the compile."""
        return max(self.resident + self.text_encoder,
                   self.resident + (1 + self.kept) * self.block + max(self.quantized + self.activations, self.fusion)
                   + (0 if inputs_on_host else self.calibration_inputs),
                   self.resident + self.kept * self.block + self.video_decoder + self.activations)

    def describe(self) -> str:
        """The streamed need's parts, for the one-line refusal."""
        parts = [f"largest block {_gib(self.block)} GiB x {1 + self.kept}",
                 f"its quantized copy {_gib(self.quantized)} GiB" if self.quantized else None,
                 f"activations at {self.rows:,} rows {_gib(self.activations)} GiB",
                 f"resident embed/final {_gib(self.resident)} GiB",
                 (f"recorded calibration inputs {_gib(self.calibration_inputs)} GiB" if self.calibration_inputs
                  else None),
                 f"text encoder {_gib(self.text_encoder)} GiB (alone)" if self.text_encoder else None,
                 f"video decoder {_gib(self.video_decoder)} GiB (compile)"]
        return ", ".join(p for p in parts if p)


@dataclass(frozen=True)
class MemoryPlan:
    """Whether the build streams its blocks, and the numbers it decided on."""

    streamed: bool
    needs: MemoryNeeds
    budget: int  # what the build may use: the device's free memory, or --memory-budget below it
    device: DeviceMemory
    # streamed: the recorded calibration inputs wait in host memory, each copied in for its block's pass (they did not
    # fit the device beside the rest)
    calibration_inputs_on_host: bool = False

    def describe(self) -> str:
        how = "whole" if not self.streamed else "a block at a time" + (
            ", the calibration inputs in host memory" if self.calibration_inputs_on_host else "")
        return (f"device memory: the whole DiT needs about {_gib(self.needs.whole())} GiB, a block at a time about "
                f"{_gib(self.needs.streamed(self.calibration_inputs_on_host))} GiB; {self.device.name} has "
                f"{_gib(self.device.free)} GiB free"
                + (f", --memory-budget {_gib(self.budget)} GiB" if self.budget < self.device.free else "")
                + f": building {how}")


def _gib(n: int) -> str:
    return f"{n / GIB:.3g}" if n < GIB / 10 else f"{n / GIB:.1f}"


def memory_needs(config: BuildConfig, source: TransformerSource, dtype: torch.dtype) -> MemoryNeeds:
    """The parts of `config`'s build of `source`, from the model's shapes (meta tensors) and its component files."""
    cfg = config.model_config(source.config)  # a FastH3-VSA file's gates included
    model = build_dit(cfg, dtype, device="meta")
    block = _bytes(model.blocks[0].parameters())
    resident = _bytes(p for n, p in model.named_parameters() if not n.startswith("blocks."))
    recipe = config.recipe_for("emulated", cfg.vsa_gate)
    quantized = 0
    if recipe is not None:
        linears = tuple(f"{name}." for name in recipe.quantized_linears())
        specs = block_weight_specs(cfg, dtype, recipe)
        quantized = sum(t.itemsize * math.prod(shape) for n, (t, shape) in specs.items() if n.startswith(linears))
    rows = max(example_layout(cfg, p.geometry).seq_len for p in config.profiles)
    data = recipe is not None and recipe.needs_calibration_data
    evaluations = (len(read_prompts(config.calib_prompts)) * (recipe.calib_steps - 1)) if data else 0
    root = source.component_root
    text_encoder = _folder_tensor_bytes(root / "text_encoder", dtype) if data else 0
    fusion = 8 * max(p.numel() for p in model.parameters()) if config.distilled is not None else 0
    return MemoryNeeds(cfg.num_layers, rows, resident, block, quantized, activation_bytes(cfg, rows, dtype),
                       evaluations * rows * cfg.hidden_size * dtype.itemsize, text_encoder,
                       _folder_tensor_bytes(root / "video_vae", None), len(kept_layers(recipe, cfg.num_layers)), fusion)


def kept_layers(recipe: QuantRecipe | None, num_layers: int) -> set[int]:
    """The layers a streamed build keeps on the device after their pass, for the compile's example inputs: block 0
    (its AdaLN gives the examples' modulation; the halves take its weights) and the first layer of each block
    segment (examples.py)."""
    segments = layer_segments(recipe, num_layers)
    return {0} | {segments.index(s) for s in set(segments)}


def activation_bytes(cfg: H3Config, rows: int, dtype: torch.dtype) -> int:
    """An envelope of one block's live activations at `rows`: the residual, the modulated input and its output (4
    widths of H), the QKV projection, its normed and rotated copies and the attention output (6 of N x D), the MLP's
    [gate; value], its product and what the calibration reduces over it (4 of ffn), in the block dtype."""
    return rows * dtype.itemsize * (4 * cfg.hidden_size + 6 * cfg.inner_dim + 4 * cfg.ffn_dim)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _folder_tensor_bytes(folder: Path, dtype: torch.dtype | None) -> int:
    """The tensors of a component's safetensors files, at `dtype` where given (a text encoder loads at the build
    dtype) or as stored."""
    total = 0
    for path in sorted(folder.rglob("*.safetensors")) if folder.is_dir() else ():
        for stored, shape, begin, end in safetensors_header(path).values():
            total += (end - begin) if dtype is None else (end - begin) // stored.itemsize * dtype.itemsize
    return total


def plan_memory(config: BuildConfig, source: TransformerSource, dtype: torch.dtype, device: torch.device,
                free_memory=device_memory) -> MemoryPlan:
    """Whole where it fits the budget, else a block at a time where that fits, else the one-line refusal."""
    needs = memory_needs(config, source, dtype)
    have = free_memory(device)
    budget = have.free if config.memory_budget is None else min(have.free, int(config.memory_budget * GIB))
    limit = (f"{have.name} has {_gib(have.free)} GiB free"
             + (f" (--memory-budget {config.memory_budget:g} GiB)" if budget < have.free else ""))
    if needs.whole() <= budget:
        return MemoryPlan(False, needs, budget, have)
    if config.backend == "tensorrt":
        raise UserError(f"This build does not fit: --backend tensorrt exports the whole DiT at once, which needs about "
                        f"{_gib(needs.whole())} GiB of device memory, and {limit}. Free the device, build on a larger "
                        "one, or build --backend inductor (a block at a time).")
    for on_host in (False, True) if device.type == "cuda" else (False,):
        if needs.streamed(on_host) <= budget:
            return MemoryPlan(True, needs, budget, have, on_host)
    raise UserError(f"This build does not fit: even a block at a time it needs about {_gib(needs.streamed())} GiB of "
                    f"device memory ({needs.describe()}), and {limit}. Free the device, build on a larger one, or "
                    "shrink what grows: a smaller --canvas (activations), fewer --calib-prompts or --calib-steps "
                    "(recorded calibration inputs).")
