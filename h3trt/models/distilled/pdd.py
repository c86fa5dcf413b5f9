"""PDD's head bank turned into one final projection per forward, and the per-evaluation choice of it.

PDD (arXiv 2607.26004; VideoX-Fun `minimax_h3_pdd.py`, `lora_utils_pdd.py`) trains one final projection per interval
of a fine grid, linspace(1, 0, N + 1) shifted per modality (N = 32). A forward that covers the intervals [s, e) predicts
their mean velocity with the head W = sum_k w_k W_k, b = sum_k w_k b_k, w_k = dt_k / sum(dt[s:e]), dt the interval's
length on that modality's own shifted grid: VideoX-Fun's `pdd_time_grid` (float64) and `pdd_sampling_plan`, the plan
cast to the heads' fp32 and fused by einsum("pn,noi->poi"). Fusing once per forward at build time (SGLang's
`fuse_minimax_h3_pdd_heads`) leaves the final segment one head per forward; which one an evaluation runs follows from
its video timestep, which is distinct per forward of a schedule (`StepHeads`: device tensors only, no host sync).

Shapes: N intervals, F forwards, O a head's outputs (96 video, 32 audio), I its inputs (hidden).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEAD_WEIGHTS = ("video_out.weight", "video_out.bias", "audio_out.weight", "audio_out.bias")  # FinalLayer's names
# A PDD bundle keeps its fused heads [F, ...] in weights/final.safetensors under these names (engines/bundle.py)
PDD_PREFIX = "pdd."


def interval_grid(shift: float, intervals: int) -> torch.Tensor:
    """The ascending time grid t = 1 - sigma [N + 1] of one modality, float64 (VideoX-Fun's pdd_time_grid)."""
    sigma = torch.linspace(1.0, 0.0, intervals + 1, dtype=torch.float64)
    return 1.0 - shift * sigma / (1 + (shift - 1) * sigma)


def interval_plan(shift: float, intervals: int, blocks: tuple[int, ...]) -> torch.Tensor:
    """[F, N] float64: row f weights the intervals of forward f (consecutive `blocks`, summing to N) by their
    length on this modality's grid, normalized to 1 (the block's mean velocity)."""
    if sum(blocks) != intervals or any(b < 1 for b in blocks):
        raise ValueError(f"PDD blocks {blocks} must be positive and cover the {intervals} intervals.")
    dt = interval_grid(shift, intervals).diff()
    plan = torch.zeros(len(blocks), intervals, dtype=torch.float64)
    start = 0
    for f, size in enumerate(blocks):
        span = dt[start:start + size]
        plan[f, start:start + size] = span / span.sum()
        start += size
    return plan


def fuse_heads(weight_NOI: torch.Tensor, bias_NO: torch.Tensor,
               plan_FN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused heads [F, O, I] and [F, O], fp32: the bank (any float dtype, widened exactly) weighted by the plan
    cast to fp32, as VideoX-Fun's MiniMaxH3ParallelHead.forward fuses them."""
    plan = plan_FN.to(torch.float32)
    return (torch.einsum("pn,noi->poi", plan, weight_NOI.to(torch.float32)),
            torch.einsum("pn,no->po", plan, bias_NO.to(torch.float32)))


def fused_step_heads(bank: dict[str, tuple[torch.Tensor, torch.Tensor]], shifts: tuple[float, float],
                     blocks: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """{"video_out.weight": [F, O, I], ...} from the bank {"video_out": (W [N, O, I], b [N, O]), "audio_out": ...},
    each modality on its own grid (video: shifts[0], audio: shifts[1])."""
    out = {}
    for head, shift in (("video_out", shifts[0]), ("audio_out", shifts[1])):
        weight, bias = bank[head]
        w, b = fuse_heads(weight, bias, interval_plan(shift, weight.shape[0], blocks))
        out[f"{head}.weight"], out[f"{head}.bias"] = w, b
    return out


@dataclass
class StepHeads:
    """One fused head per forward of one schedule, chosen per evaluation by the video timestep the forward runs at
    (`timesteps` [F] fp32: the schedule's video t of each forward, exactly the floats the sampler passes)."""

    timesteps: torch.Tensor  # [F] fp32
    heads: dict[str, torch.Tensor]  # HEAD_WEIGHTS -> [F, ...] fp32

    def to(self, device) -> "StepHeads":
        return StepHeads(self.timesteps.to(device), {k: v.to(device) for k, v in self.heads.items()})

    def index(self, unique_t: torch.Tensor, t_index: torch.Tensor, video_index: torch.Tensor) -> torch.Tensor:
        """[1] int64: the forward whose video timestep the target video rows carry (the last video row is a target
        row: condition rows come first). Refuses, on the device, an evaluation at no forward's timestep."""
        row_t = unique_t.index_select(0, t_index.index_select(0, video_index[-1:]))  # [1]
        match = self.timesteps.to(row_t.device) == row_t
        torch._assert_async(match.any(), "PDD: this evaluation's video timestep is none of the schedule's forwards")
        return match.to(torch.int64).argmax().reshape(1)

    def select(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The heads of forward `index` ([1] on the heads' device): name -> [O, I] or [O]."""
        return {name: bank.index_select(0, index)[0] for name, bank in self.heads.items()}
