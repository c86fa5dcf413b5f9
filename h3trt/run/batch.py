"""`h3trt run --requests FILE --out-dir OUT` (and `run --prompt`, a file of one): the queue a requests file feeds.

  1. parse (batch_file.py): every line is validated before any model loads; every error names its line
  2. plan (batch_outputs.py): requests whose outputs are ours and verify (our record says done, same request, MP4
     hash matches) are skipped; files in OUT that are not ours are refused (unless --overwrite); the rest become
     jobs, in file order, each keyed by (task, canvas, frames, schedule)
  3. serve: a replica group takes the next job and, with --max-batch N, up to N - 1 later jobs of the same key, which
     it denoises as one batch where their packed layouts agree (jobs/work.py); groups take work as they become
     free, so a slow request does not hold up another group's share
  4. record: OUT/<id>.mp4 and OUT/<id>.json per done request (committed by the worker), OUT/<id>.json with status
     failed for a failed one (here), the timeline (timeline.py) and the summary. A failed request does not stop the
     run (unless --fail-fast); a request whose group died is run again once, then recorded as failed with the reason
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from ..errors import UserError
from ..jobs.job import Event, EventKind, Job
from ..media.output_files import DEFAULT_CRF, OutputError, write_json_atomic
from ..parallel.mesh import MeshConfig
from ..pipeline.records import Failure, FailureRecord
from .batch_file import BatchItem
from .batch_outputs import MADE_BY, OutPlan, our_record, output_paths, plan_out_dir
from .timeline import write_timeline


@dataclass(frozen=True)
class BatchConfig:
    """How a batch run writes and groups its work."""

    out_dir: Path
    max_batch: int = 1  # requests of one layout denoised together along the batch dimension
    fail_fast: bool = False  # stop at the first failed request (it is still recorded)
    crf: int = DEFAULT_CRF
    timeline_png: bool = True  # draw OUT/timeline.png (matplotlib) beside OUT/timeline.json
    quiet: bool = False  # no progress bars
    shard: tuple[int, int] = (0, 1)  # torchrun: (replica group, groups); this queue holds requests group::groups
    overwrite: bool = False  # run requests whose files in OUT are not ours (or changed) and replace those files

    def __post_init__(self):
        if self.max_batch < 1:
            raise UserError(f"--max-batch must be >= 1, got {self.max_batch}.")
        group, groups = self.shard
        if groups < 1 or not 0 <= group < groups:
            raise ValueError(f"shard=({group}, {groups}) needs 0 <= group ({group}) < groups ({groups}).")
        if not 0 <= self.crf <= 51:
            raise UserError(f"crf={self.crf} is outside H.264's range 0..51.")

    @property
    def timeline_stem(self) -> str:
        """OUT/timeline.*, or timeline-group<g>.* for torchrun's replica group g (each serves its own share)."""
        group, groups = self.shard
        return "timeline" if groups == 1 else f"timeline-group{group}"


@dataclass
class BatchSummary:
    done: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        return {"done": len(self.done), "failed": len(self.failed), "skipped": len(self.skipped),
                "wall_s": round(self.wall_s, 3), "clips_per_hour": self.clips_per_hour,
                "failed_ids": self.failed}

    @property
    def clips_per_hour(self) -> float:
        return round(len(self.done) * 3600.0 / self.wall_s, 3) if self.wall_s > 0 else 0.0


def summary_line(summary: BatchSummary) -> str:
    s = summary.as_dict()
    return (f"{s['done']} done, {s['failed']} failed, {s['skipped']} skipped in {s['wall_s']:.1f} s: "
            f"{s['clips_per_hour']:.1f} clips/hour" + (f"; failed: {', '.join(s['failed_ids'])}" if s['failed'] else ""))


