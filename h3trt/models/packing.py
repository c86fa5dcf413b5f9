"""Request geometry and the packed sequence: canvas and duration rules, row order, tags, timesteps and RoPE positions.

Everything here is a pure function of shapes, on the CPU, in the reference's exact arithmetic (float64 positions,
numpy `linspace`, the two summation orders of the rotary clock). Layouts:

  t2va / fl2va: [text | keyframe condition rows | target audio | target video]
  ref2va:       [text | reference block 1 | ... | reference block n | target audio | target video]

Sources: diffusers 0.42.1 `modular_pipelines/minimax_h3/{modular_pipeline,before_denoise}.py`; h3_reference.md 2.3, 4.5.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UserError
from .config import AUDIO_TAG, TEXT_TAG, VIDEO_TAG

# Output contract of the released model.
FPS = 24
FRAMES_PER_CHUNK = 17  # the video VAE encodes 17 pixel frames ...
LATENTS_PER_CHUNK = 5  # ... into 5 latents, so clips are 17n + 5 frames <-> 5n + 2 latents
VAE_SPATIAL_RATIO = 16
CANVAS_MULTIPLE = 32  # VAE ratio x patch width: a canvas must stay a whole number of patch rows
CANVAS_SHORT_EDGE = 768
CANVAS_MAX_PIXELS = 768 * 1344
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0
# diffusers' bounds (sglang allows 4 s). At the top, 15 s rounds up to 362 frames (15.083 s), past the bound, so the
# longest clip is 345 frames: 14.375 s, which is what every message and the README state.
MIN_DURATION_S, MAX_DURATION_S = 5.0, 14.375
DEFAULT_DURATION = MIN_DURATION_S  # seconds: the shortest clip, 124 frames
AUDIO_LATENTS_PER_SECOND = 40  # audio VAE hop 800 at 32 kHz
AUDIO_CHANNELS = 2  # stereo, packed as two channel-major blocks
AUDIO_SAMPLE_RATE = 32000

# Condition rows are held just short of clean for every step; reference audio is clean.
CONDITION_VIDEO_T = 0.999
CONDITION_AUDIO_T = 1.0

# Rotary clock: a latent frame spans 5/3 * (1, 4, 4, 4, 4)[k % 5] units; spatial axes scaled to [0, 32) when square.
ROPE_FRAME_RESCALE = 5.0 / 3.0
ROPE_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
ROPE_SPATIAL_SCALE = 32


# Canvas and duration


def _canvas_before_rounding(aspect_width: float, aspect_height: float, short_edge: int = CANVAS_SHORT_EDGE,
                            max_pixels: int = CANVAS_MAX_PIXELS, size: str | None = "--width/--height"
                            ) -> tuple[float, float]:
    """(height, width) for an aspect ratio before rounding: short edge 768, area capped at 768x1344. `size`: what sets
    the canvas (a flag, a request key), for the message; None: nothing does (a reference video keeps its aspect)."""
    if aspect_width <= 0 or aspect_height <= 0:
        raise UserError(f"The aspect ratio must be positive, got {aspect_width}:{aspect_height}.")
    ratio = aspect_width / aspect_height
    if not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise UserError(
            f"MiniMax-H3 supports aspect ratios from 1:4 to 4:1, got {aspect_width}:{aspect_height} ({ratio:.3g}). "
            f"Crop the input{f' or pick {size}' if size else ''} within that range."
        )
    if ratio >= 1.0:
        width, height = short_edge * ratio, float(short_edge)
    else:
        width, height = float(short_edge), short_edge / ratio
    area = width * height
    if area > max_pixels:
        scale = (max_pixels / area) ** 0.5
        width, height = width * scale, height * scale
    return height, width


def resolve_canvas(aspect_width: float, aspect_height: float, short_edge: int = CANVAS_SHORT_EDGE,
                   max_pixels: int = CANVAS_MAX_PIXELS, size: str | None = "--width/--height") -> tuple[int, int]:
    """(height, width) of the model's canvas for an aspect ratio: short edge 768, area cap 768x1344, each edge rounded
    to the nearest 32 (the area may end slightly above the cap, as in the reference; smaller: the tiny canvases)."""
    height, width = _canvas_before_rounding(aspect_width, aspect_height, short_edge, max_pixels, size)
    m = CANVAS_MULTIPLE
    return max(m, round(height / m) * m), max(m, round(width / m) * m)


def validate_canvas(height: int, width: int, size: str = "--width/--height") -> None:
    """Raise unless (height, width) is a canvas H3 generates: multiples of 32, aspect 1:4..4:1, short edge <= 768, an
    area within the model's canvas for that aspect once each edge is rounded to 32 (resolve_canvas's all pass)."""
    m = CANVAS_MULTIPLE
    if height <= 0 or width <= 0 or height % m or width % m:
        raise UserError(
            f"Unsupported resolution {width}x{height}: width and height must be positive multiples of {m} "
            f"(for example {max(m, round(width / m) * m)}x{max(m, round(height / m) * m)})."
        )
    height_f, width_f = _canvas_before_rounding(width, height, size=size)  # also checks the aspect ratio
    max_area = (height_f + m / 2) * (width_f + m / 2)  # rounding to the nearest 32 moves each edge by <= 16
    if min(height, width) > CANVAS_SHORT_EDGE or height * width > max_area:
        fit_h, fit_w = resolve_canvas(width, height)
        raise UserError(
            f"Unsupported resolution {width}x{height}: larger than MiniMax-H3's canvas for this aspect ratio "
            f"(short edge {CANVAS_SHORT_EDGE}, area cap {CANVAS_SHORT_EDGE}x{CANVAS_MAX_PIXELS // CANVAS_SHORT_EDGE}). "
            f"Use {fit_w}x{fit_h} or smaller."
        )


def align_num_frames(num_frames: int) -> int:
    """Round a frame count up to the next 17n + 5 the video VAE can decode."""
    if num_frames < 1:
        raise ValueError(f"num_frames must be positive, got {num_frames}.")
    return num_frames + (LATENTS_PER_CHUNK - num_frames) % FRAMES_PER_CHUNK


def frames_for_duration(seconds: float, min_s: float = MIN_DURATION_S, max_s: float = MAX_DURATION_S) -> int:
    """The 17n + 5 frame count a duration generates (rounded up), within the stated range on the duration asked for
    (diffusers checks the rounded count, so 4.9 s would pass as 124 frames; 14.375 s is the last count within 15 s)."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise UserError(f"Duration must be a positive number of seconds, got {seconds}.")
    # The range first: a huge duration (1e308 s) would overflow the frame count.
    frames = align_num_frames(math.ceil(seconds * FPS - 1e-9)) if min_s <= seconds <= max_s else 0
    if not min_s <= seconds <= max_s or not min_s <= frames / FPS <= max_s:
        lo = align_num_frames(math.ceil(min_s * FPS))
        hi = int((max_s * FPS - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK) * FRAMES_PER_CHUNK + LATENTS_PER_CHUNK
        raise UserError(
            f"Unsupported duration {seconds:g} s: MiniMax-H3 takes {min_s:g} to {max_s:g} s, generated as {lo} to "
            f"{hi} frames of the form 17n + 5 at {FPS} fps (a duration is rounded up to the next such count)."
        )
    return frames


def latent_frames(num_frames: int) -> int:
    """Video latent frames of a 17n + 5 clip: 5n + 2."""
    if num_frames % FRAMES_PER_CHUNK != LATENTS_PER_CHUNK:
        raise ValueError(f"num_frames must be of the form 17n + 5, got {num_frames}.")
    return (num_frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK * LATENTS_PER_CHUNK + 2


def audio_latents(num_frames: int) -> int:
    """Audio latents per channel covering `num_frames` video frames (40 per second, rounded)."""
    return int(round(num_frames / FPS * AUDIO_LATENTS_PER_SECOND))


@dataclass(frozen=True)
class Geometry:
    """Target latent shape of one request."""

    height: int
    width: int
    num_frames: int  # 17n + 5

    @property
    def latent_frames(self) -> int:
        return latent_frames(self.num_frames)

    @property
    def latent_height(self) -> int:
        return self.height // VAE_SPATIAL_RATIO

    @property
    def latent_width(self) -> int:
        return self.width // VAE_SPATIAL_RATIO

    @property
    def audio_latents(self) -> int:
        return audio_latents(self.num_frames)

    @property
    def audio_samples(self) -> int:
        return self.audio_latents * AUDIO_SAMPLE_RATE // AUDIO_LATENTS_PER_SECOND


# Row packing


def patchify(latents_BCTHW: torch.Tensor, patch_size: tuple[int, int, int]) -> torch.Tensor:
    """[B, C, T, H, W] -> rows [B * T' * H' * W', C * pt * ph * pw], frame-major then row-major."""
    pt, ph, pw = patch_size
    B, C, T, H, W = latents_BCTHW.shape
    if T % pt or H % ph or W % pw:
        raise ValueError(f"Latents of shape {tuple(latents_BCTHW.shape)} are not divisible by the patch {patch_size}.")
    x = latents_BCTHW.reshape(B, C, T // pt, pt, H // ph, ph, W // pw, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(-1, C * pt * ph * pw).contiguous()


def unpatchify(rows: torch.Tensor, shape_CTHW: tuple[int, int, int, int], patch_size: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of `patchify` for one item: rows [T' * H' * W', C * pt * ph * pw] -> [1, C, T, H, W]."""
    pt, ph, pw = patch_size
    C, T, H, W = shape_CTHW
    x = rows.reshape(1, T // pt, H // ph, W // pw, C, pt, ph, pw)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(1, C, T, H, W)


def audio_to_rows(audio_KCA: torch.Tensor) -> torch.Tensor:
    """Stereo latents [2, C, A] -> channel-major rows [2A, C] (all left latents, then all right)."""
    return audio_KCA.permute(0, 2, 1).reshape(-1, audio_KCA.shape[1])


def rows_to_audio(rows: torch.Tensor, channels: int = AUDIO_CHANNELS) -> torch.Tensor:
    """Inverse of `audio_to_rows`: [2A, C] -> [2, C, A]."""
    return rows.reshape(channels, -1, rows.shape[-1]).permute(0, 2, 1)


@dataclass(frozen=True)
class PackedLayout:
    """Where every row of the packed sequence comes from. Video and audio indices list condition rows first."""

    position_ids: torch.Tensor  # [S, 3] float64 (t, h, w)
    token_tags: torch.Tensor  # [S] long: 0 video, 1 text, 2 audio
    video_index: torch.Tensor  # [V] long
    audio_index: torch.Tensor  # [A] long
    text_index: torch.Tensor  # [L] long
    num_condition_video_rows: int = 0  # leading video rows that are pinned conditions
    num_condition_audio_rows: int = 0  # leading audio rows that are pinned references
    video_grid: tuple[int, int, int] | None = None  # (frames, rows, cols) of the target video rows' patch grid

    @property
    def seq_len(self) -> int:
        return self.position_ids.shape[0]

    def to(self, device) -> "PackedLayout":
        moved = {k: getattr(self, k).to(device) for k in ("token_tags", "video_index", "audio_index", "text_index")}
        return PackedLayout(self.position_ids.to(device), **moved,
                            num_condition_video_rows=self.num_condition_video_rows,
                            num_condition_audio_rows=self.num_condition_audio_rows, video_grid=self.video_grid)

    def digest(self) -> bytes:
        """The one definition of "the same layout" (every field, tensors bit for bit with shapes and dtypes): equal
        digests may share one batched DiT evaluation (jobs/work.py layout_key; H3Pipeline.denoise_batch checks)."""
        digest = hashlib.sha256(repr((self.num_condition_video_rows, self.num_condition_audio_rows,
                                      self.video_grid)).encode())
        for name in _LAYOUT_TENSORS:
            t = getattr(self, name).detach().cpu().contiguous()
            digest.update(repr((name, str(t.dtype), tuple(t.shape))).encode())
            digest.update(t.numpy().tobytes())
        return digest.digest()


_LAYOUT_TENSORS = ("position_ids", "token_tags", "video_index", "audio_index", "text_index")


def spatial_grid(dim: int, patch: int, sqrt_area: float) -> torch.Tensor:
    """One aspect-normalised spatial axis: dim // patch positions, [0, 32) for a square canvas (numpy linspace)."""
    ratio = dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    grid = np.linspace(left, left + ratio, dim // patch, endpoint=False) * ROPE_SPATIAL_SCALE
    return torch.from_numpy(grid).to(torch.float64)


def frame_grid(latent_h: int, latent_w: int, patch_size) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, w) positions of one latent frame [rows, 2], and the width axis (audio rows pin to its extremes)."""
    _, ph, pw = patch_size
    sqrt_area = np.sqrt(latent_h * latent_w)
    h_grid, w_grid = spatial_grid(latent_h, ph, sqrt_area), spatial_grid(latent_w, pw, sqrt_area)
    hh, ww = torch.meshgrid(h_grid, w_grid, indexing="ij")
    return torch.stack([hh.reshape(-1), ww.reshape(-1)], dim=-1), w_grid


def frame_span(k: int) -> float:
    return ROPE_FRAME_RESCALE * ROPE_FRAMES_PER_LATENT[k % len(ROPE_FRAMES_PER_LATENT)]


def temporal_grid(num_latent_frames: int, origin: float) -> torch.Tensor:
    """Rotary time of each latent frame from `origin`: [num_latent_frames] float64 (torch cumsum, as the reference)."""
    spans = torch.tensor([frame_span(k) for k in range(num_latent_frames)], dtype=torch.float64)
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def span_pairwise(num_latent_frames: int) -> float:
    """Total rotary span, summed by numpy's pairwise summation (the last-keyframe anchor uses this order)."""
    spans = np.ones(num_latent_frames, dtype=np.float64) * ROPE_FRAME_RESCALE
    for offset, mult in enumerate(ROPE_FRAMES_PER_LATENT):
        spans[offset :: len(ROPE_FRAMES_PER_LATENT)] *= mult
    return float(spans.sum())


def span_sequential(num_latent_frames: int) -> float:
    """Total rotary span summed left to right (a reference video advances the clock by this order)."""
    return sum(frame_span(k) for k in range(num_latent_frames))


def _fill_audio(pos: torch.Tensor, rows: slice, n_latents: int, t0: float, w_grid: torch.Tensor) -> None:
    """Channel-major stereo block: t = t0 + i for each channel, h = 0, w pinned to the width grid's two extremes."""
    t = t0 + torch.arange(n_latents, dtype=torch.float64)
    pos[rows, 0] = t.repeat(AUDIO_CHANNELS)
    pos[rows, 2] = torch.cat([torch.full((n_latents,), float(w_grid[0]), dtype=torch.float64),
                              torch.full((n_latents,), float(w_grid[-1]), dtype=torch.float64)])


def _fill_video(pos: torch.Tensor, rows: slice, n_frames: int, t0: float, grid: torch.Tensor) -> None:
    pos[rows, 0] = temporal_grid(n_frames, t0).repeat_interleave(grid.shape[0])
    pos[rows, 1:] = grid.repeat(n_frames, 1)


def _tags(seq_len, text_tags, video_index, audio_index) -> torch.Tensor:
    tags = torch.empty(seq_len, dtype=torch.long)
    tags[: text_tags.shape[0]] = text_tags.to(torch.long)
    tags[audio_index] = AUDIO_TAG
    tags[video_index] = VIDEO_TAG
    return tags


def pack_t2va(
    text_tags: torch.Tensor,
    latent_frames_: int,
    latent_h: int,
    latent_w: int,
    audio_latents_: int,
    patch_size: tuple[int, int, int] = (1, 2, 2),
    keyframes: tuple[str, ...] = (),
) -> PackedLayout:
    """Layout of a t2va request, or fl2va with keyframes ('first', 'last' or both, in packed order).

    `text_tags` [L] long tags every text row: 1 for text, 0 for the rows of a vision block inside the text stream.
    The target is `latent_frames_` x `latent_h` x `latent_w` video latents (rows of `patch_size` patches) and
    `audio_latents_` stereo audio latents (2 rows each); a keyframe adds one latent frame of condition rows."""
    for anchor in keyframes:
        if anchor not in ("first", "last"):
            raise ValueError(f"A keyframe anchor must be 'first' or 'last', got {anchor!r}.")
    _, ph, pw = patch_size
    rows_per_frame = (latent_h // ph) * (latent_w // pw)
    L = text_tags.shape[0]
    n_cond = len(keyframes) * rows_per_frame
    n_audio = audio_latents_ * AUDIO_CHANNELS
    audio_start = L + n_cond
    video_start = audio_start + n_audio
    S = video_start + latent_frames_ * rows_per_frame

    pos = torch.zeros(S, 3, dtype=torch.float64)
    pos[:L, 0] = torch.arange(L, dtype=torch.float64)
    grid, w_grid = frame_grid(latent_h, latent_w, patch_size)
    origin = float(L)  # the media clock starts where the text rows end
    for i, anchor in enumerate(keyframes):
        t = origin if anchor == "first" else origin + span_pairwise(latent_frames_) - ROPE_FRAME_RESCALE
        rows = slice(L + i * rows_per_frame, L + (i + 1) * rows_per_frame)
        pos[rows, 0] = t
        pos[rows, 1:] = grid
    _fill_audio(pos, slice(audio_start, video_start), audio_latents_, origin, w_grid)
    _fill_video(pos, slice(video_start, S), latent_frames_, origin, grid)

    video_index = torch.cat([torch.arange(L, audio_start), torch.arange(video_start, S)])
    audio_index = torch.arange(audio_start, video_start)
    return PackedLayout(pos, _tags(S, text_tags, video_index, audio_index), video_index, audio_index,
                        torch.arange(L), num_condition_video_rows=n_cond,
                        video_grid=(latent_frames_, latent_h // ph, latent_w // pw))


@dataclass(frozen=True)
class RefBlock:
    """One ref2va reference as the packer sees it: its kind and latent geometry."""

    kind: str  # "image" | "video" | "audio"
    latent_shape: tuple[int, int, int] | None = None  # (frames, h, w) of image/video latents
    audio_latents: int = 0  # per channel: an audio reference, or a video's soundtrack (0 = silent video)

    def __post_init__(self):
        if self.kind not in ("image", "video", "audio"):
            raise ValueError(f"A reference must be 'image', 'video' or 'audio', got {self.kind!r}.")
        if self.kind in ("image", "video") and self.latent_shape is None:
            raise ValueError(f"An {self.kind} reference needs its latent_shape (frames, height, width).")
        if self.kind == "image" and self.latent_shape[0] != 1:
            raise ValueError(f"An image reference is one latent frame, got {self.latent_shape}.")
        if self.kind == "audio" and self.audio_latents < 1:
            raise ValueError("An audio reference needs audio_latents >= 1.")


def pack_ref2va(
    text_tags: torch.Tensor,
    references: list[RefBlock],
    latent_frames_: int,
    latent_h: int,
    latent_w: int,
    audio_latents_: int,
    patch_size: tuple[int, int, int] = (1, 2, 2),
) -> PackedLayout:
    """Layout of a ref2va request. Each reference advances the shared clock: an image by 1 unit, audio by its
    latent count, a video by max(soundtrack, video span). A video's soundtrack rows come right before its frames.

    `text_tags` [L] long as in `pack_t2va`; `references` in the order the model reads them (their latent shapes
    (t, h, w) and audio latents); the target as in `pack_t2va`."""
    _, ph, pw = patch_size
    L = text_tags.shape[0]

    def video_rows(shape):
        f, h, w = shape
        return f * (h // ph) * (w // pw)

    n_ref_video = sum(video_rows(r.latent_shape) for r in references if r.latent_shape is not None)
    n_ref_audio = sum(r.audio_latents * AUDIO_CHANNELS for r in references)
    n_audio = audio_latents_ * AUDIO_CHANNELS
    S = L + n_ref_video + n_ref_audio + n_audio + latent_frames_ * (latent_h // ph) * (latent_w // pw)

    pos = torch.zeros(S, 3, dtype=torch.float64)
    pos[:L, 0] = torch.arange(L, dtype=torch.float64)
    target_grid, target_w_grid = frame_grid(latent_h, latent_w, patch_size)
    video_parts, audio_parts = [], []
    cursor, clock = L, float(L)
    for ref in references:
        if ref.kind == "image":
            rows = slice(cursor, cursor + video_rows(ref.latent_shape))
            grid, _ = frame_grid(ref.latent_shape[1], ref.latent_shape[2], patch_size)
            pos[rows, 0] = clock
            pos[rows, 1:] = grid
            video_parts.append(torch.arange(rows.start, rows.stop))
            clock += 1.0  # an image takes one integer slot, not a latent frame's 5/3
        elif ref.kind == "audio":
            rows = slice(cursor, cursor + ref.audio_latents * AUDIO_CHANNELS)
            _fill_audio(pos, rows, ref.audio_latents, clock, target_w_grid)
            audio_parts.append(torch.arange(rows.start, rows.stop))
            clock += float(ref.audio_latents)
        else:
            a_rows = slice(cursor, cursor + ref.audio_latents * AUDIO_CHANNELS)
            v_rows = slice(a_rows.stop, a_rows.stop + video_rows(ref.latent_shape))
            grid, w_grid = frame_grid(ref.latent_shape[1], ref.latent_shape[2], patch_size)
            _fill_audio(pos, a_rows, ref.audio_latents, clock, w_grid)  # the soundtrack pins to its own video's grid
            _fill_video(pos, v_rows, ref.latent_shape[0], clock, grid)
            audio_parts.append(torch.arange(a_rows.start, a_rows.stop))
            video_parts.append(torch.arange(v_rows.start, v_rows.stop))
            rows = slice(a_rows.start, v_rows.stop)
            clock += max(float(ref.audio_latents), span_sequential(ref.latent_shape[0]))
        cursor = rows.stop

    audio_start, video_start = cursor, cursor + n_audio
    _fill_audio(pos, slice(audio_start, video_start), audio_latents_, clock, target_w_grid)
    _fill_video(pos, slice(video_start, S), latent_frames_, clock, target_grid)
    video_index = torch.cat(video_parts + [torch.arange(video_start, S)])
    audio_index = torch.cat(audio_parts + [torch.arange(audio_start, video_start)])
    return PackedLayout(pos, _tags(S, text_tags, video_index, audio_index), video_index, audio_index,
                        torch.arange(L), num_condition_video_rows=n_ref_video, num_condition_audio_rows=n_ref_audio,
                        video_grid=(latent_frames_, latent_h // ph, latent_w // pw))


def row_timesteps(layout: PackedLayout, video_t: float, audio_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct timesteps (sorted) of one evaluation, unique_t [T] fp32, and each row's index into them,
    t_index [S] long.

    Text and padding rows take the video t; target audio the audio t; condition video rows max(video t, 0.999);
    reference audio rows 1.0."""
    t = torch.full((layout.seq_len,), video_t, dtype=torch.float32)
    t[layout.video_index[: layout.num_condition_video_rows]] = max(video_t, CONDITION_VIDEO_T)
    t[layout.audio_index[layout.num_condition_audio_rows :]] = audio_t
    t[layout.audio_index[: layout.num_condition_audio_rows]] = CONDITION_AUDIO_T
    return torch.unique(t, sorted=True, return_inverse=True)


def text_tags_for(num_text_tokens: int, vision_rows: list[range] | tuple = ()) -> torch.Tensor:
    """Text tags [num_text_tokens] long: 1 everywhere, 0 on the rows of vision blocks shown to the text encoder."""
    tags = torch.full((num_text_tokens,), TEXT_TAG, dtype=torch.long)
    for rows in vision_rows:
        tags[rows.start : rows.stop] = VIDEO_TAG
    return tags
