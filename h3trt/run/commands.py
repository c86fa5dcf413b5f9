"""`h3trt run`: one clip (--prompt) or a requests file (--requests), each checked whole before any model loads, then
served by the one job loop (jobs/rank.py) launched from its one place (jobs/supervisor.py): this process, spawned
replica groups (--gpus N), or torchrun.

  1. validate: inputs, canvas, schedule, what a bundle can serve, the mesh, the output's folder, space and lock
  2. queue: a queue of one job (`ClipQueue`), or the file's (`batch.FileQueue`, which skips finished requests)
  3. serve it; report: the clip's summary, or the batch's; an interrupt removes what was being written
"""

from __future__ import annotations

import dataclasses
import sys
from contextlib import nullcontext
from pathlib import Path

from ..errors import UserError
from ..jobs.admission import admit
from ..jobs.job import Event, EventKind, Job, JobFailed
from ..jobs.model_source import Entry
from ..jobs.supervisor import launch_gpus, serve_queue
from ..media.output_files import (DEFAULT_CRF, BatchLock, estimated_clip_bytes, preflight_clip, preflight_out_dir,
                                  remove_leftovers, remove_own_temps)
from ..models.packing import FPS
from ..pipeline.records import ClipRecord, record_path
from ..pipeline.prepare import Prepared
from ..request.fields import FLAGS, KEY_WORDS
from ..request.request import Request
from .batch import BatchConfig, FileQueue, summary_line
from .batch_file import parse_requests
from .batch_outputs import finished, plan_out_dir

# ----------------------------------------------------------------------------------------------------------------------
# One clip


def run_clip(entry: Entry, request: Request, output: Path, crf: int, overwrite: bool = False, quiet: bool = False,
             profile_step: int | None = None) -> int:
    """`h3trt run --prompt ... --output clip.mp4`: 0 when the clip and its record are written."""
    check_mp4_name(output)
    steps = request.schedule.steps
    if profile_step is not None and not 1 <= profile_step < steps:
        raise UserError(f"--profile-step {profile_step}: a {steps}-step request runs {steps - 1} evaluations; "
                        f"pick one of 1..{steps - 1}.")
    mesh = entry.mesh(request.task)
    if mesh.replica > 1:
        raise UserError(f"replicas={mesh.replica} serve different requests, but there is one; use --replicas 1 and "
                        "give the other ranks to --sp or --cfg.")

    def writable(prepared: Prepared) -> None:  # the output's folder (made), space and lock
        geo = prepared.geometry
        preflight_clip(output, record_path(output), overwrite,
                       estimated_clip_bytes(geo.width, geo.height, geo.num_frames, FPS, crf))

    # Every input error, the output's and what the model cannot serve surface here, before any model is loaded.
    admit(entry, request, FLAGS, guidance_branches=mesh.cfg, own=writable)
    launch = entry.launch
    gpus = launch_gpus(launch.device_type, launch.world) if launch.how.spawns else None
    entry.model.note()  # the embedded tiny model: its clips are noise
    queue = ClipQueue(Job(output.stem, request, output, overwrite, profile_step), quiet)
    # The clip's prompt is known before the model loads: a bundle encodes it while its DiT loads (t2va's text only)
    prefetch = (request.inputs.prompt,) if request.task == "t2va" else ()
    spec = entry.worker_spec(request.task, mesh, crf=crf, raise_failures=not launch.on_mesh, prefetch_prompts=prefetch)
    try:
        serve_queue(spec, lambda group, groups: queue if group == 0 else ClipQueue(None, True), launch.how, gpus)
    except BaseException:  # Ctrl-C or a failed rank: every rank was stopped; remove what they were writing
        if launch.on_mesh:
            remove_leftovers(Path(output).parent)
        raise
    finally:
        queue.close()
    return queue.result(launch.first)


