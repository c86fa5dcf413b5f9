"""The one place a job loop's ranks are launched (jobs/rank.py), for every front door:

  - one rank, in this process (`run` on one device): the loop runs here, on the front door's queue
  - replica groups spawned by this process (`run --gpus N`, and `serve` always, one GPU included: its HTTP loop never
    shares a process with the GPU work): `Workers` starts each group, hands each the next work from the queue as it
    becomes free, forwards their events, and restarts a group whose rank dies
  - torchrun (any number of nodes): this process is one rank of the world; each group's first rank serves its share

A group is its own process group of cfg x sp ranks (--replicas of them), so one group dying leaves the others
serving. What the group held when it died goes back to the queue (`JobQueue.lost`): run again once if a rank was
killed without a word, failed with the rank's reason if one raised.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field, fields
from multiprocessing import connection
from typing import Callable

import torch.distributed as dist

from ..errors import UserError
from ..parallel.devices import node_gpus
from ..parallel.launch import Failure, RankFailed, RankGroup, init_torchrun_rank
from ..parallel.mesh import SINGLE, build_mesh
from ..str_enum import StrEnum
from .job import Event, Job, JobQueue
from .messages import Cancel, FromRank, Idle, Ready, Report, Stop, ToRank, Work
from .rank import BroadcastChannel, LocalChannel, Pipelines, WorkerSpec, group_rank_main, load_rank_pipeline, \
    rank_device, serve_group

POLL_S = 0.2  # how often the launcher looks at a queue that may have new work, and at its ranks
RESTART_BACKOFF_S = (1.0, 5.0, 30.0)  # a group that keeps failing before it is ready waits longer each time


class LaunchKind(StrEnum):
    """How a job loop's ranks start (module doc)."""

    PROCESS = "process"  # one rank, in this process
    SPAWN = "spawn"  # replica groups this process spawns (--gpus N, serve) and supervises (`Workers`)
    TORCHRUN = "torchrun"  # this process is one of torchrun's ranks

    @property
    def spawns(self) -> bool:
        """This process starts the ranks (and so picks their GPUs: launch_gpus)."""
        return self is LaunchKind.SPAWN


HOW = tuple(LaunchKind)


class GroupState(StrEnum):
    """Where a replica group is (a server's /ready and /metrics, by state)."""

    LOADING = "loading"  # its ranks are loading the pipeline
    SERVING = "serving"  # loaded, waiting for work
    BUSY = "busy"  # loaded, running work
    RESTARTING = "restarting"  # a rank died; the group starts again (after a back-off)
    STOPPED = "stopped"  # it stopped cleanly: no more work

    @property
    def serves(self) -> bool:
        """Loaded and serving, busy or free (what /ready counts)."""
        return self in (GroupState.SERVING, GroupState.BUSY)


@dataclass(frozen=True)
class GroupStatus:
    """One replica group as a server's /ready lists it and its /metrics counts it: this node's (`Workers.status`) or
    a fleet's worker replica (fleet/deploy.py `FleetGroups`). Its JSON is the fields in order, the optional ones only
    when set."""

    group: int
    state: GroupState  # a string is taken as its member
    restarts: int = 0  # restarts after a rank died
    jobs: tuple[str, ...] = ()  # the ids of the jobs it runs
    pids: tuple[int, ...] = ()  # its ranks' processes (a fleet's: the replica's, whose children they are)
    last_failure: str | None = None  # why it last failed, in its first failed rank's words
    replica_state: str | None = None  # a fleet's: Serve's state of the worker replica (RUNNING, STARTING, ...)
    replica: str | None = None  # a fleet's: the worker replica (host:pid) that runs it

    def __post_init__(self):
        object.__setattr__(self, "state", GroupState(self.state))
        object.__setattr__(self, "jobs", tuple(self.jobs))
        object.__setattr__(self, "pids", tuple(self.pids))

    def to_json(self) -> dict:
        return {"group": self.group, "state": self.state.value, "restarts": self.restarts, "jobs": list(self.jobs),
                "pids": list(self.pids), **{name: getattr(self, name) for name in _OPTIONAL_STATUS
                                            if getattr(self, name) is not None}}

    @classmethod
    def from_json(cls, data: dict) -> GroupStatus:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


