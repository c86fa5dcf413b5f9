"""Attention alone at the H3 shape, every kernel and variant h3trt can bake, one H200: ms, TFLOP/s and error.

    python scripts/bench_attention.py --json $OUT/attention_h200.json          # 56 / 28 / 14 heads x 37,838 rows
    python scripts/bench_attention.py --cpu-check --json /tmp/attention_cpu.json  # tiny shape: the script runs

Rows, per head count (56: sp=1; 28 and 14: one rank at sp=2 and sp=4), q/k/v ~ N(0, 1) bf16 [1, S, N, 128]:
  bf16  sdpa_default         torch SDPA, PyTorch's own backend choice (what the Diffusers block runs)
        cudnn                `h3trt::attention` kernel cudnn: SDPA pinned to cuDNN on [B, S, N, D] memory (BSHD strides)
        cudnn_bhsd           the same on contiguous [B, N, S, D] q/k/v (BHSD strides)
        cudnn_fe_plan<i>     cuDNN's bf16 SDPA graph through nvidia-cudnn-frontend, every plan it offers (BSHD)
        sdpa_flash           SDPA pinned to its flash backend (FlashAttention-2)
        fa3                  `h3trt::attention` kernel fa3 (fa3-fwd)
        fa4                  flash-attn-4 (CuTe DSL) when importable; otherwise skipped, the reason recorded
  fp8   (e4m3 q/k/v, static per-tensor scales from each tensor's max, v centered over the rows as the block runs it)
        fp8_cudnn            `h3trt::fp8_sdpa` kernel cudnn: e4m3 output, BSHD strides, the heuristics' first plan
        fp8_cudnn_bhsd       e4m3 output on contiguous [B, N, S, D]
        fp8_cudnn_bf16out    bf16 output (BSHD), and fp8_cudnn_bhsd_bf16out
        fp8_cudnn_plan<i>    every plan cuDNN offers (BSHD, e4m3 output)
        fp8_fa3              `h3trt::fp8_sdpa` kernel fa3 (bf16 output)
Error: relative (Frobenius) distance to exact fp32 attention (explicit softmax) on 1,024 query rows spread over the
sequence and the first 8 heads. Timing: median of 10 after 3 warm-ups, CUDA events. FLOPs: 4 S^2 N D.
`accuracy`: 56 heads only, v with mean 3 over the rows, each FP8 kernel fed v as is and centered (the shrink the
centering removes). `published_config`: cuDNN at the configuration of NVIDIA's published H200 numbers
(cudnn-frontend benchmark/sdpa_benchmark_training, llama3.1 no_mask: 32,768 rows, 64 query heads over 8 kv heads,
head dim 128: ~1,060 FP8 / ~700 bf16 TFLOP/s) and the same rows with 64 kv heads, to tell the shape from the call.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_common import write_json  # noqa: E402  (first: it puts this checkout on sys.path)

from h3trt.models.attention import attention, kernel_problem  # noqa: E402
from h3trt.calibration.formats import FP8, fp8_scale, quantize_fp8  # noqa: E402
from h3trt.build.attention_choice import median_cuda_ms  # noqa: E402
from h3trt.calibration.fp8_attention import (attention_calibration_tensors, center_rows, cudnn_fp8_attention,  # noqa: E402
                                      cudnn_fp8_plans, fp8_sdpa)

ROWS, HEAD_DIM, REF_ROWS, REF_HEADS = 37_838, 128, 1024, 8


def timed(fn, device: torch.device, n=10, warm=3) -> float:
    if device.type != "cuda":  # the CPU check: the script runs, the numbers mean nothing
        fn()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return min(times)
    return median_cuda_ms(fn, n, warm, device)


def reference_rows(q, k, v, rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Exact fp32 attention of query rows `rows` over every key, first `heads` heads: [1, R, heads, D]."""
    qs, ks, vs = (t[:, :, :heads].float() for t in (q[:, rows], k, v))
    s = torch.einsum("bqnd,bknd->bnqk", qs, ks) / math.sqrt(q.shape[-1])
    return torch.einsum("bnqk,bknd->bqnd", s.softmax(-1), vs)


def rel_err(out_BSND, want, rows, heads) -> float:
    got = out_BSND[:, rows, :heads].float()
    return ((got - want).norm() / want.norm()).item()


# ---- bf16 cuDNN through the frontend (bench-only: every plan of its SDPA graph) ------------------------------------

