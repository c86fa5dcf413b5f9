"""Calibration a block at a time, for a build that never holds the whole DiT on its device (h3trt/build/stream.py),
with the scales of the whole-model calibration (calibration/build.py `calibrate_dit`), bit for bit:

  1. encode: every --calib-prompts prompt through the text encoder, which is then freed (before any block loads).
  2. record: the prompts' trajectories, as trajectories.py runs them (a seeded t2va request each, the bundle's first
     profile, BuildConfig.calibration_schedule: a distilled bundle's rungs), but in lockstep: at each evaluation every
     prompt is embedded, then the blocks are brought in one at a time and each runs every prompt's rows. Each
     evaluation's input to block 0 (the residual stream, the time embedding, the rows' AdaLN index; RoPE per prompt)
     is recorded. A trajectory's last evaluation
     only moves its latents past the last grid point, which nothing reads, so its blocks are not run at all: a
     2-point schedule (one evaluation per prompt) records the embeddings alone. A FastH3-VSA model's blocks attend
     with VSA at each evaluation's and block's sparsity (models/vsa/plan.py), the trajectory's evaluations counted
     from 0 as trajectories.py's runner counts them, the calibration's core its dense attention, in steps 2 and 3.
  3. per block (`calibrate_layer`, called by the streamed build as it brings each block in): ModelOpt calibrates the
     block on the recorded inputs, in the whole-model forward's order (prompt by prompt, evaluation by evaluation), and
     the block's outputs replace them as the next block's inputs.

Why the scales are the same: a ModelOpt quantizer's statistics depend only on the values it sees, in the order it
sees them (its max, its histogram, SmoothQuant's and AWQ's per-channel sums). While calibrating, the quantizers pass
their inputs through, so the whole-model calibration's trajectories are the unquantized model's, with FP8 attention's
centering where a block quantizes its attention (fp8_attention.py `centered_attention`); the recorded inputs are those
activations, computed by the same modules in the same way, and each block sees them in the same order. AWQ's two
passes see the same activations (its search returns the unquantized output). The tests build the tiny model both ways
and compare every file of the two bundles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..errors import UserError
from ..models.config import NUM_MODALITIES
from ..models.dit import Block, H3DiT, sdpa_attention
from ..models.packing import Geometry, pack_t2va, row_timesteps, validate_canvas
from ..models.sampler import Schedule, euler_step, initial_latents
from ..models.text_encoder import H3TextEncoder, quiet_transformers
from ..models.vsa.plan import VsaCall, VsaRun, VsaServing
from ..models.vsa.tiles import VsaGeometry, layout_geometry
from .fp8_attention import centered_attention
from .recipe import QuantRecipe


@dataclass
class BlockInput:
    """One calibration evaluation's input to the block being calibrated (the residual stream advances block by
    block; the rest is the evaluation's)."""

    x: torch.Tensor  # [1, S, H] the residual stream, on the store's device (the build device, or the host)
    temb: torch.Tensor  # [T, E] fp32 time embedding
    adaln_index: torch.Tensor  # [S] each row's modulation row
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [S, R] fp32, shared by the prompt's evaluations
    # A FastH3-VSA model: the trajectory's VSA at this evaluation (its index counted from 0 per prompt, as the whole
    # calibration's runner counts it) and the layout's tiles; None: dense attention.
    vsa: VsaRun | None = None
    geometry: VsaGeometry | None = None

    def attention(self, core: Callable, index: int) -> Callable:
        """Block `index`'s attention at this evaluation: `core` itself, or (FastH3-VSA) VSA at its sparsity for the
        block and evaluation with `core` its dense attention, as the whole model's forward attends."""
        return core if self.vsa is None else VsaCall(self.vsa, self.geometry, core).layer(index)


class Blocks(Protocol):
    """What the recording needs of a streamed DiT's blocks (build/block_loader.py BlockLoader)."""

    def load(self, index: int) -> Block:
        """Block `index` on the device; the caller drops it when done."""


def encode_prompts(component_root: Path, prompts: list[str], device: torch.device, dtype: torch.dtype) -> list:
    """Every prompt's t2va text conditioning (embeds on `device`, tags), the text encoder freed afterwards: at full
    size it is Qwen3-VL-32B (63 GB in bf16), which must leave the device before the blocks arrive."""
    if any(not p.strip() for p in prompts):
        raise UserError("A calibration prompt is empty; remove blank prompts from --calib-prompts.")
    quiet_transformers()
    encoder = H3TextEncoder.from_pretrained(component_root, device=device, dtype=dtype)
    texts = [encoder.encode_t2va(prompt) for prompt in prompts]
    del encoder
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return texts


def trajectory_attention(recipe: QuantRecipe, index: int) -> Callable:
    """The attention block `index` runs with during calibration: FP8 attention's centered form where the recipe
    quantizes its attention (calibrate.py's core, its quantizers passing values through), else SDPA."""
    if recipe.fp8_attention and index not in recipe.exclude_blocks:
        return centered_attention
    return sdpa_attention


