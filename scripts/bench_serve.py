"""`h3trt serve` against `h3trt run` on the same bundle in the same call: the full-size fp8 bundle (fp8 GEMMs +
--fp8-attention, 1344x768, 5 s, --short-steps), 4 clips each way.

    python scripts/bench_serve.py --out bench/results/serve_h200.json            # checkpoint, build, run, serve
    python scripts/bench_serve.py --tiny --out /tmp/serve_tiny.json               # the same flow on the CPU

  run    `h3trt run --engine B --requests FILE` (4 requests, one process, bundle pages evicted first)
  serve  `h3trt serve --engine B` (pages evicted first): process start -> /ready; the same 4 requests POSTed to
         /v1/videos at once; while the GPU works, a client GETs /v1/videos/{id} every 50 ms (the latency of the
         event loop under load); SIGTERM at the end (the drain's exit status recorded)

Seconds per clip, both ways: from the first clip's text encode to the last clip's MP4 (the records' Unix spans)
over 4 -- the service time of the queue, inter-job gaps included, model load excluded. The overhead is
serve / run - 1 (the issue's bound: 1%). Checkpoint and build are e2e_bundle.py's (imported).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_bundle  # noqa: E402  (the build phase, the page-cache eviction)
from e2e_ctx import Ctx, release_gpu_memory  # noqa: E402
import e2e_checkpoint  # noqa: E402  (the checkpoint phase)
from bench_common import ROOT  # noqa: E402

ROW = "fp8"
CLIPS = 4
PROMPTS = ["A red fox runs through the snowy forest at sunset, and the camera follows it",
           "Rain falls on a tin roof at night while a dog barks in the distance",
           "A sailboat crosses a bright bay, waves slapping its hull, gulls calling",
           "A street drummer plays on a busy corner as people walk past"]


def requests_file(ctx, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "requests.jsonl"
    steps = e2e_bundle.row_steps(ctx, ROW)
    path.write_text("".join(json.dumps({"id": f"clip{i}", "task": "t2va", "prompt": p, "seed": i, "steps": steps,
                                        "resolution": f"{ctx.width}x{ctx.height}", "duration": 5}) + "\n"
                            for i, p in enumerate(PROMPTS[:CLIPS])))
    return path


def service_time(records: list[dict]) -> dict:
    """Seconds per clip over the queue: first text encode -> last MP4, over the clips."""
    start = min(r["spans_unix"]["text_encode"][0] for r in records)
    end = max(r["spans_unix"]["decode_and_mux"][1] for r in records)
    return {"first_start_unix": start, "last_end_unix": end, "seconds_per_clip": round((end - start) / len(records), 3),
            "clip_wall_s": [r["wall_s"] for r in records],
            "step_s_median": round(statistics.median(b - a for r in records
                                                     for a, b in zip(r["step_marks_s"], r["step_marks_s"][1:])), 4)
            if any(len(r["step_marks_s"]) > 1 for r in records) else None}


def fresh_user_cache(ctx) -> dict:
    """The user cache the measured processes share: h3trt's bytecode cache kept (what a restarted node or a fleet
    scaling from zero has: the image ships no .pyc and sets PYTHONDONTWRITEBYTECODE, so h3trt keeps its own; seeded
    from the build's), the bundle's verified-once record removed (a freshly copied bundle: every byte hashed)."""
    import shutil

    xdg = ctx.state / "xdg-bench-serve"
    seed = ctx.state / "xdg-build" / "h3trt" / "pycache"
    if seed.is_dir() and not (xdg / "h3trt" / "pycache").exists():
        shutil.copytree(seed, xdg / "h3trt" / "pycache")
    shutil.rmtree(xdg / "h3trt" / "verified", ignore_errors=True)
    xdg.mkdir(parents=True, exist_ok=True)
    # The prefix the processes use: h3trt's own, which this bench process set up (h3trt/__init__.py) and its children
    # inherit, else the one under this XDG_CACHE_HOME.
    prefix = Path(os.environ.get("PYTHONPYCACHEPREFIX") or xdg / "h3trt" / "pycache")
    cached = sum(1 for _ in prefix.rglob("*.pyc")) if prefix.exists() else 0
    return {"XDG_CACHE_HOME": str(xdg), "bytecode_files_cached": cached, "bytecode_prefix": str(prefix)}


def phase_run(ctx, bundle: Path) -> dict:
    folder = ctx.state / "bench-serve-run"
    subprocess.run(["rm", "-rf", str(folder)], check=False)
    reqs = requests_file(ctx, folder)
    out = folder / "out"
    cache = fresh_user_cache(ctx)
    evicted = e2e_bundle.evict_page_cache(bundle)
    launched = time.time()
    rc, seconds = ctx.subprocess([sys.executable, "-m", "h3trt.cli", "run", "--engine", str(bundle), "--requests",
                                  str(reqs), "--out-dir", str(out), "--quiet"],
                                 {"XDG_CACHE_HOME": cache["XDG_CACHE_HOME"]}, "run --requests")
    result = {"rc": rc, "process_s": round(seconds, 2), "page_cache": evicted,
              "bytecode_files_cached_before": cache["bytecode_files_cached"]}
    records = [json.loads(p.read_text()) for p in sorted(out.glob("clip*.json"))]
    if rc != 0 or len(records) != CLIPS:
        result["error"] = f"h3trt run exited {rc} with {len(records)} records (see {ctx.log_path})"
        return result
    result.update(service_time(records))
    result["launch_to_first_step_s"] = round(min(r["spans_unix"]["denoise"][0] for r in records) - launched, 3)
    first = min(records, key=lambda r: r["spans_unix"]["denoise"][0])
    result["first_clip_load"] = first.get("load")
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ended_jobs(client, ids: list[str], more) -> dict:
    """Poll the jobs every 0.5 s while `more()` until each has ended; {id: job} of those that did."""
    jobs = {}
    while len(jobs) < len(ids) and more():
        for job_id in ids:
            if job_id not in jobs:
                job = client.get(f"/v1/videos/{job_id}").json()
                if job["status"] in ("completed", "failed", "cancelled"):
                    jobs[job_id] = job
        time.sleep(0.5)
    return jobs


def phase_serve(ctx, bundle: Path) -> dict:
    import httpx

    folder = ctx.state / "bench-serve-serve"
    subprocess.run(["rm", "-rf", str(folder)], check=False)
    folder.mkdir(parents=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cache = fresh_user_cache(ctx)
    evicted = e2e_bundle.evict_page_cache(bundle)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "XDG_CACHE_HOME": cache["XDG_CACHE_HOME"]}
    log = open(ctx.log_path, "a")
    launched = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "h3trt.cli", "serve", "--engine", str(bundle), "--data-dir",
                             str(folder / "data"), "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=ROOT)
    result: dict = {"page_cache": evicted, "bytecode_files_cached_before": cache["bytecode_files_cached"]}
    try:
        client = httpx.Client(base_url=url, timeout=30)
        listening = ready = None
        while time.time() - launched < ctx.remaining() - 30:
            if proc.poll() is not None:
                result["error"] = f"h3trt serve exited {proc.returncode} (see {ctx.log_path})"
                return result
            try:
                r = client.get("/ready")
                listening = listening or time.time()
                if r.status_code == 200:
                    ready = time.time()
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        if ready is None:
            result["error"] = "not ready within the call's budget"
            return result
        result.update(start_to_listening_s=round(listening - launched, 3), start_to_ready_s=round(ready - launched, 3))
        ctx.log(f"serve: listening after {listening - launched:.1f} s, ready after {ready - launched:.1f} s")
        steps = e2e_bundle.row_steps(ctx, ROW)
        ids = []
        for i, prompt in enumerate(PROMPTS[:CLIPS]):
            r = client.post("/v1/videos", json={"prompt": prompt, "seed": i, "steps": steps, "seconds": "5",
                                                "size": f"{ctx.width}x{ctx.height}"})
            r.raise_for_status()
            ids.append(r.json()["id"])
        latencies, stop = [], threading.Event()

        def sample():  # the event loop under load: one GET every 50 ms while the GPU works
            with httpx.Client(base_url=url, timeout=30) as c:
                while not stop.is_set():
                    t = time.perf_counter()
                    c.get(f"/v1/videos/{ids[-1]}")
                    latencies.append(time.perf_counter() - t)
                    stop.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        jobs = ended_jobs(client, ids, lambda: time.time() - launched < ctx.remaining() - 20)
        stop.set()
        sampler.join()
        result["jobs"] = {j: {k: v[k] for k in ("status", "created_at", "started_at", "completed_at", "attempts",
                                                "error")} for j, v in jobs.items()}
        records = [json.loads((folder / "data" / "clips" / f"{j}.json").read_text()) for j in ids
                   if jobs.get(j, {}).get("status") == "completed"]
        if len(records) != CLIPS:
            result["error"] = f"{len(records)} of {CLIPS} jobs completed"
            return result
        result.update(service_time(records))
        lat = sorted(latencies)
        result["get_latency_ms"] = {"samples": len(lat), "p50": round(1000 * lat[len(lat) // 2], 2),
                                    "p99": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
                                    "max": round(1000 * lat[-1], 2), "while": "4 jobs ran on the GPU"}
        metrics = client.get("/metrics").text
        result["metrics_sample"] = [line for line in metrics.splitlines()
                                    if line.startswith(("h3trt_jobs{", "h3trt_denoise_step_seconds_count",
                                                        "h3trt_denoise_step_seconds_sum",
                                                        "h3trt_job_latency_seconds_sum"))]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            result["exit_status_after_sigterm"] = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            result["exit_status_after_sigterm"] = "killed after 60 s"
        log.close()
    return result


def arguments(doc: str, phases: str) -> argparse.ArgumentParser:
    """The flags this bench and bench_fleet.py share."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--phase", default=phases)
    p.add_argument("--tiny", action="store_true", help="the same flow on the CPU with the tiny config")
    p.add_argument("--short-steps", type=int, default=6, help="steps of every clip (default 6: 5 evaluations)")
    p.add_argument("--budget-s", type=float, default=None, help="default 570 (a device call: 600 s); --tiny 3600")
    return p