def cudnn_frontend_bf16(q_BNSD, k_BNSD, v_BNSD):
    """Build cuDNN's bf16 SDPA graph for these views once; returns (plan names, run(plan) -> [B, N, S, D])."""
    import cudnn

    handle = cudnn.create_handle()
    bf16, fp32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    ts = [graph.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=bf16)
          for n, t in zip("qkv", (q_BNSD, k_BNSD, v_BNSD))]
    o, _ = graph.sdpa(q=ts[0], k=ts[1], v=ts[2], is_inference=True, attn_scale=1.0 / math.sqrt(q_BNSD.shape[-1]),
                      use_causal_mask=False)
    o.set_output(True).set_dim(list(q_BNSD.shape)).set_stride(list(q_BNSD.stride())).set_data_type(bf16)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)
    count = graph.get_execution_plan_count()
    workspace = torch.empty(max([graph.get_workspace_size_plan_at_index(i) for i in range(count)] + [1]),
                            dtype=torch.uint8, device=q_BNSD.device)
    out = torch.empty_strided(q_BNSD.shape, q_BNSD.stride(), dtype=q_BNSD.dtype, device=q_BNSD.device)

    def run(plan: int):
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        graph.execute_plan_at_index({ts[0]: q_BNSD, ts[1]: k_BNSD, ts[2]: v_BNSD, o: out}, workspace, plan,
                                    handle=handle)
        return out

    return [graph.get_plan_name_at_index(i) for i in range(count)], run


