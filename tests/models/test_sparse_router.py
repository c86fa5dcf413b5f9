"""The SubBlock router's two paths (h3trt/models/sparse/router.py): which one a device runs, and that the fused Triton
router (models/sparse/router_triton.py) keeps the torch reference's blocks.

CPU CI has no GPU: the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, numpy on CPU tensors), in
a subprocess because the interpreter is chosen when the kernels are decorated, at import. The interpreter runs the
kernels' own index arithmetic, masks and reductions (ragged tails, sub-cells past the end, every n, B = 2, unequal q
and k lengths, the top-k's tie order); it does not run the GPU's dot or exp instructions, so the GPU's numbers are
checked by `test_triton_router_matches_torch_on_cuda` (skipped without CUDA) and at H3's shape by
scripts/bench_router.py.
"""

import json
import os

import pytest
import torch

from h3trt.errors import UserError
from h3trt.models.sparse.attention import _topk_lowest_first, subblock_route, subblock_route_reference, subblock_scores
from h3trt.models.sparse import router as sparse_router
from h3trt.models.sparse.router import choose_router, route_blocks, warm_router
from h3trt.models.sparse.run import SparseRun, load_sparse_kernel
from h3trt.models.sparse.plan import SparseSettings

from kernel_checks import interpreted


# ---- which router ----------------------------------------------------------------------------------------------

def test_cpu_and_other_devices_route_with_torch():
    for device_type in ("cpu", "meta", "mps"):
        assert choose_router(device_type, None) == "torch"
        assert choose_router(device_type, "ImportError: no triton") == "torch"  # Triton is never needed off CUDA


def test_cuda_routes_with_triton_by_default():
    # Measured on an H100 (sparse_router.TRITON_ROUTER_ON_CUDA's comment): the fused router is CUDA's default.
    assert sparse_router.TRITON_ROUTER_ON_CUDA is True
    assert choose_router("cuda", None) == "triton"
    # The switch still turns it off (a GPU where it misbehaves): then CUDA routes with torch, Triton or not.
    assert choose_router("cuda", None, triton_on_cuda=False) == "torch"
    assert choose_router("cuda", "ImportError: no triton", triton_on_cuda=False) == "torch"


def test_cuda_without_triton_is_refused_with_the_fix_not_routed_slowly():
    with pytest.raises(UserError, match=r"needs Triton on a CUDA GPU.*No module named 'triton'.*pip install triton"):
        choose_router("cuda", "ModuleNotFoundError: No module named 'triton'")


def test_route_blocks_refuses_an_unknown_router():
    q = torch.randn(1, 128, 1, 8)
    with pytest.raises(ValueError, match="SubBlock routers are"):
        route_blocks(q, q, 0.5, 0.3, "cuda-graph")


def test_cpu_load_warms_the_torch_router_and_a_sparse_run_records_it():
    assert warm_router("cpu", 2, 16, torch.float32, 64) == "torch"
    assert load_sparse_kernel("cpu", 2, 16, torch.float32) == ("reference", None)
    run = SparseRun(SparseSettings(0.5, dense_steps=0, min_seq=1), "reference", block=64)
    assert run.report()["router"] is None  # no sparse attention ran yet
    q, k, v = (torch.randn(1, 64 * 20 + 5, 2, 16) for _ in range(3))
    out = run._attend(q, k, v, torch.ones(21, dtype=torch.bool))
    assert out.shape == q.shape and run.report()["router"] == "torch"


# ---- the Triton router under the interpreter (CPU) -------------------------------------------------------------

