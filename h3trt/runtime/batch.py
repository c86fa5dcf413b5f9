"""Batch generation: a JSONL file of requests in, OUT/<id>.mp4 and OUT/<id>.json per request out, resumable.

  1. parse: every line is validated (JSON, keys, types, task against its inputs, then `prepare`: files readable,
     canvas and duration allowed) before any model loads; every error names its line, all errors are reported at once
  2. plan: requests whose outputs exist and verify (record says done, same request, MP4 hash matches) are skipped;
     the rest are grouped by (task, canvas, frames, schedule), in file order
  3. run: within a group, requests are encoded one at a time into buckets by packed layout (same text length); a full
     bucket (--max-batch) or the group's end is denoised as ONE batch along the batch dimension, then each member
     decodes and writes. A failing request is recorded and the run goes on (unless fail_fast)
  4. record: OUT/<id>.json (status done or failed), the timeline (timeline.py) and the summary

On a mesh (`--gpus N` or torchrun; `run_batch_on_mesh` below, ranks set up as in h3trt/runtime/serve.py) each
replica group calls `run_batch` with `shard=(group, groups)`: group g takes requests g, g + groups, ... Every rank
of a group runs the same plan (it is computed before the first collective) and enters every batched denoise and every
tile-parallel decode together; only the group's first rank (`write=True`) writes. A failure inside denoise or decode
there ends the job (a rerun resumes).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import resource
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..engines.guard import no_compile
from ..engines.manifest import bundle_identity, read_manifest, sha256_file
from ..engines.signing import key_fingerprint, load_public_key, read_trusted_manifest
from ..models.checkpoint import locate_transformer
from ..models.config import H3Config
from ..models.packing import FPS
from ..models.tiny import TINY_HEIGHT, TINY_REFERENCE_SHORT_EDGE, TINY_WIDTH, ensure_tiny_checkpoint
from ..parallel.launch import init_rank, init_torchrun_rank, launch, torchrun_rank
from ..parallel.mesh import build_mesh, resolve_mesh
from .files import (BatchLock, OutputError, estimated_clip_bytes, preflight_out_dir, remove_leftovers,
                    remove_own_temps, write_json_atomic)
from .pipeline import CanvasDefaults, Encoded, H3Pipeline, Request, check_prompt_tokens, prepare, request_dict
from .serve import Job, launch_gpus, load_rank_pipeline, rank_device
from .timeline import TimelineTimer, write_timeline

TASKS = ("t2va", "fl2va", "ref2va")
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
REQUIRED_KEYS = ("id", "task", "prompt")
OPTIONAL_KEYS = ("image", "last_image", "refs", "seed", "steps", "resolution", "duration", "video_shift",
                 "audio_shift")
MAX_LISTED_ERRORS = 20  # a file with hundreds of bad lines lists the first 20 and counts the rest


class BatchFileError(ValueError):
    """A requests file that cannot be run as a whole; the message lists every bad line."""


class BatchAborted(RuntimeError):
    """--fail-fast: a request failed, so the run stopped after recording it."""


@dataclass(frozen=True)
class BatchItem:
    """One validated line of a requests file."""

    id: str
    line: int  # 1-based line number in the file
    request: Request
    key: tuple  # (task, height, width, frames, steps, video_shift, audio_shift): requests that may share a batch


@dataclass(frozen=True)
class BatchConfig:
    """How a batch run writes and groups its work."""

    out_dir: Path
    max_batch: int = 1  # requests of one layout denoised together along the batch dimension
    fail_fast: bool = False  # stop at the first failed request (it is still recorded)
    crf: int = 18
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
# 1. Parse


def parse_requests(path: Path, canvas: CanvasDefaults, default_steps: int = 50) -> list[BatchItem]:
    """Every line of a JSONL requests file, validated; raises BatchFileError listing every bad line. A line without
    "steps" takes `default_steps` (a bundle's baked schedule, else 50)."""
    path = Path(path)
    if not path.is_file():
        raise BatchFileError(f"{path}: no such requests file.")
    items, errors, seen = [], [], {}
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            errors.append(f"{path}:{number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                          "save the file as UTF-8.")
            continue
        if not text.strip():
            continue
        try:
            item = _parse_line(text, number, path.parent, canvas, default_steps)
        except (ValueError, OSError) as e:
            errors.append(f"{path}:{number}: {' '.join(str(e).split())}")
            continue
        if item.id in seen:
            errors.append(f"{path}:{number}: duplicate id {item.id!r} (first on line {seen[item.id]}); ids name the "
                          "output files, so each must be unique.")
            continue
        seen[item.id] = number
        items.append(item)
    if errors:
        listed = errors[:MAX_LISTED_ERRORS] + ([f"and {len(errors) - MAX_LISTED_ERRORS} more"]
                                               if len(errors) > MAX_LISTED_ERRORS else [])
        raise BatchFileError(f"{path}: {len(errors)} bad line(s), nothing was run: " + "; ".join(listed))
    if not items:
        raise BatchFileError(f"{path}: no requests (one JSON object per line).")
    return items


def _parse_line(text: str, number: int, base: Path, canvas: CanvasDefaults, default_steps: int = 50) -> BatchItem:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno}).") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}.")
    missing = [k for k in REQUIRED_KEYS if k not in data]
    unknown = sorted(set(data) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if missing or unknown:
        raise ValueError(" ".join(filter(None, [f"missing {missing}." if missing else "",
                                                f"unknown key(s) {unknown}; allowed: "
                                                f"{list(REQUIRED_KEYS + OPTIONAL_KEYS)}." if unknown else ""])))
    rid = _typed(data, "id", str)
    if not ID_PATTERN.fullmatch(rid) or rid.startswith("timeline"):
        raise ValueError(f"id {rid!r} must be 1-128 of [A-Za-z0-9._-], start with a letter or digit (it names "
                         "OUT/<id>.mp4) and not start with 'timeline' (the run's own files).")
    task = _typed(data, "task", str)
    if task not in TASKS:
        raise ValueError(f"task {task!r} must be one of {list(TASKS)}.")
    image, last_image = (_path(data, k, base) for k in ("image", "last_image"))
    refs = data.get("refs", [])
    if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
        raise ValueError("refs must be a list of file paths.")
    refs = tuple(_resolve(r, base) for r in refs)
    implied = "ref2va" if refs else "fl2va" if (image or last_image) else "t2va"
    if implied != task:
        needs = {"t2va": "no image, last_image or refs", "fl2va": "image and/or last_image, no refs",
                 "ref2va": "refs (and no image/last_image)"}
        raise ValueError(f"task {task!r} takes {needs[task]}, but the line's inputs make it {implied}.")
    width = height = None
    if "resolution" in data:
        match = re.fullmatch(r"(\d+)x(\d+)", str(data["resolution"]))
        if not match:
            raise ValueError(f"resolution must be 'WIDTHxHEIGHT' such as '1344x768', got {data['resolution']!r}.")
        width, height = int(match[1]), int(match[2])
    request = Request(_typed(data, "prompt", str), image, last_image, refs, _typed(data, "seed", int, 42),
                      _typed(data, "steps", int, default_steps), width, height,
                      float(_typed(data, "duration", (int, float), 5.0)),
                      _optional_float(data, "video_shift"), _optional_float(data, "audio_shift"))
    prepared = prepare(request, canvas)  # inputs readable, canvas and duration allowed; dropped, re-read at run time
    geo = prepared.geometry
    key = (task, geo.height, geo.width, geo.num_frames, request.steps, request.video_shift, request.audio_shift)
    return BatchItem(rid, number, request, key)


def _typed(data: dict, key: str, kind, default=None):
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, kind):
        name = {str: "a string", int: "an integer"}.get(kind, "a number")
        raise ValueError(f"{key} must be {name}, got {json.dumps(value)}.")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key} must be finite, got {value}.")
    return value


