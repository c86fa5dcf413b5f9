"""bench_e2e.py's build and run phases, per row: `h3trt build` of the full-size checkpoint and `h3trt run --engine` of
the clip, each in a fresh process bounded by its phase's timeout (e2e_ctx.py Ctx.subprocess)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench_common import NvmlSampler
from e2e_checkpoint import BASE_PROMPT, checkpoint_complete
from e2e_summary import summarise_run

if TYPE_CHECKING:
    from e2e_ctx import Ctx

ROWS = {  # row: (precision, sp, extra build flags)
    "bf16": ("bf16", 1, []), "fp8": ("fp8", 1, ["--fp8-attention"]),
    "bf16-sp2": ("bf16", 2, []), "fp8-sp2": ("fp8", 2, ["--fp8-attention"]),
    "fp8-sparse": ("fp8", 1, ["--fp8-attention", "--sparse-attention", "0.75"]),
    "fp8-50": ("fp8", 1, ["--fp8-attention"]),
}
# Rows whose bundle serves the 50-step clip (--steps 50,SHORT): the timed run takes the SHORT schedule and is
# extrapolated to the 50-step one the bundle was built for (its AdaLN tables baked for both).
SERVES_50 = ("fp8-sparse", "fp8-50")
# fp8-sparse's timed run: its first evaluations dense (--sparse-dense-steps), the rest sparse, so that both kinds are
# timed; the 50-step clip is extrapolated with the bundle's own dense steps.
SPARSE_RUN_DENSE = 3
BUNDLE_DIT_BYTES = {"bf16": 41.2e9, "fp8": 21.9e9}  # full-size DiT weights of a bundle (bench/README, AdaLN baked)


def row_steps(ctx: Ctx, row: str) -> int:
    """The steps of the row's timed run."""
    return ctx.args.full_steps if row == "bf16" else ctx.args.short_steps


def build_steps(ctx: Ctx, row: str) -> tuple[int, ...]:
    """The schedules the row's bundle bakes: the timed run's, and the 50-step clip's for SERVES_50 rows."""
    return (ctx.args.full_steps, row_steps(ctx, row)) if row in SERVES_50 else (row_steps(ctx, row),)


def bundle_path(ctx: Ctx, row: str) -> Path:
    return ctx.bundles / f"bundle-{row}"


def phase_build(ctx: Ctx, row: str) -> None:
    from h3trt.engines.manifest import read_manifest

    precision, sp, extra = ROWS[row]
    steps = build_steps(ctx, row)
    result = ctx.results.setdefault("rows", {}).setdefault(row, {})
    bundle = bundle_path(ctx, row)
    if (bundle / "manifest.json").exists():
        m = read_manifest(bundle)
        if m.precision == precision and tuple(s.steps for s in m.schedules) == steps and m.mesh.sp == sp:
            ctx.log(f"build {row}: reusing {bundle}")
            result["build"] = {**result.get("build", {}), "reused": True}
            return
    error = _cannot_build(ctx, row, precision, sp)
    if error:
        result["build"] = {"error": error}
        ctx.log(f"build {row}: {error}")
        return
    shutil.rmtree(bundle, ignore_errors=True)
    tmp = ctx.state / "tmp"  # the build's fresh-process check writes its example tensors here (RAM, not the disk)
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "h3trt.cli", "build", "--model", str(ctx.ckpt), "--output", str(bundle),
           "--precision", precision, "--steps", ",".join(map(str, steps)), "--device", ctx.device.type,
           "--profile", f"{ctx.width}x{ctx.height}x5", *extra]
    if precision == "fp8":
        # Random weights: calibration sets scales, not quality. One prompt, a 2-point trajectory (one evaluation).
        cmd += ["--calib-prompts", str(ctx.state / "calib.txt"), "--calib-steps", "2"]
    if sp > 1:
        cmd += ["--sp", str(sp)]
    cmd += shlex.split(getattr(ctx.args, "build_flags", "") or "")
    if ctx.tiny and "--sparse-attention" in extra:
        cmd += ["--sparse-min-seq", "64"]  # the tiny clip's 1,021 rows are under the default 4096: all dense
    result["build"] = {"started_unix": time.time(), "command": " ".join(cmd[2:]), "steps": list(steps)}
    ctx.save()  # a build cut short leaves its command in the results
    rc, seconds = ctx.subprocess(cmd, {"TMPDIR": str(tmp), "XDG_CACHE_HOME": str(ctx.state / "xdg-build")},
                                 f"build {row}", "build")
    build = {**result["build"], "seconds": round(seconds, 2), "rc": rc}
    if rc == 0:
        m = read_manifest(bundle)
        timings = m.build_timings_s
        build.update(bundle_bytes=m.total_bytes, weight_bytes=m.weight_bytes, build_timings_s=timings,
                     attention=m.attention, streamed=bool(timings.get("streamed")),
                     peak_gpu_gib=timings.get("peak_gpu_allocated_gib"),
                     peak_gpu_reserved_gib=timings.get("peak_gpu_reserved_gib"),
                     check_peak_gpu_gib=timings.get("check_peak_gpu_allocated_gib"),
                     sparse=None if m.sparse is None else {"kernel": m.sparse.kernel, "block": m.sparse.block,
                                                           "tile": m.sparse.tile, "dense_steps": m.sparse.dense_steps,
                                                           "measured_ms": m.sparse.measured_ms,
                                                           "unavailable": m.sparse.unavailable},
                     disk_free_gb=round(shutil.disk_usage(bundle).free / 1e9, 1))
        ctx.log(f"build {row}: {build['bundle_bytes'] / 1e9:.1f} GB in {seconds:.0f} s, "
                f"{'a block at a time' if build['streamed'] else 'whole'}, peak GPU memory "
                f"{build['peak_gpu_gib'] if build['peak_gpu_gib'] is None else round(build['peak_gpu_gib'], 2)} GiB "
                f"allocated {timings}")
    else:
        build["error"] = f"h3trt build exited {rc} (see {ctx.log_path})"
        ctx.log(f"build {row}: {build['error']}")
    result["build"] = build


