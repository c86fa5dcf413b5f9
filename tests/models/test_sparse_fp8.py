"""FP8 block-sparse attention (h3trt/models/sparse/fp8.py, models/sparse/fp8_triton.py) on the CPU.

The reference semantics (`fp8_emulated`: q, k, v - mu quantized with per-tensor scales, the masked fp32 reference over
the kept blocks, mu added) against the bf16 masked reference over the same kept blocks, and the Triton kernel, every
tile configuration, under Triton's interpreter against that emulation. Tolerances (relative error, Frobenius):
  - emulated vs the unquantized masked reference: < 8% with v of mean 0 (e4m3 rounding of q, k and v, as the dense
    FP8 tests, tests/calibration/test_fp8_attention.py), < 1% of the output with v of mean 3 (the mean returns exactly:
    centering);
  - the kernel vs its own arithmetic replayed in torch (`online_reference`: the online softmax a key tile at a time,
    P times 448 rounded to e4m3 against the running max), on the centered part of the output (o - mu): < 1e-3
    (the order of fp32 additions, and a P that lands on the other side of an e4m3 rounding boundary because of it);
  - the kernel vs the emulation, o - mu: < 10%. The kernel rounds the probabilities to e4m3 for its PV product
    (relative 2^-4 a value), which the emulation keeps exact: measured 2-8% here (fewer kept keys, less averaging),
    the FP8 kernels' own error (FA3's and cuDNN's FP8 attention round P too). Fp32 outputs are compared (the
    interpreter truncates fp32 to bf16 where the GPU rounds), and a bf16 call checks the dtype and layout;
  - the quantization pass is bit-exact: q8, k8 and v8t are the emulation's e4m3 values, zero past the last row.
The interpreter runs the kernels' index arithmetic, masks, gathers and online softmax; it does not run the GPU's
wgmma, its FP8 accumulator or the software pipeline (scripts/bench_sparse.py checks the kernel on a GPU, every cell
against the masked reference).
"""

import json
import os

import pytest
import torch

from h3trt.models.sparse.attention import subblock_route
from h3trt.models.sparse.fp8 import emulated_fp8_sparse_attention, fp8_sparse_attention
from h3trt.models.sparse.reference import reference_sparse_attention

from kernel_checks import interpreted, online_reference

MEAN_3_TOL, EMULATION_TOL, P_ROUNDING_TOL, KERNEL_TOL = 0.01, 0.08, 0.10, 1e-3


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def amax_scale(x):
    return (x.float().abs().amax() / 448.0).reshape(1)


def case(B, S, N, D, block, sparsity=0.5, v_mean=3.0, key_rows=None, seed=0, dtype=torch.bfloat16):
    """q/k/v, the layer's scales (each tensor's amax, v's centered), the router's index and a mix of sparse and dense
    query blocks."""
    g = torch.Generator().manual_seed(seed)
    Sk = key_rows or S
    q = torch.randn(B, S, N, D, generator=g).to(dtype)
    k = torch.randn(B, Sk, N, D, generator=g).to(dtype)
    v = (torch.randn(B, Sk, N, D, generator=g) + v_mean).to(dtype)
    scales = tuple(amax_scale(t) for t in (q, k, v.float() - v.float().mean(1, keepdim=True)))
    index, _ = subblock_route(q, k, sparsity, D ** -0.5, block=block)
    G = index.shape[2]
    sparse_G = torch.arange(G) % 3 != 1
    return q, k, v, scales, index, sparse_G


@pytest.mark.parametrize("v_mean,tol", [(0.0, EMULATION_TOL), (3.0, MEAN_3_TOL)])
@pytest.mark.parametrize("block", [64, 128])
def test_emulated_is_the_masked_reference_up_to_e4m3_rounding(v_mean, tol, block):
    q, k, v, scales, index, sparse_G = case(2, block * 4 + 29, 3, 32, block, v_mean=v_mean, key_rows=block * 5 + 3)
    got = emulated_fp8_sparse_attention(q, k, v, *scales, index, sparse_G, block)
    want = reference_sparse_attention(q.float(), k.float(), v.float(), index, sparse_G, block)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert 0 < rel(got, want) < tol
    # centering keeps the mean: FP8 attention without it shrank the output (0.58x at 37,838 rows on the H200)
    assert got.float().mean().item() == pytest.approx(want.mean().item(), rel=0.01)


def test_emulated_attends_only_the_kept_blocks():
    """Shuffling v's rows within a key block no query block keeps (its mean, so mu, unchanged) leaves the output bit
    for bit; within a kept block, it changes it."""
    q, k, v, scales, _, _ = case(1, 64 * 6, 2, 32, 64)
    index = torch.tensor([0, 2], dtype=torch.int32).expand(1, 2, 6, 2).contiguous()
    sparse_G = torch.ones(6, dtype=torch.bool)
    base = emulated_fp8_sparse_attention(q, k, v, *scales, index, sparse_G, 64)
    for block, same in ((5, True), (2, False)):
        v2 = v.clone()
        rows = slice(block * 64, (block + 1) * 64)
        v2[:, rows] = v[:, rows].flip(1)
        assert torch.equal(emulated_fp8_sparse_attention(q, k, v2, *scales, index, sparse_G, 64), base) == same


