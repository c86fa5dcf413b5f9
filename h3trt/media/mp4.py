"""Writing MP4s: H.264 yuv420p video and AAC audio, streamed window by window and committed atomically.

Everything goes through PyAV's bundled FFmpeg so the engine needs no `ffmpeg` binary on PATH. A problem a caller can
cause (a wrong frame shape, an odd frame size, an unknown preset) raises `MediaError` (inputs.py) with one line naming
the file, the problem and the fix, because these messages end up verbatim in `h3trt run` output.
"""

from __future__ import annotations

import os
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from av.video.reformatter import ColorPrimaries, ColorRange, ColorTrc, Colorspace, Interpolation

from .output_files import DEFAULT_CRF, commit, discard, temp_path
from .inputs import DEFAULT_SAMPLE_RATE, MediaError

DEFAULT_FPS = 24
# AAC-LC at 32 kHz stereo is transparent well below this; fixed so output size does not depend on FFmpeg defaults.
AAC_BIT_RATE = 160_000
# x264's presets, fastest first: each step searches harder for the same CRF quality (smaller file, more time).
X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")


def _h264_encoder(crf: int, width: int, height: int, fps: Fraction, low_latency: bool = False,
                  preset: str = "medium") -> tuple[str, dict[str, str], int]:
    """Pick the H.264 encoder; return (name, codec options, bit_rate or 0) expressing quality `crf`.

    libx264 is preferred because CRF is its native rate control. libopenh264, the only other software H.264 encoder
    FFmpeg ships, has no CRF, so it gets a bitrate instead: 0.1 bit per pixel per frame at CRF 18, halving every 6
    CRF steps (x264's rule of thumb). Hardware encoders (nvenc, qsv, amf, v4l2m2m) are listed by `codecs_available`
    whenever FFmpeg was built with them, even on machines without the device, so they are never chosen.

    `low_latency` (x264's zerolatency tune: no lookahead, no B-frames, sliced threads) encodes each frame as it
    arrives instead of buffering ~40 in the lookahead; closing then costs the last frames only, not the buffered
    backlog. Measured on 2 CPU cores, 1344x768: the last 18 frames + flush took 43.8 s at preset medium, 3.6 s with
    zerolatency. The price is compression: the same CRF gives a larger file.

    `preset` is x264's speed/compression trade-off (X264_PRESETS); it changes how hard x264 searches, while CRF keeps
    meaning the same target quality. libopenh264 has no presets and ignores it.
    """
    available = av.codec.codecs_available
    if "libx264" in available:
        # Always named (medium is x264's default) so a change in FFmpeg's default cannot change our output.
        options = {"crf": str(crf), "preset": preset}
        return "libx264", {**options, "tune": "zerolatency"} if low_latency else options, 0
    if "libopenh264" in available:
        bits_per_pixel = 0.1 * 2.0 ** ((DEFAULT_CRF - crf) / 6.0)
        return "libopenh264", {}, max(100_000, int(bits_per_pixel * width * height * float(fps)))
    raise MediaError("PyAV's FFmpeg has no software H.264 encoder (libx264 or libopenh264); reinstall the PyPI "
                     "wheel (`pip install --force-reinstall av`), which bundles libx264")


def _as_numpy(data: Any, what: str, path: Path) -> np.ndarray:
    """Accept numpy arrays and torch tensors (any device) so callers can hand over decoder output directly."""
    if isinstance(data, torch.Tensor):
        return data.detach().cpu().numpy()
    if isinstance(data, np.ndarray):
        return data
    raise MediaError(f"{path}: {what} is a {type(data).__name__}; pass a numpy array or torch tensor")


