"""Requests: what a user asks for, and stage 0 of a generation (every input read and the geometry resolved before any
model loads). `Encoded` is a request after stages 1-2 and the pack, the unit a batch denoises together."""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..engines.manifest import Manifest
from ..engines.request_check import check_request
from ..errors import UserError, about
from ..media.inputs import MediaError, read_audio, read_image, read_video
from ..models.checkpoint import check_component_files
from ..models.packing import (AUDIO_SAMPLE_RATE, CANVAS_MAX_PIXELS, CANVAS_MULTIPLE, CANVAS_SHORT_EDGE,
                              DEFAULT_DURATION, FPS, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK, Geometry, PackedLayout,
                              frames_for_duration, resolve_canvas, validate_canvas)
from ..models.sampler import (DEFAULT_AUDIO_SHIFT, DEFAULT_GUIDANCE, DEFAULT_SEED, DEFAULT_STEPS, DEFAULT_VIDEO_SHIFT,
                              Latents, Schedule, check_steps)
from ..models.step_cache import StepCacheConfig
from ..models.text_encoder import TOKENIZER_DIR
from ..models.video_vae import prepare_keyframe
from ..models.vsa_plan import refuse_subblock
from ..request.parts import ScheduleFrom, task_of  # their home since issue 48
from .adapters import AdapterUse, lora_field

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp"}
AUDIO_SUFFIXES = {".wav", ".mp3", ".flac", ".m4a", ".aac", ".ogg", ".opus"}
VIDEO_SUFFIXES = {".mp4", ".mov", ".mkv", ".webm", ".avi"}
REFERENCE_IMAGE_SHORT_EDGE = 2048  # reference images are encoded at their own short edge, upscaling included
SEED_RANGE = (-2 ** 63, 2 ** 64)  # what torch.Generator.manual_seed takes: int64 or uint64, [lo, hi)
# h3trt's budget for a prompt, in the checkpoint's tokens. The reference sets none; the text rows join every
# attention of every step, and H3's own prompts run tens to a few hundred tokens. Checked before any model loads.
MAX_PROMPT_TOKENS = 1024
# A prompt's bytes at most: the token budget at 16 bytes a token, far more than any text averages (English about 4,
# CJK about 3), so no prompt within the token budget is refused, and a longer one is refused without tokenizing it.
MAX_PROMPT_BYTES = 16 * MAX_PROMPT_TOKENS
MAX_REFERENCES = {"image": 9, "video": 3, "audio": 3, "total": 12}  # documented limits of the released model


@dataclass(frozen=True)
class Names:
    """What the user calls each request field, for the errors: the CLI's flags, a requests file's keys, or the
    server's JSON fields (`prepare` and the requests parser word their errors with these)."""

    prompt: str = "--prompt"
    negative_prompt: str = "--negative-prompt"
    seed: str = "--seed"
    steps: str = "--steps"
    duration: str = "--duration"
    size: str = "--width and --height"
    guidance: str = "--guidance"
    video_shift: str = "--video-shift"
    audio_shift: str = "--audio-shift"
    image: str = "--image"
    last_image: str = "--last-image"
    refs: str = "--ref"
    request: str = "the request"  # what holds the fields, in "the request's inputs make it t2va"


FLAGS = Names()  # h3trt run's
KEYS = Names("prompt", "negative_prompt", "seed", "steps", "duration", "width and height", "guidance", "video_shift",
             "audio_shift", "image", "last_image", "refs", "the line")  # a requests file's (pipeline/parse.py)


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
    duration: float = DEFAULT_DURATION  # seconds; rounded up to the next 17n + 5 frames
    video_shift: float | None = None  # None: the checkpoint's sigma_shift_scales (12)
    audio_shift: float | None = None  # None: the checkpoint's sigma_shift_scales (3)
    guidance: float = DEFAULT_GUIDANCE  # classifier-free guidance scale; 1: off (H3 is guidance-distilled)
    negative_prompt: str | None = None  # the negative branch's prompt (required when guidance > 1)
    cache: StepCacheConfig | None = None  # step caching (models/step_cache.py); None: every block of every step runs
    # Block-sparse attention (models/sparse_attention.py): the fraction of key blocks skipped (0: dense) and the leading
    # evaluations kept dense (None: its default). Set by a profile or stated; read by the sparse attention path.
    sparse_attention: float = 0.0
    sparse_dense_steps: int | None = None
    sparse_min_seq: int | None = None  # the shortest attention made sparse (None: its default, 4096 rows)
    profile: str | None = None  # the named profile (pipeline/profiles.py) the cache and sparsity came from, recorded
    lora: tuple[AdapterUse, ...] = ()  # resident LoRA adapters this request runs with (pipeline/adapters.py)
    # Where steps and the shifts came from (the request, an adapter it names, the model's default), as its front door
    # resolved them (pipeline/adapter_schedule.py resolve); None: not said (a request made in code)
    schedule_from: ScheduleFrom | None = None

    @property
    def task(self) -> str:
        return task_of(self.image, self.last_image, self.refs)


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


