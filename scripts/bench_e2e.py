"""A full-size clip end to end: `h3trt build` a full-size random checkpoint, then `h3trt run --engine` one 5 s
1344x768 clip in a fresh process (cold start split, per-step time, denoise, decode, mux, wall, gaps, peak memory,
energy), against the Diffusers reference on the same weights in the same run.

    python scripts/bench_e2e.py --out bench/results/e2e_h100.json    # one H100 80 GB, one call: the default plan
    python scripts/bench_e2e.py --out bench/results/e2e_h100.json --rows fp8-50   # the same, no sparse attention
    python scripts/bench_e2e.py --out bench/results/e2e_h200.json --phase checkpoint,reference,build,run --rows fp8
    python scripts/bench_e2e.py --out bench/results/e2e_h200.json --phase checkpoint,build,run --rows bf16
    python scripts/bench_e2e.py --out e2e_h200_stream.json --phase checkpoint,build --rows fp8 \
        --build-flags "--memory-budget 40"       # an H200 building a block at a time, against its whole build
    python scripts/bench_e2e.py --tiny --out /tmp/e2e_tiny.json --rows fp8-sparse,bf16   # the flow on the CPU, tiny

Phases (any subset, in this order; state between calls in --state, RAM-backed /dev/shm by default). Each runs in a
process of its own, stopped at its timeout (--timeout PHASE=S; also never past the call's --budget-s), and its results
land in --out as they come, so a call cut short keeps what it measured:
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
              49 evaluations + that decode (no text encode, audio decode or mux: in its favour). On an 80 GB card the
              full model is tried first (peak ~68 GiB once h3trt's copy is freed); if it runs out of memory the
              evaluation is timed with half and a quarter of the layers resident and extrapolated linearly to 50
              (e2e_reference.py says so in the results).
  build       `h3trt build` per row (bf16: --steps 50; the 50-step rows: --steps 50,SHORT, the schedule they serve
              and the one the timed run takes; other rows: --steps SHORT), in a fresh process. Its peak GPU memory
              (the manifest's build record) lands in the row as build.peak_gpu_gib; the build streams its blocks
              where the whole DiT does not fit the card (h3trt/build/memory.py).
  run         `h3trt run --engine` per row in a fresh process, the bundle's pages evicted from the page cache and an
              empty user cache (so no verified-once record: the first load of a copied bundle, every byte hashed);
              --profile-step 4 measures the host overhead of one step (the 4th: after the VAEs' background load).
              For --warm-run rows (default fp8) the same run again at once: pages cached, the record present (a node
              restarting its process). For --second-start rows a fresh process only loads the bundle, the record
              present and the pages evicted again. A row's bundle is deleted after its run unless --keep-bundles
              (disk: 64 GiB). Each run records whether Python found compiled bytecode (set PYTHONPYCACHEPREFIX and
              run compileall first to measure an install that has it: the H200 image has none).
Rows: bf16 (sp=1), fp8 (fp8 GEMMs + --fp8-attention, sp=1), bf16-sp2 and fp8-sp2 (need 2 GPUs), and the rows that
serve the 50-step clip: fp8-sparse (fp8 + FP8 attention + --sparse-attention 0.75: the build times FlashAttention-4's
block-sparse kernel where it loads against the FP8 Triton one and records the faster, build/sparse_choice.py) and
fp8-50 (the same without sparse attention). bf16 runs all 50 steps; other rows run --short-steps (6: 5 evaluations)
and are extrapolated to 49 evaluations (said in the output); fp8-sparse's timed run keeps its first 3 evaluations
dense and runs 2 sparse, and is extrapolated to the bundle's 50-step clip (its first 10 evaluations dense, 39 sparse)
from each kind's step time.

Device minutes. One H100 80 GB, the default plan (--rows fp8-sparse; estimates until a run records them, from the
H200's runs below and bench/README): checkpoint ~40 s; reference ~75 s (eager and Diffusers ~7 s an evaluation,
VAE decode ~7 s); build ~210 s (streamed: attention and sparse-kernel choice ~20 s, the block pass ~45 s, compile
~50 s, check ~25 s, hashing and copies ~40 s, start ~15 s); run ~60 s (cold start ~25 s, 5 evaluations ~17 s, decode
~7 s): ~6.5 min in all, under a 9.5-minute call (--budget-s 560 stops a call's phases in time to write the JSON).
One H200, from the first attempts (bench/results/e2e_h200_call*, e2e_h200_s7): checkpoint 37 s; reference 54 s;
build fp8 140-154 s whole; run fp8 ~0.9 min + warm run ~0.7 min; run bf16 ~4.5-5 min. Call 1: --phase
checkpoint,reference,build,run --rows fp8 (~6.5 min); call 2: --phase checkpoint,build,run --rows bf16 (~8.3 min).
--out merges into an existing file: copy call 1's JSON to call 2's --out path first, and the summary (speedup against
the Diffusers row) covers both.

The checkpoint and reference phases and the summaries are e2e_checkpoint.py, e2e_reference.py and e2e_summary.py;
the build and run phases are e2e_bundle.py; the context they run in (paths, results, log, budget) is e2e_ctx.py; what every bench shares (timing, NVML, results) is bench_common.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from e2e_ctx import PHASE_TIMEOUTS, Ctx
from e2e_bundle import ROWS, load_only, phase_build, phase_run
from e2e_checkpoint import phase_checkpoint
from e2e_reference import phase_reference
from e2e_summary import summarise

PHASES = ("checkpoint", "reference", "build", "run")


def in_own_process(ctx: Ctx, phase: str) -> None:
    """The checkpoint or reference phase in a child process (this script, `_phase NAME`), stopped at its timeout: a
    phase that hangs or overruns cannot take the later phases' time, and its GPU memory is the OS's to free. The
    child saves into --out as it measures; what it saved is merged back here."""
    ctx.save()
    rc, seconds = ctx.subprocess([sys.executable, __file__, "_phase", phase, *sys.argv[1:]], {}, phase, phase)
    ctx.results = json.loads(ctx.out.read_text())
    measured = {k: v for k, v in ctx.results.get(phase, {}).items() if isinstance(v, (int, float, str))}
    measured.update({k: v.get("s") for k, v in ctx.results.get(phase, {}).items() if isinstance(v, dict) and "s" in v})
    ctx.log(f"{phase}: {measured}")
    if rc != 0:
        entry = ctx.results.setdefault(phase, {})
        entry["error"] = (f"{'timed out' if rc == -9 else f'exited {rc}'} after {seconds:.0f} s (see {ctx.log_path})"
                          + (f"; measured before that: {sorted(k for k in entry if k != 'error')}" if entry else ""))
        ctx.log(f"{phase}: {entry['error']}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="results JSON (merged across calls); a .log beside it")
    p.add_argument("--phase", default="checkpoint,reference,build,run", help=f"comma list of {PHASES}")
    p.add_argument("--rows", default="fp8-sparse", help=f"comma list of {list(ROWS)} (build and run, in order; "
                                                         "default fp8-sparse: the one-H100 plan)")
    p.add_argument("--tiny", action="store_true", help="the same flow on the CPU with the tiny config")
    p.add_argument("--state", default=None, help="checkpoint and scratch (default /dev/shm/h3trt-e2e[-tiny])")
    p.add_argument("--bundles", default=None, help="where bundles are built (default /tmp/h3trt-e2e-bundles[-tiny]: "
                                                   "the disk; a bf16 bundle is ~52 GB)")
    p.add_argument("--full-steps", type=int, default=50, help="steps of the bf16 row and of the clip the 50-step rows "
                                                              "serve (default 50: 49 evaluations)")
    p.add_argument("--short-steps", type=int, default=6, help="steps of the other rows' timed run (default 6: 5 "
                                                              "evaluations, extrapolated to 49)")
    p.add_argument("--ref-evals", type=int, default=3, help="Diffusers evaluations (the first a warm-up)")
    p.add_argument("--eager-evals", type=int, default=2, help="h3trt eager evaluations (the first a warm-up)")
    p.add_argument("--ref-decodes", type=int, default=2, help="Diffusers VAE decodes (the first a warm-up)")
    p.add_argument("--second-start", default="", help="rows whose bundle is loaded again (load only) with the "
                                                      "verified-once record present, pages evicted (comma list)")
    p.add_argument("--warm-run", default="fp8", help="rows run again with the bundle's pages cached and the "
                                                     "verified-once record present (comma list, '' for none)")
    p.add_argument("--profile-step", type=int, default=4, help="the step whose host overhead the run profiles")
    p.add_argument("--keep-bundles", action="store_true", help="keep each bundle after its run")
    p.add_argument("--build-flags", default="", help="more `h3trt build` flags for every row, e.g. '--memory-budget "
                                                     "40' (a block at a time where the whole DiT fits: on an H200, "
                                                     "to time the streamed build against the whole one)")
    p.add_argument("--timeout", action="append", default=[], metavar="PHASE=S",
                   help=f"a phase's limit in seconds (defaults {PHASE_TIMEOUTS}); repeatable")
    p.add_argument("--budget-s", type=float, default=None, help="stop phases in time to write the results (default "
                                                                 "560: a device call of 9.5 minutes, less start-up; "
                                                                 "--tiny: 3600)")
    args = p.parse_args(argv)
    suffix = "-tiny" if args.tiny else ""
    args.state = args.state or f"/dev/shm/h3trt-e2e{suffix}"
    args.bundles = args.bundles or f"/tmp/h3trt-e2e-bundles{suffix}"
    args.second_start = [r for r in args.second_start.split(",") if r]
    args.warm_run = [r for r in args.warm_run.split(",") if r]
    args.budget_s = args.budget_s or (3600.0 if args.tiny else 560.0)
    args.timeouts = dict(PHASE_TIMEOUTS)
    for item in args.timeout:
        phase, _, seconds = item.partition("=")
        if phase not in PHASES or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--timeout {item!r}: PHASE=SECONDS with PHASE one of {PHASES}")
        args.timeouts[phase] = float(seconds)
    args.phases = [x for x in args.phase.split(",") if x]
    args.row_list = [x for x in args.rows.split(",") if x]
    for x in args.phases:
        if x not in PHASES:
            p.error(f"--phase {x!r}: choose from {PHASES}")
    for x in args.row_list + args.second_start + args.warm_run:
        if x not in ROWS:
            p.error(f"--rows / --second-start / --warm-run {x!r}: choose from {list(ROWS)}")
    return args


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_load_only":
        load_only(*sys.argv[2:5])
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == "_phase":  # a phase in its own process (in_own_process)
        args = parse_args(sys.argv[3:])
        args.started, args.child = json.loads(args.out.read_text())["calls"][-1]["started_unix"], True
        ctx = Ctx(args)
        (phase_checkpoint if sys.argv[2] == "checkpoint" else phase_reference)(ctx)
        ctx.save()
        return 0
    args = parse_args(sys.argv[1:])
    ctx = Ctx(args)
    phases, rows = args.phases, args.row_list
    ctx.results.setdefault("calls", []).append({"phases": phases, "rows": rows, "started_unix": ctx.started,
                                                "env": ctx.env(), "budget_s": args.budget_s,
                                                "timeouts_s": args.timeouts})
    ctx.results["env"] = ctx.env()
    ctx.bundles.mkdir(parents=True, exist_ok=True)  # its disk's free space is logged now, before any build
    ctx.log(f"bench_e2e: phases {phases}, rows {rows}, state {ctx.state}, bundles {ctx.bundles}, "
            f"disk free {shutil.disk_usage(ctx.bundles.parent).free / 1e9:.0f} GB, {ctx.env().get('gpu', 'cpu')}")
    try:
        for phase in ("checkpoint", "reference"):
            if phase in phases:
                in_own_process(ctx, phase)
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
