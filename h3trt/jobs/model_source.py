"""What serves a job: a bundle, a checkpoint folder or the embedded tiny model, resolved once (cli.entry_from_args)
into the canvas defaults, the device, the no-compile guard and how ranks start (one process, --gpus spawn, or
torchrun). `h3trt run` (one clip or a --requests batch, on one process or a mesh) and `h3trt eval` (both sides) all
load through an Entry, so the "bundle or tiny or checkpoint" decisions are written once.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from ..engines.manifest import Manifest, bundle_identity, read_manifest
from ..engines.signing import key_fingerprint, load_public_key, read_trusted_manifest
from ..errors import UserError
from ..models.checkpoint import locate_transformer
from ..models.distilled import DistilledServing, DistilledSpec, plan_distilled
from ..models.distilled_contract import checkpoint_contract
from ..models.lora import LoraSpec
from ..models.lora_memory import check_slots_fit, largest_rank
from ..models.precision import eager_dtype
from ..models.sampler import DEFAULT_STEPS
from ..models.sparse_plan import SparseSettings
from ..models.tiny import TINY_HEIGHT, TINY_REFERENCE_SHORT_EDGE, TINY_WIDTH, ensure_tiny_checkpoint
from ..models.vae_precision import VAEPrecision
from ..parallel.launch import torchrun_rank
from ..parallel.mesh import MeshConfig, resolve_mesh
from ..pipeline.adapter_catalog import AdapterCatalog
from ..pipeline.adapter_schedule import ScheduleValues, adapter_schedules
from ..pipeline.adapters import BUNDLE_REFUSAL, AdapterSpec, check_bundle_specs, check_specs, folder_specs
from ..pipeline.h3_pipeline import H3Pipeline
from ..pipeline.loading import Components, load_bundle, load_checkpoint
from ..pipeline.records import torch_bytecode
from ..pipeline.request import CanvasDefaults
from ..str_enum import StrEnum
from .rank import WorkerSpec
from .supervisor import LaunchKind


class ModelSource(StrEnum):
    """What serves a job: --engine DIR, --model PATH, or neither."""

    BUNDLE = "bundle"  # a compiled engine bundle: its manifest says what it serves
    CHECKPOINT = "checkpoint"  # a MiniMax-H3 checkpoint folder, run eagerly
    TINY = "tiny"  # the embedded tiny model: random weights, no path (built in the user's cache at first use)

    @property
    def compiled(self) -> bool:
        """Served from a bundle's compiled segments, as its manifest describes."""
        return self is ModelSource.BUNDLE

    @property
    def embedded(self) -> bool:
        """The embedded tiny model: no path of the user's."""
        return self is ModelSource.TINY