class Mp4Writer:
    """Streaming MP4 writer: H.264 yuv420p video plus AAC audio, committed atomically on a clean exit.

    Frames arrive window by window while the model is still producing later windows, so the container is written
    incrementally. The file is built under a temporary name unique to this writer (`atomic.temp_path`:
    `.<name>.<host>-<pid>-<token>.partial`, in the same folder) and renamed onto `path` only after both encoders are
    flushed and the container is closed; an exception in the `with` block deletes it, so a crash never leaves a
    truncated clip that looks finished. `overwrite=False` refuses to replace a `path` that exists by then
    (output_files.OutputExists). With `commit=False` the finished file stays at `partial_path` for the caller to commit
    together with other files (output_files.commit); the caller then owns it.

    Thread-compatible, not thread-safe: any single thread may drive it (e.g. an encoder thread fed by a queue), but
    only one thread at a time. It holds no global state, so independent writers may run on different threads.

    `audio_channels=0` writes a video-only file; otherwise audio must be written before exit.
    """

    def __init__(self, path: str | os.PathLike, width: int, height: int, fps: int | Fraction = DEFAULT_FPS,
                 crf: int = DEFAULT_CRF, sample_rate: int = DEFAULT_SAMPLE_RATE, audio_channels: int = 2,
                 low_latency: bool = False, preset: str = "medium", commit: bool = True,
                 overwrite: bool = True) -> None:
        self.path = Path(path)
        self.commit, self.overwrite = commit, overwrite
        if self.path.suffix.lower() != ".mp4":
            raise MediaError(f"{self.path}: output must be an MP4 file; give it a .mp4 extension")
        if not self.path.parent.is_dir():
            raise MediaError(f"{self.path}: directory {self.path.parent} does not exist; create it first")
        if width <= 0 or height <= 0 or width % 2 or height % 2:
            raise MediaError(f"{self.path}: frame size {width}x{height} is not allowed for yuv420p video; "
                             "width and height must be positive and even (crop or pad by one pixel)")
        if isinstance(fps, bool) or not isinstance(fps, (int, Fraction)) or fps <= 0:
            raise MediaError(f"{self.path}: fps={fps!r} must be a positive int or fractions.Fraction "
                             "(use Fraction(24000, 1001) for 23.976)")
        if not 0 <= crf <= 51:
            raise MediaError(f"{self.path}: crf={crf} is outside H.264's range 0..51; use 18 for visually lossless")
        if preset not in X264_PRESETS:
            raise MediaError(f"{self.path}: preset={preset!r} is not an x264 preset; use one of {X264_PRESETS}")
        if audio_channels not in (0, 1, 2):
            raise MediaError(f"{self.path}: audio_channels={audio_channels} is not supported; use 2 (stereo), "
                             "1 (mono) or 0 (no audio track)")
        if audio_channels and sample_rate <= 0:
            raise MediaError(f"{self.path}: sample_rate={sample_rate} must be positive")
        self.width, self.height, self.fps, self.crf = width, height, Fraction(fps), crf
        self.sample_rate, self.audio_channels = sample_rate, audio_channels
        # Chosen here, not at open, so a missing encoder fails before any generation work starts.
        self.encoder, self._options, self._bit_rate = _h264_encoder(crf, width, height, self.fps,
                                                                    low_latency=low_latency, preset=preset)
        # Hidden, in the same directory (so the commit is an atomic rename on one filesystem), unique to this writer
        # (two runs writing one target never share it), and not ending in .mp4 so globs never pick up an unfinished
        # clip.
        self.partial_path = temp_path(self.path)
        self.frames_written = self.samples_written = 0
        # perf_counter() when closing passed each step (audio_flushed, video_flushed, closed, renamed): what the end
        # of a clip costs after its last frame, for the host-tail breakdown.
        self.marks: dict[str, float] = {}
        self._entered = False
        self._container = self._video = self._audio = None  # PyAV objects, set in __enter__
        # Samples not yet handed to AAC: the encoder takes exactly frame_size samples per frame except the last.
        self._pending = np.zeros((audio_channels, 0), np.float32)

    def __enter__(self) -> Mp4Writer:
        if self._entered:
            raise MediaError(f"{self.path}: this Mp4Writer was already used; create a new writer for each file")
        self._entered = True
        try:
            self._open()
        except BaseException:
            self._discard()
            raise
        return self

    def _open(self) -> None:
        # format="mp4" because the partial name has no .mp4 extension to infer it from; faststart moves the index to
        # the front so browsers can start playback before the whole file has downloaded.
        try:
            self._container = av.open(str(self.partial_path), mode="w", format="mp4",
                                      container_options={"movflags": "+faststart"})
        except (av.error.FFmpegError, OSError) as err:
            raise MediaError(f"{self.path}: cannot create {self.partial_path.name} ({err}); "
                             "check that the directory is writable") from None
        video = self._container.add_stream(self.encoder, rate=self.fps, options=self._options)
        video.width, video.height, video.pix_fmt = self.width, self.height, "yuv420p"
        # One tick per frame: pts = frame index, so the muxer can neither drop nor duplicate frames.
        video.time_base = video.codec_context.time_base = 1 / self.fps
        if self._bit_rate:
            video.bit_rate = self._bit_rate
        # Tag BT.709 limited range, matching the conversion in write_frames, so players do not guess the matrix.
        # (swscale's SWS_CS_ITU709 and FFmpeg's AVCOL_SPC_BT709 are both 1; PyAV exposes only the former.)
        cc = video.codec_context
        cc.colorspace, cc.color_range = int(Colorspace.ITU709), int(ColorRange.MPEG)
        cc.color_primaries, cc.color_trc = int(ColorPrimaries.BT709), int(ColorTrc.BT709)
        self._video = video
        if self.audio_channels:
            layout = "stereo" if self.audio_channels == 2 else "mono"
            audio = self._container.add_stream("aac", rate=self.sample_rate, layout=layout)
            audio.bit_rate = AAC_BIT_RATE
            audio.time_base = audio.codec_context.time_base = Fraction(1, self.sample_rate)
            self._audio = audio
        # Opens both encoders now, so a bad encoder setup fails before any expensive generation work, and so the AAC
        # frame_size is known for write_audio.
        self._container.start_encoding()

    def _require_open(self) -> None:
        if self._container is None:
            raise MediaError(f"{self.path}: Mp4Writer is not open; use it as `with Mp4Writer(...) as w:`")

    def write_frames(self, frames: np.ndarray | torch.Tensor) -> None:
        """Encode a chunk of uint8 RGB frames shaped [T, H, W, 3]; chunks may be any length, including one frame."""
        self._require_open()
        array = _as_numpy(frames, "frames", self.path)
        if array.ndim != 4 or array.shape[1:] != (self.height, self.width, 3):
            raise MediaError(f"{self.path}: frames have shape {tuple(array.shape)}, expected "
                             f"[T, {self.height}, {self.width}, 3] RGB; permute/resize to the writer's size")
        if array.dtype != np.uint8:
            raise MediaError(f"{self.path}: frames have dtype {array.dtype}, expected uint8; "
                             "scale to 0..255, round and cast to uint8 first")
        for rgb in array:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            # Explicit BT.709 limited-range conversion (matching the stream tags) instead of swscale's BT.601 default.
            frame = frame.reformat(format="yuv420p", dst_colorspace=Colorspace.ITU709,
                                   src_color_range=ColorRange.JPEG, dst_color_range=ColorRange.MPEG,
                                   interpolation=Interpolation.BILINEAR | Interpolation.ACCURATE_RND)
            self._encode_video(frame)

    def write_yuv420(self, frames: np.ndarray | torch.Tensor) -> None:
        """Encode uint8 yuv420p frames shaped [T, H * 3 / 2, W]: each the Y plane, then U and V ([H/2, W/2] each)
        flattened, as `av.VideoFrame.from_ndarray(..., format="yuv420p")` takes them. They must already be BT.709
        limited range, what the stream is tagged (output.rgb_to_yuv420 converts on the device); no swscale pass."""
        self._require_open()
        array = _as_numpy(frames, "frames", self.path)
        if array.ndim != 3 or array.shape[1:] != (self.height * 3 // 2, self.width):
            raise MediaError(f"{self.path}: yuv420p frames have shape {tuple(array.shape)}, expected "
                             f"[T, {self.height * 3 // 2}, {self.width}] (height * 3 / 2 rows: Y, then U and V)")
        if array.dtype != np.uint8:
            raise MediaError(f"{self.path}: yuv420p frames have dtype {array.dtype}, expected uint8")
        for planes in array:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(planes), format="yuv420p")
            frame.colorspace, frame.color_range = Colorspace.ITU709, ColorRange.MPEG
            self._encode_video(frame)

    def _encode_video(self, frame: av.VideoFrame) -> None:
        frame.pts = self.frames_written
        self._container.mux(self._video.encode(frame))
        self.frames_written += 1

    def write_audio(self, samples: np.ndarray | torch.Tensor) -> None:
        """Encode float32 samples shaped [channels, N] in [-1, 1] at `sample_rate`; may be called repeatedly."""
        self._require_open()
        if not self.audio_channels:
            raise MediaError(f"{self.path}: writer has audio_channels=0; open it with audio_channels=2 for audio")
        array = _as_numpy(samples, "audio", self.path)
        if array.ndim != 2 or array.shape[0] != self.audio_channels:
            raise MediaError(f"{self.path}: audio has shape {tuple(array.shape)}, expected "
                             f"[{self.audio_channels}, N]; transpose or up/downmix it first")
        if array.dtype != np.float32:
            raise MediaError(f"{self.path}: audio has dtype {array.dtype}, expected float32; cast it first")
        if not np.isfinite(array).all():
            raise MediaError(f"{self.path}: audio contains NaN or infinity; the generated waveform is broken")
        peak = float(np.abs(array).max(initial=0.0))
        if peak > 1.0:
            raise MediaError(f"{self.path}: audio peak {peak:.3f} exceeds 1.0 and would clip; "
                             "clamp with np.clip(audio, -1, 1) or normalise it first")
        self._pending = np.concatenate([self._pending, array], axis=1)
        frame_size = self._audio.codec_context.frame_size
        whole = self._pending.shape[1] // frame_size * frame_size
        for start in range(0, whole, frame_size):
            self._encode_audio(self._pending[:, start:start + frame_size])
        self._pending = self._pending[:, whole:]

    def _encode_audio(self, chunk: np.ndarray) -> None:
        layout = "stereo" if self.audio_channels == 2 else "mono"
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(chunk), format="fltp", layout=layout)
        frame.sample_rate = self.sample_rate
        # pts counts samples, so gaps or overlaps between calls are impossible.
        frame.pts = self.samples_written
        frame.time_base = Fraction(1, self.sample_rate)
        self._container.mux(self._audio.encode(frame))
        self.samples_written += chunk.shape[1]

    def _finish(self) -> None:
        if self.frames_written == 0:
            raise MediaError(f"{self.path}: no video frames were written; call write_frames before leaving the block")
        if self._audio is not None:
            if self.samples_written + self._pending.shape[1] == 0:
                raise MediaError(f"{self.path}: no audio was written; call write_audio, or open the writer with "
                                 "audio_channels=0 for a silent clip")
            if self._pending.shape[1]:
                # The FFmpeg AAC encoder accepts one short final frame (AV_CODEC_CAP_SMALL_LAST_FRAME), so the tail
                # is not padded with silence and the track ends where the samples end.
                self._encode_audio(self._pending)
                self._pending = self._pending[:, :0]
            self._container.mux(self._audio.encode(None))
        self.marks["audio_flushed"] = time.perf_counter()
        self._container.mux(self._video.encode(None))
        self.marks["video_flushed"] = time.perf_counter()
        container, self._container = self._container, None
        container.close()  # writes the index; faststart then moves it to the front (a second pass over the file)
        self.marks["closed"] = time.perf_counter()

    def _discard(self) -> None:
        container, self._container = self._container, None
        if container is not None:
            try:
                container.close()
            except Exception:  # noqa: BLE001 - the caller's exception is the one worth reporting; the file is deleted
                pass
        discard(self.partial_path)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self._discard()
            return
        try:
            self._finish()
        except BaseException:
            self._discard()
            raise
        if self.commit:
            commit([(self.partial_path, self.path)], overwrite=self.overwrite)
        self.marks["renamed"] = time.perf_counter()


def write_mp4(path: str | os.PathLike, frames: np.ndarray | torch.Tensor, audio: np.ndarray | torch.Tensor | None,
              fps: int | Fraction = DEFAULT_FPS, crf: int = DEFAULT_CRF,
              sample_rate: int = DEFAULT_SAMPLE_RATE) -> Path:
    """Write a whole clip at once: frames uint8 [T, H, W, 3] RGB, audio float32 [channels, N] or None for no track."""
    frames = _as_numpy(frames, "frames", Path(path))
    shape = frames.shape
    if len(shape) != 4:
        raise MediaError(f"{path}: frames have shape {shape}, expected [T, H, W, 3]")
    audio = None if audio is None else _as_numpy(audio, "audio", Path(path))
    if audio is not None and audio.ndim != 2:
        raise MediaError(f"{path}: audio has shape {audio.shape}, expected [channels, N]")
    channels = 0 if audio is None else audio.shape[0]
    with Mp4Writer(path, shape[2], shape[1], fps=fps, crf=crf, sample_rate=sample_rate,
                   audio_channels=channels) as writer:
        writer.write_frames(frames)
        if audio is not None:
            writer.write_audio(audio)
    return writer.path
