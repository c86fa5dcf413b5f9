"""Fusing a distilled file into the H3 DiT's native weights, and the eager runner that gives each PDD forward its head.

The fusion is the files' own rule, in fp32 with one rounding per parameter: W' = W + sum(scale * up @ down) +
sum(diffs), or W' = the assigned tensor (FastH3's `.set_weight`: the VSA gates). It happens where the LoRAs merge
(build/builder.py load, pipeline/loading.py load_checkpoint), before quantization, calibration and AdaLN baking, so
every downstream artifact sees the distilled weights. `fuse_into` takes any name -> parameter mapping and a filter, so
a streamed build can fuse block by block as the block's weights arrive (fuse_into's `only` picks a block's names).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from ..weight_layout import swap_halves
from ..runner import NO_EXTRAS, EvalExtras, RunnerCaps
from .families import Distilled
from .files import GATE_SUFFIX, DistilledError, Fusion, Patch
from .pdd import HEAD_WEIGHTS, StepHeads


def check_fusion(fusion: Fusion, params: Mapping[str, torch.Tensor],
                 only: Callable[[str], bool] = lambda name: True) -> None:
    """Every parameter the file names (of those `only` accepts: a streamed build's block) exists, each payload fits
    it; refused before anything is changed."""
    path = fusion.path
    for name, patch in fusion.patches.items():
        if not only(name):
            continue
        if name not in params:
            if name.endswith(GATE_SUFFIX):
                raise DistilledError(f"--distilled {path} changes {name}, a VSA gate, but this model has none: only "
                                     "a file that sets every gate (.set_weight) makes a FastH3-VSA model of a base "
                                     "checkpoint; one that adds to the gates needs a FastH3-VSA checkpoint.")
            raise DistilledError(f"--distilled {path} names {name}, which the H3 DiT does not have: a file for "
                                 "another model?")
        target = params[name]
        for down, up, _, rows, _ in patch.low_rank:
            _check_shape(path, name, rows, (up.shape[0], down.shape[1]), target)
        for diff, rows, _ in patch.diffs:
            _check_shape(path, name, rows, tuple(diff.shape), target)
        if patch.assign is not None:
            if patch.low_rank or patch.diffs:
                raise DistilledError(f"--distilled {path} both adds to and assigns {name}; the order of the two is "
                                     "not defined, so h3trt will not guess.")
            _check_shape(path, name, None, tuple(patch.assign.shape), target)


def _check_shape(path, name: str, rows: slice | None, shape: tuple[int, ...], target: torch.Tensor) -> None:
    want = tuple(target[rows].shape) if rows is not None else tuple(target.shape)
    if shape != want:
        raise DistilledError(f"--distilled {path}: its payload for {name}{' rows' if rows is not None else ''} is "
                             f"{list(shape)}, the model's is {list(want)}: a file for another model size.")


def patch_delta(patch: Patch, shape: torch.Size, device) -> torch.Tensor:
    """The fp32 sum of a patch's terms [*shape] on `device` (low-rank products, then diffs: their order does not
    change the sum beyond fp32 rounding, and the files state no order between them)."""
    delta = torch.zeros(shape, dtype=torch.float32, device=device)
    for down, up, scale, rows, swap in patch.low_rank:
        up = up.to(device, torch.float32)
        term = (swap_halves(up) if swap else up) @ down.to(device, torch.float32)
        term = term * scale if scale != 1.0 else term
        (delta[rows] if rows is not None else delta).add_(term)
    for diff, rows, swap in patch.diffs:
        diff = diff.to(device, torch.float32)
        (delta[rows] if rows is not None else delta).add_(swap_halves(diff) if swap else diff)
    return delta


@torch.no_grad()
def fuse_into(fusion: Fusion, params: Mapping[str, torch.Tensor], only: Callable[[str], bool] = lambda name: True
              ) -> set[str]:
    """Apply `fusion`'s patches of the names `only` accepts to `params` (name -> parameter, in place): fp32, one
    rounding to each parameter's dtype. Returns the names fused."""
    done = set()
    for name, patch in fusion.patches.items():
        if not only(name):
            continue
        param = params[name]
        if patch.assign is not None:
            param.data = patch.assign.to(param.device, param.dtype).clone()
        else:
            delta = patch_delta(patch, param.shape, param.device)
            param.data = delta.add_(param.data.to(torch.float32)).to(param.dtype)
        done.add(name)
    return done


def merge_distilled(model: torch.nn.Module, distilled: Distilled) -> dict:
    """Fuse the file into `model` (an H3DiT) whole; returns its record (manifest, clip records)."""
    params = dict(model.named_parameters())
    check_fusion(distilled.fusion, params)
    done = fuse_into(distilled.fusion, params)
    assert done == set(distilled.fusion.patches)
    return distilled.record()


def step_heads(distilled: Distilled, device) -> StepHeads | None:
    """PDD's fused heads keyed by the video timestep of each forward of the model's schedule (None: not PDD)."""
    if distilled.heads is None:
        return None
    video_t = torch.tensor([tv for tv, _ in distilled.plan.schedule.timesteps()], dtype=torch.float32)
    return StepHeads(video_t, {k: distilled.heads[k] for k in HEAD_WEIGHTS}).to(device)


class StepHeadRunner:
    """An eager DiT runner (EagerDiT, UlyssesDiT) whose final heads are PDD's head of the evaluation's forward: before
    each call the selected fused head is copied into FinalLayer's video_out / audio_out (on the device, no sync), so
    the model computes exactly what a DiT with those heads computes. Everything else is the inner runner's."""

    def __init__(self, inner, heads: StepHeads):
        final = inner.model.final_layer
        self.inner, self.heads = inner, heads
        self.params = {name: final.get_parameter(name) for name in HEAD_WEIGHTS}

    def __getattr__(self, name):  # cfg, model, ...: the inner runner's
        return getattr(self.inner, name)

    @property
    def caps(self) -> RunnerCaps:
        return self.inner.caps

    @torch.no_grad()
    def __call__(self, video, audio, text, unique_t, t_index, layout, extras: EvalExtras = NO_EXTRAS):
        chosen = self.heads.select(self.heads.index(unique_t, t_index, layout.video_index.to(t_index.device)))
        for name, tensor in chosen.items():
            self.params[name].copy_(tensor)
        return self.inner(video, audio, text, unique_t, t_index, layout, extras)
