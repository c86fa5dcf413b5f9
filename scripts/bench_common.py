"""What the benches in scripts/ share, instead of a copy each: this checkout on sys.path, the device of a JSON result's
header, timing with the device synchronised (CUDA events on a GPU, the wall clock on the CPU), relative error, result
writing, energy and memory from NVML, and the Diffusers reference set-up (the released audio VAE, the rotary table a
model built on the meta device must get again).

Import it before h3trt: it puts this checkout first on sys.path, so that a bench measures the code beside it.
"""

from __future__ import annotations

import bisect
import json
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The released MiniMax-H3 audio VAE: its config.json and its latents' statistics (mean 0 / std 1 for random weights).
RELEASED_AUDIO_VAE = ({"encoder_dim": 64, "encoder_rates": [2, 4, 4, 5, 5], "latent_dim": 2048, "vae_latent_channels": 32,
                       "decoder_dim": 1024, "decoder_rates": [5, 5, 2, 2, 2, 2, 2], "sample_rate": 32000},
                      {"latents_mean": [0.0] * 32, "latents_std": [1.0] * 32, "sample_rate": 32000,
                       "latent_channels": 32})


def device_name(device: torch.device | str) -> str:
    """The GPU's name for a results header, or "cpu"."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(device: torch.device, fn):
    """(fn's result, seconds it took), the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def median_ms(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Median milliseconds of `iters` calls after `warmup`: CUDA events on a GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def peak_gib(device: torch.device) -> float | None:
    """The CUDA caching allocator's peak since its last reset, GiB (None on the CPU)."""
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def record_row(result: dict, name: str, fn, device: torch.device, iters: int, warmup: int, path: Path | None,
               started: float) -> None:
    """One timed row of a bench: result["ms"][name] = median_ms(fn), or result["skipped"][name] = why it failed (a
    failing kernel is a row of the report, never the end of the run); printed with the seconds since `started`, and
    the results written at once (a run cut short keeps every finished row)."""
    try:
        result["ms"][name] = median_ms(fn, device, iters, warmup)
        said = f"{result['ms'][name]:9.3f} ms"
    except Exception as e:  # noqa: BLE001
        result["skipped"][name] = said = f"failed: {type(e).__name__}: {e}"[:800]
        traceback.print_exc()
    print(f"[{time.perf_counter() - started:7.1f} s] {name:30s} {said}", flush=True)
    write_json(path, result)


def write_json(path: Path | None, data: dict) -> None:
    """The results as indented JSON, written whole (a partial file renamed into place); None: nowhere."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(data, indent=1, default=float))
    tmp.replace(path)


def released_audio_vae():
    """Diffusers' audio VAE at the released architecture (random weights)."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    from h3trt.models.checkpoint.vae import audio_vae_kwargs

    return AutoencoderKLMiniMaxH3Audio(**audio_vae_kwargs(*RELEASED_AUDIO_VAE))


def rebuild_video_vae_rope(video, device) -> None:
    """The video decoder's rotary table is a non-persistent buffer: rebuilt after to_empty / meta, as the loader
    does."""
    cfg = video.config
    video.decoder.rope = type(video.decoder.rope)(int(cfg.decoder_attention_head_dim * cfg.decoder_rope_dim_ratio),
                                                  theta=cfg.decoder_rope_theta).to(device)


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
            i = min(max(bisect.bisect_left(t, x), 1), len(t) - 1)
            if t[i] == t[i - 1]:
                return e[i]
            return e[i - 1] + (e[i] - e[i - 1]) * (x - t[i - 1]) / (t[i] - t[i - 1])

        return round(at(b) - at(a), 1)

    def peak_memory_gib(self) -> float | None:
        return round(max(s[2] for s in self.samples) / 2**30, 2) if self.available and self.samples else None


def timed_runs(fn, device: torch.device, runs: int, nvml: NvmlSampler) -> tuple[dict, object]:
    """Run fn `runs` times; the first is a warm-up (reported apart); seconds and joules of the others, and the last
    result."""
    seconds, joules, out = [], [], None
    for _ in range(runs):
        sync(device)
        a, ta = time.perf_counter(), time.time()
        out = fn()
        sync(device)
        seconds.append(time.perf_counter() - a)
        joules.append(nvml.joules(ta, time.time()))
    timed = seconds[1:] or seconds
    j = [x for x in (joules[1:] or joules) if x is not None]
    return {"first_s": round(seconds[0], 4), "s": round(statistics.median(timed), 4), "runs": runs,
            "timed_runs": len(timed), "joules": round(statistics.median(j), 1) if j else None}, out
