"""What serves a job, in three parts, each resolved once from its own flags before any model loads (cli/commands.py
`entry_from_args` composes them; h3trt eval, the benches and the tests make them in code):

  - `ModelSource`: --engine DIR (a bundle, its manifest read once, under --trust only if signed), --model PATH (a
    checkpoint folder) or neither (the embedded tiny model); --vae-precision and --lora (merged into an eager DiT, a
    bundle's held in its slots on every request). It knows the canvas defaults, the default schedule and sparsity,
    what a record says served it, and where each task's transformer and components are (located once per task)
  - `Launch`: where and how ranks start: --device, --gpus (spawned), torchrun's rank and world, --cfg/--sp/--replicas
  - `AdapterConfig`: the resident LoRA adapters requests pick by name (--adapter, --lora-dir) and their slots
    (--lora-slots, --lora-max-rank), checked against the source (a bundle's slots, less its pinned --lora files)

`Entry` holds the three: `h3trt run` (one clip or a --requests batch, on one process or a mesh), `h3trt serve` and
`h3trt eval` (both sides) load through one, so the "bundle or tiny or checkpoint" decisions are written once.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from ..adapters.catalog import AdapterCatalog
from ..adapters.checks import NO_LORA_SLOTS, check_bundle_specs, check_specs
from ..adapters.memory import check_slots_fit, largest_rank
from ..adapters.merge import LoraSpec
from ..adapters.schedule import adapter_schedules
from ..adapters.spec import AdapterSpec, folder_specs
from ..engines.caps import bundle_caps, static_batch_segments
from ..engines.manifest import Manifest, bundle_identity, read_manifest
from ..engines.signing import key_fingerprint, load_public_key, read_trusted_manifest
from ..errors import UserError
from ..models.checkpoint.reader import TransformerSource, locate_transformer
from ..models.config import H3Config
from ..models.distilled.families import DistilledServing, DistilledSpec, plan_distilled
from ..models.distilled.contract import checkpoint_contract
from ..models.precision import eager_dtype
from ..models.sampler import DEFAULT_STEPS, ScheduleValues
from ..models.sparse.plan import SparseSettings
from ..models.tiny import TINY_HEIGHT, TINY_REFERENCE_SHORT_EDGE, TINY_WIDTH, ensure_tiny_checkpoint
from ..models.vae_precision import VAEPrecision
from ..parallel.launch import torchrun_rank
from ..parallel.mesh import MeshConfig, resolve_mesh
from ..pipeline.h3_pipeline import H3Pipeline
from ..pipeline.loading import Components, load_bundle, load_checkpoint
from ..pipeline.records import torch_bytecode
from ..request.request import CanvasDefaults
from ..str_enum import StrEnum
from .rank import WorkerSpec
from .supervisor import LaunchKind


class SourceKind(StrEnum):
    """What serves a job: --engine DIR, --model PATH, or neither."""

    BUNDLE = "bundle"  # a compiled engine bundle: its manifest says what it serves
    CHECKPOINT = "checkpoint"  # a MiniMax-H3 checkpoint folder, run eagerly
    TINY = "tiny"  # the embedded tiny model: random weights, no path (built in the user's cache at first use)

    @property
    def compiled(self) -> bool:
        """Served from a bundle's compiled segments, as its manifest describes."""
        return self is SourceKind.BUNDLE

    @property
    def embedded(self) -> bool:
        """The embedded tiny model: no path of the user's."""
        return self is SourceKind.TINY


SOURCES = tuple(SourceKind)
NOTE_NO_BYTECODE = ("note: this Python has no compiled bytecode for torch (PYTHONDONTWRITEBYTECODE=1 or a read-only "
                    "install) and h3trt could not keep its own (the user cache folder is not writable), so every "
                    "process compiles torch, Inductor and transformers from source: seconds of each cold start. "
                    "Compile it once: python -m compileall -q -j 0 <site-packages>, or set PYTHONPYCACHEPREFIX to a "
                    "writable folder.")