class ClipQueue:
    """A queue of one job (or of none: a torchrun group other than the first), shown as a denoise progress bar; its
    summary printed when the clip is written."""

    def __init__(self, job: Job | None, quiet: bool):
        self.job, self.quiet = job, quiet
        self.pending = [job] if job is not None else []
        self.record: ClipRecord | None = None
        self.error: Event | str | None = None
        self.retried = False
        self.bar = None

    def take(self, group: int, limit: int) -> list[Job] | None:
        return [self.pending.pop()] if self.pending else None

    def report(self, event: Event) -> None:
        if event.kind is EventKind.PROGRESS and event.evaluations[1] and not self.quiet:
            done, total = event.evaluations
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="denoise", unit="step", file=sys.stderr)
            self.bar.update(done - self.bar.n)
            if done == total:
                self.close()  # the bar's rate is the denoise's: the decode after it is not counted
        elif event.kind is EventKind.DONE:
            self.close()
            self.record = event.record
        elif event.kind in (EventKind.FAILED, EventKind.CANCELLED):
            self.close()
            self.error = event

    def lost(self, group: int, jobs: list[Job], reason: str, died: bool) -> None:
        if died and not self.retried:
            self.retried = True
            self.pending = list(jobs)
            print(f"h3trt: replica group {group} died ({reason}); running the request again", file=sys.stderr)
        else:
            self.error = f"replica group {group} failed: {reason}"

    def cancels(self) -> list[str]:
        return []

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def result(self, reports: bool) -> int:
        """0 and the clip's summary, or the job's failure as one error (UserError when the request was at fault)."""
        if self.error is not None:
            event = self.error
            if isinstance(event, str):
                raise JobFailed(f"{event}. Every rank was stopped; no output was written.")
            raise (UserError if event.record is not None and event.record.user_error else JobFailed)(event.error)
        if reports and self.record is not None:
            report_record(self.record, self.job.output)
            note = no_sparse_evaluation(self.record)
            if note is not None:
                print(f"h3trt: note: {note}", file=sys.stderr)
        return 0


def no_sparse_evaluation(record: ClipRecord) -> str | None:
    """Why a request that asked for block-sparse attention ran none (its record's sparse_attention lists no sparse
    evaluation), or None: it ran some, or asked for none. Said on stderr: the clip is dense, which the run's exit
    status does not tell."""
    report = record.sparse_attention or {}
    if not report.get("sparsity") or report.get("sparse_evaluations") or "evaluations" not in report:
        return None
    evaluations, dense_steps = report["evaluations"], report["dense_steps"]
    why = (f"all {evaluations} of its evaluations are among the first {dense_steps} kept dense (--sparse-dense-steps)"
           if evaluations <= dense_steps else
           f"its attentions are shorter than --sparse-min-seq {report['min_seq']} rows")
    return (f"block-sparse attention (sparsity {report['sparsity']:g}) ran on no evaluation: {why}; the clip is "
            "dense, as its record's sparse_attention says.")


def check_mp4_name(output: Path) -> None:
    """--output names an .mp4 file (one line otherwise)."""
    if output.name.lower() == ".mp4":
        raise UserError(f"--output {output} has no file name before the extension; name the clip, e.g. "
                        f"{output.with_name('clip.mp4')}.")
    if output.suffix.lower() != ".mp4":
        raise UserError(f"--output must end in .mp4, got {str(output)!r}; e.g. {output.with_suffix('.mp4')}.")


def report_record(record: ClipRecord, output: Path) -> None:
    """Print the summary of a written clip."""
    print(f"wrote {output}: {record.frames} frames {record.width}x{record.height} @ {record.fps} fps, "
          f"{record.audio_samples / record.audio_sample_rate:.3f} s stereo audio ({record.task}, seed {record.seed})")
    for stage, seconds in record.timings_s.items():
        print(f"  {stage:<17}{seconds:8.2f} s")
    # Stages overlap (video decode, audio decode and encoding run concurrently): the total is wall time, not a sum.
    print(f"  {'wall':<17}{record.wall_s:8.2f} s   (timings: {record_path(output)})")


