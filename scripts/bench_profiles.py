"""The speed profiles end to end (issue 46 item 4): one full-size fp8 bundle with --fp8-attention and
--sparse-attention, baked for the 50-step schedule, and the same request at lossless, quality, balanced and fast, each
cached profile again at --cache-threshold inf (every hit its warm-up and limit allow) and balanced at 0 (sparse only,
no hits: the bar's row), one fresh process per profile.

    # one H100 80 GB, two device calls on one warm machine (the bundle stays in /tmp between them):
    python scripts/bench_e2e.py --phase checkpoint,build --rows fp8-sparse --short-steps 8 --keep-bundles \\
        --out bench/results/profiles_build_h100.json                                      # call 1: ~5 min
    python scripts/bench_profiles.py --bundle /tmp/h3trt-e2e-bundles/bundle-fp8-sparse \\
        --out bench/results/profiles_h100.json                                            # call 2: ~6 min
    python scripts/bench_profiles.py --tiny --bundle BUNDLE --out /tmp/profiles_tiny.json  # the flow on the CPU

The build is bench_e2e.py's (its checkpoint phase, e2e_checkpoint.py, and its fp8-sparse row: --steps 50,SHORT,
streamed where the DiT does not fit the card), not another copy of it.

What is measured and what is extrapolated (said again in the JSON's `method`):
  - Each profile runs the SHORT schedule (--short-steps, default 8: 7 evaluations; baked in the bundle beside the 50
    steps), its knobs shortened in proportion so that every kind of evaluation occurs: the first --short-dense
    evaluations dense (the profile's 10 at 50 steps) and the cache's warm-up --short-warmup (its 4). Measured there:
    the seconds of each evaluation (the record's step marks), each one's kind (computed dense, computed sparse,
    cached: the record's sparse_evaluations and the cache's skipped steps), the clip's wall time and its fixed part
    (wall less the denoise: text encoding, decode, mux), the load (cold start, reported apart), and the distances of
    its clip to the lossless one of the same schedule: SSIM and PSNR in YUV420 (h3trt/eval.py, FFmpeg's filters'
    arithmetic) over the decoded MP4s, and the audio's log-spectral distance.
  - Extrapolated: the 50-step clip's seconds = fixed part + its counts x the per-evaluation times of their kind.
    The counts are exact where the cache's decisions do not depend on the residuals: no cache, threshold inf (every
    hit the profile's warm-up 4 and limit allow) and threshold 0 (no hit); at a profile's own threshold they depend
    on the model's residuals, so no 50-step figure is given there (the short run's own counts are).
  - Random weights: the cache's hits are not the real model's, and the distances are numerical distance between
    clips, not picture quality.
Every phase and profile is bounded by a timeout, progress lines carry the seconds since the start, and --out is
rewritten (atomically) after every profile.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_common import ROOT, write_json

# name: (profile, --cache-threshold or None for the profile's own). The bars' rows first: a call cut short keeps them.
VARIANTS = {"lossless": ("lossless", None), "balanced_t0": ("balanced", 0.0), "fast_inf": ("fast", math.inf),
            "balanced": ("balanced", None), "fast": ("fast", None), "quality": ("quality", None),
            "quality_inf": ("quality", math.inf), "balanced_inf": ("balanced", math.inf)}
# The 50-step knobs of each profile (request/fields.py PROFILES): cache (warm-up, max skips in a row) or None,
# sparse attention's dense evaluations or None.
FULL_KNOBS = {"lossless": (None, None), "quality": ((4, 1), None), "balanced": ((4, 3), 10), "fast": ((4, 3), 10)}
BARS = {"balanced_t0": 0.75, "fast_inf": 0.30}  # the clip's seconds / lossless's, at most (issue 46)
PROMPT = "A red fox runs through the snowy forest at sunset, and the camera follows it"
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f} s] {msg}", flush=True)


def cached_evaluations(n: int, warmup: int, max_skip: int | None, threshold: float) -> list[int] | None:
    """The evaluations a first-block cache skips when its decisions need no residual (models/step_cache.py): at
    threshold inf every one the warm-up and the limit allow, at 0 none; None for any other threshold."""
    if threshold == 0:
        return []
    if threshold != math.inf:
        return None
    hits, run = [], 0
    for i in range(n):
        if i > 0 and i >= warmup and (max_skip is None or run < max_skip):
            hits.append(i)
            run += 1
        else:
            run = 0
    return hits


def counts(n: int, profile: str, threshold: float | None, warmup=None, dense=None) -> dict | None:
    """{dense, sparse, cached} evaluations of `n` under a profile's knobs (its 50-step ones, or the short run's
    `warmup` and `dense`); None where the cache's hits depend on the residuals."""
    cache, sparse_dense = FULL_KNOBS[profile]
    hits = []
    if cache is not None:
        hits = cached_evaluations(n, warmup if warmup is not None else cache[0], cache[1],
                                  threshold if threshold is not None else -1.0)
        if hits is None:
            return None
    first_sparse = n if sparse_dense is None else (dense if dense is not None else sparse_dense)
    computed = [i for i in range(n) if i not in hits]
    return {"dense": sum(i < first_sparse for i in computed), "sparse": sum(i >= first_sparse for i in computed),
            "cached": len(hits)}


