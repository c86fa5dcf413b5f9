"""One request's block-sparse attention: which evaluation the denoiser is in, the attention core a sparse evaluation
runs in place of the dense one, and what the clip's record says about it.

The pipeline makes one `SparseRun` per request that asks for sparsity (none otherwise: a dense request never enters
this code) and calls `next_evaluation()` once per denoise step, before the step's DiT call(s); a runner asks
`attention(layout)` for the core of one DiT call: None in a dense evaluation (the runner keeps its own attention,
FP8 attention included), else a function over [B, S, N, D] q/k/v that routes every head (SubBlock: the fused
Triton router on CUDA, torch elsewhere, models/sparse_router.py) and runs `h3trt::sparse_attention` with the
request's kernel. Under Ulysses the function runs after the exchange, on every row of this rank's heads, so each
rank routes its own heads.

Shape legend: B batch, S rows, N heads, D head dim, G query blocks, K key blocks.
"""

from __future__ import annotations

import math
import sys

import torch

from .packing import PackedLayout
from .sparse_attention import SUBBLOCK_BLOCK
from .sparse_kernels import kept_fraction, sparse_attention, warm_sparse_kernel
from .sparse_router import route_blocks, router_for, warm_router
from .sparse_plan import SparseSettings, evaluation_is_sparse, sparse_query_blocks


class SparseRun:
    """A request's sparse attention over its denoise evaluations (models/sparse_plan.py for the rules)."""

    def __init__(self, settings: SparseSettings, kernel: str, block: int = SUBBLOCK_BLOCK):
        if not settings.enabled:
            raise ValueError("SparseRun is for a request with sparsity > 0; a dense request runs without one.")
        self.settings, self.kernel, self.block = settings, kernel, block
        self.evaluation = -1  # the current evaluation, from 0 (-1: none yet)
        self.router: str | None = None  # the SubBlock router of the first sparse attention (router_for its device)
        self.sparse_evaluations: list[int] = []  # evaluations in which a sparse attention ran
        self._kept = self._pairs = 0.0  # computed and all (query block, key block) pairs over the sparse attentions

    def next_evaluation(self) -> None:
        self.evaluation += 1

    def attention(self, layout: PackedLayout):
        """The attention core of one DiT call over `layout` in the current evaluation; None: dense."""
        if not evaluation_is_sparse(self.settings, self.evaluation, layout.seq_len):
            return None
        sparse_G = sparse_query_blocks(layout, self.block).to(layout.token_tags.device)  # once per DiT call
        return lambda q, k, v: self._attend(q, k, v, sparse_G)

    def _attend(self, q_BSND, k_BSND, v_BSND, sparse_G) -> torch.Tensor:
        rows, head_dim = q_BSND.shape[1], q_BSND.shape[3]
        if sparse_G.shape[0] != math.ceil(rows / self.block):
            raise ValueError(f"sparse attention got {rows} query rows for a layout of {sparse_G.shape[0]} blocks.")
        if self.router is None:
            self.router = router_for(q_BSND.device)
        index, _ = route_blocks(q_BSND, k_BSND, self.settings.sparsity, head_dim ** -0.5, self.router,
                                block=self.block)
        key_blocks = math.ceil(k_BSND.shape[1] / self.block)
        pairs = sparse_G.shape[0] * key_blocks
        self._kept += kept_fraction(index, sparse_G, key_blocks) * pairs
        self._pairs += pairs
        if not self.sparse_evaluations or self.sparse_evaluations[-1] != self.evaluation:
            self.sparse_evaluations.append(self.evaluation)
        return sparse_attention(q_BSND, k_BSND, v_BSND, index, sparse_G.to(q_BSND.device), self.block, self.kernel)

    def report(self) -> dict:
        """The clip record's `sparse_attention`: what was asked, the kernel, the router (None: no sparse attention
        ran), the evaluations (from 0) that ran sparse, and the fraction of (query block, key block) pairs computed
        over their attentions (1.0 is dense)."""
        return {**self.settings.to_dict(), "kernel": self.kernel, "block": self.block, "router": self.router,
                "evaluations": self.evaluation + 1, "sparse_evaluations": list(self.sparse_evaluations),
                "kept_fraction": round(self._kept / self._pairs, 6) if self._pairs else None}


def warm_sparse(kernel: str, device, heads: int, head_dim: int, dtype: torch.dtype, block: int) -> None:
    """Compile the sparse attention `kernel` and the device's SubBlock router (warm_router) now, at load, for `heads`
    heads at `block`, so that no request compiles either: every loader of a sparse-serving DiT calls this."""
    warm_sparse_kernel(kernel, device, heads, head_dim, dtype, block)
    warm_router(device, heads, head_dim, dtype, block)


def load_sparse_kernel(device, heads: int, head_dim: int, dtype: torch.dtype) -> tuple[str | None, str | None]:
    """(kernel, problem): the sparse attention kernel a loaded DiT serves, chosen once (default_sparse_kernel: fa4 on
    sm_90 where it loads, flex on another CUDA GPU, reference on the CPU) and compiled now with its router
    (warm_sparse), for `heads` heads (this rank's, under Ulysses) at its block (sparse_block). A kernel or router that
    does not compile here leaves (None, why): the load goes on, dense requests run, and a sparse request is refused
    with why; a note on stderr says so at load."""
    from .sparse_kernels import default_sparse_kernel, sparse_block

    kernel = default_sparse_kernel(device)
    try:
        warm_sparse(kernel, device, heads, head_dim, dtype, sparse_block(kernel, device))
    except Exception as e:  # noqa: BLE001 - an optional kernel never stops a dense load; the reason is kept
        problem = (f"the {kernel} block-sparse attention kernel did not compile on {device} at load, or its SubBlock "
                   f"router ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}), so this engine serves "
                   f"dense attention only. Run the request with --sparse-attention 0 (or a dense profile: lossless, "
                   f"quality), or install FlashAttention-4 (pip install flash-attn-4) on an sm_90 GPU.")
        print(f"h3trt: note: {problem}", file=sys.stderr)
        return None, problem
    return kernel, None
