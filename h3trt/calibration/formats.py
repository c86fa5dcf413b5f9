"""FP8 (e4m3) and NVFP4 (E2M1 + E4M3 per 16 values + fp32 global) tensors: FP8 quantization, NVFP4 dequantization,
and the linear functions the compiled block calls. Pure tensor functions; nothing here holds state. NVFP4 weights
are packed by ModelOpt's own NVFP4 export (h3trt/calibration/calibrate.py): E2M1 codes, element 2j in the low nibble.

Shape legend: N output features, K input features, G = K / 16 NVFP4 groups, M flattened rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP4_MAX = 6.0  # largest E2M1 value
NVFP4_GROUP = 16  # values sharing one E4M3 scale (the NVFP4 format's block)
# Smallest amax turned into a scale: an all-zero tensor (a dead channel, an unused modality) gets a finite scale.
MIN_AMAX = 1e-12


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-tensor scale (fp32, shape [1]) mapping max |x| onto the e4m3 maximum: x ~ q * scale."""
    return (amax.detach().float().reshape(1).clamp_min(MIN_AMAX) / FP8_MAX).contiguous()


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Saturating e4m3 quantization (calibrated scales can be exceeded at serving time; saturate, never inf)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_linear(x: torch.Tensor, weight_NK: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor, fast_accum: bool = False) -> torch.Tensor:
    """y = x @ W^T with W8A8 per-tensor scales, output in x's dtype. `torch._scaled_mm` wants the second operand
    column-major: W^T of a row-major [N, K] weight is exactly that, so no copy. `fast_accum`: cuBLAS keeps the
    Hopper FP8 tensor cores' own accumulator over the whole K instead of promoting partial sums to fp32 registers
    every few k-blocks (faster, a little less exact: QuantRecipe.fp8_accum; no effect on the CPU). On the CPU the
    scales go to the rowwise kernel (below)."""
    x_MK = quantize_fp8(x.reshape(-1, x.shape[-1]), input_scale)
    y_MN = fp8_mm(x_MK, weight_NK, input_scale, weight_scale, x.dtype, fast_accum)
    return y_MN.view(*x.shape[:-1], weight_NK.shape[0])


