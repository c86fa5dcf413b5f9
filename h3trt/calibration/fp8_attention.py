"""FP8 attention: one custom op, `h3trt::fp8_sdpa`, over e4m3 q/k/v with calibrated static per-tensor scales.

The compiled block quantizes q/k/v (fused by Inductor into the RoPE kernel that produces them), calls the op, and
dequantizes its output (fused into the out-projection's input quantization). The op is opaque to torch.export and
Inductor (a fake implementation gives its output's shape and dtype), so a saved artifact calls it by name: whoever
loads a bundle imports this module first.

Three kernels, chosen at build time (`h3trt build --attention`, measured with `auto`) and recorded in the manifest,
never swapped behind the user's back (what each needs: h3trt/models/attention.py, KERNELS):
  cudnn      cuDNN's FP8 flash attention through nvidia-cudnn-frontend (Hopper and newer). QK^T and PV run on e4m3
             tensor cores with fp32 accumulation; the unnormalised softmax probabilities (<= 1) are quantized to
             e4m3 with scale 448 before PV; the output is e4m3 in v's scale.
  fa3        FlashAttention-3's FP8 forward (the fa3-fwd wheel, sm_90 only): e4m3 q/k/v with per-(batch, head)
             descales (here the per-tensor scales, broadcast), P quantized to e4m3 inside the kernel, bf16 output.
  emulated   the reference numerics on any device: q/k/v dequantized into bf16 SDPA, output quantized as cuDNN's.
             It does not quantize the probabilities (SDPA never exposes them), so it is the cudnn kernel's
             numerics up to that one rounding. This is what a CPU build runs and what CI checks.

v is centered first (measured on the H200, scripts/bench_fp8_attention.py --accuracy): the cuDNN kernel's FP8 P.V
accumulation loses low-order bits as the running sum grows, so its output comes out too small by a factor that grows
with the sequence (0.58x at 37,838 rows of flat attention over v with mean 3; 0.91x at 4,096); FA3's FP8 kernel
shrinks it the same way (0.582x at mean 3, issue 17). Softmax rows sum to one, so softmax(s) v = softmax(s) (v - mu) +
mu exactly for mu, v's mean over the rows: the kernel only sees the centered values, whose running sums stay small,
and mu is added back in full precision. Calibration records the max of the centered v
(`attention_calibration_tensors`).

Output scale: attention output rows are convex combinations of v's rows, so |o| <= max |v| and v's own scale
quantizes o without clipping; no separate calibration is needed and the caller dequantizes with `v_scale`.

Shape legend: B batch, S rows, N heads, D head dim.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..models import attention as _kernels
from ..models.attention import CUDNN_FRONTEND_FIX, check_kernel, kernels_for
from ..models.precision import Precision
from .formats import FP8, FP8_MAX, quantize_fp8

P_SCALE = FP8_MAX  # e4m3 scale of the unnormalised softmax probabilities (all in (0, 1])
FP8_KERNELS = kernels_for(Precision.FP8)  # ("cudnn", "fa3", "emulated")


def center_rows(v_BSND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(v - mu, mu): mu [B, 1, N, D] is each head channel's mean over the rows, in fp32."""
    mu_B1ND = v_BSND.float().mean(dim=1, keepdim=True)
    return (v_BSND.float() - mu_B1ND).to(v_BSND.dtype), mu_B1ND


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def centered_attention(q_BSND, k_BSND, v_BSND, q_in=_same, k_in=_same, v_in=_same) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v as FP8 attention's calibration runs it: v centered, SDPA over q_in(q), k_in(k),
    v_in(v - mu), mu added back in fp32. The `*_in` are ModelOpt's quantizers (h3trt/calibration/calibrate.py), which
    pass their input through while they calibrate; left out, this is the attention of the calibration's
    trajectories. Returns [B, S, N, D] in q's dtype."""
    from ..models.dit import sdpa_attention

    v_centered, mu_B1ND = center_rows(v_BSND)
    out = sdpa_attention(q_in(q_BSND), k_in(k_BSND), v_in(v_centered))
    return (out.float() + mu_B1ND).to(q_BSND.dtype)


def attention_calibration_tensors(q_BSND, k_BSND, v_BSND) -> dict[str, torch.Tensor]:
    """The tensors FP8 attention quantizes, by amax key (`attn.q`, `attn.k`, `attn.v`): v centered, as the block runs."""
    return {"q": q_BSND, "k": k_BSND, "v": center_rows(v_BSND)[0]}


