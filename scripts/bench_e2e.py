"""A full-size clip end to end: `h3trt build` a full-size random checkpoint, then `h3trt run --engine` one 5 s
1344x768 clip in a fresh process (cold start split, per-step time, denoise, decode, mux, wall, gaps, peak memory,
energy), against the Diffusers reference on the same weights in the same run.

    python scripts/bench_e2e.py --out bench/results/e2e_h200.json --phase checkpoint,reference,build,run --rows fp8
    python scripts/bench_e2e.py --out bench/results/e2e_h200.json --phase checkpoint,build,run --rows bf16
    python scripts/bench_e2e.py --tiny --out /tmp/e2e_tiny.json     # the same flow on the CPU, tiny config

Phases (any subset, in this order; state between calls in --state, RAM-backed /dev/shm by default):
  checkpoint  the official layout (FL2VA partition): all 50 DiT layers at real shapes (33.1B parameters, random,
              bf16 with the release's fp32 islands, generated on the GPU and streamed to the file one tensor at a
              time, 66 GB), the full-size video VAE (2.6B, fp32 as released) and audio VAE, and a TINY text encoder
              whose output is H3's 5120 wide (51 layers, 8-wide heads: a random 32B Qwen3-VL only adds disk). Skipped
              when --state already holds it. QKV rows are written as generated: random rows interleaved per head are
              random rows, and the loaders de-interleave exactly as for the release.
  reference   on the same weights (regenerated on the GPU from the same seeds, checked against the checkpoint file),
              at the clip's 37,838 rows: Diffusers' MiniMaxH3Transformer3DModel for --ref-evals evaluations (the first
              a warm-up), h3trt's eager DiT for --eager-evals, and Diffusers' video VAE decode of the clip's latent in
              bf16 as its pipeline loads it (`_keep_in_fp32_modules` kept fp32). Diffusers end to end is extrapolated:
              49 evaluations + that decode (no text encode, audio decode or mux: in its favour).
  build       `h3trt build` per row (bf16: --steps 50; other rows: --steps of their run), in a fresh process.
  run         `h3trt run --engine` per row in a fresh process, the bundle's pages evicted from the page cache and an
              empty user cache (so no verified-once record: the first load of a copied bundle, every byte hashed);
              --profile-step 4 measures the host overhead of one step (the 4th: after the VAEs' background load).
              For --warm-run rows (default fp8) the same run again at once: pages cached, the record present (a node
              restarting its process). For --second-start rows a fresh process only loads the bundle, the record
              present and the pages evicted again. A row's bundle is deleted after its run unless --keep-bundles
              (disk: 64 GiB). Each run records whether Python found compiled bytecode (set PYTHONPYCACHEPREFIX and
              run compileall first to measure an install that has it: the H200 image has none).
Rows: bf16 (sp=1), fp8 (fp8 GEMMs + --fp8-attention, sp=1), bf16-sp2 and fp8-sp2 (need 2 GPUs). bf16 runs all 50
steps; other rows run --short-steps (6: 5 evaluations) and are extrapolated to 49 evaluations (said in the output).

Device minutes, from the first H200 attempt (bench/results/e2e_h200_call*: checkpoint 36 s, reference 51 s, each
build ~200 s up to its fresh-process check) and bench/README (h3trt bf16 ~5.5 s an evaluation with cuDNN attention,
~4.8 s with FA3; fp8 + FP8 attention ~3.3-3.7 s; the bundle's video decode ~6 s at --vae-precision bf16, 48 s fp32):
  checkpoint ~0.6 min; reference ~0.9 min; build fp8 ~3.7 min; build bf16 ~3.5 min; run fp8 ~0.8 min + warm run
  ~0.7 min; run bf16 ~4.5-5 min (cold start + 49 evaluations + decode).
  Call 1: --phase checkpoint,reference,build,run --rows fp8 (~6.5 min); call 2: --phase checkpoint,build,run --rows
  bf16 (~8.3 min, ~8.9 when /dev/shm was lost and the checkpoint is rewritten). --budget-s (default 560) stops a
  call's subprocesses in time to write the JSON. --out merges into an existing file: copy call 1's JSON to call 2's
  --out path first, and the summary (speedup against the Diffusers row) covers both.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("checkpoint", "reference", "build", "run")
ROWS = {  # row: (precision, sp, extra build flags)
    "bf16": ("bf16", 1, []), "fp8": ("fp8", 1, ["--fp8-attention"]),
    "bf16-sp2": ("bf16", 2, []), "fp8-sp2": ("fp8", 2, ["--fp8-attention"]),
}
FULL_EVALUATIONS = 49  # a 50-step clip
BUNDLE_DIT_BYTES = {"bf16": 41.2e9, "fp8": 21.9e9}  # full-size DiT weights of a bundle (bench/README, AdaLN baked)
TEXT_ROWS = 128  # the validated 37,838-row shape: 128 text + 2 x 207 audio + 37 x 24 x 42 video
SEED = 0
CALIB_PROMPT = "A red fox runs through the snowy forest at sunset while music plays."
BASE_PROMPT = "A red fox runs through the snowy forest at sunset, and the camera follows it"


# ----------------------------------------------------------------------------------------------------------------------
# Context: paths, results, log


class Ctx:
    def __init__(self, args):
        self.args, self.tiny = args, args.tiny
        self.device = torch.device("cpu" if args.tiny else "cuda")
        self.state, self.bundles = Path(args.state), Path(args.bundles)
        self.ckpt = self.state / "ckpt"
        self.out = Path(args.out)
        self.log_path = self.out.with_suffix(".log")
        self.started = time.time()
        self.results = json.loads(self.out.read_text()) if self.out.exists() else {}
        from h3trt.models.config import H3Config

        self.cfg = H3Config.tiny() if self.tiny else H3Config()
        self.width, self.height = (160, 96) if self.tiny else (1344, 768)
        from h3trt.models.packing import Geometry, frames_for_duration

        self.geometry = Geometry(self.height, self.width, frames_for_duration(5.0))

    def log(self, msg: str) -> None:
        line = f"[{time.time() - self.started:7.1f}s] {msg}"
        print(line, flush=True)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def save(self) -> None:
        tmp = self.out.with_name(f".{self.out.name}.partial")
        tmp.write_text(json.dumps(self.results, indent=1, default=float))
        os.replace(tmp, self.out)

    def remaining(self) -> float:
        return self.args.budget_s - (time.time() - self.started)

    def subprocess(self, cmd: list[str], env_extra: dict, what: str) -> tuple[int, float]:
        """Run `cmd` with output appended to the log; (exit code, seconds). Killed before the call's budget ends."""
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env_extra}
        timeout = max(5.0, self.remaining() - 15.0)
        self.log(f"{what}: {' '.join(cmd)}  (timeout {timeout:.0f} s)")
        start = time.perf_counter()
        with open(self.log_path, "a") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = -9
                self.log(f"{what}: killed at the call's budget (--budget-s {self.args.budget_s:.0f})")
        return rc, time.perf_counter() - start

    def env(self) -> dict:
        info = {"torch": torch.__version__, "device": str(self.device), "tiny": self.tiny}
        if self.device.type == "cuda":
            info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), cuda=torch.version.cuda,
                        cudnn=torch.backends.cudnn.version())
        return info


