"""What a generation leaves beside its MP4: the stage timer, the provenance and timing record (`ClipRecord`, with a
bundle's cold-start split, `ColdStart`; made in one place, `clip_record`, which asks each feature that served the
clip for its part through one interface, models/runner.py `RecordPart`), the finished clip not yet in place (`Clip`,
what the pipeline returns) and the commit that puts the record and the clip in place together (the job layer's); what
a failure leaves (`Failure`, a requests file's `FailureRecord`)."""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from ..engines.atomic import sha256_file
from ..media.output_files import commit, discard, write_json_file
from ..models.packing import AUDIO_SAMPLE_RATE, FPS, PackedLayout
from ..models.runner import RecordPart
from ..models.sampler import Schedule
from .prepare import Prepared


def process_started_unix() -> float | None:
    """When this process started, in Unix seconds (Linux: /proc; None elsewhere): a record's cold start begins there,
    before the interpreter imported anything."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks since boot
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def torch_bytecode() -> bool:
    """Whether this interpreter found torch's compiled bytecode (.pyc, under PYTHONPYCACHEPREFIX when set). Without
    it every process compiles each module it imports from source: an image built with PYTHONDONTWRITEBYTECODE=1 and no
    .pyc files pays that on every start."""
    import importlib.util

    return Path(importlib.util.cache_from_source(torch.__file__)).is_file()


class StageTimer:
    """Wall time per stage, synchronising the device so GPU work is charged to the stage that queued it. `spans` keeps
    each stage's first start and last end in Unix seconds, so a record shows the gaps between stages."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self.spans: dict[str, list[float]] = {}
        self.step_marks: list[float] = []  # seconds since the denoise stage began, at each step's callback
        self.step_profile: dict | None = None  # --profile-step's host-overhead report
        self.decode_tail: dict[str, float] | None = None  # decode_tail_s split into its steps (parallel_decode.py)
        self._unix_offset = time.time() - time.perf_counter()

    @contextmanager
    def __call__(self, stage: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.add(stage, start, time.perf_counter())

    def add(self, stage: str, start: float, end: float) -> None:
        """Charge [start, end] (perf_counter seconds) to `stage`; a timeline recorder also keeps the interval."""
        self.seconds[stage] = self.seconds.get(stage, 0.0) + end - start
        self.span(stage, start, end)

    def span(self, stage: str, start: float, end: float) -> None:
        """Widen `stage`'s span to cover [start, end] (perf_counter seconds) without charging time to it."""
        a, b = start + self._unix_offset, end + self._unix_offset
        old = self.spans.get(stage)
        self.spans[stage] = [min(old[0], a), max(old[1], b)] if old else [a, b]


@dataclass(frozen=True)
class ClipRecord:
    """The clip's record, clip.json beside clip.mp4 (and a server's job row): what was asked, what was written, how long
    each stage took and what served it. Its JSON is the fields below in this order, a field that is None left out,
    then `extra`. Three layers fill it in turn (each a `dataclasses.replace` of the last): the pipeline (clip_record,
    with every feature's part, FEATURE_FIELDS; then generate's wall time), the job layer (status .. peak_memory, and
    `extra`) and its commit (the MP4's sha256 and size). A record written by an earlier version may lack fields added
    since: they read as None, so a stored record reads and writes back unchanged."""

    # The request and what was written (the pipeline)
    output: str | None = None  # the MP4 as the worker named it (a server's is its work path)
    task: str | None = None  # t2va, fl2va or ref2va
    prompt: str | None = None
    seed: int | None = None
    steps: int | None = None
    evaluations: int | None = None  # DiT evaluations of the schedule
    shifts: dict | None = None  # {"video": shift, "audio": shift}
    # Where steps and each shift came from: "request", "adapter NAME" (its own schedule) or "default" (the model's)
    schedule_from: dict | None = None
    width: int | None = None
    height: int | None = None
    frames: int | None = None  # frames written
    fps: int | None = None
    audio_samples: int | None = None  # stereo samples written
    audio_sample_rate: int | None = None
    sequence_rows: int | None = None  # the packed sequence's rows
    device: str | None = None
    vae_precision: str | None = None
    torch: str | None = None  # torch.__version__
    python: str | None = None  # platform.python_version()
    timings_s: dict[str, float] | None = None  # seconds per stage (stages overlap: their sum is not wall_s)
    spans_unix: dict[str, list[float]] | None = None  # each stage's first start and last end, Unix seconds
    step_marks_s: list[float] | None = None  # seconds since the denoise began, at each step's callback
    video_decoder: str | None = None  # compiled or eager
    step_profile: dict | None = None  # --profile-step's host-overhead report
    load: ColdStart | None = None  # a bundle's cold-start split
    peak_memory_gib: dict | None = None  # CUDA: {"allocated": GiB, "reserved": GiB}
    loras: list[dict] | None = None  # the LoRAs merged into the DiT (None: none)
    adapters: list[dict] | None = None  # the resident LoRA adapters the request ran with: name, file, sha256, scale
    # the distilled checkpoint the DiT runs (models/distilled/families.py record: family, schedule, file, sha256;
    # None: none)
    distilled: dict | None = None
    # decode_tail_s as its consecutive steps (pipeline/parallel_decode.py TAIL_STEPS: the last window to the encoder,
    # x264's last frames, the AAC and x264 flushes, the faststart index, the rename, the join)
    decode_tail_steps_s: dict | None = None
    step_cache: dict | None = None  # the step cache's report (None: no cache; a batched denoise has none)
    sparse_attention: dict | None = None  # block-sparse attention's report ({"sparsity": 0.0}: dense)
    wall_s: float | None = None  # one request's wall time (None in a batched denoise: its members share it)
    # The commit
    mp4_sha256: str | None = None
    mp4_bytes: int | None = None
    # The job layer
    status: str | None = None  # "done"
    id: str | None = None  # the job's id
    request: dict | None = None  # the request as its fields (request/request.py Request.flat)
    model: str | None = None  # what served it: a checkpoint path, a bundle, embedded-tiny
    batch: dict | None = None  # {"size", "index", "members"}: the batched denoise it was part of
    peak_memory: dict | None = None  # {"bytes", "what"}
    # The serving side's and the front door's own fields, written after the others in their order: a bundle's
    # identity, the mesh, a server's job id, a requests file's line and its marker
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        clash = sorted(set(self.extra) & set(_CLIP_FIELDS))
        if clash:
            raise ValueError(f"a clip record's extra fields {clash} would replace its own fields of those names.")

    def to_json(self) -> dict:
        """The record as written: the fields that are set in their order, then `extra`."""
        fields = {name: getattr(self, name) for name in _CLIP_FIELDS}
        if self.load is not None:
            fields["load"] = self.load.to_json()
        return {**{name: value for name, value in fields.items() if value is not None}, **self.extra}

    @classmethod
    def from_json(cls, data: dict) -> ClipRecord:
        """A record as read back (a file or a row); keys it does not name go to `extra`, in their order."""
        fields = {k: v for k, v in data.items() if k in _CLIP_FIELDS}
        if fields.get("load") is not None:
            fields["load"] = ColdStart.from_json(fields["load"])
        return cls(**fields, extra={k: v for k, v in data.items() if k not in _CLIP_FIELDS})


_CLIP_FIELDS = tuple(f.name for f in dataclasses.fields(ClipRecord) if f.name != "extra")
# The record's fields that the features serving a clip write, each through its RecordPart (clip_record): the loaded
# model's merged LoRAs, resident adapters and distilled checkpoint, a request's step cache and sparse attention. A
# new feature's field goes here, in its place among the record's fields; until then it is written after them.
FEATURE_FIELDS = ("loras", "adapters", "distilled", "step_cache", "sparse_attention")


@dataclass(frozen=True)
class ColdStart:
    """A bundle's cold-start split (pipeline/loading.py `load_bundle`), the `load` of every record it serves: where
    the seconds from the process's start to a pipeline ready to denoise went. Its JSON is the fields below that are
    set, in this order (a field in `nulls` written as null), then `extra`; a split written by an earlier version may
    lack fields added since, and reads and writes back unchanged."""

    process_to_load_s: float | None = None  # process start -> this load: interpreter, imports, CUDA's first call
    engine: dict | None = None  # the engine's own split (engines/bundle.py Engine.load_report)
    engine_s: float | None = None  # Engine.load, as this loader timed it
    python_bytecode: bool | None = None  # torch's compiled bytecode was found (torch_bytecode)
    text_encoder_load_s: float | None = None  # on its thread, overlapping the weights (a tensorrt bundle: None)
    text_encoder_warmup_s: float | None = None  # its throwaway first encode, on that thread
    text_encoder_wait_s: float | None = None  # waited for it after the DiT was ready
    text_prefetched: int | None = None  # prompts its first encode made for the run's requests (their text_encode)
    loader_imports_s: float | None = None  # transformers, diffusers, Inductor, before the loader threads started
    total_s: float | None = None  # bundle on hand, ready to encode and denoise
    # The VAEs, off the cold-start path: filled in once they are ready (with_vaes), before the first clip's record
    vae_load_s: float | None = None
    all_files_checked_s: float | None = None  # every file of the bundle verified (BundleVerification.wait_all)
    components_read: dict | None = None  # what reading the components took
    nulls: tuple[str, ...] = ()  # fields measured as unknown, written as null (process_to_load_s off Linux)
    extra: dict = field(default_factory=dict)  # keys this version does not name, in their order

    def to_json(self) -> dict:
        fields = {name: getattr(self, name) for name in _COLD_START_FIELDS}
        return {**{k: v for k, v in fields.items() if v is not None or k in self.nulls}, **self.extra}

    @classmethod
    def from_json(cls, data: dict) -> ColdStart:
        return cls(**{k: v for k, v in data.items() if k in _COLD_START_FIELDS},
                   nulls=tuple(k for k, v in data.items() if k in _COLD_START_FIELDS and v is None),
                   extra={k: v for k, v in data.items() if k not in _COLD_START_FIELDS})

    def with_vaes(self, vae_load_s: float, verified: dict) -> ColdStart:
        """The split once the VAEs are loaded: their seconds and the bundle's verification report (wait_all)."""
        return ColdStart.from_json({**self.to_json(), "vae_load_s": vae_load_s, **verified})


_COLD_START_FIELDS = tuple(f.name for f in dataclasses.fields(ColdStart) if f.name not in ("nulls", "extra"))


@dataclass(frozen=True)
class Clip:
    """A generated clip, not in place yet: what the pipeline returns on the writing rank. The finished MP4 lies under
    its temporary name beside the output (atomic.temp_path: hidden, never ending in .mp4, so a crash leaves nothing
    that looks done); `record` is the pipeline's part of its record. The job layer completes the record and commits
    the pair (commit_clip), or discards the MP4."""

    mp4_temp: Path
    record: ClipRecord

    def discard(self) -> None:
        discard(self.mp4_temp)


@dataclass(frozen=True)
class Failure:
    """What a failed job's event carries besides its stage and reason (Event.error), for its front door: a server's
    error code, `h3trt run`'s exit status, a requests file's failure record."""

    error_type: str = ""  # the exception's class name, or WorkerLost / DiskFull (the job store's own ends)
    user_error: bool = False  # the request was at fault (a UserError): `h3trt run` exits 2
    traceback: list[str] = field(default_factory=list)  # the last lines of traceback.format_exception
    timings_s: dict[str, float] = field(default_factory=dict)  # seconds per stage it got through


@dataclass(frozen=True)
class FailureRecord:
    """A requests file's record of a request that failed, OUT/<id>.json where its clip's record would be (`h3trt run
    --requests`: run/batch.py). Its JSON is "status": "failed", then the fields below in this order, then
    `extra` (the serving side's: a bundle's identity)."""

    id: str
    line: int  # the request's line in the file
    stage: str  # where it failed (a job stage, or prepare / encode / worker)
    error: str  # "<stage>: <ExceptionType>: <message>"
    traceback: list[str]
    request: dict  # the request as its fields (request/request.py Request.flat)
    model: str  # what served it
    timings_s: dict[str, float]
    made_by: str  # batch_outputs.MADE_BY: what marks the file as the batch's own
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {"status": "failed", **fields, **self.extra}

    @classmethod
    def from_json(cls, data: dict) -> FailureRecord:
        if data.get("status") != "failed":
            raise ValueError(f"a failure record's status is 'failed', not {data.get('status')!r}.")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in data.items() if k in names},
                   extra={k: v for k, v in data.items() if k not in names and k != "status"})


