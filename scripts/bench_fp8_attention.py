"""Attention alone at the H3 shape: bf16 SDPA (what Diffusers runs) against h3trt's FP8 attention op, one H200.

Rows: bf16 SDPA with PyTorch's default backend choice, bf16 SDPA pinned to cuDNN and to flash, and the
`h3trt::fp8_sdpa` op (cuDNN FP8 kernel, and the emulated reference) alone and with its prologue/epilogue unfused,
at 56 heads (sp=1) and 28 heads (sp=2 per rank) x 37,838 rows x 128; q, k, v ~ N(0, 1). Median of 10 after 3
warm-ups, CUDA events. Accuracy: relative Frobenius distance to bf16 SDPA's output and the ratio of the means, for
zero-mean v and for v with mean 3, with v quantized as is ("uncentered") and centered over the rows as the block
does (h3trt/calibration/fp8_attention.py says why).

  python scripts/bench_fp8_attention.py --json bench/results/fp8_attention_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dit import bench  # noqa: E402

from h3trt.calibration.formats import fp8_scale, quantize_fp8  # noqa: E402
from h3trt.calibration.fp8_attention import attention_calibration_tensors, center_rows, fp8_sdpa  # noqa: E402
from h3trt.calibration.modules import fp8_attention  # noqa: E402

ROWS, HEAD_DIM = 37_838, 128


def time_ms(fn) -> float:
    """Median of 10 after 3 warm-ups, CUDA events (bench_dit's timer)."""
    return bench(fn, n=10, warm=3)


def sdpa_BSND(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run(heads: int, rows: int, device: torch.device) -> dict:
    g = torch.Generator(device).manual_seed(0)
    shape = (1, rows, heads, HEAD_DIM)
    q, k, v = (torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16) for _ in range(3))
    sdpa = lambda: sdpa_BSND(q, k, v)  # noqa: E731
    flops = 4 * rows * rows * heads * HEAD_DIM
    out = {"heads": heads, "rows": rows, "head_dim": HEAD_DIM, "tflop": flops / 1e12, "ms": {}, "tflops": {},
           "accuracy": {}}

    def add(name, fn):
        ms = time_ms(fn)
        out["ms"][name], out["tflops"][name] = ms, flops / ms / 1e9

    add("sdpa_bf16_default", sdpa)
    for name, backend in (("sdpa_bf16_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_bf16_flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel(backend):
            add(name, sdpa)
    scales = [fp8_scale(t.abs().amax()) for t in attention_calibration_tensors(q, k, v).values()]
    q8, k8, v8 = (quantize_fp8(t, s).contiguous() for t, s in zip((q, k, center_rows(v)[0]), scales))
    for kernel in ("cudnn", "emulated"):
        add(f"fp8_{kernel}_op", lambda: fp8_sdpa(q8, k8, v8, *scales, kernel))
        # Quantization, centering and the mean's return unfused here; inside the compiled block they ride on the
        # kernels that produce q/k/v and consume the output.
        add(f"fp8_{kernel}_with_unfused_prologue", lambda: fp8_attention(q, k, v, *scales, kernel))
    # Accuracy against bf16 SDPA, for zero-mean v and v with mean 3 over the rows (the case centering is for).
    for offset in (0.0, 3.0):
        vo = v + offset
        want = sdpa_BSND(q, k, vo).float()
        sc = [fp8_scale(t.abs().amax()) for t in attention_calibration_tensors(q, k, vo).values()]
        raw_scale = fp8_scale(vo.abs().amax())
        raw = fp8_sdpa(q8, k8, quantize_fp8(vo, raw_scale).contiguous(), sc[0], sc[1], raw_scale, "cudnn")
        rows_ = {"cudnn_uncentered": raw.float() * raw_scale,
                 "cudnn_centered": fp8_attention(q, k, vo, *sc, "cudnn"),
                 "emulated_centered": fp8_attention(q, k, vo, *sc, "emulated")}
        out["accuracy"][f"v_mean_{offset:g}"] = {
            name: {"rel_err": rel_err(o, want), "mean_ratio": (o.float().mean() / want.mean()).item()}
            for name, o in rows_.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, nargs="+", default=[56, 28])
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    results = [run(h, args.rows, device) for h in args.heads]
    record = {"bench": "fp8_attention", "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "results": results}
    try:
        import cudnn
        record["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
        record["cudnn_backend"] = cudnn.backend_version()
    except ImportError:
        record["cudnn_frontend"] = None
    print(f"{record['device']}, torch {record['torch']}, cuDNN {record['cudnn']}, frontend {record['cudnn_frontend']}")
    for r in results:
        print(f"{r['heads']} heads x {r['rows']} rows x {r['head_dim']}  ({r['tflop']:.1f} TFLOP)")
        for name, ms in r["ms"].items():
            print(f"  {name:36s} {ms:8.2f} ms  {r['tflops'][name]:6.0f} TFLOP/s")
        for case, rows in r["accuracy"].items():
            print(f"  accuracy vs bf16 SDPA, {case}: " + ", ".join(
                f"{n} rel err {a['rel_err']:.2e} (mean ratio {a['mean_ratio']:.3f})" for n, a in rows.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
