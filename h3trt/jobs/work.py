"""One unit of work on the ranks of a replica group: a job, or jobs that share a batched denoise (jobs/job.py).

Every rank of the group runs `run_work` on the same jobs, in step: every rank denoises, every rank decodes its share
of the video tiles, only the group's first rank (`writes`) commits MP4s and records and reports events.

  1. one job: the pipeline's `generate` (guidance, step caching and --profile-step included) returns its `Clip`, which
     `commit_job_clip` completes and puts in place
  2. several (equal keys): each encoded alone, bucketed by packed layout (same text length, same condition rows), each
     bucket denoised as ONE batch along the batch dimension, then each member decoded and committed the same way
  3. after every denoise evaluation: the device is synchronised (progress counts evaluations FINISHED, not queued),
     and the group agrees on cancellations (a cancelled job stops at this step, on every rank together)
  4. a job that fails fails alone on a one-rank group (the event names its stage and reason, the memory is freed,
     the next job runs); on a group of several ranks the error is re-raised once reported: the other ranks may be
     inside a collective of that stage, so the group is restarted (jobs/supervisor.py)
"""

from __future__ import annotations

import gc
import hashlib
import resource
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist

from ..adapters.use import batch_key
from ..errors import UserError
from ..media.output_files import DEFAULT_CRF
from ..pipeline.h3_pipeline import H3Pipeline, Target
from ..pipeline.parallel_decode import _comm_device
from ..pipeline.records import Clip, ClipRecord, Failure, TimelineTimer, commit_clip
from ..pipeline.prepare import Encoded, read_media
from .job import Event, EventKind, Job, Stage, decode_progress, denoise_progress


class JobCancelled(Exception):
    """Every rank of the group agreed to stop this job at this step."""


@dataclass(frozen=True)
class Place:
    """Where the work runs: this rank's replica group and what each record says served it."""

    group: int = 0  # the replica group's index
    decode_group: object = None  # every rank of the group (None: one rank); they denoise and decode together
    writes: bool = True  # this rank commits the group's files and reports its events
    crf: int = DEFAULT_CRF
    raise_failures: bool = False  # re-raise a failed job's error once reported (one clip in this process)
    model: str = ""  # what the record says served it (a checkpoint path, a bundle, embedded-tiny)
    record_extra: dict = field(default_factory=dict)  # added to every record (a bundle's identity, the mesh)

    def target(self, job: Job) -> Target:
        """Where `job`'s clip is written, and whether this rank writes it."""
        return Target(job.output, self.crf, self.decode_group, self.writes)


