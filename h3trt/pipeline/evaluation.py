"""What one request's denoise carries from evaluation to evaluation, beside the pipeline's stages (h3_pipeline.py):
its sparse settings and step cache, the runner's adapter argument, the evaluation count a sparse run advances on, the
finite check of its latents, and whether two requests pack into the same rows."""

from __future__ import annotations

import torch

from ..errors import UserError
from ..models.sampler import Latents, Schedule
from ..models.sparse_kernels import sparse_block
from ..models.sparse_run import SparseRun
from ..models.step_cache import StepCache
from ..models.vsa_plan import VsaRun, request_vsa_run
from ..request.request import Request


def lora_kwargs(lora) -> dict:
    """The runner's `lora` argument where a request has adapters; none at all otherwise (the plain runner's call)."""
    return {"lora": lora} if lora is not None else {}


def counted(model, sparse: SparseRun | VsaRun):
    """The sampler's model function, advancing `sparse` to the next evaluation before each step's DiT call(s)."""
    def step(video, audio, unique_t, t_index):
        sparse.next_evaluation()
        return model(video, audio, unique_t, t_index)

    return step


def sparse_run_for(dit, request: Request, device) -> SparseRun | VsaRun | None:
    """A request's block-sparse attention over its evaluations on `dit` (the pipeline's runner): a FastH3-VSA model's
    VSA on every request (at the request's vsa_sparsity where it states one), SubBlock's where the request asks for
    it and the runner serves it, else None."""
    settings = request.speed.sparse
    vsa = request_vsa_run(getattr(dit, "vsa", None), settings.enabled, request.speed.vsa_sparsity)
    if vsa is not None:  # a FastH3-VSA model: VSA, never SubBlock
        return vsa
    if not settings.enabled:
        return None
    kernel, problem = getattr(dit, "sparse_kernel", None), getattr(dit, "sparse_problem", None)
    tile = getattr(dit, "sparse_tile", None)
    if kernel is None and problem is not None:
        raise UserError(problem)
    if kernel is None:
        raise UserError("this engine serves no block-sparse attention (a TensorRT bundle's plans fuse their "
                        "attention). Run the request with --sparse-attention 0 (or a dense profile: lossless, "
                        "quality), on the checkpoint (--model), or on an inductor/aoti bundle built with "
                        "--sparse-attention or --sp > 1.")
    return SparseRun(settings, kernel, sparse_block(kernel, device), tile)


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
