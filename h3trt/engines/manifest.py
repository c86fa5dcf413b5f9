"""The bundle manifest: what was built, for what, and the sha256 of every chunk of every file (the check of a request
against it is request_check.py's, the checks of its files bundle_files.py's, the device and mesh checks of a load
load_checks.py's).

Files are hashed in chunks of `hash_chunk_bytes` (64 MiB), each with its own sha256, so that a load verifies a file
on as many cores as it reads it with, while it reads it (`weights_io.read_safetensors`), instead of one core
hashing a 38 GB file before anything is loaded. A file of up to one chunk has one digest: its plain sha256.

Every refusal says what differs and how to rebuild. A bundle holds compiled code (shared objects, Triton binaries):
load only bundles you trust. The manifest hashes its own content (`manifest_sha256`, recorded in every clip served
from it), so an edit of any field is refused; against intent rather than accident, bundles are signed (signing.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..adapters.slots import BLOCK_TARGETS
from ..errors import UserError
from ..models.checkpoint.reader import TASKS
from ..models.config import H3Config
from ..models.precision import DIT_PRECISIONS, VAE_PRECISIONS, Precision
from ..models.sparse.kernels import SPARSE_KERNELS
from ..models.sparse.plan import SparseSettings
from ..models.vsa.plan import VsaServing
from .schedules import ScheduleRecord, rungs_of, schedule_json
from .weights_io import HASH_CHUNK_BYTES, chunk_digests

# 2: the video decoder as in/block/out segments at a recorded --vae-precision; 3: the manifest carries
# manifest_sha256, the hash of its own content; 4: per-chunk sha256 ("sha256_chunks", "hash_chunk_bytes")
FORMAT_VERSION = 4
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"  # Ed25519 over manifest.json's bytes (signing.py); the one file the manifest cannot list
UNLISTED = (MANIFEST, SIGNATURE)
# What compiles a bundle's segments (h3trt/build/backends.py): tensorrt is ONNX + plans, served by tensorrt_runtime.py.
BACKENDS = ("inductor", "aoti", "tensorrt")


class BundleError(UserError):
    """A bundle that cannot serve here or cannot serve this request."""


@dataclass(frozen=True)
class MeshRecord:
    """The mesh baked into the segments: sp fixes each rank's heads (the block halves' buffer layout is static), the
    rows per rank stay symbolic; any number of replicas may serve it (a replica group is one more copy of the ranks)."""

    cfg: int
    sp: int
    heads_per_rank: int
    rows_per_rank: str = "ceil(S / sp), symbolic"  # for the reader: S is a request's packed length


@dataclass(frozen=True)
class ProfileRecord:
    """A canvas and duration a request may use (the compiled video decoder's tile shapes come from these)."""

    width: int
    height: int
    seconds: float
    num_frames: int


@dataclass(frozen=True)
class AdalnRecord:
    """baked: modulation tables for the schedule replace adaln_proj (weights/adaln_tables); else its weights are
    kept (weights/adaln_weights) and any schedule is served."""

    baked: bool
    timesteps: int | None = None  # baked only: the table rows
    adaln_weight_bytes: int | None = None  # baked only: the adaln_proj weights left out
    table_bytes: int | None = None  # baked only: the tables that replace them
    bytes_saved: int = 0  # adaln_weight_bytes - table_bytes (negative for a model as small as the tiny one)


@dataclass(frozen=True)
class VideoDecoderRecord:
    """How the compiled video decoder serves (h3trt/engines/video_decoder.py)."""

    cuda_graph: bool  # each compiled tile decoder as one CUDA graph replay (ignored on the CPU)
    inductor_options: dict = field(default_factory=dict)  # over the DiT's, what its segments compiled with
    fp8: dict | None = None  # --vae-precision fp8: how its linears execute
    segments: str = "in + block (one compiled block serves every layer) + out, per tile shape"


@dataclass(frozen=True)
class SparseRecord:
    """A bundle built with --sparse-attention: its requests' default block-sparse settings (models/sparse/plan.py; a
    request's own value wins, sparsity 0 is dense) and the kernel it serves, chosen (build/sparse_choice.py: what
    --sparse-kernel asked, each candidate's ms, those left out and why) and compiled at build and by every load."""

    sparsity: float  # the default fraction of key blocks skipped (0: dense unless a request asks)
    dense_steps: int  # the default leading evaluations kept dense
    min_seq: int  # the default shortest attention made sparse (rows)
    kernel: str  # one of models/sparse/kernels.py SPARSE_KERNELS
    block: int  # the routing block's rows the kernel runs at
    segments: str = ("block_pre + block_post around the sparse attention (sp=1: beside the fused block, which dense "
                     "evaluations keep), reading the block's weights")
    tile: str | None = None  # the fp8 kernel's tile configuration (models/sparse/fp8_triton.py); else None
    requested: str = "auto"
    measured_ms: dict = field(default_factory=dict)
    unavailable: dict = field(default_factory=dict)

    def settings(self) -> SparseSettings:
        return SparseSettings(self.sparsity, self.dense_steps, self.min_seq)


@dataclass(frozen=True)
class AdapterSlotsRecord:
    """--lora-slots N --lora-max-rank R: N slots of rank <= R on `targets` of every block; the banks are not stored."""

    slots: int  # N; also K, the adapters one evaluation carries (fewer are padded with scale 0: build/segments.py)
    max_rank: int  # R
    targets: tuple[str, ...]  # the block linears adapted ("attn.qkv_proj", ..., "adaln_proj.linear")


@dataclass(frozen=True)
class FileRecord:
    """One bundle file: its size and the sha256 of each `hash_chunk_bytes` chunk (one digest up to one chunk)."""

    bytes: int
    sha256_chunks: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    """A bundle's manifest.json, typed: parsed and validated once (`from_dict`, through `parse_manifest`), read by
    attribute everywhere else; the builder constructs one and `write_manifest` serializes it (`to_dict`, the inverse
    of `from_dict`). `raw` is the JSON object as read or written: the hashes (manifest_sha256, files_sha256) and
    `h3trt inspect` are computed from it."""

    backend: str  # one of BACKENDS
    precision: Precision  # one of DIT_PRECISIONS
    task: str  # the partition it was built from (t2va/fl2va: FL2VA, ref2va: Ref2VA)
    tasks: tuple[str, ...]  # the tasks it serves
    model_config: H3Config
    checkpoint: dict  # path and sha256 of the checkpoint it was built from
    schedules: tuple[ScheduleRecord, ...]  # what its AdaLN tables serve (schedules.py); the first: the default
    adaln: AdalnRecord
    profiles: tuple[ProfileRecord, ...]
    mesh: MeshRecord
    arch: str  # sm_90, cpu-x86_64, or a tensorrt bundle's comma-separated plan targets
    device: str  # what it was built on (cuda, cpu): a run's default device type
    versions: dict  # torch, cuda, triton, python of the build
    segments: dict  # segment name -> its entry (artifact, inputs, weights, outputs, dynamic: backend-specific)
    weight_bytes: dict
    build_timings_s: dict
    tiny: bool  # built from the embedded tiny model (random weights)
    quant: dict | None  # fp8/nvfp4: the recipe, the calibration record, which segment serves each layer
    attention: dict | None  # precision -> the attention kernel chosen at build time
    vae_precision: Precision  # one of VAE_PRECISIONS: the compiled video decoder's
    video_decoder: VideoDecoderRecord
    loras: tuple[dict, ...]  # the LoRAs merged at build time
    tensorrt: dict | None  # tensorrt bundles: flavour, version, targets
    sparse: SparseRecord | None = None  # --sparse-attention: the default settings and the kernel; None: not built so
    lora_slots: AdapterSlotsRecord | None = None  # --lora-slots: per-request adapters; None (older bundles too): none
    vsa: VsaServing | None = None  # a FastH3-VSA bundle: its VSA settings and kernel; None: no VSA model
    # --distilled: the family, its schedule and tasks, the file and its sha256 (models/distilled/families.py
    # Distilled.record)
    distilled: dict | None = None
    # Filled by write_manifest, from the files and the content:
    files: dict[str, FileRecord] = field(default_factory=dict)
    hash_chunk_bytes: int = HASH_CHUNK_BYTES
    manifest_sha256: str = ""
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def schedule(self) -> ScheduleRecord:
        """The default schedule: a request that states none runs it."""
        return self.schedules[0]

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    @property
    def video_decoder_cuda_graph(self) -> bool:
        return self.video_decoder.cuda_graph

    def to_dict(self) -> dict:
        """The manifest.json object: every field, as `from_dict` reads it back (None-valued record fields and an
        absent tensorrt record are left out)."""
        data = {"format_version": FORMAT_VERSION, **{f: getattr(self, f) for f in _PLAIN_FIELDS}}
        data.update(
            tasks=list(self.tasks), model_config=self.model_config.to_dict(), schedule=schedule_json(self.schedule),
            adaln={k: v for k, v in asdict(self.adaln).items() if v is not None},
            profiles=[asdict(p) for p in self.profiles], mesh=asdict(self.mesh), loras=list(self.loras),
            video_decoder=asdict(self.video_decoder),
            files={rel: {"bytes": f.bytes, "sha256_chunks": list(f.sha256_chunks)} for rel, f in self.files.items()})
        if self.tensorrt is not None:
            data["tensorrt"] = self.tensorrt
        if self.sparse is not None:
            data["sparse"] = asdict(self.sparse)
        if self.lora_slots is not None:
            data["lora_slots"] = asdict(self.lora_slots)
        if self.vsa is not None:
            data["vsa"] = self.vsa.to_dict()
        if self.distilled is not None:
            data["distilled"] = self.distilled
        if len(self.schedules) > 1:
            data["schedules"] = [schedule_json(s) for s in self.schedules]
        return data

    @classmethod
    def from_dict(cls, data: dict, where: Path | str = MANIFEST) -> "Manifest":
        """The typed manifest, refusing a missing field or one of the wrong type with a message that names it."""
        top = _Fields(data, str(where))
        adaln, mesh = top.sub("adaln"), top.sub("mesh")
        # schedules.py: "schedules" where a bundle serves several, else its one "schedule"
        schedules = ([top.item("schedules", i, s) for i, s in enumerate(top.get("schedules", list))]
                     if data.get("schedules") else [top.sub("schedule")])
        decoder = top.sub("video_decoder")
        files = top.get("files", dict)
        profiles = top.get("profiles", list)
        if not profiles:
            raise top.error("profiles", "a non-empty list")
        manifest = cls(
            raw=data, backend=top.choice("backend", BACKENDS),
            precision=Precision(top.choice("precision", DIT_PRECISIONS)),
            task=top.choice("task", TASKS), tasks=tuple(top.strings("tasks", TASKS)),
            model_config=top.model_config("model_config"), checkpoint=top.get("checkpoint", dict),
            schedules=tuple(ScheduleRecord(s.get("steps", int), s.get("video_shift", float),
                                           s.get("audio_shift", float),
                                           rungs_of(s.get("rungs", list, optional=True))) for s in schedules),
            adaln=AdalnRecord(adaln.get("baked", bool), *(adaln.get(k, int, optional=True) for k in (
                "timesteps", "adaln_weight_bytes", "table_bytes")), adaln.get("bytes_saved", int, optional=True) or 0),
            profiles=tuple(ProfileRecord(p.get("width", int), p.get("height", int), p.get("seconds", float),
                                         p.get("num_frames", int))
                           for p in (top.item("profiles", i, entry) for i, entry in enumerate(profiles))),
            mesh=MeshRecord(mesh.positive("cfg"), mesh.positive("sp"), mesh.positive("heads_per_rank"),
                            mesh.get("rows_per_rank", str, optional=True) or MeshRecord.rows_per_rank),
            arch=top.get("arch", str), device=top.get("device", str), versions=top.get("versions", dict),
            segments=top.get("segments", dict), weight_bytes=top.get("weight_bytes", dict),
            build_timings_s=top.get("build_timings_s", dict), tiny=top.get("tiny", bool),
            quant=top.get("quant", dict, optional=True), attention=top.get("attention", dict, optional=True),
            vae_precision=Precision(top.choice("vae_precision", VAE_PRECISIONS)),
            video_decoder=VideoDecoderRecord(
                decoder.get("cuda_graph", bool), decoder.get("inductor_options", dict, optional=True) or {},
                decoder.get("fp8", dict, optional=True),
                decoder.get("segments", str, optional=True) or VideoDecoderRecord.segments),
            loras=tuple(top.get("loras", list, optional=True) or ()),
            tensorrt=top.get("tensorrt", dict, optional=True), sparse=_sparse_record(top),
            lora_slots=_lora_slots_record(top.sub("lora_slots")) if top.data.get("lora_slots") else None,
            vsa=_vsa_record(top) if top.data.get("vsa") is not None else None,
            distilled=top.get("distilled", dict, optional=True),
            files={rel: FileRecord(meta["bytes"], tuple(meta["sha256_chunks"])) for rel, meta in files.items()},
            hash_chunk_bytes=top.positive("hash_chunk_bytes"), manifest_sha256=top.get("manifest_sha256", str))
        gate = manifest.model_config.vsa_gate  # a distilled record's vsa (the file's gates) needs the gate too
        if (manifest.vsa is not None) != gate or (not gate and (manifest.distilled or {}).get("vsa") is not None):
            raise top.error("vsa", "present exactly when model_config.vsa_gate is true (a FastH3-VSA bundle)")
        if manifest.backend == "tensorrt" and manifest.tensorrt is None:
            raise top.error("tensorrt", "an object (a tensorrt bundle records its plans' flavour and targets)")
        return manifest


def _sparse_record(top: "_Fields") -> SparseRecord | None:
    if top.data.get("sparse") is None:
        return None
    sparse = top.sub("sparse")
    record = SparseRecord(sparse.get("sparsity", float), sparse.get("dense_steps", int), sparse.positive("min_seq"),
                          sparse.choice("kernel", SPARSE_KERNELS), sparse.positive("block"),
                          sparse.get("segments", str, optional=True) or SparseRecord.segments,
                          sparse.get("tile", str, optional=True), sparse.get("requested", str, optional=True) or "auto",
                          *(sparse.get(k, dict, optional=True) or {} for k in ("measured_ms", "unavailable")))
    if not 0.0 <= record.sparsity < 1.0 or record.dense_steps < 0:
        raise sparse.error("sparsity", "a fraction in [0, 1) with dense_steps >= 0")
    return record


def _vsa_record(top: "_Fields") -> VsaServing:
    try:
        return VsaServing.from_dict(top.get("vsa", dict))
    except ValueError as e:
        raise top.error("vsa", f"a FastH3-VSA bundle's settings and kernel ({e})") from None


def _lora_slots_record(r: "_Fields") -> AdapterSlotsRecord:
    return AdapterSlotsRecord(r.positive("slots"), r.positive("max_rank"), tuple(r.strings("targets", BLOCK_TARGETS)))


# Manifest fields written to JSON as they are (the others: records, tuples and the model config, in to_dict).
_PLAIN_FIELDS = ("backend", "precision", "task", "checkpoint", "arch", "device", "versions", "segments", "weight_bytes",
                 "build_timings_s", "tiny", "quant", "attention", "vae_precision", "hash_chunk_bytes",
                 "manifest_sha256")
_KINDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object",
          list: "a list"}


