"""Reading media inputs for h3trt: keyframe and reference images, reference audio and video, and `probe` (what a
file holds, by decoding it).

Everything goes through PyAV's bundled FFmpeg (and PIL for images) so the engine needs no `ffmpeg` binary on PATH.
Every problem a user can cause (missing file, wrong format, oversized or corrupt input) raises `MediaError` with one
line naming the file, the problem and the fix, because these messages end up verbatim in `h3trt run` output. Writing
MP4s is mp4.py's.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import MediaError  # the base's: a request's checks raise it too (a reference's kind)

# 32 kHz stereo is the model's native audio format: every audio input is resampled to it.
DEFAULT_SAMPLE_RATE = 32000
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
# Input images and video frames larger than this are refused before they are decoded (8192 x 8192): every input is
# resized to at most H3's 2048 px reference edge, and a 20000 x 20000 PNG alone would need 1.2 GB decoded.
MAX_INPUT_PIXELS = 8192 * 8192
# probe() always returns every key; those of a missing stream are None, so callers can index without checking.
PROBE_KEYS = ("format", "video_codec", "pix_fmt", "width", "height", "fps", "frames",
              "audio_codec", "sample_rate", "audio_channels", "audio_duration")


def _existing_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise MediaError(f"{path} does not exist; check the path")
    if not path.is_file():
        raise MediaError(f"{path} is not a file; pass the path of a media file")
    return path


# What to tell the user to re-export an unreadable file as, by what the caller was expecting.
_EXPORT_HINT = {"audio": "WAV, MP3 or M4A", "video": "an H.264 MP4", "media": "an H.264 MP4"}


def _open_media(path: Path, kind: str) -> Any:
    try:
        return av.open(str(path), mode="r")
    except av.error.FFmpegError as err:
        raise MediaError(f"{path} is not a readable {kind} file ({err.strerror}); "
                         f"re-export it as {_EXPORT_HINT[kind]}") from None


def read_image(path: str | os.PathLike) -> Image.Image:
    """Load a PNG/JPEG/WebP as RGB, with EXIF rotation applied so phone photos are upright as the user saw them."""
    path = _existing_file(path)
    try:
        with Image.open(path) as image:
            if image.format not in IMAGE_FORMATS:
                raise MediaError(f"{path} is a {image.format} image, which is not supported; convert it to PNG or JPEG")
            _check_pixels(path, *image.size)
            image.load()
            return ImageOps.exif_transpose(image).convert("RGB")
    except Image.DecompressionBombError:  # PIL's own guard, past twice its limit: refused from the header alone
        raise MediaError(f"{path} is over h3trt's input limit of {MAX_INPUT_PIXELS:,} pixels (8192 x 8192) by "
                         "far; downscale it first") from None
    except UnidentifiedImageError:  # its message repeats the path, quoted: said once, by us
        raise MediaError(f"{path} is not a readable image (no image format was recognised); re-save it as PNG or "
                         "JPEG") from None
    except (OSError, SyntaxError) as err:
        # PIL raises OSError/SyntaxError for truncated or corrupt files after the header parsed.
        raise MediaError(f"{path} is not a readable image ({err}); re-save it as PNG or JPEG") from None


def _check_pixels(path: Path, width: int, height: int) -> None:
    if width * height > MAX_INPUT_PIXELS:
        raise MediaError(f"{path} is {width}x{height} ({width * height:,} pixels), over h3trt's input limit of "
                         f"{MAX_INPUT_PIXELS:,} (8192 x 8192); downscale it first")


def _decode_audio(container: Any, path: Path) -> tuple[np.ndarray, int]:
    """Decode the first audio stream of an open container to float32 stereo [2, N] at its own sample rate."""
    stream = container.streams.audio[0]
    channels = stream.codec_context.channels
    rate = int(stream.codec_context.sample_rate)
    if rate <= 0:
        raise MediaError(f"{path}: audio stream has no sample rate; re-export it as WAV or M4A")
    # A format conversion only, at the stream's own rate: the rate is changed afterwards by `resample`, the
    # reference's resampler. Mono is decoded as mono and duplicated (swresample's mono->stereo matrix would scale it
    # by 1/sqrt(2), 3 dB quieter than the same sound in stereo; the reference duplicates too). More than 2 channels
    # use swresample's standard (normalised, clip-free) downmix; the reference refuses them.
    layout = "mono" if channels == 1 else "stereo"
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate)
    chunks: list[np.ndarray] = []
    try:
        for frame in container.decode(stream):
            # Samples are concatenated in decode order, so timestamps carry nothing here; clearing them keeps input
            # quirks (gaps, resets after edits) out of the conversion's filter graph.
            frame.pts = None
            chunks.extend(out.to_ndarray() for out in resampler.resample(frame))
        chunks.extend(out.to_ndarray() for out in resampler.resample(None))
    except av.error.FFmpegError as err:
        raise MediaError(f"{path}: audio stream is corrupt ({err.strerror}); re-export it as WAV or M4A") from None
    if not chunks:
        raise MediaError(f"{path}: audio stream decodes to no samples; re-export it with audible content")
    audio = np.concatenate(chunks, axis=1).astype(np.float32, copy=False)
    return (np.repeat(audio, 2, axis=0) if layout == "mono" else audio), rate


# The reference's resampler: torchaudio.transforms.Resample(orig, new) with its defaults (windowed sinc, Hann window,
# lowpass_filter_width 6, rolloff 0.99), which diffusers' MiniMax-H3 pipeline applies to reference audio once, after
# truncating it at its native rate. Reproduced here in plain torch (torchaudio is not a dependency).
RESAMPLE_LOWPASS_WIDTH = 6
RESAMPLE_ROLLOFF = 0.99


def resample(waveform_CN: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """float32 [C, N] at `orig_rate` -> [C, ceil(N * new / orig)] at `new_rate`: torchaudio's sinc_interp_hann,
    the same arithmetic (kernel in float64, stored and applied in float32), so the reference's numbers."""
    if orig_rate == new_rate:
        return waveform_CN
    gcd = math.gcd(int(orig_rate), int(new_rate))
    orig, new = int(orig_rate) // gcd, int(new_rate) // gcd
    base = min(orig, new) * RESAMPLE_ROLLOFF
    width = math.ceil(RESAMPLE_LOWPASS_WIDTH * orig / base)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    t = torch.arange(0, -new, -1)[:, None, None] / new + idx  # [new, 1, 2 * width + orig]
    t = (t * base).clamp_(-RESAMPLE_LOWPASS_WIDTH, RESAMPLE_LOWPASS_WIDTH)
    window = torch.cos(t * math.pi / RESAMPLE_LOWPASS_WIDTH / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.tensor(1.0, dtype=t.dtype), t.sin() / t) * window * (base / orig)
    kernel = kernel.to(torch.float32)
    channels, length = waveform_CN.shape
    padded = torch.nn.functional.pad(waveform_CN.float(), (width, width + orig))
    out = torch.nn.functional.conv1d(padded[:, None], kernel, stride=orig).transpose(1, 2).reshape(channels, -1)
    return out[:, : math.ceil(new * length / orig)]