def _optional_float(data: dict, key: str) -> float | None:
    return None if data.get(key) is None else float(_typed(data, key, (int, float)))


def _path(data: dict, key: str, base: Path) -> Path | None:
    return None if data.get(key) is None else _resolve(_typed(data, key, str), base)


def _resolve(value: str, base: Path) -> Path:
    """Relative paths are relative to the requests file, so a batch folder can move as a whole."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def check_bundle_batch(manifest: dict, max_batch: int) -> None:
    """Refuse --max-batch > 1 on a bundle whose DiT segments were compiled for batch 1: a segment's first activation
    ([B, ...]) without a dynamic dimension 0 has its batch size baked into the artifact."""
    if max_batch == 1:
        return
    static = sorted(name for name, entry in manifest["segments"].items()
                    if not name.startswith(("video_decoder", "audio_decoder"))
                    and "0" not in {str(d) for d in entry.get("dynamic", {}).get(entry["inputs"][0], {})})
    if static:
        raise ValueError(f"--max-batch {max_batch}: this bundle's DiT segments {static} are compiled for batch 1 (the "
                         "batch dimension is static in the artifacts); pass --max-batch 1 with --engine, or serve "
                         "batches from --model (eager).")


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


# ----------------------------------------------------------------------------------------------------------------------
# On a mesh: each replica group runs `run_batch` over its share of the file


def run_batch_on_mesh(args, items, config, root, manifest, device, canvas, model: str, extra: dict) -> int:
    """`h3trt run --requests` on a mesh: each replica group runs `run_batch` over its share of the file."""
    torchrun = torchrun_rank()
    if torchrun is not None and args.gpus > 1:
        raise ValueError(f"Under torchrun the world is torchrun's ({torchrun[1]} ranks); leave out --gpus.")
    world = torchrun[1] if torchrun else args.gpus
    task = "ref2va" if items[0].key[0] == "ref2va" else "t2va"
    heads = (H3Config.from_dict(manifest["model_config"]) if manifest else locate_transformer(root, task).config).num_heads
    mesh = resolve_mesh(world, heads, manifest["mesh"] if manifest else None, args.cfg, args.sp, args.replicas)
    if mesh.cfg == 2:
        raise ValueError("--cfg 2 splits guidance branches, and batch files carry no guidance; use --cfg 1.")
    job = Job(str(root), manifest is not None, task, "cuda" if str(device).startswith("cuda") else "cpu", mesh,
              canvas=canvas, model_name=model, record_extra=extra, vae_precision=args.vae_precision,
              loras=tuple(args.lora), trust=str(args.trust) if args.trust is not None else None)
    if torchrun is not None:
        rank, world, local_rank = init_torchrun_rank(job.device_type)
        failed = serve_batch_rank(rank, world, local_rank, job, heads, items, config)
        dist.barrier()
        dist.destroy_process_group()
        return 1 if failed else 0
    with tempfile.TemporaryDirectory(prefix="h3trt-batch-") as tmp:
        try:
            launch(serve_batch_launched, world, (job, heads, items, config, tmp),
                   gpus=launch_gpus(job.device_type, world))
        except BaseException:  # Ctrl-C or a failed rank: every rank was stopped; remove what they were writing
            remove_leftovers(config.out_dir)
            raise
        failed = sum(int(f.read_text()) for f in Path(tmp).glob("failed-*"))
    print(f"{config.out_dir}: batch on replica({mesh.replica}) x cfg({mesh.cfg}) x sp({mesh.sp}): {failed} failed "
          f"(per-request records in {config.out_dir})")
    return 1 if failed else 0


def serve_batch_rank(rank: int, world: int, local_rank: int, job: Job, num_heads: int, items, config) -> int:
    """One rank of a mesh batch run; returns the failures its replica group recorded (0 on non-writing ranks)."""
    par = build_mesh(job.mesh, job.device_type, world, num_heads)
    pipeline = load_rank_pipeline(job, par, rank_device(job.device_type))
    mine = replace(config, shard=(par.replica_index, job.mesh.replica), write=par.writes,
                   decode_group=par.decode_group, quiet=config.quiet or not par.writes)
    summary = run_batch(pipeline, items, mine, job.model_name, job.record_extra)
    if par.writes:
        print(f"replica group {par.replica_index}: {summary_line(summary)}")
        return len(summary.failed)
    return 0


def serve_batch_launched(rank: int, world: int, store: str, job: Job, num_heads: int, items, config, tmp: str) -> None:
    init_rank(rank, world, store, job.device_type)
    Path(tmp, f"failed-{rank}").write_text(str(serve_batch_rank(rank, world, rank, job, num_heads, items, config)))


# ----------------------------------------------------------------------------------------------------------------------
# `h3trt run --requests FILE --out-dir DIR`


def engine_manifest(args) -> dict:
    """--engine's manifest, read before anything else: with --trust only if it carries that key's signature (every
    file is then checked against it when the bundle loads, before any of its code runs)."""
    if args.trust is not None:
        return read_trusted_manifest(args.engine, args.trust)
    return read_manifest(args.engine)


def served_identity(manifest: dict, args) -> dict:
    """What a record says about the bundle that served it, with the key that vouched for it under --trust."""
    identity = bundle_identity(manifest)
    if args.trust is not None:
        identity["signed_by"] = key_fingerprint(load_public_key(args.trust))
    return identity


def run_requests(args) -> int:
    """The CLI's batch mode: validate the whole file, load the model once, run; 0 if every request is done."""
    single = [flag for flag, value in (("--prompt", args.prompt), ("--output", args.output), ("--image", args.image),
                                       ("--last-image", args.last_image), ("--ref", args.ref)) if value]
    if single:
        raise ValueError(f"--requests takes every request from its file; drop {' '.join(single)}.")
    if args.out_dir is None:
        raise ValueError("--requests needs --out-dir DIR (OUT/<id>.mp4 and OUT/<id>.json per request).")
    if args.cache is not None:
        raise ValueError("--cache decides per request, and a batch run shares one DiT evaluation per step across "
                         "requests; run cached requests one at a time (h3trt run --prompt ... --cache ...).")
    if args.lora and args.engine is not None:
        raise ValueError(f"--lora applies to --model runs; the bundle {args.engine} was compiled with the LoRAs its "
                         "manifest lists. Rebuild it with h3trt build --lora FILE[:SCALE].")
    if args.trust is not None and args.engine is None:
        raise ValueError("--trust checks a bundle's signature; pass it with --engine DIR.")
    manifest = None
    if args.engine is not None:
        manifest = engine_manifest(args)
        check_bundle_batch(manifest, args.max_batch)
    tiny = manifest["tiny"] if manifest else args.model is None
    canvas = (CanvasDefaults(short_edge=TINY_HEIGHT, max_pixels=TINY_WIDTH * TINY_HEIGHT,
                             reference_short_edge=TINY_REFERENCE_SHORT_EDGE) if tiny else CanvasDefaults())
    config = BatchConfig(args.out_dir, args.max_batch, args.fail_fast, args.crf, quiet=args.quiet)
    default_steps = manifest["schedule"]["steps"] if manifest else 50  # a bundle's baked schedule is its default
    items = parse_requests(args.requests, canvas, default_steps)  # every line checked before any model loads
    tasks = {"ref2va" if i.key[0] == "ref2va" else "t2va" for i in items}
    if manifest is None and len(tasks) > 1:
        raise ValueError(f"{args.requests} mixes ref2va with t2va/fl2va requests, which use different checkpoint "
                         "partitions (Ref2VA/ and FL2VA/); split the file and run each part.")
    device = args.device or (manifest["device"].split(":")[0] if manifest else
                             ("cuda" if torch.cuda.is_available() else "cpu"))
    root = args.engine if manifest else (ensure_tiny_checkpoint() if tiny else args.model)
    component_root = root if manifest else locate_transformer(root, items[0].key[0]).component_root
    try:
        check_prompt_tokens(component_root, [(f"{args.requests}:{i.line}: the prompt", i.request.prompt)
                                             for i in items])
    except ValueError as e:
        raise BatchFileError(f"{e} Nothing was run.") from None
    # Before any model loads: the out-dir is a writable folder with room for its largest clip, and no other batch
    # writes it (under torchrun, rank 0 holds the lock for the job).
    preflight_out_dir(args.out_dir, max(estimated_clip_bytes(i.key[2], i.key[1], i.key[3], FPS, args.crf)
                                        for i in items))
    torchrun = torchrun_rank()
    lock = BatchLock(args.out_dir) if torchrun is None or torchrun[0] == 0 else nullcontext()
    try:
        with lock:
            return _run_requests_locked(args, items, config, manifest, tiny, root, canvas, device, torchrun)
    except KeyboardInterrupt:
        remove_own_temps()
        done = [i.id for i in items if finished(config.out_dir, i)]
        listed = ", ".join(done[:10]) + (f" and {len(done) - 10} more" if len(done) > 10 else "")
        print(f"h3trt: interrupted: {len(done)} of {len(items)} requests are done in {args.out_dir}"
              f"{' (' + listed + ')' if done else ''}, each with its record; the others left no files. Rerun the "
              "same command to finish them.", file=sys.stderr)
        return 130


