"""Jobs: what the one job loop serves, whichever front door feeds it.

    run --prompt          a queue of one job                      (run/commands.py)
    run --requests FILE   a queue fed from the file               (run/batch.py)
    serve                 a queue fed by HTTP, kept in a job store (h3trt/server/)

A front door puts `Job`s in its `JobQueue`. A replica group's worker (jobs/rank.py) takes the next work from it (one
job, or up to --max-batch jobs whose `key`s are equal and so may share a batched denoise), runs it (jobs/work.py)
and reports `Event`s back: started, progress, done (with the clip's record), failed (with the stage and the reason) or
cancelled. The queue decides what a group takes, when the work ends, and what a group that died was holding becomes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..pipeline.records import ClipRecord, Failure
from ..request.request import BatchKey, Request
from ..str_enum import StrEnum


class Stage(StrEnum):
    """A job's stages, in order (what a job's row and the API show as it runs); `progress` (0-100) reaches
    DENOISE_END when the last denoise evaluation has finished on the device, and 100 when the MP4 and its record are
    committed."""

    QUEUED = "queued"
    TEXT_ENCODE = "text_encode"
    CONDITION_ENCODE = "condition_encode"
    DENOISE = "denoise"
    DECODE = "decode"
    DONE = "done"


class EventKind(StrEnum):
    """What a worker reports of a job: started, progress, then exactly one end (done, failed or cancelled)."""

    STARTED = "started"
    PROGRESS = "progress"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def ends(self) -> bool:
        """An event of this kind is the job's last."""
        return self in (EventKind.DONE, EventKind.FAILED, EventKind.CANCELLED)


STAGES = tuple(Stage)
DENOISE_END = 95  # the denoise is ~95% of a full-size clip's time on the H200 (bench/README.md: 3.6 s x 49 vs ~10 s)
EVENT_KINDS = tuple(EventKind)
ENDS = tuple(kind for kind in EventKind if kind.ends)


@dataclass(frozen=True)
class Job:
    """One clip to make. Picklable: spawned ranks receive it whole."""

    id: str
    request: Request
    output: Path  # the MP4; its record goes beside it (records.record_path)
    overwrite: bool = False  # replace an existing clip and record (the front door checked what it may replace)
    profile_step: int | None = None  # --profile-step: the evaluation whose host overhead is measured
    record: dict = field(default_factory=dict)  # fields added to the clip's record (a requests file's id and line)
    key: BatchKey | None = None  # jobs with equal keys may share a batched denoise (BatchKey.of; None: alone)
    attempt: int = 0  # the claim it was taken under (a job store's attempt number; 0: no store): its events carry it


@dataclass(frozen=True)
class Event:
    """What a worker reports of a job. `progress` is monotonic per job (0-100): the fraction of denoise evaluations
    finished on the device (not merely queued), then of the frames decoded."""

    job: str
    kind: EventKind  # a string is taken as its member
    # A Stage (its member when it names one); a failed event's says where it failed, which may be a step outside the
    # job's stages ("prepare", "encode", "worker", "store").
    stage: Stage | str = ""
    progress: int = 0
    evaluations: tuple[int, int] = (0, 0)  # (finished on the device, total)
    record: ClipRecord | Failure | None = None  # done: the clip's record as committed beside the MP4; failed: what
    # its front door records of the failure
    error: str | None = None  # failed: "<stage>: <ExceptionType>: <message>"; cancelled: why
    intervals: tuple = ()  # done/failed: (stage, unix start, unix end) of the job's work, for timelines
    group: int = 0  # the replica group that ran it
    attempt: int = 0  # the job's claim it reports on (Job.attempt): a store ignores the events of an earlier claim

    def __post_init__(self):
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"Event kind {self.kind!r} is not one of {EVENT_KINDS}.")
        object.__setattr__(self, "kind", EventKind(self.kind))
        if self.stage in STAGES:
            object.__setattr__(self, "stage", Stage(self.stage))

    @property
    def ends(self) -> bool:
        return self.kind.ends


def denoise_progress(finished: int, total: int) -> int:
    """Percent of a job done when `finished` of its `total` denoise evaluations have finished on the device."""
    return DENOISE_END * finished // max(total, 1)


def decode_progress(frames: int, total: int) -> int:
    """Percent of a job done when `frames` of its `total` frames are decoded (100 only once the clip is committed)."""
    return min(99, DENOISE_END + (100 - DENOISE_END) * frames // max(total, 1))


class JobFailed(RuntimeError):
    """A job failed on a worker that could not hand its exception over (another process): its stage and reason."""


class JobQueue(Protocol):
    """A front door's side of the job loop (jobs/supervisor.py drives it; all calls from one thread)."""

    def take(self, group: int, limit: int) -> list[Job] | None:
        """The next work for replica group `group`: 1..limit jobs with equal keys, [] when none is waiting now (a
        server's queue), None when none ever will be (the group may stop)."""

    def report(self, event: Event) -> None:
        """A worker's event; the ends (done, failed, cancelled) come once per job taken."""

    def lost(self, group: int, jobs: list[Job], reason: str, died: bool) -> None:
        """Group `group` stopped while holding `jobs` (ended neither way): `died` when a rank was killed or vanished
        without a word (the work is not to blame: run it again, once), else a rank raised `reason`."""

    def cancels(self) -> list[str]:
        """Ids of running jobs to cancel at their next denoise step (a server's DELETE; [] elsewhere)."""
