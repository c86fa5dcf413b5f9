"""Video Sparse Attention as FastH3 runs it: tile pooling, the routing, the coarse (gated) branch and the attention of
one block, over the tiles of models/vsa/tiles.py. The kernels that attend over the kept tiles are models/
vsa/kernels.py; which evaluations and layers run sparse is models/vsa/plan.py.

Definition (FastVideo `video_sparse_attn_h3.py` `_pool_tiles`, `_build_block_mask`, `MiniMaxH3VSAImpl.forward`;
SGLang `video_sparse_attn_h3.py` `_topk_tile_lists`, `forward_varlen`; the "exempt" mode both default to), per batch
row and head, with G tiles of which the first Gp are prefix chunks and Gv = G - Gp video tiles:
  1. qbar, kbar, vbar [G, D]: each tile's mean over its real rows, in fp32;
  2. scores [G, G] = qbar kbar^T / sqrt(D), fp32;
  3. a video query tile keeps every prefix key tile ("exempt": the prefix never competes) and the k video key tiles
     of highest score, k = max(1, min(ceil((1 - s) Gv), Gv)); a prefix query tile keeps every key tile (dense), and
     so does every tile when k = Gv (s = 0 is dense attention);
  4. out[row] = softmax over the real key rows of its tile's kept tiles of q k^T / sqrt(D), times v;
  5. the coarse branch, added to every row (prefix rows too): out[row] += (softmax(scores[tile(row)]) over all G
     tiles . vbar) * gate[row], gate = attn.to_gate_compress(the block's modulated input), no sigmoid.
Ties at the top-k threshold: both peers call torch.topk, whose choice among equal scores is unspecified (it differs
between devices); here the lower tile wins (a stable order), so a routing never depends on the device. The coarse
branch is folded in fp32 as SGLang's `vsa_h3_untile` does (FastVideo rounds it to bf16 before the multiply).

Shape legend: B batch, S packed rows, P padded rows (64 G), N heads, D head dim, G tiles, T kept tiles per query tile.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from ..sparse.attention import _topk_lowest_first
from .tiles import VSA_TILE_ROWS, VsaGeometry


def vsa_topk(sparsity: float, num_video_tiles: int) -> int:
    """Video key tiles a video query tile keeps: max(1, min(ceil((1 - s) Gv), Gv)), in Python floats as FastVideo's
    `compute_topk` and SGLang's `_compute_topk` (0.9 of 660 tiles: 66)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"VSA sparsity is the share of video key tiles skipped, in [0, 1); got {sparsity!r}.")
    return max(1, min(math.ceil((1.0 - sparsity) * num_video_tiles), num_video_tiles))


def to_tiles(x_BSND: torch.Tensor, geometry: VsaGeometry) -> torch.Tensor:
    """Packed rows [B, S, N, D] -> the padded tile layout [B, P, N, D], pad rows zero."""
    out = x_BSND.new_zeros((x_BSND.shape[0], geometry.padded_len, *x_BSND.shape[2:]))
    return out.index_copy_(1, geometry.row_slot, x_BSND)  # a scatter by each row's slot: no host sync


def from_tiles(x_BPND: torch.Tensor, geometry: VsaGeometry) -> torch.Tensor:
    """The padded tile layout [B, P, N, D] -> packed rows [B, S, N, D]."""
    return x_BPND.index_select(1, geometry.row_slot)


