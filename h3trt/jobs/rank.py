"""Rank code: the one job loop every rank of a replica group runs, whichever front door feeds it and however the rank
was started (this process, `--gpus N` / `serve` spawning it, or torchrun).

  1. join the group's mesh: (cfg, sp) within the group (validated with the arithmetic before the first collective)
  2. load this rank's pipeline once: a bundle is checked against the launched mesh; the eager DiT gets the Ulysses
     runner of its sp group
  3. loop: take the next work from the channel (the same jobs on every rank of the group), run it
     (jobs/work.py), report its events (the group's first rank only), until the channel says stop

The channel is where the work comes from: the front door's queue itself (`LocalChannel`, one process), the launcher
over a pipe per rank (`PipeChannel`, spawned groups: jobs/supervisor.py), or the group's first rank broadcasting what
it took from its own share of the queue (`BroadcastChannel`, torchrun).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ..adapters.shape import SlotShape
from ..engines.guard import no_compile
from ..media.output_files import DEFAULT_CRF
from ..parallel.launch import init_rank
from ..parallel.mesh import SINGLE, MeshConfig, Parallel, build_mesh
from ..pipeline.h3_pipeline import H3Pipeline
from ..request.parts import CanvasDefaults
from .job import Event, Job, JobQueue
from .messages import Cancel, FromRank, Idle, Ready, Report, Stop, Work
from .work import Place, Reporter, free_memory, run_work


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank of every replica group needs to load and serve; picklable, so a spawned rank gets it whole."""

    model_root: str  # checkpoint folder or bundle
    engine: bool  # model_root is a bundle
    task: str  # the partition loaded first (t2va and fl2va share one; an eager group loads ref2va's on demand)
    device_type: str  # cuda or cpu
    mesh: MeshConfig  # the launch's degrees: `replica` groups of cfg x sp ranks
    num_heads: int  # the DiT's attention heads (sp must divide them)
    canvas: CanvasDefaults = CanvasDefaults()
    crf: int = DEFAULT_CRF
    max_batch: int = 1  # jobs of equal keys a group takes at once and denoises together
    model_name: str = ""  # what the record says served it
    record_extra: dict | None = None  # added to every record (e.g. the bundle's identity)
    vae_precision: str | None = None  # --vae-precision (None: a bundle's, else bf16 on CUDA / fp32 on the CPU)
    loras: tuple = ()  # LoraSpecs merged into an eager DiT on every rank (a bundle: an adapter on every request)
    adapters: tuple = ()  # AdapterSpecs: resident LoRA adapters every rank of a group loads once
    lora_slots: SlotShape | None = None  # an eager DiT's adapter slots (None: one per adapter, of their largest rank;
    # a bundle's are its own)
    trust: str | None = None  # --trust: the public key a bundle must be signed with
    distilled: object = None  # a DistilledSpec fused into an eager DiT on every rank (a bundle carries its own)
    prefetch_prompts: tuple[str, ...] = ()  # t2va prompts a bundle's text encoder encodes while the DiT loads
    raise_failures: bool = False  # one clip in this process: a failure propagates with its own type and traceback

    @property
    def group_size(self) -> int:
        return self.mesh.cfg * self.mesh.sp


def partition(task: str) -> str:
    """The checkpoint partition serving a task: t2va and fl2va share FL2VA's, ref2va has its own."""
    return "ref2va" if task == "ref2va" else "t2va"


def rank_device(device_type: str) -> torch.device:
    """A rank's device: on GPUs always cuda:0, since every rank's own GPU is its cuda:0 (h3trt/parallel/devices.py);
    that is what lets one compiled bundle serve on every GPU of a node."""
    return torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")


def load_rank_pipeline(spec: WorkerSpec, par: Parallel, device: torch.device, task: str | None = None) -> H3Pipeline:
    """This rank's pipeline: a bundle checked against the launched mesh, or the eager model of `task`'s partition
    (default: spec.task) with the runners of this rank's groups."""
    if spec.engine:
        return H3Pipeline.load_engine(Path(spec.model_root), device, spec.canvas, mesh=par.config,
                                      sp_group=par.sp_group, cfg_group=par.cfg_group, vae_precision=spec.vae_precision,
                                      trust=spec.trust, adapters=spec.adapters, loras=spec.loras,
                                      serve_adapters=spec.lora_slots is not None,
                                      prefetch_prompts=spec.prefetch_prompts)
    return H3Pipeline.load(Path(spec.model_root), task or spec.task, device, spec.canvas, spec.vae_precision,
                           loras=spec.loras, sp_group=par.sp_group, cfg_group=par.cfg_group, adapters=spec.adapters,
                           lora_slots=spec.lora_slots, distilled=spec.distilled)


class Pipelines:
    """The group's one loaded pipeline. An eager group serving a job of the other partition (ref2va after t2va, or
    back) drops the loaded one first: one partition in memory at a time (a full-size DiT is 66 GB in bf16)."""

    def __init__(self, load: Callable[[str], H3Pipeline], task: str, engine: bool):
        self._load, self.engine = load, engine
        self.part, self.pipeline = partition(task), load(task)

    def for_task(self, task: str) -> H3Pipeline:
        if self.engine or partition(task) == self.part:
            return self.pipeline  # a bundle serves its one task (other tasks were refused before they were queued)
        device = self.pipeline.device
        self.pipeline = None
        free_memory(device)
        self.part, self.pipeline = partition(task), self._load(task)
        return self.pipeline


