"""Step caching on one GPU: evaluations skipped and latent error against the uncached run by threshold, and the
denoise speedup (issue 21's bar: a threshold that skips >= 30% of the evaluations makes denoise >= 1.35x faster).

Shape: the released H3 DiT's width (hidden 5376, 56 heads x 128, SwiGLU 14336, time and AdaLN dims as released) with
--layers blocks (default 50, the released depth: a first-block skip still runs block 0, embed and final, so the depth
sets what a skip saves) and random bf16 weights, on the eager path (the reference modules; a bundle runs the same
block stack through the same cache), one t2va sequence for --width x --height x --seconds with --text-rows text rows,
--steps grid points (steps - 1 evaluations), the sampler and step cache of h3trt.

RANDOM WEIGHTS: the numbers are numeric only (which evaluations a threshold skips on this random model and how far
the final latents move); they say nothing about picture quality, and real-weight thresholds and MagCache ratios
differ. MagCache takes its ratios from a calibration run of this same model and schedule (recorded in the JSON).

Runs, after a warm-up evaluation: uncached (timed), MagCache calibration (every block runs; its latents must equal
the uncached ones bit for bit), first-block at each --fbc-thresholds, MagCache at each --mag-thresholds.

    python scripts/bench_step_cache.py --json bench/results/step_cache_h200.json     # one H200, about 2 minutes
    python scripts/bench_step_cache.py --tiny --json /tmp/step_cache_cpu.json        # CPU dry run, toy size

Needs only torch and h3trt (no diffusers, no weights, no text encoder or VAE).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from bench_common import rel_err, sync  # first: it puts this checkout on sys.path

from h3trt.models.config import H3Config
from h3trt.models.dit import EagerDiT, build_dit, rope_inv_freq
from h3trt.models.packing import Geometry, frames_for_duration, pack_t2va, text_tags_for
from h3trt.models.runner import EvalExtras
from h3trt.models.sampler import Latents, Schedule, denoise, initial_latents
from h3trt.models.step_cache import StepCache, StepCacheConfig

BAR_SKIPPED, BAR_SPEEDUP = 0.30, 1.35


def random_model(cfg: H3Config, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Allocated once in the checkpoint's dtypes (meta, then to_empty: a full-size fp32 copy would not fit), then
    variance-preserving random weights: matrices N(0, 1 / fan_in), norms 1, biases N(0, 0.02)."""
    model = build_dit(cfg, dtype, device="meta").to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2]:
                p.fill_(1.0)
            elif p.ndim == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:
                p.normal_(0.0, 0.02)
    model.rope_inv_freq = rope_inv_freq(cfg).to(device)  # a non-persistent buffer: to_empty left it uninitialised
    return model.eval()


