"""Stage 0 of a generation: what a request states checked (`check_request`: its prompts, numbers, task inputs and
counts, in that order, before any file is read), its input files read and placed on its canvas (`read_media`), the
geometry resolved. `prepare` is both halves, as admission (jobs/admission.py) runs them once; the rank that runs an
admitted job re-reads only its media (jobs/work.py). Beside them admission's other checks of a request: the prompt's
tokens by the checkpoint's own tokenizer (`check_prompt_tokens`), and what a bundle serves (`check_bundle_serves`: its
task, canvas and schedule, engines/request_check.py). Every error names the field as the front door calls it (`Names`,
request/fields.py). `Encoded` is a request after stages 1-2 and the pack, the unit a batch denoises together."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..engines.manifest import Manifest
from ..engines.request_check import check_request as check_manifest_request
from ..errors import MediaError, UserError, about
from ..media.inputs import read_audio, read_image, read_video
from ..models.checkpoint.reader import check_component_files
from ..models.packing import (AUDIO_SAMPLE_RATE, CANVAS_MULTIPLE, FPS, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK, Geometry,
                              PackedLayout, frames_for_duration, resolve_canvas, validate_canvas)
from ..models.sampler import DEFAULT_AUDIO_SHIFT, DEFAULT_VIDEO_SHIFT, Latents, Schedule, check_steps
from ..models.text_encoder import TOKENIZER_DIR
from ..models.video_vae import prepare_keyframe
from ..models.vsa.plan import check_vsa_request
from ..request.fields import FLAGS, MAX_PROMPT_BYTES, MAX_PROMPT_TOKENS, Names
from ..request.request import Admitted, CanvasDefaults, Request


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


def prepare(request: Request, canvas: CanvasDefaults = CanvasDefaults(), names: Names = FLAGS) -> Prepared:
    """Stage 0 at admission: what the request states checked (`check_request`: counts bounded before anything is
    read or built), then its media read (`read_media`); one clear error before any model work, naming fields as
    `names` does."""
    check_request(request, names)
    return read_media(request, canvas, names)


def read_media(request: Request, canvas: CanvasDefaults = CanvasDefaults(), names: Names = FLAGS) -> Prepared:
    """Read a checked request's keyframes and references and resolve its geometry on `canvas` (the keyframes first:
    without a width and height, the first one's aspect picks the canvas)."""
    inputs = request.inputs
    num_frames = frames_for_duration(request.canvas.duration)
    height, width, placed = _canvas_and_keyframes(request, canvas, names)
    with about("refs"):
        references = [_reference(Path(path), reference_kind(Path(path)), num_frames, canvas) for path in inputs.refs]
    return Prepared(request, Geometry(height, width, num_frames), placed, references)


def _canvas_and_keyframes(request: Request, canvas: CanvasDefaults, n: Names) -> tuple[int, int, list]:
    """(height, width, the keyframes placed on that canvas as (anchor, image)): the keyframes read first, since
    without --width and --height the first one's aspect picks the canvas."""
    keyframes, size = [], request.canvas
    for anchor, key in (("first", "image"), ("last", "last_image")):
        if getattr(request.inputs, key):
            with about(key):
                keyframes.append((anchor, key, read_image(getattr(request.inputs, key))))
    if (size.width is None) != (size.height is None):
        raise UserError(f"{n.size} go together: pass both, or neither for the model's canvas.", field="width")
    if size.width is not None:
        height, width = size.height, size.width
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


# What a request states, checked before any file is read ---------------------------------------------------------------

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp"}
AUDIO_SUFFIXES = {".wav", ".mp3", ".flac", ".m4a", ".aac", ".ogg", ".opus"}
VIDEO_SUFFIXES = {".mp4", ".mov", ".mkv", ".webm", ".avi"}
SEED_RANGE = (-2 ** 63, 2 ** 64)  # what torch.Generator.manual_seed takes: int64 or uint64, [lo, hi)
MAX_REFERENCES = {"image": 9, "video": 3, "audio": 3, "total": 12}  # documented limits of the released model


def check_request(request: Request, n: Names) -> None:
    """What a request states, checked before any file is read or anything is built: its prompts, its numbers and its
    task's inputs, its references counted by kind, its duration. One UserError, about the field, named as `n`
    names it."""
    _check_prompts(request, n)
    _check_fields(request, n)
    reference_kinds(request, n)
    num_frames(request, n)


def _check_prompts(request: Request, n: Names) -> None:
    """The prompts: UTF-8, within the byte bound, and a prompt that says something."""
    prompt = request.inputs.prompt
    for key, text in (("prompt", prompt), ("negative_prompt", request.guidance.negative_prompt)):
        if text is not None:
            check_utf8(text, _said(n, key), key)
            if len(text.encode("utf-8")) > MAX_PROMPT_BYTES:
                raise UserError(f"{getattr(n, key)} is {len(text.encode('utf-8')):,} bytes; h3trt takes prompts "
                                f"of at most {MAX_PROMPT_TOKENS} tokens and {MAX_PROMPT_BYTES:,} bytes. "
                                "Shorten it.", field=key)
    if not prompt.strip():
        raise UserError(f"The prompt is empty; pass {n.prompt} \"...\".", field="prompt")


