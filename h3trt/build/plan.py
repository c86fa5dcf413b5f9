"""`h3trt build` before anything loads: every check that can fail fast (sp against the heads, the device, the attention
kernels, a process that already serves a bundle), and the bundle's size, estimated for the free-space check."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..engines.loaders import bundle_activated
from ..errors import UserError
from ..models.checkpoint.reader import TransformerSource, locate_transformer
from ..models.config import H3Config
from ..models.dit import build_dit
from ..models.precision import Precision
from ..models.vsa.plan import VsaServing
from ..parallel.mesh import MeshConfig
from .adaln import schedule_timesteps
from .attention_choice import AttentionChoice, AttentionShape, resolve_attention
from .sparse_choice import SparseChoice, resolve_sparse_kernel
from .config import BuildConfig
from .examples import example_layout
from .memory import MemoryPlan, device_memory, plan_memory

EAGER_COMPONENTS = ("text_encoder", "tokenizer", "processor", "video_vae", "audio_vae", "vae")
# Compiled code (Inductor's C++ / Triton binaries, AOTI packages, TensorRT's plans hold weights too) by device type:
# measured, a full-size fp8 bundle on the H200 holds ~0.2 GB of it (32.27 GB, less 20.94 GB of weights and tables and
# 11.0 GB of components), the tiny model's on the CPU 5.8 MB. An allowance above both, not a bound.
COMPILED_CODE_BYTES = {"cuda": 256 << 20, "cpu": 32 << 20}


@dataclass(frozen=True)
class BundleSize:
    """A bundle's size, estimated before anything loads, by part: what the free-space check asks for."""

    weights: int  # the DiT's parameters at the build dtype (fp8/nvfp4: counted at bf16, an upper bound)
    adaln_tables: int  # baked AdaLN tables for the schedule (0 with --keep-adaln: adaln_proj is in the weights)
    components: int  # the eager components copied from the checkpoint (text encoder, tokenizer, VAEs)
    compiled: int  # compiled code, COMPILED_CODE_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.adaln_tables + self.components + self.compiled

    def describe(self) -> str:
        return (f"weights {self.weights / 1e6:.1f} MB, AdaLN tables {self.adaln_tables / 1e6:.1f} MB, components "
                f"{self.components / 1e6:.1f} MB, compiled code {self.compiled / 1e6:.1f} MB")


@dataclass(frozen=True)
class BuildPlan:
    """What the build will be, decided before anything loads."""

    device: torch.device
    dtype: torch.dtype  # the DiT's compute dtype
    model_cfg: H3Config
    attention: dict[Precision, AttentionChoice]  # the kernel baked in per precision (tensorrt: none, it fuses its own)
    size: BundleSize
    # --sparse-attention: the block-sparse kernel the bundle serves, its routing block and tile, chosen on the build
    # device (timed there: build/sparse_choice.py) and compiled there once (a kernel this machine cannot run is
    # refused here); None: no sparse attention.
    sparse_kernel: SparseChoice | None = None
    # A FastH3-VSA checkpoint: the VSA kernel the bundle serves, chosen on the build device and compiled there once;
    # None: the checkpoint is no VSA model.
    vsa_kernel: str | None = None
    vsa_left_out: dict[str, str] | None = None  # the faster VSA kernels left out on the build device, with why
    vsa_tile: str | None = None  # the fp8 VSA kernel's tile configuration (build/vsa_choice.py); else None
    vsa_measured: dict[str, float] | None = None  # the VSA race's ms by kernel (an FP8 VSA build on a GPU)
    # Whole or a block at a time, and the estimates that decided it (build/memory.py); None: a plan made without the
    # fit check (tests of later phases).
    memory: MemoryPlan | None = None

    @property
    def streamed(self) -> bool:
        return self.memory is not None and self.memory.streamed

    @property
    def fp8_kernel(self) -> str:
        return self.attention[Precision.FP8].kernel if Precision.FP8 in self.attention else ""

    @property
    def dense_kernel(self) -> str:
        return next((c.kernel for p, c in self.attention.items() if p != Precision.FP8), "sdpa")


