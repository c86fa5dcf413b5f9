"""One Ray Serve worker replica (`h3trt serve --ray`) against `h3trt run` on the same bundle in the same call: the
full-size fp8 bundle (fp8 GEMMs + --fp8-attention, 1344x768, 5 s, --short-steps), the same 4 clips each way.

    python scripts/bench_fleet.py --out bench/results/fleet_h200.json           # checkpoint, build, run, fleet
    python scripts/bench_fleet.py --tiny --out /tmp/fleet_tiny.json              # the same flow on the CPU
    python scripts/bench_fleet.py --phase fleet --fleet-replicas 2 --clips 8 --out bench/results/fleet2_h200.json

  run    bench_serve.py's: `h3trt run --engine B --requests FILE` (one process, bundle pages evicted first)
  fleet  a local Ray cluster (ray.init here, the node's GPUs), a PostgreSQL store (tests/postgres.py: a throwaway
         cluster from --pg-bin, default Debian's), storage in a folder; `h3trt serve --ray ADDRESS --engine B` timed
         from its launch to its return (it returns once every worker replica has loaded and serves: replica start to
         ready, Serve's start included); then the clips POSTed at once through the Serve proxy and polled to the end

Seconds per clip, both ways, as bench_serve.py counts them: the first clip's text encode to the last clip's MP4 (the
records' Unix spans) over the clips. The overhead is fleet / run - 1 (the issue's bound: 2%). With --fleet-replicas 2
(two GPUs) the same queue over two replicas: clips per hour against one replica's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import e2e_bundle  # noqa: E402  (the build phase, the page-cache eviction)
import bench_serve  # noqa: E402  (the run phase, the prompts, the service time)
from bench_common import ROOT  # noqa: E402
from postgres import Postgres  # noqa: E402  (a throwaway PostgreSQL cluster, as the tests start it)

ROW = bench_serve.ROW


def phase_fleet(ctx, bundle: Path, replicas: int, clips: int, pg_bin: Path | None) -> dict:
    import httpx
    import ray
    from ray import serve

    folder = ctx.state / "bench-fleet"
    subprocess.run(["rm", "-rf", str(folder)], check=False)
    folder.mkdir(parents=True)
    storage, port = folder / "storage", bench_serve.free_port()
    url = f"http://127.0.0.1:{port}"
    result: dict = {"replicas": replicas, "clips": clips}
    pg = Postgres(pg_bin)
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "XDG_CACHE_HOME": str(ctx.state / "xdg-fleet")}
    try:
        # address "local": a new cluster of the bench's own, whatever RAY_ADDRESS or /tmp/ray's session file name
        context = ray.init(address="local", num_cpus=os.cpu_count(), num_gpus=0 if ctx.tiny else None,
                           include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
        result["page_cache"] = e2e_bundle.evict_page_cache(bundle)
        rc, seconds = ctx.subprocess(
            [sys.executable, "-m", "h3trt.cli", "serve", "--ray", context.address_info["gcs_address"], "--engine",
             str(bundle), "--store", pg.database(), "--storage", str(storage), "--port", str(port),
             "--min-replicas", str(replicas), "--max-replicas", str(replicas)], env, "serve --ray")
        if rc != 0:
            result["error"] = f"h3trt serve --ray exited {rc} (see {ctx.log_path})"
            return result
        result["deploy_to_ready_s"] = round(seconds, 3)  # launch -> every replica loaded and serving
        client = httpx.Client(base_url=url, timeout=60)
        result["ready"] = client.get("/ready").json()
        steps = e2e_bundle.row_steps(ctx, ROW)
        prompts = [bench_serve.PROMPTS[i % len(bench_serve.PROMPTS)] for i in range(clips)]
        ids = [client.post("/v1/videos", json={"prompt": p, "seed": i, "steps": steps, "seconds": "5",
                                                "size": f"{ctx.width}x{ctx.height}"}).raise_for_status().json()["id"]
               for i, p in enumerate(prompts)]
        jobs = bench_serve.ended_jobs(client, ids, lambda: ctx.remaining() > 20)
        result["jobs"] = {j: {k: v[k] for k in ("status", "attempts", "error")} for j, v in jobs.items()}
        records = [json.loads((storage / "clips" / f"{j}.json").read_text()) for j in ids
                   if jobs.get(j, {}).get("status") == "completed"]
        if len(records) != clips:
            result["error"] = f"{len(records)} of {clips} jobs completed"
            return result
        result.update(bench_serve.service_time(records))
    finally:
        serve.shutdown()
        ray.shutdown()
        pg.stop()
    return result


def main() -> int:
    p = bench_serve.arguments(__doc__, "checkpoint,build,run,fleet")
    p.add_argument("--fleet-replicas", type=int, default=1, help="worker replicas, one GPU each (default 1)")
    p.add_argument("--clips", type=int, default=bench_serve.CLIPS, help="clips of the fleet phase (default 4)")
    p.add_argument("--pg-bin", type=Path, help="folder of initdb and pg_ctl (default: Debian's newest)")
    args = p.parse_args()
    phases = [x for x in args.phase.split(",") if x]
    ctx = bench_serve.context(args, args.clips)
    ctx.results["workload"]["fleet_replicas"] = args.fleet_replicas
    try:
        bundle = bench_serve.bundle_and_run(ctx, phases)
        if "fleet" in phases:
            key = "fleet" if args.fleet_replicas == 1 else f"fleet_{args.fleet_replicas}_replicas"
            ctx.results[key] = phase_fleet(ctx, bundle, args.fleet_replicas, args.clips, args.pg_bin)
            ctx.log(f"{key}: { {k: v for k, v in ctx.results[key].items() if k not in ('jobs', 'ready')} }")
    finally:
        bench_serve.summarise(ctx, "fleet", lambda fleet: {"deploy_to_ready_s": fleet.get("deploy_to_ready_s")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
