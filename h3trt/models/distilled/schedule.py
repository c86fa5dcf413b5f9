"""The schedules the distilled MiniMax-H3 families run: one core (models/sampler.py `Schedule`: per-modality shifts,
"grid points = forwards + 1", optional explicit rungs, the data-ward Euler step, CFG off) and each family's values.

Every family samples with H3's own Euler step on its grid: x0 = x + (1 - t) v, x' = (s'/s) x + (1 - s'/s) x0, t the
timestep the model saw (1 - s in float32). FastVideo's `MiniMaxH3Scheduler.step` (scheduling_minimax_h3.py) is that
step, operation for operation (its "sigma_from_timestep" is 1 - timestep); LightX2V's `training_euler`
x + (s - s') v is the same update algebraically; VideoX-Fun's PDD pipeline steps its block boundaries with the same
MiniMaxH3Scheduler. tests/models/test_distilled_schedule.py checks h3trt's `euler_step` against FastVideo's form
bit for bit.

  family   forwards  grid points  rungs (before the shift)                  shifts v/a  source
  fasth3   4         5            [999, 749, 500, 250] / 1000                12 / 3      the release's dmd_denoising_steps
  fasth3   4         5            uniform 1, .75, .5, .25 (grid=uniform)     12 / 3      SGLang, FastVideo's example
  fasth3   8 (V2)    9            [999, 874, ..., 125] / 1000                10 / 3      V2's fastvideo_inference.json
  turbo    N         N + 1        uniform                                    per file    LightX2V (the file or the user)
  pdd      4, 6, 8   5, 7, 9      the 32-interval grid's block boundaries    12 / 3      VideoX-Fun, alibaba-pai

Why the rungs are FastH3 v1's reference: the student was distilled at those positions (the release's
`dmd_denoising_steps`, its adapter manifest's `sampling.base_timesteps`); FastVideo's own pipeline binds the rungs of
an export's `fastvideo_inference.json` ("never silently use a uniform grid"), and vLLM-Omni's FastH3 loader samples the
adapter on (0.999, 0.749, 0.5, 0.25, 0). The opening rung is 0.999 because training capped the noise there. SGLang's
cookbook and FastVideo's 2026-08-21 example ran the uniform grid, which `grid=uniform` reproduces. V2 has rungs only:
its sidecar says a uniform 9-point grid is not a substitute.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UserError
from ..sampler import Schedule

FASTH3_V1_RUNGS = (999, 749, 500, 250)  # dmd_denoising_steps, timestep indices out of 1000
FASTH3_V2_RUNGS = (999, 874, 749, 624, 500, 375, 250, 125)
FASTH3_SHIFTS = (12.0, 3.0)  # v1 trains on H3's own shifts; V2's come from its scheduler configs (10 / 3)
TRAIN_TIMESTEPS = 1000  # the rungs' unit
GRIDS = ("rungs", "uniform")  # FastH3 v1: the release's rungs (default) or the uniform 5-point grid

PDD_INTERVALS = 32  # the head bank: one final projection per interval of linspace(1, 0, 33)
PDD_SHIFTS = (12.0, 3.0)
# Intervals per forward, in order, for each forward count PDD runs (alibaba-pai's card, the paper): L = 8 for 4, the
# 6-forward split (8, 8, 4, 4, 4, 4), L = 4 for 8. Other counts give noise.
PDD_BLOCKS = {4: (8, 8, 8, 8), 6: (8, 8, 4, 4, 4, 4), 8: (4,) * 8}


def rungs_of(indices: tuple[int, ...]) -> tuple[float, ...]:
    """dmd_denoising_steps (integers out of 1000, strictly decreasing in (0, 1000]) -> grid positions in (0, 1]."""
    if (not indices or any(isinstance(i, bool) or not isinstance(i, int) or not 0 < i <= TRAIN_TIMESTEPS
                           for i in indices) or any(a <= b for a, b in zip(indices, indices[1:]))):
        raise UserError(f"dmd_denoising_steps must be strictly decreasing integers in (0, {TRAIN_TIMESTEPS}], got "
                        f"{list(indices)}.")
    return tuple(i / TRAIN_TIMESTEPS for i in indices)


def uniform_rungs(forwards: int) -> tuple[float, ...]:
    """The uniform grid's positions: 1, (N-1)/N, ..., 1/N."""
    return tuple((forwards - i) / forwards for i in range(forwards))


