"""`--vae-precision fp8`: the video decoder's ViT linears in W8A8 e4m3, everything else as the bf16 reference load.

What is quantized: in each of the decoder's transformer blocks, attn.to_q / to_k / to_v / to_out.0 and the SwiGLU
ff.net.0.proj / ff.net.2 (about 98% of the decoder's FLOPs at a 1,797-token tile). What is not: the encoder (keyframe
encode keeps the reference's fp32), post_quant_conv, proj_in (K = 24 is no e4m3 GEMM), proj_out (pixels), every
norm and scale (fp32 by diffusers' rule, and `_skip_layerwise_casting_patterns` names them), attention itself (bf16
SDPA). No peer ships a quantized H3 VAE.

Two activation-scale schemes, both with the weights quantized from the checkpoint at load (deterministic, so a bundle
stores no quantized weights and its compiled decoder binds the same tensors the eager VAE holds):
  dynamic  per-token activation scales computed on the fly, per-output-channel weight scales (the rowwise
           `torch._scaled_mm`). No calibration data; what `--vae-precision fp8` runs.
  static   per-tensor activation scales from a calibration decode, per-tensor weight scales (the DiT's
           `fp8_linear`). Measured by scripts/bench_vae.py against dynamic; not offered on the command line, as its
           scales would be calibrated on the build's random latents rather than real ones.

Each quantized module's forward is one line over its buffers. `bias` is registered first on purpose: diffusers'
block takes its compute dtype from the first floating tensor of attn.to_q (`get_parameter_dtype`), which must stay
the bf16 bias, not the e4m3 weight.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from ..models.checkpoint.vae import load_video_vae
from ..models.vae_precision import VAEPrecision, skips_low_precision
from ..models.video_vae import VideoVAE
from .formats import FP8, fp8_linear, fp8_rowwise_linear, fp8_scale, quantize_fp8, quantize_fp8_rows

# The quantized linears, by name inside a decoder transformer block (diffusers names).
DECODER_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
ACTIVATION_SCALES = ("dynamic", "static")
# What an fp8 bundle's video decoder executes (recorded in its manifest).
EXECUTION = ("W8A8 e4m3 in the decoder's ViT linears (attn.to_q/k/v/out, ff.net.0.proj, ff.net.2 of every block): "
             "dynamic per-token activation scales, per-output-channel weight scales, rowwise torch._scaled_mm; "
             "weights quantized from the checkpoint at load; attention, norms, proj_in/out, encoder as bf16 rules")


class FP8TokenLinear(nn.Module):
    """W8A8 with dynamic per-token activation scales and per-output-channel weight scales."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))  # first: see the module doc
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.ones(1, out_features, dtype=torch.float32, device=device))

    def forward(self, x):
        return fp8_rowwise_linear(x, self.weight, self.weight_scale, self.bias)


class FP8StaticLinear(nn.Module):
    """W8A8 with calibrated per-tensor activation and weight scales."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))  # first: see the module doc
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.ones(1, dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones(1, dtype=torch.float32, device=device))

    def forward(self, x):
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale) + self.bias


def decoder_linear_names(vae) -> list[str]:
    """Full names of the linears FP8 replaces; refuses any that diffusers would keep out of low precision."""
    names = [f"decoder.transformer_blocks.{i}.{n}" for i in range(len(vae.decoder.transformer_blocks))
             for n in DECODER_LINEARS]
    honoured = [n for n in names if skips_low_precision(vae, n)]
    if honoured:
        raise ValueError(f"{honoured[:3]} match diffusers' _skip_layerwise_casting_patterns / _keep_in_fp32_modules; "
                         "the FP8 decoder must leave them in their reference precision.")
    return names


@torch.no_grad()
def quantize_video_decoder(vae, activations: str = "dynamic", amax: dict[str, torch.Tensor] | None = None):
    """Swap the decoder's ViT linears (bf16-placed, h3trt/models/vae_precision.py) for FP8 modules holding e4m3
    weights, in place. `static` needs `amax`: max |input| per linear name, from `calibrate_video_decoder`."""
    if activations not in ACTIVATION_SCALES:
        raise ValueError(f"FP8 activation scales must be one of {ACTIVATION_SCALES}, got {activations!r}.")
    if activations == "static" and amax is None:
        raise ValueError("static FP8 activation scales need amax from calibrate_video_decoder(...).")
    from diffusers.models.modeling_utils import get_parameter_dtype

    for name in decoder_linear_names(vae):
        linear = vae.get_submodule(name)
        if not isinstance(linear, nn.Linear) or linear.bias is None:
            raise ValueError(f"{name} is {type(linear).__name__}, not a biased nn.Linear: already quantized?")
        if linear.weight.dtype != torch.bfloat16:
            raise ValueError(f"{name} is {linear.weight.dtype}; the FP8 decoder quantizes a bf16-placed VAE (load it "
                             "with dtype=torch.bfloat16 first): its activations and outputs are bf16.")
        w = linear.weight.detach()
        args = (linear.out_features, linear.in_features, torch.bfloat16, w.device)
        if activations == "dynamic":
            module = FP8TokenLinear(*args)
            q, scale_N1 = quantize_fp8_rows(w)
            module.weight_scale.copy_(scale_N1.t())
        else:
            if name not in amax:
                raise KeyError(f"calibration recorded no max for {name!r}: the calibration decode never reached it.")
            module = FP8StaticLinear(*args)
            module.weight_scale.copy_(fp8_scale(w.abs().amax()))
            q = quantize_fp8(w, module.weight_scale)
            module.input_scale.copy_(fp8_scale(amax[name]))
        module.weight.copy_(q)
        module.bias.copy_(linear.bias.detach())
        parent, leaf = name.rsplit(".", 1)
        setattr(vae.get_submodule(parent), leaf, module)
    for block in vae.decoder.transformer_blocks:
        if get_parameter_dtype(block.attn.to_q) != torch.bfloat16:
            raise AssertionError("a quantized block's compute dtype is no longer bf16 (FP8 module buffer order).")
    return vae


@torch.no_grad()
def calibrate_video_decoder(video_vae: VideoVAE, latents_BCTHW: torch.Tensor, windows: int = 1) -> dict:
    """max |input| of every linear FP8 replaces, over an eager decode of the first `windows` windows of
    (normalised) latents: the static scheme's activation scales."""
    amax, hooks = {}, []

    def record(name):
        def hook(module, inputs):
            m = inputs[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax[name], m) if name in amax else m
        return hook

    for name in decoder_linear_names(video_vae.vae):
        hooks.append(video_vae.vae.get_submodule(name).register_forward_pre_hook(record(name)))
    try:
        z, plan = video_vae.prepare(latents_BCTHW)
        for w in range(min(windows, len(plan.windows))):
            video_vae.decode_window(z, plan, w)
    finally:
        for h in hooks:
            h.remove()
    return amax


def load_video_vae_at(component_root: Path, device, precision: VAEPrecision) -> VideoVAE:
    """The video VAE at `precision`: diffusers' placement at its dtype, then (fp8) the ViT linears quantized."""
    video_vae = load_video_vae(component_root, device, precision.dtype)
    if precision.quantized:
        quantize_video_decoder(video_vae.vae, "dynamic")
    if video_vae.precision != precision.name:
        raise AssertionError(f"loaded a {video_vae.precision} video VAE for --vae-precision {precision.name}.")
    return video_vae