def _cannot_build(ctx: Ctx, row: str, precision: str, sp: int) -> str | None:
    """Why this call cannot build the row (no checkpoint, too few GPUs, too little disk), before minutes of work."""
    if checkpoint_complete(ctx) is None:
        return f"no checkpoint in {ctx.ckpt}: run --phase checkpoint first"
    if sp > torch.cuda.device_count() and not ctx.tiny:
        return f"sp={sp} needs {sp} GPUs; {torch.cuda.device_count()} visible"
    ctx.bundles.mkdir(parents=True, exist_ok=True)
    if not ctx.tiny:  # refuse now rather than after minutes of building (DiT weights: bench/README's byte table)
        need = BUNDLE_DIT_BYTES[precision] + checkpoint_complete(ctx)["vae_bytes"] + 3e9
        free = shutil.disk_usage(ctx.bundles).free
        if free < need:
            return (f"{ctx.bundles} has {free / 1e9:.0f} GB free; a {precision} bundle needs about {need / 1e9:.0f} "
                    "GB. Free the disk or pass --bundles elsewhere.")
    return None


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
    ctx.save()
    if "error" in run:
        return
    ctx.log(f"run {row}: first step {run['cold_start_s']:.1f} s after launch, {run['step_s']:.3f} s per step, "
            f"denoise {run['denoise_s']:.1f} s, decode {run['video_decode_s']:.1f} s, wall {run['wall_s']:.1f} s, "
            f"peak memory {run.get('peak_memory_gib')} GiB"
            + (f" -> {run['end_to_end_49_s']:.1f} s extrapolated to 49 evaluations ({run['note']})"
               if run["extrapolated"] else ""))
    if row in ctx.args.second_start:
        result["second_start"] = second_start(ctx, bundle, xdg)
        ctx.save()
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
    cold-start split, step times, energy, extrapolated to the 50-step clip."""
    from h3trt.engines.manifest import read_manifest

    _, sp, _ = ROWS[row]
    steps = row_steps(ctx, row)
    sparse = read_manifest(bundle).sparse
    prompt = checkpoint_complete(ctx)["prompt"] if checkpoint_complete(ctx) else BASE_PROMPT
    evicted = evict_page_cache(bundle) if evict else {"how": "not evicted: pages cached by the previous load"}
    cmd = [sys.executable, "-m", "h3trt.cli", "run", "--engine", str(bundle), "--prompt", prompt, "--output",
           str(clip), "--width", str(ctx.width), "--height", str(ctx.height), "--duration", "5", "--steps", str(steps),
           "--quiet", "--overwrite"]
    dense = None
    if sparse is not None and sparse.sparsity > 0:
        # No --profile-step here: the profiled step runs slower, and each of this run's steps is a sample.
        dense = min(SPARSE_RUN_DENSE, steps - 2)
        cmd += ["--sparse-dense-steps", str(dense)]
    else:
        cmd += ["--profile-step", str(min(ctx.args.profile_step, steps - 1))]
    if sp > 1:
        cmd += ["--gpus", str(sp)]
    nvml = NvmlSampler().start()
    launched = time.time()
    rc, seconds = ctx.subprocess(cmd, {"XDG_CACHE_HOME": str(xdg)}, f"run {row}", "run")
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
    sparse_split = (dense, min(sparse.dense_steps, 49)) if dense is not None else None
    run.update(summarise_run(record, launched, ended, nvml, sparse_split))
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
    rc, seconds = ctx.subprocess([sys.executable, str(Path(__file__).with_name("bench_e2e.py")), "_load_only",
                                  str(bundle), str(report), ctx.device.type], {"XDG_CACHE_HOME": str(xdg)},
                                 "second start", "run")
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