# ----------------------------------------------------------------------------------------------------------------------
# A requests file


def run_requests(entry: Entry, requests: Path, out_dir: Path, max_batch: int = 1, fail_fast: bool = False,
                 crf: int = DEFAULT_CRF, quiet: bool = False, overwrite: bool = False) -> int:
    """`h3trt run --requests FILE --out-dir OUT`: 0 when every request is done (now or by an earlier run)."""
    model, launch = entry.model, entry.launch
    model.check_batching(max_batch)
    config = BatchConfig(out_dir, max_batch, fail_fast, crf, quiet=quiet, overwrite=overwrite)
    # Every line admitted before any model loads, as one --prompt is (jobs/admission.py); every bad line listed.
    checked: set[Path] = set()  # the model's files, checked once per component root
    items = parse_requests(requests, model.canvas, model.default_steps,
                           lambda request: admit(entry, request, KEY_WORDS, checked=checked), model.default_sparse,
                           entry.adapters.schedules)
    mesh = entry.mesh(items[0].request.task)
    if mesh.cfg == 2:
        raise UserError("--cfg 2 splits guidance branches, and batch files carry no guidance; use --cfg 1.")
    gpus = launch_gpus(launch.device_type, launch.world) if launch.how.spawns else None
    # Before any model loads: the out-dir is a writable folder with room for its largest clip, and no other batch
    # writes it (under torchrun, rank 0 holds the lock for the job).
    shapes = [i.admitted.geometry for i in items]
    preflight_out_dir(out_dir, max(estimated_clip_bytes(g.width, g.height, g.num_frames, FPS, config.crf) for g in shapes))
    first = launch.first
    lock = BatchLock(out_dir) if first else nullcontext()
    groups = mesh.replica if launch.torchrun is not None else 1  # torchrun: each group writes its own timeline
    queues: list[FileQueue] = []

    def queue_of(group: int, groups: int) -> FileQueue:
        queues.append(FileQueue(items, dataclasses.replace(config, shard=(group, groups)), model.model_name,
                                model.record_extra, plan=plan))
        return queues[-1]

    spec = entry.worker_spec(items[0].request.task, mesh, crf=crf, max_batch=max_batch)
    try:
        with lock:
            # Under the lock, before any model loads: what OUT holds that is not ours is refused (every rank sees
            # the same files and refuses alike).
            plan = plan_out_dir(out_dir, items, [dataclasses.replace(config, shard=(g, groups)).timeline_stem
                                                 for g in range(groups)], config.timeline_png, overwrite)
            for note in plan.notes if first else ():
                print(f"h3trt: {note}", file=sys.stderr)
            model.note()
            try:
                serve_queue(spec, queue_of, launch.how, gpus)
            finally:
                for q in queues:
                    summary = q.finish()
    except KeyboardInterrupt:
        remove_own_temps()
        if launch.on_mesh:
            remove_leftovers(out_dir)
        done = [i.id for i in items if finished(out_dir, i)]
        listed = ", ".join(done[:10]) + (f" and {len(done) - 10} more" if len(done) > 10 else "")
        print(f"h3trt: interrupted: {len(done)} of {len(items)} requests are done in {out_dir}"
              f"{' (' + listed + ')' if done else ''}, each with its record; the others left no files. Rerun the "
              "same command to finish them.", file=sys.stderr)
        return 130
    if not queues:  # a torchrun rank that serves no queue (not its group's first)
        return 0
    queue = queues[0]
    if queue.stopped:
        print(f"h3trt: stopped: {queue.stopped}", file=sys.stderr)
        return 1
    where = f"replica group {queue.config.shard[0]}: " if queue.config.shard[1] > 1 else f"{out_dir}: "
    print(where + summary_line(summary))
    return 1 if summary.failed else 0