def run_command(args, variant: str, clip: Path) -> list[str]:
    profile, threshold = VARIANTS[variant]
    cache, sparse_dense = FULL_KNOBS[profile]
    width, height = (160, 96) if args.tiny else (1344, 768)
    cmd = [sys.executable, "-m", "h3trt.cli", "run", "--engine", str(args.bundle), "--prompt", PROMPT, "--output",
           str(clip), "--width", str(width), "--height", str(height), "--duration", "5", "--steps",
           str(args.short_steps), "--profile", profile, "--quiet", "--overwrite"]
    if threshold is not None:
        cmd += ["--cache-threshold", "inf" if threshold == math.inf else str(threshold)]
    if cache is not None:
        cmd += ["--cache-warmup", str(args.short_warmup)]
    if sparse_dense is not None:
        cmd += ["--sparse-dense-steps", str(args.short_dense)]
        if args.tiny:
            cmd += ["--sparse-min-seq", "64"]  # the tiny clip's 1,021 rows are under the default 4096
    return cmd


def evaluation_kinds(record: dict) -> tuple[list[float], list[str]]:
    """(seconds of each evaluation, its kind: dense, sparse or cached) from a clip record."""
    marks = record["step_marks_s"]
    seconds = [b - a for a, b in zip([0.0, *marks[:-1]], marks)]
    cache = record.get("step_cache") or {}
    cached = {i for b in (cache.get("branches") or {}).values() for i in b.get("skipped_steps", [])}
    sparse = set((record.get("sparse_attention") or {}).get("sparse_evaluations") or [])
    return seconds, ["cached" if i in cached else "sparse" if i in sparse else "dense" for i in range(len(seconds))]


def unit_ms(seconds: list[float], kinds: list[str]) -> dict:
    """Mean ms of an evaluation of each kind; the first evaluation left out where its kind has others (warm-up)."""
    out = {}
    for kind in ("dense", "sparse", "cached"):
        times = [s for i, (s, k) in enumerate(zip(seconds, kinds)) if k == kind]
        if len(times) > 1 and kinds[0] == kind:
            times = times[1:]
        out[kind] = 1000 * sum(times) / len(times) if times else None
    return out


def distances(clip: Path, lossless: Path) -> dict:
    """SSIM and PSNR in YUV420 and the audio's log-spectral distance of `clip` against the lossless clip (decoded)."""
    from h3trt.eval import log_spectral_distance, yuv420_metrics
    from h3trt.media.inputs import read_video

    (a, _, wa), (b, _, wb) = read_video(clip), read_video(lossless)
    frames = [torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255.0 for x in (a, b)]
    out = yuv420_metrics(*frames)
    if wa is not None and wb is not None:
        n = min(wa.shape[-1], wb.shape[-1])
        out["audio_lsd_db"] = log_spectral_distance(torch.from_numpy(wa[:, :n]), torch.from_numpy(wb[:, :n]))
    return out


def profile_row(args, variant: str, outdir: Path, xdg: Path) -> dict:
    """One profile in a fresh process: its record, per-kind times, counts and the 50-step extrapolation."""
    clip = outdir / f"{variant}.mp4"
    cmd = run_command(args, variant, clip)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "XDG_CACHE_HOME": str(xdg)}
    log(f"{variant}: {' '.join(cmd[2:])}")
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.profile_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.profile_timeout:.0f} s"}
    row = {"command": " ".join(cmd[2:]), "process_s": round(time.time() - t0, 2), "rc": proc.returncode}
    if proc.returncode != 0 or not clip.with_suffix(".json").exists():
        return {**row, "error": proc.stderr[-1500:]}
    record = json.loads(clip.with_suffix(".json").read_text())
    seconds, kinds = evaluation_kinds(record)
    units = unit_ms(seconds, kinds)
    denoise = record["timings_s"]["denoise"]
    profile, threshold = VARIANTS[variant]
    full = counts(args.full_steps - 1, profile, threshold)
    row.update(wall_s=record["wall_s"], denoise_s=denoise, fixed_s=record["wall_s"] - denoise,
               load=record.get("load"), evaluation_s=seconds, evaluation_kinds=kinds, unit_ms=units,
               short_counts={k: kinds.count(k) for k in ("dense", "sparse", "cached")},
               short_counts_simulated=counts(len(kinds), profile, threshold, args.short_warmup, args.short_dense),
               sparse_attention=record.get("sparse_attention"), step_cache=record.get("step_cache"),
               counts_50=full)
    return row