def commit_clip(record: ClipRecord, mp4_temp: Path, output: Path, overwrite: bool = False) -> ClipRecord:
    """A clip's last step, the job layer's: the record (with the MP4's sha256 and size) and the finished MP4 renamed
    into place together, or neither (output_files.commit: no-clobber unless `overwrite`); on any failure the MP4
    under its temporary name is removed."""
    try:
        record = dataclasses.replace(record, mp4_sha256=sha256_file(mp4_temp), mp4_bytes=os.path.getsize(mp4_temp))
        json_temp = write_json_file(record_path(output), record.to_json())
    except BaseException:
        discard(mp4_temp)
        raise
    # The record first: when the MP4 appears under its name, its record is already beside it.
    commit([(json_temp, record_path(output)), (mp4_temp, output)], overwrite=overwrite)
    return record


def record_path(output: Path) -> Path:
    """The timing/provenance JSON beside an MP4: clip.mp4 -> clip.json."""
    return output.with_suffix(".json")


@dataclass(frozen=True)
class KnownFields:
    """A record part whose fields are known before the clip is made (models/runner.py RecordPart): the loaded model's
    (its merged LoRAs, its distilled checkpoint, the resident adapters as a request named them), the attention of a
    request denoised dense."""

    fields: dict

    def record_fields(self) -> dict:
        return dict(self.fields)