# ----------------------------------------------------------------------------------------------------------------------
# Channels: where a rank's work comes from and where its events go


class LocalChannel:
    """One process: the front door's queue itself."""

    writes = True

    def __init__(self, queue: JobQueue, limit: int):
        self.queue, self.limit = queue, limit

    def next_work(self) -> list[Job] | None:
        work = self.queue.take(0, self.limit)
        if work is not None and not work:
            raise RuntimeError("LocalChannel serves queues that never wait (a file or a prompt); a server's queue "
                               "runs behind spawned workers (jobs/supervisor.py).")
        return work

    def report(self, event: Event) -> None:
        self.queue.report(event)

    def cancelled(self, job_id: str) -> bool:
        return job_id in self.queue.cancels()

    def idle(self) -> None:
        pass


class PipeChannel:
    """A spawned rank: the launcher sends Work, Cancel and Stop (jobs/messages.py) to every rank of the group; the
    group's first rank sends back Report(event) and, after each unit of work, Idle()."""

    def __init__(self, conn: Connection, writes: bool):
        self.conn, self.writes = conn, writes
        self._cancelled: set[str] = set()

    def send(self, message: FromRank) -> None:
        self.conn.send(message)

    def next_work(self) -> list[Job] | None:
        while True:
            try:
                message = self.conn.recv()
            except EOFError:  # the launcher is gone: nobody would take the results
                return None
            match message:
                case Work(jobs=jobs):
                    self._cancelled.clear()
                    return list(jobs)
                case Stop():
                    return None
                case Cancel():
                    pass  # for a job that already ended here: nothing to do
                case _:
                    raise RuntimeError(f"the launcher sent {message!r}, which a rank does not take")

    def report(self, event: Event) -> None:
        if self.writes:
            self.send(Report(event))

    def cancelled(self, job_id: str) -> bool:
        while self.conn.poll():
            message = self.conn.recv()
            if not isinstance(message, Cancel):
                raise RuntimeError(f"the launcher sent {type(message).__name__} while a job was running")
            self._cancelled.add(message.job)
        return job_id in self._cancelled

    def idle(self) -> None:
        if self.writes:
            self.send(Idle())


class BroadcastChannel:
    """torchrun: the group's first rank takes work from its own share of the queue and broadcasts it to the group."""

    def __init__(self, queue: JobQueue | None, limit: int, group, writes: bool, first_rank: int):
        self.queue, self.limit, self.group, self.writes, self.first_rank = queue, limit, group, writes, first_rank

    def next_work(self) -> list[Job] | None:
        box: list[Work | Stop | None] = [None]
        if self.writes:
            work = self.queue.take(0, self.limit)
            box = [Stop() if work is None else Work(work)]
        if self.group is not None:
            dist.broadcast_object_list(box, src=self.first_rank, group=self.group)
        match box[0]:
            case Work(jobs=jobs):
                return list(jobs)
            case Stop():
                return None
            case other:
                raise RuntimeError(f"the group's first rank broadcast {other!r}, which a rank does not take")

    def report(self, event: Event) -> None:
        if self.writes:
            self.queue.report(event)

    def cancelled(self, job_id: str) -> bool:
        return False

    def idle(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------------------------------
# The loop


def serve_group(spec: WorkerSpec, par: Parallel, group_index: int, channel, device: torch.device,
                pipelines: Pipelines | None = None) -> None:
    """Steps 2-3 on one rank (its process group already initialised, its mesh built)."""
    pipelines = pipelines or Pipelines(lambda task: load_rank_pipeline(spec, par, device, task), spec.task,
                                       spec.engine)
    mesh = {"replica": spec.mesh.replica, "cfg": spec.mesh.cfg, "sp": spec.mesh.sp, "replica_index": group_index}
    place = Place(group_index, par.decode_group, par.writes, spec.crf, spec.raise_failures, spec.model_name,
                  {**(spec.record_extra or {}), "mesh": mesh})
    reporter = Reporter(place, channel.report, channel.cancelled, device)
    with no_compile() if spec.engine else nullcontext():  # a request compiles nothing: any compiler call raises
        while (work := channel.next_work()) is not None:
            run_work(pipelines.for_task(work[0].request.task), work, place, reporter)
            channel.idle()


def group_rank_main(rank: int, world: int, store: str, conn: Connection, spec: WorkerSpec, group_index: int) -> None:
    """Entry of a rank of a spawned replica group (jobs/supervisor.py): its own process group of cfg x sp ranks (a
    group of one rank needs none)."""
    if world == 1:
        if spec.device_type == "cuda":
            torch.cuda.set_device(0)
        par = SINGLE
    else:
        init_rank(rank, world, store, spec.device_type)
        par = build_mesh(MeshConfig(1, spec.mesh.cfg, spec.mesh.sp), spec.device_type, world, spec.num_heads)
    device = rank_device(spec.device_type)
    pipelines = Pipelines(lambda task: load_rank_pipeline(spec, par, device, task), spec.task, spec.engine)
    channel = PipeChannel(conn, par.writes)
    channel.send(Ready(rank))
    serve_group(spec, par, group_index, channel, device, pipelines)
