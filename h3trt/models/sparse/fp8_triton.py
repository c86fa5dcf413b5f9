"""FP8 block-sparse attention for Hopper, in Triton: the dense FP8 recipe (h3trt/calibration/fp8_attention.py) over
the key blocks the SubBlock router keeps.

Semantics (`fp8.emulated_fp8_sparse_attention` is the same arithmetic in torch, without the P rounding):
    mu = mean of v over its rows (fp32, per batch, head and channel)
    q8, k8, v8 = e4m3(q / q_scale), e4m3(k / k_scale), e4m3((v - mu) / v_scale)  (saturating at 448)
    o = softmax(q8 k8^T * q_scale * k_scale * D^-1/2 over the kept key rows) v8 * v_scale + mu
Softmax rows sum to one over the kept rows, so centering stays exact there; per-tensor scales are the layer's
calibrated ones (the dense FP8 attention's), so a bundle needs no new calibration.

Two kernels:
  1. `_quantize_kernel`, one pass over each bf16 [B, S, N, D] input (any row and head strides: the exchange buffer's
     slices too): q8 and k8 as [B, N, Sp, D], v8 as v8t [B, N, D, Sp] (V transposed: the PV product's B operand
     must be K-major for Hopper's FP8 wgmma, as in Triton's fused-attention tutorial), rows past S zero; Sp is S
     rounded up to PAD_ROWS, so every tile load stays in bounds and the strides keep their alignment at any length.
  2. `_attention_kernel`, one program per (BLOCK_M query rows, head, batch), FlashAttention's online softmax:
       - the loop runs over the query block's kept key blocks (index[b, n, g, :], ascending; every block where
         sparse_G[g] is False), BLOCK_N rows a step: one key block, two (64-row blocks gathered in pairs so the
         tensor-core tiles stay 128 wide), or half of one;
       - S = q8 k8^T on e4m3 tensor cores, fp32 accumulation; scores in log2 units (log2 e folded into the one
         scale q_scale * k_scale * D^-1/2 * log2 e, so the softmax is exp2); key rows past the end get -inf, and
         so do a key block's rows past its row count where the call gives one (key_sizes: VSA's ragged tiles,
         models/vsa/fp8.py);
       - P = exp2(s - m + log2 448): the unnormalised probabilities times 448 (cuDNN's P scale), in (0, 448], cast
         to e4m3 for the PV product; the row sum l takes the same fp32 P, so the 448 cancels in acc / l;
       - PV accumulates in fp32 registers, the tensor cores' own FP8 accumulator promoted to fp32 after each tile
         (max_num_imprecise_acc = BLOCK_N) unless the configuration says otherwise;
       - epilogue: o = acc / l * v_scale + mu, written in the output dtype to [B, S, N, D].
Integer sizes that follow the sequence are not specialised on (do_not_specialize), so a load's warm-up compiles
everything a request needs. The configurations are fixed (TILE_CONFIGS): no autotuning at a request;
scripts/bench_sparse.py times them all, and a build measures the ones for its block (build/sparse_choice.py).

Precision under Triton's CPU interpreter: its fp32 -> e4m3 cast mis-rounds where rounding carries into the next
binade (it gives 64 for 125.1), so `_e4m3` rounds in fp32 arithmetic first there (INTERPRET) and casts an exact
value; on a GPU it is the hardware's round-to-nearest-even, saturating cast.

This module imports triton at import. Shape legend: B batch, S query rows, Sk key rows, N heads, D head dim, G query
blocks, K key blocks, T kept key blocks, Sp / Skp padded rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
PAD_ROWS = 128  # q8/k8/v8t rows are padded to a multiple of this (>= every routing block and tile)
LOG2E = 1.4426950408889634
LOG2_P_SCALE = tl.constexpr(math.log2(448.0))  # P is kept times 448 (e4m3's largest value) for the PV product
QUANT_ROWS = 64  # rows per program of the quantization pass


@dataclass(frozen=True)
class TileConfig:
    """One compiled shape of the attention kernel."""

    block_m: int  # query rows per program: the routing block or half of it
    block_n: int  # key rows per loop step: a routing block, two 64-row blocks, or half a block
    warps: int  # 4: one warpgroup (wgmma M = 64); 8: two
    stages: int  # software-pipelining depth of the loop's loads
    tma: bool = False  # K and V^T tiles through tensor descriptors (TMA) instead of pointer loads
    promote: bool = True  # PV's FP8 accumulator promoted to fp32 after each tile (False: over the whole row)

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}" + ("_tma" if self.tma else "")
                + ("" if self.promote else "_fastacc"))

    def check(self, block: int) -> None:
        if block not in TILE_CONFIGS:
            raise ValueError(f"the fp8 sparse kernel takes routing blocks of {tuple(TILE_CONFIGS)} rows, got {block}.")
        if block % self.block_m or self.block_n not in (block // 2, block, 2 * block) or self.block_n > 128:
            raise ValueError(f"tile {self.name} does not fit {block}-row blocks: block_m must divide the block and "
                             f"block_n be half a block, one, or two 64-row blocks.")
        if self.tma and self.block_n > block:
            raise ValueError(f"tile {self.name}: a TMA tile reads one contiguous key block, not a gathered pair.")


def _configs(*names: str) -> dict[str, TileConfig]:
    out = {}
    for name in names:
        body, *flags = name.split("_")
        m, rest = body[1:].split("n")
        n, rest = rest.split("w")
        w, s = rest.split("s")
        config = TileConfig(int(m), int(n), int(w), int(s), "tma" in flags, "fastacc" not in flags)
        assert config.name == name, name
        out[name] = config
    return out


# The configurations a build measures for its routing block, the first the default where nothing was measured (a
# CPU build; bench_sparse's block rows without --fp8-tile). Not yet timed on a GPU (no device in the session that
# wrote them): the choices follow FlashAttention-3's and Triton's FP8 attention tutorial (8 warps over 128-row tiles,
# 2-3 pipeline stages: Triton gives this loop two buffers at most, its loads hanging on the index loaded in it), and
# scripts/bench_sparse.py times each at H3's shape.
TILE_CONFIGS: dict[int, dict[str, TileConfig]] = {
    64: _configs("m64n128w4s3", "m64n128w8s3", "m64n64w4s3", "m64n64w4s3_tma", "m64n128w4s2"),
    128: _configs("m128n128w8s3", "m128n128w8s3_tma", "m128n64w8s3", "m64n128w4s3", "m128n128w8s2"),
}
# Timed by the bench only: the tensor cores' FP8 accumulator kept over a whole row of PV (FA3's and cuDNN's fast
# mode, which shrank FP8 attention's output before v was centered).
BENCH_ONLY_CONFIGS: dict[int, dict[str, TileConfig]] = {64: _configs("m64n128w4s3_fastacc"),
                                                        128: _configs("m128n128w8s3_fastacc")}


def tile_config(block: int, name: str | None = None) -> TileConfig:
    """The configuration `name` for `block`-row routing blocks (None: the default, the first listed)."""
    configs = {**TILE_CONFIGS.get(block, {}), **BENCH_ONLY_CONFIGS.get(block, {})}
    if not configs:
        raise ValueError(f"the fp8 sparse kernel takes routing blocks of {tuple(TILE_CONFIGS)} rows, got {block}.")
    if name is None:
        return next(iter(TILE_CONFIGS[block].values()))
    if name not in configs:
        raise ValueError(f"no fp8 sparse tile {name!r} for {block}-row blocks; they are {sorted(configs)}.")
    return configs[name]


@triton.jit
def _scalar(ptr, INTERPRET: tl.constexpr):
    """*ptr as a scalar (the interpreter makes a scalar load a one-element block, which a loop bound cannot be)."""
    if INTERPRET:
        return tl.sum(tl.load(ptr + tl.arange(0, 1)), 0)
    return tl.load(ptr)


@triton.jit
def _e4m3(x, INTERPRET: tl.constexpr):
    """fp32 -> e4m3, round to nearest even, saturating at 448 (the GPU's cvt.rn.satfinite)."""
    if INTERPRET:  # the interpreter: round on e4m3's grid in fp32, then cast an exactly representable value
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        bits = x.to(tl.int32, bitcast=True)
        # normal range (|x| >= 2^-6): keep 3 mantissa bits, ties to even; a carry moves into the exponent as it must
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        # subnormal range: multiples of 2^-9, rounded by an fp32 add at a magnitude whose ulp is 2^-9
        subnormal = (x + 24576.0) - 24576.0
        x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
    return x.to(tl.float8e4nv)


@triton.jit(do_not_specialize=["S", "Sp"])
def _quantize_kernel(x_ptr, out_ptr, scales_ptr, mu_ptr, S, Sp, stride_b, stride_s, stride_n,
                     WHICH: tl.constexpr, N: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                     TRANSPOSE: tl.constexpr, CENTER: tl.constexpr, INTERPRET: tl.constexpr):
    pid_s, n, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    ok = rows < S
    src = x_ptr + b.to(tl.int64) * stride_b + n.to(tl.int64) * stride_n + rows[:, None].to(tl.int64) * stride_s
    x = tl.load(src + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    bn = (b * N + n).to(tl.int64)
    if CENTER:
        x = x - tl.load(mu_ptr + bn * D + d)[None, :]
    x = tl.where(ok[:, None], tl.div_rn(x, _scalar(scales_ptr + WHICH, INTERPRET)), 0.0)
    x8 = _e4m3(x, INTERPRET)
    base = out_ptr + bn * Sp * D
    if TRANSPOSE:  # [D, Sp]: element (row, d) at d * Sp + row
        tl.store(base + d[None, :].to(tl.int64) * Sp + rows[:, None], x8)
    else:
        tl.store(base + rows[:, None].to(tl.int64) * D + d[None, :], x8)


@triton.jit
def _key_rows(it, idx_base, is_sparse, count, T, K, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
              INTERPRET: tl.constexpr):
    """(first key row of step `it` (one contiguous run), its BLOCK_N key rows, whether each is a computed row of a
    listed block): the step's block(s) from the index where the query block is sparse, in order where it is dense."""
    cols = tl.arange(0, BLOCK_N)
    if BLOCK_N >= BLOCK:
        e0 = it * (BLOCK_N // BLOCK)
        blk0 = tl.where(is_sparse, _scalar(idx_base + tl.minimum(e0, T - 1), INTERPRET), e0)
        row0 = blk0 * BLOCK
        if BLOCK_N == 2 * BLOCK:  # two listed blocks side by side; an odd count's last step has one
            e1 = e0 + 1
            has1 = e1 < count
            blk1 = tl.where(is_sparse, _scalar(idx_base + tl.minimum(e1, T - 1), INTERPRET), tl.minimum(e1, K - 1))
            blk1 = tl.where(has1, blk1, blk0)
            krow = tl.where(cols < BLOCK, row0, blk1 * BLOCK - BLOCK) + cols
            listed = (cols < BLOCK) | has1
        else:
            krow = row0 + cols
            listed = cols >= 0
    else:  # half a block a step
        split: tl.constexpr = BLOCK // BLOCK_N
        e = it // split
        blk = tl.where(is_sparse, _scalar(idx_base + tl.minimum(e, T - 1), INTERPRET), e)
        row0 = blk * BLOCK + (it % split) * BLOCK_N
        krow = row0 + cols
        listed = cols >= 0
    return row0, krow, listed


@triton.jit
def _attend_step(it, m_i, l_i, acc, q, qk_scale, k_base, vt_base, k_desc, vt_desc, k_row0, vt_row0, idx_base,
                 is_sparse, count, Sk, Skp, T, K, sizes_ptr, D: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, PROMOTE: tl.constexpr, HAS_SIZES: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """One step of the online softmax over BLOCK_N key rows: (m_i, l_i, acc) updated."""
    row0, krow, listed = _key_rows(it, idx_base, is_sparse, count, T, K, BLOCK, BLOCK_N, INTERPRET)
    d = tl.arange(0, D)
    if USE_TMA:
        k = k_desc.load([(k_row0 + row0).to(tl.int32), 0])
        v = vt_desc.load([vt_row0.to(tl.int32), row0]).T
    else:
        k = tl.load(k_base + krow[:, None] * D + d[None, :])
        v = tl.load(vt_base + d[None, :] * Skp + krow[:, None])  # [BLOCK_N, D] read down v8t's rows: K-major
    s = tl.dot(q, tl.trans(k))
    keep = listed & (krow < Sk)
    if HAS_SIZES:  # ragged key blocks (VSA's tiles): only a block's first sizes[j] rows are keys
        keep = keep & (krow % BLOCK < tl.load(sizes_ptr + krow // BLOCK, mask=krow < Sk, other=0))
    s = s * qk_scale + tl.where(keep, 0.0, float("-inf"))[None, :]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - (m_new - LOG2_P_SCALE)[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    p8 = _e4m3(p, INTERPRET)
    if PROMOTE:
        acc = tl.dot(p8, v, acc, max_num_imprecise_acc=BLOCK_N)
    else:
        acc = tl.dot(p8, v, acc)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["S", "Sk", "Sp_pads", "Skp_pads", "G", "K", "T"])
def _attention_kernel(q_ptr, k_ptr, vt_ptr, k_desc, vt_desc, scales_ptr, mu_ptr, index_ptr, sparse_ptr, sizes_ptr,
                      out_ptr, S, Sk, Sp_pads, Skp_pads, G, K, T, sm_scale_log2, PAD: tl.constexpr,
                      N: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, PROMOTE: tl.constexpr, HAS_MU: tl.constexpr,
                      HAS_SIZES: tl.constexpr, INTERPRET: tl.constexpr):
    pid_m, n, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # Padded row counts, rebuilt from their PAD_ROWS multiples (lengths are not specialised on) so the compiler knows
    # V^T's columns start 16-byte aligned: its loads vectorise and the loop pipelines them (cp.async).
    Sp = Sp_pads * PAD
    Skp = Skp_pads * PAD
    bn = (b * N + n).to(tl.int64)
    g = pid_m * BLOCK_M // BLOCK
    is_sparse = _scalar(sparse_ptr + g, INTERPRET) != 0
    count = tl.where(is_sparse, T, K)
    idx_base = index_ptr + (bn * G + g) * T
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + bn * Sp * D + rows_m[:, None] * D + d[None, :])
    qk_scale = _scalar(scales_ptr, INTERPRET) * _scalar(scales_ptr + 1, INTERPRET) * sm_scale_log2
    v_scale = _scalar(scales_ptr + 2, INTERPRET)
    k_base = k_ptr + bn * Skp * D
    vt_base = vt_ptr + bn * D * Skp
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if BLOCK_N >= BLOCK:
        steps = tl.cdiv(count, BLOCK_N // BLOCK)
    else:
        steps = count * (BLOCK // BLOCK_N)
    if INTERPRET:  # the interpreter cannot take a loaded value as a `for` bound (numpy 2 refuses its int())
        it = 0
        while it < steps:
            m_i, l_i, acc = _attend_step(it, m_i, l_i, acc, q, qk_scale, k_base, vt_base, k_desc, vt_desc, bn * Skp,
                                         bn * D, idx_base, is_sparse, count, Sk, Skp, T, K, sizes_ptr, D, BLOCK,
                                         BLOCK_N, USE_TMA, PROMOTE, HAS_SIZES, INTERPRET)
            it += 1
    else:  # a `for` loop: what Triton software-pipelines (num_stages)
        for it in range(0, steps):
            m_i, l_i, acc = _attend_step(it, m_i, l_i, acc, q, qk_scale, k_base, vt_base, k_desc, vt_desc, bn * Skp,
                                         bn * D, idx_base, is_sparse, count, Sk, Skp, T, K, sizes_ptr, D, BLOCK,
                                         BLOCK_N, USE_TMA, PROMOTE, HAS_SIZES, INTERPRET)
    o = acc / l_i[:, None] * v_scale
    if HAS_MU:
        o += tl.load(mu_ptr + bn * D + d)[None, :]
    out = out_ptr + ((b.to(tl.int64) * S + rows_m[:, None]) * N + n) * D + d[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=(rows_m < S)[:, None])


@dataclass(frozen=True)
class Fp8Operands:
    """What the attention kernel reads: the quantization pass's output (the module docstring's layouts)."""

    q8: torch.Tensor  # [B, N, Sp, D] e4m3
    k8: torch.Tensor  # [B, N, Skp, D] e4m3
    v8t: torch.Tensor  # [B, N, D, Skp] e4m3, v - mu
    scales: torch.Tensor  # [3] fp32: q_scale, k_scale, v_scale
    mu: torch.Tensor | None  # [B, N, D] fp32, v's mean over its rows; None: v was not centered
    rows: int  # S
    key_rows: int  # Sk


def padded_rows(rows: int) -> int:
    return -(-rows // PAD_ROWS) * PAD_ROWS


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def fp8_operands(q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor, q_scale: torch.Tensor,
                 k_scale: torch.Tensor, v_scale: torch.Tensor, center: bool = True,
                 mu_BND: torch.Tensor | None = None) -> Fp8Operands:
    """Quantize [B, S, N, D] q and [B, Sk, N, D] k, v (any dtype, last dim contiguous) with per-tensor scales
    ([1] fp32 tensors on their device; x ~ x8 * scale), v centered over its rows unless `center` is False: by its
    mean, or by `mu_BND` ([B, N, D] fp32) where given (VSA's padded layout: the mean over the real rows only)."""
    B, S, N, D = q_BSND.shape
    Sk = k_BSND.shape[1]
    if k_BSND.shape != v_BSND.shape or (k_BSND.shape[0], k_BSND.shape[2], k_BSND.shape[3]) != (B, N, D):
        raise ValueError(f"fp8 sparse attention takes q [B, S, N, D] and k, v [B, Sk, N, D] of one shape; got "
                         f"{tuple(q_BSND.shape)}, {tuple(k_BSND.shape)}, {tuple(v_BSND.shape)}.")
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"the fp8 sparse kernel takes a head dim that is a power of two from 16 to 256, got {D}.")
    device = q_BSND.device
    scales = torch.cat([s.reshape(1).float() for s in (q_scale, k_scale, v_scale)]).to(device)
    if center and mu_BND is None:
        mu_BND = v_BSND.mean(dim=1, dtype=torch.float32)
    mu_BND = mu_BND.float().contiguous() if center else None
    Sp, Skp = padded_rows(S), padded_rows(Sk)
    q8 = torch.empty((B, N, Sp, D), device=device, dtype=FP8)
    k8 = torch.empty((B, N, Skp, D), device=device, dtype=FP8)
    v8t = torch.empty((B, N, D, Skp), device=device, dtype=FP8)
    for which, (x, out, rows, padded) in enumerate(((q_BSND, q8, S, Sp), (k_BSND, k8, Sk, Skp),
                                                    (v_BSND, v8t, Sk, Skp))):
        if x.stride(-1) != 1:
            x = x.contiguous()
        centered = which == 2 and center
        _quantize_kernel[(padded // QUANT_ROWS, N, B)](
            x, out, scales, mu_BND if centered else scales, rows, padded, x.stride(0), x.stride(1), x.stride(2),
            WHICH=which, N=N, D=D, BLOCK_S=QUANT_ROWS, TRANSPOSE=which == 2, CENTER=centered,
            INTERPRET=_interpreting(), num_warps=4)
    return Fp8Operands(q8, k8, v8t, scales, mu_BND, S, Sk)


def _descriptors(ops: Fp8Operands, config: TileConfig):
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, N, Skp, D = ops.k8.shape
    k_desc = TensorDescriptor.from_tensor(ops.k8.view(B * N * Skp, D), [config.block_n, D])
    vt_desc = TensorDescriptor.from_tensor(ops.v8t.view(B * N * D, Skp), [D, config.block_n])
    return k_desc, vt_desc


def fp8_block_sparse_attention(ops: Fp8Operands, index_BNGT: torch.Tensor, sparse_G: torch.Tensor, block: int,
                               config: TileConfig | None = None, out_dtype: torch.dtype = torch.bfloat16,
                               key_sizes: torch.Tensor | None = None) -> torch.Tensor:
    """Block-sparse attention over quantized operands, scale D^-1/2: query block g (`block` rows) attends the key
    blocks index[b, n, g, :] (int32 [B, N, G, T], ascending) where sparse_G[g] (bool [G]) is True, every key block
    where it is False. `key_sizes` (int32 [K], 1..block; None: every block full up to the last row): key block j's
    first key_sizes[j] rows are its keys, the rest get no probability (VSA's ragged tiles). Returns [B, S, N, D] in
    `out_dtype` (mu added back when v was centered)."""
    config = config or tile_config(block)
    config.check(block)
    B, N, Sp, D = ops.q8.shape
    Skp = ops.k8.shape[2]
    G, K = -(-ops.rows // block), -(-ops.key_rows // block)
    T = index_BNGT.shape[-1]
    if index_BNGT.dtype != torch.int32 or tuple(index_BNGT.shape[:3]) != (B, N, G) or not 1 <= T <= K \
            or sparse_G.shape != (G,) or sparse_G.dtype != torch.bool:
        raise ValueError(f"the routing index must be int32 [B, N, G, T] = [{B}, {N}, {G}, 1..{K}] with sparse_G bool "
                         f"[{G}]; got {index_BNGT.dtype} {tuple(index_BNGT.shape)} and {sparse_G.dtype} "
                         f"{tuple(sparse_G.shape)}.")
    if key_sizes is not None and (key_sizes.dtype != torch.int32 or key_sizes.shape != (K,)):
        raise ValueError(f"key_sizes must be int32 [K] = [{K}], got {key_sizes.dtype} {tuple(key_sizes.shape)}.")
    index_BNGT = index_BNGT.contiguous()
    out = torch.empty((B, ops.rows, N, D), device=ops.q8.device, dtype=out_dtype)
    k_desc, vt_desc = _descriptors(ops, config) if config.tma else (None, None)
    grid = (-(-ops.rows // config.block_m), N, B)
    _attention_kernel[grid](
        ops.q8, ops.k8, ops.v8t, k_desc, vt_desc, ops.scales, ops.mu if ops.mu is not None else ops.scales,
        index_BNGT, sparse_G, key_sizes.contiguous() if key_sizes is not None else sparse_G, out, ops.rows,
        ops.key_rows, Sp // PAD_ROWS, Skp // PAD_ROWS, G, K, T, D ** -0.5 * LOG2E, PAD=PAD_ROWS,
        N=N, D=D, BLOCK=block, BLOCK_M=config.block_m, BLOCK_N=config.block_n, USE_TMA=config.tma,
        PROMOTE=config.promote, HAS_MU=ops.mu is not None, HAS_SIZES=key_sizes is not None,
        INTERPRET=_interpreting(), num_warps=config.warps, num_stages=config.stages)
    return out


def fp8_sparse_attention_triton(q_BSND, k_BSND, v_BSND, q_scale, k_scale, v_scale, index_BNGT, sparse_G,
                                block: int, config: TileConfig | None = None) -> torch.Tensor:
    """The one call: quantize (v centered) and attend; [B, S, N, D] in q's dtype."""
    ops = fp8_operands(q_BSND, k_BSND, v_BSND, q_scale, k_scale, v_scale)
    return fp8_block_sparse_attention(ops, index_BNGT, sparse_G, block, config, q_BSND.dtype)
