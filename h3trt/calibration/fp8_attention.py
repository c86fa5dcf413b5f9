"""FP8 attention: one custom op, `h3trt::fp8_sdpa`, over e4m3 q/k/v with calibrated static per-tensor scales.

The compiled block quantizes q/k/v (fused by Inductor into the RoPE kernel that produces them), calls the op, and
dequantizes its e4m3 output (fused into the out-projection's input quantization). The op is opaque to torch.export
and Inductor (a fake implementation gives its output's shape), so a saved artifact calls it by name: whoever loads a
bundle imports this module first.

Two kernels, chosen at build time and recorded in the manifest, never swapped behind the user's back:
  cudnn      cuDNN's FP8 flash attention through nvidia-cudnn-frontend (Hopper and newer). QK^T and PV run on e4m3
             tensor cores with fp32 accumulation; the unnormalised softmax probabilities (<= 1) are quantized to
             e4m3 with scale 448 before PV; the output is e4m3 (on Hopper cuDNN writes FP8 O only).
  emulated   the reference numerics on any device: q/k/v dequantized into bf16 SDPA, output quantized as cuDNN's.
             It does not quantize the probabilities (SDPA never exposes them), so it is the cudnn kernel's
             numerics up to that one rounding. This is what a CPU build runs and what CI checks.

v is centered first (measured on the H200, scripts/bench_fp8_attention.py --accuracy): the cuDNN kernel's FP8 P.V
accumulation loses low-order bits as the running sum grows, so its output comes out too small by a factor that grows
with the sequence (0.58x at 37,838 rows of flat attention over v with mean 3; 0.91x at 4,096). Softmax rows sum to
one, so softmax(s) v = softmax(s) (v - mu) + mu exactly for mu, v's mean over the rows: the kernel only sees the
centered values, whose running sums stay small, and mu is added back in full precision. Calibration records the max
of the centered v (`attention_calibration_tensors`).

Output scale: attention output rows are convex combinations of v's rows, so |o| <= max |v| and v's own scale
quantizes o without clipping; no separate calibration is needed and the caller dequantizes with `v_scale`.

Shape legend: B batch, S rows, N heads, D head dim.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from .formats import FP8, FP8_MAX, quantize_fp8
from .recipe import ATTENTION_KERNELS

P_SCALE = FP8_MAX  # e4m3 scale of the unnormalised softmax probabilities (all in (0, 1])
CUDNN_FRONTEND_FIX = "pip install 'h3trt[fp8-attention]' (nvidia-cudnn-frontend, cuDNN's Python graph API)"


def center_rows(v_BSND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(v - mu, mu): mu [B, 1, N, D] is each head channel's mean over the rows, in fp32."""
    mu_B1ND = v_BSND.float().mean(dim=1, keepdim=True)
    return (v_BSND.float() - mu_B1ND).to(v_BSND.dtype), mu_B1ND


def attention_calibration_tensors(q_BSND, k_BSND, v_BSND) -> dict[str, torch.Tensor]:
    """The tensors FP8 attention quantizes, by amax key (`attn.q`, `attn.k`, `attn.v`): v centered, as the block runs."""
    return {"q": q_BSND, "k": k_BSND, "v": center_rows(v_BSND)[0]}


def attention_kernel_for(device: torch.device) -> str:
    """The FP8 attention kernel a build on `device` bakes in: cuDNN's on a GPU, the emulation on a CPU."""
    return "cudnn" if torch.device(device).type == "cuda" else "emulated"


def check_attention_kernel(kernel: str, device: torch.device) -> None:
    """Raise, with the fix, where `device` cannot run `kernel` (at build and at load: never a silent emulation)."""
    device = torch.device(device)
    if kernel == "emulated":
        return
    if device.type != "cuda":
        raise ValueError(f"this bundle's FP8 attention runs cuDNN's FP8 kernel, which needs a CUDA GPU; got {device}. "
                         "Serve it on the GPU it was built for, or rebuild without --fp8-attention.")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ValueError(f"cuDNN's FP8 attention runs on sm_90 (Hopper) and newer; this GPU is sm_{major}{minor}. "
                         "Build without --fp8-attention.")
    require_cudnn_frontend()


def require_cudnn_frontend():
    try:
        import cudnn  # noqa: F401  (nvidia-cudnn-frontend)
    except ImportError as e:
        raise RuntimeError(f"the bundle's FP8 attention runs cuDNN's FP8 kernel, and nvidia-cudnn-frontend is not "
                           f"installed: {CUDNN_FRONTEND_FIX}.") from e
    return cudnn