def pdd_boundaries(forwards: int) -> tuple[int, ...]:
    """The interval index (of PDD_INTERVALS) each forward starts at, and the end: [0, ..., 32]."""
    if forwards not in PDD_BLOCKS:
        raise UserError(f"PDD runs {sorted(PDD_BLOCKS)} forwards ({', '.join(str(n + 1) for n in sorted(PDD_BLOCKS))} "
                        f"grid points: --steps), got {forwards} ({forwards + 1} grid points); other counts give "
                        "noise.")
    bounds = [0]
    for size in PDD_BLOCKS[forwards]:
        bounds.append(bounds[-1] + size)
    return tuple(bounds)


def pdd_rungs(forwards: int) -> tuple[float, ...] | None:
    """The forwards' start positions on linspace(1, 0, 33): None where they are the uniform grid (4 and 8 forwards:
    linspace(1, 0, 33)[::L] is linspace(1, 0, N + 1) bit for bit), else the 6-forward split's."""
    bounds = pdd_boundaries(forwards)
    if len(set(PDD_BLOCKS[forwards])) == 1:
        return None
    return tuple(1.0 - b / PDD_INTERVALS for b in bounds[:-1])


@dataclass(frozen=True)
class FamilySchedule:
    """What a distilled model runs: its schedule, and what a request may change of it."""

    schedule: Schedule
    other_steps: bool  # a request may run another step count (on the uniform grid): Turbo, a LoRA on any schedule
    shifts_fixed: bool  # the family was trained on these shifts only: a request may not move them
    fix: str = ""  # how to run another step count where a request may not (PDD: load the file for it)

    def for_request(self, steps: int | None, video_shift: float | None, audio_shift: float | None,
                    family: str) -> Schedule:
        """A request's schedule on this model (None: the family's), refusing what the family cannot run."""
        base = self.schedule
        steps = base.steps if steps is None else steps
        if steps != base.steps and not self.other_steps:
            raise UserError(f"this {family} model runs {base.steps - 1} forwards (steps {base.steps}); the request "
                            f"asks for steps {steps}. Leave steps out{self.fix}.", field="steps")
        v = base.video_shift if video_shift is None else video_shift
        a = base.audio_shift if audio_shift is None else audio_shift
        if self.shifts_fixed and (v, a) != (base.video_shift, base.audio_shift):
            raise UserError(f"this {family} model was distilled at shifts {base.video_shift:g}/{base.audio_shift:g}; "
                            f"the request asks for {v:g}/{a:g}. Leave video_shift and audio_shift out.",
                            field="video_shift")
        return Schedule(steps, v, a, base.rungs if steps == base.steps else None)


def fasth3_schedule(rungs: tuple[int, ...] = FASTH3_V1_RUNGS, shifts: tuple[float, float] = FASTH3_SHIFTS,
                    grid: str = "rungs") -> FamilySchedule:
    """FastH3's: its rungs (or, v1 only, the uniform grid of as many forwards), its shifts, nothing else."""
    if grid not in GRIDS:
        raise UserError(f"grid must be one of {list(GRIDS)} (FastH3: the release's rungs, or the uniform grid), got "
                        f"{grid!r}.")
    if grid == "uniform" and tuple(rungs) != FASTH3_V1_RUNGS:
        raise UserError(f"grid=uniform stands in for FastH3 v1's rungs {list(FASTH3_V1_RUNGS)} only; this release "
                        f"declares {list(rungs)}, and its contract says a uniform grid is no substitute. Drop grid.")
    forwards = len(rungs)
    positions = rungs_of(tuple(rungs)) if grid == "rungs" else None
    return FamilySchedule(Schedule(forwards + 1, *shifts, positions), False, True)


def pdd_schedule(forwards: int = 8) -> FamilySchedule:
    """PDD's: 4, 6 or 8 forwards on the 32-interval grid at 12 / 3; the heads are fused for one of them, so a
    request runs that one (another is a reload, or a rebuild, with FILE@steps=N)."""
    return FamilySchedule(Schedule(forwards + 1, *PDD_SHIFTS, pdd_rungs(forwards)), False, True,
                          f", or load the file for another count: --distilled FILE@steps=N with N one of "
                          f"{[n + 1 for n in sorted(PDD_BLOCKS)]} (its heads are fused per forward)")


def turbo_schedule(steps: int, shifts: tuple[float, float]) -> FamilySchedule:
    """Turbo's: the uniform grid of its file's step count at its shifts; a request may state others (it is a LoRA:
    the base model runs any schedule, the file's is the one it was trained for)."""
    return FamilySchedule(Schedule(steps, *shifts), True, False)