class Reporter:
    """Events of the jobs of one unit, sent on the writing rank only; cancellations agreed by the whole group."""

    def __init__(self, place: Place, send: Callable[[Event], None], cancelled: Callable[[str], bool],
                 device: torch.device):
        self.place, self._send, self._cancelled, self.device = place, send, cancelled, device
        self.progress: dict[str, int] = {}

    def event(self, job: Job, kind: EventKind, stage: Stage | str = "", progress: int | None = None, **fields) -> None:
        if progress is not None:
            progress = max(progress, self.progress.get(job.id, 0))  # monotonic per job
            self.progress[job.id] = progress
        if self.place.writes:
            self._send(Event(job.id, kind, stage, self.progress.get(job.id, 0), group=self.place.group,
                             attempt=job.attempt, **fields))

    def step(self, jobs: list[Job], i: int, n: int) -> list[bool]:
        """After evaluation i of n: wait for the device (true progress), report, and agree on cancellations: the
        flags of `jobs` that any rank of the group saw cancelled."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        for job in jobs:
            self.event(job, EventKind.PROGRESS, Stage.DENOISE if i < n else Stage.DECODE, denoise_progress(i, n),
                       evaluations=(i, n))
        return self.agree([self._cancelled(job.id) for job in jobs])

    def agree(self, flags: list[bool]) -> list[bool]:
        group = self.place.decode_group
        if group is None:
            return flags
        mine = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=_comm_device(group, self.device))
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        return [bool(v) for v in mine.tolist()]


def run_work(pipeline: H3Pipeline, jobs: list[Job], place: Place, reporter: Reporter) -> None:
    """Steps 1-4 for one unit of work; every job ends in exactly one done, failed or cancelled event."""
    for job in jobs:
        reporter.event(job, EventKind.STARTED, Stage.TEXT_ENCODE, 0)
    if len(jobs) == 1:
        _run_one(pipeline, jobs[0], place, reporter)
    else:
        _Batch(pipeline, jobs, place, reporter).run()


def _run_one(pipeline: H3Pipeline, job: Job, place: Place, reporter: Reporter) -> None:
    timer = unix_timer(pipeline.device)
    frames = prepared = None

    def on_step(i: int, n: int) -> None:
        if reporter.step([job], i, n)[0]:
            raise JobCancelled(f"cancelled at denoise evaluation {i} of {n}")

    def on_frames(count: int) -> None:
        reporter.event(job, EventKind.PROGRESS, Stage.DECODE, decode_progress(count, frames))

    if pipeline.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(pipeline.device)
    stage = "prepare"
    try:
        prepared = read_media(job.request, pipeline.canvas)  # admitted already: the rank re-reads only the media
        frames, stage = prepared.geometry.num_frames, "generate"
        clip = pipeline.generate(prepared, place.target(job), timer, on_step, on_frames, job.profile_step)
        record = commit_job_clip(clip, job, place, pipeline.device, {"size": 1, "index": 0, "members": [job.id]})
    except JobCancelled as e:
        reporter.event(job, EventKind.CANCELLED, error=str(e))
        return
    except Exception as e:  # noqa: BLE001 -- the job fails alone; see step 4
        _failed(reporter, place, [job], _stage_of(timer, stage), e, timer)
        return
    mark_decode(timer)
    reporter.event(job, EventKind.DONE, Stage.DONE, 100, record=record, intervals=tuple(timer.intervals))


@dataclass
class _Pending:
    job: Job
    encoded: Encoded
    timer: TimelineTimer
    encoded_at: float


class _Batch:
    """Step 2: encode each job, bucket by layout, denoise each bucket as one batch, decode each member."""

    def __init__(self, pipeline: H3Pipeline, jobs: list[Job], place: Place, reporter: Reporter):
        self.pipeline, self.jobs, self.place, self.reporter = pipeline, jobs, place, reporter

    def run(self) -> None:
        buckets: dict[bytes, list[_Pending]] = {}
        for job in self.jobs:
            timer = unix_timer(self.pipeline.device)
            try:
                encoded = self.pipeline.encode_request(read_media(job.request, self.pipeline.canvas), timer)
            except Exception as e:  # noqa: BLE001 -- one job's bad input fails that job
                _failed(self.reporter, self.place, [job], "encode", e, timer)
                continue
            buckets.setdefault(layout_key(encoded), []).append(_Pending(job, encoded, timer, time.perf_counter()))
        for bucket in buckets.values():
            self._run_bucket(bucket)

    def _run_bucket(self, bucket: list[_Pending]) -> None:
        device, reporter = self.pipeline.device, self.reporter
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # GPU work is charged to the interval that queued it
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for p in bucket:
            p.timer.add("wait_batch", p.encoded_at, start)
        live = list(bucket)

        def on_step(i: int, n: int) -> None:
            nonlocal live
            flags = reporter.step([p.job for p in live], i, n)
            for p, cancelled in zip(list(live), flags):
                if cancelled:
                    reporter.event(p.job, EventKind.CANCELLED, error=f"cancelled at denoise evaluation {i} of {n}")
            live = [p for p, cancelled in zip(live, flags) if not cancelled]
            if not live:
                raise JobCancelled(f"every job of the batch was cancelled at evaluation {i} of {n}")

        try:
            finals = self.pipeline.denoise_batch([p.encoded for p in bucket], on_step)
        except JobCancelled:
            return
        except Exception as e:  # noqa: BLE001
            _failed(reporter, self.place, [p.job for p in live], "denoise", e, *[p.timer for p in live])
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        members = [p.job.id for p in bucket]
        for index, (p, final) in enumerate(zip(bucket, finals)):
            if p not in live:
                continue
            p.timer.add("denoise", start, end)
            p.timer.add("wait_decode", end, time.perf_counter())
            batch = {"size": len(bucket), "index": index, "members": members}
            if not self.place.writes and self.place.decode_group is None:
                continue
            frames = p.encoded.prepared.geometry.num_frames
            try:
                clip = self.pipeline.decode_request(
                    p.encoded, final, self.place.target(p.job), p.timer,
                    on_frames=lambda count, job=p.job: reporter.event(job, EventKind.PROGRESS, Stage.DECODE,
                                                                      decode_progress(count, frames)))
                record = commit_job_clip(clip, p.job, self.place, device, batch)
            except Exception as e:  # noqa: BLE001
                _failed(reporter, self.place, [p.job], "decode", e, p.timer)
                continue
            mark_decode(p.timer)
            reporter.event(p.job, EventKind.DONE, Stage.DONE, 100, record=record, intervals=tuple(p.timer.intervals))


def unix_timer(device: torch.device) -> TimelineTimer:
    """A job's timer whose intervals are in Unix seconds: ranks of other processes report on one clock."""
    return TimelineTimer(device, time.perf_counter() - time.time())


