"""Where block-sparse attention applies in H3: pure functions of a request's sparse settings, the packed layout and
the evaluation index. The router and the kernels are models/sparse/attention.py and models/sparse/kernels.py; the
attention that uses this plan during one evaluation is models/sparse/run.py.

Rules (SubBlock's, SGLang Diffusion; issue 36 part 2):
  - Query blocks are 64 packed rows. A query block is sparse only when every one of its real rows is a target video
    row (a row being generated). Blocks holding any text, audio, or condition video row (an fl2va keyframe, a ref2va
    reference image or video) attend every key block, and so does a mixed block at a boundary: SGLang found the audio
    broke otherwise. Key blocks of every kind compete in the router's top-k.
  - The first `dense_steps` evaluations are dense (default 10). The count is over the request's denoise steps: the
    positive and negative passes of one guided step are one evaluation (both read the same step index, as SGLang
    counts its denoising steps), and a step the step cache skips still counts.
  - An attention over fewer than `min_seq` rows (default 4096) is dense.
  - Sparsity 0 is dense throughout: the sparse path is never entered.

Shape legend: S packed rows, G query blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import UserError
from ..config import VIDEO_TAG
from ..packing import PackedLayout
from .attention import SUBBLOCK_BLOCK

DEFAULT_DENSE_STEPS = 10  # SubBlock's: the first evaluations stay dense
DEFAULT_MIN_SEQ = 4096  # SubBlock's: shorter attentions stay dense


@dataclass(frozen=True)
class SparseSettings:
    """A request's block-sparse attention: the fraction of key blocks skipped per (head, sparse query block), the
    leading evaluations kept dense and the shortest attention made sparse."""

    sparsity: float = 0.0
    dense_steps: int = DEFAULT_DENSE_STEPS
    min_seq: int = DEFAULT_MIN_SEQ

    @property
    def enabled(self) -> bool:
        return self.sparsity > 0.0

    def to_dict(self) -> dict:
        return {"sparsity": self.sparsity, "dense_steps": self.dense_steps, "min_seq": self.min_seq}


def sparse_settings(sparsity: float | None = None, dense_steps: int | None = None,
                    min_seq: int | None = None, where: str = "--") -> SparseSettings:
    """Checked settings from stated values (None: the default). `where` spells the knobs in the message: "--" for the
    flags (--sparse-attention), "" for request keys (sparse_attention). UserError names the knob and what it takes
    (its `field`: the request key)."""
    def name(knob: str) -> str:
        return f"--{knob.replace('_', '-')}" if where == "--" else knob

    if sparsity is None:
        sparsity = 0.0
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not math.isfinite(sparsity) \
            or not 0.0 <= sparsity < 1.0:
        raise UserError(f"{name('sparse_attention')} takes a fraction of key blocks to skip, 0 <= s < 1 (0: dense; "
                        f"0.75 keeps a quarter), got {sparsity!r}.", field="sparse_attention")
    for knob, value, least in (("sparse_dense_steps", dense_steps, 0), ("sparse_min_seq", min_seq, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise UserError(f"{name(knob)} takes a whole number of at least {least}, got {value!r}.", field=knob)
    return SparseSettings(float(sparsity), DEFAULT_DENSE_STEPS if dense_steps is None else dense_steps,
                          DEFAULT_MIN_SEQ if min_seq is None else min_seq)


def evaluation_is_sparse(settings: SparseSettings, evaluation: int, seq_len: int) -> bool:
    """Whether evaluation `evaluation` (from 0, counted over the request's denoise steps) attends sparsely over
    `seq_len` rows."""
    return settings.enabled and evaluation >= settings.dense_steps and seq_len >= settings.min_seq


def target_video_rows(layout: PackedLayout) -> torch.Tensor:
    """[S] bool: the rows being generated as video (condition video rows are not)."""
    rows = torch.zeros(layout.seq_len, dtype=torch.bool)
    target = layout.video_index[layout.num_condition_video_rows:].cpu()
    rows[target] = True
    if not bool((layout.token_tags.cpu()[target] == VIDEO_TAG).all()):
        raise ValueError("a packed layout's target video rows must carry the video tag.")
    return rows


def sparse_query_blocks(layout: PackedLayout, block: int = SUBBLOCK_BLOCK) -> torch.Tensor:
    """[G] bool, G = ceil(S / block): True where every real row of query block g is a target video row (the last
    block may be ragged: only its real rows count). Every other block attends every key block."""
    rows = target_video_rows(layout)
    pad = -layout.seq_len % block
    padded = torch.cat((rows, torch.ones(pad, dtype=torch.bool)))  # rows past the end do not make a block dense
    return padded.view(-1, block).all(dim=1)
