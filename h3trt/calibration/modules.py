"""Quantized drop-ins for a main block's linears and attention, and the functions that put them into a block.

Each module's forward is one line over its buffers, so the block segment (weights as inputs) sees the quantized
tensors and scales as ordinary named inputs: `blocks.i.mlp.fc1.weight` (e4m3), `blocks.i.mlp.fc1.weight_scale`, ...
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..adapters.slots import merged_weight
from ..models.attention import bound_attention
from ..models.dit import Block
from ..models.precision import Precision
from .formats import (FP8, NVFP4_GROUP, dequantize_nvfp4, fp8_adapter_linear, fp8_linear, nvfp4_weight_only_linear,
                      quantize_fp8)
from .fp8_attention import center_rows, fp8_sdpa
from .recipe import QuantRecipe


class FP8Linear(nn.Module):
    """W8A8 linear, per-tensor static scales (no bias: no block linear has one). `fast_accum` is code, not data: the
    compiled segment bakes it (QuantRecipe.fp8_accum)."""

    def __init__(self, out_features: int, in_features: int, device=None, fast_accum: bool = False):
        super().__init__()
        self.fast_accum = fast_accum
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.ones(1, dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones(1, dtype=torch.float32, device=device))

    def forward(self, x):
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.fast_accum)

    def with_adapters(self, x, down_PEK, up_PEN, scales_E):
        """forward(x) with LoRA rank rows in its FP8 GEMM (adapters/slots.py FUSED; formats.fp8_adapter_linear)."""
        return fp8_adapter_linear(x, self.weight, self.weight_scale, self.input_scale, self.fast_accum, down_PEK,
                                  up_PEN, scales_E)


class SmoothedFP8Linear(FP8Linear):
    """FP8Linear behind a per-input-channel scale (SmoothQuant's pre_quant_scale, in the block dtype as ModelOpt keeps
    it). Inside the compiled block the multiply fuses into the pointwise kernel that quantizes the input."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, device=None, fast_accum: bool = False):
        super().__init__(out_features, in_features, device, fast_accum)
        self.register_buffer("pre_quant_scale", torch.ones(in_features, dtype=dtype, device=device))

    def forward(self, x):
        return fp8_linear(x * self.pre_quant_scale, self.weight, self.weight_scale, self.input_scale, self.fast_accum)

    def with_adapters(self, x, down_PEK, up_PEN, scales_E):
        """The adapter sees the unsmoothed x: A / s against x * s."""
        return super().with_adapters(x * self.pre_quant_scale, down_PEK.float() / self.pre_quant_scale.float(),
                                     up_PEN, scales_E)


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

    def with_adapters(self, x, down_PEK, up_PEN, scales_E):
        """forward(x) with LoRA rank rows merged into the weight it dequantizes anyway (adapters/slots.py FUSED)."""
        weight = dequantize_nvfp4(self.weight_packed, self.weight_block_scale, self.weight_global_scale, x.dtype)
        return F.linear(x, merged_weight(weight, down_PEK, up_PEN, scales_E))


class SmoothedNVFP4Linear(NVFP4Linear):
    """NVFP4Linear behind a per-input-channel scale (AWQ's pre_quant_scale, in the block dtype as ModelOpt keeps it)."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, device=None):
        super().__init__(out_features, in_features, device)
        self.register_buffer("pre_quant_scale", torch.ones(in_features, dtype=dtype, device=device))

    def forward(self, x):
        return nvfp4_weight_only_linear(x * self.pre_quant_scale, self.weight_packed, self.weight_block_scale,
                                        self.weight_global_scale)

    def with_adapters(self, x, down_PEK, up_PEN, scales_E):
        """The adapter sees the unsmoothed x: A / s against x * s."""
        return super().with_adapters(x * self.pre_quant_scale, down_PEK.float() / self.pre_quant_scale.float(),
                                     up_PEN, scales_E)


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
    fp8 = recipe.precision is Precision.FP8  # else NVFP4
    fast = {"fast_accum": recipe.fp8_accum == "fast"} if fp8 else {}
    for name in recipe.quantized_linears():
        linear = block.get_submodule(name)
        shape = (linear.out_features, linear.in_features)
        if recipe.smooths_inputs:
            cls = SmoothedFP8Linear if fp8 else SmoothedNVFP4Linear
            module = cls(*shape, dtype=linear.weight.dtype, device=device, **fast)
        else:
            module = (FP8Linear if fp8 else NVFP4Linear)(*shape, device=device, **fast)
        _swap(block, name, module)
    return block


@torch.no_grad()
def load_quantized_block(block: Block, cfg, recipe: QuantRecipe, tensors: dict[str, torch.Tensor]) -> Block:
    """Replace the block's linears (and attention, with --fp8-attention) by the recipe's quantized modules, filled
    with `tensors`: every buffer they declare, by its name inside the block (`mlp.fc1.weight`, `mlp.fc1.input_scale`,
    `attn.q_scale`, ...), as h3trt/calibration/calibrate.py exports them from ModelOpt's quantizers."""
    quantized_template(block, cfg, recipe)
    prefixes = tuple(f"{n}." for n in recipe.quantized_linears()) + ("attn.q_scale", "attn.k_scale", "attn.v_scale")
    for name, buffer in block.named_buffers():
        if not name.startswith(prefixes):
            continue
        if name not in tensors:
            raise KeyError(f"the calibration exported no {name!r} for this block; it exported {sorted(tensors)}.")
        value = tensors[name]
        if value.shape != buffer.shape or value.dtype != buffer.dtype:
            raise ValueError(f"{name}: the calibration exported {value.dtype} {tuple(value.shape)}, the module holds "
                             f"{buffer.dtype} {tuple(buffer.shape)}.")
        buffer.copy_(value)
    return block