# ----------------------------------------------------------------------------------------------------------------------
# Deterministic random weights (the checkpoint and the reference regenerate the same tensors)


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


# ----------------------------------------------------------------------------------------------------------------------
# Phase: checkpoint


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
    from h3trt.models.checkpoint_names import to_native_config
    from h3trt.models.checkpoint_writer import official_model_index
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
    from h3trt.models.vae_checkpoint import audio_vae_kwargs, save_audio_vae, video_vae_files

    if ctx.tiny:
        from h3trt.models.tiny import tiny_audio_vae, tiny_video_vae

        video, audio = tiny_video_vae(), tiny_audio_vae()
    else:
        from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

        from h3trt.models.vae_checkpoint import RELEASED_VIDEO_VAE

        with torch.device("meta"):
            video = AutoencoderKLMiniMaxH3(**RELEASED_VIDEO_VAE, latents_mean=(0.0,) * 24, latents_std=(1.0,) * 24)
        video = video.to_empty(device=ctx.device)
        with torch.no_grad():
            for name, p in video.named_parameters():
                p.copy_(random_tensor(f"vae.{name}", p.shape, p.dtype, ctx.device))
        torch.manual_seed(SEED + 21)
        audio = AutoencoderKLMiniMaxH3Audio(**audio_vae_kwargs(  # the released audio VAE (bench_vae.py)
            {"encoder_dim": 64, "encoder_rates": [2, 4, 4, 5, 5], "latent_dim": 2048, "vae_latent_channels": 32,
             "decoder_dim": 1024, "decoder_rates": [5, 5, 2, 2, 2, 2, 2], "sample_rate": 32000},
            {"latents_mean": [0.0] * 32, "latents_std": [1.0] * 32, "sample_rate": 32000, "latent_channels": 32}))
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


# ----------------------------------------------------------------------------------------------------------------------
# Energy and memory from NVML