@torch.library.custom_op("h3trt::fp8_sdpa", mutates_args=())
def fp8_sdpa(q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor, q_scale: torch.Tensor,
             k_scale: torch.Tensor, v_scale: torch.Tensor, kernel: str) -> torch.Tensor:
    """Non-causal attention over e4m3 [B, S, N, D] q/k/v (x ~ x_e4m3 * scale); returns e4m3 [B, S, N, D], o ~ o_e4m3 *
    v_scale."""
    if kernel == "cudnn":
        return _cudnn_fp8_sdpa(q_BSND, k_BSND, v_BSND, q_scale, k_scale, v_scale)
    if kernel == "emulated":
        return _emulated_fp8_sdpa(q_BSND, k_BSND, v_BSND, q_scale, k_scale, v_scale)
    raise ValueError(f"FP8 attention kernel must be one of {ATTENTION_KERNELS}, got {kernel!r}.")


@fp8_sdpa.register_fake
def _(q_BSND, k_BSND, v_BSND, q_scale, k_scale, v_scale, kernel):
    return torch.empty_like(q_BSND, memory_format=torch.contiguous_format)


def _emulated_fp8_sdpa(q, k, v, q_scale, k_scale, v_scale) -> torch.Tensor:
    dtype = torch.bfloat16
    q, k, v = ((t.float() * s).to(dtype).transpose(1, 2) for t, s in ((q, q_scale), (k, k_scale), (v, v_scale)))
    out_BNSD = F.scaled_dot_product_attention(q, k, v)
    return quantize_fp8(out_BNSD.transpose(1, 2), v_scale).contiguous()


# ---- cuDNN ---------------------------------------------------------------------------------------------------------

_GRAPHS: dict[tuple, tuple] = {}  # (device, B, S, N, D) -> (graph, tensors, workspace): one cuDNN plan per shape
_HANDLES: dict[int, object] = {}
_LOCK = threading.Lock()


def _bsnd_as_bnsd(shape: torch.Size) -> tuple[list[int], list[int]]:
    """cuDNN's attention takes [B, N, S, D] dims; a contiguous [B, S, N, D] tensor is that view with these strides,
    so q/k/v and the output need no transpose copies."""
    B, S, N, D = shape
    return [B, N, S, D], [S * N * D, D, N * D, 1]


def _cudnn_plan(q: torch.Tensor) -> tuple:
    key = (q.device.index, *q.shape)
    with _LOCK:
        if key in _GRAPHS:
            return _GRAPHS[key]
        cudnn = require_cudnn_frontend()
        handle = _HANDLES.get(q.device.index)
        if handle is None:
            handle = _HANDLES[q.device.index] = cudnn.create_handle()
        e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
        dims, strides = _bsnd_as_bnsd(q.shape)
        q_t, k_t, v_t = (graph.tensor(name=n, dim=dims, stride=strides, data_type=e4m3) for n in "qkv")
        scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
        scales = {n: graph.tensor(name=n, **scalar)
                  for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
        o_t, _, amax_s, amax_o = graph.sdpa_fp8(q=q_t, k=k_t, v=v_t, **scales, is_inference=True,
                                                attn_scale=1.0 / math.sqrt(q.shape[-1]), use_causal_mask=False)
        o_t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
        for amax in (amax_s, amax_o):  # the kernel always writes them; h3trt's scales are static
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=q.device)
        amax_buf = torch.empty(2, dtype=torch.float32, device=q.device)
        _GRAPHS[key] = (graph, handle, (q_t, k_t, v_t, o_t, amax_s, amax_o), scales, workspace, amax_buf)
        return _GRAPHS[key]


def _cudnn_fp8_sdpa(q, k, v, q_scale, k_scale, v_scale) -> torch.Tensor:
    if not q.is_cuda:
        raise ValueError(f"the cudnn FP8 attention kernel runs on CUDA tensors, got {q.device}; a CPU build bakes the "
                         "emulated kernel.")
    cudnn = require_cudnn_frontend()
    if q.dtype != FP8 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"fp8_sdpa takes e4m3 q/k/v of one shape, got {q.dtype} {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}.")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    graph, handle, (q_t, k_t, v_t, o_t, amax_s, amax_o), scales, workspace, amax_buf = _cudnn_plan(q)
    out = torch.empty_like(q)
    one = q_scale.new_ones(1)
    values = {"descale_q": q_scale, "descale_k": k_scale, "descale_v": v_scale, "descale_s": one / P_SCALE,
              "scale_s": one * P_SCALE, "scale_o": 1.0 / v_scale}
    pack = {q_t: q, k_t: k, v_t: v, o_t: out, amax_s: amax_buf[0:1], amax_o: amax_buf[1:2]}
    pack.update({scales[n]: t.float().reshape(1).contiguous() for n, t in values.items()})
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    graph.execute(pack, workspace, handle=handle)
    return out
