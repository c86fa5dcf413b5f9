"""VSA's fine branch in FP8 (h3trt/models/vsa/fp8.py) on the CPU, over ragged tiles (a (5, 6, 7) video grid: edge
tiles of 48, 32, ... 6 rows; prefix segments of 70 and 40 rows: chunks of 64, 6 and 40), three prefix query tiles
dense and the video ones keeping half the video tiles, batch 2.

Tolerances (relative error, Frobenius), the dense FP8 tests' (tests/calibration/test_fp8_attention.py,
tests/models/test_sparse_fp8.py):
  - the emulation through models/vsa/routing.py vsa_attention (the coarse branch included) against vsa_reference, the
    definition in fp32: < 8% with v of mean 0 (e4m3 rounding of q, k and v), < 1% with v of mean 3 (centering returns
    the mean exactly); and > 0 (it quantizes). Attending the pad rows of the ragged tiles (every tile taken as 64
    rows) moves it by ~30%: the masks are what is checked, not only the rounding;
  - the Triton kernel, under Triton's interpreter (a subprocess with TRITON_INTERPRET=1), against its own arithmetic
    replayed in torch (kernel_checks.py online_reference, given each key tile's row count), o - mu: < 1e-3 for
    every tile configuration; against the emulation: < 10% (the kernel rounds P to e4m3 for its PV product:
    measured 2.6% here); the kernel given full tiles instead of the row counts is off by more than 1.0; a bf16
    call's whole output (mean 3) < 1% from the emulation.
"""

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from h3trt.models.vsa.routing import pool_tiles, route_tiles, tile_scores, to_tiles, vsa_attention, vsa_reference
from h3trt.models.vsa.fp8 import (ALL_VSA_KERNELS, emulated_fp8_vsa_attention, fp8_vsa_attention, vsa_attention_kernel,
                                  vsa_fp8_scales, vsa_problem)
from h3trt.models.vsa.kernels import key_valid
from h3trt.models.vsa.tiles import tile_geometry

GEOMETRY = tile_geometry((70, 0, 40), (5, 6, 7))
MEAN_3_TOL, EMULATION_TOL, P_ROUNDING_TOL, KERNEL_TOL = 0.01, 0.08, 0.10, 1e-3


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def packed(v_mean=3.0, seed=0, B=2, N=2, D=32):
    g = torch.Generator().manual_seed(seed)
    shape = (B, GEOMETRY.seq_len, N, D)
    q, k, gate = (torch.randn(*shape, generator=g) for _ in range(3))
    return q, k, torch.randn(*shape, generator=g) + v_mean, gate


