"""The eager H3 pipeline: one request in, one MP4 (and a timing JSON beside it) out.

Reads top to bottom as the stages a request goes through:
  0. validate: inputs readable, canvas and duration allowed (before any model is loaded)
  1. text encode (Qwen3-VL to layer 50)
  2. condition encode: keyframes / reference images through the video VAE, reference audio through the audio VAE
  3. pack the sequence, draw the noise from the seed, denoise (one DiT evaluation per step)
  4. video decode (streamed a window at a time) and audio decode
  5. mux: H.264 + AAC under a temporary name, renamed when complete
"""

from __future__ import annotations

import contextlib
import platform
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer

from ..calibration.vae_fp8 import load_video_vae_at
from ..engines.bundle import Engine
from ..engines.manifest import BundleError, check_request, read_manifest, sha256_file
from ..models.audio_vae import AudioVAE
from ..models.checkpoint import load_dit
from ..models.dit import EagerDiT
from ..models.lora import LoraSpec, merge_loras
from ..models.step_cache import StepCache, StepCacheConfig
from ..models.packing import (
    AUDIO_SAMPLE_RATE, CANVAS_MULTIPLE, CANVAS_SHORT_EDGE, CANVAS_MAX_PIXELS, FPS, FRAMES_PER_CHUNK,
    LATENTS_PER_CHUNK, Geometry, PackedLayout, RefBlock, frames_for_duration, pack_ref2va, pack_t2va, resolve_canvas,
    row_timesteps, validate_canvas,
)
from ..models.sampler import (DEFAULT_SEED, DEFAULT_STEPS, Latents, Schedule, denoise, euler_step,
                              initial_latents)
from ..models.text_encoder import TOKENIZER_DIR, AudioRef, H3TextEncoder, ImageRef, VideoRef, quiet_transformers
from ..models.vae_checkpoint import load_audio_vae
from ..models.vae_precision import VAEPrecision
from ..models.video_vae import VideoVAE, image_to_pixels, prepare_keyframe
from .files import commit, discard, write_json_atomic, write_json_file  # noqa: F401 - write_json_atomic re-exported
from .guidance import Branch, guided_denoiser
from .media import MediaError, read_audio, read_image, read_video
from .parallel_vae import decode_and_write
from .step_profile import StepProfiler

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp"}
AUDIO_SUFFIXES = {".wav", ".mp3", ".flac", ".m4a", ".aac", ".ogg", ".opus"}
VIDEO_SUFFIXES = {".mp4", ".mov", ".mkv", ".webm", ".avi"}
REFERENCE_IMAGE_SHORT_EDGE = 2048  # reference images are encoded at their own short edge, upscaling included
SEED_RANGE = (-2 ** 63, 2 ** 64)  # what torch.Generator.manual_seed takes: int64 or uint64, [lo, hi)
# h3trt's budget for a prompt, in the checkpoint's tokens. The reference sets none; the text rows join every
# attention of every step, and H3's own prompts run tens to a few hundred tokens. Checked before any model loads.
MAX_PROMPT_TOKENS = 1024
MAX_REFERENCES = {"image": 9, "video": 3, "audio": 3, "total": 12}  # documented limits of the released model


@dataclass(frozen=True)
class Request:
    """One generation request, as the user states it."""

    prompt: str
    image: Path | None = None  # first keyframe (fl2va)
    last_image: Path | None = None  # last keyframe (fl2va)
    refs: tuple[Path, ...] = ()  # image / audio / video references (ref2va), in the order the model reads them
    seed: int = DEFAULT_SEED
    steps: int = DEFAULT_STEPS
    width: int | None = None
    height: int | None = None
    duration: float = 5.0  # seconds; rounded up to the next 17n + 5 frames
    video_shift: float | None = None  # None: the checkpoint's sigma_shift_scales (12)
    audio_shift: float | None = None  # None: the checkpoint's sigma_shift_scales (3)
    guidance: float = 1.0  # classifier-free guidance scale; 1: off (H3 is guidance-distilled)
    negative_prompt: str | None = None  # the negative branch's prompt (required when guidance > 1)
    cache: StepCacheConfig | None = None  # step caching (models/step_cache.py); None: every block of every step runs

    @property
    def task(self) -> str:
        if self.refs:
            return "ref2va"
        return "fl2va" if (self.image or self.last_image) else "t2va"


@dataclass
class Reference:
    kind: str  # image | audio | video
    path: Path
    image: Image.Image | None = None
    frames: np.ndarray | None = None  # uint8 [T, H, W, 3] at 24 fps
    audio: torch.Tensor | None = None  # [2, N] at 32 kHz


@dataclass
class Prepared:
    """A validated request: decoded inputs and the resolved geometry."""

    request: Request
    geometry: Geometry
    keyframes: list[tuple[str, Image.Image]] = field(default_factory=list)  # (anchor, image on the canvas)
    references: list[Reference] = field(default_factory=list)