def test_the_fp8_kernel_needs_cuda_and_names_the_emulation():
    q, k, v, scales, index, sparse_G = case(1, 128, 1, 32, 64)
    with pytest.raises(ValueError, match="runs on CUDA tensors.*fp8_emulated"):
        fp8_sparse_attention(q, k, v, scales, index, sparse_G, 64, "fp8")
    with pytest.raises(ValueError, match="kernels are"):
        fp8_sparse_attention(q, k, v, scales, index, sparse_G, 64, "fa4")


# ---- the Triton kernel under the interpreter (CPU) -------------------------------------------------------------

def interpreted_checks() -> dict:
    """Run in a subprocess with TRITON_INTERPRET=1 (see __main__): each check's measured error or outcome, by name."""
    from h3trt.models.sparse.fp8 import _e4m3
    from h3trt.models.sparse.fp8_triton import (BENCH_ONLY_CONFIGS, TILE_CONFIGS, fp8_block_sparse_attention,
                                                fp8_operands, fp8_sparse_attention_triton)

    out = {}
    for block in (64, 128):
        # ragged query and key tails of different lengths, B = 2, sparse and dense query blocks, v of mean 3
        q, k, v, scales, index, sparse_G = case(2, block * 3 + 29, 2, 32, block, key_rows=block * 4 + 5)
        mu = v.float().mean(1, keepdim=True)
        want = emulated_fp8_sparse_attention(q, k, v, *scales, index, sparse_G, block).float()
        ops = fp8_operands(q, k, v, *scales)
        S, Sk = q.shape[1], k.shape[1]
        out[f"quantized_{block}"] = bool(
            torch.equal(ops.q8[:, :, :S].float(), _e4m3(q, scales[0]).transpose(1, 2).float())
            and torch.equal(ops.k8[:, :, :Sk].float(), _e4m3(k, scales[1]).transpose(1, 2).float())
            and torch.equal(ops.v8t[..., :Sk].float(), _e4m3(v.float() - mu, scales[2]).permute(0, 2, 3, 1).float())
            and not ops.q8[:, :, S:].float().any() and not ops.v8t[..., Sk:].float().any())
        steps = {}
        for name, config in {**TILE_CONFIGS[block], **BENCH_ONLY_CONFIGS[block]}.items():
            got = fp8_block_sparse_attention(ops, index, sparse_G, block, config, torch.float32)
            if config.block_n not in steps:
                steps[config.block_n] = online_reference(ops, index, sparse_G, block, config.block_n)
            out[f"kernel_{block}_{name}"] = rel(got - mu, steps[config.block_n] - mu)
            out[f"emulation_{block}_{name}"] = rel(got - mu, want - mu)
        got = fp8_sparse_attention_triton(q, k, v, *scales, index, sparse_G, block)  # the one call, bf16 out
        out[f"bf16_out_{block}"] = got.dtype == torch.bfloat16 and got.shape == q.shape
        out[f"vs_bf16_reference_{block}"] = rel(got, reference_sparse_attention(q.float(), k.float(), v.float(),
                                                                                index, sparse_G, block))
    # the exchange buffer's layout (q, k, v slices of one [3, B, S, N, D] tensor), every key block kept (T = K, odd),
    # and a hand-made index of an odd count (the 64-row pair gather's last step holds one block)
    q, k, v, scales, _, _ = case(1, 64 * 5 + 7, 2, 32, 64)
    fused = torch.stack([q, k, v]).unbind(0)
    G = 6
    for tag, index in (("every_block", torch.arange(6, dtype=torch.int32).expand(1, 2, G, 6).contiguous()),
                       ("odd_count", torch.tensor([0, 2, 5], dtype=torch.int32).expand(1, 2, G, 3).contiguous())):
        sparse_G = torch.ones(G, dtype=torch.bool)
        mu = v.float().mean(1, keepdim=True)
        ops = fp8_operands(*fused, *scales)
        for name in ("m64n128w4s3", "m64n64w4s3"):
            config = TILE_CONFIGS[64][name]
            got = fp8_block_sparse_attention(ops, index, sparse_G, 64, config, torch.float32)
            out[f"{tag}_{name}"] = rel(got - mu, online_reference(ops, index, sparse_G, 64, config.block_n) - mu)
    return out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the subprocess itself")
def test_the_triton_kernel_matches_the_emulation_under_the_interpreter():
    outcome = interpreted(__file__)
    kernel = {n: e for n, e in outcome.items() if n.startswith(("kernel_", "every_block", "odd_count"))}
    assert len(kernel) == 2 * 6 + 4, sorted(outcome)
    assert all(e < KERNEL_TOL for e in kernel.values()), kernel
    emulation = {n: e for n, e in outcome.items() if n.startswith("emulation_")}
    assert all(0 < e < P_ROUNDING_TOL for e in emulation.values()), emulation  # > 0: the emulation keeps P exact
    assert all(outcome[f"quantized_{b}"] and outcome[f"bf16_out_{b}"] for b in (64, 128)), outcome
    assert all(outcome[f"vs_bf16_reference_{b}"] < MEAN_3_TOL for b in (64, 128)), outcome


if __name__ == "__main__":  # the interpreter's subprocess
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    print(json.dumps(interpreted_checks()))
