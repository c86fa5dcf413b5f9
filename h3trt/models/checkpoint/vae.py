"""Loading (and writing, for tests and the tiny default) the two H3 VAEs in the official partition layout.

Official partition (facts: diffusers `scripts/convert_minimax_h3_to_diffusers.py`, VideoX-Fun, sglang loaders):
  video_vae/config.json             latents_mean/std (24), vae_clip_length, vae_token_drop, vae_tile_size,
                                    vae_tile_overlap_min, source_path ("source"), source_safetensors_path
  video_vae/source/model.safetensors  native names: encoder.down.L.block.j.*, decoder.x_embedder, fused per-head
                                    interleaved attn.to_qkv (weight and bias), ff.w1 = [gate; up], decoder.mask_token
  audio_vae/metadata.json           {"metadata": {"kwargs": {encoder_dim, encoder_rates, latent_dim, decoder_dim,
                                    decoder_rates, sample_rate, vae_latent_channels, ...}}}
  audio_vae/config.json             latents_mean/std (32), latent_channels, sample_rate
  audio_vae/model.safetensors       names identical to diffusers' AutoencoderKLMiniMaxH3Audio (weight_g / weight_v)
A diffusers layout (`vae/`, `audio_vae/` with diffusers configs) loads through diffusers' `from_pretrained`.

The video VAE's architecture is the released one (RELEASED_VIDEO_VAE) with widths and depths read from the tensor
shapes, so a smaller test VAE in the same layout loads through the same code.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..audio_vae import AudioVAE
from ..vae_precision import place
from ..video_vae import TILE_OVERLAP_PX, TILE_PX, VideoVAE
from ..weight_layout import deinterleave_qkv, interleave_qkv, swap_halves
from .reader import DAMAGED_FILE_FIX, CheckpointError, check_state_dict

RELEASED_VIDEO_VAE = dict(
    block_out_channels=(128, 256, 256, 512, 512, 1024), layers_per_block=2,
    spatial_downsample_factors=(2, 2, 2, 2, 1, 1), temporal_downsample_factors=(1, 2, 2, 1, 1, 1),
    norm_num_groups=32, norm_eps=1e-6, latent_channels=24, decoder_num_layers=36, decoder_num_attention_heads=32,
    decoder_attention_head_dim=64, decoder_num_register_tokens=4, decoder_ffn_mult=4, decoder_rope_theta=100.0,
    decoder_rope_dim_ratio=0.75, decoder_norm_eps=1e-5, clip_length=17, token_drop=3,
)
VIDEO_VAE_HEAD_DIM = 64  # not recoverable from shapes (to_qkv is [3 * dim, dim]); a release constant
VIDEO_VAE_DROPPED = ("decoder.mask_token",)  # a training-only token the decoder never reads


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise CheckpointError(f"{path} is missing.")
    try:
        return load_file(str(path))
    except Exception as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}); {DAMAGED_FILE_FIX}.") from None


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"{path} is missing.")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}).") from None


# ----------------------------------------------------------------------------------------------------------------------
# Video VAE


# Native -> diffusers name pieces of the video VAE (diffusers' conversion script); applied reversed to write.
_ENCODER_PIECES = (("block.", "resnets."), ("nin_shortcut.", "conv_shortcut."), ("downsample.", "downsamplers.0."))
_DECODER_PIECES = (("decoder.x_embedder.", "decoder.proj_in."), (".attn.to_out.", ".attn.to_out.0."),
                   (".ff.w1.", ".ff.net.0.proj."), (".ff.w2.", ".ff.net.2."))


def _rename_video_vae_key(key: str, to_diffusers: bool) -> str:
    level_native, level_diffusers = r"^encoder\.down\.(\d+)\.(.*)$", r"^encoder\.down_blocks\.(\d+)\.(.*)$"
    m = re.match(level_native if to_diffusers else level_diffusers, key)
    if m:
        rest = m.group(2)
        for native, diffusers in _ENCODER_PIECES:
            rest = rest.replace(*((native, diffusers) if to_diffusers else (diffusers, native)), 1)
        key = f"encoder.{'down_blocks' if to_diffusers else 'down'}.{m.group(1)}.{rest}"
    for native, diffusers in _DECODER_PIECES:
        key = key.replace(*((native, diffusers) if to_diffusers else (diffusers, native)))
    return key


def video_vae_native_to_diffusers(native: dict[str, torch.Tensor], heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Native video-VAE names -> diffusers `AutoencoderKLMiniMaxH3` names. QKV (weight and bias) is de-interleaved
    per head and split; the SwiGLU w1 halves are swapped from [gate; up] to diffusers' [up; gate]."""
    out = {}
    for key, value in native.items():
        if key in VIDEO_VAE_DROPPED:
            continue
        new = _rename_video_vae_key(key, to_diffusers=True)
        if ".attn.to_qkv." in new:
            for part, tensor in zip("qkv", deinterleave_qkv(value, heads, head_dim).chunk(3, dim=0)):
                out[new.replace(".attn.to_qkv.", f".attn.to_{part}.")] = tensor.contiguous()
        else:
            out[new] = swap_halves(value) if ".ff.net.0.proj." in new else value
    return out