def pool_tiles(x_BPND: torch.Tensor, geometry: VsaGeometry) -> torch.Tensor:
    """Each tile's mean over its real rows, [B, N, G, D] fp32 (pad rows are zero, so the sum over all 64 divided by
    the real count is the mean)."""
    B, P, N, D = x_BPND.shape
    sums = x_BPND.view(B, P // VSA_TILE_ROWS, VSA_TILE_ROWS, N, D).sum(2, dtype=torch.float32)
    means = sums / geometry.sizes.to(sums.device, torch.float32).view(1, -1, 1, 1)
    return means.permute(0, 2, 1, 3)


def tile_scores(qbar_BNGD: torch.Tensor, kbar_BNGD: torch.Tensor) -> torch.Tensor:
    """scores [B, N, G, G] = qbar kbar^T / sqrt(D) in fp32 (FastVideo divides by sqrt(D); SGLang multiplies by its
    inverse, which can differ in the last bit)."""
    return torch.matmul(qbar_BNGD, kbar_BNGD.transpose(-1, -2)) / (qbar_BNGD.shape[-1] ** 0.5)


def route_tiles(scores_BNGG: torch.Tensor, num_prefix_tiles: int, sparsity: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [B, N, G, T] int32 ascending, sparse_G [G] bool): every prefix tile then the top-k video tiles for each
    video query tile (T = Gp + k); sparse_G False (every key tile) for the prefix query tiles, and for all tiles when
    k keeps every video tile. Ties at the threshold go to the lower tile."""
    B, N, G, _ = scores_BNGG.shape
    Gp = num_prefix_tiles
    Gv = G - Gp
    k = vsa_topk(sparsity, Gv)
    device = scores_BNGG.device
    if k == Gv:
        every = torch.arange(G, device=device, dtype=torch.int32).expand(B, N, G, G).contiguous()
        return every, torch.zeros(G, dtype=torch.bool, device=device)
    video_BNVV = scores_BNGG[:, :, Gp:, Gp:]
    picked = _topk_lowest_first(video_BNVV.reshape(-1, Gv), k).view(B, N, Gv, k) + Gp
    prefix = torch.arange(Gp, device=device, dtype=torch.int32).expand(B, N, Gv, Gp)
    video_rows = torch.cat([prefix, picked], dim=-1)
    # Prefix query tiles are dense (sparse_G False): their index rows are never read, any in-range values do.
    filler = torch.arange(Gp + k, device=device, dtype=torch.int32).expand(B, N, Gp, Gp + k)
    index = torch.cat([filler, video_rows], dim=2).contiguous()
    sparse_G = torch.arange(G, device=device) >= Gp
    return index, sparse_G


def coarse_branch(scores_BNGG: torch.Tensor, vbar_BNGD: torch.Tensor) -> torch.Tensor:
    """softmax(scores) over every tile . vbar: [B, N, G, D] fp32, one row per query tile."""
    return torch.matmul(torch.softmax(scores_BNGG, dim=-1), vbar_BNGD)


def add_gated(out_BSND: torch.Tensor, coarse_BNGD: torch.Tensor, gate_BSND: torch.Tensor,
              geometry: VsaGeometry) -> torch.Tensor:
    """out + coarse[tile(row)] * gate for every packed row, in fp32, returned in out's dtype."""
    coarse_BSND = coarse_BNGD.permute(0, 2, 1, 3).index_select(1, geometry.row_tile)
    return torch.addcmul(out_BSND.float(), coarse_BSND, gate_BSND.float()).to(out_BSND.dtype)


# (q, k, v [B, S, N, D]) -> [B, S, N, D]: dense attention over the packed rows, scale D^-1/2.
DenseFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (q, k, v tiled [B, P, N, D], index, sparse_G, sizes [G]) -> [B, P, N, D] (models/vsa/kernels.py).
BlockFn = Callable[..., torch.Tensor]


def vsa_attention(q_BSND, k_BSND, v_BSND, gate_BSND, geometry: VsaGeometry, sparsity: float, block_fn: BlockFn,
                  dense_fn: DenseFn) -> tuple[torch.Tensor, float]:
    """One block's VSA attention over packed rows (module docstring): (out [B, S, N, D] in q's dtype, the fraction
    of (query tile, key tile) pairs computed). Where every tile is kept (s = 0, a dense layer or evaluation, or k
    reaching every video tile) the attention is `dense_fn` over the packed rows, the same softmax; else `block_fn`
    over the padded tiles. The coarse branch runs in both."""
    q_t, k_t, v_t = (to_tiles(x, geometry) for x in (q_BSND, k_BSND, v_BSND))
    scores = tile_scores(pool_tiles(q_t, geometry), pool_tiles(k_t, geometry))
    Gv = geometry.num_video_tiles
    if sparsity == 0 or vsa_topk(sparsity, Gv) == Gv:  # every tile kept: the dense attention, the same softmax
        out, kept = dense_fn(q_BSND, k_BSND, v_BSND), 1.0
    else:
        index, sparse_G = route_tiles(scores, geometry.num_prefix_tiles, sparsity)
        out_t = block_fn(q_t, k_t, v_t, index, sparse_G, geometry.sizes.to(q_t.device))
        out, kept = from_tiles(out_t, geometry), kept_pairs(index.shape[-1], geometry)
    del q_t, k_t
    coarse = coarse_branch(scores, pool_tiles(v_t, geometry))
    return add_gated(out, coarse, gate_BSND, geometry), kept


def kept_pairs(width: int, geometry: VsaGeometry) -> float:
    """(query tile, key tile) pairs computed over all G^2 when video query tiles keep `width` tiles."""
    G, Gp = geometry.num_tiles, geometry.num_prefix_tiles
    return (Gp * G + (G - Gp) * width) / (G * G)


def vsa_reference(q_BSND, k_BSND, v_BSND, gate_BSND, geometry: VsaGeometry, sparsity: float) -> torch.Tensor:
    """The definition, row by row in fp32 (the test oracle): a row mask [B, N, S, S] built from each row's tile and the
    kept tiles, masked softmax attention, plus the coarse branch; no padded layout, no kernel. CPU-sized inputs."""
    q, k, v, g = (x.float() for x in (q_BSND, k_BSND, v_BSND, gate_BSND))
    B, S, N, D = q.shape
    tile = geometry.row_tile.to(q.device)
    G, Gp = geometry.num_tiles, geometry.num_prefix_tiles
    members = F.one_hot(tile, G).float()  # [S, G]
    counts = members.sum(0)

    def means(x):  # [B, S, N, D] -> [B, N, G, D]
        return torch.einsum("sg,bsnd->bngd", members, x) / counts.view(1, 1, G, 1)

    scores = torch.einsum("bngd,bnhd->bngh", means(q), means(k)) / math.sqrt(D)
    kept = torch.ones(B, N, G, G, dtype=torch.bool)
    kv = vsa_topk(sparsity, G - Gp) if sparsity > 0 else G - Gp
    if kv < G - Gp:
        order = torch.sort(scores[:, :, Gp:, Gp:], dim=-1, descending=True, stable=True).indices[..., :kv]
        video = torch.zeros(B, N, G - Gp, G - Gp, dtype=torch.bool).scatter_(-1, order, True)
        kept[:, :, Gp:, Gp:] = video
    row_mask = kept[:, :, tile][:, :, :, tile]  # [B, N, S, S]
    logits = torch.einsum("bsnd,btnd->bnst", q, k) / math.sqrt(D)
    attn = torch.softmax(logits.masked_fill(~row_mask, float("-inf")), dim=-1)
    out = torch.einsum("bnst,btnd->bsnd", attn, v)
    coarse = torch.softmax(scores, -1) @ means(v)  # [B, N, G, D]
    return out + coarse.permute(0, 2, 1, 3)[:, tile] * g
