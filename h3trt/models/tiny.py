"""The embedded tiny default: every H3 component at toy width with deterministic random weights.

`h3trt run` without `--model` builds this checkpoint at first use (no download) in the official layout, so the
tiny model goes through exactly the loaders real weights do. Its picture and sound are noise: the weights are
random. What it proves is the machinery: packing, sampler, VAEs, muxing, timing, errors.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from ..errors import UserError
from ..paths import cache_dir as default_cache_dir
from .checkpoint.writer import random_state_dict, save_official
from .config import H3Config
from .tiny_text_encoder import write_tiny_text_encoder
from .checkpoint.vae import save_audio_vae, save_video_vae, weight_norm_quietly

TINY_VERSION = 1  # bump when the tiny components change, so stale caches are rebuilt
TINY_SEED = 0
# The tiny model's default canvas: H3's 16:9 canvas (1344x768) would take minutes on two CPU cores.
TINY_WIDTH, TINY_HEIGHT = 160, 96
# Reference images are encoded at their own short edge (2048 for H3); the tiny default keeps them small.
TINY_REFERENCE_SHORT_EDGE = 64


def tiny_video_vae():
    from diffusers import AutoencoderKLMiniMaxH3  # diffusers: seconds to import; only a first use builds the VAEs

    gen = torch.Generator().manual_seed(TINY_SEED + 10)
    mean = (0.1 * torch.randn(24, generator=gen)).tolist()
    std = (0.5 + torch.rand(24, generator=gen)).tolist()
    torch.manual_seed(TINY_SEED + 11)  # diffusers initialises from the global generator
    return AutoencoderKLMiniMaxH3(block_out_channels=(32,) * 6, decoder_num_layers=2, decoder_num_attention_heads=2,
                                  decoder_ffn_mult=2, latents_mean=tuple(mean), latents_std=tuple(std)).eval()


def tiny_audio_vae():
    from diffusers import AutoencoderKLMiniMaxH3Audio

    gen = torch.Generator().manual_seed(TINY_SEED + 20)
    mean = (0.1 * torch.randn(32, generator=gen)).tolist()
    std = (0.5 + torch.rand(32, generator=gen)).tolist()
    torch.manual_seed(TINY_SEED + 21)
    with weight_norm_quietly():
        return AutoencoderKLMiniMaxH3Audio(encoder_dim=8, latent_dim=64, decoder_dim=128, latents_mean=mean,
                                           latents_std=std).eval()


def write_tiny_checkpoint(root: Path) -> Path:
    """Write the whole tiny model in the official layout: FL2VA/ and Ref2VA/, each with every component."""
    from transformers.utils import logging as hf_logging  # transformers: seconds to import, needed at first use only

    hf_logging.disable_progress_bar()  # a "Writing model shards" bar for a 3 MB model is noise on the first run
    cfg = H3Config.tiny()
    fork = torch.random.get_rng_state()
    try:
        save_official(root, cfg, {"FL2VA": random_state_dict(cfg, TINY_SEED),
                                  "Ref2VA": random_state_dict(cfg, TINY_SEED + 1)}, torch.bfloat16, shards=2)
        video_vae, audio_vae = tiny_video_vae(), tiny_audio_vae()
        for partition in ("FL2VA", "Ref2VA"):
            write_tiny_text_encoder(root / partition, hidden_size=cfg.text_dim, seed=TINY_SEED + 30)
            save_video_vae(root / partition, video_vae)
            save_audio_vae(root / partition, audio_vae)
    finally:
        torch.random.set_rng_state(fork)
    (root / "h3trt_tiny.json").write_text(json.dumps({
        "version": TINY_VERSION, "width": TINY_WIDTH, "height": TINY_HEIGHT,
        "reference_short_edge": TINY_REFERENCE_SHORT_EDGE,
        "note": "random weights: the output is noise; see README for real MiniMax-H3 weights",
    }, indent=1))
    return root


class TinyCacheError(UserError):
    """The tiny model's cache folder cannot be written (one line naming XDG_CACHE_HOME)."""


def ensure_tiny_checkpoint(cache_dir: Path | None = None) -> Path:
    """The tiny checkpoint folder, written on first use.

    Safe for concurrent first runs: one process builds under a file lock (`<cache>/.tiny-v<N>.lock`, filelock) while
    the others wait and then use what it built. The build goes to a temporary folder renamed into place once
    complete, so an interrupted build never leaves a half-written model that later runs would trust; a finished
    model (its h3trt_tiny.json written last) is never deleted. A read-only cache that already holds the model works."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    target = cache_dir / f"tiny-v{TINY_VERSION}"
    marker = target / "h3trt_tiny.json"
    if marker.exists():
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(cache_dir / f".tiny-v{TINY_VERSION}.lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            print(f"h3trt: waiting for another process to finish building the tiny model in {cache_dir}",
                  file=sys.stderr)
            lock.acquire()
        try:
            if marker.exists():  # built by the process we waited for
                return target
            for stale in cache_dir.glob(".tiny-build-*"):  # interrupted builds; under the lock nobody else builds
                shutil.rmtree(stale, ignore_errors=True)
            if target.exists():  # no marker: a broken attempt of an older h3trt, never a finished model
                shutil.rmtree(target)
            tmp = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=cache_dir))
            try:
                write_tiny_checkpoint(tmp)
                os.replace(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            lock.release()
    except OSError as e:
        raise TinyCacheError(f"the tiny model's cache {cache_dir} is not writable ({e.strerror or e}); set "
                             "XDG_CACHE_HOME to a writable folder (h3trt caches under $XDG_CACHE_HOME/h3trt, "
                             "default ~/.cache/h3trt), or pass --model PATH.") from None
    return target


def write_tiny_vsa_checkpoint(tiny_root: Path, dest: Path, seed: int = TINY_SEED + 40) -> Path:
    """A tiny FastH3-VSA checkpoint at `dest`: the tiny model's FL2VA partition (its text encoder, VAEs and tokenizer
    copied from `tiny_root`) with a transformer whose main blocks carry `attn.to_gate_compress` (H3Config.vsa_gate),
    random weights from `seed`. What tests and benches build VSA bundles from; t2va and fl2va only, as FastH3."""
    dest = Path(dest)
    shutil.copytree(Path(tiny_root) / "FL2VA", dest / "FL2VA", ignore=shutil.ignore_patterns("transformer"))
    cfg = H3Config.tiny(vsa_gate=True)
    save_official(dest, cfg, {"FL2VA": random_state_dict(cfg, seed)}, torch.bfloat16, shards=2)
    return dest