def prepare(request: Request, canvas: CanvasDefaults = CanvasDefaults(), names: Names = FLAGS) -> Prepared:
    """Stage 0: read every input and resolve the geometry, raising one clear error before any model work. Counts are
    bounded before anything is read or built (steps, prompt bytes, references); errors name fields as `names` does."""
    n = names
    _check_prompts(request, n)
    _check_fields(request, n)
    kinds = _reference_kinds(request, n)  # counted before any is read
    num_frames = _num_frames(request, n)
    height, width, placed = _canvas_and_keyframes(request, canvas, n)
    with about("refs"):
        references = [_reference(Path(path), kind, num_frames, canvas) for path, kind in zip(request.refs, kinds)]
    return Prepared(request, Geometry(height, width, num_frames), placed, references)


def _check_prompts(request: Request, n: Names) -> None:
    """The prompts: UTF-8, within the byte bound, and a prompt that says something."""
    for key, text in (("prompt", request.prompt), ("negative_prompt", request.negative_prompt)):
        if text is not None:
            check_utf8(text, _said(n, key), key)
            if len(text.encode("utf-8")) > MAX_PROMPT_BYTES:
                raise UserError(f"{getattr(n, key)} is {len(text.encode('utf-8')):,} bytes; h3trt takes prompts "
                                f"of at most {MAX_PROMPT_TOKENS} tokens and {MAX_PROMPT_BYTES:,} bytes. "
                                "Shorten it.", field=key)
    if not request.prompt.strip():
        raise UserError(f"The prompt is empty; pass {n.prompt} \"...\".", field="prompt")


def _check_fields(request: Request, n: Names) -> None:
    """The numbers and the task's inputs that need no file read: seed, steps, shifts, guidance and its negative
    prompt, references against keyframes."""
    if isinstance(request.seed, bool) or not isinstance(request.seed, int) or not (
            SEED_RANGE[0] <= request.seed < SEED_RANGE[1]):
        raise UserError(f"{n.seed} {request.seed} is outside [-2^63, 2^64), the range torch.Generator "
                        "takes; pass a seed in that range.", field="seed")
    check_steps(request.steps, n.steps)
    if request.refs and (request.image or request.last_image):
        raise UserError(f"{n.refs} (ref2va) cannot be combined with {n.image}/{n.last_image} (fl2va); pick "
                        "one task.", field="refs")
    for key, shift, default in (("video_shift", request.video_shift, DEFAULT_VIDEO_SHIFT),
                                ("audio_shift", request.audio_shift, DEFAULT_AUDIO_SHIFT)):
        if shift is not None and not (math.isfinite(shift) and shift > 0):
            raise UserError(f"{getattr(n, key)} must be a positive finite number (the checkpoint's is "
                            f"{default:g}), got {shift}.", field=key)
    Schedule(request.steps, *(DEFAULT_VIDEO_SHIFT if request.video_shift is None else request.video_shift,
                              DEFAULT_AUDIO_SHIFT if request.audio_shift is None else request.audio_shift))
    # NaN compares false with everything: unchecked, it would pass as "not > 1", run unguided and drop the negative
    # prompt.
    if not (math.isfinite(request.guidance) and request.guidance >= 1.0):
        raise UserError(f"{n.guidance} must be a finite number >= 1 (1 = off, the default: H3 is "
                        f"guidance-distilled), got {request.guidance}.", field="guidance")
    if request.negative_prompt is not None and request.guidance == 1.0:
        raise UserError(f"{n.negative_prompt} only acts with {n.guidance} > 1 (H3 is "
                        "guidance-distilled and runs one branch by default); pass "
                        f"{n.guidance} too, or drop {n.negative_prompt}.", field="negative_prompt")
    if request.guidance > 1.0 and not (request.negative_prompt or "").strip():
        raise UserError(f"{n.guidance} {request.guidance:g} needs {n.negative_prompt} \"...\": the "
                        "negative branch is the request with that prompt (H3's text encoder takes no "
                        "empty prompt).", field="guidance")


