"""Ulysses sequence parallelism for the H3 DiT: each rank holds S / sp rows of the packed sequence; attention
re-shards to all rows x N / sp heads with one fused all-to-all for q/k/v and one for the output.

The packed sequence is padded to a multiple of sp. Padding rows are left out of the attention keys, and everything
else in a block is row-local, so padding never reaches a live row; the padded rows are dropped after the last
block. Shape legend: B batch, S rows (Sp padded, Sl = Sp / sp local), N heads (Nl = N / sp local), D head dim,
P = sp (the all-to-all's leading dimension: destination rank when sent, source rank when received).

The two layout functions are pure; a compiled engine bakes `to_head_groups` into its pre-attention segment and
`from_head_groups` into its post-attention segment, so only the two exchanges and SDPA run between them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..models.dit import AttentionFn, H3DiT, layer_attention, sdpa_attention
from ..models.packing import PackedLayout
from ..models.runner import NO_EXTRAS, EvalExtras, RunnerCaps
from ..models.vsa.plan import VsaServing, vsa_call


def padded_length(seq_len: int, sp: int) -> int:
    return -(-seq_len // sp) * sp


def to_head_groups(*tensors_BSND: torch.Tensor, sp: int) -> torch.Tensor:
    """The send buffer [P, C, B, Sl, Nl, D] of q, k, v (C = 3), or q, k, v and a FastH3-VSA block's gate (C = 4,
    which travels with them): head group j goes to rank j (piece [j, x, b] is contiguous)."""
    B, Sl, N, D = tensors_BSND[0].shape
    qkv = torch.stack(tensors_BSND)  # [C, B, Sl, N, D]
    return qkv.unflatten(3, (sp, N // sp)).permute(3, 0, 1, 2, 4, 5).contiguous()


def from_head_groups(out_PBSND: torch.Tensor) -> torch.Tensor:
    """Received outputs (head group p from rank p) -> my rows of every head [B, Sl, N, D]."""
    P, B, Sl, Nl, D = out_PBSND.shape
    return out_PBSND.permute(1, 2, 0, 3, 4).reshape(B, Sl, P * Nl, D)


class UlyssesExchange:
    """The part of a sharded attention that runs outside compiled code: exchange, SDPA over every row for my heads,
    exchange back. Takes the send buffer of `to_head_groups`, returns the buffer `from_head_groups` reads.

    Each exchange is one fused all-to-all (one NCCL group of sends and receives) whose receives land directly in
    place: rank p's rows of q, k and v go to rows [p Sl, (p + 1) Sl) of [B, Sp, Nl, D] buffers, the layout the
    unsharded block hands SDPA, and the output's row chunks leave from that layout as they are. No reordering copies.
    """

    def __init__(self, group, seq_len: int, padded: int):
        self.group, self.sp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.peers = [dist.get_global_rank(group, p) for p in range(self.sp)]
        self.seq_len = seq_len

    def _all_to_all(self, pieces: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """(send, receive, rank) pieces: my own copied, the rest in one batch of sends and receives."""
        ops = []
        for send, recv, p in pieces:
            if p == self.rank:
                recv.copy_(send)
            else:
                ops += [dist.P2POp(dist.isend, send, self.peers[p], self.group),
                        dist.P2POp(dist.irecv, recv, self.peers[p], self.group)]
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()

    def __call__(self, qkv_send: torch.Tensor, attention: AttentionFn | None = None) -> torch.Tensor:
        """`attention`: the attention core over [B, S, Nl, D] q/k/v (and a VSA block's gate: the buffer's C = 4) of
        the real rows (e.g. FP8 attention bound to a layer's scales); None: bf16 SDPA."""
        P, C, B, Sl, Nl, D = qkv_send.shape
        if attention is None and C != 3:
            raise ValueError(f"the exchange's SDPA takes q, k, v; a send buffer of {C} tensors needs its attention.")
        qkv = qkv_send.new_empty((C, B, P * Sl, Nl, D))
        self._all_to_all([(qkv_send[p, i, b], qkv[i, b, p * Sl:(p + 1) * Sl], p)
                          for p in range(P) for i in range(C) for b in range(B)])
        if attention is None:
            q, k, v = qkv.transpose(2, 3).unbind(0)  # [B, Nl, Sp, D] views over [B, Sp, Nl, D]
            # Padding rows (sp not dividing the sequence) must get no weight as keys. Leaving them out of k/v is that
            # attention exactly, and keeps the fused kernels: a boolean mask would send SDPA to a slower one.
            k, v = k[:, :, :self.seq_len], v[:, :, :self.seq_len]
            out_BSND = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).contiguous()  # no-op for the fused
            # kernels, which write [B, Sp, Nl, D]
        else:
            # The real rows only (an FP8 attention kernel takes q and k/v of one length); padding rows' outputs are
            # zeros, dropped after the last block.
            real = (t[:, :self.seq_len].contiguous() for t in qkv.unbind(0))  # no copy at B = 1
            out_BSND = F.pad(attention(*real), (0, 0, 0, 0, 0, P * Sl - self.seq_len))
        out = qkv_send.new_empty((P, B, Sl, Nl, D))
        self._all_to_all([(out_BSND[b, p * Sl:(p + 1) * Sl], out[p, b], p) for p in range(P) for b in range(B)])
        return out


