"""h3trt.models.precision: the one precision table. Parsing, the refusal's message, the names as they print and
serialise (manifests keep their strings), and every row against the per-layer tables it replaced."""

from __future__ import annotations

import json

import pytest
import torch

from h3trt.build.tensorrt import RTX_TARGETS
from h3trt.errors import UserError
from h3trt.models.attention import KERNELS, cpu_kernel, gpu_candidates
from h3trt.models.precision import (ATTENTION_PRECISIONS, DIT_PRECISIONS, QUANT_PRECISIONS, SPECS, VAE_PRECISIONS,
                                    Precision, unquantized)
from h3trt.models.vae_precision import VAEPrecision

# The tables the rows replaced, as they stood in each layer (models/precision.py, models/attention.py,
# calibration/recipe.py, build/tensorrt.py, build/builder.py).
OLD_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.bfloat16, "nvfp4": torch.bfloat16}
OLD_CALIB_ALGOS = {"fp8": ("max", "percentile", "smoothquant"), "nvfp4": ("max", "awq_lite")}
OLD_TRT_TARGETS = {"fp32": RTX_TARGETS, "bf16": ("sm80", "sm86", "sm89", "sm120", "sm121"),
                   "fp8": ("sm89", "sm120", "sm121"), "nvfp4": ("sm120", "sm121")}
OLD_TRT_DEFAULT_TARGETS = {"fp32": ("sm89", "sm120"), "bf16": ("sm89", "sm120"), "fp8": ("sm89", "sm120"),
                           "nvfp4": ("sm120",)}
OLD_VERIFY_REL_TOL = {"bf16": 2e-2, "fp32": 1e-4, "fp8": 3e-2, "nvfp4": 2e-2}
OLD_VAE_VERIFY_REL_TOL = {"fp32": 1e-4, "bf16": 2e-2, "fp8": 0.15}
OLD_GPU_CANDIDATES = {"bf16": ("cudnn", "fa3"), "fp32": ("sdpa",), "fp8": ("cudnn", "fa3")}
OLD_CPU_KERNEL = {"bf16": "sdpa", "fp32": "sdpa", "fp8": "emulated"}


def test_the_subsets_keep_their_names_and_order():
    # The order is the one error messages and argparse list.
    assert DIT_PRECISIONS == ("bf16", "fp32", "fp8", "nvfp4") and DIT_PRECISIONS == tuple(Precision)
    assert VAE_PRECISIONS == ("fp32", "bf16", "fp8")
    assert ATTENTION_PRECISIONS == ("bf16", "fp32", "fp8")
    assert QUANT_PRECISIONS == ("fp8", "nvfp4")
    assert set(SPECS) == set(Precision)


def test_parse_takes_a_name_or_a_precision_and_returns_the_member():
    for p in Precision:
        assert Precision.parse(p.value) is p and Precision.parse(p) is p
    assert Precision.parse("fp8", VAE_PRECISIONS, "--vae-precision") is Precision.FP8


@pytest.mark.parametrize("name, choices, flag, message", [
    ("fp16", None, "--precision", "--precision must be one of ['bf16', 'fp32', 'fp8', 'nvfp4'], got 'fp16'."),
    ("nvfp4", VAE_PRECISIONS, "--vae-precision",
     "--vae-precision must be one of ['fp32', 'bf16', 'fp8'], got 'nvfp4'."),
    (Precision.BF16, QUANT_PRECISIONS, "quantized precision",
     "quantized precision must be one of ['fp8', 'nvfp4'], got 'bf16'."),
    (None, None, "--precision", "got None."),
    ("FP8", None, "--precision", "got 'FP8'."),  # the name, not the member's
])
def test_parse_refuses_another_name_listing_the_valid_ones(name, choices, flag, message):
    with pytest.raises(UserError) as err:
        Precision.parse(name, choices, flag)
    assert message in str(err.value)


def test_a_precision_prints_compares_and_serialises_as_its_name():
    p = Precision.NVFP4
    assert (str(p), f"{p}", f"{p:>6}", repr(p), "%s" % p) == ("nvfp4", "nvfp4", " nvfp4", "'nvfp4'", "nvfp4")
    assert p == "nvfp4" and hash(p) == hash("nvfp4") and {"nvfp4": 1}[p] == 1 and {p: 1}["nvfp4"] == 1
    # A manifest written from typed values holds the same strings as before (and so hashes the same).
    assert json.dumps({"precision": p, "attention": {Precision.BF16: {}}}) == \
        json.dumps({"precision": "nvfp4", "attention": {"bf16": {}}})
    assert f"{[Precision.FP32, Precision.BF16]}" == "['fp32', 'bf16']"