def plan_build(config: BuildConfig, log=print, free_memory=device_memory) -> BuildPlan:
    """Every check that needs no model, in the order of their cost; logs the device memory plan and the attention
    kernels chosen. `free_memory(device)`: what the device has free (build/memory.py; tests pass their own)."""
    source = locate_transformer(config.model_root, config.task)
    # a FastH3-VSA file's gates make the model a FastH3-VSA one: what it cannot be is refused before anything is timed
    model_cfg = config.model_config(source.config)
    MeshConfig(cfg=config.cfg, sp=config.sp).validate(config.cfg * config.sp, model_cfg.num_heads)
    config.check_vsa(model_cfg.vsa_gate)
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA device is visible; use --device cpu.")
    if device.type == "cuda" and (device.index or 0) != 0:
        # Compiled code names the device it was compiled on; bundles are compiled on, and served from, the process's
        # cuda:0 (h3trt/parallel/devices.py). `h3trt build --device cuda:N` makes GPU N this process's cuda:0.
        raise UserError(f"Bundles are compiled on the process's cuda:0, not {device}; use h3trt build --device "
                        f"cuda:{device.index}, which makes that GPU the process's cuda:0.")
    dtype = config.precision.spec.dtype
    memory = plan_memory(config, source, dtype, device, free_memory)  # before anything touches the device's memory
    log(memory.describe())
    attention = {} if config.backend == "tensorrt" else _attention(config, model_cfg, device, log)
    if config.backend in ("inductor", "aoti") and bundle_activated():
        # Measured: after a bundle's cache is activated, a build in the same process leaves some C++ kernels out of
        # the new bundle's cache, and its fresh-process check then finds the compiler invoked.
        raise UserError(f"This process already serves from the bundle {bundle_activated()}; a build here would not "
                        "capture every compiled kernel. Build in a fresh process (`h3trt build ...`).")
    sparse = _sparse_kernel(config, model_cfg, device, dtype, log) if config.sparse is not None else None
    vsa = _vsa_kernel(config, model_cfg, device, dtype, log) if model_cfg.vsa_gate else None
    return BuildPlan(device, dtype, model_cfg, attention, estimated_size(config, source, dtype, device), sparse,
                     vsa and vsa.kernel, vsa and vsa.left_out, vsa and vsa.tile, vsa and vsa.measured_ms, memory)


def _vsa_kernel(config: BuildConfig, model_cfg: H3Config, device: torch.device, dtype: torch.dtype, log):
    """The VSA kernel of a FastH3-VSA bundle (build/vsa_choice.py: bf16, the first of fa4, flex, reference that
    compiles here and matches the fp32 definition; with --fp8-attention, fa4 and the fp8 kernel's tiles timed at the
    bundle's longest profile), at one rank's heads, the ones left out logged with why and recorded; every load
    compiles and checks it again."""
    from ..models.vsa.tiles import layout_geometry
    from .vsa_choice import resolve_vsa_kernel

    heads = model_cfg.num_heads // config.sp
    s = config.vsa(model_cfg.num_layers)
    longest = max((example_layout(model_cfg, p.geometry) for p in config.profiles), key=lambda lay: lay.seq_len)
    choice = resolve_vsa_kernel(device, heads, model_cfg.head_dim, dtype, config.fp8_attention,
                                layout_geometry(longest), s.sparsity, log)
    name = choice.kernel + (f" (tile {choice.tile})" if choice.tile else "")
    log(f"VSA (FastH3-VSA model): the {name} kernel, {heads} heads per rank, sparsity {s.sparsity:g} "
        f"({s.sparsity_from}), first {s.dense_first_steps} steps dense, dense blocks {list(s.dense_layers) or 'none'}")
    return choice


def vsa_serving(config: BuildConfig, plan: BuildPlan) -> VsaServing | None:
    """A FastH3-VSA bundle's VSA: the settings of its --vsa-* flags and the kernel chosen (None: no VSA model), which
    calibration attends with and the manifest records."""
    if plan.vsa_kernel is None:
        return None
    return VsaServing(config.vsa(plan.model_cfg.num_layers), plan.vsa_kernel, plan.vsa_left_out or {}, plan.vsa_tile,
                      plan.vsa_measured or {})


