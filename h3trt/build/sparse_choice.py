"""`h3trt build --sparse-attention S --sparse-kernel auto|fa4|fp8|reference|fp8_emulated`: the block-sparse kernel a
bundle serves, chosen on the build machine and recorded in the manifest (engines/manifest.py SparseRecord), which
every load honours (engines/bundle.py).

`auto` (the default) on a GPU times every candidate this GPU and this bundle can run, at the bundle's own attention
shape (every row of its longest profile, the heads of one rank) over one routing index (SubBlock's, at the bundle's
default sparsity, MEASURE_SPARSITY where that is 0; every query block sparse):
  fa4  FlashAttention-4's bf16 block-sparse forward;
  fp8  the Triton FP8 kernel (models/sparse/fp8_triton.py), each of its tile configurations for the block, timed
       with its quantization pass: only in a bundle built with --fp8-attention, whose layers carry the q/k/v scales.
The fastest wins (kernel and, for fp8, tile); the record keeps every time and each candidate left out, with why. On a
CPU nothing is timed: fp8_emulated with --fp8-attention, else reference. A named kernel is checked against the
device and the bundle, not raced (fp8's tiles are still timed: the kernel is named, its tile measured).

A bundle never serves flex: FlexAttention's Inductor kernel compiled again at a request on the H100 though the load
had warmed it, and a bundle may compile nothing at a request. A GPU that runs neither candidate refuses the build
in one line naming FlashAttention-4's package (and --fp8-attention's kernel where the bundle lacks it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..errors import UserError
from ..models.sparse.attention import SUBBLOCK_BLOCK
from ..models.sparse.fp8 import FP8_SPARSE_KERNELS, unit_scales
from ..models.sparse.kernels import FA4_FIX, sparse_attention, sparse_kernel_problem
from .attention_choice import AttentionShape, median_cuda_ms

SPARSE_KERNEL_REQUESTS = ("auto", "fa4", "fp8", "reference", "fp8_emulated")
MEASURE_SPARSITY = 0.75  # the timing index's sparsity where the bundle's default is 0 (dense unless asked)
BENCH_WARMUP, BENCH_ITERS = 2, 5


@dataclass(frozen=True)
class SparseChoice:
    """The kernel a bundle serves and how it was chosen (the manifest's `sparse` record holds these fields)."""

    kernel: str  # models/sparse/kernels.py SPARSE_KERNELS, never flex
    block: int  # the routing block's rows
    tile: str | None  # the fp8 kernel's tile configuration (models/sparse/fp8_triton.py TILE_CONFIGS); else None
    requested: str  # what --sparse-kernel asked for: auto, or a kernel
    measured_ms: dict[str, float] = field(default_factory=dict)  # "fa4", "fp8:<tile>": ms at the bundle's shape
    unavailable: dict[str, str] = field(default_factory=dict)  # candidates left out, and why

    def to_dict(self) -> dict:
        return asdict(self)


Measure = Callable[[str, "str | None", AttentionShape, int, float, torch.device], float]


def fp8_tiles(block: int) -> tuple[str, ...]:
    from ..models.sparse.fp8_triton import TILE_CONFIGS

    return tuple(TILE_CONFIGS[block])


def resolve_sparse_kernel(requested: str, device, fp8_attention: bool, shape: AttentionShape, sparsity: float,
                          measure: Measure | None = None,
                          problem: Callable[[str, torch.device], str | None] = sparse_kernel_problem,
                          tiles: Callable[[int], tuple[str, ...]] = fp8_tiles) -> SparseChoice:
    """The kernel a build serves on `device`. `measure(kernel, tile, shape, block, sparsity, device)` -> ms, `problem`
    (why a kernel cannot run here, or None) and `tiles` (the fp8 kernel's configurations for a block) are parameters
    so the choice is testable without a GPU."""
    if requested not in SPARSE_KERNEL_REQUESTS:
        raise UserError(f"--sparse-kernel must be one of {SPARSE_KERNEL_REQUESTS}, got {requested!r}.")
    device = torch.device(device)
    block = SUBBLOCK_BLOCK
    measure = measure or measure_sparse_ms
    sparsity = sparsity or MEASURE_SPARSITY
    if requested != "auto":
        if requested in FP8_SPARSE_KERNELS and not fp8_attention:
            raise UserError(f"--sparse-kernel {requested} runs FP8 attention with each layer's calibrated q/k/v "
                            "scales: build with --precision fp8 --fp8-attention, or pick fa4 or reference.")
        reason = problem(requested, device)
        if reason is not None:
            raise UserError(f"--sparse-kernel {requested}: {reason}")
        if requested != "fp8":
            return SparseChoice(requested, block, None, requested)
        measured = {f"fp8:{t}": round(float(measure("fp8", t, shape, block, sparsity, device)), 3)
                    for t in tiles(block)}
        best = min(measured, key=lambda name: measured[name])
        return SparseChoice("fp8", block, best.split(":", 1)[1], requested, measured)
    if device.type != "cuda":
        return SparseChoice("fp8_emulated" if fp8_attention else "reference", block, None, requested)
    candidates = ("fa4", "fp8") if fp8_attention else ("fa4",)
    unavailable = {k: r for k in candidates if (r := problem(k, device)) is not None}
    if not fp8_attention:
        unavailable["fp8"] = "the bundle has no FP8 attention scales (build with --precision fp8 --fp8-attention)"
    runnable = [k for k in candidates if k not in unavailable]
    if not runnable:
        listed = "; ".join(f"{k}: {r}" for k, r in unavailable.items())
        raise UserError(f"--sparse-attention: no block-sparse kernel a bundle serves runs on {device} ({listed}). "
                        f"Install FlashAttention-4: {FA4_FIX}.")
    measured = {}
    for kernel in runnable:
        for tile in (tiles(block) if kernel == "fp8" else (None,)):
            name = kernel if tile is None else f"{kernel}:{tile}"
            measured[name] = round(float(measure(kernel, tile, shape, block, sparsity, device)), 3)
    best = min(measured, key=lambda name: (measured[name], list(measured).index(name)))  # ties: the first timed
    kernel, _, tile = best.partition(":")
    return SparseChoice(kernel, block, tile or None, requested, measured, unavailable)


def measure_sparse_ms(kernel: str, tile: str | None, shape: AttentionShape, block: int, sparsity: float,
                      device: torch.device) -> float:
    """Median ms of one sparse attention call at `shape`, CUDA events after warm-up: the fa4 op on bf16 q/k/v, or the
    fp8 kernel's quantization pass and attention, over SubBlock's index for random q/k (every query block sparse)."""
    from ..models.sparse.fp8 import fp8_sparse_attention
    from ..models.sparse.router import route_blocks, router_for

    g = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(shape.batch, shape.rows, shape.heads, shape.head_dim, device=device,
                           dtype=torch.bfloat16, generator=g) for _ in range(3))
    with torch.no_grad():
        index, _ = route_blocks(q, k, sparsity, shape.head_dim ** -0.5, router_for(device), block=block)
        sparse_G = torch.ones(-(-shape.rows // block), dtype=torch.bool, device=device)
        if kernel in FP8_SPARSE_KERNELS:
            scales = unit_scales(device)

            def run():
                return fp8_sparse_attention(q, k, v, scales, index, sparse_G, block, kernel, tile)
        else:
            def run():
                return sparse_attention(q, k, v, index, sparse_G, block, kernel)
        return median_cuda_ms(run, BENCH_ITERS, BENCH_WARMUP, device)