def _audio_at(audio: np.ndarray, rate: int, sample_rate: int, max_seconds: float | None) -> np.ndarray:
    """Native-rate audio truncated to `max_seconds` there (as the reference does), then resampled once."""
    if max_seconds is not None:
        audio = audio[:, : int(max_seconds * rate)]
    return resample(torch.from_numpy(np.ascontiguousarray(audio)), rate, sample_rate).numpy()


def read_audio(path: str | os.PathLike, sample_rate: int = DEFAULT_SAMPLE_RATE,
               max_seconds: float | None = None) -> np.ndarray:
    """Decode the first audio stream of any audio or video file to float32 stereo [2, N] at `sample_rate`: decoded
    at its own rate, cut to the first `max_seconds` (None: all of it), then resampled as the reference resamples."""
    path = _existing_file(path)
    with _open_media(path, "audio") as container:
        if not container.streams.audio:
            raise MediaError(f"{path} has no audio stream; pass a file with sound (WAV, MP3, M4A, video with audio)")
        audio, rate = _decode_audio(container, path)
    return _audio_at(audio, rate, sample_rate, max_seconds)


def _frame_rate(stream: Any, path: Path) -> Fraction:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate:
        raise MediaError(f"{path}: video stream has no frame rate; re-encode it with a constant frame rate")
    return Fraction(rate)