def fp8_mm(a_MK: torch.Tensor, b_NK: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
           out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """a @ b^T * scale_a * scale_b over e4m3 operands with per-tensor scales ([1] each), out in `out_dtype`."""
    if a_MK.device.type == "cpu":
        # The CPU's per-tensor _scaled_mm is 100-200x slower than its rowwise kernel (torch 2.13: 3.6 s against 28 ms
        # at 2304x64x256): the same two scales, broadcast to every row and column, take the rowwise one. The result
        # equals the per-tensor kernel's to within the output's rounding (the scales are applied in another order).
        scale_a = scale_a.reshape(1, 1).expand(a_MK.shape[0], 1).contiguous()
        scale_b = scale_b.reshape(1, 1).expand(1, b_NK.shape[0]).contiguous()
    return torch._scaled_mm(a_MK, b_NK.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def fp8_adapter_linear(x: torch.Tensor, weight_NK: torch.Tensor, weight_scale: torch.Tensor,
                       input_scale: torch.Tensor, fast_accum: bool, down_PEK: torch.Tensor, up_PEN: torch.Tensor,
                       scales_E: torch.Tensor) -> torch.Tensor:
    """fp8_linear plus LoRA rank rows (adapters/slots.py, FUSED) inside its one FP8 GEMM:
        h = x A^T                    a small FP8 GEMM of the base's own e4m3 input against A (e4m3, its own scale)
        y = [x | h] @ [W | U]^T      U [N, P*E]: the rows' up factors times their strengths, block-diagonal over the
                                     P parts (part p's outputs see part p's h only)
    so the up-projection is P*E more terms of the base GEMM's reduction, and no [M, N] side tensor is written.
    One GEMM has one pair of scales, (s_a, s_w): rank row r's h enters as h / a_r and its U column as
    U * a_r / (s_a s_w), exact in the product for any a_r. a_r = sqrt(amax|h_r| s_a s_w / amax|U_r|) gives both the
    same largest magnitude, sqrt(amax|h_r| amax|U_r| / (s_a s_w)), the choice that keeps both farthest from e4m3's
    ends (448 above, subnormals below). s_a is the base's s_x, unless a row's largest terms outgrow what s_x s_w
    holds (an adapter that moves the output more than the base makes it): then s_a = c s_x, c the power of two that
    makes room, and x's e4m3 values are divided by c, exactly but for those c times closer to the subnormals,
    instead of the adapter's largest terms saturating."""
    parts, rows, n_in = down_PEK.shape
    x_MK = quantize_fp8(x.reshape(-1, n_in), input_scale)
    down_RK = down_PEK.reshape(parts * rows, n_in)
    down_scale = fp8_scale(down_RK.abs().amax())
    h_MR = fp8_mm(x_MK, quantize_fp8(down_RK, down_scale), input_scale, down_scale, x.dtype, fast_accum)
    up_PEN = up_PEN.float() * scales_E[None, :, None]
    up_NR = torch.block_diag(*up_PEN.transpose(1, 2).unbind(0))
    h_amax_R, up_amax_R = (t.abs().amax(dim=0).float().clamp_min(MIN_AMAX) for t in (h_MR, up_NR))
    over = (h_amax_R * up_amax_R / (FP8_MAX ** 2 * input_scale * weight_scale)).amax()
    c = torch.exp2(torch.ceil(torch.log2(over.clamp_min(1.0))))  # 1 unless a row's terms outgrow the base's
    scale_a = input_scale * c
    a_R = (h_amax_R * scale_a * weight_scale / up_amax_R).sqrt()  # per rank row: each its own balance
    a_MK = torch.cat([(x_MK.float() / c).to(FP8), quantize_fp8(h_MR, a_R)], dim=1)
    b_NK = torch.cat([weight_NK, quantize_fp8(up_NR, scale_a * weight_scale / a_R)], dim=1)
    y_MN = fp8_mm(a_MK, b_NK, scale_a, weight_scale, x.dtype, fast_accum)
    return y_MN.view(*x.shape[:-1], weight_NK.shape[0])


def quantize_fp8_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token / per-output-channel) e4m3: (q [M, K] e4m3, scale [M, 1] fp32) with x ~ q * scale. A row's
    scale comes from its own max, so one loud token cannot flatten the others (no calibration needed)."""
    scale_M1 = x_MK.detach().abs().amax(dim=-1, keepdim=True).float().clamp_min(MIN_AMAX) / FP8_MAX
    return quantize_fp8(x_MK, scale_M1), scale_M1


def fp8_rowwise_linear(x: torch.Tensor, weight_NK: torch.Tensor, weight_scale_1N: torch.Tensor,
                       bias_N: torch.Tensor | None) -> torch.Tensor:
    """y = x @ W^T + b with dynamic per-token activation scales and per-output-channel weight scales (the rowwise
    `torch._scaled_mm`: scale_a [M, 1], scale_b [1, N]), output in x's dtype. The bias is added after the GEMM rather
    than passed to it: a pointwise op that Inductor fuses into what consumes y."""
    x_MK, x_scale_M1 = quantize_fp8_rows(x.reshape(-1, x.shape[-1]))
    y_MN = torch._scaled_mm(x_MK, weight_NK.t(), scale_a=x_scale_M1, scale_b=weight_scale_1N, out_dtype=x.dtype)
    if bias_N is not None:
        y_MN = y_MN + bias_N
    return y_MN.view(*x.shape[:-1], weight_NK.shape[0])


# ---- NVFP4 -------------------------------------------------------------------------------------------------------

def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Decode E2M1 codes arithmetically (no lookup table: an exported graph must carry no constant tensors)."""
    c = codes.to(torch.int32)
    sign = 1.0 - 2.0 * ((c >> 3) & 1).float()
    exp, man = ((c >> 1) & 3).float(), (c & 1).float()
    subnormal = man * 0.5
    normal = torch.exp2(exp - 1.0) * (1.0 + 0.5 * man)
    return sign * torch.where(exp == 0, subnormal, normal)


def dequantize_nvfp4(packed_NK2: torch.Tensor, block_scale_NG: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """[N, K] in `dtype`: one pointwise expression, which Inductor compiles into one kernel."""
    N = packed_NK2.shape[0]
    codes = torch.stack((packed_NK2 & 15, packed_NK2 >> 4), dim=-1).view(N, -1)
    values = e2m1_values(codes).view(N, block_scale_NG.shape[1], NVFP4_GROUP)
    return (values * (block_scale_NG.float() * global_scale)[..., None]).view(N, -1).to(dtype)


def nvfp4_weight_only_linear(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
                             global_scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize_nvfp4(packed, block_scale, global_scale, x.dtype))
