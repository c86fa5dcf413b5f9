"""SubBlock routing on the CPU (h3trt/models/sparse/attention.py): the reference against a brute-force float64
definition written from the issue's text (ragged tails, every n in 1, 2, 4, 8, unequal q and k lengths), the budget's
rounding, the chunked path against the reference (the same blocks, ties included), and bad arguments refused.

Tolerances: the reference pools and scores in fp32, the brute force in float64 row by row; scores agree within 1e-4
(relative), and a chosen set may differ from the float64 one only by swapping blocks whose float64 scores lie within
that distance of each other (a near-tie fp32 cannot resolve).
"""

import itertools
import math

import pytest
import torch

from h3trt.models.sparse import attention as sparse_attention
from h3trt.models.sparse.attention import (SUBBLOCK_BLOCK, sparse_budget, subblock_route, subblock_route_reference,
                                           subblock_scores)

from kernel_checks import tie_case


def brute_scores(q, k, scale, n_q, n_k, block):
    """score(i, j) = log sum over the (query sub-block, key sub-block) pairs of blocks i and j that hold real rows of
    exp(mean(q rows) . mean(k rows) * scale), in float64, one block pair at a time. [B, N, G, K]."""
    B, S, N, _ = q.shape
    Sk = k.shape[1]
    G, K = -(-S // block), -(-Sk // block)

    def subs(x, rows, i, n):
        size = block // n
        out = []
        for a in range(n):
            lo, hi = i * block + a * size, min(rows, i * block + (a + 1) * size)
            if lo < hi:  # a sub-cell past the end holds no real row: dropped
                out.append(x[:, lo:hi].double().mean(1))  # [B, N, D]
        return out

    out = torch.empty(B, N, G, K, dtype=torch.float64)
    for i in range(G):
        qs = subs(q, S, i, n_q)
        for j in range(K):
            ks = subs(k, Sk, j, n_k)
            terms = torch.stack([(qa * kb).sum(-1) * scale for qa in qs for kb in ks])  # [pairs, B, N]
            out[:, :, i, j] = torch.log(torch.exp(terms).sum(0))
    return out


def assert_valid_topk(index, topk, scores64, tol):
    """`index` holds `topk` distinct ascending blocks per row, and is a top-k of the float64 scores up to `tol`."""
    assert index.dtype == torch.int32 and index.shape[-1] == topk
    assert bool((index[..., 1:] > index[..., :-1]).all())
    chosen = torch.zeros_like(scores64, dtype=torch.bool).scatter_(-1, index.long(), True)
    lowest_kept = scores64.masked_fill(~chosen, math.inf).amin(-1)
    highest_dropped = scores64.masked_fill(chosen, -math.inf).amax(-1)
    assert bool((lowest_kept >= highest_dropped - tol * scores64.abs().amax()).all())


@pytest.mark.parametrize("n_q,n_k", [(1, 1), (2, 2), (4, 4), (8, 8), (1, 8), (8, 2)])
@pytest.mark.parametrize("rows,key_rows", [(64 * 5, 64 * 5), (64 * 4 + 37, 64 * 6 + 3), (64 * 3 + 9, 64 * 3 + 9)])
def test_reference_matches_the_float64_definition(n_q, n_k, rows, key_rows):
    torch.manual_seed(n_q * 10 + n_k + rows)
    q = torch.randn(2, rows, 3, 16)
    k = torch.randn(2, key_rows, 3, 16)
    scale = 16 ** -0.5 * 4  # sharper than D**-0.5 so the ranking is not flat
    want = brute_scores(q, k, scale, n_q, n_k, SUBBLOCK_BLOCK)
    got = subblock_scores(q, k, scale, n_q, n_k)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    K = want.shape[-1]
    for sparsity in (0.0, 0.3, 0.75, 0.95):
        index, topk = subblock_route_reference(q, k, sparsity, scale, n_q, n_k)
        assert topk == sparse_budget(K, sparsity)
        assert_valid_topk(index, topk, want, 1e-4)


def test_ragged_tail_sub_cells_past_the_end_are_dropped_not_zero_pooled():
    """A last block with 9 real rows at n = 4 (16-row sub-blocks) has one real sub-cell: its score is that cell's
    term alone. Zero-pooled empty cells would add exp(0) terms: this tail would score log(e^s + 3) instead."""
    q = torch.randn(1, 64 + 9, 1, 8)
    k = torch.randn(1, 64 + 9, 1, 8)
    scores = subblock_scores(q, k, 1.0, 4, 4)
    qbar, kbar = q[:, 64:].mean(1), k[:, 64:].mean(1)
    torch.testing.assert_close(scores[0, 0, 1, 1], (qbar * kbar).sum(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("blocks,sparsity,want", [
    (590, 0.75, 152),  # SubBlock's own example at 37.7k rows
    (590, 0.80, 120),
    (592, 0.75, 152),  # H3's 37,838 rows in 64-row blocks
    (296, 0.75, 80),  # and in 128-row blocks
    (590, 0.0, 590),  # sparsity 0: every block
    (1, 0.9, 1),
    (3, 0.75, 3),  # small K: the multiple of 8 is capped at K (dense)
    (8, 0.5, 8),
    (9, 0.5, 8),  # 4.5 -> 5 -> 8
    (9, 0.1, 9),  # 8.1 -> 9 -> 16, capped at 9
    (17, 0.5, 16),
    (100, 0.99, 8),  # at least one group of 8
    (16, 0.5, 8),
])
def test_budget_rounds_up_to_eights_and_caps_at_the_key_blocks(blocks, sparsity, want):
    assert sparse_budget(blocks, sparsity) == want


def test_budget_is_subblocks_float_arithmetic():
    """ceil((1 - s) * K) in Python floats, as SubBlock computes it: 1 - 0.7 is 0.30000000000000004, so 0.7 of 80 blocks
    wants 25 (not 24) and keeps 32; the same count SubBlock keeps."""
    assert math.ceil((1.0 - 0.7) * 80) == 25
    assert sparse_budget(80, 0.7) == 32


@pytest.mark.parametrize("sparsity", [-0.1, 1.0, 1.5, math.nan, math.inf, "0.5", None, True])
def test_budget_refuses_bad_sparsity(sparsity):
    with pytest.raises(ValueError, match=r"sparsity .*\[0, 1\)"):
        sparse_budget(10, sparsity)


@pytest.mark.parametrize("blocks", [0, -3, 2.0, True])
def test_budget_refuses_bad_block_counts(blocks):
    with pytest.raises(ValueError, match="positive whole number of key blocks"):
        sparse_budget(blocks, 0.5)


def test_sparsity_zero_keeps_every_block_in_order():
    q, k = torch.randn(1, 64 * 7 + 5, 2, 8), torch.randn(1, 64 * 7 + 5, 2, 8)
    for route in (subblock_route, subblock_route_reference):
        index, topk = route(q, k, 0.0, 8 ** -0.5)
        assert topk == 8 and index.dtype == torch.int32 and index.shape == (1, 2, 8, 8)
        assert torch.equal(index, torch.arange(8, dtype=torch.int32).expand(1, 2, 8, 8))


@pytest.mark.parametrize("n_q,n_k", [(4, 4), (1, 1), (8, 2)])
@pytest.mark.parametrize("chunk_bytes", [1, 5000, 2**28])
def test_chunked_route_keeps_the_reference_blocks(n_q, n_k, chunk_bytes):
    """chunk_bytes 1: one head and one query block at a time; 5000: a few query blocks of one head; 2**28: all."""
    torch.manual_seed(n_q + n_k)
    q = torch.randn(2, 64 * 40 + 21, 3, 32, dtype=torch.bfloat16)
    k = torch.randn(2, 64 * 40 + 21, 3, 32, dtype=torch.bfloat16)
    for sparsity in (0.5, 0.75, 0.9):
        want, want_topk = subblock_route_reference(q, k, sparsity, 32 ** -0.5, n_q, n_k)
        got, topk = subblock_route(q, k, sparsity, 32 ** -0.5, n_q, n_k, chunk_bytes=chunk_bytes)
        assert topk == want_topk and got.dtype == torch.int32 and got.is_contiguous()
        assert torch.equal(got, want)


def test_ties_go_to_the_lower_key_block_in_both_paths():
    """tie_case: both torch paths keep the 4 high blocks and the 4 lowest-numbered copies."""
    q, k, copies, want = tie_case()
    scores = subblock_scores(q, k, 0.25)
    assert bool((scores[..., copies] == scores[..., copies[:1]]).all())
    ref, topk = subblock_route_reference(q, k, 0.7, 0.25)
    assert topk == 8 and torch.equal(ref, want)
    for chunk_bytes in (1, 2**28):
        got, _ = subblock_route(q, k, 0.7, 0.25, chunk_bytes=chunk_bytes)
        assert torch.equal(got, want)


@pytest.mark.parametrize("chunk_bytes,most", [(2**28, 40 * 3), (4 * 160 * 4 * 4 * 5, 5), (1, 1)])
def test_chunked_route_bounds_its_scratch(monkeypatch, chunk_bytes, most):
    """Each chunk's pair scores (query blocks x heads x n_q x K * n_k fp32) stay within chunk_bytes, or one query
    block of one head where the budget is smaller: 256 MiB takes all 40 blocks x 3 heads at once; 5 blocks' worth,
    5 query blocks of one head; 1 byte, one block."""
    seen = []
    inner = sparse_attention._block_scores

    def spy(qbar, q_valid, q_start, kbar, k_valid, n_q, n_k):
        seen.append(qbar.shape[1] * qbar.shape[2] * kbar.shape[2] * 4)
        return inner(qbar, q_valid, q_start, kbar, k_valid, n_q, n_k)

    q, k = torch.randn(1, 64 * 40, 3, 8), torch.randn(1, 64 * 160, 3, 8)
    want, _ = subblock_route_reference(q, k, 0.8, 1.0)
    monkeypatch.setattr(sparse_attention, "_block_scores", spy)
    got, _ = subblock_route(q, k, 0.8, 1.0, chunk_bytes=chunk_bytes)
    assert torch.equal(got, want)
    one_block = 4 * 160 * 4 * 4
    assert max(seen) == most * one_block and sum(seen) == 40 * 3 * one_block


@pytest.mark.parametrize("kwargs,match", [
    (dict(n_q=3), "n_q and n_k"),
    (dict(n_k=16), "n_q and n_k"),
    (dict(block=48, n_q=32), "n_q and n_k"),
    (dict(block=60, n_q=8), "divisible by n_q"),
    (dict(block=0), "positive whole number of rows"),
    (dict(softmax_scale=0.0), "softmax_scale"),
    (dict(softmax_scale=math.nan), "softmax_scale"),
    (dict(sparsity=1.0), "sparsity"),
    (dict(sparsity=-0.5), "sparsity"),
    (dict(chunk_bytes=0), "chunk_bytes"),
])
def test_route_refuses_bad_arguments(kwargs, match):
    q, k = torch.randn(1, 128, 2, 8), torch.randn(1, 128, 2, 8)
    args = dict(sparsity=0.5, softmax_scale=8 ** -0.5) | kwargs
    with pytest.raises(ValueError, match=match):
        subblock_route(q, k, **args)
    if "chunk_bytes" not in kwargs:
        with pytest.raises(ValueError, match=match):
            subblock_route_reference(q, k, **args)


@pytest.mark.parametrize("q,k,match", [
    (torch.randn(128, 2, 8), torch.randn(128, 2, 8), r"\[B, S, N, D\]"),
    (torch.randn(1, 128, 2, 8), torch.randn(1, 128, 3, 8), "share B, N and D"),
    (torch.randn(1, 128, 2, 8), torch.randn(2, 128, 2, 8), "share B, N and D"),
    (torch.randn(1, 0, 2, 8), torch.randn(1, 128, 2, 8), "at least one row"),
    (torch.ones(1, 128, 2, 8, dtype=torch.int32), torch.ones(1, 128, 2, 8, dtype=torch.int32), "floating-point"),
])
def test_route_refuses_bad_tensors(q, k, match):
    with pytest.raises(ValueError, match=match):
        subblock_route(q, k, 0.5, 0.3)


def test_every_n_pairs_with_a_128_row_block():
    """The 128-row kernels route with block=128 (sub-blocks of 128 / n rows); same definition."""
    torch.manual_seed(3)
    q, k = torch.randn(1, 128 * 3 + 70, 2, 8), torch.randn(1, 128 * 3 + 70, 2, 8)
    for n in (1, 2, 4, 8):
        want = brute_scores(q, k, 0.7, n, n, 128)
        torch.testing.assert_close(subblock_scores(q, k, 0.7, n, n, 128).double(), want, rtol=1e-4, atol=1e-4)
        ref, topk = subblock_route_reference(q, k, 0.5, 0.7, n, n, 128)
        got, _ = subblock_route(q, k, 0.5, 0.7, n, n, 128, chunk_bytes=1)
        assert torch.equal(got, ref) and topk == 4
        assert_valid_topk(ref, topk, want, 1e-4)


def test_all_pairs_of_n_are_accepted():
    q, k = torch.randn(1, 100, 1, 4), torch.randn(1, 100, 1, 4)
    for n_q, n_k in itertools.product((1, 2, 4, 8), repeat=2):
        index, topk = subblock_route(q, k, 0.5, 0.5, n_q, n_k)
        assert index.shape == (1, 1, 2, topk) and topk == 2