class FileQueue:
    """Steps 2-4: the jobs of a requests file (the JobQueue of jobs/job.py), their records and the timeline.
    `plan`: what OUT holds (batch_outputs.plan_out_dir, made by the caller over the whole file before any model
    loads; made here, and its notes said, when not given). `on_event(event)` sees every event after it was recorded
    (tests stop a run there)."""

    def __init__(self, items: list[BatchItem], config: BatchConfig, model: str = "", record_extra: dict | None = None,
                 on_event: Callable[[Event], None] | None = None, plan: OutPlan | None = None):
        self.config, self.model, self.extra, self.on_event = config, model, record_extra or {}, on_event
        self.out_dir = Path(config.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.summary = BatchSummary()
        group, groups = config.shard
        self.items = {item.id: item for item in items[group::groups]}
        if plan is None:  # 2. plan, before any model loads; refuses files in the way that are not ours
            plan = plan_out_dir(self.out_dir, list(self.items.values()), [config.timeline_stem], config.timeline_png,
                                config.overwrite)
            for note in plan.notes:
                print(f"h3trt: {note}", file=sys.stderr)
        self.plan = plan
        jobs = []
        for item in self.items.values():
            if item.id in plan.finished:
                self.summary.skipped.append(item.id)
            else:
                mp4, _ = output_paths(self.out_dir, item)
                # A job replaces only files the plan found ours (or --overwrite allowed); any other target is
                # committed without replacing, so a file that appears meanwhile is kept and the job fails naming it.
                jobs.append(Job(item.id, item.request, mp4, overwrite=item.id in plan.replace,
                                record={"line": item.line, "made_by": MADE_BY},
                                key=item.admitted.batch_key))
        self.pending: deque[Job] = deque(jobs)
        self.retried: set[str] = set()
        self.stopped: str | None = None  # why no more work is handed out (--fail-fast)
        self.rows: list[dict] = []
        self.started_unix, self._start = time.time(), time.perf_counter()
        self.bars = None
        if not config.quiet:
            self.bars = (tqdm(total=len(self.items), initial=len(self.summary.skipped), desc="requests", unit="clip",
                              position=0, file=sys.stderr),
                         tqdm(total=0, desc="denoise", unit="step", position=1, leave=False, file=sys.stderr))

    # --- JobQueue ---------------------------------------------------------------------------------------------------

    def take(self, group: int, limit: int) -> list[Job] | None:
        if self.stopped or not self.pending:
            return None
        work = [self.pending.popleft()]
        if limit > 1 and work[0].key:
            for job in list(self.pending):
                if len(work) == limit:
                    break
                if job.key == work[0].key:
                    self.pending.remove(job)
                    work.append(job)
        return work

    def report(self, event: Event) -> None:
        if event.kind is EventKind.PROGRESS and self.bars and event.evaluations[1]:
            done, total = event.evaluations
            bar = self.bars[1]
            if bar.total != total or bar.n > done:
                bar.reset(total=total)
                bar.set_description(f"denoise {event.job}")
            bar.update(done - bar.n)
        elif event.kind is EventKind.DONE:
            self.summary.done.append(event.job)
            self._row(event, "done", event.record.batch["members"])
        elif event.kind is EventKind.FAILED:
            self._failed(event.job, event.stage, event.error, event)
        if self.on_event is not None:
            self.on_event(event)

    def lost(self, group: int, jobs: list[Job], reason: str, died: bool) -> None:
        for job in reversed(jobs):
            if died and job.id not in self.retried:
                self.retried.add(job.id)
                if self._ours_now(job.id):  # the group died after committing (part of) it: ours to replace
                    job = dataclasses.replace(job, overwrite=True)
                self.pending.appendleft(job)
                self._log(f"{job.id}: its replica group {group} died ({reason}); running it again")
            else:
                self._failed(job.id, "worker", f"worker: its replica group {group} failed: {reason}", None)

    def cancels(self) -> list[str]:
        return []

    # --- records ----------------------------------------------------------------------------------------------------

    def _row(self, event: Event, status: str, members: list[str] | None = None) -> None:
        """A timeline row; `members`: the jobs of the batched denoise it was part of (None: itself alone)."""
        origin = self.started_unix
        self.rows.append({"id": event.job, "status": status, "group": event.group, "batch": members or [event.job],
                          "intervals": [(s, a - origin, b - origin) for s, a, b in event.intervals]})
        self._advance()

    def _failed(self, job_id: str, stage: str, error: str, event: Event | None) -> None:
        self.summary.failed.append(job_id)
        item = self.items[job_id]
        details = event.record if event is not None and event.record is not None else Failure()
        _, json_path = output_paths(self.out_dir, item)
        record = FailureRecord(job_id, item.line, stage, error, details.traceback, item.request.flat(),
                               self.model, details.timings_s, MADE_BY, dict(self.extra))
        try:
            write_json_atomic(json_path, record.to_json(),
                              overwrite=job_id in self.plan.replace or self._ours_now(job_id))
        except OutputError as e:  # a full disk, or a file that appeared: one line says so and the batch goes on
            self._log(f"{job_id}: its failure record could not be written either: {e}")
        if event is not None:
            self._row(event, "failed")
        else:
            self.rows.append({"id": job_id, "status": "failed", "group": -1, "batch": [job_id], "intervals": []})
            self._advance()
        self._log(f"{job_id} (line {item.line}) failed: {error}")
        if self.config.fail_fast and self.stopped is None:
            self.stopped = (f"{job_id} (line {item.line}) failed: {error} (--fail-fast; a rerun skips the finished "
                            "requests and retries this one).")

    def _ours_now(self, job_id: str) -> bool:
        """Whether OUT/<id>.json is now a record of ours (this run's: the out-dir lock keeps other batches out)."""
        return our_record(output_paths(self.out_dir, self.items[job_id])[1], job_id) is not None

    def finish(self) -> BatchSummary:
        """Close the run: the summary's wall time, the bars, and the timeline (kept across resumed runs)."""
        self.summary.wall_s = time.perf_counter() - self._start
        if self.bars:
            self.bars[1].close()
            self.bars[0].close()
            self.bars = None
        try:
            stem = self.config.timeline_stem
            write_timeline(self.out_dir, stem, self.rows, self.summary.as_dict(), self.config.timeline_png,
                           self.started_unix, replace=self.plan.timelines.get(stem, False))
        except (OutputError, OSError) as e:  # a full disk: the clips' own records are what matters
            self._log(f"the timeline could not be written: {e}")
        return self.summary

    def _advance(self) -> None:
        if self.bars:
            self.bars[0].update(1)
            self.bars[0].set_postfix(done=len(self.summary.done), failed=len(self.summary.failed))

    def _log(self, message: str) -> None:
        if self.bars:
            self.bars[0].write(f"h3trt: {message}", file=sys.stderr)
        else:
            print(f"h3trt: {message}", file=sys.stderr)


def run_batch(pipeline, items: list[BatchItem], config: BatchConfig, model: str = "",
              on_event: Callable[[Event], None] | None = None) -> BatchSummary:
    """A requests file's items on a pipeline already loaded in this process, through the one job loop (benchmarks
    and tests; `h3trt run --requests` goes through run/commands.py, which also loads the model and launches ranks)."""
    from ..jobs.rank import Pipelines, WorkerSpec
    from ..jobs.supervisor import serve_in_process

    queue = FileQueue(items, config, model, on_event=on_event)
    spec = WorkerSpec("", False, "t2va", pipeline.device.type, MeshConfig(), pipeline.dit.cfg.num_heads,
                      canvas=pipeline.canvas, crf=config.crf, max_batch=config.max_batch, model_name=model)
    try:
        serve_in_process(spec, queue, Pipelines(lambda task: pipeline, "t2va", engine=True))
    finally:
        summary = queue.finish()
    return summary
