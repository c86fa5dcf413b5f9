"""The MiniMax-H3 denoiser in plain PyTorch, split into the three segments the engine compiles.

Module names are the checkpoint's native names (h3_reference.md section 3.1), so a native state dict loads with no
renaming; `qkv_proj` holds `[q; k; v]` (the loader de-interleaves official shards) and `mlp.fc1` holds `[gate; value]`.

Segments (each callable alone; `forward` is exactly embed -> blocks -> final):
  embed:  patch/condition projections, token refiner, scatter into the packed buffer, time MLP
  block:  one main block, given its modulation table (so a baked table can replace `adaln_proj`)
  final:  modulated final norm and the two fp32 output heads on the video and audio rows

Shape legend: B batch, S packed rows, H hidden, N heads, D head dim, R rotary dims, T distinct timesteps,
M = 3 * T modulation rows, V/A/L video/audio/text rows, C row channels, E time_embed_dim.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import NUM_MODALITIES, NUM_MODULATION_PARAMS, H3Config
from .block_stack import RowSharding, run_block_stack
from .runner import NO_EXTRAS, BlockAdapters, DiTAdapters, EvalExtras, RunnerCaps
from .step_cache import CacheContext
from .vsa.plan import VsaServing, vsa_call

# Prefixes whose weights the released checkpoint stores in float32 (VideoX-Fun MINIMAX_H3_FP32_SOURCE_PREFIXES);
# everything else is bfloat16, AdaLN included.
FP32_PREFIXES = (
    "video_patch_proj.",
    "audio_patch_proj.",
    "time_embedder.",
    "final_layer.video_out.",
    "final_layer.audio_out.",
)

# Parameter-name prefixes the segments, the bundle's weight files and the size estimates split the model by: the embed
# segment's modules, and the modulation projections (`adaln_proj`) a baked bundle leaves out.
EMBED_PREFIXES = ("video_patch_proj.", "audio_patch_proj.", "condition_proj.", "time_embedder.", "token_refiner.")
ADALN_PREFIX = "adaln_proj."

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def project(linear: nn.Module, x: torch.Tensor, name: str, adapters: BlockAdapters | None) -> torch.Tensor:
    """`linear(x)`, or with adapters `adapters(name, linear, x)`; the branch is Python, decided before any compiled code
    runs, so a block without adapters is the same ops as one that never heard of them."""
    return linear(x) if adapters is None else adapters(name, linear, x)


def sdpa_attention(q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor) -> torch.Tensor:
    """Full non-causal attention over one packed document. Returns [B, S, N, D]."""
    out_BNSD = F.scaled_dot_product_attention(q_BSND.transpose(1, 2), k_BSND.transpose(1, 2), v_BSND.transpose(1, 2))
    return out_BNSD.transpose(1, 2)


def layer_attention(attn_fn, i: int):
    """Main block i's attention core: `attn_fn.layer(i)` where the attention differs by block (VSA: its dense
    layers, models/vsa/plan.py), else `attn_fn` itself."""
    layer = getattr(attn_fn, "layer", None)
    return layer(i) if layer is not None else attn_fn


def apply_rope(x_BSND: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """NeoX (rotate-half) rotation of the leading R head dims of x [B, S, N, D] by cos/sin [S, R] (fp32, cast to x's
    dtype); the rest pass through. Returns [B, S, N, D]."""
    rotary = cos_SR.shape[-1]
    x_rot, x_pass = x_BSND[..., :rotary], x_BSND[..., rotary:]
    cos = cos_SR.to(x_BSND.dtype)[None, :, None, :]
    sin = sin_SR.to(x_BSND.dtype)[None, :, None, :]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def rope_inv_freq(cfg: H3Config) -> torch.Tensor:
    """The F = cfg.rope_freq_dim rotary frequencies [F] fp32 (16 at full size), shared by the t, h and w axes."""
    f = cfg.rope_freq_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, 2 * f, 2, dtype=torch.float32) / (2 * f)))


def rope_tables(position_ids_S3: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [S, 6F] fp32 for (t, h, w) positions [S, 3] and inv_freq [F]. Positions are cast to fp32 before the
    multiply, as the reference."""
    freqs_S3F = position_ids_S3.to(torch.float32)[..., None] * inv_freq.view(1, 1, -1)
    freqs_S3F = freqs_S3F.flatten(1)  # t | h | w
    freqs = torch.cat((freqs_S3F, freqs_S3F), dim=-1)
    return freqs.cos(), freqs.sin()


