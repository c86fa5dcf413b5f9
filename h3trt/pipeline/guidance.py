"""Classifier-free guidance: v = v_neg + scale * (v_pos - v_neg), the two branches on one rank set after another, or
side by side on the mesh's two cfg groups, combined after one all-gather.

H3 is guidance-distilled (the released checkpoint has one positive branch; h3_reference.md section 4.3), so guidance
is off by default and costs nothing then. With `--guidance S > 1` the negative branch is the same request with
`--negative-prompt`: its own text rows, hence its own packed layout, over the same video and audio rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..models.packing import PackedLayout
from ..models.runner import NO_EXTRAS, DiTRunner, EvalExtras
from ..models.step_cache import StepCache


@dataclass
class Branch:
    """One guidance branch: its text embedding [1, L, C] and packed layout, on the device."""

    text: torch.Tensor
    layout: PackedLayout


def branch_t_index(to: PackedLayout, frm: PackedLayout, t_index_S: torch.Tensor) -> torch.Tensor:
    """The row timestep index of layout `to` for the evaluation whose index over layout `frm` is `t_index_S`.

    Branches differ only in their text rows; video and audio rows (condition rows first) match one to one, and text
    and padding rows take the video t, which every text row of `frm` carries.
    """
    out = t_index_S[frm.text_index[0]].expand(to.seq_len).clone()
    out[to.video_index] = t_index_S[frm.video_index]
    out[to.audio_index] = t_index_S[frm.audio_index]
    return out


def combine(pos: torch.Tensor, neg: torch.Tensor, scale: float) -> torch.Tensor:
    """The guided velocity, in fp32."""
    pos, neg = pos.float(), neg.float()
    return neg + scale * (pos - neg)


def guided_denoiser(dit: DiTRunner, positive: Branch, negative: Branch, scale: float, cfg_group=None,
                    extras: EvalExtras = NO_EXTRAS, cache: StepCache | None = None):
    """The sampler's model function (video, audio, unique_t, t_index) -> (video v, audio v), guided. With `cfg_group`
    (2 ranks) group rank 0 evaluates the positive branch and rank 1 the negative; both get the combined result.
    `extras` (models/runner.py): the request's, on both branches (a sparse run counts both branches of a step as one
    evaluation); a step `cache` (models/step_cache.py) keeps one state per branch, "cond" and "uncond", as the
    reference's cache contexts, each branch's extras carrying its own (each skips on its own residuals)."""
    if cfg_group is not None and dist.get_world_size(cfg_group) != 2:
        raise ValueError(f"A cfg group has 2 ranks (one per branch), got {dist.get_world_size(cfg_group)}.")
    branch_extras: dict[str, EvalExtras] = {}

    def for_branch(name: str) -> EvalExtras:  # a branch's context made at its first evaluation, as the cache expects
        if name not in branch_extras:
            branch_extras[name] = replace(extras, cache=cache.context(name)) if cache is not None else extras
        return branch_extras[name]

    def model(video, audio, unique_t, t_index):
        t_neg = branch_t_index(negative.layout, positive.layout, t_index)
        runs = ((positive, t_index, "cond"), (negative, t_neg, "uncond"))

        def run(branch, t, name):
            return dit(video, audio, branch.text, unique_t, t, branch.layout, for_branch(name))

        if cfg_group is None:
            (pv, pa), (nv, na) = (run(*r) for r in runs)
        else:
            mv, ma = run(*runs[dist.get_rank(cfg_group)])
            (pv, pa), (nv, na) = _exchange(mv, ma, cfg_group)
        return combine(pv, nv, scale), combine(pa, na, scale)

    return model


def _exchange(video_v: torch.Tensor, audio_v: torch.Tensor, group):
    """Both branches' outputs on both ranks: one all-gather of the two velocities packed into one fp32 buffer."""
    flat = torch.cat([video_v.float().flatten(), audio_v.float().flatten()])
    parts = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(parts, flat, group=group)
    split = video_v.numel()
    return [(p[:split].view(video_v.shape), p[split:].view(audio_v.shape)) for p in parts]