def _run_requests_locked(args, items, config, manifest, tiny, root, canvas, device, torchrun) -> int:
    if args.gpus > 1 or torchrun is not None:
        model = str(args.engine) if manifest else ("embedded-tiny" if tiny else str(root))
        extra = {"bundle": served_identity(manifest, args)} if manifest else {}
        return run_batch_on_mesh(args, items, config, root, manifest, device, canvas, model, extra)
    if manifest is not None:
        pipeline = H3Pipeline.load_engine(args.engine, device, canvas, vae_precision=args.vae_precision,
                                          trust=args.trust)
        extra = {"bundle": served_identity(manifest, args)}
        model, serving = str(args.engine), no_compile()
    else:
        if tiny:
            print("h3trt: using the embedded tiny default model (random weights): every clip is noise. Pass --model "
                  "PATH for real MiniMax-H3 weights.", file=sys.stderr)
        pipeline = H3Pipeline.load(root, items[0].key[0], device, canvas, args.vae_precision,
                                   loras=tuple(args.lora))
        extra, model, serving = {}, "embedded-tiny" if tiny else str(root), nullcontext()
    try:
        with serving:
            summary = run_batch(pipeline, items, config, model, extra)
    except BatchAborted as e:
        print(f"h3trt: stopped: {e}", file=sys.stderr)
        return 1
    print(f"{args.out_dir}: {summary_line(summary)}")
    return 1 if summary.failed else 0