def timestep_sinusoid(timesteps_T: torch.Tensor, freq_dim: int) -> torch.Tensor:
    """[cos | sin] embedding of unscaled t in [0, 1] (diffusers Timesteps(flip_sin_to_cos=True, shift=0))."""
    half = freq_dim // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timesteps_T.device) / half
    args = timesteps_T[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: H3Config, gate: bool = False):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.inner_dim, bias=False)  # rows [q; k; v]
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.inner_dim, cfg.hidden_size, bias=False)
        # `gate`: a FastH3-VSA main block's VSA coarse-branch gate (no bias, no activation; Block.pre_attention)
        self.to_gate_compress = nn.Linear(cfg.hidden_size, cfg.inner_dim, bias=False) if gate else None

    def qkv(self, x_BSH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
            adapters: BlockAdapters | None = None):
        """x [B, S, H] -> q, k, v [B, S, N, D]: project, per-head QK RMSNorm, then RoPE with `rope` (cos, sin) [S, R]
        (the norm comes first, as in the checkpoint's training code; None: no rotation, the refiner's). `adapters`: the
        owning block's adapters (its linears named from the block: "attn.qkv_proj")."""
        B, S, _ = x_BSH.shape
        qkv = project(self.qkv_proj, x_BSH, "attn.qkv_proj", adapters)
        q, k, v = qkv.view(B, S, 3, self.num_heads, self.head_dim).unbind(2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def forward(self, x_BSH, rope=None, attn_fn: AttentionFn = sdpa_attention):
        """Self-attention over x [B, S, H] -> [B, S, H]; `attn_fn` the core over [B, S, N, D] q/k/v."""
        q, k, v = self.qkv(x_BSH, rope)
        out_BSND = attn_fn(q, k, v)
        return self.out_proj(out_BSND.flatten(2).to(x_BSH.dtype))


class SwiGLU(nn.Module):
    def __init__(self, cfg: H3Config):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_dim, bias=False)  # rows [gate; value]
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.hidden_size, bias=False)

    def forward(self, x, adapters: BlockAdapters | None = None):
        """x [..., H] -> [..., H]; `adapters`: the owning block's adapters (its linears "mlp.fc1", "mlp.fc2")."""
        gate, value = project(self.fc1, x, "mlp.fc1", adapters).chunk(2, dim=-1)
        return project(self.fc2, value * F.silu(gate), "mlp.fc2", adapters)


class RefinerBlock(nn.Module):
    """Plain pre-norm block over the text rows: no AdaLN, no RoPE."""

    def __init__(self, cfg: H3Config):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x_BLH):
        """Text rows [B, L, H] -> [B, L, H]."""
        x_BLH = x_BLH + self.attn(self.norm1(x_BLH))
        return x_BLH + self.mlp(self.norm2(x_BLH))


class TokenRefiner(nn.Module):
    def __init__(self, cfg: H3Config):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(cfg) for _ in range(cfg.num_refiner_layers))
        self.final_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(self, x_BLH):
        """Projected text rows [B, L, H] -> refined [B, L, H]."""
        for block in self.blocks:
            x_BLH = block(x_BLH)
        return self.final_norm(x_BLH)


class TimeEmbedder(nn.Module):
    def __init__(self, cfg: H3Config):
        super().__init__()
        self.freq_dim = cfg.freq_dim
        self.proj_in = nn.Linear(cfg.freq_dim, cfg.time_embed_hidden_dim)
        self.proj_out = nn.Linear(cfg.time_embed_hidden_dim, cfg.time_embed_dim)

    def forward(self, timesteps_T):
        """Distinct timesteps [T] -> time embedding temb [T, E] (fp32 weights: the checkpoint's precision island)."""
        emb = timestep_sinusoid(timesteps_T, self.freq_dim).to(self.proj_in.weight.dtype)
        return self.proj_out(F.silu(self.proj_in(emb)))


class AdaLNProj(nn.Module):
    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim)

    def forward(self, temb_TE, adapters: BlockAdapters | None = None):
        """temb [T, E] fp32 -> [T, out_dim] in the weights' dtype; `adapters`: the owning block's adapters (its linear
        "adaln_proj.linear")."""
        # SiLU at temb's own precision (fp32), cast after: a rounding before the activation would bias every block
        # identically at every step.
        return project(self.linear, F.silu(temb_TE).to(self.linear.weight.dtype), "adaln_proj.linear", adapters)


