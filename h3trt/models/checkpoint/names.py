"""The two naming schemes of MiniMax-H3 transformer checkpoints, and the map between them (checkpoint/reader.py reads
them, checkpoint/writer.py writes them):
- native: the official release's (sglang's) tensor names and config.json fields, `_class_name` NATIVE_CLASS; the
  Comfy single file holds the same names under COMFY_PREFIX;
- diffusers: `MiniMaxH3Transformer3DModel`'s names (DIFFUSERS_CLASS), mapped to native ones by `native_name`.
"""

from __future__ import annotations

import re

from ..config import H3Config

NATIVE_CLASS = "MiniMaxH3DiTModel"
DIFFUSERS_CLASS = "MiniMaxH3Transformer3DModel"
COMFY_PREFIX = "model.diffusion_model."

# config.json field names of the official (sglang-native) transformer config -> H3Config fields.
NATIVE_CONFIG_FIELDS = {
    "num_layers": "num_layers",
    "token_refiner_num_layers": "num_refiner_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_heads",
    "attention_head_dim": "head_dim",
    "ffn_hidden_size": "ffn_dim",
    "latents_dim": "in_channels",
    "audio_latents_dim": "audio_in_channels",
    "patch_size": "patch_size",
    "text_dim": "text_dim",
    "timestep_input_dim": "freq_dim",
    "time_embed_hidden_size": "time_embed_hidden_dim",
    "time_embed_dim": "time_embed_dim",
    "rope_inv_freq_len": "rope_freq_dim",
    "rope_theta": "rope_theta",
    "norm_eps": "norm_eps",
}

# diffusers name -> native name, applied in order to the whole key.
_DIFFUSERS_TO_NATIVE = [
    (r"^proj_in\.", "video_patch_proj."),
    (r"^audio_proj_in\.", "audio_patch_proj."),
    (r"^context_embedder\.", "condition_proj."),
    (r"^time_embedder\.linear_1\.", "time_embedder.proj_in."),
    (r"^time_embedder\.linear_2\.", "time_embedder.proj_out."),
    (r"^transformer_blocks\.", "blocks."),
    (r"^token_refiner\.refiner_blocks\.", "token_refiner.blocks."),
    (r"\.attn\.norm_q\.", ".attn.q_norm."),
    (r"\.attn\.norm_k\.", ".attn.k_norm."),
    (r"\.attn\.to_out\.0\.", ".attn.out_proj."),
    (r"\.ff\.net\.0\.proj\.", ".mlp.fc1."),
    (r"\.ff\.net\.2\.", ".mlp.fc2."),
    (r"^norm_out\.norm\.", "final_layer.norm."),
    (r"^norm_out\.linear\.", "final_layer.adaln_proj.linear."),
    (r"^proj_out\.", "final_layer.video_out."),
    (r"^audio_proj_out\.", "final_layer.audio_out."),
]


def native_name(diffusers_name: str) -> str:
    for pattern, repl in _DIFFUSERS_TO_NATIVE:
        diffusers_name = re.sub(pattern, repl, diffusers_name)
    return diffusers_name


def to_native_config(cfg: H3Config) -> dict:
    data = {theirs: getattr(cfg, ours) for theirs, ours in NATIVE_CONFIG_FIELDS.items()}
    data["patch_size"] = list(cfg.patch_size)
    data.update(qk_norm_eps=cfg.norm_eps, final_norm_eps=cfg.norm_eps, adaln_out_features=cfg.modulation_dim,
                final_adaln_out_features=2 * cfg.hidden_size)
    return {"_class_name": NATIVE_CLASS, **data}
