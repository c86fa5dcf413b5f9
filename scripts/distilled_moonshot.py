"""bench_distilled.py --plan moonshot: issue 47's distilled table from ONE ~9-minute call on one H100 80 GB.

What is measured (one process per step, each killed before the call's --budget-s ends, the JSON written after every
phase):
  1. checkpoint  bench_e2e's full-size random official layout in --state (/dev/shm), reused when present
  2. file        a random FastH3 fastvideo-lora-v2 file for it, rank 64, with the 50 VSA gates (.set_weight
                 [7168, 5376]: the VSA-DataFree variant), drawn on the GPU
  3. build       ONE `h3trt build --distilled FILE --precision fp8` of FastH3-VSA (a one-prompt calibration on the
                 family's first forward: --calib-steps 2; --build-flags --fp8-attention makes it FP8 VSA, fa4 and
                 the fp8 kernel's tiles raced at build, models/vsa/fp8.py); the manifest's `vsa` says which kernel
                 the build chose, its times and why the others were left out
  4. clips       ONE `h3trt run --engine BUNDLE --requests` process, the bundle's pages evicted first: the 4-step
                 clip with VSA at the file's 0.9 (`fasth3_vsa`, first after the load: `cold_start_s` beside it), the
                 same clip dense (`fasth3_dense`: the request's `"vsa_sparsity": 0`, dense attention with the coarse
                 branch kept), and the VSA clip again warm (`fasth3_vsa_warm`, when the budget allows); each clip's
                 `e2e_s` is its record's wall time from text encode to the finished MP4, the bundle loaded
What is computed, not measured: `turbo4`, `turbo8` and `pdd8`, from the dense clip of the same bundle: its time before
the denoise, its time after (decode, mux, the host tail) and its mean seconds per evaluation times the family's
forwards (4, 8, 8). Their arithmetic is the dense FastH3 evaluation's or less: a fused Turbo or PDD bundle compiles the
plain block, which has no gate projection and no coarse branch, and PDD's per-forward head is one linear like the base
head; so each computed e2e_s is an upper bound, and says so. The 50-step base clip is not in this plan (its own build).

On random weights the clips are noise: the timings hold, the pictures mean nothing.

On an H100 80 GB the build is the streamed one (build/stream.py, a block on the GPU at a time): a whole full-size fp8
build runs out of memory in calibration there (the bf16 DiT, and here the 3.85 GB of gates, beside each FP8 copy).
"""

from __future__ import annotations

import json
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from bench_common import NvmlSampler
from e2e_ctx import release_gpu_memory
from e2e_bundle import bytecode_note, evict_page_cache
from e2e_checkpoint import BASE_PROMPT, checkpoint_complete, phase_checkpoint

# H100 80 GB seconds per phase, estimated from the H200 measurements (bench/README): the checkpoint 40 s (GPU draws,
# /dev/shm writes: the same on an H100); a full-size fp8 build 154 s at --steps 6 (x1.15 for the H100's compute, +30 s
# for the streamed block-at-a-time load an 80 GB card needs, +15 s for the VSA kernel's warm-up and the file's fusion,
# less 4 calibration forwards); an fp8 evaluation at 37,838 rows 3.64 s on an H200, ~4.3-4.6 s on an H100 with FP8
# attention, ~5.5 s dense here (bf16 attention: a VSA model's dense evaluations keep it) and ~3 s with VSA at 0.9; the
# video decode 5.2 s; a bundle's cold start 13-18 s.
ESTIMATE_S = {"checkpoint": 45.0, "file": 20.0, "build": 210.0, "load": 18.0, "clip_vsa": 19.0, "clip_dense": 29.0,
              "clip_vsa_warm": 18.0, "process": 12.0}
COMPUTED = {"turbo4": 4, "turbo8": 8, "pdd8": 8}  # family row -> its forwards
FILE_NAME = "distilled-fasth3-vsa.safetensors"
BUNDLE_NAME = "distilled-fasth3-vsa"


def estimates(ctx) -> dict:
    """Each phase's estimated H100 seconds (the checkpoint's 0 when --state holds it), printed before anything runs."""
    est = dict(ESTIMATE_S)
    if checkpoint_complete(ctx) is not None:
        est["checkpoint"] = 2.0
    if (ctx.state / FILE_NAME).with_suffix(".json").exists():
        est["file"] = 1.0
    est["run_process"] = est["process"] + est["load"] + est["clip_vsa"] + est["clip_dense"] + est["clip_vsa_warm"]
    est["total"] = est["checkpoint"] + est["file"] + est["build"] + est["run_process"]
    ctx.log("moonshot: estimated H100 seconds (H200 numbers scaled; bench/README): " + ", ".join(
        f"{k} {v:.0f}" for k, v in est.items()) + f"; the call's budget {ctx.args.budget_s:.0f} s")
    return est


