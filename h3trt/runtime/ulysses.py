"""Ulysses sequence parallelism for the H3 DiT: each rank holds S / sp rows of the packed sequence; attention
re-shards to all rows x N / sp heads with one fused all-to-all for q/k/v and one for the output.

The packed sequence is padded to a multiple of sp. Padding rows are masked out as attention keys, and everything
else in a block is row-local, so padding never reaches a live row; the padded rows are dropped after the last
block. Shape legend: B batch, S rows (Sp padded, Sl = Sp / sp local), N heads (Nl = N / sp local), D head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..models.config import NUM_MODALITIES
from ..models.dit import H3DiT
from ..models.packing import PackedLayout


def padded_length(seq_len: int, sp: int) -> int:
    return -(-seq_len // sp) * sp


class UlyssesAttention:
    """The `attn_fn` of a block under sequence parallelism: [B, Sl, N, D] q/k/v in, [B, Sl, N, D] out."""

    def __init__(self, group, seq_len: int, padded: int):
        self.group, self.sp = group, dist.get_world_size(group)
        self.mask = None
        if padded != seq_len:  # keys of padding rows get no weight; without padding, no mask (fast kernels)
            self.mask = (torch.arange(padded) < seq_len).view(1, 1, 1, padded)

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.group)
        return out

    def __call__(self, q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor) -> torch.Tensor:
        sp = self.sp
        B, Sl, N, D = q_BSND.shape
        # 1. One all-to-all for q, k and v: send head group j to rank j, receive every rank's rows of my heads.
        qkv = torch.stack([q_BSND, k_BSND, v_BSND])  # [3, B, Sl, N, D]
        qkv = qkv.unflatten(3, (sp, N // sp)).permute(3, 0, 1, 2, 4, 5).contiguous()  # [sp, 3, B, Sl, Nl, D]
        qkv = self._all_to_all(qkv)  # [sp (row chunk), 3, B, Sl, Nl, D]
        q, k, v = qkv.permute(1, 2, 0, 3, 4, 5).reshape(3, B, sp * Sl, N // sp, D)
        # 2. Attention over every row for my heads.
        mask = None if self.mask is None else self.mask.to(q.device)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask).transpose(1, 2)  # [B, Sp, Nl, D]
        # 3. One all-to-all back: row chunk j to rank j, receive my rows of every head group.
        out = out.unflatten(1, (sp, Sl)).permute(1, 0, 2, 3, 4).contiguous()  # [sp, B, Sl, Nl, D]
        out = self._all_to_all(out)  # [sp (head group), B, Sl, Nl, D]
        return out.permute(1, 2, 0, 3, 4).reshape(B, Sl, N, D)


@torch.no_grad()
def forward_sp(model: H3DiT, group, video, audio, text, unique_t, t_index, layout: PackedLayout):
    """One DiT evaluation with the block stack sharded over `group`; every rank returns the full outputs."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = layout.seq_len
    padded = padded_length(seq_len, sp)
    if model.cfg.num_heads % sp:
        raise ValueError(f"sp={sp} does not divide the {model.cfg.num_heads} heads.")
    # 1. Embed on every rank (text refiner and projections are cheap next to the blocks).
    x, temb = model.embed(video, audio, text, unique_t, layout.video_index, layout.audio_index, layout.text_index,
                          seq_len)
    adaln_index = t_index * NUM_MODALITIES + layout.token_tags
    cos, sin = model.rope(layout.position_ids)
    pad = padded - seq_len
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
        adaln_index = F.pad(adaln_index, (0, pad))
        cos, sin = F.pad(cos, (0, 0, 0, pad)), F.pad(sin, (0, 0, 0, pad))
    # 2. My rows.
    local = slice(rank * padded // sp, (rank + 1) * padded // sp)
    x_local = x[:, local].contiguous()
    attn = UlyssesAttention(group, seq_len, padded)
    for block in model.blocks:
        x_local = block(x_local, block.modulation(temb), adaln_index[local], (cos[local], sin[local]), attn)
    # 3. Every rank gathers the rows and runs the heads (the sampler updates the same latents everywhere).
    parts = [torch.empty_like(x_local) for _ in range(sp)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    x = torch.cat(parts, dim=1)[:, :seq_len]
    return model.final(x, temb, t_index, layout.video_index, layout.audio_index)


class UlyssesDiT:
    """The eager DiT with its block stack sharded over `group`: the runner signature the pipeline calls."""

    def __init__(self, model: H3DiT, group):
        self.model, self.cfg, self.group = model, model.cfg, group

    def __call__(self, video, audio, text, unique_t, t_index, layout: PackedLayout):
        return forward_sp(self.model, self.group, video, audio, text, unique_t, t_index, layout)