_OPTIONAL_STATUS = ("last_failure", "replica_state", "replica")


def serve_queue(spec: WorkerSpec, queue_of: Callable[[int, int], JobQueue], how: LaunchKind,
                gpus: list[str] | None = None) -> None:
    """Serve the work of `queue_of(group, groups)` (a front door's queue: the whole of it, or under torchrun each
    group's share) until it has no more: in this process, on spawned replica groups (`gpus`: the node's GPUs they
    take, None on the CPU), or as one of torchrun's ranks."""
    if how == LaunchKind.PROCESS:
        serve_in_process(spec, queue_of(0, 1))
    elif how == LaunchKind.SPAWN:
        Workers(spec, queue_of(0, 1), gpus).run()
    elif how == LaunchKind.TORCHRUN:
        serve_torchrun(spec, queue_of)
    else:
        raise ValueError(f"how={how!r} must be one of {HOW}.")


def launch_gpus(device_type: str, world: int) -> list[str] | None:
    """The node's GPUs that `world` spawned ranks take one each (rank r of the launch: GPU #r), checked before any
    rank starts; None on the CPU."""
    if device_type != "cuda":
        return None
    gpus = node_gpus()
    if gpus is None or len(gpus) < world:
        raise UserError(f"--gpus {world} but only {len(gpus or [])} CUDA devices are visible"
                        f"{' (CUDA_VISIBLE_DEVICES=' + ','.join(gpus) + ')' if gpus else ''}.")
    return gpus


def serve_in_process(spec: WorkerSpec, queue: JobQueue, pipelines: Pipelines | None = None) -> None:
    """One rank, this process: the loop over `queue` until it has no more work (`pipelines`: already loaded)."""
    device = rank_device(spec.device_type)
    pipelines = pipelines or Pipelines(lambda task: load_rank_pipeline(spec, SINGLE, device, task), spec.task,
                                       spec.engine)
    serve_group(spec, SINGLE, 0, LocalChannel(queue, spec.max_batch), device, pipelines)


def serve_torchrun(spec: WorkerSpec, queue_of: Callable[[int, int], JobQueue]) -> None:
    """This process is one rank of torchrun's world; the first rank of each replica group serves `queue_of(group,
    groups)` (its share of the work) and broadcasts each unit of work to its group."""
    _, world, _ = init_torchrun_rank(spec.device_type)
    par = build_mesh(spec.mesh, spec.device_type, world, spec.num_heads)
    queue = queue_of(par.replica_index, spec.mesh.replica) if par.writes else None
    channel = BroadcastChannel(queue, spec.max_batch, par.decode_group, par.writes,
                               par.replica_index * spec.group_size)
    serve_group(spec, par, par.replica_index, channel, rank_device(spec.device_type))
    dist.barrier()
    dist.destroy_process_group()


@dataclass
class _Group:
    """One replica group as the launcher sees it."""

    index: int
    ranks: RankGroup | None = None
    conns: list = field(default_factory=list)  # the launcher's end of each rank's pipe
    ready: int = 0  # ranks that loaded their pipeline
    holding: dict[str, Job] = field(default_factory=dict)  # the unit of work it runs, less the jobs that ended
    busy: bool = False  # between handing it Work and its Idle
    stopping: bool = False  # sent Stop: it has no more work
    done: bool = False  # stopped cleanly
    restarts: int = 0
    failures_before_ready: int = 0
    not_before: float = 0.0  # a restart waits until then
    last_failure: str | None = None
    cancels_sent: set = field(default_factory=set)

    @property
    def state(self) -> GroupState:
        if self.done:
            return GroupState.STOPPED
        if self.ranks is None:
            return GroupState.RESTARTING
        return GroupState.BUSY if self.busy else (GroupState.SERVING if self.up else GroupState.LOADING)

    @property
    def up(self) -> bool:
        return self.ranks is not None and self.ready == len(self.conns)