NOTE_FIRST_BYTECODE = ("note: first start with this Python: compiling torch's bytecode into {prefix} (seconds, once; "
                       "PYTHONDONTWRITEBYTECODE or a read-only install keeps Python from writing it beside the "
                       "source). Later starts read it.")
TINY_CANVAS = CanvasDefaults(short_edge=TINY_HEIGHT, max_pixels=TINY_WIDTH * TINY_HEIGHT,
                             reference_short_edge=TINY_REFERENCE_SHORT_EDGE)
NOTE_TINY = ("using the embedded tiny default model (random weights, built at first use): the clip is noise. "
             "Pass --model PATH for real MiniMax-H3 weights.")


@dataclass(frozen=True)
class ModelSource:
    """The model that serves (module doc): its kind, its folder and a bundle's manifest, and the flags that shape what
    loads of it."""

    kind: SourceKind  # a string is taken as its member
    path: Path | None  # the bundle folder or the checkpoint folder (None: the embedded tiny model, see `root`)
    manifest: Manifest | None  # a bundle's, read once (under --trust only if signed by that key)
    trust: Path | None = None  # --trust: the public key a bundle must be signed with
    vae_precision: str | None = None  # --vae-precision (None: a bundle's, else VAEPrecision.default)
    loras: tuple[LoraSpec, ...] = ()  # --lora: merged into an eager DiT; a bundle's: held in its slots, every request
    distilled: DistilledSpec | None = None  # --distilled: fused into an eager DiT (a bundle's manifest has its own)
    # task -> where its transformer is: located once (a checkpoint's folders and configs are read at the first ask)
    _located: dict[str, TransformerSource] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in SOURCES:
            raise ValueError(f"A model source's kind must be one of {SOURCES}, got {self.kind!r}.")
        object.__setattr__(self, "kind", SourceKind(self.kind))
        if self.kind.compiled != (self.manifest is not None) or self.kind.embedded != (self.path is None):
            raise ValueError("A model source has a manifest exactly when it is a bundle, a path unless it is tiny.")

    @classmethod
    def resolve(cls, engine: Path | None = None, model: Path | None = None, trust: Path | None = None,
                vae_precision: str | None = None, loras: tuple[LoraSpec, ...] = (),
                distilled: DistilledSpec | None = None) -> ModelSource:
        """--engine DIR (a bundle), --model PATH (a checkpoint), or neither (the embedded tiny model); a flag that
        does not fit the source is refused here, before any model loads (--distilled's with adapters:
        AdapterConfig.resolve)."""
        if engine is not None and model is not None:
            raise UserError("--engine and --model name two models; pass one.")
        if distilled is not None:
            _check_distilled(distilled, engine, loras)
        if trust is not None and engine is None:
            raise UserError("--trust checks a bundle's signature; pass it with --engine DIR.")
        if vae_precision is not None:
            VAEPrecision(vae_precision)  # a bad value fails before any model loads
        if engine is not None:
            # With --trust, only if its bytes carry that key's signature (every file is then checked against it when
            # the bundle loads, before any of its code runs).
            manifest = read_trusted_manifest(engine, trust) if trust is not None else read_manifest(engine)
            return cls(SourceKind.BUNDLE, Path(engine), manifest, trust, vae_precision, tuple(loras))
        if model is not None:
            return cls(SourceKind.CHECKPOINT, Path(model), None, None, vae_precision, tuple(loras), distilled)
        return cls(SourceKind.TINY, None, None, None, vae_precision, tuple(loras), distilled)

    @property
    def root(self) -> Path:
        """The bundle, the checkpoint, or the embedded tiny checkpoint (built at first use: after the inputs were
        checked, so a bad request fails without that wait)."""
        return self.path if self.path is not None else ensure_tiny_checkpoint()

    @property
    def tiny(self) -> bool:
        """Random weights: the embedded tiny model, or a bundle built from it."""
        return self.manifest.tiny if self.manifest is not None else self.kind.embedded

    @property
    def task(self) -> str:
        """The task a server or a fleet loads first: a bundle's own, else t2va (fl2va shares its partition)."""
        return self.manifest.task if self.manifest is not None else "t2va"

    @property
    def canvas(self) -> CanvasDefaults:
        return TINY_CANVAS if self.tiny else CanvasDefaults()

    @property
    def default_steps(self) -> int:
        """A bundle's baked schedule is its default (its shifts already are): a few-step bundle needs no --steps; a
        distilled model's family schedule likewise."""
        if self.distilled_serving is not None:
            return self.distilled_serving.plan.schedule.steps
        return self.manifest.schedule.steps if self.manifest is not None else DEFAULT_STEPS

    @cached_property
    def distilled_serving(self) -> DistilledServing | None:
        """What a distilled model serves: a bundle's manifest record, or --distilled's file read from its header."""
        if self.manifest is not None:
            return DistilledServing.from_record(self.manifest.distilled) if self.manifest.distilled else None
        if self.distilled is not None:
            return plan_distilled(self.distilled)
        if self.kind.embedded:
            return None
        source = self.located("t2va")  # a full FastH3 export serves its sidecar's ladder
        contract = checkpoint_contract(source.component_root, source.shifts, source.config.vsa_gate)
        return contract[0] if contract is not None else None

    @property
    def default_sparse(self) -> SparseSettings | None:
        """A bundle built with --sparse-attention: its requests' default sparse settings, which a request's own value
        (a flag, a key, its profile's) overrides knob by knob (request/parse.py with_bundle_sparse); None: dense by default."""
        if self.manifest is None or self.manifest.sparse is None:
            return None
        return self.manifest.sparse.settings()

    @property
    def adapters_refusal(self) -> str | None:
        """Why this model serves no per-request adapters at all (a fused FastH3 or PDD checkpoint; a bundle built
        without LoRA slots); None: it may (AdapterConfig: which it holds)."""
        if self.distilled_serving is not None and self.distilled_serving.adapters_refusal is not None:
            return self.distilled_serving.adapters_refusal
        return NO_LORA_SLOTS if self.manifest is not None and self.manifest.lora_slots is None else None

    def check_batching(self, max_batch: int) -> None:
        """Refuse --max-batch > 1 where no two requests share a denoise: a bundle compiled for batch 1, a FastH3-VSA
        model (VSA counts one request's evaluations), before any job is taken."""
        if max_batch > 1 and (self.manifest is not None and self.manifest.vsa is not None
                              or self.distilled_serving is not None and self.distilled_serving.vsa is not None):
            raise UserError(f"--max-batch {max_batch}: a FastH3-VSA model denoises each request alone (VSA counts one "
                            "request's evaluations); pass --max-batch 1.")
        if self.manifest is not None:
            check_bundle_batch(self.manifest.segments, max_batch)

    @property
    def model_name(self) -> str:
        """What a record says served it."""
        return "embedded-tiny" if self.kind.embedded else str(self.root)

    @property
    def record_extra(self) -> dict:
        """Added to every record: a bundle's identity, with the key that vouched for it under --trust."""
        if self.manifest is None:
            return {}
        identity = bundle_identity(self.manifest)
        if self.trust is not None:
            identity["signed_by"] = key_fingerprint(load_public_key(self.trust))
        return {"bundle": identity}

    def located(self, task: str) -> TransformerSource:
        """A checkpoint's transformer for `task`, located once (a checkpoint without it fails here)."""
        if task not in self._located:
            self._located[task] = locate_transformer(self.root, task)
        return self._located[task]

    def component_root(self, task: str) -> Path:
        """Where the tokenizer and the eager components are (a bad checkpoint fails here, before the slow loads)."""
        return self.root if self.manifest is not None else self.located(task).component_root

    def config(self, task: str) -> H3Config:
        """The DiT's configuration: a bundle's manifest's, else the checkpoint's for `task`."""
        return self.manifest.model_config if self.manifest is not None else self.located(task).config

    def note(self) -> None:
        """Tell the user when the clips will be noise (the embedded tiny model's random weights), and when a bundle's
        cold start will compile Python from source (no bytecode)."""
        if self.kind.embedded:
            print(f"h3trt: {NOTE_TINY}", file=sys.stderr)
        if self.kind.compiled and not torch_bytecode():
            note = NOTE_FIRST_BYTECODE.format(prefix=sys.pycache_prefix) if sys.pycache_prefix else NOTE_NO_BYTECODE
            print(f"h3trt: {note}", file=sys.stderr)