def interpreted_checks() -> dict:
    """Run in a subprocess with TRITON_INTERPRET=1 (see __main__): every check's outcome, by name."""
    from h3trt.models.sparse.router_triton import (pool_subblocks_triton, subblock_route_triton,
                                                   subblock_scores_triton, topk_lowest_first_triton)
    from h3trt.models.sparse.attention import pool_subblocks

    out = {}
    torch.manual_seed(0)
    cases = [(n, n, 64) for n in (1, 2, 4, 8)] + [(8, 2, 64), (4, 4, 128)]
    for n_q, n_k, block in cases:
        # Ragged q and k tails of different lengths (the last q block has 37 real rows, the last k block 3), B = 2.
        rows, key_rows = block * 3 + 37, block * 9 + 3
        q = torch.randn(2, rows, 2, 16, dtype=torch.bfloat16)
        k = torch.randn(2, key_rows, 2, 16, dtype=torch.bfloat16)
        scale = 16 ** -0.5 * 4
        tag = f"{n_q}x{n_k}_b{block}"
        for x, n, side in ((q, n_q, "q"), (k, n_k, "k")):
            got, valid = pool_subblocks_triton(x, n, block)
            want, want_valid = pool_subblocks(x, n, block)
            out[f"pool_{tag}_{side}"] = valid == want_valid and bool(torch.allclose(got, want, rtol=1e-6, atol=1e-6))
        scores = subblock_scores_triton(q, k, scale, n_q, n_k, block)
        want_scores = subblock_scores(q, k, scale, n_q, n_k, block)
        out[f"scores_{tag}"] = bool(torch.allclose(scores, want_scores, rtol=1e-5, atol=1e-5))
        got, topk = subblock_route_triton(q, k, 0.75, scale, n_q, n_k, block)
        want, want_topk = subblock_route_reference(q, k, 0.75, scale, n_q, n_k, block)
        out[f"route_{tag}"] = topk == want_topk and got.dtype == torch.int32 and torch.equal(got, want)
        for sparsity in (0.3, 0.9):  # the top-k kernel at other budgets, on the same scores
            want, topk = subblock_route_reference(q, k, sparsity, scale, n_q, n_k, block)
            got = topk_lowest_first_triton(scores.view(-1, scores.shape[-1]), topk).view(want.shape)
            out[f"route_{tag}_{sparsity}"] = torch.equal(got, want)
    # Exact ties (kernel_checks.tie_case, test_sparse_attention.py's case, through the Triton path).
    from kernel_checks import tie_case

    q, k, _, want = tie_case()
    got, _ = subblock_route_triton(q, k, 0.7, 0.25)
    out["ties_to_the_lower_block"] = torch.equal(got, want)
    # The top-k kernel alone on tie-heavy rows (few distinct values, -0.0 and +0.0 among them), every budget.
    scores = torch.randint(-3, 4, (6, 37)).float() * 0.5
    zero = scores == 0
    scores[zero] = torch.tensor([-0.0, 0.0]).repeat(37)[:int(zero.sum())]
    out["topk_ties"] = all(torch.equal(topk_lowest_first_triton(scores, t), _topk_lowest_first(scores, t))
                           for t in (1, 5, 17, 36))
    return out


def test_triton_router_keeps_the_reference_blocks_under_the_interpreter():
    outcome = interpreted(__file__)
    assert len(outcome) == 6 * (2 + 1 + 1 + 2) + 2
    failed = sorted(name for name, ok in outcome.items() if not ok)
    assert not failed, failed


# ---- the Triton router on a GPU --------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_router_matches_torch_on_cuda():
    """On the GPU the dot and exp are the hardware's: the scores agree with torch's to a few ulp, and at these seeds
    (no near-tie at a threshold) the kept blocks are the same."""
    assert warm_router("cuda", 4, 128, torch.bfloat16, 64) == "triton"
    torch.manual_seed(0)
    for n in (1, 2, 4, 8):
        q = torch.randn(2, 64 * 50 + 37, 4, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 64 * 47 + 3, 4, 128, device="cuda", dtype=torch.bfloat16)
        want, topk = subblock_route(q, k, 0.75, 128 ** -0.5 * 4, n, n)
        got, got_topk = route_blocks(q, k, 0.75, 128 ** -0.5 * 4, "triton", n, n)
        assert got_topk == topk and torch.equal(got, want), n


if __name__ == "__main__":  # the interpreter's subprocess
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    print(json.dumps(interpreted_checks()))