class Workers:
    """Spawned replica groups over one queue (module doc). `run()` returns when the queue has no more work and every
    group has stopped; it raises RankFailed when a group cannot load (with `load_failures_fatal`, the `run` front
    doors) and re-raises an interrupt after stopping every rank. A server runs it on a thread of its own and calls
    `drain()` or `stop()` from another."""

    def __init__(self, spec: WorkerSpec, queue: JobQueue, gpus: list[str] | None, load_failures_fatal: bool = True,
                 log: Callable[[str], None] = lambda m: print(f"h3trt: {m}", file=sys.stderr),
                 rank_group: Callable[..., RankGroup] = RankGroup):
        self.spec, self.queue, self.gpus, self.fatal, self.log = spec, queue, gpus, load_failures_fatal, log
        self.rank_group = rank_group  # starts a group's ranks (tests/jobs/test_workers.py passes one of threads)
        self.groups = [_Group(i) for i in range(spec.mesh.replica)]
        self._draining = threading.Event()
        self._stop = threading.Event()
        self.lock = threading.Lock()  # guards `groups` for status() readers on other threads
        self._ended: list[tuple[_Group, Event]] = []  # jobs' last events, not yet reported (_report_ended)

    # --- what other threads may call --------------------------------------------------------------------------------

    def drain(self) -> None:
        """Take no new work; return from run() once the running work has ended."""
        self._draining.set()

    def stop(self) -> None:
        """Stop every group now (what they hold goes back to the queue as lost, not to blame)."""
        self._stop.set()

    def status(self) -> list[GroupStatus]:
        with self.lock:
            return [GroupStatus(g.index, g.state, g.restarts, tuple(g.holding),
                                tuple(p.pid for p in g.ranks.procs) if g.ranks is not None else (),
                                g.last_failure or None) for g in self.groups]

    def serving(self) -> int:
        """Groups loaded and serving (busy or free)."""
        with self.lock:
            return sum(1 for g in self.groups if g.up and not g.done)

    # --- the loop ---------------------------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            for g in self.groups:
                self._start(g)
            while not all(g.done for g in self.groups):
                if self._stop.is_set():
                    self._give_back_all("the server is stopping")
                    break
                self._forward_cancels()
                self._hand_out_work()
                self._report_ended()
                self._wait()
                self._read_messages()
                self._check_ranks()
        finally:
            try:
                self._report_ended(flush=True)
            finally:
                for g in self.groups:
                    self._kill(g)

    def _start(self, g: _Group) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(self.spec.group_size)]
        with self.lock:
            g.conns, g.ready, g.busy, g.holding, g.cancels_sent = [p[0] for p in pipes], 0, False, {}, set()
            g.ranks = self.rank_group(group_rank_main, self.spec.group_size,
                                      lambda r: (pipes[r][1], self.spec, g.index), self.gpus,
                                      first_gpu=g.index * self.spec.group_size)
        for _, child in pipes:
            child.close()  # the children hold their ends; the launcher sees EOF when a child is gone

    def _kill(self, g: _Group) -> None:
        if g.ranks is not None:
            g.ranks.stop()
        for c in g.conns:
            c.close()
        with self.lock:
            g.ranks, g.conns = None, []

    def _send(self, g: _Group, message: ToRank) -> None:
        for c in g.conns:
            try:
                c.send(message)
            except (BrokenPipeError, OSError):
                pass  # that rank is gone; _check_ranks deals with it

    def _forward_cancels(self) -> None:
        wanted = set(self.queue.cancels())
        for g in self.groups:
            for job_id in (wanted & set(g.holding)) - g.cancels_sent:
                self._send(g, Cancel(job_id))
                g.cancels_sent.add(job_id)

    def _hand_out_work(self) -> None:
        for g in self.groups:
            if not g.up or g.busy or g.stopping or g.done:
                continue
            work = None if self._draining.is_set() else self.queue.take(g.index, self.spec.max_batch)
            if work is None:
                if self._draining.is_set() and any(other.busy for other in self.groups):
                    continue  # drain: stop together once the running work has ended
                self._send(g, Stop())
                g.stopping = True
            elif work:
                with self.lock:
                    g.holding, g.busy = {job.id: job for job in work}, True
                self._send(g, Work(work))

    def _report_ended(self, flush: bool = False) -> None:
        """Record the jobs that ended, once their group has its next work (or none is coming): the loop calls this
        after handing work out, so what a job's end costs the queue (a server's thumbnail, publishing the clip, the
        store's row) overlaps the next job on the GPU instead of delaying it. A group whose work all ended but whose
        Idle has not arrived yet is in between: its ends wait for the next pass."""
        waiting = []
        for g, event in self._ended:
            if not flush and g.busy and not g.holding:
                waiting.append((g, event))
            else:
                self.queue.report(event)
        self._ended = waiting

    def _wait(self) -> None:
        waitables = [c for g in self.groups for c in g.conns] + [s for g in self.groups if g.ranks
                                                                  for s in g.ranks.sentinels]
        restart_due = [g.not_before for g in self.groups if g.ranks is None and not g.done]
        timeout = POLL_S if not restart_due else max(0.0, min(POLL_S, min(restart_due) - time.monotonic()))
        connection.wait(waitables, timeout)

    def _read_messages(self) -> None:
        for g in self.groups:
            for c in list(g.conns):
                while True:
                    try:
                        if not c.poll():
                            break
                        message = c.recv()
                    except (EOFError, OSError):
                        break  # a rank is gone: _check_ranks
                    self._handle(g, message)

    def _handle(self, g: _Group, message: FromRank) -> None:
        match message:
            case Ready():
                with self.lock:
                    g.ready += 1
                if g.up:
                    g.failures_before_ready = 0
                    if g.restarts:
                        self.log(f"replica group {g.index} serves again (restart {g.restarts})")
            case Report(event=event) if event.ends:
                with self.lock:
                    g.holding.pop(event.job, None)
                self._ended.append((g, event))  # recorded once the group's next work is out (_report_ended)
            case Report(event=event):
                self.queue.report(event)
            case Idle():
                with self.lock:
                    g.busy, g.holding = False, {}
            case _:
                raise RuntimeError(f"replica group {g.index} sent {message!r}, which the launcher does not take")

    def _check_ranks(self) -> None:
        now = time.monotonic()
        for g in self.groups:
            if g.ranks is None:
                if not g.done and now >= g.not_before:
                    self._start(g)
                continue
            failure = g.ranks.failure()
            if failure is None:
                if g.stopping and g.ranks.finished():
                    self._kill(g)
                    g.done = True
                continue
            self._read_messages()  # the events it sent before it died (a failure it reported, say)
            self._group_failed(g, failure)

    def _group_failed(self, g: _Group, failure: Failure) -> None:
        was_up, lost = g.up, list(g.holding.values())
        self._kill(g)
        message = f"replica group {g.index}: {failure.message()}"
        with self.lock:
            g.last_failure, g.busy, g.holding = message, False, {}
        if not was_up:
            g.failures_before_ready += 1
            if self.fatal:
                raise RankFailed(f"{message}. Every rank was stopped; no output was written.")
        self.log(f"{message}; restarting the group"
                 + (f" (it held {', '.join(j.id for j in lost)})" if lost else ""))
        if lost:
            self.queue.lost(g.index, lost, failure.reason, failure.died)
        if g.stopping:  # it had no more work anyway
            g.done = True
            return
        g.restarts += 1
        delay = RESTART_BACKOFF_S[min(g.failures_before_ready, len(RESTART_BACKOFF_S)) - 1] \
            if g.failures_before_ready else 0.0
        g.not_before = time.monotonic() + delay

    def _give_back_all(self, reason: str) -> None:
        for g in self.groups:
            lost = list(g.holding.values())
            self._kill(g)
            g.done = True
            if lost:
                self.queue.lost(g.index, lost, reason, True)
