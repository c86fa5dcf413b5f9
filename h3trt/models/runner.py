"""The one contract of a DiT runner (issue 48 item 3): what the pipeline calls for one DiT evaluation, whatever serves
it (the eager DiT, its Ulysses-sharded twin, a bundle's compiled segments, a TensorRT engine, a recorder around one).

    runner(video_BVC, audio_BAC, text_BLC, unique_t_T, t_index_S, layout, extras) -> (video v_BVC, audio v_BAC), fp32

`extras` (`EvalExtras`) is everything one evaluation carries besides its rows, in one frozen value: a request's step
cache context, its block-sparse attention and its adapters, each None where the request asks for none, so a runner that
serves none of them is called exactly as one that does (a new per-evaluation feature is one more field here, its support
in the runners, and its record). Each member is a `RecordPart`: it says what its feature writes in the clip's record
(`record_fields`), and the pipeline's one record builder (pipeline/records.py `clip_record`) asks the members of a
request's extras for it, in field order, so a new field's feature is recorded with no other change. `RunnerCaps` says
what a runner serves, so that admission checks a request against it once, before anything is queued (a bundle's from its
manifest, without loading it), instead of the pipeline asking the runner attribute by attribute.

Shape legend: B batch, V video rows, A audio rows, L text rows, S packed rows, T distinct timesteps; C channels.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from ..errors import UserError

if TYPE_CHECKING:
    from .config import H3Config
    from .packing import PackedLayout
    from .sparse.run import SparseRun
    from .step_cache import CacheContext
    from .vsa.plan import VsaServing

# Why a runner without a sparse kernel serves no block-sparse attention, when it does not say its own reason.
NO_SPARSE_KERNEL = ("this engine serves no block-sparse attention (a TensorRT bundle's plans fuse their attention). Run "
                    "the request with --sparse-attention 0 (or a dense profile: lossless, quality), on the checkpoint "
                    "(--model), or on an inductor/aoti bundle built with --sparse-attention or --sp > 1.")


class RecordPart(Protocol):
    """A feature's run over one request, as its clip's record sees it."""

    def record_fields(self) -> dict:
        """The clip record's fields this feature writes, by the record's names ({"step_cache": {...}}); {} or a None
        value: nothing of its own. A name the record does not know is written after its own fields, in order."""


class BlockAdapters(Protocol):
    """The low-rank side branches one evaluation adds to one main block's linears (adapters/slots.py `AdapterBlock`).
    A block given None runs exactly its base linears: no side branch is traced or run."""

    def __call__(self, name: str, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`linear(x)` plus the adapters' terms on the block's linear `name` ("attn.qkv_proj", "mlp.fc1", ...)."""


class DiTAdapters(RecordPart, Protocol):
    """The adapters one evaluation of the DiT carries (adapters/slots.py `AdapterRun`): one view per main block, and
    what the clip's record says of them (every member of EvalExtras is a RecordPart)."""

    def block(self, i: int) -> BlockAdapters:
        """The side branches of main block `i`."""


@dataclass(frozen=True)
class EvalExtras:
    """What one DiT evaluation carries besides its rows; None: the request asks for none of it, and the runner runs
    its plain path. Every member is a RecordPart (module doc)."""

    cache: CacheContext | None = None  # the step cache's context of this branch (models/step_cache.py)
    sparse: SparseRun | None = None  # the request's block-sparse attention over its evaluations (models/sparse/run.py)
    adapters: DiTAdapters | None = None  # the request's adapters in the runner's slots (adapters/slots.py AdapterRun)

    def record_parts(self) -> tuple[RecordPart, ...]:
        """The members that are set, in field order: what the clip's record asks for their features' fields."""
        return tuple(part for f in fields(self) if (part := getattr(self, f.name)) is not None)


NO_EXTRAS = EvalExtras()


@dataclass(frozen=True)
class RunnerCaps:
    """What a runner serves beyond a plain evaluation."""

    sparse_kernel: str | None = None  # the block-sparse attention kernel it serves (models/sparse/kernels.py); None
    sparse_problem: str | None = None  # why it serves none, naming the fix (None: NO_SPARSE_KERNEL says it)
    sparse_tile: str | None = None  # the fp8 sparse kernel's tile configuration (a bundle's manifest's; None: default)
    vsa: VsaServing | None = None  # a FastH3-VSA model's settings and kernel (models/vsa/plan.py); None: not one
    adapter_slots: int | None = None  # the adapters one evaluation may carry; None: it holds no adapter slots
    adapter_problem: str | None = None  # why it serves no adapters, naming the fix (None: the general words)
    batches: bool = True  # several requests may share one evaluation (False: compiled for batch 1)

    def check(self, sparse: bool, adapters: int, batch: int = 1) -> None:
        """Refuse what a request (or a batch of `batch`) asks beyond these caps: UserError naming its field."""
        if sparse and self.sparse_kernel is None:
            raise UserError(self.sparse_problem or NO_SPARSE_KERNEL, field="sparse_attention")
        if adapters and self.adapter_problem is not None:
            raise UserError(f"lora: {self.adapter_problem}", field="lora")
        if adapters and self.adapter_slots is None:
            raise UserError("lora: this engine holds no adapter slots, so it serves no per-request adapters; start it "
                            "with --adapter NAME=FILE or --lora-dir DIR (a bundle: build it with --lora-slots N).",
                            field="lora")
        if self.adapter_slots is not None and adapters > self.adapter_slots:
            raise UserError(f"lora asks for {adapters} adapters, but one evaluation carries at most "
                            f"{self.adapter_slots} (the model's LoRA slots); ask for fewer.", field="lora")
        if batch > 1 and not self.batches:
            raise UserError(f"a batch of {batch}: this engine's DiT is compiled for batch 1; pass --max-batch 1.")


class DiTRunner(Protocol):
    """A DiT runner (module doc): its configuration, its caps, and one evaluation per call."""

    cfg: H3Config
    caps: RunnerCaps

    def __call__(self, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor, unique_t: torch.Tensor,
                 t_index: torch.Tensor, layout: PackedLayout,
                 extras: EvalExtras = NO_EXTRAS) -> tuple[torch.Tensor, torch.Tensor]:
        """video [B, V, C], audio [B, A, C_audio], text [B, L, C_text], unique_t [T], t_index [S] -> the velocities
        [B, V, C], [B, A, C_audio], fp32."""
