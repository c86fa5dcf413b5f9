"""bench_e2e.py's checkpoint phase: the official layout (FL2VA partition) at full size, random and deterministic (each
tensor drawn from a generator seeded by its name, so the reference phase regenerates the same weights on the GPU
instead of reading 66 GB), the full-size VAEs and a tiny text encoder of H3's output width."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench_common import released_audio_vae

if TYPE_CHECKING:
    from e2e_ctx import Ctx

TEXT_ROWS = 128  # the validated 37,838-row shape: 128 text + 2 x 207 audio + 37 x 24 x 42 video
SEED = 0
CALIB_PROMPT = "A red fox runs through the snowy forest at sunset while music plays."
BASE_PROMPT = "A red fox runs through the snowy forest at sunset, and the camera follows it"


def _seed(name: str) -> int:
    return int(hashlib.sha256(f"{SEED}:{name}".encode()).hexdigest()[:15], 16)


def random_tensor(name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """random_state_dict's distribution (norm scales near 1, small biases, fan-in scaled matrices), drawn on `device`
    from a generator seeded by the name: the same tensor whatever order or process asks for it."""
    gen = torch.Generator(device).manual_seed(_seed(name))
    x = torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32)
    parts = name.rsplit(".", 2)
    if len(parts) >= 2 and "norm" in parts[-2]:
        x = 1.0 + 0.1 * x
    elif x.ndim <= 1:
        x = 0.02 * x
    else:
        x = x / math.sqrt(shape[1])
    return x.to(dtype)


def dit_tensor_specs(cfg) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(native name, shape, checkpoint dtype) of every stored DiT tensor, rope.inv_freq aside."""
    from h3trt.models.dit import build_dit, parameter_dtype

    meta = build_dit(cfg, torch.bfloat16, device="meta").state_dict()
    return [(n, tuple(t.shape), parameter_dtype(n, torch.bfloat16)) for n, t in sorted(meta.items())]


def checkpoint_complete(ctx: Ctx) -> dict | None:
    marker = ctx.ckpt / "h3trt_e2e.json"
    if not marker.exists():
        return None
    data = json.loads(marker.read_text())
    return data if data.get("tiny") == ctx.tiny else None