@dataclass(frozen=True)
class Launch:
    """Where the job loop's ranks run and how they start: this process, --gpus N spawned by it, or torchrun's."""

    device: str  # cpu or cuda (a --device cuda:N was already made the process's cuda:0: cli/commands.choose_gpu)
    gpus: int = 1  # --gpus: local ranks to spawn
    torchrun: tuple[int, int] | None = None  # (rank, world) when this process is a torchrun rank
    cfg: int | None = None  # --cfg / --sp / --replicas as given (None: a bundle's, else resolve_mesh's choice)
    sp: int | None = None
    replicas: int | None = None

    @classmethod
    def resolve(cls, source: ModelSource, device: str | None = None, gpus: int = 1, cfg: int | None = None,
                sp: int | None = None, replicas: int | None = None) -> Launch:
        """The flags checked against this process (torchrun's or not) and the machine: a bundle serves where it was
        built, an eager model on the GPU when there is one."""
        torchrun = torchrun_rank()
        if torchrun is not None and gpus > 1:
            raise UserError(f"Under torchrun the world is torchrun's ({torchrun[1]} ranks); leave out --gpus.")
        if device is None:
            device = source.manifest.device_type if source.manifest else ("cuda" if torch.cuda.is_available()
                                                                          else "cpu")
        elif str(device).startswith("cuda") and not torch.cuda.is_available():  # not torch's assert at the first load
            raise UserError(f"--device {device} was asked for but no CUDA device is visible; use --device cpu.")
        return cls(device, gpus, torchrun[:2] if torchrun is not None else None, cfg, sp, replicas)

    @property
    def device_type(self) -> str:
        return "cuda" if str(self.device).startswith("cuda") else "cpu"

    @property
    def on_mesh(self) -> bool:
        """Several ranks: --gpus N spawns them, or this process is one of torchrun's."""
        return self.gpus > 1 or self.torchrun is not None

    @property
    def how(self) -> LaunchKind:
        """How the job loop's ranks start (jobs/supervisor.py): this process, spawned by it, or torchrun's."""
        return (LaunchKind.TORCHRUN if self.torchrun is not None else LaunchKind.SPAWN if self.gpus > 1
                else LaunchKind.PROCESS)

    @property
    def world(self) -> int:
        return self.torchrun[1] if self.torchrun is not None else self.gpus

    @property
    def first(self) -> bool:
        """This process is the launch's first rank (not a torchrun rank other than 0): it writes what the run shares."""
        return self.torchrun is None or self.torchrun[0] == 0

    def mesh(self, source: ModelSource, task: str) -> MeshConfig:
        """The launched mesh from --cfg/--sp/--replicas, the world and a bundle's degrees (parallel.mesh)."""
        if not self.on_mesh:  # one process: the degrees must all be 1 (the message says why not)
            return resolve_mesh(1, 1, None, self.cfg, self.sp, self.replicas)
        return resolve_mesh(self.world, source.config(task).num_heads,
                            source.manifest.mesh if source.manifest else None, self.cfg, self.sp, self.replicas)