def fa4_function():
    """flash-attn-4's forward, or the reason it cannot run here."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001  (ImportError, or a CUDA/DSL library failing to load)
        return None, f"flash-attn-4 not importable ({type(e).__name__}: {e})"
    return flash_attn_func, None


def run_heads(heads: int, rows: int, device: torch.device, table: dict) -> None:
    g = torch.Generator(device).manual_seed(0)
    shape = (1, rows, heads, HEAD_DIM)
    q, k, v = (torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * rows * rows * heads * HEAD_DIM
    ref_rows = torch.linspace(0, rows - 1, min(REF_ROWS, rows), device=device).long()
    ref_heads = min(REF_HEADS, heads)
    want = reference_rows(q, k, v, ref_rows, ref_heads)
    out = {"heads": heads, "rows": rows, "head_dim": HEAD_DIM, "tflop": flops / 1e12, "kernels": {}, "skipped": {},
           "plans": {}}
    cuda = device.type == "cuda"

    def add(name, fn, to_bsnd=lambda o: o):
        try:
            result = to_bsnd(fn())
            ms = timed(fn, device)
        except Exception as e:  # noqa: BLE001  (a variant cuDNN refuses is a result, not a crash)
            out["skipped"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print(f"  {name:30s} skipped: {out['skipped'][name]}", flush=True)
            return
        err = rel_err(result, want, ref_rows, ref_heads)
        out["kernels"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err": err}
        print(f"  {name:30s} {ms:8.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  rel err {err:.2e}", flush=True)

    def skip(name, reason):
        out["skipped"][name] = reason
        print(f"  {name:30s} skipped: {reason}", flush=True)

    print(f"{heads} heads x {rows} rows x {HEAD_DIM} ({flops / 1e12:.1f} TFLOP)", flush=True)
    bnsd = lambda o: o.transpose(1, 2)  # noqa: E731  ([B, N, S, D] results back to [B, S, N, D])
    # bf16.
    add("sdpa_default", lambda: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))), bnsd)
    for kernel in ("cudnn", "fa3"):
        problem = kernel_problem(kernel, "bf16", device)
        if problem:
            skip(kernel, problem)
        else:
            add(kernel, lambda kernel=kernel: attention(q, k, v, kernel))
    if cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            add("cudnn_bhsd", lambda: F.scaled_dot_product_attention(qh, kh, vh), bnsd)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            add("sdpa_flash", lambda: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))), bnsd)
        del qh, kh, vh
        try:
            names, run_plan = cudnn_frontend_bf16(*(t.transpose(1, 2) for t in (q, k, v)))
            out["plans"]["cudnn_fe_bf16"] = names
            for i in range(len(names)):
                add(f"cudnn_fe_plan{i}", lambda i=i: run_plan(i), bnsd)
        except Exception as e:  # noqa: BLE001
            skip("cudnn_fe_plan*", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        fa4, reason = fa4_function()
        if fa4 is None:
            skip("fa4", reason)
        else:
            add("fa4", lambda: fa4(q, k, v, causal=False), lambda o: o[0] if isinstance(o, tuple) else o)
    # FP8: the block's quantization (v centered; the mean is added back after the kernel).
    v_centered, mu = center_rows(v)
    scales = [fp8_scale(t.abs().amax()) for t in attention_calibration_tensors(q, k, v).values()]
    q8, k8, v8 = (quantize_fp8(t, s).contiguous() for t, s in zip((q, k, v_centered), scales))

    def dequantized(o_BSND):
        return (o_BSND.float() * scales[2] if o_BSND.dtype == FP8 else o_BSND.float()) + mu

    for kernel in ("cudnn", "fa3", "emulated"):
        problem = kernel_problem(kernel, "fp8", device)
        if problem:
            skip(f"fp8_{kernel}", problem)
        elif kernel != "emulated" or not cuda:
            add(f"fp8_{kernel}", lambda kernel=kernel: fp8_sdpa(q8, k8, v8, *scales, kernel), dequantized)
    if cuda and kernel_problem("cudnn", "fp8", device) is None:
        q8h, k8h, v8h = (t.transpose(1, 2).contiguous() for t in (q8, k8, v8))
        views = {"": tuple(t.transpose(1, 2) for t in (q8, k8, v8)), "_bhsd": (q8h, k8h, v8h)}
        for layout, (a, b, c) in views.items():
            for suffix, o_dtype in (("", FP8), ("_bf16out", torch.bfloat16)):
                if layout or suffix:
                    add(f"fp8_cudnn{layout}{suffix}",
                        lambda a=a, b=b, c=c, o_dtype=o_dtype: cudnn_fp8_attention(a, b, c, *scales, out_dtype=o_dtype),
                        lambda o: dequantized(o.transpose(1, 2)))
        a, b, c = views[""]
        try:
            names = cudnn_fp8_plans(a, b, c)
            out["plans"]["cudnn_fp8"] = names
            for i in range(len(names)):
                add(f"fp8_cudnn_plan{i}", lambda i=i: cudnn_fp8_attention(a, b, c, *scales, plan=i),
                    lambda o: dequantized(o.transpose(1, 2)))
        except Exception as e:  # noqa: BLE001
            skip("fp8_cudnn_plan*", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    table["results"].append(out)


def accuracy_mean3(rows: int, device: torch.device) -> dict:
    """56 heads, v with mean 3 over the rows: each FP8 kernel fed v as is vs centered (rel err, mean ratio)."""
    g = torch.Generator(device).manual_seed(1)
    q, k, v = (torch.randn(1, rows, 56, HEAD_DIM, device=device, generator=g, dtype=torch.bfloat16)
               for _ in range(3))
    v = v + 3.0
    ref_rows = torch.linspace(0, rows - 1, min(REF_ROWS, rows), device=device).long()
    want = reference_rows(q, k, v, ref_rows, REF_HEADS)
    result = {}
    from h3trt.calibration.modules import fp8_attention

    for kernel in ("cudnn", "fa3", "emulated"):
        if kernel_problem(kernel, "fp8", device) or (kernel == "emulated" and device.type == "cuda"):
            continue
        sc = [fp8_scale(t.abs().amax()) for t in attention_calibration_tensors(q, k, v).values()]
        raw_scale = fp8_scale(v.abs().amax())
        raw = fp8_sdpa(quantize_fp8(q, sc[0]).contiguous(), quantize_fp8(k, sc[1]).contiguous(),
                       quantize_fp8(v, raw_scale).contiguous(), sc[0], sc[1], raw_scale, kernel)
        raw = raw.float() * raw_scale if raw.dtype == FP8 else raw.float()
        for name, o in (("uncentered", raw), ("centered", fp8_attention(q, k, v, *sc, kernel))):
            got = o[:, ref_rows, :REF_HEADS].float()
            result[f"{kernel}_{name}"] = {"rel_err": ((got - want).norm() / want.norm()).item(),
                                          "mean_ratio": (got.mean() / want.mean()).item()}
    return result


def published_config(device: torch.device) -> dict:
    """cuDNN at NVIDIA's published H200 configuration (GQA 64/8, 32,768 rows) and with 64 kv heads."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows, out = 32_768, {}
    for kv_heads in (8, 64):
        g = torch.Generator(device).manual_seed(2)
        q = torch.randn(1, rows, 64, HEAD_DIM, device=device, generator=g, dtype=torch.bfloat16)
        k, v = (torch.randn(1, rows, kv_heads, HEAD_DIM, device=device, generator=g, dtype=torch.bfloat16)
                for _ in range(2))
        flops = 4 * rows * rows * 64 * HEAD_DIM
        entry = {}
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ms = timed(lambda: F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=kv_heads != 64), device)
            entry["bf16_sdpa_cudnn"] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as e:  # noqa: BLE001
            entry["bf16_sdpa_cudnn"] = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        try:
            _, run_plan = cudnn_frontend_bf16(*(t.transpose(1, 2) for t in (q, k, v)))
            ms = timed(lambda: run_plan(0), device)
            entry["bf16_cudnn_fe"] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as e:  # noqa: BLE001
            entry["bf16_cudnn_fe"] = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        one = torch.ones(1, device=device)
        q8, k8, v8 = (t.to(FP8).transpose(1, 2) for t in (q, k, v))
        try:
            ms = timed(lambda: cudnn_fp8_attention(q8, k8, v8, one, one, one), device)
            entry["fp8_cudnn"] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as e:  # noqa: BLE001
            entry["fp8_cudnn"] = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        out[f"64q_{kv_heads}kv_{rows}rows"] = entry
        print(f"published config, 64 q / {kv_heads} kv heads x {rows} rows: " + ", ".join(
            f"{n} {e['tflops']:.0f} TFLOP/s" if "tflops" in e else f"{n} skipped ({e['skipped']})"
            for n, e in entry.items()), flush=True)
        del q, k, v, q8, k8, v8
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, nargs="+", default=[56, 28, 14])
    p.add_argument("--rows", type=int, default=ROWS)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--cpu-check", action="store_true", help="tiny shape on the CPU: the rows that run there")
    p.add_argument("--no-published-config", action="store_true", help="skip the 32,768-row GQA comparison")
    args = p.parse_args()
    device = torch.device("cpu" if args.cpu_check else "cuda")
    heads, rows = ([4, 2], 300) if args.cpu_check else (args.heads, args.rows)
    table = {"bench": "attention", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
             "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "results": []}
    for name, module in (("cudnn_frontend", "cudnn"), ("fa3_fwd", "fa3_fwd_interface"),
                         ("flash_attn_4", "flash_attn.cute")):
        try:
            from importlib.metadata import version

            table[name] = version({"cudnn": "nvidia-cudnn-frontend", "fa3_fwd_interface": "fa3-fwd",
                                   "flash_attn.cute": "flash-attn-4"}[module])
        except Exception:  # noqa: BLE001
            table[name] = None
    print(f"{table['device']}, torch {table['torch']}, cuDNN {table['cudnn']}, cudnn-frontend "
          f"{table['cudnn_frontend']}, fa3-fwd {table['fa3_fwd']}, flash-attn-4 {table['flash_attn_4']}", flush=True)
    with torch.no_grad():
        for h in heads:
            run_heads(h, rows, device, table)
            write_json(args.json, table)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        table["accuracy_v_mean_3"] = accuracy_mean3(rows, device) if not args.cpu_check else accuracy_mean3_cpu()
        print("accuracy, v with mean 3: " + ", ".join(f"{n} rel err {a['rel_err']:.2e} (mean x{a['mean_ratio']:.3f})"
                                                      for n, a in table["accuracy_v_mean_3"].items()), flush=True)
        if device.type == "cuda" and not args.no_published_config:
            table["published_config"] = published_config(device)
    write_json(args.json, table)
    return 0


def accuracy_mean3_cpu() -> dict:
    """The --cpu-check stand-in for accuracy_mean3: 300 rows, emulated kernel only."""
    global REF_HEADS
    saved, REF_HEADS = REF_HEADS, 4
    try:
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, 300, 4, HEAD_DIM, generator=g, dtype=torch.bfloat16) for _ in range(3))
        from h3trt.calibration.modules import fp8_attention

        v = v + 3.0
        rows = torch.arange(300)
        want = reference_rows(q, k, v, rows, 4)
        sc = [fp8_scale(t.abs().amax()) for t in attention_calibration_tensors(q, k, v).values()]
        got = fp8_attention(q, k, v, *sc, "emulated").float()
        return {"emulated_centered": {"rel_err": ((got - want).norm() / want.norm()).item(),
                                      "mean_ratio": (got.mean() / want.mean()).item()}}
    finally:
        REF_HEADS = saved


if __name__ == "__main__":
    sys.exit(main())