class _Trajectory:
    """One prompt's calibration trajectory, an evaluation at a time (models/sampler.py denoise_batch with a batch
    of one, H3DiT.forward split around its blocks)."""

    def __init__(self, model: H3DiT, text, seed: int, geometry: Geometry, device: torch.device,
                 vsa: VsaServing | None):
        cfg, g = model.cfg, geometry
        self.model, self.device = model, device
        self.layout = pack_t2va(text.tags, g.latent_frames, g.latent_height, g.latent_width, g.audio_latents,
                                cfg.patch_size, ())
        start = initial_latents(seed, g.latent_frames, g.latent_height, g.latent_width, g.audio_latents,
                                cfg.patch_size, cfg.in_channels, cfg.audio_in_channels)
        self.lay = self.layout.to(device)
        self.video = torch.stack([start.video.to(device)])  # [1, V, C] fp32, as denoise_batch stacks it
        self.audio = torch.stack([start.audio.to(device)])
        self.text = text.embeds.to(device)
        self.rope = model.rope(self.lay.position_ids)
        self.vsa = vsa
        self.tiles = layout_geometry(self.lay).to(device) if vsa is not None else None

    def embed(self, k: int, tv: float, ta: float, store: torch.device) -> BlockInput:
        """Evaluation k's embedding: the input the blocks start from, recorded (x on `store`)."""
        lay = self.lay
        unique_t, t_index = row_timesteps(self.layout, tv, ta)
        self.t_index = t_index.to(self.device)
        self.x, self.temb = self.model.embed(self.video, self.audio, self.text, unique_t.to(self.device),
                                             lay.video_index, lay.audio_index, lay.text_index, lay.seq_len)
        self.adaln_index = self.t_index * NUM_MODALITIES + lay.token_tags
        run = None
        if self.vsa is not None:  # the whole calibration's runner: a VsaRun per trajectory, one evaluation per call
            run = VsaRun(self.vsa)
            run.evaluation = k
        self.input = BlockInput(self.x.to(store), self.temb, self.adaln_index, self.rope, run, self.tiles)
        return self.input

    def block(self, block: Block, index: int, core: Callable) -> None:
        self.x = block(self.x, block.modulation(self.temb), self.adaln_index, self.rope,
                       self.input.attention(core, index))

    def step(self, schedule: Schedule, k: int, tv: float, ta: float) -> None:
        """The final layer and the Euler step: the latents of evaluation k + 1."""
        lay, sv, sa = self.lay, schedule.video_sigmas, schedule.audio_sigmas
        cv, ca = self.layout.num_condition_video_rows, self.layout.num_condition_audio_rows
        v_video, v_audio = self.model.final(self.x, self.temb, self.t_index, lay.video_index, lay.audio_index)
        self.video[:, cv:] = euler_step(self.video[:, cv:], v_video[:, cv:], tv, sv[k], sv[k + 1])
        self.audio[:, ca:] = euler_step(self.audio[:, ca:], v_audio[:, ca:], ta, sa[k], sa[k + 1])


@torch.no_grad()
def record_block_inputs(model: H3DiT, blocks: Blocks, texts: list, recipe: QuantRecipe, schedule: Schedule,
                        geometry: Geometry, store: torch.device, log=print,
                        vsa: VsaServing | None = None) -> list[BlockInput]:
    """Block 0's input at every evaluation of every prompt's trajectory (module docstring, step 2), in the order the
    whole-model calibration runs them: prompt by prompt, evaluation by evaluation. `model`: the DiT with its blocks
    elsewhere (embed and final on the device); `blocks.load(i)` brings block i in (the caller's to free). `schedule`:
    each trajectory's, as the whole calibration's (BuildConfig.calibration_schedule: a distilled bundle's rungs).
    `vsa`: a FastH3-VSA model's settings and kernel, which its blocks attend with (calibration/trajectories.py)."""
    device = model.condition_proj.weight.device
    validate_canvas(geometry.height, geometry.width)
    runs = [_Trajectory(model, text, seed, geometry, device, vsa) for seed, text in enumerate(texts)]
    timesteps = schedule.timesteps()
    recorded: list[list[BlockInput]] = [[] for _ in runs]
    for k, (tv, ta) in enumerate(timesteps):
        for run, inputs in zip(runs, recorded):
            inputs.append(run.embed(k, tv, ta, store))
        if k == len(timesteps) - 1:
            break  # the last evaluation's velocity moves the latents past the last grid point: unread
        for i in range(model.cfg.num_layers):
            block, core = blocks.load(i), trajectory_attention(recipe, i)
            for run in runs:
                run.block(block, i, core)
            del block
        for run in runs:
            run.step(schedule, k, tv, ta)
        log(f"  calibration trajectories: evaluation {k + 1}/{len(timesteps)} of {len(runs)} prompt(s)")
    return [x for inputs in recorded for x in inputs]


@torch.no_grad()
def calibrate_layer(block: Block, index: int, num_layers: int, recipe: QuantRecipe,
                    inputs: list[BlockInput] | None, log=print):
    """Block `index` calibrated by ModelOpt on `inputs` (None: weights only), which become its outputs, the next
    block's inputs (the last block's are left: nothing reads them). A block the recipe excludes is not calibrated
    (None), only run. Returns calibrate.py's Calibration (its quantizers in the block's linears), or None."""
    from .calibrate import calibrate_block  # imports ModelOpt

    advance = index < num_layers - 1
    if index in recipe.exclude_blocks:
        if inputs is not None and advance:
            _replay(block, index, inputs, trajectory_attention(recipe, index), True)
        return None
    replay = None if inputs is None else (lambda core, last: _replay(block, index, inputs, core, last and advance))
    return calibrate_block(block, index, num_layers, recipe, replay, log)


def _replay(block: Block, index: int, inputs: list[BlockInput], core: Callable, advance: bool) -> None:
    device = block.norm1.weight.device
    for item in inputs:
        x = block(item.x.to(device), block.modulation(item.temb), item.adaln_index, item.rope,
                  item.attention(core, index))
        if advance:
            item.x = x.to(item.x.device)