@dataclass(frozen=True)
class AdapterConfig:
    """The resident LoRA adapters requests pick by name, and their slots, as checked against the model source."""

    specs: tuple[AdapterSpec, ...] = ()  # --adapter, then --lora-dir's files: LoRA adapters at start
    folder: Path | None = None  # serve --lora-dir: where adapters load from while the server runs
    num_slots: int | None = None  # serve --lora-slots / --lora-max-rank (None: fitted, SlotShape.fitted)
    max_rank: int | None = None
    # The most adapters one request may name (one evaluation's slots): a bundle's slots less its pinned --lora files,
    # or --lora-slots; None: bounded by the resident set alone
    per_request: int | None = None

    @classmethod
    def resolve(cls, source: ModelSource, specs: tuple[AdapterSpec, ...] = (), folder: Path | None = None,
                num_slots: int | None = None, max_rank: int | None = None) -> AdapterConfig:
        """--adapter, --lora-dir's files, --lora-slots and --lora-max-rank against `source`: names distinct, files
        there, and a bundle's adapters and --lora files (held in its slots) within its slots' count, rank and
        targets; before any model loads."""
        if (num_slots is not None or max_rank is not None) and source.manifest is not None:
            raise UserError("--lora-slots and --lora-max-rank size a checkpoint's adapter slots; a bundle's were fixed "
                            "when it was built (h3trt inspect shows them): leave them out with --engine.")
        if (num_slots is not None or max_rank is not None) and not specs and folder is None:
            raise UserError("--lora-slots and --lora-max-rank size the slots of LoRA adapters; pass them with "
                            "--adapter NAME=FILE or --lora-dir DIR.")
        if source.distilled is not None and (specs or folder is not None):  # a --distilled FastH3 or PDD file
            refusal = source.distilled_serving.adapters_refusal
            if refusal is not None:
                raise UserError(refusal)
        folder = Path(folder) if folder is not None else None
        specs = (*specs, *(folder_specs(folder) if folder is not None else ()))
        check_specs(specs)
        m = source.manifest
        if m is None:
            return cls(specs, folder, num_slots, max_rank, num_slots)
        if m.distilled is not None and (specs or source.loras or folder is not None):
            refusal = source.distilled_serving.adapters_refusal
            if refusal is not None:  # a fused FastH3 or PDD bundle: no slots will ever help
                raise UserError(f"--adapter/--lora/--lora-dir: {refusal}")
        # --adapter, and --lora (an adapter on every request, unmerged), go into the bundle's LoRA slots
        check_bundle_specs(specs, source.loras, m.lora_slots, m.model_config, m.task, folder)
        return cls(specs, folder, per_request=bundle_caps(m, pinned=len(source.loras)).adapter_slots)

    @property
    def schedules(self) -> dict[str, ScheduleValues]:
        """The resident adapters' own schedules, by name (a request naming one leaves it the steps and shifts it does
        not state: adapters/schedule.py)."""
        return adapter_schedules(self.specs)

    def catalog(self, source: ModelSource, device: str, state: Path | None = None, log=None,
                task: str = "t2va") -> AdapterCatalog | None:
        """A server's set of adapters (GET /v1/loras, admission, the admin calls), its files read and checked against
        `task`'s partition (a bundle's: its own, in its slots' shape less the --lora files pinned in them; a
        checkpoint's: slots that fit `device`'s memory); `state`: the file that keeps the admin calls' changes across
        restarts. None for a model that serves no adapters (ModelSource.adapters_refusal), and for a model without
        adapters or --lora-dir (the set is empty for good)."""
        if source.adapters_refusal is not None or (not self.specs and self.folder is None):
            return None
        cfg, log = source.config(task), ({"log": log} if log is not None else {})
        if source.manifest is not None:  # a bundle's slots were checked by its build
            task, slots = source.manifest.task, source.manifest.lora_slots
            return AdapterCatalog.start(self.specs, cfg, task, folder=self.folder, state=state, **log,
                                        num_slots=self.per_request, max_rank=slots.max_rank, targets=slots.targets)
        dtype = eager_dtype(device)  # a checkpoint's slots are the server's: they must fit its memory
        catalog = AdapterCatalog.start(self.specs, cfg, task, folder=self.folder, state=state, **log,
                                       num_slots=self.num_slots, max_rank=self.max_rank,
                                       rank_limit=lambda n: largest_rank(cfg, n, device, dtype))
        n, r = catalog.shape.num_slots, catalog.shape.max_rank
        given = (f"--lora-slots {n}" if self.num_slots else "") + (f" --lora-max-rank {r}" if self.max_rank else "")
        check_slots_fit(cfg, n, r, device, dtype, what=(
            f"{given.strip()} (the slots: {n} of rank {r})" if given else
            f"the slots fitted to the adapters at start ({n} of rank {r}; --lora-slots and --lora-max-rank set them)"))
        return catalog