def context(args, clips: int) -> Ctx:
    """bench_e2e's context for these flags (its state folders, the call's budget) with the workload recorded."""
    suffix = "-tiny" if args.tiny else ""
    args.state, args.bundles = f"/dev/shm/h3trt-e2e{suffix}", f"/tmp/h3trt-e2e-bundles{suffix}"
    args.full_steps, args.profile_step = 50, 4
    args.budget_s = args.budget_s or (3600.0 if args.tiny else 570.0)
    ctx = Ctx(args)
    ctx.results["env"] = ctx.env()
    ctx.results["workload"] = {"clips": clips, "canvas": f"{ctx.width}x{ctx.height}", "seconds": 5,
                               "steps": args.short_steps, "precision": "fp8 GEMMs + fp8 attention, sp=1"}
    return ctx


def bundle_and_run(ctx, phases: list[str]) -> Path:
    """The phases both benches start with: the checkpoint, the bundle, `h3trt run` over the requests; the bundle."""
    bundle = e2e_bundle.bundle_path(ctx, ROW)
    if "checkpoint" in phases:
        e2e_checkpoint.phase_checkpoint(ctx)
        release_gpu_memory()
    if "build" in phases:
        e2e_bundle.phase_build(ctx, ROW)
        ctx.save()
    if "run" in phases:
        ctx.results["run"] = phase_run(ctx, bundle)
        ctx.log(f"run: {ctx.results['run']}")
        ctx.save()
    return bundle