def phase_file(ctx) -> Path:
    """The FastH3-VSA file for the checkpoint's config (reused when its marker is there)."""
    from h3trt.models.distilled.writer import write_fasth3

    path = ctx.state / FILE_NAME
    marker = path.with_suffix(".json")
    if path.exists() and marker.exists():
        ctx.results["moonshot"]["file"] = {**json.loads(marker.read_text()), "reused": True}
        return path
    t0 = time.perf_counter()
    write_fasth3(path, ctx.cfg, seed=47, rank=4 if ctx.tiny else 64, gates=True, dtype=torch.bfloat16,
                 device=ctx.device)
    info = {"path": str(path), "bytes": path.stat().st_size, "seconds": round(time.perf_counter() - t0, 2),
            "format": "fastvideo-lora-v2 with .set_weight VSA gates (the VSA-DataFree variant), random"}
    marker.write_text(json.dumps(info))
    ctx.results["moonshot"]["file"] = info
    ctx.log(f"file: {info['bytes'] / 1e9:.2f} GB in {info['seconds']:.1f} s")
    return path


def phase_build(ctx, file: Path) -> Path | None:
    """The one fp8 FastH3-VSA build; the bundle, None when it failed."""
    bundle = ctx.bundles / BUNDLE_NAME
    shutil.rmtree(bundle, ignore_errors=True)
    ctx.bundles.mkdir(parents=True, exist_ok=True)
    (ctx.state / "tmp").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "h3trt.cli", "build", "--model", str(ctx.ckpt), "--output", str(bundle), "--device",
           ctx.device.type, "--profile", f"{ctx.width}x{ctx.height}x5", "--distilled", str(file)]
    if not ctx.tiny:
        cmd += ["--precision", "fp8", "--calib-prompts", str(ctx.state / "calib.txt"), "--calib-steps", "2"]
    cmd += shlex.split(ctx.args.build_flags)
    env = {"TMPDIR": str(ctx.state / "tmp"), "XDG_CACHE_HOME": str(ctx.state / "xdg-build")}
    rc, seconds = ctx.subprocess(cmd, env, "build", phase="build")
    build = {"rc": rc, "seconds": round(seconds, 2), "command": " ".join(cmd[2:])}
    ctx.results["moonshot"]["build"] = build
    if rc != 0:
        build["error"] = f"h3trt build exited {rc} (see {ctx.log_path})"
        ctx.log(f"build: {build['error']}")
        return None
    from h3trt.engines.manifest import read_manifest

    m = read_manifest(bundle)
    build.update(bundle_bytes=m.total_bytes, build_timings_s=m.build_timings_s, vsa=m.vsa.to_dict(),
                 distilled_vsa=m.distilled["vsa"], schedule=m.distilled["schedule"],
                 streamed=bool(m.build_timings_s.get("streamed")))
    ctx.log(f"build: {seconds:.0f} s, {m.total_bytes / 1e9:.1f} GB, "
            f"{'a block at a time' if build['streamed'] else 'whole'}; VSA kernel {m.vsa.kernel} (left out: "
            f"{m.vsa.left_out or 'none'}), sparsity {m.vsa.settings.sparsity:g} ({m.vsa.settings.sparsity_from})")
    return bundle


def clip_lines(ctx, est: dict) -> list[dict]:
    """The requests of the one run process: VSA, dense, and VSA warm when the budget holds it."""
    prompt = (checkpoint_complete(ctx) or {}).get("prompt", BASE_PROMPT)
    base = {"task": "t2va", "prompt": prompt, "seed": 0, "resolution": f"{ctx.width}x{ctx.height}", "duration": 5}
    lines = [{"id": "fasth3_vsa", **base}, {"id": "fasth3_dense", **base, "vsa_sparsity": 0}]
    needed = est["run_process"] + 20.0
    if ctx.tiny or ctx.remaining() > needed:
        lines.append({"id": "fasth3_vsa_warm", **base})
    else:
        ctx.log(f"clips: the warm VSA clip left out ({ctx.remaining():.0f} s left, ~{needed:.0f} s needed with it)")
    return lines


def phase_clips(ctx, bundle: Path, est: dict) -> None:
    """One `h3trt run --engine --requests` process: each clip's row from its record, as it finished."""
    out_dir = ctx.state / "moonshot-out"
    shutil.rmtree(out_dir, ignore_errors=True)
    requests = ctx.state / "moonshot.jsonl"
    lines = clip_lines(ctx, est)
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    xdg = ctx.state / "xdg-run"
    shutil.rmtree(xdg, ignore_errors=True)
    evicted = evict_page_cache(bundle)
    cmd = [sys.executable, "-m", "h3trt.cli", "run", "--engine", str(bundle), "--requests", str(requests),
           "--out-dir", str(out_dir), "--quiet"]
    nvml = NvmlSampler().start()
    launched = time.time()
    rc, seconds = ctx.subprocess(cmd, {"XDG_CACHE_HOME": str(xdg)}, "clips", phase="run")
    nvml.stop()
    run = {"rc": rc, "process_s": round(seconds, 2), "page_cache": evicted, "command": " ".join(cmd[2:]),
           "peak_memory_nvml_gib": nvml.peak_memory_gib(), "python_bytecode": bytecode_note()}
    ctx.results["moonshot"]["run"] = run
    rows = ctx.results["moonshot"]["rows"]
    for i, line in enumerate(lines):
        record_file = out_dir / f"{line['id']}.json"
        if not record_file.exists():
            rows[line["id"]] = {"measured": False, "error": f"no record (the run exited {rc}; see {ctx.log_path})"}
            continue
        rows[line["id"]] = clip_row(json.loads(record_file.read_text()), launched if i == 0 else None)
        ctx.log(f"clip {line['id']}: e2e {rows[line['id']]['e2e_s']:.2f} s, {rows[line['id']]['evaluations']} "
                f"evaluations x {rows[line['id']]['eval_s']:.3f} s (median), after the DiT "
                f"{rows[line['id']]['post_dit_s']:.2f} s, VSA {rows[line['id']]['vsa']}")
    if rc != 0:
        run["error"] = f"h3trt run exited {rc} (see {ctx.log_path}); the rows hold the clips that finished"


