"""Stage 0 of a generation: a request's input files read and placed on its canvas (`read_media`), the geometry
resolved, on every process that runs it (the rank re-reads only the media: what the request states was checked once,
where it was admitted, request/checks.py). `prepare` is both halves, the checks then the media, as admission runs
them. `Encoded` is a request after stages 1-2 and the pack, the unit a batch denoises together."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..errors import UserError, about
from ..media.inputs import read_audio, read_image, read_video
from ..models.packing import (AUDIO_SAMPLE_RATE, CANVAS_MULTIPLE, FPS, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK, Geometry,
                              PackedLayout, frames_for_duration, resolve_canvas, validate_canvas)
from ..models.sampler import Latents, Schedule
from ..models.video_vae import prepare_keyframe
from ..request.checks import check_request, reference_kind
from ..request.fields import FLAGS, Names
from ..request.parts import CanvasDefaults
from ..request.request import Request


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
    """Stage 0 at admission: what the request states checked (request/checks.py: counts bounded before anything is
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