@dataclass
class Encoded:
    """A request after stages 1-2 and the pack, waiting to be denoised with others of the same layout."""

    prepared: Prepared
    schedule: Schedule
    text_embeds: torch.Tensor  # [1, L, C_text]
    layout: PackedLayout
    latents: Latents  # starting rows [V, C] / [A, C], drawn from the request's own seed


@dataclass(frozen=True)
class CanvasDefaults:
    """How a model picks a canvas when the request names none."""

    short_edge: int = CANVAS_SHORT_EDGE
    max_pixels: int = CANVAS_MAX_PIXELS
    reference_short_edge: int = REFERENCE_IMAGE_SHORT_EDGE


def _reference_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    for kind, suffixes in (("image", IMAGE_SUFFIXES), ("audio", AUDIO_SUFFIXES), ("video", VIDEO_SUFFIXES)):
        if suffix in suffixes:
            return kind
    raise MediaError(f"{path}: cannot tell whether this reference is an image, audio or video from '{suffix}'; "
                     f"use one of {sorted(IMAGE_SUFFIXES | AUDIO_SUFFIXES | VIDEO_SUFFIXES)}.")


def prepare(request: Request, canvas: CanvasDefaults = CanvasDefaults()) -> Prepared:
    """Stage 0: read every input and resolve the geometry, raising one clear error before any model work."""
    for what, text in (("prompt", request.prompt), ("negative prompt", request.negative_prompt)):
        if text is not None:
            check_utf8(text, what)
    if not request.prompt.strip():
        raise ValueError("The prompt is empty; pass --prompt \"...\".")
    if isinstance(request.seed, bool) or not isinstance(request.seed, int) or not (
            SEED_RANGE[0] <= request.seed < SEED_RANGE[1]):
        raise ValueError(f"seed {request.seed} is outside [-2^63, 2^64), the range torch.Generator takes; pass a "
                         "seed in that range.")
    if request.steps < 2:
        raise ValueError(f"--steps must be at least 2 (the grid includes the final sigma 0), got {request.steps}.")
    if request.refs and (request.image or request.last_image):
        raise ValueError("--ref (ref2va) cannot be combined with --image/--last-image (fl2va); pick one task.")
    Schedule(request.steps, request.video_shift or 12.0, request.audio_shift or 3.0)  # validates shifts
    if request.guidance < 1.0:
        raise ValueError(f"--guidance must be >= 1 (1 = off, the default: H3 is guidance-distilled), got "
                         f"{request.guidance}.")
    if request.negative_prompt is not None and request.guidance == 1.0:
        raise ValueError("--negative-prompt only acts with --guidance > 1 (H3 is guidance-distilled and runs one "
                         "branch by default); pass --guidance too, or drop --negative-prompt.")
    if request.guidance > 1.0 and not (request.negative_prompt or "").strip():
        raise ValueError(f"--guidance {request.guidance:g} needs --negative-prompt \"...\": the negative branch "
                         "is the request with that prompt (H3's text encoder takes no empty prompt).")
    num_frames = frames_for_duration(request.duration)

    keyframes = [(anchor, read_image(path)) for anchor, path in (("first", request.image),
                                                                  ("last", request.last_image)) if path]
    if (request.width is None) != (request.height is None):
        raise ValueError("--width and --height go together: pass both, or neither for the model's canvas.")
    if request.width is not None:
        height, width = request.height, request.width
    else:
        aspect = keyframes[0][1].size if keyframes else (16, 9)
        height, width = resolve_canvas(*aspect, short_edge=canvas.short_edge, max_pixels=canvas.max_pixels)
    validate_canvas(height, width)
    keyframes = [(anchor, prepare_keyframe(img, height, width, stretch=i == 0)) for i, (anchor, img) in
                 enumerate(keyframes)]

    references = []
    for path in request.refs:
        kind = _reference_kind(Path(path))
        ref = Reference(kind, Path(path))
        if kind == "image":
            ref.image = _reference_image(read_image(path), canvas.reference_short_edge)
        elif kind == "audio":
            # Cut to the clip's length at the file's own rate, then resampled once, as the reference does.
            ref.audio = torch.from_numpy(read_audio(path, AUDIO_SAMPLE_RATE, max_seconds=num_frames / FPS))
        else:
            frames, fps, audio = read_video(path, max_audio_seconds=num_frames / FPS)
            ref.frames = _reference_frames(frames, fps, num_frames, canvas)
            if audio is not None:
                ref.audio = torch.from_numpy(audio)
        references.append(ref)
    kinds = [r.kind for r in references]
    for kind in ("image", "video", "audio"):
        if kinds.count(kind) > MAX_REFERENCES[kind]:
            raise ValueError(f"MiniMax-H3 takes at most {MAX_REFERENCES[kind]} {kind} references, got {kinds.count(kind)}.")
    if len(kinds) > MAX_REFERENCES["total"]:
        raise ValueError(f"MiniMax-H3 takes at most {MAX_REFERENCES['total']} references, got {len(kinds)}.")
    if kinds and set(kinds) == {"audio"}:
        raise ValueError("An audio reference must be paired with at least one image or video reference.")
    return Prepared(request, Geometry(height, width, num_frames), keyframes, references)