@dataclass(frozen=True)
class Entry:
    """What serves a job and how it is launched (module doc). Made once per command; every path that loads a model
    reads it instead of the command line."""

    model: ModelSource
    launch: Launch
    adapters: AdapterConfig = AdapterConfig()

    @classmethod
    def local(cls, model: ModelSource | None = None, device: str | None = None,
              adapters: tuple[AdapterSpec, ...] = (), **adapter_flags) -> Entry:
        """One process on `device` (h3trt eval's sides, the benches, the tests): the embedded tiny model when
        `model` is None, `adapters` resident (`adapter_flags`: AdapterConfig.resolve's folder, num_slots, max_rank)."""
        model = model if model is not None else ModelSource.resolve()
        return cls(model, Launch.resolve(model, device), AdapterConfig.resolve(model, adapters, **adapter_flags))

    def mesh(self, task: str) -> MeshConfig:
        return self.launch.mesh(self.model, task)

    def adapter_catalog(self, state: Path | None = None, log=None, task: str = "t2va") -> AdapterCatalog | None:
        """A server's set of adapters (AdapterConfig.catalog), its slots fitted to this launch's device."""
        return self.adapters.catalog(self.model, self.launch.device, state, log, task)

    def components(self, task: str) -> Components:
        """The built parts of a pipeline in this process (h3trt eval builds its own around them; the job loop's
        ranks load through `worker_spec` and rank.load_rank_pipeline)."""
        m = self.model
        if m.manifest is not None:
            return load_bundle(m.root, self.launch.device, vae_precision=m.vae_precision, trust=m.trust,
                               adapters=self.adapters.specs, loras=m.loras)
        return load_checkpoint(m.root, task, self.launch.device, m.vae_precision, m.loras,
                               adapters=self.adapters.specs, distilled=m.distilled)

    def load(self, task: str, canvas: CanvasDefaults | None = None) -> H3Pipeline:
        """A pipeline in this process."""
        return H3Pipeline.from_components(self.components(task), self.launch.device,
                                          self.model.canvas if canvas is None else canvas)

    def worker_spec(self, task: str, mesh: MeshConfig, **fields) -> WorkerSpec:
        """What every rank of every replica group needs (picklable); `fields`: the front door's own (crf,
        max_batch, raise_failures)."""
        m = self.model
        m.check_batching(fields.get("max_batch", 1))
        fields = {"adapters": self.adapters.specs, **fields}  # a server's: its catalog's set at start, and its slots
        return WorkerSpec(str(m.root), m.manifest is not None, task, self.launch.device_type, mesh,
                          m.config(task).num_heads, canvas=m.canvas, model_name=m.model_name,
                          record_extra=m.record_extra, vae_precision=m.vae_precision, loras=m.loras,
                          trust=str(m.trust) if m.trust is not None else None, distilled=m.distilled, **fields)


def check_bundle_batch(segments: dict, max_batch: int) -> None:
    """Refuse --max-batch > 1 on a bundle whose DiT segments (a manifest's `segments`) were compiled for batch 1
    (engines/caps.py static_batch_segments)."""
    if max_batch == 1:
        return
    static = static_batch_segments(segments)
    if static:
        raise UserError(f"--max-batch {max_batch}: this bundle's DiT segments {static} are compiled for batch 1 (the "
                        "batch dimension is static in the artifacts); pass --max-batch 1 with --engine, or serve "
                        "batches from --model (eager).")


def _check_distilled(spec: DistilledSpec, engine: Path | None, loras: tuple) -> None:
    """--distilled with what it cannot go with, before any model loads: a bundle (its manifest carries the file it was
    built with), and merged LoRAs beside a FastH3 or PDD file (adapters beside one: AdapterConfig.resolve)."""
    if engine is not None:
        raise UserError("--distilled fuses a file into a checkpoint run eagerly; a bundle was built with its own "
                        "(h3trt inspect shows it): drop --distilled with --engine, or build with "
                        "h3trt build --distilled FILE.")
    serving = plan_distilled(spec)
    if loras and serving.merged_lora_refusal is not None:
        raise UserError(serving.merged_lora_refusal)