class NvmlSampler:
    """Samples the GPU energy counter (mJ since driver load), power and memory every 50 ms on a thread."""

    def __init__(self, index: int = 0):
        self.samples: list[tuple[float, float, int]] = []  # (unix s, energy J, memory used bytes)
        self.available, self.error = False, None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
            self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            self.available = True
        except Exception as e:  # no GPU (--tiny) or no nvidia-ml-py: energy is reported as unavailable, with why
            self.error = f"{type(e).__name__}: {e}"
        self._stop = threading.Event()
        self._thread = None

    def _sample(self) -> None:
        energy = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3
        memory = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used
        self.samples.append((time.time(), energy, memory))

    def start(self) -> "NvmlSampler":
        if self.available:
            self._sample()

            def loop():
                while not self._stop.wait(0.05):
                    self._sample()

            self._thread = threading.Thread(target=loop, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()

    def joules(self, a: float, b: float) -> float | None:
        """Energy between Unix times a and b, interpolated on the samples."""
        if not self.available or len(self.samples) < 2:
            return None
        t = [s[0] for s in self.samples]
        e = [s[1] for s in self.samples]

        def at(x):
            import bisect

            i = min(max(bisect.bisect_left(t, x), 1), len(t) - 1)
            if t[i] == t[i - 1]:
                return e[i]
            return e[i - 1] + (e[i] - e[i - 1]) * (x - t[i - 1]) / (t[i] - t[i - 1])

        return round(at(b) - at(a), 1)

    def peak_memory_gib(self) -> float | None:
        return round(max(s[2] for s in self.samples) / 2**30, 2) if self.available and self.samples else None


# ----------------------------------------------------------------------------------------------------------------------
# Phase: reference (Diffusers transformer and VAE decode, h3trt eager, on the same weights)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, runs: int, nvml: NvmlSampler) -> dict:
    """Run fn `runs` times; the first is a warm-up (reported apart); seconds and joules of the others."""
    seconds, joules, out = [], [], None
    for i in range(runs):
        _sync(device)
        a, ta = time.perf_counter(), time.time()
        out = fn()
        _sync(device)
        seconds.append(time.perf_counter() - a)
        joules.append(nvml.joules(ta, time.time()))
    timed = seconds[1:] or seconds
    j = [x for x in (joules[1:] or joules) if x is not None]
    return {"first_s": round(seconds[0], 4), "s": round(statistics.median(timed), 4), "runs": runs,
            "timed_runs": len(timed), "joules": round(statistics.median(j), 1) if j else None}, out


def reference_inputs(ctx: Ctx):
    from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
    from h3trt.models.sampler import Schedule

    geo, cfg, dev = ctx.geometry, ctx.cfg, ctx.device
    lay = pack_t2va(text_tags_for(TEXT_ROWS), geo.latent_frames, geo.latent_height, geo.latent_width,
                    geo.audio_latents, cfg.patch_size).to(dev)
    g = torch.Generator().manual_seed(0)
    video = torch.randn(1, lay.video_index.numel(), cfg.video_patch_dim, generator=g).to(dev)
    audio = torch.randn(1, lay.audio_index.numel(), cfg.audio_in_channels, generator=g).to(dev)
    text = torch.randn(1, TEXT_ROWS, cfg.text_dim, generator=g).to(dev, torch.bfloat16)
    unique_t, t_index = (t.to(dev) for t in row_timesteps(lay, *Schedule().timesteps()[10]))
    return lay, video, audio, text, unique_t, t_index


@torch.no_grad()
def phase_reference(ctx: Ctx) -> None:
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed

    from h3trt.models.weight_layout import deinterleave_qkv
    from h3trt.models.checkpoint_writer import diffusers_state_dict
    from h3trt.models.dit import EagerDiT, build_dit, rope_inv_freq

    if checkpoint_complete(ctx) is None:
        ctx.results["reference"] = {"error": f"no checkpoint in {ctx.ckpt}: run --phase checkpoint first (the machine "
                                             "may have been released between calls, taking /dev/shm with it)"}
        ctx.log(f"reference: {ctx.results['reference']['error']}")
        return
    cfg, dev = ctx.cfg, ctx.device
    out = {"evaluation_rows": None, "notes": []}
    nvml = NvmlSampler().start()
    t0 = time.perf_counter()
    # The checkpoint's tensors, regenerated (QKV de-interleaved as the loader does), in place of a 66 GB read.
    state = {}
    for name, shape, dtype in dit_tensor_specs(cfg):
        t = random_tensor(name, shape, dtype, dev)
        state[name] = deinterleave_qkv(t, cfg.num_heads, cfg.head_dim) if name.endswith(".attn.qkv_proj.weight") else t
    out["weights_s"] = round(time.perf_counter() - t0, 2)
    out["weights_match_checkpoint"] = _matches_checkpoint(ctx, "blocks.0.mlp.fc2.weight", state)
    model = build_dit(cfg, torch.bfloat16, device="meta")
    model.load_state_dict(state, strict=True, assign=True)
    model.rope_inv_freq = rope_inv_freq(cfg).to(dev)
    model.eval()
    lay, video, audio, text, unique_t, t_index = reference_inputs(ctx)
    out["evaluation_rows"] = lay.seq_len
    ctx.log(f"reference: weights on {dev} in {out['weights_s']:.1f} s; {lay.seq_len} rows per evaluation")

    eager = EagerDiT(model)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out["h3trt_eager"], eager_out = _timed(lambda: eager(video, audio, text, unique_t, t_index, lay), dev,
                                           ctx.args.eager_evals, nvml)
    out["h3trt_eager"]["peak_gib"] = _peak(dev)
    ctx.log(f"reference: h3trt eager {out['h3trt_eager']['s']:.3f} s per evaluation")

    with torch.device("meta"):
        ref = MiniMaxH3Transformer3DModel(**cfg.to_diffusers_kwargs())
    ref.load_state_dict(diffusers_state_dict(model.state_dict(), cfg), strict=True, assign=True)
    ref.rope = MiniMaxH3RotaryPosEmbed(cfg.rope_freq_dim, cfg.rope_theta).to(dev)  # non-persistent: rebuilt
    left = [n for n, t in list(ref.named_parameters()) + list(ref.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"Diffusers model tensors left on meta after loading: {left[:5]}")
    ref.eval()
    args = dict(hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=text, timestep=unique_t,
                timestep_indices=t_index, token_tags=lay.token_tags, position_ids=lay.position_ids,
                video_indices=lay.video_index, audio_indices=lay.audio_index, text_indices=lay.text_index,
                return_dict=False)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out["diffusers"], ref_out = _timed(lambda: ref(**args), dev, ctx.args.ref_evals, nvml)
    out["diffusers"]["peak_gib"] = _peak(dev)
    out["h3trt_eager_rel_err_vs_diffusers"] = [_rel(a, b) for a, b in zip(eager_out, ref_out)]
    ctx.log(f"reference: Diffusers {out['diffusers']['s']:.3f} s per evaluation (h3trt eager vs Diffusers rel. err "
            f"{out['h3trt_eager_rel_err_vs_diffusers']})")
    del model, eager, ref, state, eager_out, ref_out, args
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    out["vae_decode"] = reference_decode(ctx, nvml)
    nvml.stop()
    d = out["diffusers"]
    decode_s = out["vae_decode"].get("s")
    out["diffusers_end_to_end_s"] = (round(FULL_EVALUATIONS * d["s"] + decode_s, 2) if decode_s is not None else None)
    out["diffusers_end_to_end_joules"] = (round(FULL_EVALUATIONS * d["joules"] + out["vae_decode"]["joules"], 0)
                                          if d["joules"] is not None and out["vae_decode"].get("joules") else None)
    out["notes"].append(f"Diffusers end to end = {FULL_EVALUATIONS} x its measured evaluation (median of "
                        f"{d['timed_runs']} after a warm-up) + its bf16 VAE decode of the clip; no text encode, "
                        "audio decode, mux or load (in Diffusers' favour).")
    ctx.results["reference"] = out


def reference_decode(ctx: Ctx, nvml: NvmlSampler) -> dict:
    """Diffusers' own tiled decode (`AutoencoderKLMiniMaxH3.decode`) of the clip's latent, the VAE loaded in bf16 the
    way its pipeline loads it: the `_keep_in_fp32_modules` stay fp32."""
    from h3trt.models.vae_checkpoint import load_video_vae

    dev, geo = ctx.device, ctx.geometry
    vae = load_video_vae(ctx.ckpt / "FL2VA", dev, dtype=torch.bfloat16)
    z = torch.randn(1, vae.vae.config.latent_channels, geo.latent_frames, geo.latent_height, geo.latent_width,
                    generator=torch.Generator().manual_seed(1)).to(dev)
    z = vae.denormalize(z)
    result = {"dtype": "bf16 (fp32 _keep_in_fp32_modules)", "latent": list(z.shape)}
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        timing, frames = _timed(lambda: vae.vae.decode(z, return_dict=False)[0], dev, ctx.args.ref_decodes, nvml)
        result.update(timing, frames=list(frames.shape), peak_gib=_peak(dev))
        ctx.log(f"reference: Diffusers bf16 VAE decode {timing['s']:.2f} s for {frames.shape[2]} frames")
    except Exception as e:  # recorded as a failed row, not replaced by another decode
        result["error"] = f"{type(e).__name__}: {e}"
        ctx.log(f"reference: Diffusers bf16 VAE decode failed: {result['error']}")
    return result


def _matches_checkpoint(ctx: Ctx, name: str, state: dict) -> bool:
    from safetensors import safe_open

    index = json.loads((ctx.ckpt / "FL2VA" / "transformer" / "model.safetensors.index.json").read_text())
    with safe_open(str(ctx.ckpt / "FL2VA" / "transformer" / index["weight_map"][name]), "pt") as f:
        return bool(torch.equal(f.get_tensor(name), state[name].cpu()))


def _peak(dev) -> float | None:
    return round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None


def _rel(a, b) -> float:
    return round(((a.float() - b.float()).norm() / b.float().norm()).item(), 6)


# ----------------------------------------------------------------------------------------------------------------------
# Phases: build and run, per row


def row_steps(ctx: Ctx, row: str) -> int:
    return ctx.args.full_steps if row == "bf16" else ctx.args.short_steps


def bundle_path(ctx: Ctx, row: str) -> Path:
    return ctx.bundles / f"bundle-{row}"


def phase_build(ctx: Ctx, row: str) -> None:
    from h3trt.engines.manifest import read_manifest

    precision, sp, extra = ROWS[row]
    steps = row_steps(ctx, row)
    result = ctx.results.setdefault("rows", {}).setdefault(row, {})
    bundle = bundle_path(ctx, row)
    if (bundle / "manifest.json").exists():
        m = read_manifest(bundle)
        if m.precision == precision and m.schedule.steps == steps and m.mesh.sp == sp:
            ctx.log(f"build {row}: reusing {bundle}")
            result["build"] = {**result.get("build", {}), "reused": True}
            return
    if checkpoint_complete(ctx) is None:
        result["build"] = {"error": f"no checkpoint in {ctx.ckpt}: run --phase checkpoint first"}
        ctx.log(f"build {row}: {result['build']['error']}")
        return
    if sp > torch.cuda.device_count() and not ctx.tiny:
        result["build"] = {"error": f"sp={sp} needs {sp} GPUs; {torch.cuda.device_count()} visible"}
        return
    shutil.rmtree(bundle, ignore_errors=True)
    ctx.bundles.mkdir(parents=True, exist_ok=True)
    if not ctx.tiny:  # refuse now rather than after minutes of building (DiT weights: bench/README's byte table)
        need = BUNDLE_DIT_BYTES[precision] + checkpoint_complete(ctx)["vae_bytes"] + 3e9
        free = shutil.disk_usage(ctx.bundles).free
        if free < need:
            result["build"] = {"error": f"{ctx.bundles} has {free / 1e9:.0f} GB free; a {precision} bundle needs about "
                                        f"{need / 1e9:.0f} GB. Free the disk or pass --bundles elsewhere."}
            ctx.log(f"build {row}: {result['build']['error']}")
            return
    tmp = ctx.state / "tmp"  # the build's fresh-process check writes its example tensors here (RAM, not the disk)
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "h3trt.cli", "build", "--model", str(ctx.ckpt), "--output", str(bundle),
           "--precision", precision, "--steps", str(steps), "--device", ctx.device.type,
           "--profile", f"{ctx.width}x{ctx.height}x5", *extra]
    if precision == "fp8":
        # Random weights: calibration sets scales, not quality. One prompt, a 2-point trajectory (one evaluation).
        cmd += ["--calib-prompts", str(ctx.state / "calib.txt"), "--calib-steps", "2"]
    if sp > 1:
        cmd += ["--sp", str(sp)]
    rc, seconds = ctx.subprocess(cmd, {"TMPDIR": str(tmp), "XDG_CACHE_HOME": str(ctx.state / "xdg-build")},
                                 f"build {row}")
    build = {"seconds": round(seconds, 2), "rc": rc, "command": " ".join(cmd[2:]), "steps": steps}
    if rc == 0:
        m = read_manifest(bundle)
        build.update(bundle_bytes=m.total_bytes, weight_bytes=m.weight_bytes,
                     build_timings_s=m.build_timings_s, attention=m.attention,
                     disk_free_gb=round(shutil.disk_usage(bundle).free / 1e9, 1))
        ctx.log(f"build {row}: {build['bundle_bytes'] / 1e9:.1f} GB in {seconds:.0f} s {m.build_timings_s}")
    else:
        build["error"] = f"h3trt build exited {rc} (see {ctx.log_path})"
        ctx.log(f"build {row}: {build['error']}")
    result["build"] = build


def evict_page_cache(root: Path) -> dict:
    """Write back and drop the bundle's pages from the page cache (posix_fadvise DONTNEED: no root needed), so the
    load reads the disk. A RAM-backed filesystem (tmpfs) keeps them: its pages are the files."""
    t0 = time.perf_counter()
    n = 0
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return {"files": n, "seconds": round(time.perf_counter() - t0, 2), "how": "fsync + posix_fadvise(DONTNEED)"}


def phase_run(ctx: Ctx, row: str) -> None:
    result = ctx.results.setdefault("rows", {}).setdefault(row, {})
    bundle = bundle_path(ctx, row)
    if not (bundle / "manifest.json").exists():
        result["run"] = {"error": f"no bundle at {bundle}: run --phase build --rows {row} first (a released machine "
                                  "loses it)"}
        ctx.log(f"run {row}: {result['run']['error']}")
        return
    outdir = ctx.state / "out"
    outdir.mkdir(parents=True, exist_ok=True)
    clip = outdir / f"{row}.mp4"
    xdg = ctx.state / f"xdg-run-{row}"  # empty: no verified-once record, so this load hashes every byte
    shutil.rmtree(xdg, ignore_errors=True)
    xdg.mkdir(parents=True)
    run = run_clip(ctx, row, bundle, clip, xdg, evict=True)
    result["run"] = run
    if "error" in run:
        return
    ctx.log(f"run {row}: first step {run['cold_start_s']:.1f} s after launch, {run['step_s']:.3f} s per step, "
            f"denoise {run['denoise_s']:.1f} s, decode {run['video_decode_s']:.1f} s, wall {run['wall_s']:.1f} s"
            + (f" -> {run['end_to_end_49_s']:.1f} s extrapolated to 49 evaluations" if run["extrapolated"] else ""))
    if row in ctx.args.second_start:
        result["second_start"] = second_start(ctx, bundle, xdg)
    if row in ctx.args.warm_run:
        # The same run again with the bundle's pages still in memory and the verified-once record present: what a
        # fleet node restarting its process sees, and the loader without this machine's disk (1.6 GB/s) under it.
        warm = run_clip(ctx, row, bundle, clip, xdg, evict=False)
        result["warm_run"] = warm
        if "error" not in warm:
            ctx.log(f"run {row} again, pages cached: first step {warm['cold_start_s']:.1f} s after launch (weights "
                    f"{warm['load']['engine']['weights_GBps']} GB/s, process start to load "
                    f"{warm['load']['process_to_load_s']} s)")
    clip.unlink(missing_ok=True)
    if not ctx.args.keep_bundles:
        shutil.rmtree(bundle, ignore_errors=True)
        ctx.log(f"run {row}: deleted {bundle} (--keep-bundles keeps it)")


def run_clip(ctx: Ctx, row: str, bundle: Path, clip: Path, xdg: Path, evict: bool) -> dict:
    """`h3trt run --engine` in a fresh process, the bundle's pages evicted first (or left cached); the record's
    cold-start split, step times, energy."""
    _, sp, _ = ROWS[row]
    steps = row_steps(ctx, row)
    prompt = checkpoint_complete(ctx)["prompt"] if checkpoint_complete(ctx) else BASE_PROMPT
    evicted = evict_page_cache(bundle) if evict else {"how": "not evicted: pages cached by the previous load"}
    cmd = [sys.executable, "-m", "h3trt.cli", "run", "--engine", str(bundle), "--prompt", prompt, "--output",
           str(clip), "--width", str(ctx.width), "--height", str(ctx.height), "--duration", "5", "--steps", str(steps),
           "--profile-step", str(min(ctx.args.profile_step, steps - 1)), "--quiet", "--overwrite"]
    if sp > 1:
        cmd += ["--gpus", str(sp)]
    nvml = NvmlSampler().start()
    launched = time.time()
    rc, seconds = ctx.subprocess(cmd, {"XDG_CACHE_HOME": str(xdg)}, f"run {row}")
    ended = time.time()
    nvml.stop()
    run = {"rc": rc, "process_s": round(seconds, 2), "steps": steps, "page_cache": evicted,
           "python_bytecode": bytecode_note(),
           "segment_load_compile_threads": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "1 (h3trt's default)"),
           "command": " ".join(cmd[2:])}
    record_file = clip.with_suffix(".json")
    if rc != 0 or not record_file.exists():
        run["error"] = f"h3trt run exited {rc} (see {ctx.log_path})"
        ctx.log(f"run {row}: {run['error']}")
        return run
    record = json.loads(record_file.read_text())
    record_file.unlink()
    run.update(summarise_run(record, launched, ended, nvml))
    run["record"] = record
    return run


