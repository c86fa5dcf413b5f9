"""The VSA kernel a FastH3-VSA bundle serves, chosen on the build machine and recorded in the manifest's `vsa` record
(models/vsa/plan.py VsaServing: kernel, tile, measured_ms, left_out), which every load warms and honours
(engines/bundle.py); a bundle never compiles at a request.

Without --fp8-attention (bf16 VSA): models/vsa/plan.py choose_vsa_kernel, the first of fa4, flex, reference that
compiles here and matches the fp32 definition (they compute one thing; the order is their speed).
With --precision fp8 --fp8-attention (FP8 VSA, models/vsa/fp8.py; the one FP8 attention a VSA model takes):
  - on a GPU, the candidates that warm up here (load_vsa_kernel: compiled and checked) are timed at the bundle's own
    VSA shape, the tiles of its longest profile's layout at one rank's heads, routed at the bundle's sparsity
    (MEASURE_SPARSITY where that is 0), every call with its device scales: fa4 (bf16) and fp8 at each of the Triton
    kernel's 64-row tile configurations. The fastest is served (FP8 is a permission, not an order: the issue's "serve
    the fastest"); the record keeps every time and each candidate left out, with why. Where neither warms up, the
    bf16 choice (flex, reference), fa4 and fp8 left out and logged;
  - on the CPU nothing is timed: fp8_emulated, fp8 left out (it needs CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import UserError
from ..models.vsa.plan import choose_vsa_kernel, load_vsa_kernel
from ..models.vsa.tiles import VsaGeometry
from .attention_choice import median_cuda_ms
from .sparse_choice import fp8_tiles  # VSA's tiles are the FP8 kernel's 64-row ones

MEASURE_SPARSITY = 0.9  # the timing routing's sparsity where the bundle's is 0 (FastH3 v1's)
BENCH_WARMUP, BENCH_ITERS = 2, 5


@dataclass(frozen=True)
class VsaChoice:
    """The VSA kernel a bundle serves and how it was chosen (VsaServing's kernel, tile, left_out, measured_ms)."""

    kernel: str
    tile: str | None = None
    left_out: dict[str, str] = field(default_factory=dict)
    measured_ms: dict[str, float] = field(default_factory=dict)


# (kernel, tile, geometry, heads, head_dim, sparsity, device) -> ms
Measure = Callable[[str, "str | None", VsaGeometry, int, int, float, torch.device], float]
Load = Callable[..., str]


def resolve_vsa_kernel(device, heads: int, head_dim: int, dtype: torch.dtype, fp8: bool, geometry: VsaGeometry,
                       sparsity: float, log=print, measure: Measure | None = None, load: Load = load_vsa_kernel,
                       tiles: Callable[[], tuple[str, ...]] = lambda: fp8_tiles(64)) -> VsaChoice:
    """The kernel a FastH3-VSA build serves on `device` (module docstring); `fp8`: built with --fp8-attention.
    `measure`, `load` (warm a kernel, UserError where it cannot) and `tiles` are parameters so the race is testable
    without a GPU."""
    device = torch.device(device)
    if not fp8:
        kernel, left_out = choose_vsa_kernel(device, heads, head_dim, dtype, log)
        return VsaChoice(kernel, None, left_out)
    if device.type != "cuda":
        left_out = {"fp8": f"the fp8 VSA kernel needs a CUDA GPU; this device is {device}"}
        log(f"VSA kernel fp8 left out: {left_out['fp8']}; fp8_emulated (its semantics in torch) serves")
        return VsaChoice(load(device, heads, head_dim, dtype, "fp8_emulated"), None, left_out)
    measure = measure or measure_vsa_ms
    sparsity = sparsity or MEASURE_SPARSITY
    left_out, measured = {}, {}
    for kernel, tile in [("fa4", None)] + [("fp8", t) for t in tiles()]:
        name = kernel if tile is None else f"{kernel}:{tile}"
        try:
            load(device, heads, head_dim, dtype, kernel, tile)
        except UserError as e:
            left_out[name] = str(e)
            log(f"VSA kernel {name} left out: {e}")
            continue
        measured[name] = round(float(measure(kernel, tile, geometry, heads, head_dim, sparsity, device)), 3)
    if not measured:
        kernel, bf16_left_out = choose_vsa_kernel(device, heads, head_dim, dtype, log)
        return VsaChoice(kernel, None, {**left_out, **bf16_left_out})
    best = min(measured, key=lambda name: (measured[name], list(measured).index(name)))  # ties: the first timed
    kernel, _, tile = best.partition(":")
    log(f"VSA kernels timed at {geometry.padded_len} padded rows x {heads} heads, sparsity {sparsity:g}: "
        + ", ".join(f"{n} {ms:g} ms" for n, ms in measured.items()) + f"; serving {best}")
    return VsaChoice(kernel, tile or None, left_out, measured)


def measure_vsa_ms(kernel: str, tile: str | None, geometry: VsaGeometry, heads: int, head_dim: int, sparsity: float,
                   device: torch.device) -> float:
    """Median ms of one VSA fine-branch call (the FP8 kernel's scales and quantization pass included) over
    `geometry`'s padded tiles, bf16 q/k/v of unit normal rows (pad rows zero), routed as vsa_attention routes them,
    CUDA events after warm-up."""
    from ..models.vsa.routing import pool_tiles, route_tiles, tile_scores
    from ..models.vsa.fp8 import vsa_attention_kernel
    from ..models.vsa.kernels import key_valid

    geometry = geometry.to(device)
    g = torch.Generator(device).manual_seed(0)
    real = key_valid(geometry.sizes).view(1, -1, 1, 1)
    q, k, v = (torch.randn(1, geometry.padded_len, heads, head_dim, device=device, dtype=torch.bfloat16,
                           generator=g) * real for _ in range(3))
    block_fn = vsa_attention_kernel(kernel, tile)
    with torch.no_grad():
        index, sparse_G = route_tiles(tile_scores(pool_tiles(q, geometry), pool_tiles(k, geometry)),
                                      geometry.num_prefix_tiles, sparsity)
        return median_cuda_ms(lambda: block_fn(q, k, v, index, sparse_G, geometry.sizes), BENCH_ITERS, BENCH_WARMUP,
                              device)
