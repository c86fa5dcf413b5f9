"""The precision the VAEs run at, and the one rule that places their weights: diffusers' own.

The reference pipeline loads every component with `pipe.load_components(dtype=torch.bfloat16)`, which is
`from_pretrained(torch_dtype=torch.bfloat16)` per component. For a model with `_keep_in_fp32_modules` that casts each
floating tensor of the checkpoint (parameters and persistent buffers) to the dtype unless one of those module names is
a *whole component* of its dotted name (diffusers `load_model_dict_into_meta`: `m in name.split(".")`), in which case
it stays float32; non-persistent buffers (the decoder's rotary frequencies) are not in the checkpoint and keep the
dtype they were built with. A substring test is not the same rule: "quant_conv" is a substring of
"post_quant_conv", and keeping that bf16 decoder input in fp32 is what broke an earlier bf16 attempt.

What the rule gives for the H3 VAEs (tested against diffusers in tests/models/test_vae_precision.py):
  video: encoder, quant_conv, every norm (norm1, norm2, norm_out) and scale1/scale2 fp32; post_quant_conv, proj_in,
         register tokens, the ViT linears and proj_out bf16. The residual stream is therefore fp32 (scale1 is) and a
         tile's pixels come out bf16 (proj_out is). Keyframe / reference encode runs entirely in fp32, as in fp32.
  audio: `_keep_in_fp32_modules` covers every parameter: the audio VAE is fp32 at every precision (diffusers says
         why: the BigVGAN decoder is ~20 dB quieter in bf16).
`_skip_layerwise_casting_patterns` ("norm") names the modules diffusers never stores in a lower precision
(`enable_layerwise_casting`); under bf16 every tensor they match is already fp32 by the rule above, and the FP8
decoder (h3trt/calibration/vae_fp8.py) never quantizes a module they match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .precision import VAE_PRECISIONS, Precision, eager_dtype, unquantized


@dataclass(frozen=True)
class VAEPrecision:
    """How the video decoder runs: fp32 (the checkpoint's dtype), bf16 (the reference pipeline's load), or fp8 (bf16
    placement, the decoder's ViT linears W8A8 e4m3 with per-token activation scales)."""

    name: Precision  # one of VAE_PRECISIONS (a string is parsed)

    def __post_init__(self):
        object.__setattr__(self, "name", Precision.parse(self.name, VAE_PRECISIONS, "--vae-precision"))

    @property
    def dtype(self) -> torch.dtype:
        """What the tensors diffusers does not pin to fp32 are cast to (fp8: bf16 placement plus e4m3 ViT linears)."""
        return self.name.spec.dtype

    @property
    def quantized(self) -> bool:
        return self.name.spec.quantized

    @property
    def verify_rel_tol(self) -> float:
        """How far a build lets a compiled decoder segment differ from the eager one (PrecisionSpec says why)."""
        return self.name.spec.vae_verify_rel_tol

    @classmethod
    def default(cls, device: str | torch.device) -> "VAEPrecision":
        """bf16 on CUDA (what a Diffusers user runs), fp32 on the CPU (where bf16 matmuls are slow and the bitwise
        parity tests run)."""
        return cls(unquantized(eager_dtype(device)))

    @classmethod
    def resolve(cls, name: str | Precision | None, device: str | torch.device) -> "VAEPrecision":
        return cls.default(device) if name is None else cls(name)


def fp32_pinned(model, tensor_name: str) -> bool:
    """Whether diffusers' `from_pretrained(torch_dtype=...)` keeps this parameter / buffer in float32."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    parts = tensor_name.split(".")
    return any(m in parts for m in keep)


def skips_low_precision(model, module_name: str) -> bool:
    """Whether diffusers' `enable_layerwise_casting` leaves this module alone (its `_skip_layerwise_casting_patterns`
    and `_keep_in_fp32_modules`, matched with re.search as diffusers matches them)."""
    patterns = tuple(getattr(model, "_skip_layerwise_casting_patterns", None) or ()) + tuple(
        getattr(model, "_keep_in_fp32_modules", None) or ())
    return any(re.search(p, module_name) for p in patterns)


def place(model, device, dtype: torch.dtype):
    """Move `model` to `device` and cast its checkpoint tensors as `from_pretrained(torch_dtype=dtype)` does: floating
    parameters and persistent buffers to `dtype` unless `fp32_pinned` (then float32); non-persistent buffers as
    built."""
    model = model.to(device)
    persistent = set(model.state_dict().keys())
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name not in persistent or not tensor.is_floating_point():
                continue
            want = torch.float32 if fp32_pinned(model, name) else dtype
            if tensor.dtype != want:
                tensor.data = tensor.data.to(want)
    return model