def read_video(path: str | os.PathLike, max_audio_seconds: float | None = None
               ) -> tuple[np.ndarray, float, np.ndarray | None]:
    """Decode a video to (uint8 RGB frames [T, H, W, 3], fps, float32 stereo audio [2, N] at 32 kHz or None).

    Frames come upright as a player shows them: a display-matrix rotation (phones tag portrait video this way) is
    undone in quarter turns, as the reference does (diffusers' MiniMaxH3VideoReference.from_file, after ffmpeg)."""
    path = _existing_file(path)
    with _open_media(path, "video") as container:
        if not container.streams.video:
            raise MediaError(f"{path} has no video stream; pass a video file (e.g. an H.264 MP4)")
        stream = container.streams.video[0]
        fps = float(_frame_rate(stream, path))
        _check_pixels(path, stream.codec_context.width, stream.codec_context.height)
        frames: list[np.ndarray] = []
        rotation = 0.0
        try:
            # to_ndarray converts with each frame's own colorspace/range tags (so our BT.709 output round-trips);
            # untagged sources get swscale's BT.601 default, as the ffmpeg CLI does.
            for frame in container.decode(stream):
                rotation = frame.rotation  # the stream's display matrix, surfaced on every frame (degrees, CCW)
                frames.append(frame.to_ndarray(format="rgb24"))
        except av.error.FFmpegError as err:
            raise MediaError(f"{path}: video stream is corrupt ({err.strerror}); re-encode it as H.264 MP4") from None
        has_audio = bool(container.streams.audio)
    if not frames:
        raise MediaError(f"{path}: video stream decodes to no frames; re-encode it")
    if len({f.shape for f in frames}) != 1:
        raise MediaError(f"{path}: frame size changes mid-stream; re-encode it at one resolution")
    video = np.stack(frames)
    turns = round(rotation / 90.0) % 4  # the reference snaps to quarter turns too
    if turns:
        video = np.ascontiguousarray(np.rot90(video, k=-turns, axes=(1, 2)))
    audio = None
    if has_audio:
        # A second open keeps the two decode loops independent; demuxing twice costs far less than decoding.
        with _open_media(path, "video") as container:
            audio = _audio_at(*_decode_audio(container, path), DEFAULT_SAMPLE_RATE, max_audio_seconds)
    return video, fps, audio


def probe(path: str | os.PathLike) -> dict[str, Any]:
    """Describe a media file by decoding it, so the numbers reflect what a player shows rather than header claims."""
    path = _existing_file(path)
    info: dict[str, Any] = dict.fromkeys(PROBE_KEYS)
    with _open_media(path, "media") as container:
        info["format"] = container.format.name
        streams = []
        if container.streams.video:
            stream = container.streams.video[0]
            cc = stream.codec_context
            info.update(video_codec=cc.name, pix_fmt=cc.format.name if cc.format else None, width=cc.width,
                        height=cc.height, fps=float(_frame_rate(stream, path)), frames=0)
            streams.append(stream)
        if container.streams.audio:
            stream = container.streams.audio[0]
            cc = stream.codec_context
            info.update(audio_codec=cc.name, sample_rate=cc.sample_rate, audio_channels=cc.channels)
            streams.append(stream)
        samples = 0
        try:
            for frame in container.decode(*streams):
                if isinstance(frame, av.VideoFrame):
                    info["frames"] += 1
                else:
                    samples += frame.samples
        except av.error.FFmpegError as err:
            raise MediaError(f"{path} is corrupt ({err.strerror}); regenerate or re-encode it") from None
    if info["sample_rate"]:
        info["audio_duration"] = samples / info["sample_rate"]
    return info
