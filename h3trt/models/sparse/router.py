"""Which SubBlock router a sparse attention runs, chosen by device, never swapped behind the user's back:
  triton  the fused router (models/sparse/router_triton.py) on a CUDA GPU: 3 kernels, no pair-score buffer.
  torch   `subblock_route` (models/sparse/attention.py) elsewhere: the CPU, CI, and the reference for the other.
Both keep the same blocks (the Triton path's scores agree with torch's to a few fp32 ulp; the module docstring of
sparse/router_triton.py says where that can matter). On CUDA the torch router took 15.23 ms a layer at H3's shape on
the H200, 63% of the sparse attention it routes, so a CUDA device without a loadable Triton is refused with the
reason and the fix rather than routed slowly: at load, `warm_router` compiles the Triton kernels, and a failure there
leaves the engine dense with that reason (models/sparse/run.py, load_sparse_kernel), as a kernel that does not
compile does.

Shape legend: B batch, S rows, N heads, D head dim, G query blocks, T kept key blocks.
"""

from __future__ import annotations

import functools

import torch

from ...errors import UserError
from .attention import SUBBLOCK_BLOCK, subblock_route

ROUTERS = ("torch", "triton")
TRITON_FIX = ("install Triton (pip install triton; torch's CUDA wheels depend on it, and the GPU image carries 3.6), "
              "or run sparse requests on the CPU")


# On by default on CUDA, measured on one H100 (torch 2.11+cu130, Triton 3.6; bench/README.md, issue 46): at H3's
# 37,838 rows x 56 heads, 64-row blocks, the Triton router took 3.79-3.91 ms against the torch router's 16.05-16.27
# (scripts/bench_sparse.py, scripts/bench_router.py); no new compile at a second sequence length after its warm-up;
# the kept blocks equal torch's on structured q/k and at 128-row blocks, and on i.i.d. q/k 30 of 33,152 rows differ,
# every one at a score gap <= 4.8e-7 (a near-tie fp32 cannot resolve). Each clip's record names the router.
TRITON_ROUTER_ON_CUDA = True


def choose_router(device_type: str, triton_problem: str | None, triton_on_cuda: bool | None = None) -> str:
    """'triton' on a CUDA device (TRITON_ROUTER_ON_CUDA, on by default), 'torch' on any other. `triton_problem`: why the Triton
    router does not load here (None: it loads); on CUDA that is a UserError naming the fix, not a fallback to the slow
    torch router."""
    if triton_on_cuda is None:
        triton_on_cuda = TRITON_ROUTER_ON_CUDA
    if device_type != "cuda" or not triton_on_cuda:
        return "torch"
    if triton_problem is not None:
        raise UserError(f"the fused SubBlock router needs Triton on a CUDA GPU, and it does not load here "
                        f"({triton_problem}): {TRITON_FIX}.")
    return "triton"


@functools.cache
def triton_router_problem() -> str | None:
    """Why the Triton router module does not import (None: it does). Cached: an install does not change in-process."""
    try:
        from . import router_triton  # noqa: F401
    except (ImportError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def router_for(device) -> str:
    """The router `device` runs (choose_router over this process's Triton), or a UserError with the fix."""
    device = torch.device(device)
    return choose_router(device.type, triton_router_problem() if device.type == "cuda" else None)


def route_blocks(q_BSND: torch.Tensor, k_BSND: torch.Tensor, sparsity: float, softmax_scale: float, router: str,
                 n_q: int = 4, n_k: int = 4, block: int = SUBBLOCK_BLOCK) -> tuple[torch.Tensor, int]:
    """(index [B, N, G, T] int32 ascending, T) from `router` ('torch' or 'triton'; arguments as `subblock_route`)."""
    if router == "triton":
        from .router_triton import subblock_route_triton

        return subblock_route_triton(q_BSND, k_BSND, sparsity, softmax_scale, n_q, n_k, block)
    if router == "torch":
        return subblock_route(q_BSND, k_BSND, sparsity, softmax_scale, n_q, n_k, block)
    raise ValueError(f"SubBlock routers are {ROUTERS}, got {router!r}.")


def warm_router(device, heads: int, head_dim: int, dtype: torch.dtype, block: int) -> str:
    """Choose `device`'s router and run it once on an aligned and a ragged sequence of 20 blocks (enough that it
    chooses: half of 20 rounds up to 16 kept), so the Triton kernels compile now, at load, for this (heads, head_dim,
    dtype, block), not in a request (where `h3trt run --engine` refuses any compile). Their lengths are not
    specialised on, so these two serve every sequence length. Returns the router."""
    device = torch.device(device)
    router = router_for(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    for rows in (20 * block, 20 * block + 1):
        q, k = (torch.randn(1, rows, heads, head_dim, generator=generator).to(device, dtype) for _ in range(2))
        route_blocks(q, k, 0.5, head_dim ** -0.5, router, block=block)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return router
