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

The checkpoint and reference phases and the summaries are e2e_checkpoint.py, e2e_reference.py and e2e_summary.py;
what every bench shares (timing, NVML, results) is bench_common.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_common import ROOT, NvmlSampler
from e2e_checkpoint import BASE_PROMPT, checkpoint_complete, phase_checkpoint
from e2e_reference import phase_reference
from e2e_summary import summarise, summarise_run

PHASES = ("checkpoint", "reference", "build", "run")
ROWS = {  # row: (precision, sp, extra build flags)
    "bf16": ("bf16", 1, []), "fp8": ("fp8", 1, ["--fp8-attention"]),
    "bf16-sp2": ("bf16", 2, []), "fp8-sp2": ("fp8", 2, ["--fp8-attention"]),
}
BUNDLE_DIT_BYTES = {"bf16": 41.2e9, "fp8": 21.9e9}  # full-size DiT weights of a bundle (bench/README, AdaLN baked)


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
    from h3trt.pipeline.h3_pipeline import H3Pipeline

    with no_compile():
        pipeline = H3Pipeline.load_engine(Path(bundle), device)
        ready = time.time()  # what the first step waits for; the VAEs keep loading behind it
        pipeline.video_vae
    Path(report).write_text(json.dumps({"ready_unix": ready, "load": pipeline.load_report.to_json()}, default=float))


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