def run(dit, latents: Latents, text, layout, schedule: Schedule, config: StepCacheConfig | None, device):
    """One denoise: (final latents, seconds, cache report or None)."""
    cache = StepCache(config, schedule.num_evaluations) if config is not None else None
    ctx = cache.context("cond") if cache is not None else None

    def model(video, audio, unique_t, t_index):
        return dit(video, audio, text, unique_t, t_index, layout, EvalExtras(cache=ctx))

    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        final = denoise(model, latents, layout, schedule)
    sync(device)
    return final, time.perf_counter() - start, (cache.report() if cache is not None else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True, help="write the results here")
    p.add_argument("--tiny", action="store_true", help="CPU dry run: the tiny config, fp32")
    p.add_argument("--layers", type=int, default=50)
    p.add_argument("--width", type=int, default=448)
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--text-rows", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="sigma grid points (steps - 1 evaluations)")
    p.add_argument("--fbc-thresholds", default="0.05,0.1,0.2,0.35")
    p.add_argument("--mag-thresholds", default="0.06,0.15,0.3,0.6")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda"))
    if args.tiny:
        cfg, dtype = H3Config.tiny(), torch.float32
        args.width, args.height, args.text_rows = 160, 96, 16
    else:
        cfg, dtype = H3Config(num_layers=args.layers), torch.bfloat16
    geo = Geometry(args.height, args.width, frames_for_duration(args.seconds))
    layout = pack_t2va(text_tags_for(args.text_rows), geo.latent_frames, geo.latent_height, geo.latent_width,
                       geo.audio_latents, cfg.patch_size)
    schedule = Schedule(args.steps, 12.0, 3.0)
    n = schedule.num_evaluations

    t0 = time.perf_counter()
    dit = EagerDiT(random_model(cfg, dtype, device))
    init_s = time.perf_counter() - t0
    start = initial_latents(0, geo.latent_frames, geo.latent_height, geo.latent_width, geo.audio_latents,
                            cfg.patch_size, cfg.in_channels, cfg.audio_in_channels)
    start = Latents(start.video.to(device), start.audio.to(device))
    text = torch.randn(1, args.text_rows, cfg.text_dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    lay = layout.to(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"step cache bench on {gpu}: {cfg.num_layers} layers x hidden {cfg.hidden_size}, {cfg.num_heads} heads x "
          f"{cfg.head_dim}, {str(dtype).removeprefix('torch.')}, random weights; {args.width}x{args.height}x"
          f"{args.seconds:g}s -> {layout.seq_len} packed rows; {args.steps} steps ({n} evaluations); model init "
          f"{init_s:.1f} s", file=sys.stderr)

    run(dit, start, text, lay, Schedule(2, 12.0, 3.0), None, device)  # warm-up: kernels, allocator
    base, base_s, _ = run(dit, start, text, lay, schedule, None, device)
    calib, calib_s, calib_report = run(dit, start, text, lay, schedule, StepCacheConfig("mag", 0.0, calibrate=True),
                                       device)
    ratios = tuple(calib_report["branches"]["cond"]["mag_ratios_calibrated"])
    calibration_exact = torch.equal(calib.video, base.video) and torch.equal(calib.audio, base.audio)
    cv, ca = layout.num_condition_video_rows, layout.num_condition_audio_rows

    configs = [StepCacheConfig("first-block", float(t)) for t in args.fbc_thresholds.split(",")]
    configs += [StepCacheConfig("mag", float(t), ratios) for t in args.mag_thresholds.split(",")]
    rows = []
    for config in configs:
        final, seconds, report = run(dit, start, text, lay, schedule, config, device)
        skipped = report["skipped"]
        rows.append({"kind": config.kind, "threshold": config.threshold, "computed": report["computed"],
                     "skipped": skipped, "skipped_fraction": round(skipped / n, 4),
                     "skipped_steps": report["branches"]["cond"]["skipped_steps"],
                     "relative_change": report["branches"]["cond"].get("relative_change"),
                     "video_rel_err": rel_err(final.video[cv:], base.video[cv:]),
                     "audio_rel_err": rel_err(final.audio[ca:], base.audio[ca:]),
                     "denoise_s": round(seconds, 4), "speedup": round(base_s / seconds, 3)})

    passing = [r for r in rows if r["skipped_fraction"] >= BAR_SKIPPED and r["speedup"] >= BAR_SPEEDUP]
    print(f"\n{'cache':<12}{'thresh':>8}{'skipped':>10}{'frac':>7}{'video err':>11}{'audio err':>11}"
          f"{'denoise s':>11}{'speedup':>9}")
    print(f"{'none':<12}{'-':>8}{0:>6}/{n:<3}{0.0:>7.2f}{0.0:>11.2e}{0.0:>11.2e}{base_s:>11.3f}{1.0:>9.2f}")
    for r in rows:
        print(f"{r['kind']:<12}{r['threshold']:>8g}{r['skipped']:>6}/{n:<3}{r['skipped_fraction']:>7.2f}"
              f"{r['video_rel_err']:>11.2e}{r['audio_rel_err']:>11.2e}{r['denoise_s']:>11.3f}{r['speedup']:>9.2f}")
    best = passing[0] if passing else None
    verdict = (f"bar met: {best['kind']} at {best['threshold']:g} skips {best['skipped_fraction']:.0%} and is "
               f"{best['speedup']:.2f}x faster" if passing else
               f"bar NOT met: no run skips >= {BAR_SKIPPED:.0%} at >= {BAR_SPEEDUP}x")
    print(f"\n{verdict} (random weights: numeric only); MagCache calibration latents equal uncached: "
          f"{calibration_exact}")

    result = {
        "what": "step caching: evaluations skipped, final-latent error vs uncached, denoise speedup (issue 21)",
        "weights": "random (numeric only: no statement about picture quality)",
        "device": str(device), "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
        "precision": str(dtype).removeprefix("torch."), "config": cfg.to_dict(),
        "geometry": {"width": args.width, "height": args.height, "seconds": args.seconds,
                     "latent": [geo.latent_frames, geo.latent_height, geo.latent_width],
                     "audio_latents": geo.audio_latents,
                     "text_rows": args.text_rows, "seq_len": layout.seq_len},
        "schedule": {"steps": args.steps, "evaluations": n, "video_shift": 12.0, "audio_shift": 3.0},
        "model_init_s": round(init_s, 2),
        "uncached": {"denoise_s": round(base_s, 4), "s_per_evaluation": round(base_s / n, 4)},
        "mag_calibration": {"denoise_s": round(calib_s, 4), "ratios": list(ratios),
                            "latents_equal_uncached": calibration_exact},
        "runs": rows,
        "bar": {"skipped_fraction": BAR_SKIPPED, "speedup": BAR_SPEEDUP, "met": bool(passing),
                "runs_meeting_it": [(r["kind"], r["threshold"]) for r in passing]},
    }
    if not all(math.isfinite(r["video_rel_err"]) for r in rows):
        print("warning: non-finite latent error (random weights overflowed?)", file=sys.stderr)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
