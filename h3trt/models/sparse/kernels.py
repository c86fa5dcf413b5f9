"""Block-sparse attention: the custom op `h3trt::sparse_attention` over [B, S, N, D] q/k/v and a routing index
(h3trt/models/sparse/attention.py), its kernels, and what each kernel needs from a machine.

A query block g with sparse_G[g] True computes only the key blocks index[b, n, g, :] (the last key block may be
ragged); one with sparse_G[g] False (text, audio, reference and mixed blocks in H3) attends every key row. The op is
opaque to torch.export and Inductor (a fake implementation gives its output's shape), so a compiled segment calls it
by name. Kernels, chosen once and recorded, never swapped behind the user's back:
  reference  masked SDPA: the kept blocks expanded to a boolean row mask, on any device. The oracle CI runs.
  flex       torch FlexAttention under torch.compile, the kept blocks as a BlockMask's full blocks (CUDA; blocks a
             multiple of 128 rows: Inductor refused 64-row blocks at H3's shape on the H200, issue 36).
  fa4        FlashAttention-4's block-sparse forward (flash-attn-4 4.0.0b36, CuTe DSL; sm_90 and newer): the kept
             blocks as BlockSparseTensorsTorch *full* blocks (mask_block_cnt zero: with only the mask_block pair it
             fails in sparse_physical_n_block_forward), indices ascending. 128-row blocks through the public
             flash_attn_func (the SM90 tile); 64-row blocks through the private _flash_attn_fwd(tile_mn=(64, 64)).
  fp8, fp8_emulated  FP8 block-sparse attention with a layer's calibrated q/k/v scales (models/sparse/fp8.py): not
             this op's (it takes no scales); a bundle built with --fp8-attention serves them between its halves.
Every kernel compiles (CuTe JIT, Inductor, Triton) in `warm_sparse_kernel`, at load, never at a request. A bundle
never serves flex (build/sparse_choice.py): its Inductor kernel compiled again at a request on the H100 although the
load had warmed it, which a bundle's no-compile guard refuses.

Shape legend: B batch, S rows, N heads, D head dim, G query blocks, K key blocks, T kept key blocks per query block.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ...errors import UserError
from ..attention import KernelNeeds
from .attention import SUBBLOCK_BLOCK
from .fp8 import FP8_SPARSE_KERNELS, fp8_sparse_attention, unit_scales
from .reference import kept_block_mask, reference_sparse_attention

FA4_MODULE = "flash_attn.cute.interface"  # flash-attn-4's CuTe DSL interface (flash_attn_func, _flash_attn_fwd)
FA4_FIX = ("pip install 'h3trt[fa4]' (flash-attn-4 4.0.0b36 with nvidia-cutlass-dsl 4.8.1: FlashAttention-4's "
           "block-sparse forward)")
TRITON_FIX = "pip install triton (torch's CUDA wheels depend on it; the GPU image carries 3.6)"
SPARSE_KERNELS = ("reference", "flex", "fa4", *FP8_SPARSE_KERNELS)
SPARSE_KERNEL_NEEDS: dict[str, KernelNeeds] = {
    "reference": KernelNeeds(cuda=False),
    "flex": KernelNeeds(cuda=True, min_sm=80),
    "fa4": KernelNeeds(cuda=True, min_sm=90, module=FA4_MODULE, fix=FA4_FIX),
    # FP8 wgmma (Hopper); Triton's FP8 dot also runs on newer GPUs
    "fp8": KernelNeeds(cuda=True, min_sm=90, module="triton", fix=TRITON_FIX),
    "fp8_emulated": KernelNeeds(cuda=False),
}
BF16_SPARSE_KERNELS = tuple(k for k in SPARSE_KERNELS if k not in FP8_SPARSE_KERNELS)  # this op's
FLEX_BLOCK = 128  # flex's block must be a multiple of this on CUDA
FA4_BLOCKS = (64, 128)  # the tiles FA4's SM90 block-sparse forward runs (tile_mn)


def sparse_kernel_problem(kernel: str, device) -> str | None:
    """Why `device` cannot run sparse attention `kernel`, with the fix; None when it can. Imports the kernel's package
    (a wheel that installs but does not load is a problem too)."""
    needs = SPARSE_KERNEL_NEEDS.get(kernel)
    if needs is None:
        raise ValueError(f"sparse attention kernels are {SPARSE_KERNELS}, got {kernel!r}.")
    return needs.problem(f"the {kernel} sparse attention kernel", device,
                         "Use the 'reference' sparse kernel here, or run on a GPU.",
                         f"Use another sparse kernel ({', '.join(k for k in SPARSE_KERNELS if k != kernel)}).")


def check_sparse_kernel(kernel: str, device) -> None:
    """Raise a UserError, with the fix, where `device` cannot run `kernel` (at build and at load)."""
    problem = sparse_kernel_problem(kernel, device)
    if problem is not None:
        raise UserError(problem)


def default_sparse_kernel(device, kernels: tuple[str, ...] = ("fa4", "flex")) -> str:
    """The first of `kernels` that runs on `device` (fa4 where it loads on an sm_90+ GPU, else flex on a CUDA GPU:
    the eager runner's order), else reference: chosen once, then recorded."""
    for kernel in kernels:
        if sparse_kernel_problem(kernel, device) is None:
            return kernel
    return "reference"


def sparse_block(kernel: str, device) -> int:
    """The rows of a routing block `kernel` runs at on `device`: SubBlock's 64, except flex on CUDA, whose Inductor
    kernel takes multiples of FLEX_BLOCK only."""
    return FLEX_BLOCK if kernel == "flex" and torch.device(device).type == "cuda" else SUBBLOCK_BLOCK


def kept_fraction(index_BNGT: torch.Tensor, sparse_G: torch.Tensor, num_key_blocks: int) -> float:
    """(query block, key block) pairs computed over all pairs: sparse query blocks compute T key blocks, dense ones
    all K. One host sync (reads sparse_G)."""
    _, _, G, T = index_BNGT.shape
    if sparse_G.shape != (G,) or not 1 <= T <= num_key_blocks:
        raise ValueError(f"kept_fraction: index [B, N, G, T] = {tuple(index_BNGT.shape)} needs sparse_G of shape "
                         f"({G},) (got {tuple(sparse_G.shape)}) and 1 <= T <= num_key_blocks ({num_key_blocks}).")
    sparse = int(sparse_G.sum())
    return (sparse * T + (G - sparse) * num_key_blocks) / (G * num_key_blocks)


def _check_op_args(q, k, v, index, sparse_G, block, kernel) -> None:
    if kernel not in SPARSE_KERNELS or kernel in FP8_SPARSE_KERNELS:
        raise ValueError(f"h3trt::sparse_attention kernels are {BF16_SPARSE_KERNELS}, got {kernel!r} (the FP8 "
                         "kernels take a layer's scales: models/sparse/fp8.py fp8_sparse_attention).")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or (q.shape[0], q.shape[2], q.shape[3]) != (
            k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(f"sparse_attention takes q [B, S, N, D] and k, v of one shape sharing B, N, D; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    B, S, N, _ = q.shape
    G, K = -(-S // block), -(-k.shape[1] // block)
    if index.dtype != torch.int32 or index.dim() != 4 or tuple(index.shape[:3]) != (B, N, G) \
            or not 1 <= index.shape[3] <= K:
        raise ValueError(f"the routing index must be int32 [B, N, G, T] = [{B}, {N}, {G}, 1..{K}] for {S} query rows "
                         f"and {k.shape[1]} key rows in {block}-row blocks; got {index.dtype} {tuple(index.shape)}.")
    if sparse_G.dtype != torch.bool or tuple(sparse_G.shape) != (G,):
        raise ValueError(f"sparse_G must be a bool [G] = [{G}] tensor (one flag per query block), got "
                         f"{sparse_G.dtype} {tuple(sparse_G.shape)}.")


def full_block_table(index_BNGT: torch.Tensor, sparse_G: torch.Tensor, num_key_blocks: int):
    """(count [B, N, G] int32, blocks [B, N, G, K] int32): what each query block computes, in ascending order: the
    index's T blocks for a sparse query block, all K for a dense one (entries past the count are never read)."""
    B, N, G, T = index_BNGT.shape
    K = num_key_blocks
    every_K = torch.arange(K, device=index_BNGT.device, dtype=torch.int32)
    padded_BNGK = torch.cat([index_BNGT, every_K[T:].expand(B, N, G, K - T)], dim=-1)
    blocks_BNGK = torch.where(sparse_G.view(1, 1, G, 1), padded_BNGK, every_K)
    count_BNG = torch.where(sparse_G, T, K).to(torch.int32).view(1, 1, G).expand(B, N, G).contiguous()
    return count_BNG, blocks_BNGK.contiguous()


@torch.library.custom_op("h3trt::sparse_attention", mutates_args=())
def sparse_attention(q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor, index_BNGT: torch.Tensor,
                     sparse_G: torch.Tensor, block: int, kernel: str) -> torch.Tensor:
    """Block-sparse non-causal attention, scale D^-1/2, with `kernel`: query block g (`block` rows) attends every key
    row where sparse_G[g] is False, else only the rows of key blocks index[b, n, g, :]. Returns a contiguous
    [B, S, N, D] in q's dtype."""
    _check_op_args(q_BSND, k_BSND, v_BSND, index_BNGT, sparse_G, block, kernel)
    if kernel == "reference":
        return reference_sparse_attention(q_BSND, k_BSND, v_BSND, index_BNGT, sparse_G, block)
    if not q_BSND.is_cuda:
        raise ValueError(f"the {kernel} sparse attention kernel runs on CUDA tensors, got {q_BSND.device}; the "
                         "'reference' kernel runs anywhere.")
    if kernel == "flex":
        return flex_sparse_attention(q_BSND, k_BSND, v_BSND, index_BNGT, sparse_G, block, compiled=True)
    return fa4_sparse_attention(q_BSND, k_BSND, v_BSND, index_BNGT, sparse_G, block)


@sparse_attention.register_fake
def _(q_BSND, k_BSND, v_BSND, index_BNGT, sparse_G, block, kernel):
    return torch.empty_like(q_BSND, memory_format=torch.contiguous_format)


# ---- FlexAttention -------------------------------------------------------------------------------------------------

@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic: one compile at warm-up serves every sequence length (the block mask's shapes follow it).
    return torch.compile(flex_attention, dynamic=True)


def flex_block_mask(index_BNGT, sparse_G, block: int, rows: int, key_rows: int):
    """The BlockMask of the kept blocks: all of them full blocks (the fused kernel skips mask_mod there), with a
    mask_mod that reads the same table, which is what flex's unfused (eager) implementation evaluates."""
    from torch.nn.attention.flex_attention import BlockMask

    K = -(-key_rows // block)
    count_BNG, blocks_BNGK = full_block_table(index_BNGT, sparse_G, K)
    kept_BNGK = kept_block_mask(index_BNGT, sparse_G, K)

    def kept(b, h, q_idx, kv_idx):
        return kept_BNGK[b, h, q_idx // block, kv_idx // block]

    return BlockMask.from_kv_blocks(torch.zeros_like(count_BNG), blocks_BNGK, count_BNG, blocks_BNGK,
                                    BLOCK_SIZE=(block, block), mask_mod=kept, seq_lengths=(rows, key_rows))


def flex_sparse_attention(q_BSND, k_BSND, v_BSND, index_BNGT, sparse_G, block, compiled: bool) -> torch.Tensor:
    """FlexAttention over the kept blocks; `compiled` False runs flex's unfused implementation (what tests check on
    the CPU), True the Inductor kernel (CUDA, block a multiple of FLEX_BLOCK)."""
    from torch.nn.attention.flex_attention import flex_attention

    if compiled and block % FLEX_BLOCK:
        raise ValueError(f"the flex sparse attention kernel takes blocks of a multiple of {FLEX_BLOCK} rows on CUDA "
                         f"(Inductor refuses smaller ones at H3's shape), got {block}; route with block={FLEX_BLOCK}.")
    mask = flex_block_mask(index_BNGT, sparse_G, block, q_BSND.shape[1], k_BSND.shape[1])
    fn = _compiled_flex() if compiled else flex_attention
    # Always without grad (the op is forward-only): Dynamo guards on the grad mode, so a caller in the other mode
    # than the warm-up would compile the kernel again, which a bundle's no-compile guard refuses.
    with torch.no_grad():
        out_BNSD = fn(q_BSND.transpose(1, 2), k_BSND.transpose(1, 2), v_BSND.transpose(1, 2), block_mask=mask)
    return out_BNSD.transpose(1, 2).contiguous()


# ---- FlashAttention-4 ----------------------------------------------------------------------------------------------

def fa4_modules():
    """(flash_attn.cute.interface, BlockSparseTensorsTorch), or a UserError naming the fix."""
    try:
        interface = importlib.import_module(FA4_MODULE)
        sparsity = importlib.import_module("flash_attn.cute.block_sparsity")
    except (ImportError, OSError) as e:
        raise UserError(f"the fa4 sparse attention kernel needs {FA4_MODULE!r}, which does not load here "
                        f"({type(e).__name__}: {e}): {FA4_FIX}.") from e
    return interface, sparsity.BlockSparseTensorsTorch


def fa4_sparse_attention(q_BSND, k_BSND, v_BSND, index_BNGT, sparse_G, block) -> torch.Tensor:
    """FA4's block-sparse forward on [B, S, N, D] tensors: every computed block passed as a full block (no mask_mod;
    FA4 masks the ragged last key block by the sequence length itself), indices ascending per row."""
    if block not in FA4_BLOCKS:
        raise ValueError(f"the fa4 sparse attention kernel takes {FA4_BLOCKS}-row blocks, got {block}.")
    interface, BlockSparseTensorsTorch = fa4_modules()
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_BSND, k_BSND, v_BSND))
    count_BNG, blocks_BNGK = full_block_table(index_BNGT, sparse_G, -(-k.shape[1] // block))
    tensors = BlockSparseTensorsTorch(mask_block_cnt=torch.zeros_like(count_BNG), mask_block_idx=blocks_BNGK,
                                      full_block_cnt=count_BNG, full_block_idx=blocks_BNGK, block_size=(block, block))
    if block == 128:
        out = interface.flash_attn_func(q, k, v, block_sparse_tensors=tensors)
    else:
        out = interface._flash_attn_fwd(q, k, v, tile_mn=(64, 64), block_sparse_tensors=tensors)
    out = out[0] if isinstance(out, tuple) else out  # (out, lse)
    return out.contiguous()


def warm_sparse_kernel(kernel: str, device, heads: int, head_dim: int, dtype: torch.dtype, block: int,
                       tile: str | None = None) -> None:
    """Compile `kernel` for (heads, head_dim, dtype, block) now, at load, so no request compiles it: one call per
    batch of 1 and 2, with an aligned and a ragged sequence, each with sparse and dense query blocks (the fp8 kernel
    with its `tile` configuration). Refuses, with the fix, what the device cannot run."""
    device = torch.device(device)
    check_sparse_kernel(kernel, device)
    if kernel == "flex" and block % FLEX_BLOCK:
        raise UserError(f"the flex sparse attention kernel takes blocks of a multiple of {FLEX_BLOCK} rows on CUDA, "
                        f"got {block}: route with {FLEX_BLOCK}-row blocks, or use the fa4 kernel.")
    if kernel == "fa4" and block not in FA4_BLOCKS:
        raise UserError(f"the fa4 sparse attention kernel takes {FA4_BLOCKS}-row blocks, got {block}.")
    generator = torch.Generator(device="cpu").manual_seed(0)
    # Under no_grad, as the pipeline serves (its denoise is @torch.no_grad()): Dynamo guards on the grad mode, and a
    # flex kernel warmed with grad enabled compiled again at the first request, which a bundle's no-compile guard
    # refuses (the H100 smoke's sparse bundle row failed so: "Inductor compile_fx was invoked while serving").
    with torch.no_grad():
        _warm_calls(kernel, device, heads, head_dim, dtype, block, generator, tile)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_calls(kernel, device, heads, head_dim, dtype, block, generator, tile) -> None:
    scales = unit_scales(device)
    for batch in (1, 2):
        for rows in (4 * block, 4 * block + 1):
            G = -(-rows // block)
            index = torch.tensor([0, 2], dtype=torch.int32, device=device).expand(batch, heads, G, 2).contiguous()
            sparse_G = torch.arange(G, device=device) % 2 == 0
            for q, k, v in warm_layouts(batch, rows, heads, head_dim, dtype, device, generator):
                if kernel in FP8_SPARSE_KERNELS:
                    fp8_sparse_attention(q, k, v, scales, index, sparse_G, block, kernel, tile)
                else:
                    sparse_attention(q, k, v, index, sparse_G, block, kernel)


def warm_layouts(batch: int, rows: int, heads: int, head_dim: int, dtype, device, generator):
    """The (q, k, v) [B, S, N, D] layouts a served attention gets: three tensors of their own, and the three slices of
    one [3, B, S, N, D] buffer, as the Ulysses exchange hands them over (engines/bundle.py one_rank_exchange,
    parallel/ulysses.py): k and v start past offset 0 there. Dynamo specialises a zero storage offset, so a kernel
    warmed on the first layout alone compiled again at a bundle's first sparse request (H200 smoke, session 16),
    which its no-compile guard refuses."""
    own = tuple(torch.randn(batch, rows, heads, head_dim, generator=generator).to(device, dtype) for _ in range(3))
    fused = torch.randn(3, batch, rows, heads, head_dim, generator=generator).to(device, dtype).unbind(0)
    return own, fused
