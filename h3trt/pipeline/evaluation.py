"""A request's DiT evaluations, beside the pipeline's stages (h3_pipeline.py): what the denoise carries from
evaluation to evaluation (its sparse run and step cache: the runner's EvalExtras, models/runner.py; the evaluation
count a sparse run advances on), classifier-free guidance's two branches, one evaluation profiled (--profile-step),
and the finite check of the final latents.

Guidance: v = v_neg + scale * (v_pos - v_neg), the two branches on one rank set after another, or side by side on the
mesh's two cfg groups, combined after one all-gather. H3 is guidance-distilled (the released checkpoint has one
positive branch; h3_reference.md section 4.3), so guidance is off by default and costs nothing then. With
`--guidance S > 1` the negative branch is the same request with `--negative-prompt`: its own text rows, hence its own
packed layout, over the same video and audio rows.

The profiled evaluation (`StepProfiler`): how long the GPU sat idle, waiting for the host, inside it. `h3trt run
--profile-step N` runs evaluation N under torch.profiler (CUDA activity only: CUPTI records every kernel and copy, the
host side is not instrumented, so the profile changes the step by little) between two device synchronisations. Busy
time is the union of the device intervals (kernels, copies, memsets); idle time is the rest of the step's wall time,
which is what the host costs it: Python and launch work the GPU had to wait for, host syncs (the baked AdaLN row
lookup), and the gap between the first synchronisation and the first kernel. CUDA graphs per segment would remove the
launch share of it; they are worth their complexity only where the idle share is more than about 1% of the step.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..models.packing import PackedLayout
from ..models.runner import NO_EXTRAS, DiTRunner, EvalExtras
from ..models.sampler import Latents, Schedule
from ..models.sparse.kernels import sparse_block
from ..models.sparse.run import SparseRun
from ..models.step_cache import StepCache
from ..models.vsa.plan import VsaRun, request_vsa_run
from ..request.request import Request
from .records import KnownFields

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # chrome-trace "cat" of device-side activity


def counted(model, sparse: SparseRun | VsaRun):
    """The sampler's model function, advancing `sparse` to the next evaluation before each step's DiT call(s)."""
    def step(video, audio, unique_t, t_index):
        sparse.next_evaluation()
        return model(video, audio, unique_t, t_index)

    return step


def sparse_run_for(dit: DiTRunner, request: Request, device) -> SparseRun | VsaRun | None:
    """A request's block-sparse attention over its evaluations on `dit` (the pipeline's runner): a FastH3-VSA model's
    VSA on every request (at the request's vsa_sparsity where it states one), SubBlock's where the request asks for
    it and the runner serves it (its caps: the refusal names the fix), else None."""
    settings, caps = request.speed.sparse, dit.caps
    vsa = request_vsa_run(caps.vsa, settings.enabled, request.speed.vsa_sparsity)
    if vsa is not None:  # a FastH3-VSA model: VSA, never SubBlock
        return vsa
    if not settings.enabled:
        return None
    caps.check(sparse=True, adapters=0)
    return SparseRun(settings, caps.sparse_kernel, sparse_block(caps.sparse_kernel, device), caps.sparse_tile)


# The record of a request denoised alone with dense attention (no sparse run served it): sparsity 0. A batched
# denoise, which no sparse run can serve, says nothing of it.
DENSE = KnownFields({"sparse_attention": {"sparsity": 0.0}})


def new_step_cache(request: Request, schedule: Schedule) -> StepCache | None:
    """A generation's step cache, or None when the request asks for none."""
    config = request.speed.cache
    return StepCache(config, schedule.num_evaluations) if config is not None else None


def check_finite(final: Latents) -> None:
    """Refuse to decode latents holding NaN or inf (a numerical failure: a clip of them is garbage, not a result)."""
    bad = [name for name, rows in (("video", final.video), ("audio", final.audio)) if not torch.isfinite(rows).all()]
    if bad:
        raise FloatingPointError(f"the denoised {' and '.join(bad)} latents hold NaN or inf; the clip was not "
                                 "decoded.")


# Guidance ------------------------------------------------------------------------------------------------------------

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
                    extras: EvalExtras = NO_EXTRAS):
    """The sampler's model function (video, audio, unique_t, t_index) -> (video v, audio v), guided. With `cfg_group`
    (2 ranks) group rank 0 evaluates the positive branch and rank 1 the negative; both get the combined result.
    `extras` (models/runner.py): the request's, on both branches (a sparse run counts both branches of a step as one
    evaluation); its step cache (models/step_cache.py, the cache of `extras.cache`) keeps one state per branch,
    "cond" and "uncond", as the reference's cache contexts, each branch's extras carrying its own (each skips on its
    own residuals)."""
    if cfg_group is not None and dist.get_world_size(cfg_group) != 2:
        raise ValueError(f"A cfg group has 2 ranks (one per branch), got {dist.get_world_size(cfg_group)}.")
    cache = extras.cache.cache if extras.cache is not None else None
    branch_extras: dict[str, EvalExtras] = {}

    def for_branch(name: str) -> EvalExtras:  # a branch's extras made once, at its first evaluation
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


