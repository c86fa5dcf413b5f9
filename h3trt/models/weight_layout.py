"""How the checkpoint layouts order the rows of two fused weights, and the conversions between them.

- qkv: the official layout interleaves per head, rows [h0: q k v, h1: q k v, ...]; the model (and diffusers' fused
  to_q/to_k/to_v) reads [q_all; k_all; v_all]. The video VAE's attn.to_qkv is interleaved the same way.
- SwiGLU first linear: native [gate; up] against diffusers' [up; gate], the same swap both ways.
"""

from __future__ import annotations

import torch


def deinterleave_qkv(weight: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """qkv weight [3 * N * D, ...] with rows [h0: q k v, h1: q k v, ...] -> rows [q_all; k_all; v_all], same
    shape (N = num_heads, D = head_dim)."""
    grouped = weight.reshape(num_heads, 3, head_dim, *weight.shape[1:])
    return grouped.transpose(0, 1).reshape(weight.shape)


def interleave_qkv(weight: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of `deinterleave_qkv` (writes official-layout checkpoints)."""
    stacked = weight.reshape(3, num_heads, head_dim, *weight.shape[1:])
    return stacked.transpose(0, 1).reshape(weight.shape)


def swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """SwiGLU's first linear: native [gate; up] <-> diffusers [up; gate]."""
    first, second = weight.chunk(2, dim=0)
    return torch.cat([second, first]).contiguous()