def bytecode_note() -> str:
    """Where this run's Python finds compiled bytecode: a process that cannot read or write .pyc files compiles
    every module it imports from source (seconds of torch and Inductor on the H200 image)."""
    prefix = os.environ.get("PYTHONPYCACHEPREFIX")
    if prefix:
        return f"PYTHONPYCACHEPREFIX={prefix} (compiled ahead with compileall)"
    return "as the image has it" + (" (PYTHONDONTWRITEBYTECODE set)" if os.environ.get("PYTHONDONTWRITEBYTECODE")
                                    else "")


def summarise_run(record: dict, launched: float, ended: float, nvml: NvmlSampler) -> dict:
    spans, t = record["spans_unix"], record["timings_s"]
    marks = record["step_marks_s"]
    evals = record["evaluations"]
    # The k-th mark is when step k was queued, right after step k-1 finished (each step syncs at its AdaLN lookup):
    # mark differences from the second on are step times.
    diffs = [b - a for a, b in zip(marks, marks[1:])]
    step_s = statistics.median(diffs) if diffs else t["denoise"] / evals
    gen_start, gen_end = spans["text_encode"][0], spans["decode_and_mux"][1]
    out = {
        "cold_start_s": round(spans["denoise"][0] - launched, 3),  # process launch -> first denoise step
        "load": record.get("load"),
        "step_s": round(step_s, 4), "first_step_s": round(marks[0], 3) if marks else None,
        "evaluations": evals, "denoise_s": t["denoise"],
        "video_decode_s": t.get("video_decode"), "audio_decode_s": t.get("audio_decode"), "mux_s": t.get("mux"),
        "decode_tail_s": t.get("decode_tail_s"), "wall_s": record["wall_s"],
        "process_wall_s": round(ended - launched, 2),
        "gaps_s": {
            "launch_to_text_encode": round(spans["text_encode"][0] - launched, 3),
            "text_encode_to_denoise": round(spans["denoise"][0] - spans["text_encode"][1], 3),
            "denoise_to_decode": round(spans["decode_and_mux"][0] - spans["denoise"][1], 3),
            "waiting_for_vaes": round(spans["wait_vaes"][1] - spans["wait_vaes"][0], 3) if "wait_vaes" in spans else None,
            "decode_end_to_exit": round(ended - spans["decode_and_mux"][1], 3),
        },
        "video_vae": {"precision": record.get("vae_precision"), "decoder": record.get("video_decoder")},
        "step_profile": record.get("step_profile"),
        "peak_memory_gib": record.get("peak_memory_gib"), "peak_memory_nvml_gib": nvml.peak_memory_gib(),
        "energy_j": {"clip": nvml.joules(gen_start, gen_end), "denoise": nvml.joules(*spans["denoise"]),
                     "decode_and_mux": nvml.joules(*spans["decode_and_mux"]), "process": nvml.joules(launched, ended)},
        "energy_note": (None if nvml.available else f"NVML unavailable ({nvml.error})"),
    }
    missing = FULL_EVALUATIONS - evals
    out["extrapolated"] = missing > 0
    out["end_to_end_49_s"] = round(record["wall_s"] + missing * step_s, 2)
    clip_j, den_j = out["energy_j"]["clip"], out["energy_j"]["denoise"]
    out["energy_49_j"] = round(clip_j + missing * den_j / evals, 0) if clip_j is not None else None
    if missing:
        out["note"] = (f"{evals} evaluations run; end to end extrapolated to {FULL_EVALUATIONS}: wall + {missing} x the "
                       "median step (energy likewise, from the denoise stage's joules per evaluation)")
    return out


