"""`h3trt build` before anything loads: every check that can fail fast (sp against the heads, the device, the attention
kernels, a process that already serves a bundle)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engines.loaders import bundle_activated
from ..errors import UserError
from ..models.checkpoint import locate_transformer
from ..models.config import H3Config
from ..models.precision import Precision
from ..parallel.mesh import MeshConfig
from .attention_choice import AttentionChoice, AttentionShape, resolve_attention
from .config import BuildConfig
from .examples import example_layout

EAGER_COMPONENTS = ("text_encoder", "tokenizer", "processor", "video_vae", "audio_vae", "vae")


@dataclass(frozen=True)
class BuildPlan:
    """What the build will be, decided before anything loads."""

    device: torch.device
    dtype: torch.dtype  # the DiT's compute dtype
    model_cfg: H3Config
    attention: dict[Precision, AttentionChoice]  # precision -> the kernel baked in (empty for tensorrt: it fuses its own)

    @property
    def fp8_kernel(self) -> str:
        return self.attention[Precision.FP8].kernel if Precision.FP8 in self.attention else ""

    @property
    def dense_kernel(self) -> str:
        return next((c.kernel for p, c in self.attention.items() if p != Precision.FP8), "sdpa")


def plan_build(config: BuildConfig, log=print) -> BuildPlan:
    """Every check that needs no model, in the order of their cost; logs the attention kernels chosen."""
    source = locate_transformer(config.model_root, config.task)
    model_cfg = source.config
    MeshConfig(cfg=config.cfg, sp=config.sp).validate(config.cfg * config.sp, model_cfg.num_heads)
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA device is visible; use --device cpu.")
    if device.type == "cuda" and (device.index or 0) != 0:
        # Compiled code names the device it was compiled on; bundles are compiled on, and served from, the process's
        # cuda:0 (h3trt/parallel/devices.py). `h3trt build --device cuda:N` makes GPU N this process's cuda:0.
        raise UserError(f"Bundles are compiled on the process's cuda:0, not {device}; use h3trt build --device "
                        f"cuda:{device.index}, which makes that GPU the process's cuda:0.")
    dtype = config.precision.spec.dtype
    attention = {} if config.backend == "tensorrt" else _attention(config, model_cfg, device, log)
    if config.backend in ("inductor", "aoti") and bundle_activated():
        # Measured: after a bundle's cache is activated, a build in the same process leaves some C++ kernels out of
        # the new bundle's cache, and its fresh-process check then finds the compiler invoked.
        raise UserError(f"This process already serves from the bundle {bundle_activated()}; a build here would not "
                        "capture every compiled kernel. Build in a fresh process (`h3trt build ...`).")
    return BuildPlan(device, dtype, model_cfg, attention)


def _attention(config: BuildConfig, model_cfg: H3Config, device: torch.device,
               log) -> dict[Precision, AttentionChoice]:
    """The kernels, measured at the bundle's attention shape (every row of the longest profile, one rank's heads), or
    a named kernel checked against this GPU."""
    shape = AttentionShape(max(example_layout(model_cfg, p.geometry).seq_len for p in config.profiles),
                           model_cfg.num_heads // config.sp, model_cfg.head_dim)
    attention = {}
    for precision in config.attention_precisions():
        choice = resolve_attention(config.attention, precision, device, shape)
        attention[precision] = choice
        timed = ", ".join(f"{k} {ms:.2f} ms" for k, ms in choice.measured_ms.items())
        left_out = "; ".join(f"{k} left out: {r}" for k, r in choice.unavailable.items())
        log(f"{precision} attention: {choice.kernel} (--attention {config.attention}"
            f"{', measured ' + timed if timed else ''} at {shape.rows} rows x {shape.heads} heads)"
            f"{'; ' + left_out if left_out else ''}")
    return attention
