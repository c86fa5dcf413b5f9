"""Distilled checkpoints at full size on one GPU (issue 47's table), in two plans:

  --plan moonshot (default): the whole table in ONE ~9-minute H100 call (scripts/distilled_moonshot.py's docstring
      says what is measured and what is computed): the full-size random checkpoint, a FastH3-VSA file, one fp8
      FastH3-VSA bundle, and in one `h3trt run --requests` process its 4-step VSA clip, the same clip dense and the VSA
      clip warm; Turbo 4/8-step and PDD 8-step computed from that bundle's dense clip (upper bounds, said so).
  --plan families: one fp8 bundle and one clip per family, measured (`--families`), two families a call.

    python scripts/bench_distilled.py --out bench/results/distilled_h100.json                   # moonshot, one H100
    python scripts/bench_distilled.py --plan families --families turbo4,turbo8 --out ...         # families, a call
    python scripts/bench_distilled.py --tiny --out /tmp/distilled_tiny.json                     # the flow, CPU

Families (--plan families rows): fasth3 (FastH3 v1: fastvideo-lora-v2 rank 64 with the VSA gates, its 4 forwards on
the release's rungs, VSA at 0.9; no FP8 attention: a VSA model refuses it), turbo4 / turbo8 (LightX2V PEFT rank 128,
header alpha 128, 768p shifts 6/3; 4 and 8 forwards), pdd8 (alibaba-pai Acc LoRA, rank 64, the 32-head banks; 8
forwards). Each row records the build and the run: `e2e_s` is the clip's wall time from text encode to the finished
MP4 with the bundle loaded (the record's wall_s), and beside it the cold start, each stage's seconds (text encode,
denoise, video decode, audio decode, mux, the host tail) and peak memory.

On random weights the clips are noise: the timings hold, the pictures mean nothing.

Device minutes of --plan families (estimates from bench_e2e's H200 calls: checkpoint ~0.6 min, an fp8 build ~3.7 min
up to its fresh-process check, a run ~0.5 min at 4-8 forwards): the files ~0.5 min; a family ~4.2 min. One call of 9.5
min holds the checkpoint, the files and two families: call 1 --families fasth3,pdd8 (~9.3 min), call 2 --families
turbo4,turbo8 (~9.2 min, the checkpoint rewritten when the machine was released: +0.6). --out merges across calls.
--budget-s (default 560) skips a family whose build would not finish in time (estimated from the previous build, else
240 s) and stops subprocesses in time to write the JSON; the JSON is written after every phase.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from e2e_ctx import Ctx, release_gpu_memory
from distilled_moonshot import moonshot
from e2e_bundle import bytecode_note, evict_page_cache
from e2e_checkpoint import BASE_PROMPT, checkpoint_complete, phase_checkpoint
from e2e_summary import summarise_run
from bench_common import NvmlSampler

# family row: (writer, writer kwargs, --distilled keys after '@')
FAMILIES = {
    "fasth3": ("fasth3", {"gates": True}, ""),
    "turbo4": ("turbo", {"alpha": 128.0}, "@steps=5,video_shift=6,audio_shift=3"),
    "turbo8": ("turbo", {"alpha": 128.0}, "@steps=9,video_shift=6,audio_shift=3"),
    "pdd8": ("pdd", {}, "@steps=9"),
}
DEFAULT_BUILD_S = 240.0  # an fp8 build's estimate until one was timed in this call


def phase_files(ctx: Ctx, families: list[str]) -> None:
    """One random file per format the families need, for the checkpoint's config (reused when present)."""
    from h3trt.models.distilled.writer import write_fasth3, write_pdd, write_turbo

    files = ctx.results.setdefault("files", {})
    rank = 4 if ctx.tiny else 64
    for kind in sorted({FAMILIES[f][0] for f in families}):
        path = ctx.state / f"distilled-{kind}.safetensors"
        marker = path.with_suffix(".json")
        if path.exists() and marker.exists():
            files[kind] = {**json.loads(marker.read_text()), "reused": True}
            continue
        t0 = time.perf_counter()
        if kind == "fasth3":
            write_fasth3(path, ctx.cfg, seed=47, rank=rank, gates=True, dtype=torch.bfloat16, device=ctx.device)
            info = {"gates": True, "variant": "vsa-datafree (the .set_weight gates)"}
        elif kind == "pdd":
            write_pdd(path, ctx.cfg, seed=48, rank=rank, dtype=torch.bfloat16)
            info = {}
        else:
            write_turbo(path, ctx.cfg, seed=49, rank=2 * rank, alpha=128.0, dtype=torch.bfloat16)
            info = {"alpha": 128}
        info.update(bytes=path.stat().st_size, seconds=round(time.perf_counter() - t0, 2), path=str(path))
        marker.write_text(json.dumps(info))
        files[kind] = info
        ctx.log(f"files: {kind} {info['bytes'] / 1e9:.2f} GB in {info['seconds']:.1f} s")


