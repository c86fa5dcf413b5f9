"""The schedules a bundle serves (`h3trt build --steps 50,8`): its AdaLN tables are baked for the union of their
timesteps (build/adaln.py), so a request on any of them runs from the tables, and the first is a request's default.

The manifest records them as `schedules`, and the first again as `schedule`, where a manifest written before bundles
served several records its one (engines/manifest.py): a bundle that serves one schedule writes only `schedule`, as
such a manifest did, and either reads back as the same tuple.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ScheduleRecord:
    """One schedule a bundle was built for: its AdaLN tables hold every timestep of it."""

    steps: int  # sigma grid points
    video_shift: float
    audio_shift: float
    rungs: tuple[float, ...] | None = None  # a distilled family's explicit grid (models/distilled/schedule.py)

    def __str__(self) -> str:
        rungs = f", rungs {list(self.rungs)}" if self.rungs is not None else ""
        return f"steps={self.steps}, video shift {self.video_shift:g}, audio shift {self.audio_shift:g}{rungs}"

    @property
    def key(self) -> tuple[int, float, float]:
        """What a request states of a schedule: its rungs are the bundle's (one set per step count and shifts)."""
        return self.steps, self.video_shift, self.audio_shift


def schedule_refusal(schedules: tuple[ScheduleRecord, ...], steps: int, video_shift: float, audio_shift: float,
                     note: str = "") -> str | None:
    """Why a bundle whose tables are baked for `schedules` cannot serve this schedule, naming every one it serves and
    the fixes (`note`: where the request's schedule came from, when that is the fix); None when it is one of them."""
    if (steps, video_shift, audio_shift) in [s.key for s in schedules]:
        return None
    served = str(schedules[0]) if len(schedules) == 1 else (
        f"{schedules[0]} (the default), " + ", ".join(map(str, schedules[1:])))
    return (f"This bundle's AdaLN tables are baked for {served}; the request{note} asks for steps={steps}, shifts "
            f"{video_shift:g}/{audio_shift:g}. Use {'its schedule' if len(schedules) == 1 else 'one of them'}, or "
            "rebuild with --steps/--video-shift/--audio-shift (comma lists: one schedule each), or with --keep-adaln "
            "to serve any.")


def schedule_json(schedule: ScheduleRecord) -> dict:
    """A schedule's manifest entry: its rungs only where it has them (a uniform grid's reads as before they existed)."""
    return {k: (list(v) if k == "rungs" else v) for k, v in asdict(schedule).items() if v is not None}


def rungs_of(value: list | None) -> tuple[float, ...] | None:
    return tuple(float(r) for r in value) if value is not None else None