def dense(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def tiled_case(v_mean=3.0, sparsity=0.5):
    """(q, k, v in the padded tile layout, index, sparse_G, sizes) as vsa_attention routes them."""
    q, k, v, _ = packed(v_mean)
    qt, kt, vt = (to_tiles(x, GEOMETRY) for x in (q, k, v))
    index, sparse_G = route_tiles(tile_scores(pool_tiles(qt, GEOMETRY), pool_tiles(kt, GEOMETRY)),
                                  GEOMETRY.num_prefix_tiles, sparsity)
    return qt, kt, vt, index, sparse_G, GEOMETRY.sizes


def test_the_geometry_is_ragged_with_an_exempt_prefix():
    assert GEOMETRY.sizes.tolist() == [64, 6, 40, 64, 48, 32, 24, 16, 12, 8, 6] and GEOMETRY.num_prefix_tiles == 3


@pytest.mark.parametrize("v_mean,tol", [(0.0, EMULATION_TOL), (3.0, MEAN_3_TOL)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_vsa_is_the_definition_up_to_e4m3_rounding(v_mean, tol, dtype):
    q, k, v, gate = packed(v_mean)
    want = vsa_reference(q, k, v, gate, GEOMETRY, 0.5)
    args = [t.to(dtype) for t in (q, k, v, gate)]
    got, kept = vsa_attention(*args, GEOMETRY, 0.5, vsa_attention_kernel("fp8_emulated"), dense)
    assert got.dtype == dtype and got.shape == q.shape and kept < 1.0
    assert 0 < rel(got, want) < tol
    assert got.float().mean().item() == pytest.approx(want.mean().item(), rel=0.01, abs=1e-3)

    full = torch.full_like(GEOMETRY.sizes, 64)  # the ragged tiles' pad rows attended: the masks are wrong

    def pad_attended(q_t, k_t, v_t, index, sparse_G, sizes):
        return fp8_vsa_attention(q_t, k_t, v_t, index, sparse_G, full, "fp8_emulated")

    wrong, _ = vsa_attention(*args, GEOMETRY, 0.5, pad_attended, dense)
    assert rel(wrong, want) > 0.2  # measured 0.30-0.33


def test_the_scales_are_each_tensors_amax_and_mu_the_mean_over_real_rows():
    qt, kt, vt, _, _, sizes = tiled_case()
    scales, mu = vsa_fp8_scales(qt, kt, vt, sizes)
    real = key_valid(sizes)
    want_mu = vt[:, real].mean(1)
    assert torch.allclose(mu, want_mu, rtol=1e-6, atol=1e-6)
    centered = (vt - mu[:, None]).abs()  # pad rows too: |0 - mu|
    want = torch.stack([qt.abs().amax(), kt.abs().amax(), centered.amax()]) / 448.0
    assert torch.allclose(scales, want, rtol=1e-6)
    assert scales.dtype == torch.float32 and scales.device == qt.device
    zeros = torch.zeros_like(qt)
    out = fp8_vsa_attention(zeros, zeros, zeros, *tiled_case()[3:], "fp8_emulated")  # all-zero input: no NaN
    assert torch.equal(out, zeros)


def test_the_emulation_attends_only_the_kept_tiles_real_rows():
    """Changing v in a pad row, or in a tile no query tile keeps, leaves the output of the real rows unchanged (the
    scales held fixed); changing it in a kept real row changes it."""
    qt, kt, vt, _, _, sizes = tiled_case()
    G = sizes.shape[0]
    index = torch.tensor([0, 1, 2, 4], dtype=torch.int32).expand(2, 2, G, 4).contiguous()
    sparse_G = torch.ones(G, dtype=torch.bool)
    scales, mu = vsa_fp8_scales(qt, kt, vt, sizes)
    real = key_valid(sizes)
    base = emulated_fp8_vsa_attention(qt, kt, vt, index, sparse_G, sizes, scales, mu)[:, real]
    for row, same in ((64 + 6, True), (64 * 5 + 3, True), (64 * 4 + 47, False)):  # tile 1's pad, tile 5, tile 4's last
        v2 = vt.clone()
        v2[:, row] += 1.0
        out = emulated_fp8_vsa_attention(qt, kt, v2, index, sparse_G, sizes, scales, mu)[:, real]
        assert torch.equal(out, base) == same, row


def test_every_vsa_kernel_on_a_gpu_is_checked_for_its_compute_capability_and_modules(monkeypatch):
    """The GPU side of the checks (a CUDA device faked: only its compute capability is asked), through the one
    device check the attention kernels share (models/attention.py KernelNeeds.problem)."""
    gpu = torch.device("cuda")

    def sm(value):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: divmod(value, 10))

    sm(86)
    assert "sm_90 and newer; this GPU is sm_86" in vsa_problem("fa4", gpu)
    assert "sm_90 and newer; this GPU is sm_86" in vsa_problem("fp8", gpu)
    assert vsa_problem("flex", gpu) is None and vsa_problem("reference", gpu) is None
    assert vsa_problem("fp8_emulated", gpu) is None
    sm(90)
    pytest.importorskip("triton")
    assert vsa_problem("fp8", gpu) is None
    monkeypatch.setitem(sys.modules, "cutlass.cute", None)  # FA4's CuTe DSL, not installed (or not loading)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", sys.modules.get("math"))  # FA4 itself present
    problem = vsa_problem("fa4", gpu)
    assert "'cutlass.cute'" in problem and "does not load here" in problem and "h3trt[fa4]" in problem


def test_the_fp8_kernels_and_their_problems():
    assert ALL_VSA_KERNELS == ("reference", "flex", "fa4", "fp8_emulated", "fp8")
    assert vsa_problem("fp8_emulated", "cpu") is None
    assert "CUDA" in vsa_problem("fp8", "cpu") and "fp8_emulated" in vsa_problem("fp8", "cpu")
    qt, kt, vt, index, sparse_G, sizes = tiled_case()
    with pytest.raises(ValueError, match="runs on CUDA tensors.*fp8_emulated"):
        fp8_vsa_attention(qt, kt, vt, index, sparse_G, sizes, "fp8")
    with pytest.raises(ValueError, match="tile configuration is the fp8 VSA kernel's"):
        vsa_attention_kernel("reference", "m64n64w4s3")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for the GPU")
def test_the_kernel_with_row_counts_compiles_to_fp8_wgmma_for_hopper():
    """The attention kernel with key_sizes (HAS_SIZES), compiled for sm_90 without a GPU (Triton's own ptxas): what
    the interpreter cannot show, that the masked load and the row test lower, and both products stay e4m3 wgmma."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from h3trt.models.sparse.fp8_triton import PAD_ROWS, _attention_kernel

    pointers = {"q_ptr": "*fp8e4nv", "k_ptr": "*fp8e4nv", "vt_ptr": "*fp8e4nv", "scales_ptr": "*fp32", "mu_ptr": "*fp32",
                "index_ptr": "*i32", "sparse_ptr": "*i1", "sizes_ptr": "*i32", "out_ptr": "*bf16"}
    constants = {"k_desc": None, "vt_desc": None, "PAD": PAD_ROWS, "N": 56, "D": 128, "BLOCK": 64, "BLOCK_M": 64,
                 "BLOCK_N": 128, "USE_TMA": False, "PROMOTE": True, "HAS_MU": True, "HAS_SIZES": True,
                 "INTERPRET": False}
    signature = {**pointers, **dict.fromkeys(("S", "Sk", "Sp_pads", "Skp_pads", "G", "K", "T"), "i32"),
                 "sm_scale_log2": "fp32", **dict.fromkeys(constants, "constexpr")}
    compiled = triton.compile(ASTSource(_attention_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 3})
    assert compiled.asm["cubin"] and "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in compiled.asm["ptx"]


# ---- the Triton kernel under the interpreter (CPU) -------------------------------------------------------------

def interpreted_checks() -> dict:
    """Run in a subprocess with TRITON_INTERPRET=1 (see __main__): each check's measured error or outcome, by name."""
    from kernel_checks import online_reference

    from h3trt.models.sparse.fp8_triton import BENCH_ONLY_CONFIGS, TILE_CONFIGS, fp8_operands
    from h3trt.models.vsa.fp8 import centered_error, triton_fp8_vsa_attention

    qt, kt, vt, index, sparse_G, sizes = tiled_case()
    scales, mu = vsa_fp8_scales(qt, kt, vt, sizes)
    real = key_valid(sizes)
    want = emulated_fp8_vsa_attention(qt, kt, vt, index, sparse_G, sizes, scales, mu)[:, real]
    ops = fp8_operands(qt, kt, vt, *scales.split(1), mu_BND=mu)
    out, steps = {}, {}
    for name, config in {**TILE_CONFIGS[64], **BENCH_ONLY_CONFIGS[64]}.items():
        got = triton_fp8_vsa_attention(qt, kt, vt, index, sparse_G, sizes, scales, mu, name)[:, real]
        if config.block_n not in steps:
            steps[config.block_n] = online_reference(ops, index, sparse_G, 64, config.block_n, sizes)[:, real]
        out[f"kernel_{name}"] = centered_error(got, steps[config.block_n], mu)
        out[f"emulation_{name}"] = centered_error(got, want, mu)
    got = triton_fp8_vsa_attention(qt, kt, vt, index, sparse_G, torch.full_like(sizes, 64), scales, mu)[:, real]
    out["full_tiles"] = centered_error(got, want, mu)
    bf16 = triton_fp8_vsa_attention(*(t.bfloat16() for t in (qt, kt, vt)), index, sparse_G, sizes, scales, mu)
    out["bf16_out"] = bf16.dtype == torch.bfloat16 and bf16.shape == qt.shape
    out["bf16_vs_emulation"] = rel(bf16[:, real], want)  # the whole output: bf16 rounds o, not o - mu
    return out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the subprocess itself")
def test_the_triton_kernel_serves_ragged_tiles_under_the_interpreter():
    from kernel_checks import interpreted

    outcome = interpreted(__file__)
    kernel = {n: e for n, e in outcome.items() if n.startswith("kernel_")}
    assert len(kernel) == 6, sorted(outcome)
    assert all(e < KERNEL_TOL for e in kernel.values()), kernel
    emulation = {n: e for n, e in outcome.items() if n.startswith("emulation_")}
    assert all(0 < e < P_ROUNDING_TOL for e in emulation.values()), emulation
    assert outcome["full_tiles"] > 1.0, outcome  # pad rows attended: what the row counts prevent
    assert outcome["bf16_out"] and outcome["bf16_vs_emulation"] < MEAN_3_TOL, outcome


if __name__ == "__main__":  # the interpreter's subprocess
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    print(json.dumps(interpreted_checks()))
