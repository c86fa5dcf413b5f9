"""Max calibration over real denoising trajectories of the model being built.

The build's own DiT (block dtype, weights not yet quantized) denoises each calibration prompt as a t2va request,
from the model pieces alone (text encoder, packing, seeded noise, the sampler; no VAE, nothing written): a
`--calib-steps`-point schedule with the bundle's shifts, at the bundle's first profile. Hooks record max |x|
entering every block linear and, for FP8 attention, max |q|, |k|, |v| after QK-norm and RoPE. The scale of a tensor is then amax / 448 (e4m3).

This is ModelOpt's "max" calibrator (per-tensor amax over all calibration batches), implemented here in a few lines:
the compiled block needs only the amax values, and ModelOpt's quantizer modules are not importable on the GPU image.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.dit import H3DiT, sdpa_attention
from ..models.packing import Geometry, frames_for_duration, pack_t2va, validate_canvas
from ..models.sampler import Latents, Schedule, denoise, initial_latents
from ..models.text_encoder import H3TextEncoder, quiet_transformers
from .fp8_attention import attention_calibration_tensors
from .recipe import BLOCK_LINEARS

MAX_CALIB_PROMPTS = 64  # a calibration file is a handful of prompts; more is a wrong file, not more accuracy


def read_prompts(path: Path) -> list[str]:
    """One prompt per line; blank lines and lines starting with '#' are skipped."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--calib-prompts {path} does not exist; give a text file with one prompt per line.")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    if not prompts:
        raise ValueError(f"--calib-prompts {path} has no prompts (one per line; '#' starts a comment).")
    if len(prompts) > MAX_CALIB_PROMPTS:
        raise ValueError(f"--calib-prompts {path} has {len(prompts)} prompts; at most {MAX_CALIB_PROMPTS} are used "
                         "for max calibration. Trim the file.")
    return prompts


class MaxCalibrator:
    """The eager DiT behind the runner signature, recording per-tensor amax as it runs.

    amax keys: `blocks.{i}.{linear}.input` for every block linear, `blocks.{i}.attn.{q,k,v}` (v centered over the
    rows, as FP8 attention quantizes it).
    """

    def __init__(self, model: H3DiT):
        self.model, self.cfg = model, model.cfg
        self.amax: dict[str, torch.Tensor] = {}
        self.current_block = -1
        self.hooks = []
        for i, block in enumerate(model.blocks):
            self.hooks.append(block.register_forward_pre_hook(self._enter_block(i)))
            for name in BLOCK_LINEARS:
                self.hooks.append(block.get_submodule(name).register_forward_pre_hook(
                    self._record_input(f"blocks.{i}.{name}.input")))

    def _enter_block(self, i: int):
        def hook(module, args):
            self.current_block = i
        return hook

    def _record_input(self, key: str):
        def hook(module, args):
            self._record(key, args[0])
        return hook

    def _record(self, key: str, x: torch.Tensor) -> None:
        value = x.detach().abs().amax().float().cpu()
        self.amax[key] = torch.maximum(self.amax[key], value) if key in self.amax else value

    def _attention(self, q, k, v):
        for name, t in attention_calibration_tensors(q, k, v).items():
            self._record(f"blocks.{self.current_block}.attn.{name}", t)
        return sdpa_attention(q, k, v)

    def __call__(self, video, audio, text, unique_t, t_index, layout, cache=None):
        if cache is not None:  # calibration must see every block at every step
            raise ValueError("FP8 calibration runs every evaluation; it takes no step cache.")
        return self.model(video, audio, text, unique_t, t_index, layout.token_tags, layout.position_ids,
                          layout.video_index, layout.audio_index, layout.text_index, attn_fn=self._attention)

    def close(self) -> dict[str, torch.Tensor]:
        for h in self.hooks:
            h.remove()
        return self.amax


@torch.no_grad()
def calibrate(model: H3DiT, component_root: Path, prompts: list[str], steps: int, width: int, height: int,
              seconds: float, shifts: tuple[float, float], log=print) -> dict[int, dict[str, torch.Tensor]]:
    """{block index: {"mlp.fc1.input": amax, ..., "attn.q": amax, ...}} from one trajectory per prompt."""
    device = model.condition_proj.weight.device
    geometry = Geometry(height, width, frames_for_duration(seconds))
    validate_canvas(height, width)
    schedule = Schedule(steps, *shifts)
    quiet_transformers()
    text_encoder = H3TextEncoder.from_pretrained(component_root, device=device, dtype=model.dtype)
    calibrator = MaxCalibrator(model)
    try:
        for seed, prompt in enumerate(prompts):
            t2va_trajectory(calibrator, text_encoder, prompt, seed, geometry, schedule, device)
            log(f"calibration trajectory {seed + 1}/{len(prompts)}: {steps - 1} evaluations")
    finally:
        amax = calibrator.close()
    per_block: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(model.cfg.num_layers)}
    for key, value in amax.items():
        _, i, rest = key.split(".", 2)
        per_block[int(i)][rest] = value
    return per_block


def t2va_trajectory(dit, text_encoder: H3TextEncoder, prompt: str, seed: int, geometry: Geometry, schedule: Schedule,
                    device: torch.device) -> Latents:
    """One t2va request denoised with `dit` (the runner signature), as the eager pipeline does it: the prompt's
    embeddings and tags, the packed rows, the noise drawn from `seed`, the sampler's loop. Returns the final rows."""
    if not prompt.strip():
        raise ValueError("A calibration prompt is empty; remove blank prompts from --calib-prompts.")
    cfg, g = dit.cfg, geometry
    text = text_encoder.encode_t2va(prompt)
    layout = pack_t2va(text.tags, g.latent_frames, g.latent_height, g.latent_width, g.audio_latents, cfg.patch_size, ())
    start = initial_latents(seed, g.latent_frames, g.latent_height, g.latent_width, g.audio_latents, cfg.patch_size,
                            cfg.in_channels, cfg.audio_in_channels)
    text_BLC, lay = text.embeds.to(device), layout.to(device)

    def model(video, audio, unique_t, t_index):
        return dit(video, audio, text_BLC, unique_t, t_index, lay)

    return denoise(model, Latents(start.video.to(device), start.audio.to(device)), layout, schedule)