def run(args) -> dict:
    out = json.loads(args.out.read_text()) if args.out.exists() else {}
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu"
    out.update(env={"device": name, "torch": torch.__version__, "bundle": str(args.bundle)},
               method=__doc__.split("What is measured")[1].split("Every phase")[0].strip(),
               short_steps=args.short_steps, full_steps=args.full_steps, rows=out.get("rows", {}), finished=False)
    outdir, xdg = args.work / "clips", args.work / "xdg"
    outdir.mkdir(parents=True, exist_ok=True)
    xdg.mkdir(parents=True, exist_ok=True)
    for variant in args.variants:
        if time.time() - T0 > args.budget_s - args.profile_timeout:
            out["rows"][variant] = {"error": "not run: the call's --budget-s would not hold another profile"}
            log(f"{variant}: {out['rows'][variant]['error']}")
            continue
        row = profile_row(args, variant, outdir, xdg)
        lossless = outdir / "lossless.mp4"
        if "error" not in row and lossless.exists():
            row["vs_lossless"] = distances(outdir / f"{variant}.mp4", lossless)
        out["rows"][variant] = row
        summarise(out)
        log(f"{variant}: " + (row["error"][-300:] if "error" in row else
                              f"wall {row['wall_s']:.1f} s, kinds {row['short_counts']}, ms {row['unit_ms']}, "
                              f"50-step clip {row.get('clip_50_s')} s, vs lossless {row.get('vs_lossless')}"))
        write_json(args.out, out)
    out["finished"] = True
    write_json(args.out, summarise(out))
    return out


def clip_50(rows: dict, name: str) -> tuple[float | None, dict]:
    """A row's 50-step seconds: its fixed part + its 50-step counts x the per-evaluation ms of their kind, its own
    where its short run had that kind, else those of another row of the same profile (the same kernels and
    sparsity: the short run of a cached profile may compute no sparse evaluation); (None, {}) where a count or a
    time is missing. Also {kind: the row it took the time from}."""
    row = rows[name]
    if "error" in row or row.get("counts_50") is None:
        return None, {}
    total, borrowed = row["fixed_s"], {}
    for kind, n in row["counts_50"].items():
        if not n:
            continue
        sources = [name] + [o for o, r in rows.items() if o != name and "error" not in r
                            and VARIANTS[o][0] == VARIANTS[name][0]]
        source = next((o for o in sources if rows[o]["unit_ms"].get(kind) is not None), None)
        if source is None:
            return None, {}
        if source != name:
            borrowed[kind] = source
        total += rows[source]["unit_ms"][kind] / 1000 * n
    return total, borrowed


def summarise(out: dict) -> dict:
    """Each row's 50-step seconds, against lossless's, and the bars."""
    rows = out["rows"]
    for name in rows:
        if "error" not in rows[name]:
            rows[name]["clip_50_s"], rows[name]["unit_ms_borrowed_from"] = clip_50(rows, name)
    base = rows.get("lossless", {}).get("clip_50_s")
    for name, row in rows.items():
        if base and row.get("clip_50_s"):
            row["clip_50_vs_lossless"] = row["clip_50_s"] / base
    out["bars"] = {n: {"ratio": rows[n].get("clip_50_vs_lossless"), "bar": most,
                       "met": None if rows.get(n, {}).get("clip_50_vs_lossless") is None
                       else rows[n]["clip_50_vs_lossless"] <= most} for n, most in BARS.items() if n in rows}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True, help="the fp8 sparse bundle (bench_e2e.py's fp8-sparse row, "
                                                               "--keep-bundles), baked for --full-steps and "
                                                               "--short-steps")
    p.add_argument("--out", type=Path, required=True, help="results JSON (merged with an existing one)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--short-steps", type=int, default=8, help="the timed run's steps (default 8: 7 evaluations)")
    p.add_argument("--full-steps", type=int, default=50, help="the clip extrapolated to (default 50: 49 evaluations)")
    p.add_argument("--short-dense", type=int, default=2, help="the short run's dense evaluations (a profile's 10)")
    p.add_argument("--short-warmup", type=int, default=2, help="the short run's cache warm-up (a profile's 4)")
    p.add_argument("--profile-timeout", type=float, default=150.0, help="seconds a profile's process may run")
    p.add_argument("--budget-s", type=float, default=560.0, help="no profile starts past this minus its timeout")
    p.add_argument("--work", type=Path, default=Path("/dev/shm/h3trt-profiles"), help="clips and the user cache")
    p.add_argument("--tiny", action="store_true", help="a tiny bundle on the CPU (160x96)")
    args = p.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not (args.bundle / "manifest.json").exists():
        p.error(f"unknown --variants {unknown}" if unknown else f"no bundle at {args.bundle}")
    if "lossless" in args.variants:
        args.variants = ["lossless", *[v for v in args.variants if v != "lossless"]]  # the others compare to it
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
