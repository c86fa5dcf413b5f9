"""VSA's fine branch in FP8: the attention over the kept tiles (models/vsa/kernels.py's, the same masks) with q, k and
v - mu in e4m3, the recipe of the dense FP8 attention (calibration/fp8_attention.py) and of SubBlock's FP8 kernel
(models/sparse/fp8.py), over VSA's padded tile layout where a key tile may be ragged.

Semantics, per call over the padded layout [B, P, N, D] (pad rows zero):
    mu     = v's mean over the real rows (fp32, per batch, head and channel): the sum over all P rows / sum(sizes)
    scales = per-tensor, computed on the device at each call (no host sync): max |q| / 448, max |k| / 448 and
             max |v - mu| / 448 (pad rows included: zeros, and |0 - mu|, so a scale only grows by them)
    q8, k8, v8 = e4m3(q / q_scale), e4m3(k / k_scale), e4m3((v - mu) / v_scale), saturating
    o = softmax over the kept tiles' real key rows (key position j of tile t counts iff j < sizes[t]) of
        q8 k8^T q_scale k_scale D^-1/2, times v8 v_scale, plus mu.
Why dynamic scales, not calibrated ones: a FastH3-VSA bundle runs VSA between the block halves in every evaluation, so
no compiled segment holds its attention and the dense FP8 attention's calibration (per layer, over trajectories) has
no attention of this model to observe; the three reductions cost one read of q, k and v (scripts/bench_vsa.py times
them: the `fp8_scales_ms` row), and per-call scales cannot saturate on a request unlike the calibration's.

Kernels:
  fp8           the Triton FP8 block-sparse kernel (models/sparse/fp8_triton.py) at 64-row blocks with the per-key-
                tile row count (key_sizes): FP8 wgmma on sm_90; one of its fixed tiles, timed at build and recorded.
  fp8_emulated  the semantics in torch on any device: quantize, dequantize, the masked fp32 reference over the kept
                tiles (models/vsa/kernels.py reference_vsa_attention), mu added. It keeps the probabilities exact
                where the kernel rounds them to e4m3 for its PV product. What a CPU build bakes and CI checks.

Shape legend: B batch, P padded rows (64 G), N heads, D head dim, G tiles, T kept tiles per query tile.
"""

from __future__ import annotations

import torch

from ..sparse.fp8 import E4M3_MAX, _e4m3
from ..sparse.kernels import SPARSE_KERNEL_NEEDS
from .kernels import (VSA_KERNELS, key_valid, reference_vsa_attention, vsa_block_attention, vsa_kernel_problem,
                      warm_cases)
from .tiles import VSA_TILE_ROWS

VSA_FP8_KERNELS = ("fp8_emulated", "fp8")
ALL_VSA_KERNELS = VSA_KERNELS + VSA_FP8_KERNELS  # what a record may name
# The warm-up's check of the fp8 kernel against the emulation on the same inputs (relative error of o - mu over the
# real rows): they differ by the kernel's e4m3 rounding of the probabilities, 2-8% (tests/models/test_sparse_fp8.py); a
# pad row attended or a ragged edge misread moves it by tenths (tests/models/test_vsa_fp8.py).
FP8_WARM_TOLERANCE = 0.10


def vsa_fp8_scales(q_BPND, k_BPND, v_BPND, sizes_G) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales [3] fp32: q's, k's and the centered v's max magnitude / 448; mu [B, N, D] fp32: v's mean over the real
    rows), on q's device with no host sync (module docstring)."""
    mu_BND = v_BPND.sum(1, dtype=torch.float32) / sizes_G.sum().to(torch.float32)
    q_lo, q_hi = torch.aminmax(q_BPND)
    k_lo, k_hi = torch.aminmax(k_BPND)
    v_lo, v_hi = torch.aminmax(v_BPND, dim=1)  # [B, N, D]
    amax = torch.stack([torch.maximum(-q_lo, q_hi).float(), torch.maximum(-k_lo, k_hi).float(),
                        torch.maximum(v_hi.float() - mu_BND, mu_BND - v_lo.float()).amax()])
    return (amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny), mu_BND


def emulated_fp8_vsa_attention(q_BPND, k_BPND, v_BPND, index_BNGT, sparse_G, sizes_G, scales_3,
                               mu_BND) -> torch.Tensor:
    """The semantics on any device: q, k and v - mu quantized and dequantized, the masked fp32 reference over the kept
    tiles' real key rows, mu added; [B, P, N, D] in q's dtype."""
    mu_B1ND = mu_BND[:, None]
    q, k, v = (_e4m3(t, s).float() * s for t, s in ((q_BPND, scales_3[0]), (k_BPND, scales_3[1]),
                                                     (v_BPND.float() - mu_B1ND, scales_3[2])))
    return (reference_vsa_attention(q, k, v, index_BNGT, sparse_G, sizes_G) + mu_B1ND).to(q_BPND.dtype)


