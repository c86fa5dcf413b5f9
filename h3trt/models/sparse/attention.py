"""SubBlock routing: which key blocks each query block of a block-sparse attention computes.

SubBlock is SGLang Diffusion's training-free router for MiniMax-H3 (multimodal_gen/.../backends/subblock_sparse/
router.py; facts in issue 36). q and k are cut into `block`-row blocks (64, the kernel's granularity), each block into
n sub-blocks of block / n rows (n in 1, 2, 4, 8; n_q = n_k = 4 by default). Every sub-block is mean-pooled over its
real rows, and a query block i scores a key block j by

    score(i, j) = log sum_{a < n_q, b < n_k} exp(qbar_{i,a} . kbar_{j,b} * softmax_scale)

an estimate of the block's un-normalised softmax mass, the quantity that decides how much attention is lost when it
is skipped. Each (head, query block) keeps its top `sparse_budget(Gk, sparsity)` key blocks, returned sorted ascending
(what the block-sparse kernels read). Precision decisions, where they bite:
  - the last block may be ragged: its sub-blocks pool over their real rows only, and sub-cells with no real row are
    dropped from the sum (left in, each would add an exp(0) term that inflates the score and flattens the ranking);
  - pooling and scores are fp32: with bf16 scores many blocks tie at the threshold and ties go to early key blocks
    (SubBlock measured +3.9% relative L2 at 96k rows from that);
  - ties that remain go to the lower key block, in both paths below, so they keep the same blocks.

Two paths, the same blocks: `subblock_route_reference` materialises every sub-block pair at once and sorts (the
definition, CPU-sized inputs); `subblock_route`, the one the DiT calls, computes the same fp32 numbers head by head
and query block by query block within ROUTER_CHUNK_BYTES of scratch (37,838 rows x 56 heads would need 1.2 GB at
once) and selects with a tie-exact top-k. Both are plain torch and run on any device.

Shape legend: B batch, S rows, N heads, D head dim, G query blocks, K key blocks, T kept key blocks (topk),
P pooled sub-blocks (G * n).
"""

from __future__ import annotations

import math

import torch

SUBBLOCK_BLOCK = 64  # SubBlock's query/key block rows (the 64-row kernel's granularity)
SUBBLOCK_N = (1, 2, 4, 8)  # sub-blocks per block: 64, 32, 16 or 8 rows each
BUDGET_GRANULARITY = 8  # SubBlock rounds each budget up to a multiple of 8 blocks (its kernel bills in eights)
ROUTER_CHUNK_BYTES = 256 * 2**20  # scratch for one chunk of sub-block pair scores in `subblock_route`


def sparse_budget(num_key_blocks: int, sparsity: float) -> int:
    """Key blocks kept per (head, query block): ceil((1 - sparsity) * K) rounded up to a multiple of 8, at most K.

    The arithmetic is SubBlock's, in Python floats, so the two keep the same count (0.75 of 590 blocks: 152 kept).
    `sparsity` is therefore an upper bound on the skipped share; 0 keeps every block."""
    if isinstance(num_key_blocks, bool) or not isinstance(num_key_blocks, int) or num_key_blocks < 1:
        raise ValueError(f"sparse_budget needs a positive whole number of key blocks, got {num_key_blocks!r}.")
    if not isinstance(sparsity, (int, float)) or isinstance(sparsity, bool) or not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity is the share of key blocks skipped, in [0, 1); got {sparsity!r}.")
    wanted = math.ceil((1.0 - sparsity) * num_key_blocks)
    return min(num_key_blocks, BUDGET_GRANULARITY * math.ceil(wanted / BUDGET_GRANULARITY))


def _check_route_args(q_BSND, k_BSND, softmax_scale, n_q, n_k, block) -> None:
    if not (isinstance(q_BSND, torch.Tensor) and isinstance(k_BSND, torch.Tensor)) or q_BSND.dim() != 4 \
            or k_BSND.dim() != 4:
        raise ValueError(f"the router takes q and k as [B, S, N, D] tensors, got "
                         f"{getattr(q_BSND, 'shape', type(q_BSND))} and {getattr(k_BSND, 'shape', type(k_BSND))}.")
    (B, S, N, D), (Bk, Sk, Nk, Dk) = q_BSND.shape, k_BSND.shape
    if (B, N, D) != (Bk, Nk, Dk) or S < 1 or Sk < 1:
        raise ValueError(f"q [B, S, N, D] = {tuple(q_BSND.shape)} and k = {tuple(k_BSND.shape)} must share B, N and D "
                         "and hold at least one row each.")
    if not (q_BSND.is_floating_point() and k_BSND.is_floating_point()):
        raise ValueError(f"the router pools floating-point q/k, got {q_BSND.dtype} and {k_BSND.dtype}.")
    if n_q not in SUBBLOCK_N or n_k not in SUBBLOCK_N:
        raise ValueError(f"n_q and n_k (sub-blocks per block) must be one of {SUBBLOCK_N}, got n_q={n_q}, n_k={n_k}.")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block % n_q or block % n_k:
        raise ValueError(f"block ({block!r} rows) must be a positive whole number of rows divisible by n_q ({n_q}) and "
                         f"n_k ({n_k}), e.g. {SUBBLOCK_BLOCK}.")
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number (D**-0.5 = {D ** -0.5:.6g}), got "
                         f"{softmax_scale!r}.")