def second_start(ctx: Ctx, bundle: Path, xdg: Path, evict: bool = True) -> dict:
    """A fresh process that loads the bundle again, with the verified-once record the run left in `xdg`; the
    bundle's pages evicted first, or (`evict` False) left in the page cache."""
    evicted = evict_page_cache(bundle) if evict else {"how": "not evicted: pages cached by the previous load"}
    report = ctx.state / "second_start.json"
    report.unlink(missing_ok=True)
    launched = time.time()
    rc, seconds = ctx.subprocess([sys.executable, __file__, "_load_only", str(bundle), str(report),
                                  ctx.device.type], {"XDG_CACHE_HOME": str(xdg)}, "second start")
    if rc != 0 or not report.exists():
        ctx.log(f"second start: exited {rc} (see {ctx.log_path})")
        return {"rc": rc, "error": f"exited {rc} (see {ctx.log_path})"}
    data = json.loads(report.read_text())
    return {"ready_s": round(data["ready_unix"] - launched, 3), "process_s": round(seconds, 2), "page_cache": evicted,
            "load": data["load"]}


def load_only(bundle: str, report: str, device: str) -> None:
    """Child of second_start: load the pipeline from the bundle, wait for the VAEs, write the report."""
    from h3trt.engines.guard import no_compile
    from h3trt.runtime.pipeline import H3Pipeline

    with no_compile():
        pipeline = H3Pipeline.load_engine(Path(bundle), device)
        ready = time.time()  # what the first step waits for; the VAEs keep loading behind it
        pipeline.video_vae
    Path(report).write_text(json.dumps({"ready_unix": ready, "load": pipeline.load_report}, default=float))