def _reference_kinds(request: Request, n: Names) -> list[str]:
    """Each reference's kind, from its name, and the counts H3 takes checked, before any file is read."""
    with about("refs"):
        kinds = [_reference_kind(Path(path)) for path in request.refs]
    for kind in ("image", "video", "audio"):
        if kinds.count(kind) > MAX_REFERENCES[kind]:
            raise UserError(f"{n.refs}: MiniMax-H3 takes at most {MAX_REFERENCES[kind]} {kind} references, "
                            f"got {kinds.count(kind)}.", field="refs")
    if len(kinds) > MAX_REFERENCES["total"]:
        raise UserError(f"{n.refs}: MiniMax-H3 takes at most {MAX_REFERENCES['total']} references, got "
                        f"{len(kinds)}.", field="refs")
    if kinds and set(kinds) == {"audio"}:
        raise UserError(f"{n.refs}: an audio reference must be paired with at least one image or video "
                        "reference.", field="refs")
    return kinds


def _num_frames(request: Request, n: Names) -> int:
    """The clip's frames for its duration (H3's durations: models/packing.py frames_for_duration)."""
    if not (math.isfinite(request.duration) and request.duration > 0):
        raise UserError(f"{n.duration} must be a positive number of seconds, got {request.duration:g}.",
                        field="duration")
    try:
        return frames_for_duration(request.duration)
    except UserError as e:
        raise UserError(f"{n.duration}: {e}", field="duration") from None


def _canvas_and_keyframes(request: Request, canvas: CanvasDefaults, n: Names) -> tuple[int, int, list]:
    """(height, width, the keyframes placed on that canvas as (anchor, image)): the keyframes read first, since
    without --width and --height the first one's aspect picks the canvas."""
    keyframes = []
    for anchor, key in (("first", "image"), ("last", "last_image")):
        if getattr(request, key):
            with about(key):
                keyframes.append((anchor, key, read_image(getattr(request, key))))
    if (request.width is None) != (request.height is None):
        raise UserError(f"{n.size} go together: pass both, or neither for the model's canvas.", field="width")
    if request.width is not None:
        height, width = request.height, request.width
    else:
        aspect = keyframes[0][2].size if keyframes else (16, 9)
        height, width = resolve_canvas(*aspect, short_edge=canvas.short_edge, max_pixels=canvas.max_pixels,
                                       size=n.size)
    try:
        validate_canvas(height, width, n.size)
    except UserError as e:
        raise UserError(str(e), field="resolution") from None
    placed = []
    for i, (anchor, key, img) in enumerate(keyframes):
        with about(key):
            placed.append((anchor, prepare_keyframe(img, height, width, stretch=i == 0)))
    return height, width, placed


def _reference(path: Path, kind: str, num_frames: int, canvas: CanvasDefaults) -> Reference:
    """One reference read for a clip of `num_frames` frames."""
    ref = Reference(kind, path)
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
    return ref