def mark_decode(timer: TimelineTimer) -> None:
    """An overlapped decode reports seconds per stage, not intervals: one decode_mux bar from its span."""
    span = timer.spans.get("decode_and_mux")
    if span is not None and not any(stage == "decode_mux" for stage, _, _ in timer.intervals):
        timer.intervals.append(("decode_mux", span[0], span[1]))


def _stage_of(timer: TimelineTimer, fallback: str) -> str:
    """The stage a failing `generate` was in: the last one the timer saw begin."""
    if fallback == "prepare":
        return "encode"
    if "decode_and_mux" in timer.spans or "wait_vaes" in timer.spans:
        return "decode"
    return "denoise" if "condition_encode" in timer.seconds else "encode"


def _failed(reporter: Reporter, place: Place, jobs: list[Job], stage: str, error: Exception,
            *timers: TimelineTimer) -> None:
    """Report the failure of `jobs` and free what the attempt held. On a group of several ranks the error is only
    re-raised: the rank dies with it, and the launcher decides what the job becomes from the group's root cause (this
    error fails the job; a peer killed first, whose death this error only follows, re-queues it)."""
    if place.decode_group is not None:
        raise error
    reason = f"{stage}: {type(error).__name__}: {' '.join(str(error).split())}"
    for job, timer in zip(jobs, timers if timers else [None] * len(jobs)):
        reporter.event(job, EventKind.FAILED, stage, error=reason,
                       intervals=tuple(timer.intervals) if timer is not None else (),
                       record=Failure(type(error).__name__, isinstance(error, UserError),
                                      traceback.format_exception(error)[-3:],
                                      {k: round(v, 4) for k, v in timer.seconds.items()} if timer else {}))
    free_memory(reporter.device)
    if place.raise_failures:
        raise error


def free_memory(device: torch.device) -> None:
    """What a failed job held goes back to the allocator's pool and then to the device (a CUDA OOM included)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def commit_job_clip(clip: Clip | None, job: Job, place: Place, device: torch.device,
                    batch: dict) -> ClipRecord | None:
    """A job's clip put in place, on the writing rank (None elsewhere: there is no clip). Its record is completed with
    what the job layer knows (status .. peak_memory, the serving side's and the job's extra fields), then the MP4 and
    the record are committed together or neither, never replacing a file unless the job overwrites
    (records.commit_clip). Whatever fails here, the MP4 under its temporary name goes too: nothing appears at the
    output path but a whole clip with its record."""
    if clip is None:
        return None
    try:
        record = replace(clip.record, status="done", id=job.id, request=job.request.flat(), model=place.model,
                         batch=batch, peak_memory=peak_memory(device),
                         extra={**clip.record.extra, **place.record_extra, **job.record})
    except BaseException:
        clip.discard()
        raise
    return commit_clip(record, clip.mp4_temp, job.output, job.overwrite)


def layout_key(encoded: Encoded) -> bytes:
    """Requests with equal keys pack into the same rows (the packed layout's digest: models/packing.py
    PackedLayout.digest, the one rule of "the same layout"), take the same text embedding shape and the same schedule,
    and run the same LoRA adapters at the same strengths, so they can share one batched DiT evaluation."""
    digest = hashlib.sha256(repr((encoded.schedule, tuple(encoded.text_embeds.shape))).encode())
    digest.update(encoded.layout.digest())
    if encoded.prepared.request.adapters:  # a request without adapters keys as before they existed
        digest.update(repr(batch_key(encoded.prepared.request.adapters)).encode())
    return digest.digest()


def peak_memory(device: torch.device) -> dict:
    """CUDA: the allocator's peak since this work started; CPU: the process's peak resident set since it started."""
    if device.type == "cuda":
        return {"bytes": int(torch.cuda.max_memory_allocated(device)), "what": "cuda max_memory_allocated, this work"}
    return {"bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "what": "process peak RSS"}