class _Fields:
    """One JSON object of a manifest, read field by field: every refusal names the field and what it must be."""

    def __init__(self, data, where: str, prefix: str = ""):
        self.data, self.where, self.prefix = data, where, prefix

    def error(self, key: str, what: str) -> BundleError:
        value = self.data.get(key, "<missing>") if isinstance(self.data, dict) else "<missing>"
        got = "it is missing" if value == "<missing>" else f"got {json.dumps(value)[:80]}"
        return BundleError(f"{self.where}: field {self.prefix + key!r} must be {what}, {got}. The manifest is "
                           "malformed (not written by this h3trt's `h3trt build`): re-copy the bundle or rebuild it.")

    def get(self, key: str, kind: type, optional: bool = False):
        value = self.data.get(key)
        if value is None and optional:
            return None
        # JSON has one number type: an integer is a valid float field; true/false is never a number.
        number = not isinstance(value, bool) or kind is bool
        if not (number and isinstance(value, (int, float) if kind is float else kind)):
            raise self.error(key, _KINDS[kind] + (" or null" if optional else ""))
        return float(value) if kind is float else value

    def positive(self, key: str) -> int:
        value = self.get(key, int)
        if value < 1:
            raise self.error(key, "an integer >= 1")
        return value

    def choice(self, key: str, choices: tuple[str, ...]) -> str:
        value = self.data.get(key)
        if value not in choices:
            raise self.error(key, f"one of {list(choices)}")
        return value

    def strings(self, key: str, choices: tuple[str, ...]) -> list[str]:
        values = self.get(key, list)
        if not values or any(v not in choices for v in values):
            raise self.error(key, f"a non-empty list of {list(choices)}")
        return values

    def sub(self, key: str) -> "_Fields":
        return _Fields(self.get(key, dict), self.where, f"{self.prefix}{key}.")

    def item(self, key: str, index: int, value) -> "_Fields":
        if not isinstance(value, dict):
            raise BundleError(f"{self.where}: field {self.prefix}{key}[{index}] must be an object, got "
                              f"{json.dumps(value)[:80]}. Re-copy the bundle or rebuild it.")
        return _Fields(value, self.where, f"{self.prefix}{key}[{index}].")

    def model_config(self, key: str) -> H3Config:
        try:
            return H3Config.from_dict(self.get(key, dict))
        except (TypeError, ValueError) as e:
            raise BundleError(f"{self.where}: field {self.prefix + key!r} is not a model config ({e}). Re-copy the "
                              "bundle or rebuild it.") from None