# ----------------------------------------------------------------------------------------------------------------------
# Summary


def summarise(ctx: Ctx) -> None:
    res, ref = ctx.results, ctx.results.get("reference", {})
    diffusers_e2e = ref.get("diffusers_end_to_end_s")
    rows = []
    if ref.get("diffusers"):
        d = ref["diffusers"]
        rows.append(("Diffusers bf16 (extrapolated)", d["s"], FULL_EVALUATIONS * d["s"], ref["vae_decode"].get("s"),
                     None, diffusers_e2e, None, None, d.get("peak_gib"), ref.get("diffusers_end_to_end_joules")))
    if ref.get("h3trt_eager"):
        e = ref["h3trt_eager"]
        rows.append(("h3trt eager bf16 (DiT only)", e["s"], FULL_EVALUATIONS * e["s"], None, None, None, None, None,
                     e.get("peak_gib"), None))
    summary = {}
    for row, r in res.get("rows", {}).items():
        run = r.get("run") or {}
        if "step_s" not in run:
            continue
        load = (run.get("load") or {}).get("engine", {})
        rows.append((f"h3trt bundle {row}" + (" (extrapolated)" if run["extrapolated"] else ""), run["step_s"],
                     FULL_EVALUATIONS * run["step_s"], run["video_decode_s"], run["mux_s"], run["end_to_end_49_s"],
                     run["cold_start_s"], load.get("weights_GBps"), (run.get("peak_memory_gib") or {}).get("allocated"),
                     run.get("energy_49_j")))
        starts = {k: {"ready_s": r[k].get("ready_s"),
                      "weights_GBps": ((r[k].get("load") or {}).get("engine") or {}).get("weights_GBps"),
                      "process_to_load_s": (r[k].get("load") or {}).get("process_to_load_s")}
                  for k in ("second_start", "warm_start") if isinstance(r.get(k), dict) and "ready_s" in r[k]}
        warm = r.get("warm_run") or {}
        if "cold_start_s" in warm:
            starts["warm_run"] = {"cold_start_s": warm["cold_start_s"], "first_step_s": warm.get("first_step_s"),
                                  "weights_GBps": (warm["load"].get("engine") or {}).get("weights_GBps"),
                                  "process_to_load_s": warm["load"].get("process_to_load_s")}
        summary[row] = {"end_to_end_49_s": run["end_to_end_49_s"], "cold_start_s": run["cold_start_s"],
                        "first_step_s": run.get("first_step_s"), "python_bytecode": run.get("python_bytecode"),
                        "process_to_load_s": (run.get("load") or {}).get("process_to_load_s"), **starts,
                        "weights_GBps": load.get("weights_GBps"),
                        "speedup_vs_diffusers": (round(diffusers_e2e / run["end_to_end_49_s"], 3)
                                                 if diffusers_e2e else None),
                        "host_idle_fraction": (run.get("step_profile") or {}).get("idle_fraction"),
                        "video_vae": run.get("video_vae")}
    bars = {}
    if "bf16" in summary and summary["bf16"]["speedup_vs_diffusers"]:
        bars["bf16_vs_diffusers_>=1.15x"] = summary["bf16"]["speedup_vs_diffusers"] >= 1.15
    if "fp8" in summary:
        bars["fp8_cold_start_<=15s"] = summary["fp8"]["cold_start_s"] <= 15.0
        if summary["fp8"]["weights_GBps"] is not None:
            bars["fp8_weights_>=3GBps"] = summary["fp8"]["weights_GBps"] >= 3.0
    res["summary"] = {"rows": summary, "bars": bars}
    head = (f"{'':34} {'s/step':>7} {'denoise49':>9} {'decode':>7} {'mux':>6} {'e2e s':>7} {'cold s':>7} "
            f"{'GB/s':>6} {'peakGiB':>7} {'J/clip':>8}")
    lines = [f"5 s {ctx.width}x{ctx.height} clip, 49 evaluations, {ctx.env().get('gpu', ctx.device)}", head]
    for name, *vals in rows:
        cells = [("" if v is None else f"{v:.3f}" if i == 0 else f"{v:.1f}") for i, v in enumerate(vals)]
        widths = [7, 9, 7, 6, 7, 7, 6, 7, 8]
        lines.append(f"{name:34} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    for row, s in summary.items():
        lines.append(f"{row}: {s['speedup_vs_diffusers']}x Diffusers end to end; host idle "
                     f"{s['host_idle_fraction']} of a step; video VAE {s['video_vae']}; process start to bundle "
                     f"load {s['process_to_load_s']} s")
        if "warm_run" in s:
            w = s["warm_run"]
            lines.append(f"{row} warm_run (pages cached, record present): first step {w['cold_start_s']} s after "
                         f"launch, weights {w['weights_GBps']} GB/s, process start to bundle load "
                         f"{w['process_to_load_s']} s, first step took {w['first_step_s']} s")
        for k in ("second_start", "warm_start"):
            if k in s:
                lines.append(f"{row} {k}: ready {s[k]['ready_s']} s after launch (before the text encode), weights "
                             f"{s[k]['weights_GBps']} GB/s, process start to bundle load {s[k]['process_to_load_s']} s")
    if ctx.tiny:
        lines.append("--tiny: the tiny config on the CPU proves the flow; its numbers and the bars mean nothing")
    else:
        lines += [f"bar {k}: {'met' if v else 'NOT met'}" for k, v in bars.items()]
    for line in lines:
        ctx.log(line)


# ----------------------------------------------------------------------------------------------------------------------


def release_gpu_memory() -> None:
    """Hand this process's cached GPU memory back before a child (build, run) needs the GPU."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_load_only":
        load_only(*sys.argv[2:5])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="results JSON (merged across calls); a .log beside it")
    p.add_argument("--phase", default="checkpoint,reference,build,run", help=f"comma list of {PHASES}")
    p.add_argument("--rows", default="bf16,fp8", help=f"comma list of {list(ROWS)} (build and run, in order)")
    p.add_argument("--tiny", action="store_true", help="the same flow on the CPU with the tiny config")
    p.add_argument("--state", default=None, help="checkpoint and scratch (default /dev/shm/h3trt-e2e[-tiny])")
    p.add_argument("--bundles", default=None, help="where bundles are built (default /tmp/h3trt-e2e-bundles[-tiny]: "
                                                   "the disk; a bf16 bundle is ~52 GB)")
    p.add_argument("--full-steps", type=int, default=50, help="steps of the bf16 row (default 50: 49 evaluations)")
    p.add_argument("--short-steps", type=int, default=6, help="steps of the other rows (default 6: 5 evaluations, "
                                                              "extrapolated to 49)")
    p.add_argument("--ref-evals", type=int, default=3, help="Diffusers evaluations (the first a warm-up)")
    p.add_argument("--eager-evals", type=int, default=2, help="h3trt eager evaluations (the first a warm-up)")
    p.add_argument("--ref-decodes", type=int, default=2, help="Diffusers VAE decodes (the first a warm-up)")
    p.add_argument("--second-start", default="", help="rows whose bundle is loaded again (load only) with the "
                                                      "verified-once record present, pages evicted (comma list)")
    p.add_argument("--warm-run", default="fp8", help="rows run again with the bundle's pages cached and the "
                                                     "verified-once record present (comma list, '' for none)")
    p.add_argument("--profile-step", type=int, default=4, help="the step whose host overhead the run profiles")
    p.add_argument("--keep-bundles", action="store_true", help="keep each bundle after its run")
    p.add_argument("--budget-s", type=float, default=None, help="stop subprocesses in time to write the results "
                                                                 "(default 560: a device call may not exceed 600 s; "
                                                                 "--tiny: 3600)")
    args = p.parse_args()
    suffix = "-tiny" if args.tiny else ""
    args.state = args.state or f"/dev/shm/h3trt-e2e{suffix}"
    args.bundles = args.bundles or f"/tmp/h3trt-e2e-bundles{suffix}"
    args.second_start = [r for r in args.second_start.split(",") if r]
    args.warm_run = [r for r in args.warm_run.split(",") if r]
    args.budget_s = args.budget_s or (3600.0 if args.tiny else 560.0)
    phases = [x for x in args.phase.split(",") if x]
    rows = [x for x in args.rows.split(",") if x]
    for x in phases:
        if x not in PHASES:
            p.error(f"--phase {x!r}: choose from {PHASES}")
    for x in rows + args.second_start + args.warm_run:
        if x not in ROWS:
            p.error(f"--rows / --second-start / --warm-run {x!r}: choose from {list(ROWS)}")
    ctx = Ctx(args)
    ctx.results.setdefault("calls", []).append({"phases": phases, "rows": rows, "started_unix": ctx.started,
                                                "env": ctx.env()})
    ctx.results["env"] = ctx.env()
    ctx.log(f"bench_e2e: phases {phases}, rows {rows}, state {ctx.state}, bundles {ctx.bundles}, "
            f"disk free {shutil.disk_usage(ctx.bundles.parent).free / 1e9:.0f} GB")
    try:
        if "checkpoint" in phases:
            phase_checkpoint(ctx)
            release_gpu_memory()
            ctx.save()
        if "reference" in phases:
            phase_reference(ctx)
            release_gpu_memory()
            ctx.save()
        for row in rows:
            if "build" in phases:
                phase_build(ctx, row)
                ctx.save()
            if "run" in phases:
                phase_run(ctx, row)
                ctx.save()
    finally:
        ctx.results["calls"][-1]["seconds"] = round(time.time() - ctx.started, 1)
        summarise(ctx)
        ctx.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
