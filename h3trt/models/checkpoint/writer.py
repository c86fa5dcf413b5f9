"""Writing H3 transformer checkpoints in the three layouts `checkpoint/reader.py` reads.

Used by `scripts/make_fake_checkpoint.py`, the tests and the embedded tiny default: real MiniMax-H3 weights are not
available here, so checkpoints are random but laid out exactly as the official, diffusers and Comfy files are.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import H3Config
from ..dit import build_dit, parameter_dtype, rope_inv_freq
from ..sampler import DEFAULT_AUDIO_SHIFT, DEFAULT_VIDEO_SHIFT
from ..weight_layout import interleave_qkv
from .names import COMFY_PREFIX, DIFFUSERS_CLASS, to_native_config

# The official release partitions and what each serves (sglang task_profiles.py, release_metadata.py).
PARTITION_TASKS = {"FL2VA": ("fl2va", ["t2va", "fl2va"]), "Ref2VA": ("ref2va", ["ref2va"])}


def random_state_dict(cfg: H3Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random native weights in float32: fan-in scaled matrices, norms near 1, small biases.

    Drawn in sorted-name order from one CPU generator, so the same (cfg, seed) always gives the same weights.
    """
    gen = torch.Generator("cpu").manual_seed(seed)
    names = sorted(build_dit(cfg, torch.float32, device="meta").state_dict().items())
    out = {}
    for name, meta in names:
        x = torch.randn(meta.shape, generator=gen, dtype=torch.float32)
        if "norm" in name.rsplit(".", 2)[-2]:  # RMSNorm weights: norm1, q_norm, final_norm, ...
            out[name] = 1.0 + 0.1 * x
        elif meta.ndim == 1:
            out[name] = 0.02 * x
        else:
            out[name] = x / math.sqrt(meta.shape[1])
    return out


def _checkpoint_dtypes(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(parameter_dtype(k, dtype)).contiguous() for k, v in state.items()}


def _save_sharded(folder: Path, tensors: dict[str, torch.Tensor], shards: int, stem: str, index_name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    shards = max(1, min(shards, len(names)))
    if shards == 1:
        save_file({n: tensors[n] for n in names}, str(folder / f"{stem}.safetensors"))
        return
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        file = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[i * per:(i + 1) * per]
        save_file({n: tensors[n] for n in chunk}, str(folder / file))
        weight_map.update({n: file for n in chunk})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / index_name).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def official_model_index(partition: str, video_shift: float = DEFAULT_VIDEO_SHIFT,
                         audio_shift: float = DEFAULT_AUDIO_SHIFT) -> dict:
    """The model_index.json of an official partition ("FL2VA" or "Ref2VA")."""
    name, tasks = PARTITION_TASKS[partition]
    return {
        "_class_name": "MiniMaxH3Pipeline",
        "_diffusers_version": "0.36.0",
        "scheduler": None,
        "transformer": ["diffusers", "MiniMaxH3DiTModel"],
        "_minimax_h3": {"schema_version": 1, "partition": name, "tasks": tasks, "task_aliases": {},
                        "sigma_shift_scales": {"video": video_shift, "audio": audio_shift}},
    }


def save_official(root: str | Path, cfg: H3Config, states: dict[str, dict[str, torch.Tensor]],
                  dtype: torch.dtype = torch.bfloat16, shards: int = 2,
                  video_shift: float = DEFAULT_VIDEO_SHIFT, audio_shift: float = DEFAULT_AUDIO_SHIFT) -> Path:
    """`root/FL2VA` and/or `root/Ref2VA` partitions (keys of `states`), native names, QKV interleaved per head."""
    root = Path(root)
    for partition, state in states.items():
        folder = root / partition
        folder.mkdir(parents=True, exist_ok=True)
        index = official_model_index(partition, video_shift, audio_shift)
        (folder / "model_index.json").write_text(json.dumps(index, indent=1))
        tensors = dict(state)
        for key in [k for k in tensors if k.endswith(".attn.qkv_proj.weight")]:
            tensors[key] = interleave_qkv(tensors[key], cfg.num_heads, cfg.head_dim)
        tensors = _checkpoint_dtypes(tensors, dtype)
        tensors["rope.inv_freq"] = rope_inv_freq(cfg)  # stored F32 in the release
        _save_sharded(folder / "transformer", tensors, shards, "model", "model.safetensors.index.json")
        (folder / "transformer" / "config.json").write_text(json.dumps(to_native_config(cfg), indent=1))
    return root


