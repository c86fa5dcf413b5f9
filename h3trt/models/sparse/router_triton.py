"""SubBlock routing fused in Triton: the blocks `subblock_route` (models/sparse/attention.py) keeps, on a CUDA GPU.

The torch router materialises every sub-block pair score ([N, G * n_q, K * n_k] fp32, 1.2 GB at H3's 37,838 rows x 56
heads with n = 4) in chunks and took 15.23 ms on the H200 for 64-row blocks, 63% of the sparse attention it routes
(bench/README.md). Here three kernels do the same arithmetic without that buffer:
  1. `_pool_kernel`: each sub-block's mean over its real rows, summed in fp32, divided by the real-row count (the
     mean `pool_subblocks` takes; q then scaled by softmax_scale, as `_pooled` does), zero where the sub-block holds
     no real row. One program per (block, head, batch).
  2. `_score_kernel`: score(i, j) = log sum over the valid (a, b) sub-block pairs of exp(qbar_ia . kbar_jb), fp32,
     one program per (BLOCK_G query blocks x BLOCK_K key blocks, head, batch): each pair (a, b) is one
     [BLOCK_G, D] x [D, BLOCK_K] fp32 dot (summed over 32-wide slices of D, to fit shared memory) folded into a running (max, sum) so no pair tile is kept. Pairs with a
     sub-block past the last real row are -inf (dropped), as in the torch path; pair (0, 0) of an existing block
     always holds real rows, so a real score is finite.
  3. `_topk_kernel`: per (head, query block) row of K <= 1024 scores, each score's fp32 bits mapped to an order-
     preserving integer; the topk-th largest is found bit by bit (32 counting passes over the row, no sort), every
     score above it is kept and the lowest-numbered blocks equal to it fill the rest: exactly the set a stable
     descending sort keeps (the reference's `torch.sort(..., stable=True)`, `_topk_lowest_first`'s rule). The kept
     columns are written in ascending order through a prefix sum. Rows of more than TOPK_MAX_BLOCKS key blocks
     (over 65,536 rows in 64-row blocks) take `_topk_lowest_first` instead: torch, the same set, more launches.
Precision: the dot runs in full fp32 ("ieee", CUDA-core FMAs) or "tf32x3" (three TF32 tensor-core products, the
error of fp32 within a few ulp); either differs from cuBLAS's fp32 GEMM in the order of its additions only, so the
scores agree to a few ulp and the kept set is the torch path's except where two key blocks' scores at the threshold
lie within that rounding of each other (a near-tie fp32 cannot resolve either way; scripts/bench_router.py counts
them at H3's shape, with the score gap of every swapped pair). Exact ties (equal blocks score bit-identically) go to
the lower block, as in torch.

Integer lengths are not specialised on (do_not_specialize): one compile per (dtype, head dim, block, n_q, n_k)
serves every sequence length, so `warm_router` at load compiles all a request needs.

This module imports triton at import; models/sparse/router.py imports it only where the Triton path is chosen.
Shape legend: B batch, S rows, N heads, D head dim, G query blocks, K key blocks, T kept key blocks, P pooled
sub-blocks (G * n).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import _check_route_args, _topk_lowest_first, every_key_block, route_sizes

# Query blocks x key blocks per score program (each cell an n_q x n_k set of pair dots), and its warps.
SCORE_TILE_G, SCORE_TILE_K, SCORE_WARPS = 64, 64, 4
SCORE_CHUNK_D = 32  # head-dim slice of each pair dot: its operands fit the shared memory (_score_kernel)
TOPK_MAX_BLOCKS = 1024  # the top-k kernel holds one row of this many slots in registers (65,536 rows of 64)
TOPK_WARPS = 2  # one row per program: few warps keep its 32 counting passes' reductions cheap
DOT_PRECISIONS = ("ieee", "tf32x3")
# tf32x3 for the tensor cores (the pair dots are ~80 GFLOP at H3's shape; ieee runs them on CUDA-core FMAs): on one
# H100 at H3's shape, 3.91 ms against ieee's 9.45 (scripts/bench_router.py), its blocks torch's but at near-ties.
DEFAULT_DOT_PRECISION = "tf32x3"


@triton.jit(do_not_specialize=["S", "P"])
def _pool_kernel(x_ptr, out_ptr, S, P, stride_b, stride_s, stride_n, scale,
                 N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SUB: tl.constexpr, BLOCK_SUB: tl.constexpr,
                 NSUB: tl.constexpr):
    g, n, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_SUB)
    d_ok = d < D
    base = x_ptr + b.to(tl.int64) * stride_b + n.to(tl.int64) * stride_n
    out_base = out_ptr + (b * N + n).to(tl.int64) * P * D
    for c in tl.static_range(NSUB):
        start = (g * NSUB + c) * SUB
        rows = start + r
        ok = (r < SUB) & (rows < S)
        x = tl.load(base + rows[:, None].to(tl.int64) * stride_s + d[None, :], mask=ok[:, None] & d_ok[None, :],
                    other=0.0)
        total = tl.sum(x.to(tl.float32), axis=0)
        count = tl.minimum(tl.maximum(S - start, 0), SUB)
        mean = tl.where(count > 0, total / tl.maximum(count, 1).to(tl.float32), 0.0) * scale
        tl.store(out_base + (g * NSUB + c) * D + d, mean, mask=d_ok)


@triton.jit(do_not_specialize=["G", "K", "q_valid", "k_valid", "Pq", "Pk"])
def _score_kernel(q_ptr, k_ptr, out_ptr, G, K, q_valid, k_valid, Pq, Pk,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, NQ: tl.constexpr,
                  NK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_k, pid_g, bn = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)  # query blocks
    j = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # key blocks
    dc = tl.arange(0, CHUNK_D)
    q_base = q_ptr + bn.to(tl.int64) * Pq * D
    k_base = k_ptr + bn.to(tl.int64) * Pk * D
    m = tl.full([BLOCK_G, BLOCK_K], -3.0e38, tl.float32)  # finite: no inf - inf in the padding past G or K
    s = tl.zeros([BLOCK_G, BLOCK_K], dtype=tl.float32)
    # Loops, not unrolled: unrolled, the 4 x 4 pairs' dots each kept their own shared-memory operands (270 KB, over
    # Hopper's 227 KB, on the H200 even with the head dim in slices); looped, one set of buffers serves them all.
    for a in range(NQ):
        q_row = i * NQ + a
        q_ok = q_row < q_valid
        for b in range(NK):
            k_row = j * NK + b
            k_ok = k_row < k_valid
            # The head dim in CHUNK_D slices: whole [64, 128] fp32 operands (and tf32x3's split copies of them)
            # need 288 KB of shared memory, over Hopper's 227 KB (bench_router.py on an H100 refused to launch).
            x = tl.zeros([BLOCK_G, BLOCK_K], dtype=tl.float32)
            for c in range(BLOCK_D // CHUNK_D):
                d = c * CHUNK_D + dc
                d_ok = d < D
                q_a = tl.load(q_base + q_row[:, None] * D + d[None, :], mask=q_ok[:, None] & d_ok[None, :],
                              other=0.0)
                k_b = tl.load(k_base + k_row[:, None] * D + d[None, :], mask=k_ok[:, None] & d_ok[None, :],
                              other=0.0)
                x += tl.dot(q_a, tl.trans(k_b), input_precision=PRECISION)
            x = tl.where(q_ok[:, None] & k_ok[None, :], x, float("-inf"))
            m_new = tl.maximum(m, x)
            # Pair (0, 0) of a real (i, j) is real: m is its own value from the first pair on, and a dropped pair
            # adds exp(-inf) = 0.
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
    score = m + tl.log(s) + 0.0  # + 0.0: a -0.0 score ranks as +0.0, as torch compares them
    out = out_ptr + bn.to(tl.int64) * G * K + i[:, None] * K + j[None, :]
    tl.store(out, score, mask=(i[:, None] < G) & (j[None, :] < K))


@triton.jit(do_not_specialize=["K", "T"])
def _topk_kernel(scores_ptr, index_ptr, K, T, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    ok = j < K
    score = tl.load(scores_ptr + row * K + j, mask=ok, other=0.0)
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 is +0.0 here, as torch compares them
    bits = score.to(tl.int32, bitcast=True)
    # fp32 order as an integer in [0, 2^32) (no NaN: every real score is finite); past K: -1, below every score.
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648
    key = tl.where(ok, key, -1)
    # The T-th largest key, bit by bit from the top: the largest v with at least T keys >= v.
    v = tl.zeros([], dtype=tl.int64)
    for bit in range(31, -1, -1):
        candidate = v | (tl.full([], 1, tl.int64) << bit)
        v = tl.where(tl.sum((key >= candidate).to(tl.int32), axis=0) >= T, candidate, v)
    above = key > v
    tied = key == v
    room = T - tl.sum(above.to(tl.int32), axis=0)
    keep = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= room))  # ties: the lowest blocks
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1  # ascending key block order
    tl.store(index_ptr + row * T + slot, j, mask=keep)


def pool_subblocks_triton(x_BSND: torch.Tensor, n: int, block: int, scale: float = 1.0) -> tuple[torch.Tensor, int]:
    """(pooled [B, N, P, D] fp32 times `scale`, valid): `pool_subblocks`'s means on the GPU (P = ceil(S / block) * n;
    sub-blocks at or past `valid` hold no real row and are zero)."""
    B, S, N, D = x_BSND.shape
    if x_BSND.stride(-1) != 1:
        x_BSND = x_BSND.contiguous()
    sub = block // n
    G = -(-S // block)
    P = G * n
    pooled_BNPD = torch.empty((B, N, P, D), device=x_BSND.device, dtype=torch.float32)
    _pool_kernel[(G, N, B)](x_BSND, pooled_BNPD, S, P, x_BSND.stride(0), x_BSND.stride(1), x_BSND.stride(2),
                            float(scale), N=N, D=D, BLOCK_D=triton.next_power_of_2(D), SUB=sub,
                            BLOCK_SUB=triton.next_power_of_2(sub), NSUB=n)
    return pooled_BNPD, -(-S * n // block)


def subblock_scores_triton(q_BSND, k_BSND, softmax_scale: float, n_q: int = 4, n_k: int = 4, block: int = 64,
                           precision: str = DEFAULT_DOT_PRECISION) -> torch.Tensor:
    """SubBlock's block scores [B, N, G, K] fp32 (`subblock_scores`' numbers to a few ulp), fused."""
    _check_route_args(q_BSND, k_BSND, softmax_scale, n_q, n_k, block)
    if precision not in DOT_PRECISIONS:
        raise ValueError(f"the Triton router's dot precision is one of {DOT_PRECISIONS}, got {precision!r}.")
    B, _, N, D = q_BSND.shape
    qbar_BNPD, q_valid = pool_subblocks_triton(q_BSND, n_q, block, softmax_scale)
    kbar_BNPD, k_valid = pool_subblocks_triton(k_BSND, n_k, block)
    G, K = qbar_BNPD.shape[2] // n_q, kbar_BNPD.shape[2] // n_k
    scores_BNGK = torch.empty((B, N, G, K), device=q_BSND.device, dtype=torch.float32)
    grid = (triton.cdiv(K, SCORE_TILE_K), triton.cdiv(G, SCORE_TILE_G), B * N)
    _score_kernel[grid](qbar_BNPD, kbar_BNPD, scores_BNGK, G, K, q_valid, k_valid, G * n_q, K * n_k,
                        D=D, BLOCK_D=triton.next_power_of_2(D),
                        CHUNK_D=min(SCORE_CHUNK_D, triton.next_power_of_2(D)), NQ=n_q, NK=n_k, BLOCK_G=SCORE_TILE_G,
                        BLOCK_K=SCORE_TILE_K, PRECISION=precision, num_warps=SCORE_WARPS,
                        num_stages=1)
    return scores_BNGK


def topk_lowest_first_triton(scores_RK: torch.Tensor, topk: int) -> torch.Tensor:
    """`_topk_lowest_first` in one kernel: [R, topk] int32, ascending, each row's topk largest, ties to the lower
    column. Rows longer than TOPK_MAX_BLOCKS go to the torch function (the same set)."""
    R, K = scores_RK.shape
    if K > TOPK_MAX_BLOCKS:
        return _topk_lowest_first(scores_RK, topk)
    scores_RK = scores_RK.contiguous()
    index_RT = torch.empty((R, topk), device=scores_RK.device, dtype=torch.int32)
    # One width for every K: one compile at load serves every sequence length (the H3 row, 592 blocks, needs 1024).
    _topk_kernel[(R,)](scores_RK, index_RT, K, topk, BLOCK_K=TOPK_MAX_BLOCKS,
                       num_warps=TOPK_WARPS)
    return index_RT


def subblock_route_triton(q_BSND: torch.Tensor, k_BSND: torch.Tensor, sparsity: float, softmax_scale: float,
                          n_q: int = 4, n_k: int = 4, block: int = 64,
                          precision: str = DEFAULT_DOT_PRECISION) -> tuple[torch.Tensor, int]:
    """(index [B, N, G, T] int32 ascending, T): `subblock_route`'s blocks, fused. Same arguments (no chunk_bytes:
    the only scratch is the pooled q/k and the [B, N, G, K] fp32 scores, 78 MB at H3's shape)."""
    _check_route_args(q_BSND, k_BSND, softmax_scale, n_q, n_k, block)
    B, N, G, K, topk = route_sizes(q_BSND, k_BSND, sparsity, block)
    with torch.no_grad():
        if topk == K:
            return every_key_block(B, N, G, K, q_BSND.device), topk
        scores_BNGK = subblock_scores_triton(q_BSND, k_BSND, softmax_scale, n_q, n_k, block, precision)
        return topk_lowest_first_triton(scores_BNGK.view(-1, K), topk).view(B, N, G, topk), topk