def _sparse_kernel(config: BuildConfig, model_cfg: H3Config, device: torch.device, dtype: torch.dtype,
                   log) -> SparseChoice:
    """The block-sparse kernel of a bundle built with --sparse-attention (build/sparse_choice.py: timed at the
    bundle's own attention shape on a GPU), compiled once here at one rank's heads, so that a kernel the build machine
    cannot run fails the build, not the first sparse request."""
    from ..models.sparse.kernels import warm_sparse_kernel

    heads = model_cfg.num_heads // config.sp
    shape = AttentionShape(max(example_layout(model_cfg, p.geometry).seq_len for p in config.profiles), heads,
                           model_cfg.head_dim)
    choice = resolve_sparse_kernel(config.sparse_kernel, device, config.fp8_attention, shape,
                                   config.sparse.sparsity)
    try:
        warm_sparse_kernel(choice.kernel, device, heads, model_cfg.head_dim, dtype, choice.block, choice.tile)
    except UserError:
        raise
    except Exception as e:  # a kernel that imports but does not compile here: the build's user can act on it
        first = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"--sparse-attention: the {choice.kernel} block-sparse attention kernel did not compile on "
                        f"{device} ({type(e).__name__}: {first}); fix its install (FlashAttention-4 on sm_90: pip "
                        f"install 'h3trt[fa4]'), pick another with --sparse-kernel, or build without "
                        f"--sparse-attention.") from e
    timed = ", ".join(f"{k} {ms:.2f} ms" for k, ms in choice.measured_ms.items())
    left_out = "; ".join(f"{k} left out: {r}" for k, r in choice.unavailable.items())
    log(f"sparse attention: the {choice.kernel} kernel{f' (tile {choice.tile})' if choice.tile else ''}, "
        f"{choice.block}-row blocks, {heads} heads per rank (--sparse-kernel {choice.requested}"
        f"{', measured ' + timed + f' at {shape.rows} rows' if timed else ''}){'; ' + left_out if left_out else ''}; "
        f"default sparsity {config.sparse.sparsity:g}, first {config.sparse.dense_steps} evaluations dense, "
        f"attentions under {config.sparse.min_seq} rows dense")
    return choice


def _attention(config: BuildConfig, model_cfg: H3Config, device: torch.device,
               log) -> dict[Precision, AttentionChoice]:
    """The kernels, measured at the bundle's attention shape (every row of the longest profile, one rank's heads), or
    a named kernel checked against this GPU."""
    shape = AttentionShape(max(example_layout(model_cfg, p.geometry).seq_len for p in config.profiles),
                           model_cfg.num_heads // config.sp, model_cfg.head_dim)
    attention = {}
    for precision in config.attention_precisions(model_cfg.vsa_gate):
        choice = resolve_attention(config.attention, precision, device, shape)
        attention[precision] = choice
        timed = ", ".join(f"{k} {ms:.2f} ms" for k, ms in choice.measured_ms.items())
        left_out = "; ".join(f"{k} left out: {r}" for k, r in choice.unavailable.items())
        log(f"{precision} attention: {choice.kernel} (--attention {config.attention}"
            f"{', measured ' + timed if timed else ''} at {shape.rows} rows x {shape.heads} heads)"
            f"{'; ' + left_out if left_out else ''}")
    return attention


def estimated_size(config: BuildConfig, source: TransformerSource, dtype: torch.dtype,
                   device: torch.device) -> BundleSize:
    """The bundle's bytes by part, from the model's shapes (on the meta device: nothing loads) and the sizes of the
    component files it copies."""
    model = build_dit(config.model_config(source.config), dtype, device="meta")
    adaln = sum(p.numel() for n, p in model.named_parameters() if "adaln_proj" in n)
    params = sum(p.numel() for p in model.parameters()) - (0 if config.keep_adaln else adaln)
    tables = 0
    if not config.keep_adaln:
        video_shift, audio_shift = source.shifts
        timesteps = schedule_timesteps(*config.schedules((video_shift, audio_shift))).numel()
        cfg = source.config
        tables = timesteps * (cfg.num_layers * 3 * 6 + 2) * cfg.hidden_size * dtype.itemsize  # adaln.bake_tables
    components = sum(f.stat().st_size for name in EAGER_COMPONENTS
                     for f in Path(source.component_root, name).rglob("*") if f.is_file())
    compiled = COMPILED_CODE_BYTES["cuda" if device.type == "cuda" or config.backend == "tensorrt" else "cpu"]
    return BundleSize(params * dtype.itemsize, tables, components, compiled)