def bundle_of(ctx: Ctx, family: str) -> Path:
    return ctx.bundles / f"distilled-{family}"


def phase_build(ctx: Ctx, family: str, estimate: float) -> float | None:
    """`h3trt build --distilled` (fp8, FP8 attention, calibration on one 2-point trajectory: scales, not quality, on
    random weights); the build's seconds, None when it failed or did not fit the budget."""
    row = ctx.results.setdefault("rows", {}).setdefault(family, {})
    if estimate > ctx.remaining() - 60:
        row["build"] = {"skipped": f"an fp8 build takes ~{estimate:.0f} s and {ctx.remaining():.0f} s of the call's "
                                   "budget are left: run this family in another call (--families)"}
        ctx.log(f"build {family}: {row['build']['skipped']}")
        return None
    kind, _, keys = FAMILIES[family]
    bundle = bundle_of(ctx, family)
    shutil.rmtree(bundle, ignore_errors=True)
    ctx.bundles.mkdir(parents=True, exist_ok=True)
    tmp = ctx.state / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "h3trt.cli", "build", "--model", str(ctx.ckpt), "--output", str(bundle),
           "--device", ctx.device.type, "--profile", f"{ctx.width}x{ctx.height}x5",
           "--distilled", f"{ctx.state / f'distilled-{kind}.safetensors'}{keys}"]
    if not ctx.tiny:  # a FastH3-VSA model refuses FP8 attention (its attention is VSA)
        cmd += ["--precision", "fp8", *(["--fp8-attention"] if family != "fasth3" else []), "--calib-prompts",
                str(ctx.state / "calib.txt"), "--calib-steps", "2"]
    cmd += shlex.split(ctx.args.build_flags)
    rc, seconds = ctx.subprocess(cmd, {"TMPDIR": str(tmp), "XDG_CACHE_HOME": str(ctx.state / "xdg-build")},
                                 f"build {family}", "build")
    build = {"rc": rc, "seconds": round(seconds, 2), "command": " ".join(cmd[2:])}
    if rc == 0:
        from h3trt.engines.manifest import read_manifest

        m = read_manifest(bundle)
        build.update(bundle_bytes=m.total_bytes, build_timings_s=m.build_timings_s, distilled=m.distilled)
    else:
        build["error"] = f"h3trt build exited {rc} (see {ctx.log_path})"
    row["build"] = build
    ctx.log(f"build {family}: rc {rc} in {seconds:.0f} s")
    return seconds if rc == 0 else None


