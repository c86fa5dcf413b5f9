"""One request's block-sparse attention: which evaluation the denoiser is in, the attention core a sparse evaluation
runs in place of the dense one, and what the clip's record says about it.

The pipeline makes one `SparseRun` per request that asks for sparsity (none otherwise: a dense request never enters
this code) and calls `next_evaluation()` once per denoise step, before the step's DiT call(s); a runner asks
`attention(layout)` for the core of one DiT call: None in a dense evaluation (the runner keeps its own attention,
FP8 attention included), else a function over [B, S, N, D] q/k/v that routes every head (SubBlock: the fused
Triton router on CUDA, torch elsewhere, models/sparse/router.py) and runs `h3trt::sparse_attention` with the
request's kernel, or, with an FP8 kernel (models/sparse/fp8.py), FP8 block-sparse attention with the layer's q/k/v
scales, which the caller passes (`scales=`: a bundle built with --fp8-attention has them per layer). Under Ulysses
the function runs after the exchange, on every row of this rank's heads, so each rank routes its own heads.

Shape legend: B batch, S rows, N heads, D head dim, G query blocks, K key blocks.
"""

from __future__ import annotations

import math
import sys

import torch

from ..packing import PackedLayout
from .attention import SUBBLOCK_BLOCK
from .fp8 import FP8_SPARSE_KERNELS, fp8_sparse_attention
from .kernels import kept_fraction, sparse_attention, warm_sparse_kernel
from .plan import SparseSettings, evaluation_is_sparse, sparse_query_blocks
from .router import route_blocks, router_for, warm_router


class SparseRun:
    """A request's sparse attention over its denoise evaluations (models/sparse/plan.py for the rules)."""

    def __init__(self, settings: SparseSettings, kernel: str, block: int = SUBBLOCK_BLOCK, tile: str | None = None):
        """`tile`: the fp8 kernel's configuration (the bundle's manifest records it; None: the default)."""
        if not settings.enabled:
            raise ValueError("SparseRun is for a request with sparsity > 0; a dense request runs without one.")
        self.settings, self.kernel, self.block, self.tile = settings, kernel, block, tile
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
        return lambda q, k, v, scales=None: self._attend(q, k, v, sparse_G, scales)

    def _attend(self, q_BSND, k_BSND, v_BSND, sparse_G, scales=None) -> torch.Tensor:
        fp8 = self.kernel in FP8_SPARSE_KERNELS
        if fp8 and scales is None:
            raise ValueError(f"the {self.kernel} sparse kernel needs the layer's FP8 q/k/v scales: it runs between the "
                             "halves of a bundle built with --fp8-attention, which passes them.")
        if not fp8 and scales is not None:
            raise ValueError(f"the {self.kernel} sparse kernel runs on the block dtype and takes no FP8 scales.")
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
        sparse_G = sparse_G.to(q_BSND.device)
        if fp8:
            return fp8_sparse_attention(q_BSND, k_BSND, v_BSND, scales, index, sparse_G, self.block, self.kernel,
                                        self.tile)
        return sparse_attention(q_BSND, k_BSND, v_BSND, index, sparse_G, self.block, self.kernel)

    def report(self) -> dict:
        """The clip record's `sparse_attention`: what was asked, the kernel, the router (None: no sparse attention
        ran), the evaluations (from 0) that ran sparse, and the fraction of (query block, key block) pairs computed
        over their attentions (1.0 is dense)."""
        return {**self.settings.to_dict(), "kernel": self.kernel, "block": self.block, "tile": self.tile,
                "router": self.router,
                "evaluations": self.evaluation + 1, "sparse_evaluations": list(self.sparse_evaluations),
                "kept_fraction": round(self._kept / self._pairs, 6) if self._pairs else None}

    def record_fields(self) -> dict:
        """Its part of the clip's record (models/runner.py RecordPart)."""
        return {"sparse_attention": self.report()}


def warm_sparse(kernel: str, device, heads: int, head_dim: int, dtype: torch.dtype, block: int,
                tile: str | None = None) -> None:
    """Compile the sparse attention `kernel` (the fp8 kernel at its `tile`) and the device's SubBlock router
    (warm_router) now, at load, for `heads` heads at `block`, so that no request compiles either: every loader of a
    sparse-serving DiT calls this."""
    warm_sparse_kernel(kernel, device, heads, head_dim, dtype, block, tile)
    warm_router(device, heads, head_dim, dtype, block)


def load_sparse_kernel(device, heads: int, head_dim: int, dtype: torch.dtype,
                       kernels: tuple[str, ...] = ("fa4", "flex")) -> tuple[str | None, str | None]:
    """(kernel, problem): the sparse attention kernel a loaded DiT serves, chosen once (default_sparse_kernel: the
    first of `kernels` the device runs, fa4 on sm_90 where it loads, flex on another CUDA GPU; reference on the CPU)
    and compiled now with its router (warm_sparse), for `heads` heads (this rank's, under Ulysses) at its block
    (sparse_block). A kernel or router that does not compile here leaves (None, why): the load goes on, dense requests
    run, and a sparse request is refused with why; a note on stderr says so at load. A bundle passes ("fa4",): it
    never serves flex, whose kernel a request may compile again (models/sparse/kernels.py)."""
    from .kernels import FA4_FIX, default_sparse_kernel, sparse_block

    kernel = default_sparse_kernel(device, kernels)
    if kernel == "reference" and torch.device(device).type == "cuda":
        problem = (f"no block-sparse attention kernel serves this engine on {device} (it serves {kernels}); "
                   f"{FA4_FIX}. Dense requests run; run this one with --sparse-attention 0.")
        print(f"h3trt: note: {problem}", file=sys.stderr)
        return None, problem
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