def check_attention_kernel(kernel: str, device: torch.device) -> None:
    """Raise, with the fix, where `device` cannot run FP8 `kernel` (at build and at load: never a silent emulation)."""
    check_kernel(kernel, Precision.FP8, device)


def output_dtype(kernel: str) -> torch.dtype:
    """What `fp8_sdpa` returns: e4m3 in v's scale (cudnn, emulated), or the dequantized bf16 output (fa3)."""
    return torch.bfloat16 if kernel == "fa3" else FP8


def require_cudnn_frontend():
    try:
        import cudnn  # noqa: F401  (nvidia-cudnn-frontend)
    except ImportError as e:
        raise UserError(f"the bundle's FP8 attention runs cuDNN's FP8 kernel, and nvidia-cudnn-frontend is not "
                        f"installed: {CUDNN_FRONTEND_FIX}.") from e
    return cudnn


@torch.library.custom_op("h3trt::fp8_sdpa", mutates_args=())
def fp8_sdpa(q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor, q_scale: torch.Tensor,
             k_scale: torch.Tensor, v_scale: torch.Tensor, kernel: str) -> torch.Tensor:
    """Non-causal attention over e4m3 [B, S, N, D] q/k/v (x ~ x_e4m3 * scale). Returns [B, S, N, D] in
    `output_dtype(kernel)`: e4m3 with o ~ o_e4m3 * v_scale, or bf16 o itself."""
    if kernel not in FP8_KERNELS:
        raise ValueError(f"FP8 attention kernel must be one of {FP8_KERNELS}, got {kernel!r}.")
    if q_BSND.dtype != FP8 or k_BSND.shape != q_BSND.shape or v_BSND.shape != q_BSND.shape:
        raise ValueError(f"fp8_sdpa takes e4m3 q/k/v of one shape, got {q_BSND.dtype} {tuple(q_BSND.shape)}, "
                         f"{tuple(k_BSND.shape)}, {tuple(v_BSND.shape)}.")
    if kernel == "emulated":
        return _emulated_fp8_sdpa(q_BSND, k_BSND, v_BSND, q_scale, k_scale, v_scale)
    if not q_BSND.is_cuda:
        raise ValueError(f"the {kernel} FP8 attention kernel runs on CUDA tensors, got {q_BSND.device}; a CPU build "
                         "bakes the emulated kernel.")
    q, k, v = (t.contiguous() for t in (q_BSND, k_BSND, v_BSND))
    if kernel == "fa3":
        return fa3_fp8_attention(q, k, v, q_scale, k_scale, v_scale)
    return cudnn_fp8_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), q_scale, k_scale,
                               v_scale).transpose(1, 2)


@fp8_sdpa.register_fake
def _(q_BSND, k_BSND, v_BSND, q_scale, k_scale, v_scale, kernel):
    return torch.empty_like(q_BSND, dtype=output_dtype(kernel), memory_format=torch.contiguous_format)


def _emulated_fp8_sdpa(q, k, v, q_scale, k_scale, v_scale) -> torch.Tensor:
    dtype = torch.bfloat16
    q, k, v = ((t.float() * s).to(dtype).transpose(1, 2) for t, s in ((q, q_scale), (k, k_scale), (v, v_scale)))
    out_BNSD = F.scaled_dot_product_attention(q, k, v)
    return quantize_fp8(out_BNSD.transpose(1, 2), v_scale).contiguous()


# ---- FlashAttention-3 ----------------------------------------------------------------------------------------------

def fa3_fp8_attention(q_BSND, k_BSND, v_BSND, q_scale, k_scale, v_scale) -> torch.Tensor:
    """FA3's FP8 forward: descales are [B, N] fp32 (one per batch and kv head); the per-tensor scales broadcast to
    that shape as stride-0 views. Returns the bf16 output [B, S, N, D] (FA3 writes FP8 attention's output in bf16)."""
    B, _, N, _ = q_BSND.shape
    descales = [s.float().reshape(1, 1).expand(B, N) for s in (q_scale, k_scale, v_scale)]
    out = _kernels.fa3_interface().flash_attn_func(q_BSND, k_BSND, v_BSND, causal=False, q_descale=descales[0],
                                          k_descale=descales[1], v_descale=descales[2])
    return (out[0] if isinstance(out, tuple) else out).contiguous()


# ---- cuDNN ---------------------------------------------------------------------------------------------------------

