"""What a replica group's ranks and their launcher say to each other (jobs/supervisor.py, jobs/rank.py).

    launcher -> every rank of a group      Work(jobs), Cancel(job), Stop()
    the group's first rank -> launcher     Ready(rank) (every rank, once), Report(event), Idle()

Under torchrun the group's first rank broadcasts Work or Stop to the group instead (rank.BroadcastChannel). Each message
is a frozen dataclass, picklable (a multiprocessing pipe and torch.distributed's broadcast_object_list pickle it); the
receiving side dispatches on its type, so a message of a kind it does not expect fails by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from .job import Event, Job


@dataclass(frozen=True)
class Work:
    """The group's next unit of work: 1..--max-batch jobs with equal keys, the same on every rank of the group."""

    jobs: tuple[Job, ...]

    def __post_init__(self):
        object.__setattr__(self, "jobs", tuple(self.jobs))


@dataclass(frozen=True)
class Cancel:
    """Cancel this job at its next denoise step (a server's DELETE); a rank that already ended it ignores this."""

    job: str


@dataclass(frozen=True)
class Stop:
    """No more work: the rank returns from its loop and exits."""


@dataclass(frozen=True)
class Ready:
    """This rank of the group has loaded its pipeline."""

    rank: int


@dataclass(frozen=True)
class Report:
    """One of a job's events, sent by the group's first rank (the one that writes)."""

    event: Event


@dataclass(frozen=True)
class Idle:
    """The group finished its unit of work (every job of it ended) and takes the next."""


ToRank = Work | Cancel | Stop
FromRank = Ready | Report | Idle