def clip_row(record: dict, launched: float | None) -> dict:
    """A measured clip's row from its record: e2e_s (text encode to the finished MP4), the seconds per evaluation
    (median of the step marks' differences), before and after the DiT, what VSA ran."""
    spans, marks, t = record["spans_unix"], record["step_marks_s"], record["timings_s"]
    diffs = [b - a for a, b in zip(marks, marks[1:])]
    attn = record.get("sparse_attention") or {}
    row = {"measured": True, "e2e_s": record["wall_s"], "evaluations": record["evaluations"],
           "denoise_s": t["denoise"], "eval_s": round(statistics.median(diffs), 4) if diffs else t["denoise"],
           "eval_mean_s": round(t["denoise"] / record["evaluations"], 4),
           "pre_dit_s": round(spans["denoise"][0] - spans["text_encode"][0], 3),
           "post_dit_s": round(spans["decode_and_mux"][1] - spans["denoise"][1], 3),
           "timings_s": t, "tail_s": record.get("decode_tail_steps_s"),
           "peak_memory_gib": record.get("peak_memory_gib"),
           "vsa": {k: attn.get(k) for k in ("mode", "sparsity", "sparsity_from", "kernel", "kept_fraction",
                                              "sparse_evaluations")},
           "schedule": (record.get("distilled") or {}).get("schedule")}
    if launched is not None:  # the first clip after the process started: its cold start
        row["cold_start_s"] = round(spans["denoise"][0] - launched, 3)
        row["load"] = record.get("load")
    return row


def computed_rows(ctx) -> None:
    """turbo4, turbo8, pdd8 from the dense clip's measured parts (module doc: upper bounds)."""
    rows = ctx.results["moonshot"]["rows"]
    dense = rows.get("fasth3_dense", {})
    if not dense.get("measured"):
        return
    for name, forwards in COMPUTED.items():
        e2e = dense["pre_dit_s"] + forwards * dense["eval_mean_s"] + dense["post_dit_s"]
        rows[name] = {"measured": False, "e2e_s": round(e2e, 2), "forwards": forwards, "upper_bound": True,
                      "how": (f"computed: the dense FastH3 clip's {dense['pre_dit_s']:.2f} s before the DiT + "
                              f"{forwards} x its {dense['eval_mean_s']:.3f} s per evaluation + its "
                              f"{dense['post_dit_s']:.2f} s after; a fused {name[:-1]} bundle's plain block has no "
                              "gate projection and no coarse branch, so this is an upper bound")}


def moonshot(ctx) -> None:
    """The plan (module doc): every phase in order, the JSON saved after each."""
    ctx.results["moonshot"] = {"plan": __doc__.split("\n\n")[0], "started_unix": ctx.started, "rows": {}}
    est = ctx.results["moonshot"]["estimate_h100_s"] = estimates(ctx)
    ctx.save()
    try:
        phase_checkpoint(ctx)
        release_gpu_memory()
        ctx.save()
        file = phase_file(ctx)
        release_gpu_memory()
        ctx.save()
        bundle = phase_build(ctx, file)
        ctx.save()
        if bundle is not None:
            phase_clips(ctx, bundle, est)
            computed_rows(ctx)
            ctx.save()
    finally:
        rows = ctx.results["moonshot"]["rows"]
        ctx.results["moonshot"]["seconds"] = round(time.time() - ctx.started, 1)
        ctx.results["e2e_s"] = {k: r["e2e_s"] for k, r in rows.items() if "e2e_s" in r}
        ctx.results["measured"] = sorted(k for k, r in rows.items() if r.get("measured"))
        ctx.results["computed"] = sorted(k for k, r in rows.items() if "e2e_s" in r and not r.get("measured"))
        ctx.save()
        ctx.log(f"moonshot: e2e_s {ctx.results['e2e_s']} (measured: {ctx.results['measured']}; computed upper bounds: "
                f"{ctx.results['computed']}) in {ctx.results['moonshot']['seconds']:.0f} s")
