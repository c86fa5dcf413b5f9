"""Clips per hour at batch size 1 vs 2 in one run, through the batch runner (`run_batch`) and the real pipeline API.

Reduced shape: a full-width DiT (hidden 5376, 56 heads x 128, SwiGLU 14336) with --layers blocks and random bf16
weights, the embedded tiny text encoder and tiny VAEs (the tiny default's components, so decode is cheap next to the
real VAE: the numbers show what batching does to the DiT share of a clip), 5 s clips at --width x --height.

    python scripts/bench_batch.py --json bench/results/batch_h200.json                 # one H200
    python scripts/bench_batch.py --cpu-check --json /tmp/batch_cpu.json               # toy size, proves it runs

Each batch size gets the same --clips requests (one prompt, different seeds, so every pair shares a layout) in its
own output folder, after one warm-up clip. Prints a table and writes JSON (per batch size: wall, clips/hour, the
denoise and decode seconds per clip from the records, peak memory, the timeline).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

import bench_common  # noqa: F401  (first: it puts this checkout on sys.path)

from h3trt.models.config import H3Config
from h3trt.models.dit import EagerDiT, build_dit
from h3trt.models.tiny import TINY_HEIGHT, TINY_REFERENCE_SHORT_EDGE, TINY_WIDTH, ensure_tiny_checkpoint
from h3trt.run.batch import BatchConfig, run_batch, summary_line
from h3trt.run.batch_file import BatchItem, parse_requests
from h3trt.media.output_files import write_json_atomic
from h3trt.pipeline.h3_pipeline import H3Pipeline
from h3trt.request.request import CanvasDefaults

PROMPT = "a red fox runs through fresh snow, wind howling"


def build_pipeline(args, device: torch.device) -> tuple[H3Pipeline, H3Config, CanvasDefaults]:
    tiny_canvas = CanvasDefaults(short_edge=TINY_HEIGHT, max_pixels=TINY_WIDTH * TINY_HEIGHT,
                                 reference_short_edge=TINY_REFERENCE_SHORT_EDGE)
    tiny = H3Pipeline.load(ensure_tiny_checkpoint(), "t2va", str(device), tiny_canvas)
    if args.cpu_check:
        return tiny, tiny.dit.cfg, tiny_canvas
    # Full-width blocks; the text projection takes the tiny encoder's width (its cost is negligible either way).
    cfg = H3Config(num_layers=args.layers, text_dim=tiny.dit.cfg.text_dim)
    torch.manual_seed(0)
    model = build_dit(cfg, torch.bfloat16, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:  # RMSNorm weights stay 1; small weights keep bf16 activations finite
                p.normal_(0.0, 0.02)
    pipeline = H3Pipeline(EagerDiT(model), tiny.text_encoder, tiny.video_vae, tiny.audio_vae, tiny.shifts, device,
                          CanvasDefaults())
    return pipeline, cfg, CanvasDefaults()


def requests_file(folder: Path, prefix: str, n: int, args) -> Path:
    lines = [json.dumps({"id": f"{prefix}{i}", "task": "t2va", "prompt": PROMPT, "seed": i, "steps": args.steps,
                         "resolution": f"{args.width}x{args.height}"}) for i in range(n)]
    path = folder / f"{prefix}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def measure(pipeline, items: list[BatchItem], out: Path, batch: int) -> dict:
    if pipeline.device.type == "cuda":
        torch.cuda.synchronize()
    summary = run_batch(pipeline, items, BatchConfig(out, max_batch=batch, quiet=True, timeline_png=False), "bench")
    records = [json.loads((out / f"{i.id}.json").read_text()) for i in items]
    records = [r for r in records if r["status"] == "done"]
    batches = [r["timings_s"]["denoise"] for r in records if r["batch"]["index"] == 0]  # one per batch
    decode = [sum(r["timings_s"].get(k, 0.0) for k in ("video_decode", "audio_decode", "mux")) for r in records]
    return {
        "max_batch": batch, "clips": len(items), "done": len(summary.done), "failed": summary.failed,
        "wall_s": round(summary.wall_s, 3), "clips_per_hour": summary.clips_per_hour,
        "denoise_s_per_batch": [round(s, 3) for s in batches],
        "denoise_s_per_clip": round(sum(batches) / max(1, len(summary.done)), 3),
        "decode_mux_s_per_clip": round(sum(decode) / len(decode), 3),
        "peak_memory_gib": round(max(r["peak_memory"]["bytes"] for r in records) / 2**30, 2),
        "summary": summary_line(summary),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True, help="where to write the results")
    p.add_argument("--cpu-check", action="store_true", help="tiny model on the CPU at 128x32, 2 steps: proves it runs")
    p.add_argument("--layers", type=int, default=4, help="full-width DiT blocks (default 4)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--height", type=int, default=288)
    p.add_argument("--steps", type=int, default=50, help="sigma grid points (50 = 49 DiT evaluations per batch)")
    p.add_argument("--clips", type=int, default=4, help="clips per batch size (even, so batch 2 has no remainder)")
    args = p.parse_args(argv)
    if args.cpu_check:
        args.width, args.height, args.steps, args.clips = 128, 32, 2, 2
    if args.clips < 2 or args.clips % 2:
        raise SystemExit(f"--clips must be an even number >= 2, got {args.clips}.")
    device = torch.device("cpu" if args.cpu_check else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: run on the GPU, or pass --cpu-check.")

    pipeline, cfg, canvas = build_pipeline(args, device)
    results = []
    with tempfile.TemporaryDirectory(prefix="h3trt-bench-batch-") as tmp:
        tmp = Path(tmp)
        warm = parse_requests(requests_file(tmp, "warm", 1, args), canvas)
        measure(pipeline, warm, tmp / "warm", 1)  # CUDA context, cuDNN/cuBLAS heuristics, allocator growth
        for batch in (1, 2):
            items = parse_requests(requests_file(tmp, f"b{batch}-", args.clips, args), canvas)
            results.append(measure(pipeline, items, tmp / f"b{batch}", batch))
            results[-1]["timeline"] = json.loads((tmp / f"b{batch}" / "timeline.json").read_text())["requests"]
        rows = json.loads((tmp / "b1" / "b1-0.json").read_text())["sequence_rows"]

    b1, b2 = results
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    shape = (f"{'tiny' if args.cpu_check else 'full-width'} DiT x {cfg.num_layers} layers (hidden {cfg.hidden_size}), "
             f"{args.width}x{args.height}, 124 frames, {rows} rows, {args.steps} steps")
    print(f"bench_batch: {shape}; {'fp32' if device.type == 'cpu' else 'bf16'} on {gpu}")
    print(f"{'max batch':>9} {'clips':>5} {'wall s':>8} {'clips/h':>8} {'denoise s/clip':>15} {'decode+mux s/clip':>18}"
          f" {'peak GiB':>9}")
    for r in results:
        print(f"{r['max_batch']:>9} {r['clips']:>5} {r['wall_s']:>8.2f} {r['clips_per_hour']:>8.1f} "
              f"{r['denoise_s_per_clip']:>15.3f} {r['decode_mux_s_per_clip']:>18.3f} {r['peak_memory_gib']:>9.2f}")
    speedup = b2["clips_per_hour"] / b1["clips_per_hour"] if b1["clips_per_hour"] else float("nan")
    dit_speedup = b1["denoise_s_per_clip"] / b2["denoise_s_per_clip"] if b2["denoise_s_per_clip"] else float("nan")
    print(f"batch 2 vs 1: {speedup:.3f}x clips/hour end to end, {dit_speedup:.3f}x DiT time per clip")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.json, {
        "bench": "batch", "shape": shape, "width": args.width, "height": args.height, "steps": args.steps,
        "layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "sequence_rows": rows,
        "device": gpu, "precision": "fp32" if device.type == "cpu" else "bf16", "torch": torch.__version__,
        "decode": "tiny VAEs (not the real decoder): decode is a small share here", "results": results,
        "speedup_clips_per_hour": round(speedup, 4), "speedup_dit_per_clip": round(dit_speedup, 4),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    })
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
