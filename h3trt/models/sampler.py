"""The H3 sampler: per-modality shifted sigma grids, the data-ward Euler update, and the seeded initial noise.

Source: diffusers 0.42.1 `MiniMaxH3Scheduler` and the modular pipeline's prepare/denoise steps (h3_reference.md 4).
- sigmas = unique_consecutive(s * b / (1 + (s - 1) * b)) for b = linspace(1, 0, steps) in float32; video s = 12,
  audio s = 3. `steps` grid points give steps - 1 model evaluations (50 -> 49); the model sees t = 1 - sigma.
- A distilled model may run explicit rungs instead of the uniform grid (models/distilled/schedule.py): b = its rungs
  and a terminal 0, shifted the same way per modality (FastH3's dmd_denoising_steps [999, 749, 500, 250] / 1000;
  FastVideo's MiniMaxH3Scheduler.set_timesteps(sigmas=...) takes such a grid and steps it exactly as below).
- x0 = x + (1 - t) * v (v points towards data); x_next = r * x + (1 - r) * x0 with r = sigma_next / sigma, in fp32.
- Noise: one CPU generator seeded with the request seed draws, in order, one tensor per visual condition (its latent
  shape), the video noise [1, 24, T, H, W], then the audio noise directly as rows [2A, 32].
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from ..errors import UserError
from .packing import CONDITION_VIDEO_T, PackedLayout, patchify, row_timesteps

DEFAULT_STEPS = 50
DEFAULT_VIDEO_SHIFT = 12.0
DEFAULT_AUDIO_SHIFT = 3.0
DEFAULT_SEED = 42
DEFAULT_GUIDANCE = 1.0  # classifier-free guidance off: H3 is guidance-distilled
# Sigma grid points at least (the grid includes the terminal sigma 0) and at most: H3's schedule is 50 (DEFAULT_STEPS),
# its scheduler's training grid 1000 timesteps; a finer grid changes nothing a user can see and only multiplies the
# job's time (1e9 steps: a minute to build the grid). One bound for every front door: a request's steps (run, a
# requests file, the API, whose request field table states it), an adapter's schedule, build --steps.
MIN_STEPS = 2
MAX_STEPS = 1000


def check_steps(steps: int, name: str = "steps", field: str | None = "steps") -> None:
    """`steps` within [MIN_STEPS, MAX_STEPS], else one line naming `name` (the front door's word for it)."""
    if not MIN_STEPS <= steps <= MAX_STEPS:
        raise UserError(f"{name} must be at least {MIN_STEPS} (the grid includes the final sigma 0) and at most "
                        f"{MAX_STEPS} (H3's schedule is {DEFAULT_STEPS}), got {steps}.", field=field)


def shifted_sigmas(steps: int, shift: float, rungs: tuple[float, ...] | None = None) -> torch.Tensor:
    """The sigma grid [K] (K <= steps: float32 collisions merge), terminal 0 included, float32 on the CPU. `rungs`:
    the grid positions before the shift, one per evaluation (steps - 1 of them, strictly decreasing in (0, 1]), in
    place of linspace(1, 0, steps)'s; the terminal 0 is added."""
    check_steps(steps)
    if not (math.isfinite(shift) and shift > 0):  # NaN or inf would run every step and fail at the end
        raise UserError(f"A sigma shift must be a positive finite number, got {shift}; pass a --video-shift or "
                        "--audio-shift above 0, or leave it out for the checkpoint's.")
    if rungs is None:
        base = torch.linspace(1.0, 0.0, int(steps), dtype=torch.float32)
    else:
        check_rungs(steps, rungs)
        base = torch.tensor((*rungs, 0.0), dtype=torch.float32)
    return torch.unique_consecutive(shift * base / (1 + (shift - 1) * base))


def check_rungs(steps: int, rungs: tuple[float, ...]) -> None:
    """Explicit rungs: one per evaluation of a `steps`-point grid, strictly decreasing within (0, 1]."""
    values = tuple(float(r) for r in rungs)
    if len(values) != steps - 1 or not all(0.0 < r <= 1.0 and math.isfinite(r) for r in values) or any(
            a <= b for a, b in zip(values, values[1:])):
        raise UserError(f"A {steps}-point schedule takes {steps - 1} rungs, strictly decreasing within (0, 1] (the "
                        f"terminal 0 is added), got {list(values)}.")


def schedule_value(key: str, text: str, where: str) -> int | float:
    """One schedule value from its text (a flag's, a file's metadata): `steps` an integer in every front door's bound
    (check_steps), a shift a positive finite number; `where` names it in the error."""
    try:
        value = int(text) if key == "steps" else float(text)
    except ValueError:
        value = None
    if key == "steps":
        if value is None:
            raise UserError(f"{where}: steps must be an integer (sigma grid points), got {text!r}.")
        check_steps(value, f"{where}: steps", field=None)
    if key != "steps" and (value is None or not (math.isfinite(value) and value > 0)):
        raise UserError(f"{where}: {key} must be a positive finite number, got {text!r}.")
    return value


SCHEDULE_KEYS = ("steps", "video_shift", "audio_shift")  # what a request or an adapter may state of a schedule


def key_values(text: str, keys: tuple[str, ...], where: str, value_of=schedule_value) -> dict:
    """`steps=8,video_shift=5` (what follows an '@' in --adapter and --distilled) -> {key: value_of(key, text,
    where)}, each key once and one of `keys`."""
    values: dict = {}
    for pair in text.split(","):
        key, sep, value = pair.strip().partition("=")
        if not sep or key not in keys or key in values:
            raise UserError(f"{where}: expected KEY=VALUE pairs after '@' (each key once, of {list(keys)}), e.g. "
                            f"@steps=8,video_shift=5; got {pair.strip()!r}.")
        values[key] = value_of(key, value.strip(), where)
    return values


@dataclass(frozen=True)
class ScheduleValues:
    """Some of a schedule's values, each None where not given: an adapter's defaults, or what a request states."""

    steps: int | None = None  # sigma grid points (steps - 1 DiT evaluations)
    video_shift: float | None = None
    audio_shift: float | None = None

    def given(self) -> dict[str, int | float]:
        """The values given, by key (an adapter's `schedule` in GET /v1/loras)."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    def over(self, other: ScheduleValues) -> ScheduleValues:
        """These values, and `other`'s where these give none."""
        return ScheduleValues(**{**asdict(other), **self.given()})

    @classmethod
    def parse(cls, text: str, where: str) -> ScheduleValues:
        """`steps=8,video_shift=5` (the part of an --adapter after its '@'); `where` names it in the errors."""
        return cls(**key_values(text, SCHEDULE_KEYS, where))


@dataclass(frozen=True)
class Schedule:
    """The two sigma grids of one request."""

    steps: int = DEFAULT_STEPS  # grid points; steps - 1 model evaluations
    video_shift: float = DEFAULT_VIDEO_SHIFT
    audio_shift: float = DEFAULT_AUDIO_SHIFT
    # A distilled model's grid positions before the shift, one per evaluation (None: linspace(1, 0, steps)); the same
    # rungs for both modalities, each shifted by its own shift
    rungs: tuple[float, ...] | None = None

    @classmethod
    def resolve(cls, steps: int, video_shift: float | None, audio_shift: float | None,
                defaults: tuple[float, float], rungs: tuple[float, ...] | None = None) -> "Schedule":
        """A request's schedule: its own shifts where it gives them (None: not given; 0 is refused, not replaced),
        else `defaults` (video, audio); `rungs`: the model's, for this step count (None: the uniform grid)."""
        return cls(steps, defaults[0] if video_shift is None else video_shift,
                   defaults[1] if audio_shift is None else audio_shift, rungs)

    def __post_init__(self):
        if self.rungs is not None:
            object.__setattr__(self, "rungs", tuple(float(r) for r in self.rungs))
        shifted_sigmas(self.steps, self.video_shift, self.rungs)  # validates
        shifted_sigmas(self.steps, self.audio_shift, self.rungs)

    @property
    def video_sigmas(self) -> torch.Tensor:
        return shifted_sigmas(self.steps, self.video_shift, self.rungs)

    @property
    def audio_sigmas(self) -> torch.Tensor:
        return shifted_sigmas(self.steps, self.audio_shift, self.rungs)

    @property
    def num_evaluations(self) -> int:
        # The reference zips the two timestep lists, so a float32 collision in one grid shortens both.
        return min(len(self.video_sigmas), len(self.audio_sigmas)) - 1

    def timesteps(self) -> list[tuple[float, float]]:
        """(video t, audio t) of every evaluation, as the floats the reference passes on."""
        tv, ta = 1.0 - self.video_sigmas[:-1], 1.0 - self.audio_sigmas[:-1]
        return [(float(a), float(b)) for a, b in zip(tv, ta)]


def euler_step(x: torch.Tensor, v: torch.Tensor, t: float | torch.Tensor, sigma: torch.Tensor,
               sigma_next: torch.Tensor) -> torch.Tensor:
    """One data-ward Euler step in fp32: rows x and velocity v of one shape ([..., rows, C]) -> the next rows, fp32.
    `t` is what the model saw; `sigma`, `sigma_next` 0-d entries of the stored grid, which the ratio uses (the
    reference keeps the two apart: 1 - (1 - sigma) is not exact in fp32)."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    x, v = x.float(), v.float()
    x0 = x + (1 - t) * v
    r = sigma_next.to(x.device, torch.float32) / sigma.to(x.device, torch.float32)
    return r * x + (1.0 - r) * x0


def noise_conditions(conditions: list[torch.Tensor], generator: torch.Generator, patch_size) -> torch.Tensor:
    """Noise each visual condition latent [1, C, t, h, w] to t = 0.999 (x = t * clean + (1 - t) * noise) and pack
    them into rows [sum of t * h/ph * w/pw, C * ph * pw] fp32 on the CPU, in order."""
    rows = []
    for latents in conditions:
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
        t = torch.tensor(CONDITION_VIDEO_T, dtype=torch.float32)
        rows.append(patchify(t * latents.float().cpu() + (1.0 - t) * noise, patch_size))
    return torch.cat(rows) if rows else torch.zeros(0, 0)


@dataclass
class Latents:
    """The state the sampler updates: packed video and audio rows (condition rows first), fp32."""

    video: torch.Tensor  # [V, C]
    audio: torch.Tensor  # [A, C_audio]


def initial_latents(
    seed: int,
    latent_frames: int,
    latent_h: int,
    latent_w: int,
    audio_latents: int,
    patch_size=(1, 2, 2),
    in_channels: int = 24,
    audio_channels_dim: int = 32,
    conditions: tuple[torch.Tensor, ...] = (),
    reference_audio_rows: tuple[torch.Tensor, ...] = (),
) -> Latents:
    """The packed starting rows of one request, drawn exactly as the reference draws them from `seed`.

    `conditions` are the clean visual condition latents [1, C, t, h, w] in packed order (keyframes or image/video
    references); `reference_audio_rows` are clean reference soundtrack rows [2a, 32], never noised.
    """
    gen = torch.Generator("cpu").manual_seed(int(seed))
    cond_rows = noise_conditions(list(conditions), gen, patch_size) if conditions else None
    video = torch.randn((1, in_channels, latent_frames, latent_h, latent_w), generator=gen, dtype=torch.float32)
    video_rows = patchify(video, patch_size)
    audio_rows = torch.randn((audio_latents * 2, audio_channels_dim), generator=gen, dtype=torch.float32)
    if cond_rows is not None:
        video_rows = torch.cat([cond_rows, video_rows])
    if reference_audio_rows:
        audio_rows = torch.cat([r.float().cpu() for r in reference_audio_rows] + [audio_rows])
    return Latents(video_rows, audio_rows)


# (video rows [B, V, C], audio rows [B, A, C_audio], unique timesteps [T], timestep index [S]) -> (video v [B, V, C],
# audio v [B, A, C_audio]): one evaluation for a batch of requests of one packed layout (B = 1: one request).
Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def denoise(
    model: Denoiser,
    latents: Latents,
    layout: PackedLayout,
    schedule: Schedule,
    on_step: Callable[[int, int], None] | None = None,
) -> Latents:
    """One request's denoising: `denoise_batch` with a batch of one (rows [V, C] / [A, C] in and out)."""
    return denoise_batch(model, [latents], layout, schedule, on_step)[0]


def denoise_batch(
    model: Denoiser,
    batch: list[Latents],
    layout: PackedLayout,
    schedule: Schedule,
    on_step: Callable[[int, int], None] | None = None,
) -> list[Latents]:
    """The denoising loop: one model evaluation per step for requests of one packed layout and schedule, stacked
    along the batch dimension; condition rows stay pinned, target rows step in fp32. Each request keeps its own
    starting rows [V, C] / [A, C] (its own seed's noise), and the update is elementwise, so each ends where it would
    alone, a batch of one bitwise so."""
    device = batch[0].video.device
    cv, ca = layout.num_condition_video_rows, layout.num_condition_audio_rows
    video = torch.stack([item.video for item in batch])  # [B, V, C] fp32, a copy: the inputs stay as they were
    audio = torch.stack([item.audio for item in batch])  # [B, A, C_audio]
    sv, sa = schedule.video_sigmas, schedule.audio_sigmas
    steps = schedule.timesteps()
    for i, (tv, ta) in enumerate(steps):
        unique_t, t_index = row_timesteps(layout, tv, ta)
        v_video, v_audio = model(video, audio, unique_t.to(device), t_index.to(device))
        video[:, cv:] = euler_step(video[:, cv:], v_video[:, cv:], tv, sv[i], sv[i + 1])
        audio[:, ca:] = euler_step(audio[:, ca:], v_audio[:, ca:], ta, sa[i], sa[i + 1])
        if on_step is not None:
            on_step(i + 1, len(steps))
    return [Latents(video[b], audio[b]) for b in range(len(batch))]