def video_vae_diffusers_to_native(state: dict[str, torch.Tensor], heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Inverse of `video_vae_native_to_diffusers` (writes official-layout test checkpoints)."""
    out, qkv = {}, {}
    for key, value in state.items():
        m = re.match(r"^(.*)\.attn\.to_([qkv])\.(weight|bias)$", key)
        if m:
            qkv.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = value
            continue
        out[_rename_video_vae_key(key, to_diffusers=False)] = swap_halves(value) if ".ff.net.0.proj." in key else value
    for (prefix, kind), parts in qkv.items():
        stacked = torch.cat([parts["q"], parts["k"], parts["v"]])
        out[f"{prefix}.attn.to_qkv.{kind}"] = interleave_qkv(stacked, heads, head_dim).contiguous()
    out["decoder.mask_token"] = torch.zeros(1, 1, state["decoder.proj_in.weight"].shape[0])
    return out


def _video_vae_kwargs(native: dict[str, torch.Tensor], config: dict) -> dict:
    """The released architecture with widths and depths read from the tensors."""
    levels = sorted({int(k.split(".")[2]) for k in native if k.startswith("encoder.down.")})
    try:
        channels = tuple(native[f"encoder.down.{level}.block.0.conv1.weight"].shape[0] for level in levels)
        dim = native["decoder.x_embedder.weight"].shape[0]
        layers = 1 + max(int(k.split(".")[2]) for k in native if k.startswith("decoder.transformer_blocks."))
        ffn = native["decoder.transformer_blocks.0.ff.w2.weight"].shape[1]
    except (KeyError, ValueError, IndexError) as e:
        raise CheckpointError(f"video_vae/source/model.safetensors is not an H3 video VAE ({e!r}).") from None
    kwargs = dict(RELEASED_VIDEO_VAE)
    kwargs.update(block_out_channels=channels, decoder_num_layers=layers, decoder_ffn_mult=ffn // dim,
                  decoder_num_attention_heads=dim // VIDEO_VAE_HEAD_DIM,
                  clip_length=int(config.get("vae_clip_length", 17)), token_drop=int(config.get("vae_token_drop", 3)),
                  latents_mean=tuple(config["latents_mean"]), latents_std=tuple(config["latents_std"]))
    return kwargs


def load_video_vae(component_root: Path, device="cpu", dtype=torch.float32) -> VideoVAE:
    """The video VAE of an official partition (`video_vae/`) or a diffusers root (`vae/`), its tensors placed as
    diffusers' `from_pretrained(torch_dtype=dtype)` places them (h3trt/models/vae_precision.py). The FP8 decoder is
    this at bf16 plus h3trt/calibration/vae_fp8.py."""
    from diffusers import AutoencoderKLMiniMaxH3  # diffusers: seconds to import, needed only when a VAE loads

    component_root = Path(component_root)
    if (component_root / "video_vae").is_dir():
        folder = component_root / "video_vae"
        config = _read_json(folder / "config.json")
        for key in ("latents_mean", "latents_std"):
            if key not in config:
                raise CheckpointError(f"{folder / 'config.json'} has no {key}.")
        source = folder / config.get("source_path", "source") / config.get("source_safetensors_path", "model.safetensors")
        native = _load_safetensors(source)
        kwargs = _video_vae_kwargs(native, config)
        with torch.device("meta"):
            vae = AutoencoderKLMiniMaxH3(**kwargs)
        state = video_vae_native_to_diffusers(native, kwargs["decoder_num_attention_heads"], VIDEO_VAE_HEAD_DIM)
        _load_strict(vae, state, source)
        vae.enable_tiling(int(config.get("vae_tile_size", TILE_PX)), int(config.get("vae_tile_size", TILE_PX)),
                          int(config.get("vae_tile_overlap_min", TILE_OVERLAP_PX)),
                          int(config.get("vae_tile_overlap_min", TILE_OVERLAP_PX)))
    elif (component_root / "vae").is_dir():
        vae = AutoencoderKLMiniMaxH3.from_pretrained(str(component_root / "vae"), local_files_only=True)
    else:
        raise CheckpointError(f"{component_root} has neither video_vae/ (official layout) nor vae/ (diffusers layout).")
    return VideoVAE(place(vae, device, dtype), vae.config.latents_mean, vae.config.latents_std)


def _load_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], where: Path) -> None:
    """Strict assign-load of a meta-built diffusers video VAE, then rebuild its one non-persistent buffer."""
    check_state_dict(model, state, str(where))
    model.load_state_dict(state, strict=True, assign=True)
    cfg = model.config
    rope_dim = int(cfg.decoder_attention_head_dim * cfg.decoder_rope_dim_ratio)
    model.decoder.rope = type(model.decoder.rope)(rope_dim, theta=cfg.decoder_rope_theta)


# ----------------------------------------------------------------------------------------------------------------------
# Audio VAE


def audio_vae_kwargs(metadata_kwargs: dict, config: dict) -> dict:
    """diffusers `AutoencoderKLMiniMaxH3Audio` kwargs from the official metadata.json kwargs and config.json."""
    try:
        rates = [int(r) for r in metadata_kwargs["decoder_rates"]]
        kwargs = dict(
            encoder_dim=int(metadata_kwargs["encoder_dim"]), encoder_rates=tuple(metadata_kwargs["encoder_rates"]),
            latent_dim=int(metadata_kwargs["latent_dim"]), latent_channels=int(metadata_kwargs["vae_latent_channels"]),
            decoder_dim=int(metadata_kwargs["decoder_dim"]), decoder_rates=tuple(rates),
            decoder_kernel_sizes=tuple(2 * r - (r % 2) for r in rates), num_attention_heads=8,
            resblock_kernel_sizes=(3, 7, 11), resblock_dilation_sizes=((1, 3, 5),) * 3,
            sampling_rate=int(metadata_kwargs["sample_rate"]),
            latents_mean=list(config["latents_mean"]), latents_std=list(config["latents_std"]),
        )
    except KeyError as e:
        raise CheckpointError(f"audio_vae metadata.json / config.json lacks {e}.") from None
    for key, ours in (("latent_channels", kwargs["latent_channels"]), ("sample_rate", kwargs["sampling_rate"])):
        if key in config and int(config[key]) != ours:
            raise CheckpointError(f"audio_vae/config.json {key}={config[key]} disagrees with metadata.json ({ours}).")
    return kwargs


@contextlib.contextmanager
def weight_norm_quietly():
    """Construct diffusers' audio VAE without torch's FutureWarning about `torch.nn.utils.weight_norm`: the call is
    diffusers' (its checkpoints use the weight_g / weight_v names of that API), not the user's to act on, and it
    was printed on every run. Only that warning is filtered, only while the module is built."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.nn\.utils\.weight_norm` is deprecated",
                                category=FutureWarning)
        yield