def check_utf8(text: str, what: str = "prompt") -> None:
    """Refuse text that is not valid UTF-8: arguments with undecodable bytes reach Python as lone surrogates
    (surrogateescape), which the tokenizer and the JSON record cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = text[e.start]
        byte = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else f"character {char!r}"
        raise ValueError(f"The {what} is not valid UTF-8 ({byte} at position {e.start}); re-encode it as UTF-8."
                         ) from None


def check_prompt_tokens(component_root: Path, prompts: list[tuple[str, str]]) -> None:
    """Refuse prompts over MAX_PROMPT_TOKENS, counted by the checkpoint's own tokenizer (loaded only for prompts
    longer than the budget in bytes: a byte-level BPE token covers at least one byte). `prompts`: (where, prompt)
    pairs; every one over the budget is listed in one error."""
    long = [(where, p) for where, p in prompts if len(p.encode("utf-8")) > MAX_PROMPT_TOKENS]
    if not long:
        return
    tokenizer = AutoTokenizer.from_pretrained(Path(component_root) / TOKENIZER_DIR, local_files_only=True)
    over = []
    for where, p in long:
        n = len(tokenizer(p, add_special_tokens=False)["input_ids"])
        if n > MAX_PROMPT_TOKENS:
            over.append(f"{where} has {n} tokens")
    if over:
        raise ValueError(f"{'; '.join(over)}; h3trt takes prompts of at most {MAX_PROMPT_TOKENS} tokens. Shorten it.")


def _reference_image(image: Image.Image, short_edge: int) -> Image.Image:
    """A reference image at its own short edge (multiples of 32, upscaling included, no area cap), LANCZOS."""
    width, height = image.size
    if width > 4 * height or height > 4 * width:
        raise ValueError(f"A reference image must be within 1:4 and 4:1, got {width}x{height}.")
    scale = short_edge / min(width, height)
    m = CANVAS_MULTIPLE
    size = (max(m, round(width * scale / m) * m), max(m, round(height * scale / m) * m))
    return image if image.size == size else image.resize(size, Image.Resampling.LANCZOS)


def _reference_frames(frames: np.ndarray, fps: float, num_frames: int, canvas: CanvasDefaults) -> np.ndarray:
    """A reference video on 24 fps (hold each frame until the next one's slot), truncated to the generated length,
    on the canvas of its own aspect ratio, snapped down to 17n + 5 frames for the VAE."""
    if fps != FPS:
        scale = FPS / fps
        slots = np.floor(np.arange(frames.shape[0]) * scale + 0.5).astype(np.int64)
        frames = np.repeat(frames, np.diff(slots, append=int(np.floor(frames.shape[0] * scale + 0.5))), axis=0)
    frames = frames[:num_frames]
    usable = max(1, (frames.shape[0] - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK) * FRAMES_PER_CHUNK + LATENTS_PER_CHUNK
    if frames.shape[0] < usable:
        raise ValueError(f"A reference video needs at least {usable} frames at {FPS} fps, got {frames.shape[0]}.")
    frames = frames[:usable]
    height, width = resolve_canvas(frames.shape[2], frames.shape[1], canvas.short_edge, canvas.max_pixels)
    if frames.shape[1:3] != (height, width):
        frames = np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.LANCZOS))
                           for f in frames])
    return frames


class StageTimer:
    """Wall time per stage, synchronising the device so GPU work is charged to the stage that queued it. `spans` keeps
    each stage's first start and last end in Unix seconds, so a record shows the gaps between stages."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self.spans: dict[str, list[float]] = {}
        self.step_marks: list[float] = []  # seconds since the denoise stage began, at each step's callback
        self.step_profile: dict | None = None  # --profile-step's host-overhead report
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


class Deferred:
    """A value built on a background thread (the VAEs while the DiT loads and denoises); `result()` waits for it and
    raises what the builder raised. `seconds` is how long the builder ran."""

    def __init__(self, build: Callable[[], object]):
        self._value, self._error, self.seconds = None, None, None
        self._thread = threading.Thread(target=self._run, args=(build,), name="h3trt-deferred", daemon=True)
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


class H3Pipeline:
    """Loaded components for one task partition. Constructed from built parts; `load` reads a checkpoint,
    `load_engine` a bundle."""

    def __init__(self, dit, text_encoder, video_vae: VideoVAE | None, audio_vae: AudioVAE | None,
                 shifts: tuple[float, float], device: torch.device, canvas: CanvasDefaults = CanvasDefaults(),
                 check_request=None, cfg_group=None, loras: tuple[dict, ...] = (),
                 deferred_vaes: Deferred | None = None, load_report: dict | None = None):
        """`deferred_vaes`: (video VAE, audio VAE) still loading on a background thread, in place of the two
        (a bundle's cold start: the first denoise step needs neither); the first use waits for them.
        `load_report`: a bundle's cold-start split (Engine.load_report and the components), for every record."""
        if (video_vae is None) != (deferred_vaes is not None) or (audio_vae is None) != (deferred_vaes is not None):
            raise ValueError("H3Pipeline takes either both VAEs or deferred_vaes, not a mix.")
        self.dit, self.text_encoder, self._vaes = dit, text_encoder, (video_vae, audio_vae)
        self._deferred_vaes, self.load_report = deferred_vaes, load_report
        self.shifts, self.device, self.canvas = shifts, torch.device(device), canvas
        self.check_request = check_request  # a bundle's admission check: (prepared, schedule) -> None or raise
        self.cfg_group = cfg_group  # the 2-rank group that splits guidance branches (None: both run here)
        self.loras = tuple(loras)  # records of the LoRAs merged into the DiT (models/lora.py), for every clip record

    def _ready_vaes(self) -> tuple[VideoVAE, AudioVAE]:
        if self._deferred_vaes is not None:
            self._vaes, self._deferred_vaes = self._deferred_vaes.result(), None
        return self._vaes

    @property
    def video_vae(self) -> VideoVAE:
        return self._ready_vaes()[0]

    @property
    def audio_vae(self) -> AudioVAE:
        return self._ready_vaes()[1]

    @classmethod
    def load(cls, model_root: Path, task: str, device: str = "cpu", canvas: CanvasDefaults = CanvasDefaults(),
             vae_precision: str | None = None, loras: tuple[LoraSpec, ...] = ()):
        """The eager pipeline for `task`'s partition, with `loras` merged into its DiT; `vae_precision` None: bf16 on
        CUDA, fp32 on the CPU (VAEPrecision.default)."""
        device = torch.device(device)
        vae = VAEPrecision.resolve(vae_precision, device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model, source = load_dit(model_root, task, dtype=dtype, device=device)
        records = merge_loras(model, loras, task)
        shifts = source.shifts
        return cls(EagerDiT(model), *eager_components(source.component_root, device, dtype, vae), shifts, device,
                   canvas, loras=records)

    @classmethod
    def load_engine(cls, bundle_root: Path, device: str = "cpu", canvas: CanvasDefaults = CanvasDefaults(),
                    mesh=None, sp_group=None, cfg_group=None, vae_precision: str | None = None,
                    trust: Path | None = None):
        """A bundle's pipeline for one rank: `mesh` is the launched MeshConfig (None: one process), checked against
        the bundle's; `sp_group` / `cfg_group` this rank's groups. The video VAE runs at the bundle's
        --vae-precision (its decoder was compiled for it); `vae_precision`, when given, must be that one; `trust` a
        public key the bundle must be signed with (Engine.load)."""
        device = torch.device(device)
        start = time.perf_counter()
        # diffusers resolves its classes lazily, and two threads importing through it (and transformers) at once can
        # see a half-initialised module (measured: "cannot import name 'AutoModel'"): resolve the VAE classes here.
        import diffusers

        diffusers.AutoencoderKLMiniMaxH3, diffusers.AutoencoderKLMiniMaxH3Audio
        text_parts = ("text_encoder", "tokenizer", "processor")
        # Engine.load reads and checks the manifest (and its signature) again; this is only for the text dtype.
        dtype = torch.float32 if read_manifest(bundle_root)["precision"] == "fp32" else torch.bfloat16
        pending: dict[str, Deferred] = {}

        def text_encoder_alongside(verification) -> None:
            # The text encoder loads on its own thread while the DiT weights stream in: the first step needs it.
            def load_text():
                for part in text_parts:
                    verification.wait_prefix(f"{part}/")
                t0 = time.perf_counter()
                return _text_encoder(Path(bundle_root), device, dtype), time.perf_counter() - t0

            pending["text"] = Deferred(load_text)

        engine = Engine.load(bundle_root, device, mesh, sp_group, trust=trust, early=text_parts,
                             alongside=text_encoder_alongside)
        engine_s = time.perf_counter() - start
        m = engine.manifest
        if vae_precision is not None and vae_precision != m["vae_precision"]:
            VAEPrecision(vae_precision)  # an unknown name gets the list of known ones
            raise BundleError(f"This bundle's video decoder was compiled at --vae-precision {m['vae_precision']}; "
                              f"the run asks for {vae_precision}. Leave --vae-precision out to serve the bundle's, "
                              f"or rebuild with h3trt build --vae-precision {vae_precision}.")

        def admit(prepared: Prepared, schedule: Schedule) -> None:
            geo = prepared.geometry
            check_request(m, geo.width, geo.height, geo.num_frames, schedule.steps, schedule.video_shift,
                          schedule.audio_shift, prepared.request.task)

        shifts = (m["schedule"]["video_shift"], m["schedule"]["audio_shift"])
        report = {"engine": engine.load_report, "engine_s": round(engine_s, 4)}

        def vaes() -> tuple[VideoVAE, AudioVAE]:
            # Off the cold-start path: the first denoise step needs neither VAE (a keyframe's encode, or the decode,
            # waits for them). Their files are verified first; then every bundle file has been checked.
            for component in ("video_vae", "vae", "audio_vae"):
                engine.component_ready(component)
            t0 = time.perf_counter()
            # On a side stream: the default stream is the denoise loop's, and 10 GB of copies queued there would
            # hold up its steps.
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                video_vae, audio_vae = _vaes(Path(bundle_root), device, VAEPrecision(m["vae_precision"]))
            if stream is not None:
                stream.synchronize()
            video_vae.tile_decoders = engine.video_decoders(video_vae.vae)
            report["vae_load_s"] = round(time.perf_counter() - t0, 4)
            if engine.verification is not None:  # a tensorrt bundle verified every file before loading
                report.update(engine.verification.wait_all())
            return video_vae, audio_vae

        t0 = time.perf_counter()
        if "text" in pending:
            text_encoder, load_s = pending["text"].result()
            report["text_encoder_load_s"] = round(load_s, 4)  # on its thread, overlapping the weights
        else:  # a tensorrt bundle: loaded and verified before this point
            text_encoder = _text_encoder(Path(bundle_root), device, dtype)
        report["text_encoder_wait_s"] = round(time.perf_counter() - t0, 4)  # after the DiT was ready
        deferred = Deferred(vaes)  # after the text encoder: one loader thread inside transformers/diffusers at a time
        report["total_s"] = round(time.perf_counter() - start, 4)  # bundle on hand, ready to encode and denoise
        return cls(engine.dit, text_encoder, None, None, shifts, device, canvas, admit, cfg_group,
                   loras=m.get("loras") or (), deferred_vaes=deferred, load_report=report)

    def schedule(self, request: Request) -> Schedule:
        return Schedule(request.steps, request.video_shift or self.shifts[0], request.audio_shift or self.shifts[1])

    @torch.no_grad()
    def generate(self, prepared: Prepared, output: Path, crf: int = 18,
                 on_step: Callable[[int, int], None] | None = None, write: bool = True,
                 decode_group=None, finish: Callable[[dict], None] | None = None,
                 overwrite: bool = False, profile_step: int | None = None) -> dict | None:
        """Run stages 1-5 for a prepared request; returns the record written beside the MP4 (None on a rank that does
        not write). With `decode_group` (the ranks of one replica group, the writer first) every rank decodes its
        share of the video tiles and only the writer (write=True) writes; without it a rank with write=False stops
        after denoising. `finish(record)` completes the record before it is written; the MP4 and the record are then
        committed together, never replacing existing files unless `overwrite` (files.commit). `profile_step`: the
        evaluation (from 1) whose host overhead is measured (step_profile.py)."""
        timer, start = StageTimer(self.device), time.perf_counter()
        cache = new_step_cache(prepared.request, self.schedule(prepared.request))
        schedule, layout, final = self.denoise_request(prepared, on_step, timer, cache, profile_step)
        if not write and decode_group is None:
            return None

        # 4-5. Decode and mux, streamed: a window of frames is encoded while the next decodes.
        frames_written, audio_samples, mp4_temp = self._decode_and_mux(prepared, layout, final, output, crf, timer,
                                                                       decode_group)
        if not write:
            return None
        record = self._record(prepared, schedule, layout, output, frames_written, audio_samples, timer)
        if cache is not None:
            record["step_cache"] = cache.report()
        record["wall_s"] = round(time.perf_counter() - start, 4)  # the stages overlap (decode, audio, encode)
        return commit_clip(record, mp4_temp, Path(output), finish, overwrite)

    @torch.no_grad()
    def denoise_request(self, prepared: Prepared, on_step: Callable[[int, int], None] | None = None,
                        timer: StageTimer | None = None, cache: StepCache | None = None,
                        profile_step: int | None = None) -> tuple[Schedule, PackedLayout, Latents]:
        """Stages 1-3 for a prepared request: the schedule, the packed layout and the final latent rows. A request
        with a step cache fills `cache` (a new one when None) with what it skipped."""
        req, timer = prepared.request, timer or StageTimer(self.device)
        schedule = self.schedule(req)
        cache = cache or new_step_cache(req, schedule)
        if self.check_request is not None:
            self.check_request(prepared, schedule)
        if self.cfg_group is not None and req.guidance == 1.0:
            raise ValueError("This job splits guidance branches over cfg=2 rank groups, but the request has no "
                             "guidance (--guidance 1, H3's default); launch with --cfg 1 or pass --guidance > 1.")

        # 1. Text (and the negative branch's text under guidance).
        with timer("text_encode"):
            text = self._encode_text(prepared)
            negative = self._encode_text(prepared, req.negative_prompt) if req.guidance > 1.0 else None

        # 2. Conditions, in packed order.
        with timer("condition_encode"):
            conditions = self._encode_conditions(prepared)

        # 3. Pack, noise, denoise.
        layout, latents = self._pack(prepared, text.tags, conditions)
        branches = None
        if negative is not None:
            branches = (Branch(text.embeds.to(self.device), layout.to(self.device)),
                        Branch(negative.embeds.to(self.device),
                               self._pack(prepared, negative.tags, conditions)[0].to(self.device)))
        if profile_step is not None and not 1 <= profile_step <= schedule.num_evaluations:
            raise ValueError(f"--profile-step {profile_step}: this request runs {schedule.num_evaluations} "
                             "evaluations (count from 1).")
        with timer("denoise"):
            begun = time.perf_counter()

            def stepped(i: int, n: int) -> None:
                timer.step_marks.append(time.perf_counter() - begun)
                if on_step is not None:
                    on_step(i, n)

            final = self._denoise(text.embeds, layout, latents, schedule, stepped, branches, req.guidance, cache,
                                  profile_step, timer)
        if cache is not None and self.cfg_group is not None:  # every rank of the cfg group: a collective
            cache.gather(self.cfg_group)
        return schedule, layout, final

    @torch.no_grad()
    def encode_request(self, prepared: Prepared, timer: StageTimer | None = None) -> Encoded:
        """Stages 1-2 and the pack of a request that will be denoised in a batch (single-branch: no guidance)."""
        req, timer = prepared.request, timer or StageTimer(self.device)
        schedule = self.schedule(req)
        if self.check_request is not None:
            self.check_request(prepared, schedule)
        if getattr(req, "guidance", 1.0) != 1.0:
            raise ValueError("Batched requests run one branch (guidance 1, H3's default); run a guided request alone.")
        if getattr(req, "cache", None) is not None:
            raise ValueError("Step caching decides per request, and a batch shares one evaluation per step; run a "
                             "cached request alone (h3trt run --prompt ... --cache ...).")
        with timer("text_encode"):
            text = self._encode_text(prepared)
        with timer("condition_encode"):
            conditions = self._encode_conditions(prepared)
        layout, latents = self._pack(prepared, text.tags, conditions)
        return Encoded(prepared, schedule, text.embeds, layout, latents)

    @torch.no_grad()
    def denoise_batch(self, batch: list[Encoded], on_step: Callable[[int, int], None] | None = None) -> list[Latents]:
        """Stage 3 for requests of one layout and schedule, stacked along the batch dimension: one DiT evaluation per
        step serves them all; each keeps its own seed's starting rows, so each ends where it would alone."""
        first = batch[0]
        for other in batch[1:]:
            if other.schedule != first.schedule or not same_layout(other.layout, first.layout):
                raise ValueError("denoise_batch needs one schedule and one packed layout (task, canvas, duration and "
                                 f"text length) for the whole batch; {other.prepared.request.prompt[:40]!r} differs "
                                 f"from {first.prepared.request.prompt[:40]!r}.")
        device, dit, schedule = self.device, self.dit, first.schedule
        layout, lay = first.layout, first.layout.to(device)
        text_BLC = torch.cat([e.text_embeds for e in batch]).to(device)
        video = torch.stack([e.latents.video for e in batch]).to(device)  # [B, V, C] fp32
        audio = torch.stack([e.latents.audio for e in batch]).to(device)  # [B, A, C] fp32
        cv, ca = layout.num_condition_video_rows, layout.num_condition_audio_rows
        sv, sa = schedule.video_sigmas, schedule.audio_sigmas
        steps = schedule.timesteps()
        # The loop of `sampler.denoise` with a batch dimension: the same ops per item, so B = 1 is bitwise equal.
        for i, (tv, ta) in enumerate(steps):
            unique_t, t_index = row_timesteps(layout, tv, ta)
            v_video, v_audio = dit(video, audio, text_BLC, unique_t.to(device), t_index.to(device), lay)
            video[:, cv:] = euler_step(video[:, cv:], v_video[:, cv:], tv, sv[i], sv[i + 1])
            audio[:, ca:] = euler_step(audio[:, ca:], v_audio[:, ca:], ta, sa[i], sa[i + 1])
            if on_step is not None:
                on_step(i + 1, len(steps))
        return [Latents(video[b], audio[b]) for b in range(len(batch))]

    @torch.no_grad()
    def decode_request(self, encoded: Encoded, final: Latents, output: Path, crf: int = 18,
                       timer: StageTimer | None = None, group=None, write: bool = True,
                       finish: Callable[[dict], None] | None = None, overwrite: bool = False) -> dict | None:
        """Stages 4-5 for one request of a batch; returns its record, committed with the MP4 as in `generate` (None
        on a rank of `group` that does not write: it decodes its share of the tiles)."""
        timer = timer or StageTimer(self.device)
        frames_written, audio_samples, mp4_temp = self._decode_and_mux(encoded.prepared, encoded.layout, final,
                                                                       output, crf, timer, group)
        if not write:
            return None
        record = self._record(encoded.prepared, encoded.schedule, encoded.layout, output, frames_written,
                              audio_samples, timer)
        return commit_clip(record, mp4_temp, Path(output), finish, overwrite)

    def generate_batch(self, prepared: list[Prepared], outputs: list[Path], crf: int = 18,
                       on_step: Callable[[int, int], None] | None = None) -> list[dict]:
        """Stages 1-5 for requests of one layout, denoised as one batch; one record per request, in order."""
        if len(prepared) != len(outputs):
            raise ValueError(f"generate_batch got {len(prepared)} requests but {len(outputs)} outputs.")
        timers = [StageTimer(self.device) for _ in prepared]
        encoded = [self.encode_request(p, t) for p, t in zip(prepared, timers)]
        start = time.perf_counter()
        finals = self.denoise_batch(encoded, on_step)
        end = time.perf_counter()
        for timer in timers:
            timer.add("denoise", start, end)
        return [self.decode_request(e, f, o, crf, t) for e, f, o, t in zip(encoded, finals, outputs, timers)]

    def _record(self, prepared: Prepared, schedule: Schedule, layout: PackedLayout, output: Path, frames_written: int,
                audio_samples: int, timer: StageTimer) -> dict:
        """The provenance and timing record written beside an MP4."""
        req, geo = prepared.request, prepared.geometry
        return {
            "output": str(output), "task": req.task, "prompt": req.prompt, "seed": req.seed,
            "steps": req.steps, "evaluations": schedule.num_evaluations,
            "shifts": {"video": schedule.video_shift, "audio": schedule.audio_shift},
            "width": geo.width, "height": geo.height, "frames": frames_written, "fps": FPS,
            "audio_samples": int(audio_samples), "audio_sample_rate": AUDIO_SAMPLE_RATE,
            "sequence_rows": layout.seq_len, "device": str(self.device), "vae_precision": self.video_vae.precision,
            "torch": torch.__version__, "python": platform.python_version(),
            "timings_s": {k: round(v, 4) for k, v in timer.seconds.items()},
            "spans_unix": {k: [round(a, 4), round(b, 4)] for k, (a, b) in timer.spans.items()},
            # Host-side marks: a step's kernels are queued ahead, and each step waits for the one before (the baked
            # AdaLN lookup syncs), so the differences are the steps' device times within one step's queueing.
            "step_marks_s": [round(m, 4) for m in timer.step_marks],
            "video_decoder": "compiled" if self.video_vae.tile_decoders else "eager",
            **({"step_profile": timer.step_profile} if timer.step_profile is not None else {}),
            **({"load": self.load_report} if self.load_report is not None else {}),
            **({"peak_memory_gib": {"allocated": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3),
                                    "reserved": round(torch.cuda.max_memory_reserved(self.device) / 2**30, 3)}}
               if self.device.type == "cuda" else {}),
            **({"loras": list(self.loras)} if self.loras else {}),
        }

    def _encode_conditions(self, prepared: Prepared) -> tuple[list[torch.Tensor], list[torch.Tensor], list[RefBlock]]:
        """Stage 2: visual condition latents and reference audio rows in packed order, and the ref2va blocks."""
        conditions, ref_audio, ref_blocks = [], [], []
        for _, image in prepared.keyframes:
            conditions.append(self.video_vae.encode_condition(image_to_pixels(image)))
        for ref in prepared.references:
            block_audio = 0
            if ref.audio is not None:
                rows = self.audio_vae.encode_rows(ref.audio)
                ref_audio.append(rows)
                block_audio = rows.shape[0] // 2
            if ref.kind == "image":
                conditions.append(self.video_vae.encode_condition(image_to_pixels(ref.image)))
            elif ref.kind == "video":
                pixels = torch.from_numpy(ref.frames.copy()).permute(3, 0, 1, 2)[None]
                conditions.append(self.video_vae.encode_condition(pixels))
            latent_shape = tuple(conditions[-1].shape[2:]) if ref.kind != "audio" else None
            ref_blocks.append(RefBlock(ref.kind, latent_shape, block_audio))
        return conditions, ref_audio, ref_blocks

    def _pack(self, prepared: Prepared, text_tags: torch.Tensor, conditions) -> tuple[PackedLayout, Latents]:
        """Stage 3 set-up: the packed layout and the seeded starting rows."""
        req, geo, cfg = prepared.request, prepared.geometry, self.dit.cfg
        visual, ref_audio, ref_blocks = conditions
        lf, lh, lw, la = geo.latent_frames, geo.latent_height, geo.latent_width, geo.audio_latents
        if req.task == "ref2va":
            layout = pack_ref2va(text_tags, ref_blocks, lf, lh, lw, la, cfg.patch_size)
        else:
            layout = pack_t2va(text_tags, lf, lh, lw, la, cfg.patch_size, tuple(a for a, _ in prepared.keyframes))
        latents = initial_latents(req.seed, lf, lh, lw, la, cfg.patch_size, cfg.in_channels, cfg.audio_in_channels,
                                  tuple(visual), tuple(ref_audio))
        return layout, latents

    def _decode_and_mux(self, prepared: Prepared, layout: PackedLayout, final: Latents, output: Path, crf: int,
                        timer: StageTimer, group=None) -> tuple[int, int, Path | None]:
        """Stages 4-5 for one request's final rows [V, C] / [A, C]: returns (frames written, audio samples, the
        finished MP4 under its temporary name on the writing rank, not committed yet).

        Tile-parallel over `group` (None: this process alone; otherwise every rank of the group calls this with the
        same rows and only group rank 0 writes); frames are encoded on a background thread while later windows
        decode, AAC as soon as the audio is ready (h3trt/runtime/parallel_vae.py)."""
        geo, cfg = prepared.geometry, self.dit.cfg
        lf, lh, lw = geo.latent_frames, geo.latent_height, geo.latent_width
        start = time.perf_counter()
        video_vae, audio_vae = self.video_vae, self.audio_vae  # a bundle's VAEs may still be loading: wait here
        timer.span("wait_vaes", start, time.perf_counter())
        video_rows = final.video[layout.num_condition_video_rows:]
        video_latents = video_rows.reshape(1, lf, lh // cfg.patch_size[1], lw // cfg.patch_size[2], cfg.in_channels,
                                           *cfg.patch_size).permute(0, 4, 1, 5, 2, 6, 3, 7)
        video_latents = video_latents.reshape(1, cfg.in_channels, lf, lh, lw)
        start = time.perf_counter()
        result = decode_and_write(video_vae, audio_vae, video_latents,
                                  final.audio[layout.num_condition_audio_rows:], output, group=group, fps=FPS,
                                  crf=crf, sample_rate=AUDIO_SAMPLE_RATE, commit=False)
        timer.span("decode_and_mux", start, time.perf_counter())
        for stage, seconds in result["timings_s"].items():  # video_decode, audio_decode, mux, decode_tail_s
            timer.seconds[stage] = timer.seconds.get(stage, 0.0) + seconds
        return result["frames"], result["audio_samples"], result["mp4_temp"]

    def _encode_text(self, prepared: Prepared, prompt: str | None = None):
        """The request's prompt (or `prompt`: the negative branch's) with the task's visual context."""
        req = prepared.request
        prompt = req.prompt if prompt is None else prompt
        if req.task == "t2va":
            return self.text_encoder.encode_t2va(prompt)
        if req.task == "fl2va":
            return self.text_encoder.encode_fl2va(prompt, [img for _, img in prepared.keyframes])
        refs = []
        for ref in prepared.references:
            if ref.kind == "image":
                refs.append(ImageRef(ref.image))
            elif ref.kind == "audio":
                refs.append(AudioRef())
            else:
                refs.append(VideoRef(ref.frames, float(FPS), has_audio=ref.audio is not None))
        return self.text_encoder.encode_ref2va(prompt, refs)

    def _denoise(self, text_embeds, layout: PackedLayout, latents: Latents, schedule: Schedule, on_step,
                 branches: tuple[Branch, Branch] | None = None, guidance: float = 1.0,
                 cache: StepCache | None = None, profile_step: int | None = None, timer: StageTimer | None = None):
        dit, device = self.dit, self.device
        lay = layout.to(device)
        text = text_embeds.to(device)
        cond = cache.context("cond") if cache is not None and branches is None else None  # the reference's name

        def unguided(video, audio, unique_t, t_index):
            return dit(video, audio, text, unique_t, t_index, lay, cache=cond)

        model = unguided if branches is None else guided_denoiser(dit, *branches, guidance, self.cfg_group, cache)
        profiler = None
        if profile_step is not None:
            model = profiler = StepProfiler(model, profile_step, device)

        start = Latents(latents.video.to(device), latents.audio.to(device))
        final = denoise(model, start, layout, schedule, on_step)
        if profiler is not None and timer is not None:
            timer.step_profile = profiler.report
        return final


def new_step_cache(request: Request, schedule: Schedule) -> StepCache | None:
    """A generation's step cache, or None when the request asks for none."""
    config = getattr(request, "cache", None)
    return StepCache(config, schedule.num_evaluations) if config is not None else None



def commit_clip(record: dict, mp4_temp: Path, output: Path, finish: Callable[[dict], None] | None = None,
                overwrite: bool = False) -> dict:
    """Stage 5's last step: the record (with the MP4's sha256, completed by `finish`) and the finished MP4 renamed
    into place together, or neither (files.commit: no-clobber unless `overwrite`)."""
    try:
        record["mp4_sha256"] = sha256_file(mp4_temp)
        if finish is not None:
            finish(record)
        json_temp = write_json_file(record_path(output), record)
    except BaseException:
        discard(mp4_temp)
        raise
    # The record first: when the MP4 appears under its name, its record is already beside it.
    commit([(json_temp, record_path(output)), (mp4_temp, output)], overwrite=overwrite)
    return record


def record_path(output: Path) -> Path:
    """The timing/provenance JSON beside an MP4: clip.mp4 -> clip.json."""
    return output.with_suffix(".json")


def request_dict(request: Request) -> dict:
    data = asdict(request)
    for key in ("image", "last_image"):
        data[key] = str(data[key]) if data[key] else None
    data["refs"] = [str(p) for p in request.refs]
    if request.cache is not None:
        data["cache"] = request.cache.to_dict()
    return data


def same_layout(a: PackedLayout, b: PackedLayout) -> bool:
    """Whether two requests pack into the same rows (so they can share one batched DiT evaluation)."""
    return (a.num_condition_video_rows == b.num_condition_video_rows
            and a.num_condition_audio_rows == b.num_condition_audio_rows
            and all(torch.equal(getattr(a, k), getattr(b, k))
                    for k in ("position_ids", "token_tags", "video_index", "audio_index", "text_index")))
