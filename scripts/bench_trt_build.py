"""Build TensorRT bundles (`h3trt build --backend tensorrt`) of a full-width H3 stack and report what the plans are.

    python scripts/bench_trt_build.py --json bench/results/trt_build_h200.json [--layers 2] \
        [--precisions bf16,fp8,nvfp4]
    python scripts/bench_trt_build.py --tiny --json /tmp/trt_build_tiny.json        # CPU check, tiny model

Writes a random full-width checkpoint with --layers blocks (official layout), then for each precision builds a
bundle for the 1344x768x5 profile (37,838 tokens) with TensorRT-RTX for its default targets (bf16/fp8: sm89+sm120,
nvfp4: sm120) and reports, per segment: ONNX export and plan build seconds, plan size, the plan's activation memory
at the profile's maximum (the fused-attention proof at full length: unfused scores alone would be 56 x S^2 x 2 bytes,
about 160 GB), whether attention is one fused MHA kernel, and which types the GEMMs read. Also the build's wall time
and peak host / GPU memory.

On an H200 this exercises what needs CUDA (NVFP4 calibration through ModelOpt's FP4 kernels) and the full-width
export and AOT build; no plan executes (TensorRT-RTX refuses sm_90).
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

import bench_common  # noqa: E402,F401  (first: it puts this checkout on sys.path)


def run(layers: int, precisions: list[str], tiny: bool) -> dict:
    from h3trt.build.builder import build
    from h3trt.build.config import BuildConfig, Profile
    from h3trt.models.checkpoint.writer import random_state_dict, save_official
    from h3trt.models.config import H3Config
    from h3trt.models.tiny import TINY_HEIGHT, TINY_WIDTH, ensure_tiny_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.mkdtemp(prefix="bench-trt-"))
    if tiny:
        ckpt, profile = ensure_tiny_checkpoint(), Profile(TINY_WIDTH, TINY_HEIGHT, 5.0)
    else:
        cfg = H3Config(num_layers=layers)
        save_official(work / "ckpt", cfg, {"FL2VA": random_state_dict(cfg, 0)}, torch.bfloat16, shards=4)
        ckpt, profile = work / "ckpt", Profile(1344, 768, 5.0)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "layers": None if tiny else layers, "tiny": tiny, "profile": "x".join(map(str, (profile.width,
              profile.height, int(profile.seconds)))), "builds": {}}
    for precision in precisions:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        manifest = build(BuildConfig(ckpt, work / f"bundle-{precision}", precision=precision, profiles=(profile,),
                                     device=device, backend="tensorrt", tiny=tiny),
                         log=lambda m: print("  build:", m, flush=True))
        result["builds"][precision] = {
            "wall_s": round(time.perf_counter() - t0, 1), "tensorrt": manifest.tensorrt,
            "peak_host_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
            "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
            "segments": {name: {k: e[k] for k in ("export_s", "build_s", "plan_bytes", "activation_bytes",
                                                  "fused_attention", "gemm_types", "quantized", "layers")}
                         for name, e in manifest.segments.items()},
        }
    return result


def table(result: dict) -> str:
    rows = [f"{result['device']}, {result['profile']}, " + ("tiny model" if result["tiny"] else
                                                            f"{result['layers']} full-width layers"),
            f"{'precision':9} {'segment':8} {'export s':>8} {'build s':>7} {'plan MB':>8} {'act MB':>8} "
            f"{'fused':>5}  gemm types"]
    for precision, b in result["builds"].items():
        for name, s in b["segments"].items():
            rows.append(f"{precision:9} {name:8} {s['export_s']:8.1f} {s['build_s']:7.1f} {s['plan_bytes'] / 1e6:8.1f} "
                        f"{(s['activation_bytes'] or 0) / 1e6:8.1f} {str(s['fused_attention']):>5}  "
                        f"{'/'.join(s['gemm_types'])}")
        rows.append(f"{precision:9} total wall {b['wall_s']} s, peak host RSS {b['peak_host_rss_gb']} GB, peak GPU "
                    f"{b['peak_gpu_gb']} GB, {b['tensorrt']['flavour']} {b['tensorrt']['version']} for "
                    f"{','.join(b['tensorrt']['targets'])}")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True, help="where to write the results")
    p.add_argument("--layers", type=int, default=2, help="full-width blocks in the random checkpoint")
    p.add_argument("--precisions", default=None, help="comma-separated (default bf16,fp8,nvfp4; --tiny: bf16,fp8)")
    p.add_argument("--tiny", action="store_true", help="the tiny model on the CPU: checks the script, not the scale")
    args = p.parse_args()
    precisions = (args.precisions or ("bf16,fp8" if args.tiny else "bf16,fp8,nvfp4")).split(",")
    result = run(args.layers, precisions, args.tiny)
    print(table(result))
    from h3trt.media.output_files import write_json_atomic

    write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