_GRAPHS: dict[tuple, tuple] = {}  # (device, shapes, strides, output dtype, plan) -> built graph: one per call shape
_HANDLES: dict[int, object] = {}
_LOCK = threading.Lock()


def _cudnn_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_dtype: torch.dtype, plan: int | None):
    """The cuDNN FP8 SDPA graph for [B, N, S, D] views with these strides (k/v may have fewer heads: GQA), writing
    `out_dtype` (e4m3 or bf16) in q's layout; `plan` None: the heuristics' first plan, else every plan is built and
    this index runs (the benchmark's plan sweep)."""
    key = (q.device.index, tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), v.stride(), out_dtype, plan)
    with _LOCK:
        if key in _GRAPHS:
            return _GRAPHS[key]
        cudnn = require_cudnn_frontend()
        handle = _HANDLES.get(q.device.index)
        if handle is None:
            handle = _HANDLES[q.device.index] = cudnn.create_handle()
        e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        o_type = e4m3 if out_dtype == FP8 else cudnn.data_type.BFLOAT16
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
        q_t, k_t, v_t = (graph.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=e4m3)
                         for n, t in zip("qkv", (q, k, v)))
        scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
        scales = {n: graph.tensor(name=n, **scalar)
                  for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
        o_t, _, amax_s, amax_o = graph.sdpa_fp8(q=q_t, k=k_t, v=v_t, **scales, is_inference=True,
                                                attn_scale=1.0 / math.sqrt(q.shape[-1]), use_causal_mask=False)
        o_t.set_output(True).set_dim(list(q.shape)).set_stride(list(q.stride())).set_data_type(o_type)
        for amax in (amax_s, amax_o):  # the kernel always writes them; h3trt's scales are static
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        if plan is None:
            graph.build_plans()
            workspace_bytes = graph.get_workspace_size()
        else:
            graph.build_plans(cudnn.build_plan_policy.ALL)
            workspace_bytes = graph.get_workspace_size_plan_at_index(plan)
        workspace = torch.empty(max(workspace_bytes, 1), dtype=torch.uint8, device=q.device)
        amax_buf = torch.empty(2, dtype=torch.float32, device=q.device)
        _GRAPHS[key] = (graph, handle, (q_t, k_t, v_t, o_t, amax_s, amax_o), scales, workspace, amax_buf)
        return _GRAPHS[key]


def cudnn_fp8_plans(q, k, v, out_dtype: torch.dtype = FP8) -> list[str]:
    """The names of every plan cuDNN offers for this call (heuristics A and fallback), in index order."""
    graph = _cudnn_graph(q, k, v, out_dtype, 0)[0]
    return [graph.get_plan_name_at_index(i) for i in range(graph.get_execution_plan_count())]


def cudnn_fp8_attention(q_BNSD, k_BNSD, v_BNSD, q_scale, k_scale, v_scale, out_dtype: torch.dtype = FP8,
                        plan: int | None = None) -> torch.Tensor:
    """cuDNN's FP8 attention over e4m3 [B, N, S, D] views of any strides (the op passes [B, S, N, D] memory). Returns
    [B, N, S, D] in q's layout: e4m3 in v's scale (o ~ o_e4m3 * v_scale), or bf16 o with `out_dtype` bf16."""
    graph, handle, (q_t, k_t, v_t, o_t, amax_s, amax_o), scales, workspace, amax_buf = _cudnn_graph(
        q_BNSD, k_BNSD, v_BNSD, out_dtype, plan)
    cudnn = require_cudnn_frontend()
    out = torch.empty_strided(q_BNSD.shape, q_BNSD.stride(), dtype=out_dtype, device=q_BNSD.device)
    one = q_scale.new_ones(1)
    values = {"descale_q": q_scale, "descale_k": k_scale, "descale_v": v_scale, "descale_s": one / P_SCALE,
              "scale_s": one * P_SCALE, "scale_o": 1.0 / v_scale if out_dtype == FP8 else one}
    pack = {q_t: q_BNSD, k_t: k_BNSD, v_t: v_BNSD, o_t: out, amax_s: amax_buf[0:1], amax_o: amax_buf[1:2]}
    pack.update({scales[n]: t.float().reshape(1).contiguous() for n, t in values.items()})
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q_BNSD.device).cuda_stream)
    if plan is None:
        graph.execute(pack, workspace, handle=handle)
    else:
        graph.execute_plan_at_index(pack, workspace, plan, handle=handle)
    return out