class Block(nn.Module):
    """One main block. Modulation row for packed row s is `adaln_index[s] = timestep_index[s] * 3 + tag[s]`."""

    def __init__(self, cfg: H3Config):
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.norm1 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg, gate=cfg.vsa_gate)
        self.norm2 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.adaln_proj = AdaLNProj(cfg.time_embed_dim, cfg.modulation_dim)

    def modulation(self, temb_TE: torch.Tensor, adapters: BlockAdapters | None = None) -> torch.Tensor:
        """The block's modulation table [M, 6, H]: row m*3+tag holds shift/scale/gate (msa), shift/scale/gate (mlp)."""
        return self.adaln_proj(temb_TE, adapters).view(-1, NUM_MODULATION_PARAMS, self.hidden_size)

    def forward(
        self,
        x_BSH: torch.Tensor,
        mod_M6H: torch.Tensor,
        adaln_index_S: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn_fn: AttentionFn = sdpa_attention,
        adapters: BlockAdapters | None = None,
    ) -> torch.Tensor:
        """x [B, S, H] -> [B, S, H], with the block's modulation table [M, 6, H], each row's table row
        adaln_index [S] and rope (cos, sin) [S, R]; `adapters`: this evaluation's adapters on the block's linears (the
        modulation table is the caller's, made with the same adapters: `modulation(temb, adapters)`). A FastH3-VSA block
        hands `attn_fn` its gate too: (q, k, v, gate)."""
        return self.post_attention(x_BSH, attn_fn(*self.pre_attention(x_BSH, mod_M6H, adaln_index_S, rope, adapters)),
                                   mod_M6H, adaln_index_S, adapters)

    # The two halves around attention: under sequence parallelism each is compiled alone and the attention between
    # them (two all-to-alls around SDPA) runs outside the compiled code.
    def pre_attention(self, x_BSH, mod_M6H, adaln_index_S, rope, adapters: BlockAdapters | None = None):
        """Modulated norm, QKV projection, QK norm and RoPE: q, k, v [B, S, N, D]; a FastH3-VSA block adds its gate
        [B, S, N, D], projected from the same modulated input (no norm, no rotation, no activation)."""
        h = self.norm1(x_BSH) * (1.0 + _mod_row(mod_M6H, 1, adaln_index_S)) + _mod_row(mod_M6H, 0, adaln_index_S)
        q, k, v = self.attn.qkv(h, rope, adapters)
        if self.attn.to_gate_compress is None:
            return q, k, v
        return q, k, v, project(self.attn.to_gate_compress, h, "attn.to_gate_compress", adapters).view(q.shape)

    def post_attention(self, x_BSH, attn_BSND, mod_M6H, adaln_index_S, adapters: BlockAdapters | None = None):
        """Output projection, gated residual, and the modulated SwiGLU half: the block's output [B, S, H]."""
        def row(param: int) -> torch.Tensor:
            return _mod_row(mod_M6H, param, adaln_index_S)

        x_BSH = x_BSH + row(2) * project(self.attn.out_proj, attn_BSND.flatten(2).to(x_BSH.dtype), "attn.out_proj",
                                         adapters)
        h = self.norm2(x_BSH) * (1.0 + row(4)) + row(3)
        return x_BSH + row(5) * self.mlp(h, adapters)


def _mod_row(mod_M6H: torch.Tensor, param: int, adaln_index_S: torch.Tensor) -> torch.Tensor:
    """Modulation parameter `param` (0-5: shift/scale/gate msa, shift/scale/gate mlp) for every row: [S, H]."""
    return mod_M6H[:, param].index_select(0, adaln_index_S)


class FinalLayer(nn.Module):
    def __init__(self, cfg: H3Config):
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.adaln_proj = AdaLNProj(cfg.time_embed_dim, 2 * cfg.hidden_size)  # rows [shift; scale]; no gate
        self.video_out = nn.Linear(cfg.hidden_size, cfg.video_patch_dim)
        self.audio_out = nn.Linear(cfg.hidden_size, cfg.audio_in_channels)

    def modulation(self, temb_TE: torch.Tensor) -> torch.Tensor:
        """[T, 2, H]: shift, scale per timestep (the final layer is not modality-indexed)."""
        return self.adaln_proj(temb_TE).view(-1, 2, self.hidden_size)

    def forward(self, x_BSH, mod_T2H, timestep_index_S, video_index_V, audio_index_A):
        """x [B, S, H], the table [T, 2, H] and each row's timestep index [S] -> video rows [B, V, C_video] and audio
        rows [B, A, C_audio] at the heads' dtype (fp32 in the checkpoint)."""
        shift = mod_T2H[:, 0].index_select(0, timestep_index_S)
        scale = mod_T2H[:, 1].index_select(0, timestep_index_S)
        h = (self.norm(x_BSH) * (1.0 + scale) + shift).to(self.video_out.weight.dtype)
        # The heads are per-row linears: selecting rows first gives the same values and skips the other modality.
        video_BVC = self.video_out(h.index_select(1, video_index_V))
        audio_BAC = self.audio_out(h.index_select(1, audio_index_A))
        return video_BVC, audio_BAC


