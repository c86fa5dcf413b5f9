"""Where a bundle's cold start goes on the CPU side (issue 18): imports, the compiled-segment load, and how they
contend for the GIL, each probe in a fresh process on the device, against a bundle built earlier in the same call:

    python scripts/bench_cold_start.py --bundle /tmp/h3trt-e2e-bundles/bundle-fp8 --json $OUT/cold_start_h200.json

Probes (each a fresh `python` process, run one after another):
  imports            time `import torch`, CUDA's first call, h3trt's engine modules, Inductor's loader modules, then
                     transformers and diffusers as the text encoder's thread imports them; nothing else running
  segments:<how>     the bundle's segments loaded as `Engine.load` loads them (cache activated, then each segment,
                     under the no-compile guard), seconds per segment, with <how> one of
                       as_served   what h3trt.engines.loaders.load_segments does (one compile thread unless
                                   TORCHINDUCTOR_COMPILE_THREADS is set; when cold_start_probe_h200.json was
                                   measured it was Inductor's default, a pool of compile workers)
                       threads1    Inductor's compile_threads forced to 1 first (no compile-worker pool started)
                       contend     as_served while another thread imports transformers + diffusers (a cold start)
                       contend_t1  threads1 while that thread imports them
  profile            as_served under cProfile (main thread); the top functions by cumulative time go to the JSON
The table prints seconds; the JSON keeps each probe's report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import bench_common  # noqa: E402,F401  (first: it puts this checkout on sys.path)

PROBES = ("imports", "segments:as_served", "segments:threads1", "segments:contend", "segments:contend_t1", "profile")


def _import_text_side() -> float:
    """What the text encoder's thread imports during a bundle load (h3trt/pipeline/loading.py)."""
    t0 = time.perf_counter()
    import diffusers

    diffusers.AutoencoderKLMiniMaxH3, diffusers.AutoencoderKLMiniMaxH3Audio
    from h3trt.models.text_encoder import quiet_transformers

    quiet_transformers()
    return time.perf_counter() - t0


def probe(kind: str, bundle: Path, report_path: Path) -> None:
    report: dict = {"probe": kind}
    t = time.perf_counter()
    import torch

    report["import_torch_s"] = time.perf_counter() - t
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a check of this script only
    t = time.perf_counter()
    torch.zeros(1, device=device)
    report["cuda_init_s"] = time.perf_counter() - t
    t = time.perf_counter()
    from h3trt.engines import bundle as _bundle  # noqa: F401  (what the CLI has imported before a load)
    from h3trt.engines.guard import no_compile
    from h3trt.engines.loaders import activate_compiled_cache, load_segment

    report["import_h3trt_engines_s"] = time.perf_counter() - t
    if kind == "imports":
        t = time.perf_counter()
        import torch._inductor.codecache  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401

        report["import_inductor_s"] = time.perf_counter() - t
        report["import_text_side_s"] = _import_text_side()
        report_path.write_text(json.dumps(report))
        return
    how = kind.split(":")[1] if ":" in kind else "as_served"
    if how in ("threads1", "contend_t1"):
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1
    side: dict = {}
    if how.startswith("contend"):
        def text_side():
            side["import_text_side_s"] = _import_text_side()

        thread = threading.Thread(target=text_side, daemon=True)
        thread.start()
    manifest = json.loads((bundle / "manifest.json").read_text())
    profiler = None
    if kind == "profile":
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    activate_compiled_cache(bundle)
    report["activate_cache_s"] = time.perf_counter() - t0
    per = {}
    with no_compile():
        for name, entry in manifest["segments"].items():
            t = time.perf_counter()
            load_segment(manifest["backend"], entry, bundle, device)
            per[name] = round(time.perf_counter() - t, 4)
    report["segments_s"] = per
    report["segments_total_s"] = time.perf_counter() - t0
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(45)
        report["profile_top"] = out.getvalue().splitlines()[:80]
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        report["profile_self"] = out.getvalue().splitlines()[:50]
    if how.startswith("contend"):
        thread.join()
        report.update(side)
    from torch._inductor.async_compile import AsyncCompile
    from torch._dynamo.utils import counters

    report["compile_pool_started"] = AsyncCompile._ready_future is not None
    report["inductor_counters"] = {k: v for k, v in counters["inductor"].items()}
    report["wall_s"] = time.perf_counter() - t0
    report_path.write_text(json.dumps(report, default=str))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_probe":
        probe(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
        os._exit(0)  # as a served process ends: no wait on a compile-worker pool's shutdown
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--probes", default=",".join(PROBES), help=f"comma list of {PROBES}")
    args = p.parse_args()
    import torch

    result = {"bundle": str(args.bundle), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "cpus": os.cpu_count(), "probes": {}}
    for kind in [k for k in args.probes.split(",") if k]:
        report = args.json.with_suffix(f".{kind.replace(':', '_')}.tmp")
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "_probe", kind, str(args.bundle), str(report)],
                              capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - t
        if proc.returncode != 0 or not report.exists():
            result["probes"][kind] = {"rc": proc.returncode, "stderr": proc.stderr[-3000:]}
            print(f"{kind:22s} FAILED rc={proc.returncode}\n{proc.stderr[-1500:]}", flush=True)
            continue
        r = json.loads(report.read_text())
        report.unlink()
        r["process_wall_s"] = round(wall, 3)
        result["probes"][kind] = r
        segs = r.get("segments_s", {})
        print(f"{kind:22s} process {wall:6.2f} s  torch {r['import_torch_s']:5.2f}  cuda {r['cuda_init_s']:5.2f}  "
              f"engines {r['import_h3trt_engines_s']:5.2f}  "
              + (f"inductor {r['import_inductor_s']:5.2f}  text-side imports {r['import_text_side_s']:5.2f}"
                 if kind == "imports" else
                 f"activate {r['activate_cache_s']:5.2f}  segments {r['segments_total_s']:6.2f} "
                 f"({', '.join(f'{k} {v:.2f}' for k, v in segs.items())})  pool {r['compile_pool_started']}"
                 + (f"  text-side {r['import_text_side_s']:5.2f}" if "import_text_side_s" in r else "")), flush=True)
        for line in r.get("profile_top", [])[:60]:
            print("   ", line)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