def _check_fields(request: Request, n: Names) -> None:
    """The numbers and the task's inputs that need no file read: seed, steps, shifts, guidance and its negative
    prompt, references against keyframes."""
    inputs, schedule, guidance = request.inputs, request.schedule, request.guidance
    seed = inputs.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise UserError(f"{n.seed} {seed} is outside [-2^63, 2^64), the range torch.Generator takes; pass a seed in "
                        "that range.", field="seed")
    check_steps(schedule.steps, n.steps)
    if inputs.refs and (inputs.image or inputs.last_image):
        raise UserError(f"{n.refs} (ref2va) cannot be combined with {n.image}/{n.last_image} (fl2va); pick "
                        "one task.", field="refs")
    for key, shift, default in (("video_shift", schedule.video_shift, DEFAULT_VIDEO_SHIFT),
                                ("audio_shift", schedule.audio_shift, DEFAULT_AUDIO_SHIFT)):
        if shift is not None and not (math.isfinite(shift) and shift > 0):
            raise UserError(f"{getattr(n, key)} must be a positive finite number (the checkpoint's is "
                            f"{default:g}), got {shift}.", field=key)
    Schedule.resolve(schedule.steps, schedule.video_shift, schedule.audio_shift,
                     (DEFAULT_VIDEO_SHIFT, DEFAULT_AUDIO_SHIFT))  # raises where the schedule cannot be made
    # NaN compares false with everything: unchecked, it would pass as "not > 1", run unguided and drop the negative
    # prompt.
    scale, negative = guidance.scale, guidance.negative_prompt
    if not (math.isfinite(scale) and scale >= 1.0):
        raise UserError(f"{n.guidance} must be a finite number >= 1 (1 = off, the default: H3 is "
                        f"guidance-distilled), got {scale}.", field="guidance")
    if negative is not None and scale == 1.0:
        raise UserError(f"{n.negative_prompt} only acts with {n.guidance} > 1 (H3 is "
                        "guidance-distilled and runs one branch by default); pass "
                        f"{n.guidance} too, or drop {n.negative_prompt}.", field="negative_prompt")
    if scale > 1.0 and not (negative or "").strip():
        raise UserError(f"{n.guidance} {scale:g} needs {n.negative_prompt} \"...\": the "
                        "negative branch is the request with that prompt (H3's text encoder takes no "
                        "empty prompt).", field="guidance")


def reference_kind(path: Path) -> str:
    """A reference's kind (image, audio or video), from its file's suffix."""
    suffix = path.suffix.lower()
    for kind, suffixes in (("image", IMAGE_SUFFIXES), ("audio", AUDIO_SUFFIXES), ("video", VIDEO_SUFFIXES)):
        if suffix in suffixes:
            return kind
    raise MediaError(f"{path}: cannot tell whether this reference is an image, audio or video from '{suffix}'; "
                     f"use one of {sorted(IMAGE_SUFFIXES | AUDIO_SUFFIXES | VIDEO_SUFFIXES)}.")


def reference_kinds(request: Request, n: Names) -> list[str]:
    """Each reference's kind, from its name, and the counts H3 takes checked, before any file is read."""
    with about("refs"):
        kinds = [reference_kind(Path(path)) for path in request.inputs.refs]
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


def num_frames(request: Request, n: Names) -> int:
    """The clip's frames for its duration (H3's durations: models/packing.py frames_for_duration)."""
    duration = request.canvas.duration
    if not (math.isfinite(duration) and duration > 0):
        raise UserError(f"{n.duration} must be a positive number of seconds, got {duration:g}.", field="duration")
    try:
        return frames_for_duration(duration)
    except UserError as e:
        raise UserError(f"{n.duration}: {e}", field="duration") from None


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


def check_prompt_tokens(component_root: Path, request: Request, names: Names) -> None:
    """Refuse a prompt (or negative prompt) over MAX_PROMPT_TOKENS, counted by the checkpoint's own tokenizer (loaded
    only for a prompt longer than the budget in bytes: a byte-level BPE token covers at least one byte); both are
    listed in one error, about the first."""
    texts = {key: text for key, text in (("prompt", request.inputs.prompt),
                                         ("negative_prompt", request.guidance.negative_prompt)) if text}
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


def check_bundle_serves(manifest: Manifest, admitted: Admitted) -> None:
    """Refuse a request a bundle was not built for (task, canvas, schedule: engines/request_check.py), its
    schedule resolved with the bundle's shifts as the pipeline resolves it. Admission (jobs/admission.py) asks it
    before anything loads; the bundle's loaded pipeline asks it again as its last-line guard (pipeline/loading.py,
    of a request its media read: pipeline/prepare.py Prepared, which has the same request and geometry)."""
    req, geo, baked = admitted.request, admitted.geometry, manifest.schedule
    check_vsa_request(manifest.vsa, bool(req.speed.sparse_attention), req.speed.vsa_sparsity)
    s = req.schedule
    schedule = Schedule.resolve(s.steps, s.video_shift, s.audio_shift, (baked.video_shift, baked.audio_shift))
    # A schedule an adapter brought is the `lora` field's doing: the fix is there (or in stating the schedule).
    adapters = s.origin.adapters() if s.origin is not None else {}
    said = "; ".join(f"{key} from {source}" for key, source in adapters.items())
    check_manifest_request(manifest, geo.width, geo.height, geo.num_frames, s.steps, schedule.video_shift,
                           schedule.audio_shift, req.task, schedule_field="lora" if adapters else "steps",
                           schedule_note=f" ({said})" if said else "")
