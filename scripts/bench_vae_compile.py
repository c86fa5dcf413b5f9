"""Which compile options help the per-tile video decoder: ms per 256 px tile (7-latent window, [1, 24, 7, 16, 16] ->
[1, 3, 28, 256, 256]) of the full-size H3 decoder (random weights) on one GPU.

Rows, per --precisions (bf16: the reference's placement; fp8: dynamic per-token W8A8 ViT linears):
  eager                        diffusers' modules, as `VideoVAE.decode_tile` runs them without a bundle
  inductor                     the bundle's segments (in / one block per layer / out; standalone_compile, saved,
                               loaded) launched: what a bundle serves with cuda_graph off
  inductor + CUDA graph        the same kernels replayed as one graph per tile (TileDecoder): cuda_graph on
  max-autotune                 segments compiled with max_autotune (Triton GEMM templates vs cuBLAS, per shape)
  max-autotune + CUDA graph
Inductor's own CUDA graphs (`triton.cudagraphs`, cudagraph trees) are not a row: a block segment takes its layer's
weights as inputs, so Inductor would copy 67M weights into static buffers on every call; the whole-tile capture above
is the form that fits weights-as-inputs. Every row is checked against the eager tile (relative error, norm).

  python scripts/bench_vae_compile.py --json bench/results/vae_compile_h200.json    # about 3-4 minutes on an H200
  python scripts/bench_vae_compile.py --tiny                                         # dry run on this CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vae_precision import _compile_decoders, _from_checkpoint, _serve, random_vaes  # noqa: E402
from h3trt.models.vae_precision import VAEPrecision, place  # noqa: E402
from h3trt.models.video_vae import VideoVAE  # noqa: E402
from h3trt.calibration.vae_fp8 import quantize_video_decoder  # noqa: E402
from h3trt.media.output_files import write_json_atomic  # noqa: E402

OPTIONS = {"inductor": {}, "max-autotune": {"max_autotune": True, "max_autotune_gemm_backends": "ATEN,TRITON"}}
SPEEDUP_TO_ADOPT = 1.03  # a compile option must beat the bundle's default by 3% to be worth its build time


def _tile_ms(fn, z: torch.Tensor, reps: int) -> list[float]:
    fn(z)  # warm-up (and a CUDA graph's capture)
    times = []
    for _ in range(reps):
        if z.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(z)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn(z)
            times.append(1e3 * (time.perf_counter() - t))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    parser.add_argument("--reps", type=int, default=20, help="timed tiles per row (after one warm-up)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tiny", action="store_true", help="toy decoder on this CPU (a dry run of the code paths)")
    args = parser.parse_args()
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    device = torch.device("cpu" if args.tiny else "cuda")
    wall = time.perf_counter()
    model, _ = random_vaes(device, args.tiny)
    config, checkpoint = model.config, {k: v.detach() for k, v in model.state_dict().items()}
    tiling = (model.tile_sample_min_height, model.tile_sample_min_width, model.tile_sample_min_overlap_height,
              model.tile_sample_min_overlap_width)
    del model
    tile = 4 if args.tiny else 16
    z = torch.randn(1, 24, 7, tile, tile, generator=torch.Generator().manual_seed(0)).to(device)
    threads = {"compile_threads": min(16, os.cpu_count() or 1)}
    rows = []
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="bench-vae-compile-") as tmp, \
            temporary_cache_dir(f"{tmp}/inductor"):
        for name in args.precisions:
            precision = VAEPrecision(name)
            vae = place(_from_checkpoint(checkpoint, config, device, tiling), device, precision.dtype)
            if precision.quantized:
                quantize_video_decoder(vae, "dynamic")
            video = VideoVAE(vae, [0.0] * 24, [1.0] * 24)
            zt = z.to(video.dtype)
            want = vae.decoder(vae.post_quant_conv(zt)).float()

            def row(label, fn, **extra):
                times = _tile_ms(fn, zt, args.reps)
                got = fn(zt).float()
                rows.append({"precision": name, "variant": label, "ms_per_tile": statistics.median(times),
                             "ms_runs": times, "rel_err_vs_eager": ((got - want).norm() / want.norm()).item(), **extra})
                print(f"  {name} {label}: {rows[-1]['ms_per_tile']:.2f} ms per tile", flush=True)

            row("eager", lambda x: vae.decoder(vae.post_quant_conv(x)))
            for label, options in OPTIONS.items():
                t0 = time.perf_counter()
                compiled, _ = _compile_decoders(video, z[:, :, :7, :tile, :tile], Path(tmp) / f"{name}_{label}",
                                                {**threads, **options})
                compile_s = time.perf_counter() - t0
                for graph in (False, True):
                    decoder = _serve(video, compiled, graph).tile_decoders[(7, tile, tile)]
                    row(label + (" + CUDA graph" if graph else ""), decoder, compile_s=compile_s, options=options,
                        cuda_graph=graph)
            del video, vae
            if device.type == "cuda":
                torch.cuda.empty_cache()
    choice = {}
    for name in args.precisions:
        mine = [r for r in rows if r["precision"] == name]
        base = min((r for r in mine if r["variant"].startswith("inductor")), key=lambda r: r["ms_per_tile"])
        best = min((r for r in mine if r["variant"] != "eager"), key=lambda r: r["ms_per_tile"])
        keep = best if base["ms_per_tile"] / best["ms_per_tile"] >= SPEEDUP_TO_ADOPT else base
        choice[name] = {"variant": keep["variant"], "cuda_graph": keep["cuda_graph"], "options": keep["options"]}
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    record = {"bench": "vae_compile_options", "device": gpu,
              "torch": torch.__version__, "tile": list(z.shape), "tiny": args.tiny, "rows": rows, "choice": choice,
              "wall_s": time.perf_counter() - wall}
    print(f"video decoder tile {tuple(z.shape)} -> [1, 3, 28, {16 * tile}, {16 * tile}], {record['device']}, "
          f"torch {record['torch']}, median of {args.reps}")
    print(f"{'precision':<9} {'variant':<28} {'ms / tile':>9} {'x eager':>8} {'rel err':>9} {'compile s':>9}")
    for r in rows:
        eager = next(e for e in rows if e["precision"] == r["precision"] and e["variant"] == "eager")
        compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else ""
        print(f"{r['precision']:<9} {r['variant']:<28} {r['ms_per_tile']:9.2f} "
              f"{eager['ms_per_tile'] / r['ms_per_tile']:7.2f}x {r['rel_err_vs_eager']:9.1e} {compile_s:>9}")
    for name, c in choice.items():
        print(f"keep for {name}: {c['variant']} -> h3trt/build/builder.py "
              f"VIDEO_DECODER_CUDA_GRAPH = {c['cuda_graph']}, "
              f"VIDEO_DECODER_INDUCTOR_OPTIONS = {c['options']}")
    print(f"wall {record['wall_s']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.json, record)


if __name__ == "__main__":
    main()