def hash_threads() -> int:
    """Threads that read and hash bundle files: sha256 runs at 1-2 GB/s a core, so one per core, up to 16."""
    return max(1, min(16, os.cpu_count() or 1))


def hash_tree(root: Path, chunk_bytes: int = HASH_CHUNK_BYTES) -> dict[str, dict]:
    """{relative path: {bytes, sha256_chunks}} for every file under `root` except the manifest and its signature."""
    paths = sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() not in UNLISTED)
    with ThreadPoolExecutor(hash_threads()) as pool:
        digests = [chunk_digests(p, chunk_bytes, pool) for p in paths]
    return {p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "sha256_chunks": d}
            for p, d in zip(paths, digests)}




def content_sha256(data: dict) -> str:
    """sha256 of the manifest's content (every field but manifest_sha256 itself, as canonical JSON)."""
    body = {k: v for k, v in data.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(root: Path, manifest: Manifest) -> Manifest:
    """Hash every file under `root` into `manifest`, serialize it (`to_dict`) as ROOT/manifest.json, and return it as
    read back from those bytes (`parse_manifest`): a manifest this reader would refuse is never written."""
    files = {rel: FileRecord(meta["bytes"], tuple(meta["sha256_chunks"])) for rel, meta in hash_tree(root).items()}
    data = replace(manifest, files=files, hash_chunk_bytes=HASH_CHUNK_BYTES).to_dict()
    data["manifest_sha256"] = content_sha256(data)
    text = json.dumps(data, indent=1).encode()
    written = parse_manifest(text, root)
    tmp = root / f".{MANIFEST}.partial"
    tmp.write_bytes(text)
    os.replace(tmp, root / MANIFEST)
    return written


def read_manifest(root: Path) -> "Manifest":
    path = Path(root) / MANIFEST
    if not path.exists():
        raise BundleError(f"{root} is not an h3trt bundle (no {MANIFEST}); build one with `h3trt build`.")
    return parse_manifest(path.read_bytes(), root)


def parse_manifest(data: bytes, root: Path) -> "Manifest":
    """manifest.json's bytes -> the manifest, refusing a corrupt file, another format, any edited field and any field
    of the wrong type. The one place a manifest is read (read_manifest, signing.read_trusted_manifest)."""
    path = Path(root) / MANIFEST
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path} is corrupted ({e}); re-copy the bundle or rebuild it.") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise BundleError(f"{root} is bundle format {version!r}; this h3trt reads format "
                          f"{FORMAT_VERSION}. Rebuild it with this h3trt's `h3trt build`.")
    if manifest.get("manifest_sha256") != content_sha256(manifest):
        raise BundleError(f"{path} was changed after the build (its content no longer hashes to its "
                          "manifest_sha256); a manifest is never edited by hand. Re-copy the bundle or rebuild it.")
    files = manifest.get("files")
    malformed = [rel for rel, meta in (files.items() if isinstance(files, dict) else [])
                 if not (isinstance(meta, dict) and isinstance(meta.get("bytes"), int)
                         and isinstance(meta.get("sha256_chunks"), list))]
    if not isinstance(files, dict) or malformed:
        raise BundleError(f"{path} lists {'no files' if not isinstance(files, dict) else malformed[0]} without the "
                          f"format {FORMAT_VERSION} fields (bytes, sha256_chunks); re-copy the bundle or rebuild it.")
    return Manifest.from_dict(manifest, path)


def bundle_identity(manifest: Manifest) -> dict:
    """What a record says about the bundle that served it: manifest_sha256 hashes the whole manifest (every field,
    the file table included); files_sha256 the file table alone."""
    files = hashlib.sha256(json.dumps(manifest.raw["files"], sort_keys=True).encode()).hexdigest()
    return {"backend": manifest.backend, "precision": manifest.precision, "files_sha256": files,
            "manifest_sha256": manifest.manifest_sha256}