SOURCES = tuple(ModelSource)
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
class Entry:
    """One resolved model source and how it is launched. Made once per job (`resolve`); every path that loads a model
    reads it instead of the command line."""

    source: ModelSource  # a string is taken as its member
    path: Path | None  # the bundle folder or the checkpoint folder (None: the embedded tiny model, see `root`)
    manifest: Manifest | None  # a bundle's, read once (under --trust only if signed by that key)
    device: str  # cpu or cuda (a --device cuda:N was already made the process's cuda:0: cli/commands.choose_gpu)
    trust: Path | None = None  # --trust: the public key a bundle must be signed with
    vae_precision: str | None = None  # --vae-precision (None: a bundle's, else VAEPrecision.default)
    loras: tuple[LoraSpec, ...] = ()  # merged into an eager DiT; a bundle's: an adapter on every request (its slots)
    gpus: int = 1  # --gpus: local ranks to spawn
    torchrun: tuple[int, int] | None = None  # (rank, world) when this process is a torchrun rank
    cfg: int | None = None  # --cfg / --sp / --replicas as given (None: a bundle's, else resolve_mesh's choice)
    sp: int | None = None
    replicas: int | None = None
    adapters: tuple[AdapterSpec, ...] = ()  # --adapter, then --lora-dir's files: LoRA adapters at start
    lora_dir: Path | None = None  # serve --lora-dir: where adapters load from while the server runs
    lora_slots: int | None = None  # serve --lora-slots / --lora-max-rank (None: fitted, SlotShape.fitted)
    lora_max_rank: int | None = None
    distilled: DistilledSpec | None = None  # --distilled: fused into an eager DiT (a bundle's manifest has its own)

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"Entry source must be one of {SOURCES}, got {self.source!r}.")
        object.__setattr__(self, "source", ModelSource(self.source))
        if self.source.compiled != (self.manifest is not None) or self.source.embedded != (self.path is None):
            raise ValueError("An Entry has a manifest exactly when its source is a bundle, a path unless it is tiny.")

    @classmethod
    def resolve(cls, engine: Path | None = None, model: Path | None = None, device: str | None = None,
                trust: Path | None = None, vae_precision: str | None = None, loras: tuple[LoraSpec, ...] = (),
                gpus: int = 1, cfg: int | None = None, sp: int | None = None,
                replicas: int | None = None, adapters: tuple[AdapterSpec, ...] = (), lora_dir: Path | None = None,
                lora_slots: int | None = None, lora_max_rank: int | None = None,
                distilled: DistilledSpec | None = None) -> "Entry":
        """--engine DIR (a bundle), --model PATH (a checkpoint), or neither (the embedded tiny model); every flag
        that does not fit the source is refused here, before any model loads."""
        if engine is not None and model is not None:
            raise UserError("--engine and --model name two models; pass one.")
        if distilled is not None:
            _check_distilled(distilled, engine, loras, adapters, lora_dir)
        if trust is not None and engine is None:
            raise UserError("--trust checks a bundle's signature; pass it with --engine DIR.")
        if (lora_slots is not None or lora_max_rank is not None) and engine is not None:
            raise UserError("--lora-slots and --lora-max-rank size a checkpoint's adapter slots; a bundle's were fixed "
                            "when it was built (h3trt inspect shows them): leave them out with --engine.")
        if (lora_slots is not None or lora_max_rank is not None) and not adapters and lora_dir is None:
            raise UserError("--lora-slots and --lora-max-rank size the slots of LoRA adapters; pass them with "
                            "--adapter NAME=FILE or --lora-dir DIR.")
        adapters = (*adapters, *(folder_specs(Path(lora_dir)) if lora_dir is not None else ()))
        check_specs(tuple(adapters))
        if vae_precision is not None:
            VAEPrecision(vae_precision)  # a bad value fails before any model loads
        torchrun = torchrun_rank()
        if torchrun is not None and gpus > 1:
            raise UserError(f"Under torchrun the world is torchrun's ({torchrun[1]} ranks); leave out --gpus.")
        manifest = None
        if engine is not None:
            # With --trust, only if its bytes carry that key's signature (every file is then checked against it when
            # the bundle loads, before any of its code runs).
            manifest = read_trusted_manifest(engine, trust) if trust is not None else read_manifest(engine)
            source, path = ModelSource.BUNDLE, Path(engine)
            if manifest.distilled is not None and (adapters or loras or lora_dir is not None):
                refusal = DistilledServing.from_record(manifest.distilled).adapters_refusal
                if refusal is not None:  # a fused FastH3 or PDD bundle: no slots will ever help
                    raise UserError(f"--adapter/--lora/--lora-dir: {refusal}")
            # --adapter, and --lora (an adapter on every request, unmerged), go into the bundle's LoRA slots
            check_bundle_specs(tuple(adapters), tuple(loras), manifest.lora_slots, manifest.model_config,
                               manifest.task, Path(lora_dir) if lora_dir is not None else None)
        elif model is not None:
            source, path = ModelSource.CHECKPOINT, Path(model)
        else:
            source, path = ModelSource.TINY, None
        if device is None:  # a bundle serves where it was built; an eager model on the GPU when there is one
            device = manifest.device_type if manifest else ("cuda" if torch.cuda.is_available() else "cpu")
        elif str(device).startswith("cuda") and not torch.cuda.is_available():  # not torch's assert at the first load
            raise UserError(f"--device {device} was asked for but no CUDA device is visible; use --device cpu.")
        return cls(source, path, manifest, device, trust, vae_precision, tuple(loras), gpus, torchrun, cfg, sp,
                   replicas, tuple(adapters), Path(lora_dir) if lora_dir is not None else None, lora_slots,
                   lora_max_rank, distilled)

    @property
    def root(self) -> Path:
        """The bundle, the checkpoint, or the embedded tiny checkpoint (built at first use: after the inputs were
        checked, so a bad request fails without that wait)."""
        return self.path if self.path is not None else ensure_tiny_checkpoint()

    @property
    def tiny(self) -> bool:
        """Random weights: the embedded tiny model, or a bundle built from it."""
        return self.manifest.tiny if self.manifest is not None else self.source.embedded

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
        if self.source.embedded:
            return None
        source = locate_transformer(self.root, "t2va")  # a full FastH3 export serves its sidecar's ladder
        contract = checkpoint_contract(source.component_root, source.shifts, source.config.vsa_gate)
        return contract[0] if contract is not None else None

    @property
    def default_sparse(self) -> SparseSettings | None:
        """A bundle built with --sparse-attention: its requests' default sparse settings, which a request's own value
        (a flag, a key, its profile's) overrides knob by knob (profiles.with_bundle_sparse); None: dense by default."""
        if self.manifest is None or self.manifest.sparse is None:
            return None
        return self.manifest.sparse.settings()

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
    def spawns(self) -> bool:
        return self.how.spawns

    @property
    def world(self) -> int:
        return self.torchrun[1] if self.torchrun is not None else self.gpus

    @property
    def model_name(self) -> str:
        """What a record says served it."""
        return "embedded-tiny" if self.source.embedded else str(self.root)

    @property
    def record_extra(self) -> dict:
        """Added to every record: a bundle's identity, with the key that vouched for it under --trust."""
        if self.manifest is None:
            return {}
        identity = bundle_identity(self.manifest)
        if self.trust is not None:
            identity["signed_by"] = key_fingerprint(load_public_key(self.trust))
        return {"bundle": identity}

    def component_root(self, task: str) -> Path:
        """Where the tokenizer and the eager components are (a bad checkpoint fails here, before the slow loads)."""
        return self.root if self.manifest is not None else locate_transformer(self.root, task).component_root

    def num_heads(self, task: str) -> int:
        cfg = self.manifest.model_config if self.manifest is not None else locate_transformer(self.root, task).config
        return cfg.num_heads

    def mesh(self, task: str) -> MeshConfig:
        """The launched mesh from --cfg/--sp/--replicas, the world and a bundle's degrees (parallel.mesh)."""
        if not self.on_mesh:  # one process: the degrees must all be 1 (the message says why not)
            return resolve_mesh(1, 1, None, self.cfg, self.sp, self.replicas)
        return resolve_mesh(self.world, self.num_heads(task), self.manifest.mesh if self.manifest else None,
                            self.cfg, self.sp, self.replicas)

    def note(self) -> None:
        """Tell the user when the clips will be noise (the embedded tiny model's random weights), and when a bundle's
        cold start will compile Python from source (no bytecode)."""
        if self.source.embedded:
            print(f"h3trt: {NOTE_TINY}", file=sys.stderr)
        if self.source.compiled and not torch_bytecode():
            note = NOTE_FIRST_BYTECODE.format(prefix=sys.pycache_prefix) if sys.pycache_prefix else NOTE_NO_BYTECODE
            print(f"h3trt: {note}", file=sys.stderr)

    def components(self, task: str) -> Components:
        """The built parts of a pipeline in this process (h3trt eval builds its own around them; the job loop's
        ranks load through `worker_spec` and rank.load_rank_pipeline)."""
        if self.manifest is not None:
            return load_bundle(self.root, self.device, vae_precision=self.vae_precision, trust=self.trust,
                               adapters=self.adapters, loras=self.loras)
        return load_checkpoint(self.root, task, self.device, self.vae_precision, self.loras, adapters=self.adapters,
                               distilled=self.distilled)

    def adapter_catalog(self, state: Path | None = None, log=None, task: str = "t2va") -> AdapterCatalog | None:
        """A server's set of adapters (GET /v1/loras, admission, the admin calls), its files read and checked against
        `task`'s partition (a bundle's: its own, in its slots' shape less the --lora files pinned in them); `state`:
        the file that keeps the admin calls' changes across restarts. None for a bundle without LoRA slots, and for a
        model without adapters or --lora-dir (the set is empty for good)."""
        if self.adapter_refusal is not None or (not self.adapters and self.lora_dir is None):
            return None
        if self.manifest is not None:
            cfg, task, slots = self.manifest.model_config, self.manifest.task, self.manifest.lora_slots
            shape = {"num_slots": self.adapter_slots, "max_rank": slots.max_rank, "targets": slots.targets}
        else:
            cfg = locate_transformer(self.root, task).config
            shape = {"num_slots": self.lora_slots, "max_rank": self.lora_max_rank}
        dtype = eager_dtype(self.device)
        limit = (lambda n: largest_rank(cfg, n, self.device, dtype)) if self.manifest is None else None
        catalog = AdapterCatalog.start(self.adapters, cfg, task, folder=self.lora_dir, state=state, **shape,
                                       **({"log": log} if log is not None else {}), rank_limit=limit)
        if self.manifest is None:  # a checkpoint's slots are the server's (a bundle's were checked by its build)
            n, r = catalog.shape.num_slots, catalog.shape.max_rank
            given = (f"--lora-slots {n}" if self.lora_slots else "") + (
                f" --lora-max-rank {r}" if self.lora_max_rank else "")
            check_slots_fit(cfg, n, r, self.device, dtype, what=(
                f"{given.strip()} (the slots: {n} of rank {r})" if given else
                f"the slots fitted to the adapters at start ({n} of rank {r}; --lora-slots and --lora-max-rank set "
                "them)"))
        return catalog

    @property
    def adapter_slots(self) -> int | None:
        """The most adapters one request may name (one evaluation's slots): a bundle's slots less its pinned --lora
        files, or --lora-slots; None: bounded by the resident set alone."""
        if self.manifest is not None and self.manifest.lora_slots is not None:
            return self.manifest.lora_slots.slots - len(self.loras)
        return self.lora_slots

    @property
    def adapter_schedules(self) -> dict[str, ScheduleValues]:
        """The resident adapters' own schedules, by name (a request naming one leaves it the steps and shifts it does
        not state: pipeline/adapter_schedule.py)."""
        return adapter_schedules(self.adapters)

    @property
    def adapter_refusal(self) -> str | None:
        """Why this model serves no per-request adapters at all (a fused FastH3 or PDD checkpoint; a bundle built
        without LoRA slots); None: it may."""
        if self.distilled_serving is not None and self.distilled_serving.adapters_refusal is not None:
            return self.distilled_serving.adapters_refusal
        return BUNDLE_REFUSAL if self.manifest is not None and self.manifest.lora_slots is None else None

    def load(self, task: str, canvas: CanvasDefaults | None = None) -> H3Pipeline:
        """A pipeline in this process."""
        return H3Pipeline.from_components(self.components(task), self.device,
                                          self.canvas if canvas is None else canvas)

    def worker_spec(self, task: str, mesh: MeshConfig, **fields) -> WorkerSpec:
        """What every rank of every replica group needs (picklable); `fields`: the front door's own (crf,
        max_batch, raise_failures)."""
        fields = {"adapters": self.adapters, **fields}  # a server's: its catalog's set at start, and its slots
        return WorkerSpec(str(self.root), self.manifest is not None, task, self.device_type, mesh,
                          self.num_heads(task), canvas=self.canvas, model_name=self.model_name,
                          record_extra=self.record_extra, vae_precision=self.vae_precision, loras=self.loras,
                          trust=str(self.trust) if self.trust is not None else None, distilled=self.distilled,
                          **fields)


def _check_distilled(spec: DistilledSpec, engine: Path | None, loras: tuple, adapters: tuple,
                     lora_dir: Path | None) -> None:
    """--distilled with what it cannot go with, before any model loads: a bundle (its manifest carries the file it was
    built with), and LoRAs beside a FastH3 or PDD file."""
    if engine is not None:
        raise UserError("--distilled fuses a file into a checkpoint run eagerly; a bundle was built with its own "
                        "(h3trt inspect shows it): drop --distilled with --engine, or build with "
                        "h3trt build --distilled FILE.")
    serving = plan_distilled(spec)
    if loras and serving.merged_lora_refusal is not None:
        raise UserError(serving.merged_lora_refusal)
    if (adapters or lora_dir is not None) and serving.adapters_refusal is not None:
        raise UserError(serving.adapters_refusal)