class H3DiT(nn.Module):
    def __init__(self, cfg: H3Config):
        super().__init__()
        self.cfg = cfg
        self.video_patch_proj = nn.Linear(cfg.video_patch_dim, cfg.hidden_size)
        self.audio_patch_proj = nn.Linear(cfg.audio_in_channels, cfg.hidden_size)
        self.condition_proj = nn.Linear(cfg.text_dim, cfg.hidden_size)
        self.time_embedder = TimeEmbedder(cfg)
        self.token_refiner = TokenRefiner(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_layer = FinalLayer(cfg)
        # Recomputed, not loaded: the checkpoint's `rope.inv_freq` equals this and the loader checks, then drops it.
        self.register_buffer("rope_inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the packed residual stream (the block stack's dtype)."""
        return self.condition_proj.weight.dtype

    def rope(self, position_ids_S3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [S, R] fp32 for positions [S, 3] (rope_tables)."""
        return rope_tables(position_ids_S3.to(self.rope_inv_freq.device), self.rope_inv_freq)

    def embed(
        self,
        video_BVC: torch.Tensor,
        audio_BAC: torch.Tensor,
        text_BLC: torch.Tensor,
        timesteps_T: torch.Tensor,
        video_index_V: torch.Tensor,
        audio_index_A: torch.Tensor,
        text_index_L: torch.Tensor,
        seq_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed residual stream [B, S, H] in the block dtype, and the shared time embedding [T, E] in fp32."""
        video = self.video_patch_proj(video_BVC.to(self.video_patch_proj.weight.dtype))
        audio = self.audio_patch_proj(audio_BAC.to(self.audio_patch_proj.weight.dtype))
        text = self.token_refiner(self.condition_proj(text_BLC.to(self.dtype)))
        x_BSH = text.new_zeros(text.shape[0], seq_len, text.shape[-1])
        x_BSH = x_BSH.index_copy(1, text_index_L, text)
        x_BSH = x_BSH.index_copy(1, video_index_V, video.to(text.dtype))
        x_BSH = x_BSH.index_copy(1, audio_index_A, audio.to(text.dtype))
        return x_BSH, self.time_embedder(timesteps_T)

    def final(self, x_BSH, temb_TE, timestep_index_S, video_index_V, audio_index_A):
        """Velocity for the video rows [B, V, C] and audio rows [B, A, C], in fp32 at the checkpoint's precision."""
        mod = self.final_layer.modulation(temb_TE)
        return self.final_layer(x_BSH, mod, timestep_index_S, video_index_V, audio_index_A)

    def forward(
        self,
        video_BVC: torch.Tensor,
        audio_BAC: torch.Tensor,
        text_BLC: torch.Tensor,
        timesteps_T: torch.Tensor,
        timestep_index_S: torch.Tensor,
        token_tags_S: torch.Tensor,
        position_ids_S3: torch.Tensor,
        video_index_V: torch.Tensor,
        audio_index_A: torch.Tensor,
        text_index_L: torch.Tensor,
        attn_fn: AttentionFn = sdpa_attention,
        cache: CacheContext | None = None,
        shard: RowSharding | None = None,
        adapters: DiTAdapters | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One evaluation over a packed sequence: video_BVC [B, V, C] and audio_BAC [B, A, C_audio] rows (fp32,
        condition rows first), text_BLC [B, L, C_text], timesteps_T [T] distinct t in [0, 1]; the row vectors
        timestep_index_S, token_tags_S [S], position_ids_S3 [S, 3] and the row indices video_index_V, audio_index_A,
        text_index_L as in `h3trt.models.packing.PackedLayout`. Returns the velocities [B, V, C] and [B, A, C_audio]
        in fp32.

        `cache`: a step cache's state for this denoiser call (models/step_cache.py), None: every block runs.
        `shard`: this rank's rows under sequence parallelism (parallel/ulysses.py RowShard), with `attn_fn` the
        attention that exchanges them (RowShard.attention()); None: every row here.
        `adapters`: the adapters this evaluation carries on the main blocks' linears (adapters/slots.py
        `AdapterSlots.select`), the same for every batch row; None: the base model, exactly."""
        seq_len = position_ids_S3.shape[0]
        if token_tags_S.shape != (seq_len,) or timestep_index_S.shape != (seq_len,):
            raise ValueError(
                f"token_tags {tuple(token_tags_S.shape)} and timestep_index {tuple(timestep_index_S.shape)} must both "
                f"be ({seq_len},), one entry per packed row."
            )
        if self.cfg.vsa_gate and getattr(attn_fn, "layer", None) is None:
            raise ValueError("A FastH3-VSA DiT runs VSA's attention, with its gate, in every main block: pass the "
                             "evaluation's VSA attention (models/vsa/plan.py VsaRun.attention) as attn_fn.")
        if shard is not None and attn_fn is sdpa_attention:
            raise ValueError("A row shard needs the attention that exchanges rows between ranks: pass "
                             "attn_fn=shard.attention() (plain SDPA would attend over this rank's rows only).")
        # 1. Embed every modality into the packed stream; one time embedding per distinct timestep.
        x_BSH, temb_TE = self.embed(
            video_BVC, audio_BAC, text_BLC, timesteps_T, video_index_V, audio_index_A, text_index_L, seq_len
        )
        # 2. Row -> modulation-table row, and the rotary tables, shared by every block.
        adaln_index_S = timestep_index_S * NUM_MODALITIES + token_tags_S
        rope = self.rope(position_ids_S3)
        # 3. The block stack, on this rank's rows under a shard (a step cache may skip all of it, or all but block 0).
        def block_fn(i: int, x: torch.Tensor, adaln_index: torch.Tensor, rope) -> torch.Tensor:
            block_adapters = None if adapters is None else adapters.block(i)
            mod = self.blocks[i].modulation(temb_TE, block_adapters)
            return self.blocks[i](x, mod, adaln_index, rope, layer_attention(attn_fn, i), block_adapters)

        x_BSH = run_block_stack(x_BSH, len(self.blocks), block_fn, adaln_index_S, rope, cache, shard)
        # 4. Output heads on the video and audio rows.
        return self.final(x_BSH, temb_TE, timestep_index_S, video_index_V, audio_index_A)


class EagerDiT:
    """The reference DiT behind the runner contract (models/runner.py DiTRunner), as an engine bundle serves it.
    `caps`: the block-sparse attention kernel it serves (models/sparse/kernels.py, chosen and warmed at load; None:
    none, and `sparse_problem` why) and a FastH3-VSA model's settings and kernel (`vsa`: models/vsa/plan.py)."""

    def __init__(self, model: H3DiT, sparse_kernel: str | None = None, vsa: VsaServing | None = None,
                 sparse_problem: str | None = None):
        self.model, self.cfg = model, model.cfg
        self.caps = RunnerCaps(sparse_kernel, sparse_problem, vsa=vsa)

    def __call__(self, video, audio, text, unique_t, t_index, layout, extras: EvalExtras = NO_EXTRAS):
        """H3DiT.forward under the contract: `extras.sparse`'s attention (a SparseRun, or a FastH3-VSA model's VsaRun
        every evaluation) replaces the dense one, `extras.adapters` adds the request's adapters, `extras.cache`
        skips."""
        sparse = extras.sparse
        if self.cfg.vsa_gate:  # a FastH3-VSA model: its request's VsaRun, every evaluation (models/vsa/plan.py)
            attn = vsa_call(sparse, layout, sdpa_attention)
        else:
            attn = sparse.attention(layout) if sparse is not None else None
        return self.model(video, audio, text, unique_t, t_index, layout.token_tags, layout.position_ids,
                          layout.video_index, layout.audio_index, layout.text_index,
                          attn_fn=attn if attn is not None else sdpa_attention, cache=extras.cache,
                          adapters=extras.adapters)


def build_dit(cfg: H3Config, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> H3DiT:
    """The DiT with the checkpoint's precision islands: FP32_PREFIXES in float32, everything else in `dtype`.

    On device "meta" nothing is allocated; load weights with `load_state_dict(..., assign=True)`.
    """
    with torch.device(device):
        model = H3DiT(cfg)
    apply_precision(model, dtype)
    return model.eval().requires_grad_(False)


def apply_precision(model: H3DiT, dtype: torch.dtype) -> None:
    for name, param in model.named_parameters():
        target = parameter_dtype(name, dtype)
        if param.dtype != target:
            param.data = param.data.to(target)


def parameter_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the checkpoint stores a native-named parameter in, for a model whose block dtype is `dtype`."""
    return torch.float32 if name.startswith(FP32_PREFIXES) else dtype
