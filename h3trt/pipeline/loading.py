"""The two ways a pipeline's components are loaded: from a checkpoint (the eager reference modules) or from an engine
bundle (its compiled DiT, the text encoder beside the weights as they stream in, the VAEs off the cold-start path).
Each returns `Components`, the built parts H3Pipeline is constructed from."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from ..adapters.merge import LoraSpec, merge_loras
from ..adapters.resident import ResidentAdapters
from ..adapters.shape import SlotShape
from ..adapters.spec import AdapterSpec
from ..calibration.vae_fp8 import load_video_vae_at
from ..engines.bundle import Engine
from ..engines.manifest import BundleError, read_manifest
from ..models.audio_vae import AudioVAE
from ..models.checkpoint.reader import load_dit, locate_transformer
from ..models.distilled.families import DistilledServing, DistilledSpec, load_distilled
from ..models.distilled.contract import checkpoint_contract, refuse_export_base
from ..models.distilled.merge import StepHeadRunner, merge_distilled, step_heads
from ..models.dit import EagerDiT
from ..models.precision import eager_dtype
from ..models.sparse.run import load_sparse_kernel
from ..models.text_encoder import H3TextEncoder, quiet_transformers
from ..models.checkpoint.vae import load_audio_vae
from ..models.vae_precision import VAEPrecision
from ..models.video_vae import VideoVAE
from ..models.vsa.plan import VsaServing, choose_vsa_kernel, served_vsa_settings
from ..parallel.ulysses import UlyssesDiT
from .prepare import Prepared, check_bundle_serves
from .records import ColdStart, process_started_unix, torch_bytecode


@dataclass(frozen=True)
class Components:
    """What a loader hands H3Pipeline: the DiT (any callable of the EagerDiT signature), the text encoder, the VAEs
    (or `deferred_vaes` still loading them), the checkpoint's or bundle's default shifts, and what every record
    carries about the source."""

    dit: object
    text_encoder: H3TextEncoder
    video_vae: VideoVAE | None
    audio_vae: AudioVAE | None
    shifts: tuple[float, float]  # (video, audio) sigma shifts a request without its own uses
    # A bundle's: refuses a request it was not built for, as admission did (prepare.check_bundle_serves)
    check_request: Callable[[Prepared], None] | None = None
    loras: tuple[dict, ...] = ()  # records of the LoRAs merged into the DiT
    # (video VAE, audio VAE, their load's seconds, the verification report) on a background thread, in place of the
    # two VAEs; the last two complete the cold-start split (ColdStart.with_vaes)
    deferred_vaes: Deferred | None = None
    load_report: ColdStart | None = None  # a bundle's cold-start split, for every record
    adapters: ResidentAdapters | None = None  # resident LoRA adapters, picked per request
    # A distilled checkpoint's: what it serves (its schedule, tasks, refusals) and its record for every clip
    distilled: DistilledServing | None = None
    distilled_record: dict | None = None
    text_prefetched: dict | None = None  # t2va prompt -> its encoding, made while a bundle loaded (one use each)


class Deferred:
    """A value built on a background thread (the VAEs while the DiT loads and denoises); `result()` waits for it and
    raises what the builder raised. `seconds` is how long the builder ran.

    Not a daemon: a process that ends while the builder is still loading (an error right after the load) waits for
    it. A daemon thread still inside torch when the interpreter exits aborts the process ("terminate called without
    an active exception", exit 134) in place of the clean error exit."""

    def __init__(self, build: Callable[[], object]):
        self._value, self._error, self.seconds = None, None, None
        self._thread = threading.Thread(target=self._run, args=(build,), name="h3trt-deferred", daemon=False)
        self._thread.start()

    def _run(self, build) -> None:
        start = time.perf_counter()
        try:
            self._value = build()
        except BaseException as e:  # re-raised on the caller's thread by result()
            self._error = e
        self.seconds = time.perf_counter() - start

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def import_loader_modules() -> float:
    """Import, on the calling thread, every package a bundle load's threads import (the text encoder's thread:
    transformers, diffusers; the VAEs' thread: diffusers' VAE classes; the main thread: Inductor, for the compiled
    code), and resolve the lazy names they use; returns the seconds it took. load_bundle calls it on its thread
    before the loader threads start, so that no two threads ever import at once.

    Why: Python's import lock covers one module at a time, and these packages import each other (diffusers and
    transformers import torch._inductor through torch's compile helpers; both resolve their classes lazily). A thread
    importing through them while another does can reach a module the other has only half executed: on the H200 one
    cold start in three died with "cannot import name 'IndentedBuffer' from partially initialized module
    'torch._inductor.utils'" (the text encoder's thread in diffusers while Engine.load imported
    torch._inductor.codecache), and earlier with "cannot import name 'AutoModel'". tests/pipeline/test_loader_imports.py
    runs the thread bodies after this and fails on any of these packages first imported off the main thread."""
    t0 = time.perf_counter()
    import diffusers
    import torch._inductor.codecache  # noqa: F401 -- engines/loaders.py activate_compiled_cache
    import torch._inductor.config  # noqa: F401 -- engines/loaders.py load_segments
    import torch._inductor.utils  # noqa: F401
    import transformers
    from diffusers.models.modeling_utils import get_parameter_dtype  # noqa: F401 -- calibration/vae_fp8.py

    diffusers.AutoencoderKLMiniMaxH3, diffusers.AutoencoderKLMiniMaxH3Audio  # models/checkpoint/vae.py
    transformers.Qwen3VLModel, transformers.Qwen3VLConfig  # models/text_encoder.py
    # AutoTokenizer and AutoImageProcessor import their classes by the names in the checkpoint's configs (Qwen3-VL's,
    # the checkpoint contract), searching the model modules that list them.
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    tokenizer_class_from_name("Qwen2Tokenizer")
    get_image_processor_class_from_name("Qwen2VLImageProcessor")
    quiet_transformers()
    return time.perf_counter() - t0


def eager_components(root: Path, device: torch.device, dtype: torch.dtype,
                     vae_precision: VAEPrecision | None = None):
    """The text encoder at `dtype`, the video VAE at `vae_precision` (None: VAEPrecision.default) and the audio VAE
    in fp32 (diffusers pins all of it to fp32 at every precision: h3trt/models/vae_precision.py)."""
    return _text_encoder(root, device, dtype), *_vaes(root, device, vae_precision or VAEPrecision.default(device))


def _text_encoder(root: Path, device: torch.device, dtype: torch.dtype) -> H3TextEncoder:
    quiet_transformers()
    return H3TextEncoder.from_pretrained(root, device=device, dtype=dtype)


def _vaes(root: Path, device: torch.device, vae_precision: VAEPrecision) -> tuple[VideoVAE, AudioVAE]:
    return load_video_vae_at(root, device, vae_precision), load_audio_vae(root, device)


def load_checkpoint(model_root: Path, task: str, device: str = "cpu", vae_precision: str | None = None,
                    loras: tuple[LoraSpec, ...] = (), sp_group=None,
                    adapters: tuple[AdapterSpec, ...] = (), lora_slots: SlotShape | None = None,
                    distilled: DistilledSpec | None = None) -> Components:
    """The eager components for `task`'s partition, with `loras` merged into the DiT and `adapters` resident beside
    it, in LoRA slots of `lora_slots` (None: one slot each, of their largest rank) in the DiT's dtype;
    `vae_precision` None: bf16 on CUDA, fp32 on the CPU (VAEPrecision.default). With `sp_group` (this rank's Ulysses
    group) the DiT runner shards its block stack over it. `distilled`: a distilled file fused into the DiT after the
    LoRAs (models/distilled/merge.py); the model then runs its family's schedule (its shifts are the defaults)."""
    device = torch.device(device)
    vae = VAEPrecision.resolve(vae_precision, device)
    dtype = eager_dtype(device)
    # The --distilled file first: a FastH3-VSA file's gates are parameters the model is built with (load_dit)
    fused = None
    if distilled is not None:
        located = locate_transformer(model_root, task)
        refuse_export_base(located.component_root, distilled.path)
        fused = load_distilled(distilled, located.config, task)
    model, source = load_dit(model_root, task, dtype=dtype, device=device,
                             supplied=fused.fusion.assigned() if fused is not None else None)
    records = merge_loras(model, loras, task)
    shifts = source.shifts
    serving, record = (fused.serving, merge_distilled(model, fused)) if fused is not None else (None, None)
    # a full FastH3 export: its own ladder (and VSA)
    contract = checkpoint_contract(source.component_root, shifts, model.cfg.vsa_gate, task) if fused is None else None
    if contract is not None:
        serving, record = contract
    if serving is not None:
        shifts = (serving.plan.schedule.video_shift, serving.plan.schedule.audio_shift)
    sp = torch.distributed.get_world_size(sp_group) if sp_group is not None else 1
    heads = model.cfg.num_heads // sp
    if model.cfg.vsa_gate:  # FastH3-VSA: VSA every evaluation at what its file was distilled at, its kernel warmed
        kernel, sparse_problem = None, None
        settings = served_vsa_settings(serving.vsa if serving is not None else None)
        vsa = VsaServing(settings, *choose_vsa_kernel(device, heads, model.cfg.head_dim, dtype, _note))
    else:
        (kernel, sparse_problem), vsa = load_sparse_kernel(device, heads, model.cfg.head_dim, dtype), None
    dit = (UlyssesDiT(model, sp_group, kernel, vsa, sparse_problem) if sp_group is not None
           else EagerDiT(model, kernel, vsa, sparse_problem))
    resident = (ResidentAdapters(tuple(adapters), model.cfg, task, dtype, device, lora_slots)
                if adapters or lora_slots is not None else None)
    if resident is not None:  # its caps: the adapters one evaluation carries, in the resident slots
        dit.caps = replace(dit.caps, adapter_slots=resident.slots.num_slots)
    heads = step_heads(fused, device) if fused is not None else None
    if heads is not None:  # PDD: each forward's fused head, chosen per evaluation
        dit = StepHeadRunner(dit, heads)
    return Components(dit, *eager_components(source.component_root, device, dtype, vae), shifts,
                      loras=records, adapters=resident, distilled=serving, distilled_record=record)


def _note(line: str) -> None:
    print(f"h3trt: note: {line}", file=sys.stderr)


def load_bundle(bundle_root: Path, device: str = "cpu", mesh=None, sp_group=None, vae_precision: str | None = None,
                trust: Path | None = None, adapters: tuple[AdapterSpec, ...] = (),
                loras: tuple[LoraSpec, ...] = (), serve_adapters: bool = False,
                prefetch_prompts: tuple[str, ...] = ()) -> Components:
    """A bundle's components for one rank: `mesh` is the launched MeshConfig (None: one process), checked against
    the bundle's; `sp_group` this rank's sequence-parallel group. The video VAE runs at the bundle's
    --vae-precision (its decoder was compiled for it); `vae_precision`, when given, must be that one; `trust` a
    public key the bundle must be signed with (Engine.load). `adapters` (and `loras`, an adapter on every request)
    are loaded into the bundle's LoRA slots (checked against them before: adapters.check_bundle_specs);
    `serve_adapters`: the slots serve adapters that join later (a server's --lora-dir), even with none at start.
    `prefetch_prompts`: t2va prompts the run already knows (one clip's), encoded on the text encoder's thread while
    the DiT loads (its warm-up), so that request's text encode is off the critical path."""
    device, bundle_root = torch.device(device), Path(bundle_root)
    start = time.perf_counter()
    started_unix, process_unix = time.time(), process_started_unix()
    # Engine.load reads and checks the manifest (and its signature) again; this is only for the text dtype.
    dtype = read_manifest(bundle_root).precision.spec.dtype

    # 1. The engine: checks, code, DiT weights; the text encoder loads on its own thread as soon as its files are
    #    verified, beside the weights streaming in.
    text = _TextEncoderBeside(bundle_root, device, dtype, prefetch_prompts)
    engine = Engine.load(bundle_root, device, mesh, sp_group, trust=trust, early=_TEXT_PARTS, alongside=text.start)
    engine_s = time.perf_counter() - start
    m = engine.manifest
    if vae_precision is not None and vae_precision != m.vae_precision:
        VAEPrecision(vae_precision)  # an unknown name gets the list of known ones
        raise BundleError(f"This bundle's video decoder was compiled at --vae-precision {m.vae_precision}; "
                          f"the run asks for {vae_precision}. Leave --vae-precision out to serve the bundle's, "
                          f"or rebuild with h3trt build --vae-precision {vae_precision}.")

    # 2. The text encoder, once the DiT is ready.
    t0 = time.perf_counter()
    text_encoder, text_split, prefetched = text.result()
    text_split["text_encoder_wait_s"] = round(time.perf_counter() - t0, 4)  # after the DiT was ready
    # A tensorrt bundle's first thread: its imports first, on this thread (import_loader_modules; done already, and
    # a no-op, on the compiled path).
    imports_s = import_loader_modules()

    # 3. The VAEs, off the cold-start path: the first denoise step needs neither (a keyframe's encode, or the decode,
    #    waits for them). After the text encoder: one loader thread inside transformers/diffusers at a time.
    deferred = Deferred(lambda: _bundle_vaes(engine, bundle_root, device, VAEPrecision(m.vae_precision)))
    # Process start to this load: interpreter, imports, CUDA's first call, the request's checks (tokenizer included).
    before = round(started_unix - process_unix, 4) if process_unix is not None else None
    split = ColdStart(process_to_load_s=before, engine=engine.load_report, engine_s=round(engine_s, 4),
                      python_bytecode=torch_bytecode(), **text_split,
                      # transformers, diffusers and Inductor, on the main thread before the loader threads started
                      loader_imports_s=round(text.imports_s if text.imports_s is not None else imports_s, 4),
                      total_s=round(time.perf_counter() - start, 4),  # bundle on hand, ready to encode and denoise
                      nulls=("process_to_load_s",) if before is None else ())
    resident = (ResidentAdapters(tuple(adapters), m.model_config, m.task, m.precision.spec.dtype, device,
                                 slots=engine.dit.lora_slots, pinned=tuple(loras))
                if engine.dit.lora_slots is not None and (adapters or loras or serve_adapters) else None)
    return Components(engine.dit, text_encoder, None, None, (m.schedule.video_shift, m.schedule.audio_shift),
                      functools.partial(check_bundle_serves, m), loras=m.loras,
                      deferred_vaes=deferred, load_report=split, adapters=resident,
                      distilled=DistilledServing.from_record(m.distilled) if m.distilled is not None else None,
                      distilled_record=m.distilled, text_prefetched=prefetched)


_TEXT_PARTS = ("text_encoder", "tokenizer", "processor")  # the bundle's files the text encoder loads from


class _TextEncoderBeside:
    """The text encoder of a bundle, loaded on its own thread while the DiT weights stream in (the first step needs
    it), and warmed there with one first encode: of the prompts the run already knows (`prompts`: a single clip's,
    t2va), so the request's text encode is done before its load ends, else a throwaway one. `start` is Engine.load's
    `alongside` callback; a tensorrt bundle never calls it (everything is verified before loading), and `result` loads
    it on the calling thread."""

    def __init__(self, bundle_root: Path, device: torch.device, dtype: torch.dtype, prompts: tuple[str, ...] = ()):
        self.bundle_root, self.device, self.dtype, self.prompts = bundle_root, device, dtype, tuple(prompts)
        self.pending: Deferred | None = None
        self.imports_s: float | None = None

    def start(self, verification) -> None:
        # Every module the loader threads (and Engine.load's compiled code, after this) import is imported here
        # first, on this thread, before the text encoder's thread starts: two threads importing at once can see a
        # half-initialised module (import_loader_modules). The load pool's threads, already reading the weights,
        # import nothing; the imports (10 s on the H200 machine) still overlap the weights streaming in.
        self.imports_s = import_loader_modules()
        self.pending = Deferred(lambda: self._load(verification))

    def _load(self, verification) -> tuple[H3TextEncoder, float, float, dict]:
        for part in _TEXT_PARTS:
            verification.wait_prefix(f"{part}/")
        t0 = time.perf_counter()
        encoder = _text_encoder(self.bundle_root, self.device, self.dtype)
        load_s = time.perf_counter() - t0
        # The first encode while the weights still stream: the first call of every kernel (cuBLAS's handles, the
        # lazily loaded CUDA modules) is paid here, not by the request's text encode on the critical path.
        t0 = time.perf_counter()
        encoded = {prompt: encoder.encode_t2va(prompt) for prompt in self.prompts}
        if not encoded:
            encoder.encode_t2va("warm-up")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return encoder, load_s, time.perf_counter() - t0, encoded

    def result(self) -> tuple[H3TextEncoder, dict, dict]:
        """The text encoder, its part of the cold-start split and the prompts it encoded ({prompt: encoding})."""
        if self.pending is None:  # a tensorrt bundle: loaded and verified before this point
            return _text_encoder(self.bundle_root, self.device, self.dtype), {}, {}
        encoder, load_s, warmup_s, encoded = self.pending.result()
        # on its thread, overlapping the weights; then its first encode(s), on that thread
        split = {"text_encoder_load_s": round(load_s, 4), "text_encoder_warmup_s": round(warmup_s, 4)}
        return encoder, {**split, **({"text_prefetched": len(encoded)} if encoded else {})}, encoded


def _bundle_vaes(engine: Engine, bundle_root: Path, device: torch.device,
                 precision: VAEPrecision) -> tuple[VideoVAE, AudioVAE, float, dict]:
    """A bundle's VAEs (the video decoder's compiled tiles), their load's seconds and the bundle's verification report
    (every file checked: BundleVerification.wait_all; {} for a tensorrt bundle, verified before loading). Their
    files are verified first."""
    for component in ("video_vae", "vae", "audio_vae"):
        engine.component_ready(component)
    t0 = time.perf_counter()
    # On a side stream: the default stream is the denoise loop's, and 10 GB of copies queued there would hold up its
    # steps.
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        video_vae, audio_vae = _vaes(bundle_root, device, precision)
    if stream is not None:
        stream.synchronize()
    video_vae = video_vae.with_tile_decoders(engine.video_decoders(video_vae.vae))
    seconds = round(time.perf_counter() - t0, 4)
    verified = engine.verification.wait_all() if engine.verification is not None else {}
    return video_vae, audio_vae, seconds, verified