def phase_run(ctx: Ctx, family: str) -> None:
    """`h3trt run --engine` in a fresh process, no schedule flag; e2e_s is the clip's wall (text encode to MP4)."""
    row = ctx.results.setdefault("rows", {}).setdefault(family, {})
    bundle = bundle_of(ctx, family)
    if not (bundle / "manifest.json").exists():
        row["run"] = {"error": f"no bundle at {bundle}"}
        return
    clip = ctx.state / "out" / f"{family}.mp4"
    clip.parent.mkdir(parents=True, exist_ok=True)
    xdg = ctx.state / f"xdg-run-{family}"
    shutil.rmtree(xdg, ignore_errors=True)
    xdg.mkdir(parents=True)
    evicted = evict_page_cache(bundle)
    prompt = (checkpoint_complete(ctx) or {}).get("prompt", BASE_PROMPT)
    cmd = [sys.executable, "-m", "h3trt.cli", "run", "--engine", str(bundle), "--prompt", prompt, "--output",
           str(clip), "--width", str(ctx.width), "--height", str(ctx.height), "--duration", "5", "--quiet",
           "--overwrite"]
    nvml = NvmlSampler().start()
    launched = time.time()
    rc, seconds = ctx.subprocess(cmd, {"XDG_CACHE_HOME": str(xdg)}, f"run {family}", phase="run")
    ended = time.time()
    nvml.stop()
    run = {"rc": rc, "process_s": round(seconds, 2), "page_cache": evicted, "python_bytecode": bytecode_note(),
           "command": " ".join(cmd[2:])}
    record_file = clip.with_suffix(".json")
    if rc != 0 or not record_file.exists():
        run["error"] = f"h3trt run exited {rc} (see {ctx.log_path})"
    else:
        record = json.loads(record_file.read_text())
        summary = summarise_run(record, launched, ended, nvml)
        for key in ("end_to_end_49_s", "energy_49_j", "extrapolated", "note"):  # a distilled clip runs its own count
            summary.pop(key, None)
        run.update(summary, e2e_s=record["wall_s"], timings_s=record["timings_s"],
                   tail_s=record.get("decode_tail_steps_s"), schedule=record["distilled"]["schedule"],
                   family=record["distilled"]["family"])
        record_file.unlink()
        clip.unlink(missing_ok=True)
        ctx.log(f"run {family}: e2e {run['e2e_s']:.2f} s ({run['evaluations']} forwards x {run['step_s']:.3f} s, "
                f"cold start {run['cold_start_s']:.1f} s)")
    row["run"] = run
    if not ctx.args.keep_bundles:
        shutil.rmtree(bundle, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="results JSON (merged across calls; the table's: "
                                                            "bench/results/distilled_<card>.json); a .log beside it")
    p.add_argument("--plan", choices=("moonshot", "families"), default="moonshot",
                   help="moonshot: the whole table in one call (one FastH3-VSA build; Turbo and PDD computed); "
                        "families: one build and clip per --families row")
    p.add_argument("--families", default="fasth3,pdd8", help=f"--plan families: comma list of {list(FAMILIES)}")
    p.add_argument("--tiny", action="store_true", help="the same flow on the CPU with the tiny config (bf16 bundles)")
    p.add_argument("--state", default=None, help="checkpoint, files, scratch (default /dev/shm/h3trt-e2e[-tiny]: "
                                                 "bench_e2e's, so its checkpoint is reused)")
    p.add_argument("--bundles", default=None, help="where bundles are built (default /tmp/h3trt-distilled-bundles)")
    p.add_argument("--keep-bundles", action="store_true", help="keep each bundle after its run")
    p.add_argument("--budget-s", type=float, default=None, help="the call's budget (default 560 s; --tiny 3600)")
    p.add_argument("--build-flags", default="",
                   help="more `h3trt build` flags for every build, e.g. '--memory-budget 0.0082' (--tiny) to build a "
                        "block at a time where the whole would fit (an H100 streams the full size on its own)")
    args = p.parse_args()
    suffix = "-tiny" if args.tiny else ""
    args.state = args.state or f"/dev/shm/h3trt-e2e{suffix}"
    args.bundles = args.bundles or f"/tmp/h3trt-distilled-bundles{suffix}"
    args.budget_s = args.budget_s or (3600.0 if args.tiny else 560.0)
    families = [f for f in args.families.split(",") if f]
    for f in families:
        if f not in FAMILIES:
            p.error(f"--families {f!r}: choose from {list(FAMILIES)}")
    ctx = Ctx(args)
    env = ctx.env()
    ctx.results["env"] = env
    ctx.results["card"] = env.get("gpu", "cpu")
    ctx.results["note"] = "random weights: timings only; the clips are noise"
    ctx.results.setdefault("calls", []).append({"plan": args.plan, "families": families if args.plan == "families"
                                                else None, "started_unix": ctx.started, "env": env})
    ctx.log(f"bench_distilled: --plan {args.plan} on {ctx.results['card']}, state {ctx.state}, budget "
            f"{args.budget_s:.0f} s")
    if args.plan == "moonshot":
        try:
            moonshot(ctx)
        finally:
            ctx.results["calls"][-1]["seconds"] = round(time.time() - ctx.started, 1)
            ctx.save()
        return 0 if ctx.results.get("measured") else 1  # no clip measured: a phase failed (the JSON says which)
    estimate = DEFAULT_BUILD_S if not ctx.tiny else 0.0
    try:
        phase_checkpoint(ctx)
        release_gpu_memory()
        ctx.save()
        phase_files(ctx, families)
        ctx.save()
        for family in families:
            seconds = phase_build(ctx, family, estimate)
            ctx.save()
            if seconds is not None:
                estimate = max(estimate, seconds)
                phase_run(ctx, family)
                ctx.save()
    finally:
        ctx.results["calls"][-1]["seconds"] = round(time.time() - ctx.started, 1)
        ctx.results["e2e_s"] = {f: r["run"]["e2e_s"] for f, r in ctx.results.get("rows", {}).items()
                                if "e2e_s" in r.get("run", {})}
        ctx.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
