"""Quantized drop-ins for a main block's linears and attention, and the functions that put them into a block.

Each module's forward is one line over its buffers, so the block segment (weights as inputs) sees the quantized
tensors and scales as ordinary named inputs: `blocks.i.mlp.fc1.weight` (e4m3), `blocks.i.mlp.fc1.weight_scale`, ...
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..models.attention import bound_attention
from ..models.dit import Block
from .formats import (
    FP8, NVFP4_GROUP, fp8_linear, fp8_scale, nvfp4_weight_only_linear, quantize_fp8, quantize_nvfp4,
)
from .fp8_attention import center_rows, fp8_sdpa
from .recipe import QuantRecipe


class FP8Linear(nn.Module):
    """W8A8 linear, per-tensor static scales (no bias: no block linear has one)."""

    def __init__(self, out_features: int, in_features: int, device=None):
        super().__init__()
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.ones(1, dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones(1, dtype=torch.float32, device=device))

    def forward(self, x):
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale)


class NVFP4Linear(nn.Module):
    """Weight-only NVFP4 linear: dequantized to the activation dtype inside the compiled block, bf16 GEMM."""

    def __init__(self, out_features: int, in_features: int, device=None):
        super().__init__()
        self.register_buffer("weight_packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8,
                                                          device=device))
        self.register_buffer("weight_block_scale", torch.empty(out_features, in_features // NVFP4_GROUP, dtype=FP8,
                                                               device=device))
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))

    def forward(self, x):
        return nvfp4_weight_only_linear(x, self.weight_packed, self.weight_block_scale, self.weight_global_scale)


ATTENTION_SCALES = ("q_scale", "k_scale", "v_scale")


def fp8_attention(q_BSND, k_BSND, v_BSND, q_scale, k_scale, v_scale, kernel: str):
    """Attention over e4m3 q/k/v with calibrated static scales, v centered over the rows (h3trt/calibration/fp8_attention.py
    says why). Inside a compiled block the quantization fuses into the RoPE kernel and the dequantization and the
    mean's return into the out-projection's input quantization."""
    v_centered, mu_B1ND = center_rows(v_BSND)
    out_fp8 = fp8_sdpa(quantize_fp8(q_BSND, q_scale), quantize_fp8(k_BSND, k_scale), quantize_fp8(v_centered, v_scale),
                       q_scale, k_scale, v_scale, kernel)
    out = out_fp8.float() * v_scale if out_fp8.dtype == FP8 else out_fp8.float()  # e4m3 in v's scale, or bf16 o
    return (out + mu_B1ND).to(q_BSND.dtype)


def attention_fn(scales: dict[str, torch.Tensor] | None, kernel: str):
    """The block's attention core: `h3trt::attention` with `kernel` (scales None: attention in the block dtype), or
    FP8 attention with FP8 `kernel` bound to the block's q/k/v scales."""
    if scales is None:
        return bound_attention(kernel)
    q_scale, k_scale, v_scale = (scales[n] for n in ATTENTION_SCALES)
    return lambda q, k, v: fp8_attention(q, k, v, q_scale, k_scale, v_scale, kernel)


def _swap(block: Block, name: str, module: nn.Module) -> None:
    parent, leaf = name.rsplit(".", 1)
    setattr(block.get_submodule(parent), leaf, module)


def quantized_template(block: Block, cfg, recipe: QuantRecipe) -> Block:
    """The block's structure with the recipe's modules in place (weights on the block's device, uninitialised):
    the compiled segment's code, and the names of its inputs."""
    device = block.norm1.weight.device
    if recipe.fp8_attention:
        # Buffers, so the scales travel with the block's weights; the block segment binds them into its attn_fn.
        for name in ATTENTION_SCALES:
            block.attn.register_buffer(name, torch.ones(1, dtype=torch.float32, device=device))
    for name in recipe.quantized_linears():
        linear = block.get_submodule(name)
        cls = FP8Linear if recipe.precision == "fp8" else NVFP4Linear
        _swap(block, name, cls(linear.out_features, linear.in_features, device=device))
    return block


@torch.no_grad()
def quantize_block(block: Block, cfg, recipe: QuantRecipe, amax: dict[str, torch.Tensor]) -> Block:
    """Replace the block's linears (and attention, with --fp8-attention) by quantized modules holding real weights.
    `amax` maps names inside the block (`mlp.fc1.input`, `attn.q`, ...) to calibrated max |x|."""
    originals = {name: block.get_submodule(name).weight.detach() for name in recipe.quantized_linears()}
    quantized_template(block, cfg, recipe)
    for name, weight in originals.items():
        module = block.get_submodule(name)
        if recipe.precision == "fp8":
            module.weight_scale.copy_(fp8_scale(weight.abs().amax()))
            module.weight.copy_(quantize_fp8(weight, module.weight_scale))
            module.input_scale.copy_(fp8_scale(_amax(amax, f"{name}.input")))
        else:
            for key, value in quantize_nvfp4(weight).items():
                getattr(module, key).copy_(value)
    if recipe.fp8_attention:
        for name in ("q", "k", "v"):
            getattr(block.attn, f"{name}_scale").copy_(fp8_scale(_amax(amax, f"attn.{name}")))
    return block


def _amax(amax: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in amax:
        raise KeyError(f"calibration recorded no max for {key!r}: the calibration runs never reached it.")
    return amax[key]