class UlyssesAttention:
    """The eager block's `attn_fn` under sequence parallelism: [B, Sl, N, D] q/k/v in, [B, Sl, N, D] out."""

    def __init__(self, exchange: UlyssesExchange, core: AttentionFn | None = None):
        """`core`: the attention over every real row of this rank's heads, after the exchange (None: SDPA); one
        whose `layer(i)` differs by block (VSA) makes this attention's `layer(i)` do too."""
        self.exchange, self.core = exchange, core

    def __call__(self, *tensors_BSND: torch.Tensor) -> torch.Tensor:
        """q, k, v [B, Sl, N, D] (and a VSA block's gate) -> [B, Sl, N, D]."""
        return from_head_groups(self.exchange(to_head_groups(*tensors_BSND, sp=self.exchange.sp), self.core))

    def layer(self, i: int) -> "UlyssesAttention":
        """Main block i's attention: the exchange around the core's `layer(i)` (models/dit.py layer_attention)."""
        return UlyssesAttention(self.exchange, layer_attention(self.core, i))


class RowShard:
    """This rank's rows of a packed sequence padded to a multiple of sp, and the gather that undoes it."""

    def __init__(self, group, seq_len: int):
        self.group, self.sp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.seq_len, self.padded = seq_len, padded_length(seq_len, self.sp)
        local = self.padded // self.sp
        self.rows = slice(self.rank * local, (self.rank + 1) * local)
        self.live_rows = max(0, min(local, seq_len - self.rank * local))  # my leading rows that are not padding

    def local(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Pad `t` along its row dimension `dim` with zeros and keep my rows (contiguous: compiled segments need it)."""
        pad = self.padded - self.seq_len
        if pad:
            t = F.pad(t, (0, 0) * (t.dim() - 1 - dim) + (0, pad))
        return t[(slice(None),) * dim + (self.rows,)].contiguous()

    def gather(self, x_BSlH: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, padding dropped: [B, S, H] on every rank."""
        parts = [torch.empty_like(x_BSlH) for _ in range(self.sp)]
        dist.all_gather(parts, x_BSlH.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)[:, : self.seq_len]

    def attention(self, core: AttentionFn | None = None) -> UlyssesAttention:
        """The eager block's `attn_fn` over these rows: to_head_groups, the exchange (`core` after it: each rank's
        heads over every row; None: SDPA), from_head_groups."""
        return UlyssesAttention(self.exchange(), core)

    def exchange(self) -> UlyssesExchange:
        """The exchange alone, for compiled halves that bake to_head_groups / from_head_groups in."""
        return UlyssesExchange(self.group, self.seq_len, self.padded)


@torch.no_grad()
def forward_sp(model: H3DiT, group, video, audio, text, unique_t, t_index, layout: PackedLayout,
               extras: EvalExtras = NO_EXTRAS):
    """One DiT evaluation with the block stack sharded over `group`; every rank returns the full outputs. Embed and
    the heads run on every rank (cheap next to the blocks; the sampler then updates the same latents everywhere), the
    blocks on this rank's rows (models/block_stack.py). `extras` (models/runner.py): a step cache decides on values
    all ranks share (models/step_cache.py), so every rank skips the same blocks; in a sparse evaluation each rank
    routes its own heads after the exchange (models/sparse/run.py); adapters run on each rank's rows."""
    sp = dist.get_world_size(group)
    if model.cfg.num_heads % sp:
        raise ValueError(f"sp={sp} does not divide the {model.cfg.num_heads} heads.")
    shard = RowShard(group, layout.seq_len)
    sparse = extras.sparse
    if model.cfg.vsa_gate:  # a FastH3-VSA model: its request's VSA on each rank's heads, every evaluation
        core = vsa_call(sparse, layout, sdpa_attention)
    else:
        core = sparse.attention(layout) if sparse is not None else None
    return model(video, audio, text, unique_t, t_index, layout.token_tags, layout.position_ids, layout.video_index,
                 layout.audio_index, layout.text_index, attn_fn=shard.attention(core), cache=extras.cache,
                 shard=shard, adapters=extras.adapters)


class UlyssesDiT:
    """The eager DiT with its block stack sharded over `group`, under the runner contract (models/runner.py);
    `caps` as EagerDiT's."""

    def __init__(self, model: H3DiT, group, sparse_kernel: str | None = None, vsa: VsaServing | None = None,
                 sparse_problem: str | None = None):
        self.model, self.cfg, self.group = model, model.cfg, group
        self.caps = RunnerCaps(sparse_kernel, sparse_problem, vsa=vsa)

    def __call__(self, video, audio, text, unique_t, t_index, layout: PackedLayout, extras: EvalExtras = NO_EXTRAS):
        return forward_sp(self.model, self.group, video, audio, text, unique_t, t_index, layout, extras)