_NATIVE_TO_DIFFUSERS = [
    ("video_patch_proj.", "proj_in."),
    ("audio_patch_proj.", "audio_proj_in."),
    ("condition_proj.", "context_embedder."),
    ("time_embedder.proj_in.", "time_embedder.linear_1."),
    ("time_embedder.proj_out.", "time_embedder.linear_2."),
    ("token_refiner.blocks.", "token_refiner.refiner_blocks."),
    ("final_layer.norm.", "norm_out.norm."),
    ("final_layer.adaln_proj.linear.", "norm_out.linear."),
    ("final_layer.video_out.", "proj_out."),
    ("final_layer.audio_out.", "audio_proj_out."),
]


def diffusers_state_dict(state: dict[str, torch.Tensor], cfg: H3Config) -> dict[str, torch.Tensor]:
    """Native names ([q; k; v], fc1 [gate; value]) -> diffusers `MiniMaxH3Transformer3DModel` names."""
    out = {}
    for key, value in state.items():
        new = key
        for old, repl in _NATIVE_TO_DIFFUSERS:
            if new.startswith(old):
                new = repl + new[len(old):]
                break
        if new.startswith("blocks."):
            new = "transformer_blocks." + new[len("blocks."):]
        new = (new.replace(".attn.q_norm.", ".attn.norm_q.").replace(".attn.k_norm.", ".attn.norm_k.")
               .replace(".attn.out_proj.", ".attn.to_out.0.").replace(".mlp.fc2.", ".ff.net.2."))
        if new.endswith(".mlp.fc1.weight"):
            gate, val = value.chunk(2, dim=0)
            out[new.replace(".mlp.fc1.", ".ff.net.0.proj.")] = torch.cat([val, gate])
        elif new.endswith(".attn.qkv_proj.weight"):
            for part, w in zip("qkv", value.chunk(3, dim=0)):
                out[new.replace(".attn.qkv_proj.", f".attn.to_{part}.")] = w.contiguous()
        else:
            out[new] = value
    return out


def save_diffusers(root: str | Path, cfg: H3Config, states: dict[str, dict[str, torch.Tensor]],
                   dtype: torch.dtype = torch.bfloat16, shards: int = 2) -> Path:
    """Diffusers layout: `root/transformer` (t2va, fl2va) and/or `root/transformer_ref` (ref2va), keys of `states`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3ModularPipeline"}, indent=1))
    for component, state in states.items():
        folder = root / component
        tensors = diffusers_state_dict(_checkpoint_dtypes(state, dtype), cfg)
        _save_sharded(folder, tensors, shards, "diffusion_pytorch_model",
                      "diffusion_pytorch_model.safetensors.index.json")
        config = {"_class_name": DIFFUSERS_CLASS, **cfg.to_diffusers_kwargs()}
        config["patch_size"] = list(cfg.patch_size)
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    return root


def save_comfy(path: str | Path, cfg: H3Config, state: dict[str, torch.Tensor],
               dtype: torch.dtype = torch.bfloat16) -> Path:
    """One file, native names under `model.diffusion_model.`, QKV stacked [q; k; v]."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {COMFY_PREFIX + k: v for k, v in _checkpoint_dtypes(state, dtype).items()}
    tensors[COMFY_PREFIX + "rope.inv_freq"] = rope_inv_freq(cfg)
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return path