def feature_fields(parts: Iterable[RecordPart]) -> tuple[dict, dict]:
    """What the features that served a clip write in its record, each asked through `record_fields`: the record's own
    fields (FEATURE_FIELDS), and the fields it does not name, in order (its `extra`). A None value writes nothing; a
    field two parts write, or one of the record's that no feature writes (its prompt, its timings), is refused."""
    named: dict = {}
    extra: dict = {}
    for part in parts:
        for name, value in part.record_fields().items():
            if value is None:
                continue
            if name in named or name in extra:
                raise ValueError(f"two features write the clip record's {name!r}; each field has one writer.")
            if name in _CLIP_FIELDS and name not in FEATURE_FIELDS:
                raise ValueError(f"{type(part).__name__} writes the clip record's {name!r}, which no feature writes "
                                 f"(theirs: {list(FEATURE_FIELDS)}).")
            (named if name in FEATURE_FIELDS else extra)[name] = value
    return named, extra


def clip_record(prepared: Prepared, schedule: Schedule, layout: PackedLayout, output: Path, frames_written: int,
                audio_samples: int, timer: StageTimer, device: torch.device, video_vae,
                load_report: ColdStart | None = None, parts: Iterable[RecordPart] = ()) -> ClipRecord:
    """The pipeline's part of the record written beside an MP4, made here alone: the request, its schedule and layout,
    what was written, the serving side (`device`, the VideoVAE that decoded it, a bundle's `load_report`), and what
    each feature that served it says of itself (`parts`: feature_fields)."""
    req, geo = prepared.request, prepared.geometry
    origin = req.schedule.origin
    features, extra = feature_fields(parts)
    return ClipRecord(
        output=str(output), task=req.task, prompt=req.inputs.prompt, seed=req.inputs.seed,
        steps=req.schedule.steps, evaluations=schedule.num_evaluations,
        shifts={"video": schedule.video_shift, "audio": schedule.audio_shift},
        schedule_from=origin.to_json() if origin is not None else None,
        width=geo.width, height=geo.height, frames=frames_written, fps=FPS,
        audio_samples=int(audio_samples), audio_sample_rate=AUDIO_SAMPLE_RATE,
        sequence_rows=layout.seq_len, device=str(device), vae_precision=video_vae.precision,
        torch=torch.__version__, python=platform.python_version(),
        timings_s={k: round(v, 4) for k, v in timer.seconds.items()},
        spans_unix={k: [round(a, 4), round(b, 4)] for k, (a, b) in timer.spans.items()},
        # Host-side marks: a step's kernels are queued ahead, and each step waits for the one before (the baked
        # AdaLN lookup syncs), so the differences are the steps' device times within one step's queueing.
        step_marks_s=[round(m, 4) for m in timer.step_marks],
        video_decoder="compiled" if video_vae.tile_decoders else "eager",
        step_profile=timer.step_profile, load=load_report,
        peak_memory_gib={"allocated": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
                         "reserved": round(torch.cuda.max_memory_reserved(device) / 2**30, 3)}
        if device.type == "cuda" else None,
        decode_tail_steps_s=timer.decode_tail, **features, extra=extra,
    )