def check_utf8(text: str, what: str = "prompt", field: str = "prompt") -> None:
    """Refuse text that is not valid UTF-8: arguments with undecodable bytes reach Python as lone surrogates
    (surrogateescape), which the tokenizer and the JSON record cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = text[e.start]
        byte = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else f"character {char!r}"
        raise UserError(f"The {what} is not valid UTF-8 ({byte} at position {e.start}); re-encode it as "
                        "UTF-8.", field=field) from None


def _said(names: Names, key: str) -> str:
    """A text field as a message says it: "prompt", "negative prompt" (a flag's words) or "negative_prompt" (a key)."""
    return getattr(names, key).lstrip("-").replace("-", " ")


def check_prompt_tokens(component_root: Path, request: Request, names: Names = FLAGS) -> None:
    """Refuse a prompt (or negative prompt) over MAX_PROMPT_TOKENS, counted by the checkpoint's own tokenizer (loaded
    only for a prompt longer than the budget in bytes: a byte-level BPE token covers at least one byte); both are
    listed in one error, about the first."""
    texts = {key: getattr(request, key) for key in ("prompt", "negative_prompt") if getattr(request, key)}
    long = {key: text for key, text in texts.items() if len(text.encode("utf-8")) > MAX_PROMPT_TOKENS}
    if not long:
        return
    tokenizer = _tokenizer(Path(component_root) / TOKENIZER_DIR)
    over = {}
    for key, text in long.items():
        count = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if count > MAX_PROMPT_TOKENS:
            over[key] = f"the {_said(names, key)} has {count} tokens"
    if over:
        raise UserError(f"{'; '.join(over.values())}; h3trt takes prompts of at most {MAX_PROMPT_TOKENS} tokens. "
                        "Shorten it.", field=next(iter(over)))


@functools.lru_cache(maxsize=2)
def _tokenizer(tokenizer_dir: Path):
    """A checkpoint's tokenizer, loaded once per process (a requests file's long prompts, a server's requests, count
    with one)."""
    # transformers takes 10 s to import on the H200 machine (its auto classes pull in sklearn, sympy and
    # torch.distributed.tensor): imported here, only for a long prompt, so a bundle's cold start imports it on the
    # text encoder's thread while the DiT weights stream in (pipeline/loading.py).
    from transformers import AutoTokenizer

    check_component_files(tokenizer_dir, weights=False)  # a truncated tokenizer.json: one line, not a traceback
    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def check_bundle_serves(manifest: Manifest, prepared: Prepared) -> None:
    """Refuse a request a bundle was not built for (task, canvas, schedule: engines/request_check.py), its
    schedule resolved with the bundle's shifts as the pipeline resolves it. Admission (jobs/admission.py) asks it
    before anything loads; the bundle's loaded pipeline asks it again as its last-line guard (pipeline/loading.py)."""
    req, geo, baked = prepared.request, prepared.geometry, manifest.schedule
    if manifest.vsa is not None:
        refuse_subblock(manifest.vsa, bool(getattr(req, "sparse_attention", None)))
    schedule = Schedule.resolve(req.steps, req.video_shift, req.audio_shift, (baked.video_shift, baked.audio_shift))
    # A schedule an adapter brought is the `lora` field's doing: the fix is there (or in stating the schedule).
    adapters = req.schedule_from.adapters() if req.schedule_from is not None else {}
    said = "; ".join(f"{key} from {source}" for key, source in adapters.items())
    check_request(manifest, geo.width, geo.height, geo.num_frames, req.steps, schedule.video_shift,
                  schedule.audio_shift, req.task, schedule_field="lora" if adapters else "steps",
                  schedule_note=f" ({said})" if said else "")


def _reference_image(image: Image.Image, short_edge: int) -> Image.Image:
    """A reference image at its own short edge (multiples of 32, upscaling included, no area cap), LANCZOS."""
    width, height = image.size
    if width > 4 * height or height > 4 * width:
        raise UserError(f"A reference image must be within 1:4 and 4:1, got {width}x{height}.")
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
        raise UserError(f"A reference video needs at least {usable} frames at {FPS} fps, got {frames.shape[0]}.")
    frames = frames[:usable]
    height, width = resolve_canvas(frames.shape[2], frames.shape[1], canvas.short_edge, canvas.max_pixels, size=None)
    if frames.shape[1:3] != (height, width):
        frames = np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.LANCZOS))
                           for f in frames])
    return frames


def request_dict(request: Request) -> dict:
    data = asdict(request)
    for key in ("image", "last_image"):
        data[key] = str(data[key]) if data[key] else None
    data["refs"] = [str(p) for p in request.refs]
    if request.cache is not None:
        data["cache"] = request.cache.to_dict()
    if request.lora:
        data["lora"] = lora_field(request.lora)
    else:
        del data["lora"]  # a request without adapters is written as before they existed
    del data["schedule_from"]  # not a field a user states: the clip's record carries it (records.py)
    return data
