"""Batch generation: a JSONL file of requests in, OUT/<id>.mp4 and OUT/<id>.json per request out, resumable.

  1. parse (batch_file.py): every line is validated before any model loads; every error names its line
  2. plan: requests whose outputs exist and verify (record says done, same request, MP4 hash matches) are skipped;
     the rest are grouped by (task, canvas, frames, schedule), in file order
  3. run: within a group, requests are encoded one at a time into buckets by packed layout (same text length); a full
     bucket (--max-batch) or the group's end is denoised as ONE batch along the batch dimension, then each member
     decodes and writes. A failing request is recorded and the run goes on (unless fail_fast)
  4. record: OUT/<id>.json (status done or failed), the timeline (timeline.py) and the summary

On a mesh (`--gpus N` or torchrun; batch_entry.py, ranks set up as in h3trt/runtime/serve.py) each
replica group calls `run_batch` with `shard=(group, groups)`: group g takes requests g, g + groups, ... Every rank
of a group runs the same plan (it is computed before the first collective) and enters every batched denoise and every
tile-parallel decode together; only the group's first rank (`write=True`) writes. A failure inside denoise or decode
there ends the job (a rerun resumes).
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from ..engines.manifest import sha256_file
from .batch_file import BatchItem
from .files import DEFAULT_CRF
from .files import OutputError, write_json_atomic
from .pipeline import H3Pipeline
from .request import Encoded, prepare, request_dict
from .timeline import TimelineTimer, write_timeline


class BatchAborted(RuntimeError):
    """--fail-fast: a request failed, so the run stopped after recording it."""


@dataclass(frozen=True)
class BatchConfig:
    """How a batch run writes and groups its work."""

    out_dir: Path
    max_batch: int = 1  # requests of one layout denoised together along the batch dimension
    fail_fast: bool = False  # stop at the first failed request (it is still recorded)
    crf: int = DEFAULT_CRF
    shard: tuple[int, int] = (0, 1)  # (replica group, groups): this group serves requests group::groups
    write: bool = True  # this rank writes MP4s and records (the first rank of its group)
    decode_group: object = None  # the ranks of this replica group: all denoise and decode together, one writes
    timeline_png: bool = True  # draw OUT/timeline.png (matplotlib) beside OUT/timeline.json
    quiet: bool = False  # no progress bars

    def __post_init__(self):
        if self.max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {self.max_batch}.")
        group, groups = self.shard
        if groups < 1 or not 0 <= group < groups:
            raise ValueError(f"shard=({group}, {groups}) needs 0 <= group ({group}) < groups ({groups}).")
        if not 0 <= self.crf <= 51:
            raise ValueError(f"crf={self.crf} is outside H.264's range 0..51.")


# ----------------------------------------------------------------------------------------------------------------------
# 2. Plan


def output_paths(out_dir: Path, item: BatchItem) -> tuple[Path, Path]:
    return Path(out_dir) / f"{item.id}.mp4", Path(out_dir) / f"{item.id}.json"


def finished(out_dir: Path, item: BatchItem) -> bool:
    """Whether OUT/<id>.mp4 and OUT/<id>.json exist and verify: done, for this same request, MP4 hash as recorded."""
    mp4, record = output_paths(out_dir, item)
    if not (mp4.is_file() and record.is_file()):
        return False
    try:
        data = json.loads(record.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (data.get("status") == "done" and data.get("request") == request_dict(item.request)
            and data.get("mp4_sha256") == sha256_file(mp4))


# ----------------------------------------------------------------------------------------------------------------------
# 3-4. Run and record


@dataclass
class _Pending:
    item: BatchItem
    encoded: Encoded
    timer: TimelineTimer
    encoded_at: float


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


def run_batch(pipeline: H3Pipeline, items: list[BatchItem], config: BatchConfig, model: str = "",
              record_extra: dict | None = None, on_done: Callable[[str], None] | None = None) -> BatchSummary:
    """Generate every item of this replica group (config.shard) that is not already finished; see the module doc.
    `model` and `record_extra` go into every record (what served it: a checkpoint path, a bundle's hash);
    `on_done(id)` is called after each finished request."""
    return _Run(pipeline, items, config, model, record_extra or {}, on_done).run()


class _Run:
    def __init__(self, pipeline, items, config, model, record_extra, on_done):
        self.pipeline, self.config, self.model, self.extra, self.on_done = (pipeline, config, model, record_extra,
                                                                            on_done)
        group, groups = config.shard
        self.items = items[group::groups]
        self.out_dir = Path(config.out_dir)
        self.summary = BatchSummary()
        self.rows: list[dict] = []
        self.bars = None

    def run(self) -> BatchSummary:
        cfg = self.config
        if cfg.write:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        # 2. Plan, before any collective: every rank of a group sees the same finished set.
        todo = []
        for item in self.items:
            if finished(self.out_dir, item):
                self.summary.skipped.append(item.id)
            else:
                todo.append(item)
        groups: dict[tuple, list[BatchItem]] = {}
        for item in todo:
            groups.setdefault(item.key, []).append(item)
        self.origin, started_unix = time.perf_counter(), time.time()
        self._open_bars(len(self.items), len(self.summary.skipped))
        try:
            for group in groups.values():
                self._run_group(group)
        finally:
            self.summary.wall_s = time.perf_counter() - self.origin
            self._close_bars()
            if cfg.write:
                try:
                    write_timeline(self.out_dir, cfg.shard, self.rows, self.summary.as_dict(), cfg.timeline_png,
                                   started_unix)
                except (OutputError, OSError) as e:  # a full disk: the clips' own records are what matters
                    self._log(f"the timeline could not be written: {e}")
        return self.summary

    def _run_group(self, group: list[BatchItem]) -> None:
        """Encode one request at a time into buckets by packed layout; run a bucket when it is full or at the end."""
        buckets: dict[bytes, list[_Pending]] = {}
        for item in group:
            timer = TimelineTimer(self.pipeline.device, self.origin)
            try:
                encoded = self.pipeline.encode_request(prepare(item.request, self.pipeline.canvas), timer)
            except Exception as e:  # noqa: BLE001 -- any failure of one request is recorded; the batch goes on
                self._fail([_Pending(item, None, timer, 0.0)], e, "encode")
                continue
            bucket = buckets.setdefault(layout_key(encoded), [])
            bucket.append(_Pending(item, encoded, timer, time.perf_counter()))
            if len(bucket) == self.config.max_batch:
                self._run_bucket(buckets.pop(layout_key(encoded)))
        for bucket in buckets.values():
            self._run_bucket(bucket)

    def _run_bucket(self, bucket: list[_Pending]) -> None:
        device = self.pipeline.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # GPU work is charged to the interval that queued it
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for p in bucket:
            p.timer.add("wait_batch", p.encoded_at, start)
        steps_bar = self.bars[1] if self.bars else None
        if steps_bar is not None:
            steps_bar.reset(total=bucket[0].encoded.schedule.num_evaluations)
            steps_bar.set_description(f"denoise x{len(bucket)}")
        try:
            finals = self.pipeline.denoise_batch([p.encoded for p in bucket],
                                                 (lambda i, n: steps_bar.update(1)) if steps_bar else None)
        except Exception as e:  # noqa: BLE001
            self._fail(bucket, e, "denoise")
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        members = [p.item.id for p in bucket]
        for p in bucket:
            p.timer.add("denoise", start, end)
        for index, (p, final) in enumerate(zip(bucket, finals)):
            p.timer.add("wait_decode", end, time.perf_counter())
            batch = {"size": len(bucket), "index": index, "members": members}
            if not self.config.write and self.config.decode_group is None:
                self._done(p, batch, None)
                continue
            mp4, _ = output_paths(self.out_dir, p.item)
            seen, start = len(p.timer.intervals), time.perf_counter()
            try:
                # overwrite: a retried request replaces its stale files; the out-dir lock keeps other runs out.
                record = self.pipeline.decode_request(p.encoded, final, mp4, self.config.crf, p.timer,
                                                      self.config.decode_group, self.config.write,
                                                      finish=self._completer(p, batch), overwrite=True)
            except Exception as e:  # noqa: BLE001
                self._fail([p], e, "decode")
                continue
            if len(p.timer.intervals) == seen:  # an overlapped decode reports seconds per stage, not intervals
                p.timer.mark("decode_mux", start, time.perf_counter())
            self._done(p, batch, record)

    def _completer(self, p: _Pending, batch: dict) -> Callable[[dict], None]:
        """What a done record holds besides the pipeline's fields; filled in just before it is committed."""
        def finish(record: dict) -> None:
            record.update(status="done", id=p.item.id, line=p.item.line, request=request_dict(p.item.request),
                          model=self.model, batch=batch, shard=list(self.config.shard),
                          peak_memory=peak_memory(self.pipeline.device), **self.extra)

        return finish

    def _done(self, p: _Pending, batch: dict, record: dict | None) -> None:
        self.summary.done.append(p.item.id)
        self.rows.append({"id": p.item.id, "status": "done", "batch": batch["members"], "intervals": p.timer.intervals})
        self._advance()
        if self.on_done is not None:
            self.on_done(p.item.id)

    def _fail(self, bucket: list[_Pending], error: Exception, stage: str) -> None:
        for p in bucket:
            self.summary.failed.append(p.item.id)
            self.rows.append({"id": p.item.id, "status": "failed", "batch": [q.item.id for q in bucket],
                              "intervals": p.timer.intervals})
            if self.config.write:
                _, json_path = output_paths(self.out_dir, p.item)
                self._write_failed_record(json_path, {
                    "status": "failed", "id": p.item.id, "line": p.item.line, "stage": stage,
                    "error": f"{type(error).__name__}: {error}",
                    "traceback": traceback.format_exception(error)[-3:], "request": request_dict(p.item.request),
                    "model": self.model, "timings_s": {k: round(v, 4) for k, v in p.timer.seconds.items()},
                    **self.extra})
            self._advance()
        self._log(f"{', '.join(p.item.id for p in bucket)} failed at {stage}: {type(error).__name__}: {error}")
        if self.config.decode_group is not None and stage in ("denoise", "decode"):
            # The other ranks of the group may be inside a collective of this stage: carrying on would pair the
            # next request's collectives with theirs. The job ends (every rank) and a rerun resumes.
            raise BatchAborted(f"{bucket[0].item.id} (line {bucket[0].item.line}) failed at {stage} on a "
                               f"multi-rank group: {error}. The job stops; a rerun skips the finished requests.")
        if self.config.fail_fast:
            raise BatchAborted(f"{bucket[0].item.id} (line {bucket[0].item.line}) failed at {stage}: {error} "
                               "(--fail-fast; a rerun skips the finished requests and retries this one).")

    def _write_failed_record(self, path: Path, record: dict) -> None:
        """A failed request's record; where even that cannot be written (a full disk), one line says so and the
        batch goes on (the rerun retries the request either way)."""
        try:
            write_json_atomic(path, record)
        except OutputError as e:
            self._log(f"{record['id']}: its failure record could not be written either: {e}")

    def _open_bars(self, total: int, skipped: int) -> None:
        if self.config.quiet or not self.config.write:
            return
        self.bars = (tqdm(total=total, initial=skipped, desc="requests", unit="clip", position=0, file=sys.stderr),
                     tqdm(total=0, desc="denoise", unit="step", position=1, leave=False, file=sys.stderr))

    def _advance(self) -> None:
        if self.bars:
            self.bars[0].update(1)
            self.bars[0].set_postfix(done=len(self.summary.done), failed=len(self.summary.failed))

    def _close_bars(self) -> None:
        if self.bars:
            self.bars[1].close()
            self.bars[0].close()

    def _log(self, message: str) -> None:
        if not self.config.write:
            return
        if self.bars:
            self.bars[0].write(f"h3trt: {message}", file=sys.stderr)
        else:
            print(f"h3trt: {message}", file=sys.stderr)


def layout_key(encoded: Encoded) -> bytes:
    """Requests with equal keys pack into the same rows (task, canvas, frames, text length, conditions) and the same
    schedule, so they can share one batched DiT evaluation."""
    lay, digest = encoded.layout, hashlib.sha256()
    digest.update(repr((encoded.schedule, lay.num_condition_video_rows, lay.num_condition_audio_rows,
                        tuple(encoded.text_embeds.shape))).encode())
    for t in (lay.position_ids, lay.token_tags, lay.video_index, lay.audio_index, lay.text_index):
        digest.update(t.cpu().contiguous().numpy().tobytes())
    return digest.digest()


def peak_memory(device: torch.device) -> dict:
    """CUDA: the allocator's peak since this batch started; CPU: the process's peak resident set since it started."""
    if device.type == "cuda":
        return {"bytes": int(torch.cuda.max_memory_allocated(device)), "what": "cuda max_memory_allocated, this batch"}
    return {"bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "what": "process peak RSS"}


def summary_line(summary: BatchSummary) -> str:
    s = summary.as_dict()
    return (f"{s['done']} done, {s['failed']} failed, {s['skipped']} skipped in {s['wall_s']:.1f} s: "
            f"{s['clips_per_hour']:.1f} clips/hour" + (f"; failed: {', '.join(s['failed_ids'])}" if s['failed'] else ""))