def pool_subblocks(x_BSND: torch.Tensor, n: int, block: int) -> tuple[torch.Tensor, int]:
    """(pooled [B, N, P, D] fp32, valid): sub-block c covers rows [c * block/n, (c + 1) * block/n), its mean over its
    real rows; P = ceil(S / block) * n, and sub-blocks at or past `valid` = ceil(S * n / block) hold no real row (zero
    here, dropped from every score). Reads x in its own dtype and accumulates in fp32, never copying it whole."""
    B, S, N, D = x_BSND.shape
    sub = block // n
    full, tail = divmod(S, sub)
    G = -(-S // block)
    pooled_BPND = x_BSND.new_zeros((B, G * n, N, D), dtype=torch.float32)
    if full:
        pooled_BPND[:, :full] = x_BSND[:, :full * sub].reshape(B, full, sub, N, D).sum(2, dtype=torch.float32) / sub
    if tail:
        pooled_BPND[:, full] = x_BSND[:, full * sub:].sum(1, dtype=torch.float32) / tail
    return pooled_BPND.permute(0, 2, 1, 3).contiguous(), full + (tail > 0)


def _pooled(q_BSND, k_BSND, softmax_scale, n_q, n_k, block):
    """Pooled, pre-scaled q [B, N, Pq, D] and pooled k [B, N, Pk, D] (fp32), with their valid sub-block counts."""
    qbar_BNPD, q_valid = pool_subblocks(q_BSND, n_q, block)
    kbar_BNPD, k_valid = pool_subblocks(k_BSND, n_k, block)
    return qbar_BNPD * softmax_scale, q_valid, kbar_BNPD, k_valid


def _block_scores(qbar_BNPD, q_valid, q_start, kbar_BNPD, k_valid, n_q, n_k) -> torch.Tensor:
    """score(i, j) [B, N, g, K] for the query blocks whose sub-blocks are qbar's rows, the first at pooled row
    `q_start` (so `q_valid` counts from the sequence start): log-sum-exp over their valid sub-block pairs."""
    B, N, Pq, _ = qbar_BNPD.shape
    Pk = kbar_BNPD.shape[2]
    pair_BNPP = torch.matmul(qbar_BNPD, kbar_BNPD.transpose(-1, -2))  # fp32: qbar . kbar * softmax_scale
    if k_valid < Pk:
        pair_BNPP[..., k_valid:] = -math.inf
    if q_start + Pq > q_valid:
        pair_BNPP[..., max(0, q_valid - q_start):, :] = -math.inf
    return torch.logsumexp(pair_BNPP.view(B, N, Pq // n_q, n_q, Pk // n_k, n_k), dim=(3, 5))


def subblock_scores(q_BSND: torch.Tensor, k_BSND: torch.Tensor, softmax_scale: float, n_q: int = 4, n_k: int = 4,
                    block: int = SUBBLOCK_BLOCK) -> torch.Tensor:
    """SubBlock's block scores [B, N, G, K] in fp32, every sub-block pair at once (the definition)."""
    _check_route_args(q_BSND, k_BSND, softmax_scale, n_q, n_k, block)
    with torch.no_grad():
        qbar, q_valid, kbar, k_valid = _pooled(q_BSND, k_BSND, softmax_scale, n_q, n_k, block)
        return _block_scores(qbar, q_valid, 0, kbar, k_valid, n_q, n_k)


def subblock_route_reference(q_BSND: torch.Tensor, k_BSND: torch.Tensor, sparsity: float, softmax_scale: float,
                             n_q: int = 4, n_k: int = 4, block: int = SUBBLOCK_BLOCK) -> tuple[torch.Tensor, int]:
    """(index [B, N, G, T] int32 sorted ascending, T): the top T key blocks of `subblock_scores` per (head, query
    block), ties to the lower key block (a stable descending sort), in plain torch on any device."""
    scores_BNGK = subblock_scores(q_BSND, k_BSND, softmax_scale, n_q, n_k, block)
    topk = sparse_budget(scores_BNGK.shape[-1], sparsity)
    order_BNGK = torch.sort(scores_BNGK, dim=-1, descending=True, stable=True).indices
    return order_BNGK[..., :topk].sort(dim=-1).values.to(torch.int32).contiguous(), topk


def _topk_lowest_first(scores_RK: torch.Tensor, topk: int) -> torch.Tensor:
    """The column indices [R, topk] int32, ascending, of each row's `topk` largest scores, ties to the lower column:
    the same set as a stable descending sort, at the cost of two top-k passes. torch.topk alone leaves the order of
    ties unspecified (it differs between devices), so the threshold value is found first, every score above it is
    kept, and the lowest-indexed scores equal to it fill the rest."""
    R, K = scores_RK.shape
    if topk == K:
        return torch.arange(K, device=scores_RK.device, dtype=torch.int32).expand(R, K).contiguous()
    threshold_R1 = scores_RK.topk(topk, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above_RK = scores_RK > threshold_R1
    tied_RK = scores_RK == threshold_R1
    room_R1 = topk - above_RK.sum(-1, keepdim=True)
    keep_RK = above_RK | (tied_RK & (tied_RK.cumsum(-1) <= room_R1))
    # Exactly `topk` columns kept per row; give them distinct keys, larger for lower columns, and read them back.
    column_K = torch.arange(K, 0, -1, device=scores_RK.device)
    picked_RT = torch.where(keep_RK, column_K, 0).topk(topk, dim=-1, sorted=True).values
    return (K - picked_RT).to(torch.int32)


def route_sizes(q_BSND: torch.Tensor, k_BSND: torch.Tensor, sparsity: float, block: int) -> tuple[int, ...]:
    """(B, N, G query blocks, K key blocks, topk kept per row) of a routing."""
    B, _, N, _ = q_BSND.shape
    K = -(-k_BSND.shape[1] // block)
    return B, N, -(-q_BSND.shape[1] // block), K, sparse_budget(K, sparsity)


def every_key_block(B: int, N: int, G: int, K: int, device) -> torch.Tensor:
    """The index when the budget keeps every key block (nothing to choose): [B, N, G, K] int32, in order."""
    return torch.arange(K, device=device, dtype=torch.int32).expand(B, N, G, K).contiguous()


def subblock_route(q_BSND: torch.Tensor, k_BSND: torch.Tensor, sparsity: float, softmax_scale: float, n_q: int = 4,
                   n_k: int = 4, block: int = SUBBLOCK_BLOCK,
                   chunk_bytes: int = ROUTER_CHUNK_BYTES) -> tuple[torch.Tensor, int]:
    """(index [B, N, G, T] int32 sorted ascending per row, T): SubBlock's routing, the blocks
    `subblock_route_reference` keeps, with at most `chunk_bytes` of pair scores alive at once.

    q, k: [B, S, N, D] (k may have another row count); sparsity in [0, 1) (0 keeps every block); softmax_scale the
    attention's (D**-0.5); n_q, n_k sub-blocks per block in (1, 2, 4, 8); block rows per block (64: SubBlock's)."""
    _check_route_args(q_BSND, k_BSND, softmax_scale, n_q, n_k, block)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}.")
    B, N, G, K, topk = route_sizes(q_BSND, k_BSND, sparsity, block)
    with torch.no_grad():
        if topk == K:
            return every_key_block(B, N, G, K, q_BSND.device), topk
        qbar_BNPD, q_valid, kbar_BNPD, k_valid = _pooled(q_BSND, k_BSND, softmax_scale, n_q, n_k, block)
        # One query block of one head holds n_q x (K * n_k) fp32 pair scores; take as many as the budget allows,
        # whole heads first (the matmul per head is then the reference's own), query blocks of one head past that.
        per_block = n_q * K * n_k * 4
        blocks = max(1, min(G, chunk_bytes // per_block))
        heads = max(1, min(N, chunk_bytes // (per_block * G))) if blocks == G else 1
        index_BNGT = torch.empty((B, N, G, topk), device=q_BSND.device, dtype=torch.int32)
        for h in range(0, N, heads):
            h_end = min(N, h + heads)
            for g in range(0, G, blocks):
                g_end = min(G, g + blocks)
                scores_BngK = _block_scores(qbar_BNPD[:, h:h_end, g * n_q:g_end * n_q], q_valid, g * n_q,
                                            kbar_BNPD[:, h:h_end], k_valid, n_q, n_k)
                picked = _topk_lowest_first(scores_BngK.reshape(-1, K), topk)
                index_BNGT[:, h:h_end, g:g_end] = picked.view(B, h_end - h, g_end - g, topk)
        return index_BNGT, topk
