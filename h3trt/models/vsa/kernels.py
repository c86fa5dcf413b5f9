"""The block-sparse attention of VSA over the padded tile layout (models/vsa/tiles.py): 64-row query tiles, each
attending the key tiles its routing keeps (models/vsa/routing.py route_tiles), where a key tile may be ragged: only its
first sizes[j] rows are keys, the rest are padding that no query attends. Pad query rows compute garbage that is dropped.

Kernels, chosen once per engine and recorded, never swapped behind the user's back:
  reference  masked SDPA: the kept tiles and the real key rows as one boolean row mask, a few query tiles at a time;
             any device. The oracle the others are tested against.
  flex       torch FlexAttention: full tiles as a BlockMask's full blocks, ragged ones as its partial blocks with a
             mask_mod that reads the real-row table (on the CPU flex's unfused implementation, in CI; on CUDA the
             Inductor kernel, compiled at load).
  fa4        FlashAttention-4's block-sparse forward at 64 x 64 (models/sparse/kernels.py's path): full tiles as
             full blocks, ragged tiles as mask blocks under a mask_mod (CuTe DSL, `_fa4_real_keys`) that keeps a key
             position where it holds a real row (the form of FA4's own aux-tensor masks; its signature is
             flash-attn-4 4.0.0b36's: batch, head, q, kv, seqlen_info, aux_tensors). CUDA sm_90+, where FA4 loads.
The FP8 kernels (fp8, the Triton FP8 block-sparse kernel given each key tile's row count, and its emulation
fp8_emulated) are models/vsa/fp8.py's, which builds on this module.

Shape legend: B batch, P padded rows (64 G), N heads, D head dim, G tiles, T kept tiles per query tile.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..attention import KernelNeeds
from ..sparse.kernels import SPARSE_KERNEL_NEEDS, fa4_modules
from ..sparse.reference import REFERENCE_MASK_BYTES, kept_block_mask
from .tiles import VSA_TILE_ROWS

VSA_KERNELS = ("reference", "flex", "fa4")  # slowest first: the choice tries them from the end
FA4_CUTE_MODULE = "cutlass.cute"  # the CuTe DSL FA4 compiles a mask_mod with (nvidia-cutlass-dsl, FA4's dependency)


# What each VSA kernel needs from a machine (models/attention.py KernelNeeds): fa4 the block-sparse fa4's, and the
# CuTe DSL its mask_mod compiles with.
VSA_KERNEL_NEEDS = {"reference": KernelNeeds(cuda=False), "flex": KernelNeeds(cuda=True),
                    "fa4": replace(SPARSE_KERNEL_NEEDS["fa4"], also=(FA4_CUTE_MODULE,))}


def vsa_kernel_problem(kernel: str, device) -> str | None:
    """Why `device` cannot run VSA `kernel`, with the fix; None when it can (imports FA4 for fa4)."""
    if kernel not in VSA_KERNELS:
        raise ValueError(f"VSA kernels are {VSA_KERNELS}, got {kernel!r}.")
    return VSA_KERNEL_NEEDS[kernel].problem(f"the {kernel} VSA kernel", device, "Use 'reference' here.",
                                            "Use another VSA kernel (flex or reference).")


def key_valid(sizes_G: torch.Tensor) -> torch.Tensor:
    """[P] bool: True at the real rows of each tile (its first sizes[g] positions)."""
    offsets = torch.arange(VSA_TILE_ROWS, device=sizes_G.device)
    return (offsets.view(1, -1) < sizes_G.view(-1, 1)).reshape(-1)


def _check(q, k, v, index, sparse_G, sizes) -> None:
    B, P, N, _ = q.shape
    G = P // VSA_TILE_ROWS
    if P % VSA_TILE_ROWS or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"VSA attention takes q, k, v of one padded tile shape [B, 64 G, N, D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    if index.dtype != torch.int32 or tuple(index.shape[:3]) != (B, N, G) or sparse_G.shape != (G,) \
            or sizes.shape != (G,):
        raise ValueError(f"VSA routing: index int32 [B, N, G, T] = [{B}, {N}, {G}, T], sparse_G [{G}] and sizes "
                         f"[{G}]; got {index.dtype} {tuple(index.shape)}, {tuple(sparse_G.shape)}, "
                         f"{tuple(sizes.shape)}.")


def vsa_block_attention(q_BPND, k_BPND, v_BPND, index_BNGT, sparse_G, sizes_G, kernel: str) -> torch.Tensor:
    """Attention over the kept tiles' real key rows, scale D^-1/2, with `kernel`: [B, P, N, D] in q's dtype."""
    _check(q_BPND, k_BPND, v_BPND, index_BNGT, sparse_G, sizes_G)
    if kernel == "reference":
        return reference_vsa_attention(q_BPND, k_BPND, v_BPND, index_BNGT, sparse_G, sizes_G)
    if kernel == "flex":
        return flex_vsa_attention(q_BPND, k_BPND, v_BPND, index_BNGT, sparse_G, sizes_G, compiled=q_BPND.is_cuda)
    if kernel == "fa4":
        return fa4_vsa_attention(q_BPND, k_BPND, v_BPND, index_BNGT, sparse_G, sizes_G)
    raise ValueError(f"VSA kernels are {VSA_KERNELS}, got {kernel!r}.")


def reference_vsa_attention(q_BPND, k_BPND, v_BPND, index_BNGT, sparse_G, sizes_G) -> torch.Tensor:
    """Masked SDPA, REFERENCE_MASK_BYTES of mask at a time (query rows attend independently, so chunks change
    nothing)."""
    B, P, N, D = q_BPND.shape
    G = P // VSA_TILE_ROWS
    kept_BNGG = kept_block_mask(index_BNGT, sparse_G, G)
    valid_P = key_valid(sizes_G)
    q, k, v = (t.transpose(1, 2) for t in (q_BPND, k_BPND, v_BPND))
    out = torch.empty((B, N, P, D), dtype=q.dtype, device=q.device)
    step = max(1, REFERENCE_MASK_BYTES // max(1, B * N * VSA_TILE_ROWS * P))
    for g in range(0, G, step):
        g_end = min(G, g + step)
        rows = slice(g * VSA_TILE_ROWS, g_end * VSA_TILE_ROWS)
        mask = kept_BNGG[:, :, g:g_end].repeat_interleave(VSA_TILE_ROWS, 2).repeat_interleave(VSA_TILE_ROWS, 3)
        out[:, :, rows] = F.scaled_dot_product_attention(q[:, :, rows], k, v, attn_mask=mask & valid_P)
    return out.transpose(1, 2).contiguous()


def _block_tables(index_BNGT, sparse_G, sizes_G):
    """(full count, full blocks, partial count, partial blocks) [B, N, G] / [B, N, G, G] int32: each query tile's
    kept key tiles split into full and ragged ones, each list ascending and padded past its count."""
    B, N, G, _ = index_BNGT.shape
    kept = kept_block_mask(index_BNGT, sparse_G, G)  # [B, N, G, G]
    ragged = (sizes_G < VSA_TILE_ROWS).view(1, 1, 1, G)

    def table(mask):
        count = mask.sum(-1, dtype=torch.int32)
        # Ascending kept tiles first: sort by (not kept, tile), stably.
        order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return count.contiguous(), order.contiguous()

    return (*table(kept & ~ragged), *table(kept & ragged))


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def flex_vsa_attention(q_BPND, k_BPND, v_BPND, index_BNGT, sparse_G, sizes_G, compiled: bool) -> torch.Tensor:
    """FlexAttention with full tiles as full blocks and ragged ones as partial blocks (mask_mod: kept and real);
    `compiled` False runs flex's unfused implementation (the CPU), True the Inductor kernel (CUDA)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    P = q_BPND.shape[1]
    full_cnt, full_idx, part_cnt, part_idx = _block_tables(index_BNGT, sparse_G, sizes_G)
    kept = kept_block_mask(index_BNGT, sparse_G, P // VSA_TILE_ROWS)
    valid = key_valid(sizes_G)

    def mask_mod(b, h, q_idx, kv_idx):
        return kept[b, h, q_idx // VSA_TILE_ROWS, kv_idx // VSA_TILE_ROWS] & valid[kv_idx]

    mask = BlockMask.from_kv_blocks(part_cnt, part_idx, full_cnt, full_idx, BLOCK_SIZE=(VSA_TILE_ROWS, VSA_TILE_ROWS),
                                    mask_mod=mask_mod, seq_lengths=(P, P))
    fn = _compiled_flex() if compiled else flex_attention
    with torch.no_grad():  # forward-only; Dynamo guards on the grad mode (sparse.kernels.flex_sparse_attention)
        out = fn(q_BPND.transpose(1, 2), k_BPND.transpose(1, 2), v_BPND.transpose(1, 2), block_mask=mask)
    return out.transpose(1, 2).contiguous()


@functools.cache
def _fa4_real_keys():
    """The fa4 kernel's mask_mod: key position n attends where n >= threshold[n], threshold (int32 [P], the one aux
    tensor) being n at a real row and P at a pad row. Built at first use: the CuTe DSL imports with FA4 only."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def real_keys(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        threshold = utils.scalar_to_ssa(aux_tensors[0][n_idx[0]], cutlass.Int32)
        return n_idx >= threshold

    return real_keys


def fa4_vsa_attention(q_BPND, k_BPND, v_BPND, index_BNGT, sparse_G, sizes_G) -> torch.Tensor:
    """FA4's 64 x 64 block-sparse forward: full tiles as full blocks, ragged tiles as mask blocks under
    `_fa4_real_keys` (module docstring)."""
    interface, BlockSparseTensorsTorch = fa4_modules()
    P = q_BPND.shape[1]
    full_cnt, full_idx, part_cnt, part_idx = _block_tables(index_BNGT, sparse_G, sizes_G)
    tensors = BlockSparseTensorsTorch(mask_block_cnt=part_cnt, mask_block_idx=part_idx, full_block_cnt=full_cnt,
                                      full_block_idx=full_idx, block_size=(VSA_TILE_ROWS, VSA_TILE_ROWS))
    positions = torch.arange(P, device=q_BPND.device, dtype=torch.int32)
    threshold = torch.where(key_valid(sizes_G), positions, P).to(torch.int32).contiguous()
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_BPND, k_BPND, v_BPND))
    out = interface._flash_attn_fwd(q, k, v, tile_mn=(VSA_TILE_ROWS, VSA_TILE_ROWS), block_sparse_tensors=tensors,
                                    mask_mod=_fa4_real_keys(), aux_tensors=[threshold])
    out = out[0] if isinstance(out, tuple) else out
    return out.contiguous()


# The warm-up's check of a kernel against the fp32 reference on the same inputs: max |out - ref| over the real rows,
# relative to max |ref|, by the kernel's dtype (bf16 rounds its output and P at ~4e-3; a kept tile dropped, a pad row
# attended or a ragged edge misread moves the output by tenths).
WARM_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def warm_vsa_kernel(kernel: str, device, heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """Run `kernel` once on a ragged geometry with sparse and dense query tiles (batch 1 and 2), so that its JIT
    (CuTe, Inductor) compiles at load, never at a request, and check its output against the fp32 reference on the
    same inputs (WARM_TOLERANCE): FA4's mask_mod plumbing is tested on the CPU against a stand-in of FA4 only, so a
    GPU whose FA4 reads the masks otherwise fails here, not in a clip. Raises where the device cannot run it or its
    output differs."""
    problem = vsa_kernel_problem(kernel, device)
    if problem is not None:
        raise ValueError(problem)
    with torch.no_grad():
        for q, k, v, index, sparse_G, sizes in warm_cases(device, heads, head_dim, dtype):
            out = vsa_block_attention(q, k, v, index, sparse_G, sizes, kernel)
            if kernel != "reference":
                _check_warm_output(kernel, out, (q, k, v), index, sparse_G, sizes)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def warm_cases(device, heads: int, head_dim: int, dtype: torch.dtype):
    """The warm-up's inputs, batch 1 then 2: (q, k, v [B, P, N, D] in `dtype`, index, sparse_G, sizes) over eight
    tiles, two of them prefix (dense query tiles), five ragged, the video query tiles keeping half the video tiles."""
    from .routing import route_tiles

    generator = torch.Generator(device="cpu").manual_seed(0)
    sizes = torch.tensor([64, 30, 64, 64, 16, 64, 32, 8], device=device)
    G = sizes.shape[0]
    for batch in (1, 2):
        scores = torch.randn(batch, heads, G, G, generator=generator).to(device)
        index, sparse_G = route_tiles(scores, 2, 0.5)
        q, k, v = (torch.randn(batch, G * VSA_TILE_ROWS, heads, head_dim, generator=generator).to(device, dtype)
                   for _ in range(3))
        yield q, k, v, index, sparse_G, sizes


def _check_warm_output(kernel: str, out_BPND, qkv, index_BNGT, sparse_G, sizes_G) -> None:
    want = reference_vsa_attention(*(t.float() for t in qkv), index_BNGT, sparse_G, sizes_G)
    real = key_valid(sizes_G)  # pad query rows compute what nobody reads
    err = (out_BPND[:, real].float() - want[:, real]).abs().max().item()
    scale = want[:, real].abs().max().item()
    bound = WARM_TOLERANCE.get(out_BPND.dtype, 3e-2) * scale
    if not err <= bound:  # NaN fails too
        raise ValueError(f"its output differs from the fp32 reference on the warm-up tiles (max error {err:.3g}, "
                         f"allowed {bound:.3g} at {str(out_BPND.dtype).removeprefix('torch.')}): this install's "
                         "kernel does not compute VSA's masks as h3trt passes them")