def main() -> int:
    args = arguments(__doc__, "checkpoint,build,run,serve").parse_args()
    phases = [x for x in args.phase.split(",") if x]
    ctx = context(args, CLIPS)
    try:
        bundle = bundle_and_run(ctx, phases)
        if "serve" in phases:
            ctx.results["serve"] = phase_serve(ctx, bundle)
            ctx.log(f"serve: { {k: v for k, v in ctx.results['serve'].items() if k != 'jobs'} }")
    finally:
        summarise(ctx, "serve", lambda srv: {"get_p99_ms": srv.get("get_latency_ms", {}).get("p99"),
                                             "start_to_ready_s": srv.get("start_to_ready_s")})
    return 0


def summarise(ctx, key: str, extra) -> None:
    """`key`'s phase against `h3trt run` (seconds per clip, the overhead, clips per hour) and `extra(its result)`;
    the results saved either way."""
    run, other = ctx.results.get("run", {}), ctx.results.get(key, {})
    if run.get("seconds_per_clip") and other.get("seconds_per_clip"):
        ctx.results["summary"] = {
            "run_seconds_per_clip": run["seconds_per_clip"], f"{key}_seconds_per_clip": other["seconds_per_clip"],
            f"{key}_overhead": round(other["seconds_per_clip"] / run["seconds_per_clip"] - 1, 4),
            f"{key}_clips_per_hour": round(3600 / other["seconds_per_clip"], 1),
            "run_clips_per_hour": round(3600 / run["seconds_per_clip"], 1), **extra(other)}
        ctx.log(f"summary: {ctx.results['summary']}")
    ctx.save()


if __name__ == "__main__":
    sys.exit(main())