def phase_checkpoint(ctx: Ctx) -> None:
    done = checkpoint_complete(ctx)
    if done is not None:
        ctx.log(f"checkpoint: present in {ctx.ckpt} (written {done['seconds']:.0f} s, {done['bytes'] / 1e9:.1f} GB)")
        ctx.results["checkpoint"] = {**done, "reused": True}
        return
    from h3trt.engines.weights_io import write_safetensors
    from h3trt.models.checkpoint.names import to_native_config
    from h3trt.models.checkpoint.writer import official_model_index
    from h3trt.models.dit import rope_inv_freq

    shutil.rmtree(ctx.ckpt, ignore_errors=True)
    part = ctx.ckpt / "FL2VA"
    (part / "transformer").mkdir(parents=True)
    (part / "model_index.json").write_text(json.dumps(official_model_index("FL2VA"), indent=1))
    (part / "transformer" / "config.json").write_text(json.dumps(to_native_config(ctx.cfg), indent=1))
    t0 = time.perf_counter()
    # 1. The DiT: shards of about 5 GB, written by 4 threads (each generates its shard's tensors on the GPU).
    specs = dit_tensor_specs(ctx.cfg)
    shard_bytes = 5e9 if not ctx.tiny else 2e5
    shards, current, size = [], [], 0
    for spec in specs:
        current.append(spec)
        size += math.prod(spec[1]) * spec[2].itemsize
        if size >= shard_bytes:
            shards.append(current)
            current, size = [], 0
    shards.append(current + [("rope.inv_freq", None, torch.float32)])
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    def write_shard(i: int) -> int:
        tensors = {n: (rope_inv_freq(ctx.cfg) if shape is None else random_tensor(n, shape, dtype, ctx.device))
                   for n, shape, dtype in shards[i]}
        return write_safetensors(part / "transformer" / names[i], tensors)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1 if ctx.tiny else 4) as pool:
        dit_bytes = sum(pool.map(write_shard, range(len(shards))))
    weight_map = {n: names[i] for i, shard in enumerate(shards) for n, _, _ in shard}
    (part / "transformer" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": dit_bytes}, "weight_map": weight_map}, indent=1))
    t_dit = time.perf_counter() - t0
    ctx.log(f"checkpoint: DiT {sum(math.prod(s) for _, s, _ in specs if s) / 1e9:.2f} B parameters, "
            f"{dit_bytes / 1e9:.1f} GB in {len(shards)} shards, {t_dit:.1f} s ({dit_bytes / 1e9 / t_dit:.2f} GB/s)")
    # 2. VAEs and the text encoder.
    vae_bytes = write_vaes(ctx, part)
    from h3trt.models.tiny_text_encoder import write_tiny_text_encoder

    if ctx.tiny:
        write_tiny_text_encoder(part, hidden_size=ctx.cfg.text_dim, seed=SEED + 30)
    else:  # H3's output width, 51 layers, but 8-wide heads and MLP: 150 MB instead of 7B parameters
        write_tiny_text_encoder(part, hidden_size=ctx.cfg.text_dim, seed=SEED + 30, head_dim=8, intermediate_size=16)
    prompt, rows = prompt_with_rows(part, TEXT_ROWS)
    (ctx.state / "calib.txt").write_text(CALIB_PROMPT + "\n")
    total = sum(f.stat().st_size for f in ctx.ckpt.rglob("*") if f.is_file())
    done = {"tiny": ctx.tiny, "seconds": round(time.perf_counter() - t0, 2), "dit_write_s": round(t_dit, 2),
            "bytes": total, "dit_bytes": dit_bytes, "vae_bytes": vae_bytes, "shards": len(shards),
            "dit_parameters": sum(math.prod(s) for _, s, _ in specs), "prompt": prompt, "text_rows": rows,
            "text_encoder": f"tiny random Qwen3-VL, output width {ctx.cfg.text_dim} (51 layers, 8-wide heads)",
            "qkv": "random rows, written as generated (the loaders de-interleave them as the release's)"}
    (ctx.ckpt / "h3trt_e2e.json").write_text(json.dumps(done, indent=1))
    ctx.results["checkpoint"] = done
    ctx.log(f"checkpoint: {total / 1e9:.1f} GB in {done['seconds']:.0f} s; prompt gives {rows} text rows")


def write_vaes(ctx: Ctx, part: Path) -> int:
    """The full-size video VAE (random, fp32 as released) and audio VAE; the tiny ones in --tiny."""
    from h3trt.engines.weights_io import write_safetensors
    from h3trt.models.checkpoint.vae import save_audio_vae, video_vae_files

    if ctx.tiny:
        from h3trt.models.tiny import tiny_audio_vae, tiny_video_vae

        video, audio = tiny_video_vae(), tiny_audio_vae()
    else:
        from diffusers import AutoencoderKLMiniMaxH3

        from h3trt.models.checkpoint.vae import RELEASED_VIDEO_VAE

        with torch.device("meta"):
            video = AutoencoderKLMiniMaxH3(**RELEASED_VIDEO_VAE, latents_mean=(0.0,) * 24, latents_std=(1.0,) * 24)
        video = video.to_empty(device=ctx.device)
        with torch.no_grad():
            for name, p in video.named_parameters():
                p.copy_(random_tensor(f"vae.{name}", p.shape, p.dtype, ctx.device))
        torch.manual_seed(SEED + 21)
        audio = released_audio_vae()
    native, config = video_vae_files(video)
    folder = part / "video_vae"
    n = write_safetensors(folder / "source" / "model.safetensors", native)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_audio_vae(part, audio)
    return n + (part / "audio_vae" / "model.safetensors").stat().st_size


def prompt_with_rows(part: Path, rows: int) -> tuple[str, int]:
    """A prompt whose t2va encoding has `rows` rows (the tiny tokenizer: one row per short word), so the clip has the
    validated sequence length."""
    from h3trt.models.text_encoder import H3TextEncoder

    enc = H3TextEncoder.from_pretrained(part, device=torch.device("cpu"), dtype=torch.float32)
    words = 0
    for _ in range(8):  # " a" adds one row; a few encodes settle it
        prompt = BASE_PROMPT + " a" * words
        n = enc.encode_t2va(prompt).embeds.shape[1]
        if n >= rows:
            return prompt, n
        words += rows - n
    return prompt, n
