"""The masked reference of block-sparse attention: the kept blocks expanded to a boolean row mask over SDPA, on any
device. The oracle the other kernels are tested against (models/sparse/kernels.py's `reference` kernel, and the
FP8 emulation's attention, models/sparse/fp8.py).

Shape legend: B batch, S rows, N heads, D head dim, G query blocks, K key blocks, T kept key blocks per query block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REFERENCE_MASK_BYTES = 256 * 2**20  # the reference's row mask, built this many bytes of query rows at a time


def kept_block_mask(index_BNGT: torch.Tensor, sparse_G: torch.Tensor, num_key_blocks: int) -> torch.Tensor:
    """[B, N, G, K] bool: True where query block g computes key block j."""
    B, N, G, _ = index_BNGT.shape
    kept = torch.zeros((B, N, G, num_key_blocks), dtype=torch.bool, device=index_BNGT.device)
    kept.scatter_(-1, index_BNGT.long(), True)
    return kept | ~sparse_G.view(1, 1, G, 1)


def reference_sparse_attention(q_BSND, k_BSND, v_BSND, index_BNGT, sparse_G, block) -> torch.Tensor:
    """Masked SDPA: the kept blocks expanded to a [B, N, rows, Sk] boolean mask, a few query blocks at a time so the
    mask stays within REFERENCE_MASK_BYTES. Rows attend independently, so the chunks change nothing."""
    B, S, N, D = q_BSND.shape
    Sk = k_BSND.shape[1]
    K = -(-Sk // block)
    kept_BNGK = kept_block_mask(index_BNGT, sparse_G, K)
    q_BNSD, k_BNSD, v_BNSD = (t.transpose(1, 2) for t in (q_BSND, k_BSND, v_BSND))
    out_BNSD = torch.empty((B, N, S, D), dtype=q_BSND.dtype, device=q_BSND.device)
    step = max(1, REFERENCE_MASK_BYTES // max(1, B * N * block * Sk))  # query blocks per chunk
    G = kept_BNGK.shape[2]
    for g in range(0, G, step):
        g_end = min(G, g + step)
        rows = slice(g * block, min(S, g_end * block))
        mask = kept_BNGK[:, :, g:g_end].repeat_interleave(block, dim=2).repeat_interleave(block, dim=3)
        mask = mask[:, :, :rows.stop - rows.start, :Sk]
        out_BNSD[:, :, rows] = F.scaled_dot_product_attention(q_BNSD[:, :, rows], k_BNSD, v_BNSD, attn_mask=mask)
    return out_BNSD.transpose(1, 2).contiguous()