def fp8_vsa_attention(q_BPND, k_BPND, v_BPND, index_BNGT, sparse_G, sizes_G, kernel: str,
                      tile: str | None = None) -> torch.Tensor:
    """VSA's attention over the kept tiles in FP8 with `kernel` (fp8: the Triton kernel at tile `tile`, None its
    default; fp8_emulated) and per-call scales: [B, P, N, D] in q's dtype."""
    scales, mu = vsa_fp8_scales(q_BPND, k_BPND, v_BPND, sizes_G)
    if kernel == "fp8_emulated":
        return emulated_fp8_vsa_attention(q_BPND, k_BPND, v_BPND, index_BNGT, sparse_G, sizes_G, scales, mu)
    if kernel != "fp8":
        raise ValueError(f"FP8 VSA kernels are {VSA_FP8_KERNELS}, got {kernel!r}.")
    if not q_BPND.is_cuda:
        raise ValueError(f"the fp8 VSA kernel runs on CUDA tensors, got {q_BPND.device}; 'fp8_emulated' runs anywhere.")
    return triton_fp8_vsa_attention(q_BPND, k_BPND, v_BPND, index_BNGT, sparse_G, sizes_G, scales, mu, tile)


def triton_fp8_vsa_attention(q_BPND, k_BPND, v_BPND, index_BNGT, sparse_G, sizes_G, scales_3, mu_BND,
                             tile: str | None = None) -> torch.Tensor:
    """The Triton kernel's call with given scales and mu (vsa_fp8_scales'): the quantization pass (v centered by mu),
    then the block-sparse kernel at 64-row blocks, each key tile's real rows its keys; [B, P, N, D] in q's dtype."""
    from ..sparse.fp8_triton import fp8_block_sparse_attention, fp8_operands, tile_config

    ops = fp8_operands(q_BPND, k_BPND, v_BPND, *scales_3.split(1), mu_BND=mu_BND)
    return fp8_block_sparse_attention(ops, index_BNGT, sparse_G, VSA_TILE_ROWS, tile_config(VSA_TILE_ROWS, tile),
                                      q_BPND.dtype, key_sizes=sizes_G.to(torch.int32))


def vsa_attention_kernel(kernel: str, tile: str | None = None):
    """The block function of `kernel` (any of ALL_VSA_KERNELS; `tile` the fp8 kernel's): (q, k, v, index, sparse_G,
    sizes) -> out, what models/vsa/routing.py vsa_attention takes."""
    if kernel in VSA_FP8_KERNELS:
        return lambda *a: fp8_vsa_attention(*a, kernel, tile)
    if tile is not None:
        raise ValueError(f"a tile configuration is the fp8 VSA kernel's; the {kernel} kernel takes none.")
    return lambda *a: vsa_block_attention(*a, kernel)


# What each FP8 VSA kernel needs from a machine: the FP8 block-sparse kernel's (the same Triton FP8 wgmma).
VSA_FP8_NEEDS = {kernel: SPARSE_KERNEL_NEEDS[kernel] for kernel in VSA_FP8_KERNELS}


def vsa_problem(kernel: str, device) -> str | None:
    """Why `device` cannot run VSA `kernel` (any of ALL_VSA_KERNELS), with the fix; None when it can."""
    if kernel not in VSA_FP8_KERNELS:
        return vsa_kernel_problem(kernel, device)
    return VSA_FP8_NEEDS[kernel].problem(f"the {kernel} VSA kernel", device, "fp8_emulated runs here.",
                                         "Use a bf16 VSA kernel (fa4, flex or reference).")


def warm_fp8_vsa_kernel(kernel: str, tile: str | None, device, heads: int, head_dim: int, dtype) -> None:
    """Run the FP8 `kernel` at `tile` on warm_cases' ragged tiles (batch 1 and 2), so that Triton compiles it at load,
    never at a request, and check the fp8 kernel against the emulation on the same inputs (FP8_WARM_TOLERANCE).
    Raises where the device cannot run it or its output differs."""
    problem = vsa_problem(kernel, device)
    if problem is not None:
        raise ValueError(problem)
    with torch.no_grad():
        for q, k, v, index, sparse_G, sizes in warm_cases(device, heads, head_dim, dtype):
            out = fp8_vsa_attention(q, k, v, index, sparse_G, sizes, kernel, tile)
            if kernel == "fp8":
                want = fp8_vsa_attention(q, k, v, index, sparse_G, sizes, "fp8_emulated")
                _, mu = vsa_fp8_scales(q, k, v, sizes)
                real = key_valid(sizes)
                err = centered_error(out[:, real], want[:, real], mu)
                if not err < FP8_WARM_TOLERANCE:  # NaN fails too
                    raise ValueError(f"its output differs from the FP8 emulation on the warm-up tiles (relative "
                                     f"error {err:.3g}, allowed {FP8_WARM_TOLERANCE}): this install's Triton does not "
                                     "compute VSA's masks as h3trt passes them")
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def centered_error(got_BSND, want_BSND, mu_BND) -> float:
    """|got - want| / |want - mu| (Frobenius): the error on the attention's centered part, the part FP8 carries."""
    centered = want_BSND.float() - mu_BND[:, None]
    return ((got_BSND.float() - want_BSND.float()).norm() / centered.norm()).item()
