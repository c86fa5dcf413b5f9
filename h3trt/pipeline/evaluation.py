"""What one request's denoise carries from evaluation to evaluation, beside the pipeline's stages (h3_pipeline.py):
its sparse settings and step cache (the runner's EvalExtras: models/runner.py), the evaluation count a sparse run
advances on, the finite check of its latents, and whether two requests pack into the same rows."""

from __future__ import annotations

import torch

from ..models.runner import DiTRunner
from ..models.sampler import Latents, Schedule
from ..models.sparse.kernels import sparse_block
from ..models.sparse.run import SparseRun
from ..models.step_cache import StepCache
from ..models.vsa.plan import VsaRun, request_vsa_run
from ..request.request import Request


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
