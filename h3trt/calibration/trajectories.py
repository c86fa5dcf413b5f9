"""The calibration's forward loop over real denoising trajectories of the model being built: each `--calib-prompts`
prompt denoised as a seeded t2va request from the model pieces alone (text encoder, packing, noise, the sampler; no
VAE, nothing written), a `--calib-steps`-point schedule (a distilled bundle: its family's rungs), at the bundle's first
profile. The
DiT attends through whatever attention the calibration hands the loop (h3trt/calibration/calibrate.py's cores).
Apart from the ModelOpt driver so that it alone needs the text encoder's dependencies (transformers, Pillow)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import UserError
from ..models.dit import H3DiT, sdpa_attention
from ..models.runner import NO_EXTRAS, EvalExtras, RunnerCaps
from ..models.packing import Geometry, frames_for_duration, pack_t2va, validate_canvas
from ..models.sampler import Latents, Schedule, denoise, initial_latents
from ..models.text_encoder import H3TextEncoder, quiet_transformers
from ..models.vsa.plan import VsaRun, VsaServing, vsa_call

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def trajectory_forward(model: H3DiT, component_root: Path, prompts: list[str], schedule: Schedule, width: int,
                       height: int, seconds: float, log=print,
                       vsa: VsaServing | None = None) -> Callable[[AttentionFn], None]:
    """The forward loop over real trajectories: each prompt denoised as a seeded t2va request on `schedule` (the
    build's BuildConfig.calibration_schedule: a distilled bundle's own rungs) from the model pieces alone (text
    encoder, packing, noise, sampler; no VAE), the DiT attending through the calibration's cores. A FastH3-VSA model
    (`vsa`: its settings and kernel) attends with VSA, as it serves, the cores its dense attention."""
    device = model.condition_proj.weight.device
    geometry = Geometry(height, width, frames_for_duration(seconds))
    validate_canvas(height, width)
    quiet_transformers()
    text_encoder = H3TextEncoder.from_pretrained(component_root, device=device, dtype=model.dtype)
    runner = _Runner(model)

    def forward(attention: AttentionFn) -> None:
        runner.attention = attention
        for seed, prompt in enumerate(prompts):
            runner.vsa = VsaRun(vsa) if vsa is not None else None  # each trajectory's evaluations from 0
            t2va_trajectory(runner, text_encoder, prompt, seed, geometry, schedule, device)
            log(f"  trajectory {seed + 1}/{len(prompts)}: {schedule.num_evaluations} evaluations")

    return forward


def t2va_trajectory(dit, text_encoder: H3TextEncoder, prompt: str, seed: int, geometry: Geometry, schedule: Schedule,
                    device: torch.device) -> Latents:
    """One t2va request denoised with `dit` (the runner signature), as the eager pipeline does it: the prompt's
    embeddings and tags, the packed rows, the noise drawn from `seed`, the sampler's loop. Returns the final rows."""
    if not prompt.strip():
        raise UserError("A calibration prompt is empty; remove blank prompts from --calib-prompts.")
    cfg, g = dit.cfg, geometry
    text = text_encoder.encode_t2va(prompt)
    layout = pack_t2va(text.tags, g.latent_frames, g.latent_height, g.latent_width, g.audio_latents, cfg.patch_size, ())
    start = initial_latents(seed, g.latent_frames, g.latent_height, g.latent_width, g.audio_latents, cfg.patch_size,
                            cfg.in_channels, cfg.audio_in_channels)
    text_BLC, lay = text.embeds.to(device), layout.to(device)

    def model(video, audio, unique_t, t_index):
        return dit(video, audio, text_BLC, unique_t, t_index, lay)

    return denoise(model, Latents(start.video.to(device), start.audio.to(device)), layout, schedule)


class _Runner:
    """The eager DiT under the runner contract (models/runner.py), attending through `attention`; it serves plain
    evaluations only (`caps`: none of the extras), as calibration sees the model."""

    caps = RunnerCaps()

    def __init__(self, model: H3DiT):
        self.model, self.cfg, self.attention = model, model.cfg, sdpa_attention
        self.vsa: VsaRun | None = None  # a FastH3-VSA model's run over the trajectory (one call per step)

    def __call__(self, video, audio, text, unique_t, t_index, layout, extras: EvalExtras = NO_EXTRAS):
        if extras != NO_EXTRAS:  # calibration must see every block at every step, dense, on the model's weights
            raise ValueError("Calibration runs every evaluation plainly; it takes no step cache, sparse attention or "
                             "adapters.")
        attn = self.attention
        if self.cfg.vsa_gate:  # VSA as served, the calibration's core its dense attention
            if self.vsa is not None:
                self.vsa.next_evaluation()
            attn = vsa_call(self.vsa, layout, self.attention)  # None: refused, with what to pass
        return self.model(video, audio, text, unique_t, t_index, layout.token_tags, layout.position_ids,
                          layout.video_index, layout.audio_index, layout.text_index, attn_fn=attn)