@pytest.mark.parametrize("p", list(Precision), ids=str)
def test_every_row_holds_what_the_old_tables_said(p):
    spec, name = p.spec, p.value
    assert spec.dtype == OLD_DTYPES[name]
    assert spec.quantized == (name in ("fp8", "nvfp4"))
    assert spec.calib_algos == OLD_CALIB_ALGOS.get(name, ())
    assert spec.trt_targets == OLD_TRT_TARGETS[name] and spec.trt_default_targets == OLD_TRT_DEFAULT_TARGETS[name]
    assert spec.verify_rel_tol == OLD_VERIFY_REL_TOL[name]
    assert spec.vae_verify_rel_tol == OLD_VAE_VERIFY_REL_TOL.get(name)
    # The attention of a block in the row's dtype (the old attention_precision(dtype)); FP8 attention is a flag.
    assert spec.attention == {torch.bfloat16: "bf16", torch.float32: "fp32"}[spec.dtype]
    # fp8 calibrates its static activation scales on trajectories whatever the algorithm (the old
    # needs_calibration_data), nvfp4 only for awq_lite or TensorRT's FP4 activations.
    assert spec.calibrated_activations == (name == "fp8")
    assert spec.modelopt_config == {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}.get(name, "")


@pytest.mark.parametrize("p", list(Precision), ids=str)
def test_every_row_is_consistent_with_itself(p):
    spec = p.spec
    assert spec.attention in ATTENTION_PRECISIONS and spec.attention is unquantized(spec.dtype)
    # Quantization-only facts are set exactly on quantized rows.
    quant_fields = (spec.calib_algos, spec.calib_algos_why, spec.modelopt_config, spec.execution, spec.trt_execution)
    assert all(bool(f) == spec.quantized for f in quant_fields), quant_fields
    assert (p in QUANT_PRECISIONS) == spec.quantized
    assert (spec.vae_verify_rel_tol is not None) == (p in VAE_PRECISIONS)
    assert spec.trt_targets and set(spec.trt_default_targets) <= set(spec.trt_targets) <= set(RTX_TARGETS)
    assert 0 < spec.verify_rel_tol < 1


def test_the_execution_records_say_what_each_backend_runs():
    assert Precision.FP8.spec.execution.startswith("W8A8: e4m3 weights and activations")
    assert Precision.NVFP4.spec.execution.startswith("weight-only: packed E2M1 weights")
    assert Precision.FP8.spec.trt_execution.startswith("TensorRT FP8 GEMMs from ModelOpt's FP8 Q/DQ")
    assert Precision.NVFP4.spec.trt_execution.startswith("TensorRT FP4 GEMMs from ModelOpt's NVFP4 Q/DQ")


def test_unquantized_maps_a_dtype_to_its_precision():
    assert unquantized(torch.bfloat16) is Precision.BF16 and unquantized(torch.float32) is Precision.FP32
    assert unquantized(torch.float16) is None


def test_attention_kernels_cover_the_attention_precisions_as_before():
    assert {p for _, p in KERNELS} == set(ATTENTION_PRECISIONS)
    assert all(isinstance(p, Precision) for _, p in KERNELS)
    assert {p: gpu_candidates(p) for p in ATTENTION_PRECISIONS} == OLD_GPU_CANDIDATES
    assert {p: cpu_kernel(p) for p in ATTENTION_PRECISIONS} == OLD_CPU_KERNEL


def test_vae_precision_parses_its_name_and_reads_the_row():
    fp8 = VAEPrecision("fp8")
    assert fp8.name is Precision.FP8 and fp8 == VAEPrecision(Precision.FP8)
    assert fp8.quantized and fp8.dtype == torch.bfloat16 and fp8.verify_rel_tol == 0.15
    assert VAEPrecision.default("cpu").name is Precision.FP32 and VAEPrecision.default("cuda").name is Precision.BF16
    with pytest.raises(UserError, match=r"--vae-precision must be one of \['fp32', 'bf16', 'fp8'\], got 'nvfp4'"):
        VAEPrecision("nvfp4")