# The stages of a batch's timeline (run/timeline.py), each with its colour in the PNG (the legend's order); a stage
# not listed here is refused rather than drawn grey.
STAGE_COLOURS = {
    "text_encode": "#4c72b0",
    "condition_encode": "#64b5cd",
    "wait_batch": "#dddddd",
    "denoise": "#dd8452",
    "wait_decode": "#bbbbbb",
    "video_decode": "#55a868",
    "audio_decode": "#8172b3",
    "mux": "#c44e52",
    "decode_mux": "#937860",  # decode and mux overlapped on threads/ranks: one bar for the whole call
}


class TimelineTimer(StageTimer):
    """A StageTimer that also keeps every interval, in seconds since `origin` (a `time.perf_counter()` value)."""

    def __init__(self, device: torch.device, origin: float):
        super().__init__(device)
        self.origin = origin
        self.intervals: list[tuple[str, float, float]] = []

    def mark(self, stage: str, start: float, end: float) -> None:
        """An interval for the timeline only (its seconds are already charged elsewhere)."""
        self.intervals.append((stage, start - self.origin, end - self.origin))

    def add(self, stage: str, start: float, end: float) -> None:
        if stage not in STAGE_COLOURS:
            raise ValueError(f"Timeline stage {stage!r} is not one of {list(STAGE_COLOURS)}; add it to STAGE_COLOURS.")
        super().add(stage, start, end)
        start, end = start - self.origin, end - self.origin
        last = self.intervals[-1] if self.intervals else None
        if last is not None and last[0] == stage and start - last[2] < 1e-3:
            self.intervals[-1] = (stage, last[1], end)  # one bar for back-to-back pieces of one stage
        else:
            self.intervals.append((stage, start, end))
