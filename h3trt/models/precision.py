"""Precisions: the one typed table every layer reads (the bottom layer with errors.py: anything may import it).

A precision is named as flags and manifests spell it ("bf16", "fp32", "fp8", "nvfp4"). Each name is parsed once
where it enters (BuildConfig, VAEPrecision, QuantRecipe and AttentionChoice through `Precision.parse`; the manifest
reader through its field check) into a `Precision`, and inner code reads the facts of its row (`precision.spec`, a
`PrecisionSpec`) rather than the name; where a layer runs one format's code (FP8 or NVFP4 modules), it compares
members. `Precision` is a str enum: it compares, hashes, prints and serialises as its name, so manifests on disk keep
the same strings.

A quantized precision (fp8, nvfp4) keeps what it does not quantize, and every activation, in bf16: its dtype is
bf16, and the quantized GEMMs are the calibration's modules (h3trt/calibration/). Three flags and records take a
subset of the names: --vae-precision (VAE_PRECISIONS: h3trt/models/vae_precision.py says where its tensors go, and
its fp8 is the decoder's own W8A8 scheme, h3trt/calibration/vae_fp8.py), the attention kernels' q/k/v
(ATTENTION_PRECISIONS: fp8 is --fp8-attention's e4m3), and the quantization recipe (QUANT_PRECISIONS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError
from ..str_enum import StrEnum


class Precision(StrEnum):
    """A precision by the name flags and manifests use (printed as it: h3trt/str_enum.py); `spec` holds what it
    means."""

    BF16 = "bf16"
    FP32 = "fp32"
    FP8 = "fp8"
    NVFP4 = "nvfp4"

    @property
    def spec(self) -> "PrecisionSpec":
        return SPECS[self]

    @classmethod
    def parse(cls, name, choices: tuple["Precision", ...] | None = None, flag: str = "--precision") -> "Precision":
        """`name` (a string or a Precision) as a Precision, refusing one outside `choices` (default: every precision,
        what --precision takes) with the valid names and `flag`, the flag or field it came from."""
        choices = DIT_PRECISIONS if choices is None else choices
        if name not in choices:
            raise UserError(f"{flag} must be one of {[p.value for p in choices]}, got {name!r}.")
        return cls(name)


@dataclass(frozen=True)
class PrecisionSpec:
    """What one precision means to each layer. Quantization-only fields keep their defaults on bf16 and fp32."""

    dtype: torch.dtype  # what the model computes in: every tensor it does not quantize, and every activation
    quantized: bool  # the main blocks' linears hold low-precision weights (h3trt/calibration/)
    attention: Precision  # what a block's attention reads q/k/v in (FP8 attention is --fp8-attention's, on top)
    # The build checks each freshly loaded segment against the eager one within this relative error (norm).
    # Quantized: compiled vs eager quantized segment; a 1-ulp bf16 difference before an e4m3 rounding can flip a code.
    verify_rel_tol: float
    # The same for the video decoder's segments at this --vae-precision (None: not a VAE precision). fp8: the compiled
    # and the eager FP8 decoder each round to e4m3 on their own (Inductor keeps a fused norm's output in fp32 where
    # eager rounds it to bf16 first, so codes flip), and differ by about the quantization noise itself: a 7x4x4 tile
    # of the random tiny decoder measured 5.5% compiled vs eager, where eager FP8 vs bf16 is 9%. A wrong graph is
    # ~100%; FP8's quality is measured separately (scripts/bench_vae.py: PSNR vs fp32 of the compiled and the eager
    # FP8 decoder).
    vae_verify_rel_tol: float | None
    # TensorRT-RTX compute capabilities whose plans can hold it (support matrix, confirmed by builds: FP8 GEMMs need
    # Ada or RTX Blackwell, FP4 only RTX Blackwell; BF16 needs Ampere+; fp32 is the parity twin, never shipped), and
    # those a build targets without --trt-targets.
    trt_targets: tuple[str, ...]
    trt_default_targets: tuple[str, ...]
    # Activations quantized with static per-tensor scales: every calibration runs real trajectories (W8A8).
    calibrated_activations: bool = False
    # The calibration algorithms it takes, by ModelOpt's names, the default first (h3trt/calibration/recipe.py says
    # what each does), and why ModelOpt's others do not apply.
    calib_algos: tuple[str, ...] = ()
    calib_algos_why: str = ""
    modelopt_config: str = ""  # the ModelOpt *_DEFAULT_CFG its weight and input formats come from
    # How it executes, recorded in the manifest's quant.execution: in the inductor and aoti backends' blocks, and in
    # TensorRT plans.
    execution: str = ""
    trt_execution: str = ""


SPECS: dict[Precision, PrecisionSpec] = {
    Precision.BF16: PrecisionSpec(
        dtype=torch.bfloat16, quantized=False, attention=Precision.BF16, verify_rel_tol=2e-2,
        vae_verify_rel_tol=2e-2, trt_targets=("sm80", "sm86", "sm89", "sm120", "sm121"),
        trt_default_targets=("sm89", "sm120")),
    Precision.FP32: PrecisionSpec(
        dtype=torch.float32, quantized=False, attention=Precision.FP32, verify_rel_tol=1e-4,
        vae_verify_rel_tol=1e-4, trt_targets=("sm75", "sm80", "sm86", "sm89", "sm120", "sm121"),
        trt_default_targets=("sm89", "sm120")),
    Precision.FP8: PrecisionSpec(
        dtype=torch.bfloat16, quantized=True, attention=Precision.BF16, verify_rel_tol=3e-2,
        vae_verify_rel_tol=0.15, trt_targets=("sm89", "sm120", "sm121"), trt_default_targets=("sm89", "sm120"),
        calibrated_activations=True, calib_algos=("max", "percentile", "smoothquant"),
        calib_algos_why="AWQ searches scales for 4-bit block weights; FP8 weights are per-tensor e4m3",
        modelopt_config="FP8_DEFAULT_CFG",
        execution="W8A8: e4m3 weights and activations, per-tensor static scales, torch._scaled_mm (cuBLAS on CUDA; "
                  "accumulation per fp8_accum; the rowwise kernel on the CPU, the scales broadcast); the activation quantization is a pointwise op Inductor fuses into the "
                  "kernel that produces the activation",
        trt_execution="TensorRT FP8 GEMMs from ModelOpt's FP8 Q/DQ (e4m3 weights and activations, per-tensor static "
                      "scales from the calibration); attention bf16 (fused MHA)"),
    Precision.NVFP4: PrecisionSpec(
        dtype=torch.bfloat16, quantized=True, attention=Precision.BF16, verify_rel_tol=2e-2,
        vae_verify_rel_tol=None, trt_targets=("sm120", "sm121"), trt_default_targets=("sm120",),
        calib_algos=("max", "awq_lite"),
        calib_algos_why="NVFP4 is weight-only here: it has no activation ranges to clip or smooth",
        modelopt_config="NVFP4_DEFAULT_CFG",
        execution="weight-only: packed E2M1 weights with E4M3 scales per 16 values and an fp32 global scale, "
                  "dequantized to bf16 inside the compiled block before a bf16 GEMM (saves memory, not time; native "
                  "FP4 GEMMs need sm_100+ and are not implemented in this build)",
        trt_execution="TensorRT FP4 GEMMs from ModelOpt's NVFP4 Q/DQ (FP4 weights with E4M3 block scales from the "
                      "calibration, FP4 activations quantized dynamically); attention bf16 (fused MHA)"),
}

DIT_PRECISIONS = tuple(Precision)  # h3trt build --precision (bf16 the default); a manifest's precision
VAE_PRECISIONS = (Precision.FP32, Precision.BF16, Precision.FP8)  # --vae-precision; a manifest's vae_precision
ATTENTION_PRECISIONS = (Precision.BF16, Precision.FP32, Precision.FP8)  # what attention kernels read q/k/v in
QUANT_PRECISIONS = tuple(p for p in Precision if p.spec.quantized)  # what a quantization recipe takes


def unquantized(dtype: torch.dtype) -> Precision | None:
    """The precision that computes everything in `dtype` and quantizes nothing (bf16, fp32); None for another."""
    return next((p for p in Precision if not p.spec.quantized and p.spec.dtype == dtype), None)


def eager_dtype(device: str | torch.device) -> torch.dtype:
    """What an eager (checkpoint) run computes in: bf16 on CUDA, fp32 on the CPU (where bf16 matmuls are slow and the
    bitwise parity tests run)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