def load_audio_vae(component_root: Path, device="cpu", dtype=torch.float32) -> AudioVAE:
    """The audio VAE of an official partition (metadata.json + config.json + model.safetensors) or a diffusers one.
    fp32 by default: the released decoder is audibly worse in bf16."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    folder = Path(component_root) / "audio_vae"
    if (folder / "metadata.json").exists():
        meta = _read_json(folder / "metadata.json")
        kwargs = audio_vae_kwargs(meta.get("metadata", {}).get("kwargs", {}), _read_json(folder / "config.json"))
        with weight_norm_quietly():
            vae = AutoencoderKLMiniMaxH3Audio(**kwargs)  # small (~0.3 GB); weight_norm needs real tensors to build
        state = _load_safetensors(folder / "model.safetensors")
        check_state_dict(vae, state, str(folder / "model.safetensors"))
        vae.load_state_dict(state, strict=True)
    elif (folder / "config.json").exists():
        with weight_norm_quietly():
            vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(str(folder), local_files_only=True)
    else:
        raise CheckpointError(f"{folder} is missing (expected metadata.json, config.json and model.safetensors).")
    return AudioVAE(place(vae, device, dtype), vae.config.latents_mean, vae.config.latents_std)


# ----------------------------------------------------------------------------------------------------------------------
# Writers (official layout)


def video_vae_files(vae, tile_px: int = TILE_PX,
                    tile_overlap_px: int = TILE_OVERLAP_PX) -> tuple[dict[str, torch.Tensor], dict]:
    """What an official partition's video_vae/ holds for a diffusers `AutoencoderKLMiniMaxH3`: the native tensors of
    source/model.safetensors (on the VAE's device) and config.json."""
    cfg = vae.config
    native = video_vae_diffusers_to_native({k: v.contiguous() for k, v in vae.state_dict().items()},
                                           cfg.decoder_num_attention_heads, cfg.decoder_attention_head_dim)
    config = {
        "_class_name": "MiniMaxH3VideoVAE", "latent_channels": cfg.latent_channels,
        "latents_mean": list(cfg.latents_mean), "latents_std": list(cfg.latents_std),
        "source_path": "source", "source_safetensors_path": "model.safetensors",
        "vae_clip_length": cfg.clip_length, "vae_token_drop": cfg.token_drop,
        "vae_tile_size": tile_px, "vae_tile_overlap_min": tile_overlap_px,
    }
    return native, config


def save_video_vae(component_root: Path, vae, tile_px: int = TILE_PX, tile_overlap_px: int = TILE_OVERLAP_PX) -> None:
    folder = Path(component_root) / "video_vae"
    (folder / "source").mkdir(parents=True, exist_ok=True)
    native, config = video_vae_files(vae, tile_px, tile_overlap_px)
    save_file(native, str(folder / "source" / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def save_audio_vae(component_root: Path, vae) -> None:
    folder = Path(component_root) / "audio_vae"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = vae.config
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(folder / "model.safetensors"))
    kwargs = {"attn_proj": True, "decoder_dim": cfg.decoder_dim, "decoder_rates": list(cfg.decoder_rates),
              "decoder_type": "bigvgan", "encoder_dim": cfg.encoder_dim, "encoder_rates": list(cfg.encoder_rates),
              "latent_dim": cfg.latent_dim, "sample_rate": cfg.sampling_rate,
              "vae_latent_channels": cfg.latent_channels}
    (folder / "metadata.json").write_text(json.dumps({"metadata": {"kwargs": kwargs}}, indent=1))
    (folder / "config.json").write_text(json.dumps({
        "_class_name": "MiniMaxH3AudioVAE", "latent_channels": cfg.latent_channels, "sample_rate": cfg.sampling_rate,
        "output_channel": 2, "source_safetensors_path": "model.safetensors", "source_metadata_path": "metadata.json",
        "latents_mean": list(cfg.latents_mean), "latents_std": list(cfg.latents_std),
    }, indent=1))
