"""The MiniMax-H3 DiT dimensions: one frozen dataclass, full size by default, `H3Config.tiny()` for tests.

Every field is a checkpoint contract: the defaults are the released model's (sglang `MiniMaxH3DiTArchConfig`,
diffusers `MiniMaxH3Transformer3DModel.__init__`; see shared/docs/h3_reference.md section 2.1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Per-row modality tags. They index the AdaLN table (row = timestep_index * 3 + tag), so they are a checkpoint contract.
VIDEO_TAG = 0
TEXT_TAG = 1
AUDIO_TAG = 2
NUM_MODALITIES = 3

# Six modulation vectors per (timestep, modality) row, in the checkpoint's order.
NUM_MODULATION_PARAMS = 6


@dataclass(frozen=True)
class H3Config:
    """Dimensions of the H3 denoiser."""

    num_layers: int = 50  # main transformer blocks
    num_refiner_layers: int = 2  # plain pre-norm blocks over the text rows only
    hidden_size: int = 5376  # residual stream width
    num_heads: int = 56  # attention heads (full MHA)
    head_dim: int = 128  # per-head width; num_heads * head_dim (7168) is wider than hidden_size
    ffn_dim: int = 14336  # SwiGLU inner width; fc1 is [gate; value], 2 * ffn_dim rows
    in_channels: int = 24  # video latent channels
    audio_in_channels: int = 32  # audio latent channels (one row = one latent, no patching)
    patch_size: tuple[int, int, int] = (1, 2, 2)  # (t, h, w) video patch
    text_dim: int = 5120  # text-encoder hidden size (Qwen3-VL-32B)
    freq_dim: int = 256  # sinusoidal timestep embedding width
    time_embed_hidden_dim: int = 5376  # time MLP inner width
    time_embed_dim: int = 2688  # time MLP output, the input of every AdaLN projection
    rope_freq_dim: int = 16  # rotary frequencies per axis; 2 * 3 * rope_freq_dim head dims are rotated
    rope_theta: float = 10000.0  # rotary base
    norm_eps: float = 1e-5  # epsilon of every RMSNorm
    # FastH3-VSA: every main block carries `attn.to_gate_compress` (hidden -> heads * head_dim, no bias), the gate of
    # VSA's coarse branch, and its attention is VSA (models/vsa/routing.py). Not in the base release; the tensors say
    # so.
    vsa_gate: bool = False

    def __post_init__(self):
        rotary = 2 * 3 * self.rope_freq_dim
        if rotary > self.head_dim:
            raise ValueError(
                f"rope_freq_dim {self.rope_freq_dim} rotates 2 * 3 * {self.rope_freq_dim} = {rotary} head dims, "
                f"more than head_dim {self.head_dim}."
            )
        if len(self.patch_size) != 3 or any(p < 1 for p in self.patch_size):
            raise ValueError(f"patch_size must be three positive ints (t, h, w), got {self.patch_size}.")
        for name in ("num_layers", "hidden_size", "num_heads", "head_dim", "ffn_dim", "text_dim", "freq_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim must be even (cos and sin halves), got {self.freq_dim}.")

    @property
    def inner_dim(self) -> int:
        """Attention width: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Leading head dims that RoPE rotates (96 of 128 at full size)."""
        return 2 * 3 * self.rope_freq_dim

    @property
    def video_patch_dim(self) -> int:
        """Width of one packed video row: channels * prod(patch)."""
        t, h, w = self.patch_size
        return self.in_channels * t * h * w

    @property
    def modulation_dim(self) -> int:
        """Output width of one block's adaln_proj: 3 modalities x 6 vectors x hidden."""
        return NUM_MODALITIES * NUM_MODULATION_PARAMS * self.hidden_size

    @classmethod
    def tiny(cls, **overrides) -> "H3Config":
        """A few-kilobyte model with the same structure: used by tests and the embedded default."""
        fields = dict(
            num_layers=2,
            num_refiner_layers=2,
            hidden_size=64,
            num_heads=2,
            head_dim=32,
            ffn_dim=96,
            text_dim=48,
            freq_dim=32,
            time_embed_hidden_dim=64,
            time_embed_dim=32,
            rope_freq_dim=4,
        )
        fields.update(overrides)
        return cls(**fields)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "H3Config":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown H3Config fields {unknown}; known fields are {sorted(known)}.")
        data = dict(data)
        if "patch_size" in data:
            data["patch_size"] = tuple(data["patch_size"])
        return cls(**data)

    def to_diffusers_kwargs(self) -> dict:
        """The same dimensions under diffusers' `MiniMaxH3Transformer3DModel` argument names."""
        return dict(
            num_attention_heads=self.num_heads,
            attention_head_dim=self.head_dim,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_refiner_layers=self.num_refiner_layers,
            ffn_dim=self.ffn_dim,
            in_channels=self.in_channels,
            audio_in_channels=self.audio_in_channels,
            patch_size=tuple(self.patch_size),
            text_dim=self.text_dim,
            freq_dim=self.freq_dim,
            time_embed_hidden_dim=self.time_embed_hidden_dim,
            time_embed_dim=self.time_embed_dim,
            rope_freq_dim=self.rope_freq_dim,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
            qk_norm_eps=self.norm_eps,
            final_norm_eps=self.norm_eps,
        )

    @classmethod
    def from_diffusers_config(cls, config: dict) -> "H3Config":
        """Read a diffusers `transformer/config.json` (extra `_`-prefixed keys ignored)."""
        eps = {config.get(k, 1e-5) for k in ("norm_eps", "qk_norm_eps", "final_norm_eps")}
        if len(eps) != 1:
            raise ValueError(f"h3trt uses one epsilon for every RMSNorm; this config has {sorted(eps)}.")
        mapping = dict(
            num_heads="num_attention_heads",
            head_dim="attention_head_dim",
            hidden_size="hidden_size",
            num_layers="num_layers",
            num_refiner_layers="num_refiner_layers",
            ffn_dim="ffn_dim",
            in_channels="in_channels",
            audio_in_channels="audio_in_channels",
            patch_size="patch_size",
            text_dim="text_dim",
            freq_dim="freq_dim",
            time_embed_hidden_dim="time_embed_hidden_dim",
            time_embed_dim="time_embed_dim",
            rope_freq_dim="rope_freq_dim",
            rope_theta="rope_theta",
        )
        fields = {ours: config[theirs] for ours, theirs in mapping.items() if theirs in config}
        fields["norm_eps"] = eps.pop()
        return cls.from_dict(fields)