# One evaluation profiled --------------------------------------------------------------------------------------------

def busy_and_idle(intervals: list[tuple[float, float]], start: float, end: float) -> dict:
    """Union of device `intervals` (any unit, clipped to [start, end]) and what is left of [start, end]: busy, idle,
    the number of idle gaps and the longest. Pure: unit-tested."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals if b > start and a < end)
    busy, gaps, longest, cursor = 0.0, 0, 0.0, start
    for a, b in clipped:
        if a > cursor:
            gaps += 1
            longest = max(longest, a - cursor)
        if b > cursor:
            busy += b - max(a, cursor)
            cursor = b
    if end > cursor:
        gaps += 1
        longest = max(longest, end - cursor)
    total = end - start
    return {"wall": total, "busy": busy, "idle": total - busy, "idle_fraction": (total - busy) / total if total else 0.0,
            "gaps": gaps, "longest_gap": longest}


class StepProfiler:
    """Wraps a denoiser (video, audio, unique_t, t_index) -> velocities; evaluation `step` (1-based) runs profiled.
    `report` holds the result once that evaluation has run (None before)."""

    def __init__(self, model, step: int, device: torch.device):
        if step < 1:
            raise ValueError(f"--profile-step counts evaluations from 1, got {step}.")
        self.model, self.step, self.device = model, step, torch.device(device)
        self.calls = 0
        self.report: dict | None = None

    def __call__(self, *args):
        self.calls += 1
        if self.calls != self.step:
            return self.model(*args)
        if self.device.type != "cuda":
            start = time.perf_counter()
            out = self.model(*args)
            self.report = {"step": self.step, "device": str(self.device), "wall_ms": (time.perf_counter() - start) * 1e3,
                           "note": "no GPU: host overhead between GPU work is not defined on the CPU"}
            return out
        return self._profiled(*args)

    def _profiled(self, *args):
        """The evaluation under the profiler. A profiler that cannot run (no CUPTI in this process) does not fail the
        request: the evaluation runs unprofiled and the report says why there is no figure."""
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize(self.device)
        try:
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.__enter__()
        except Exception as e:
            self.report = {"step": self.step, "device": str(self.device), "error": f"torch.profiler: {e}"}
            return self.model(*args)
        try:
            torch.cuda.synchronize(self.device)
            marker = torch.empty(1, device=self.device)
            marker.zero_()  # a device event at the start of the step, on the profiler's clock
            out = self.model(*args)
            torch.cuda.synchronize(self.device)
            marker.zero_()  # and one at its end
            torch.cuda.synchronize(self.device)
        finally:
            prof.__exit__(None, None, None)
        try:
            self.report = self._summarise(prof)
        except Exception as e:  # the measurement failed, not the request: the record says so
            self.report = {"step": self.step, "device": str(self.device), "error": f"{type(e).__name__}: {e}"}
        return out

    def _summarise(self, prof) -> dict:
        with tempfile.TemporaryDirectory(prefix="h3trt-profile-") as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        device_events = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in trace.get("traceEvents", [])
                         if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X"]
        if len(device_events) < 3:
            raise RuntimeError(f"the profiler recorded {len(device_events)} device events (is CUPTI working in this "
                               "process?), so no host-overhead figure can be given")
        device_events.sort()
        # The first and last device events are the two marker memsets: the step is what lies between them.
        start, end = device_events[0][1], device_events[-1][0]
        stats = busy_and_idle(device_events[1:-1], start, end)
        return {"step": self.step, "device": str(self.device), "device_events": len(device_events) - 2,
                "wall_ms": round(stats["wall"] / 1e3, 3), "busy_ms": round(stats["busy"] / 1e3, 3),
                "idle_ms": round(stats["idle"] / 1e3, 3), "idle_fraction": round(stats["idle_fraction"], 5),
                "idle_gaps": stats["gaps"], "longest_gap_ms": round(stats["longest_gap"] / 1e3, 3)}
