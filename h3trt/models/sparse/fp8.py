"""FP8 block-sparse attention: the dense FP8 attention's recipe (h3trt/calibration/fp8_attention.py: e4m3 q/k/v with
the layer's calibrated per-tensor scales, v centered over its rows, the output scaled back and mu added) over the key
blocks the SubBlock router keeps. A bundle built with --precision fp8 --fp8-attention serves it between the block's
halves, each layer with its own q/k/v scales (engines/bundle.py), in place of a bf16 block-sparse kernel.

Kernels (models/sparse/kernels.py's table says what each needs):
  fp8           the Triton kernel (models/sparse/fp8_triton.py): FP8 wgmma on sm_90, one of its fixed tile
                configurations (chosen by timing at build, recorded in the manifest).
  fp8_emulated  the semantics in torch on any device: quantize, dequantize, the masked reference over the kept
                blocks in fp32, mu added. It does not round the probabilities to e4m3 (the Triton kernel does, for
                its PV product), so the two differ by that one rounding. What a CPU build bakes and CI checks.

Shape legend: B batch, S rows, N heads, D head dim, G query blocks, T kept key blocks per query block.
"""

from __future__ import annotations

import torch

from .reference import reference_sparse_attention

FP8_SPARSE_KERNELS = ("fp8", "fp8_emulated")
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Saturating e4m3 quantization, x ~ x8 * scale (calibration/formats.py quantize_fp8's, which this layer may not
    import)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def emulated_fp8_sparse_attention(q_BSND, k_BSND, v_BSND, q_scale, k_scale, v_scale, index_BNGT, sparse_G,
                                  block: int) -> torch.Tensor:
    """The reference semantics on any device: q, k and v - mu quantized with their scales and dequantized, attention
    over the kept blocks in fp32 (the masked reference), mu added; [B, S, N, D] in q's dtype."""
    mu_B1ND = v_BSND.mean(dim=1, keepdim=True, dtype=torch.float32)
    q, k, v = ((_e4m3(t, s).float() * s) for t, s in ((q_BSND, q_scale), (k_BSND, k_scale),
                                                      (v_BSND.float() - mu_B1ND, v_scale)))
    out_BSND = reference_sparse_attention(q, k, v, index_BNGT, sparse_G, block)
    return (out_BSND + mu_B1ND).to(q_BSND.dtype)


def fp8_sparse_attention(q_BSND, k_BSND, v_BSND, scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                         index_BNGT, sparse_G, block: int, kernel: str, tile: str | None = None) -> torch.Tensor:
    """Block-sparse FP8 attention over [B, S, N, D] q/k/v in the block dtype with the layer's (q, k, v) scales
    ([1] fp32 each, v's for the centered v): query block g attends the key blocks index[b, n, g, :] where
    sparse_G[g], every key block elsewhere. `tile`: the fp8 kernel's configuration (None: its default)."""
    if kernel == "fp8_emulated":
        return emulated_fp8_sparse_attention(q_BSND, k_BSND, v_BSND, *scales, index_BNGT, sparse_G, block)
    if kernel != "fp8":
        raise ValueError(f"FP8 block-sparse attention kernels are {FP8_SPARSE_KERNELS}, got {kernel!r}.")
    if not q_BSND.is_cuda:
        raise ValueError(f"the fp8 sparse attention kernel runs on CUDA tensors, got {q_BSND.device}; "
                         "'fp8_emulated' runs anywhere.")
    from .fp8_triton import fp8_sparse_attention_triton, tile_config

    return fp8_sparse_attention_triton(q_BSND, k_BSND, v_BSND, *scales, index_BNGT, sparse_G, block,
                                       tile_config(block, tile))


def unit_scales(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor scales for unit-normal q/k/v (max |x| about 4.5 at the warm-up's sizes): what a warm-up runs with."""
    return tuple(torch.full((1,), 5.0 / E4M3_MAX, device=device) for _ in range(3))
