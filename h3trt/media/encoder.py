"""Pipelined media output: device uint8 frames -> yuv420p on the device -> pinned host chunks -> PyAV on a
background thread.

Why a thread: H.264 encoding is host work that would otherwise sit between decoded windows on the critical path.
The decode loop hands over frames as soon as a window is finished and goes on decoding; the encoder thread (the only
thread that touches the `Mp4Writer`) encodes them meanwhile, and encodes AAC the moment the audio arrives. What is
left after the last tile (the "host tail") is the last window's frames plus the encoders' flush. The RGB -> YUV
conversion runs on the device before the copy (rgb_to_yuv420), so the encoder thread only runs x264.

Copies run on their own CUDA stream into pinned buffers, so a device-to-host copy overlaps the next tile's decode;
the encoder thread waits on each chunk's event, never on the device as a whole. The host buffers are a fixed pool of
`max_pending_frames // chunk_frames` chunks, allocated once and handed back by the encoder thread after use: a slow
encoder back-pressures the decode instead of letting host memory grow with clip length, and no pinned memory is
allocated per chunk.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .output_files import OutputError, discard, join_holding_interrupts
from .inputs import MediaError
from .mp4 import X264_PRESETS, Mp4Writer

PUT_POLL_S = 0.5  # how often a blocked producer re-checks that the encoder thread is still alive
_STOP = object()
KR, KB = 0.2126, 0.0722  # BT.709 luma weights of red and blue (green gets the rest)
# RGB (0..255) -> (Y, U, V) offsets from (16, 128, 128) in BT.709 limited range: Y spans 219 levels, U and V 224.
RGB_TO_YUV709 = torch.tensor([
    [KR, 1.0 - KR - KB, KB],
    [-KR / (2.0 * (1.0 - KB)), -(1.0 - KR - KB) / (2.0 * (1.0 - KB)), 0.5],
    [0.5, -(1.0 - KR - KB) / (2.0 * (1.0 - KR)), -KB / (2.0 * (1.0 - KR))],
]) * torch.tensor([[219.0 / 255.0], [224.0 / 255.0], [224.0 / 255.0]])


@functools.lru_cache(maxsize=None)
def _rgb_to_yuv709_on(device: torch.device) -> torch.Tensor:
    """RGB_TO_YUV709 on `device`, copied once: a blocking host-to-device copy per call would sync the decode stream."""
    return RGB_TO_YUV709.to(device)


def rgb_to_yuv420(frames_FHW3: torch.Tensor) -> torch.Tensor:
    """uint8 RGB [F, H, W, 3] (full range) -> uint8 yuv420p [F, H * 3 / 2, W] (BT.709 limited range), computed on
    the frames' device: the Y plane, then U and V ([H/2, W/2] each) flattened, the layout `Mp4Writer.write_yuv420`
    and PyAV's yuv420p `from_ndarray` take.

    Why on the device: on the host this conversion is swscale, single-threaded on the encoder thread (~6 ms a
    1344x768 frame on one core), so it adds to every frame of the host tail; on a GPU it is free and halves the bytes
    copied to the host. It reproduces what `Mp4Writer.write_frames` gets from swscale (BT.709 matrix, limited range,
    bilinear + accurate rounding): Y per pixel; chroma from the mean of each horizontal pixel pair, then rows filtered
    by [1, 3, 3, 1] / 8 around each pair of rows (edge rows repeated), i.e. centred siting. Measured against swscale
    on random frames of 8 rows or more: every sample within 1 (rounding), under 1% of them differ.
    """
    if frames_FHW3.dtype != torch.uint8 or frames_FHW3.ndim != 4 or frames_FHW3.shape[-1] != 3:
        raise ValueError(f"rgb_to_yuv420 takes uint8 [F, H, W, 3], got {frames_FHW3.dtype} {tuple(frames_FHW3.shape)}.")
    f, h, w, _ = frames_FHW3.shape
    if h % 2 or w % 2:
        raise ValueError(f"yuv420p needs an even frame size, got {w}x{h}.")
    yuv = frames_FHW3.float() @ _rgb_to_yuv709_on(frames_FHW3.device).T  # [F, H, W, 3], offsets not added yet
    y = yuv[..., 0] + (16.0 + 0.5)  # + 0.5: floor below rounds to nearest
    pairs = yuv.view(f, h, w // 2, 2, 3)[..., 1:].sum(3)  # [F, H, W/2, 2] U, V: twice the pair mean
    rows = torch.cat([pairs[:, :1], pairs, pairs[:, -1:]], 1)  # edge rows repeated: H + 2 rows
    uv = rows[:, 0:h:2] + rows[:, 3::2] + 3.0 * (rows[:, 1:h + 1:2] + rows[:, 2:h + 2:2])  # 16x the filtered mean
    uv = (uv / 16.0 + (128.0 + 0.5)).permute(0, 3, 1, 2)  # [F, 2, H/2, W/2]
    planes = torch.cat([y.reshape(f, -1), uv.reshape(f, -1)], 1)
    return planes.floor_().clamp_(0, 255).to(torch.uint8).view(f, h * 3 // 2, w)


@dataclass(frozen=True)
class OutputConfig:
    """How finished frames travel to the encoder."""

    chunk_frames: int = 8  # frames per device-to-host copy (a window's 17 frames -> 3 copies)
    max_pending_frames: int = 64  # frames queued for the encoder before the decode waits (1344x768: 3 MB each)
    # x264 encodes each frame as it arrives (zerolatency tune) rather than holding ~40 in its lookahead, so what is
    # left after the last tile is that window's frames, not the buffered backlog (the host tail; mp4.py measures it).
    low_latency: bool = True
    # x264 preset: the last window's frames cost their encode time after the last tile. Measured with zerolatency at
    # CRF 18 on 2 CPU cores, 124 frames of 1344x768 (the last 18 frames + flush + close; file; PSNR vs the input):
    #   smooth colour fields + mild noise: medium 0.77 s, 9.0 MB, 47.7 dB; faster 0.53 s, 8.0 MB, 47.6 dB;
    #     veryfast 0.34 s, 9.2 MB, 47.7 dB; superfast 0.38 s, 14.7 MB, 48.9 dB.
    #   uniform noise (x264's worst case): medium 1.98 s, 65 MB, 30.8 dB; veryfast 0.67 s, 58 MB, 29.3 dB.
    # veryfast: 2.3x to 3x faster than medium at the same CRF, with the same size and PSNR on smooth content.
    preset: str = "veryfast"
    # RGB -> yuv420p with rgb_to_yuv420 on the frames' device before the copy (True), or swscale on the encoder
    # thread (False). On a GPU the former is free; on the CPU torch takes ~40 ms a 1344x768 frame on 2 cores against
    # swscale's ~6 ms, so a full-size decode on the CPU would rather pass False. The two agree within 1 per sample.
    convert_on_device: bool = True

    def __post_init__(self):
        if self.chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {self.chunk_frames}.")
        if self.max_pending_frames < self.chunk_frames:
            raise ValueError(f"max_pending_frames ({self.max_pending_frames}) must hold at least one chunk "
                             f"(chunk_frames = {self.chunk_frames}).")
        if self.preset not in X264_PRESETS:
            raise ValueError(f"preset {self.preset!r} is not an x264 preset; use one of {X264_PRESETS}.")


class EncoderThreadFailed(RuntimeError):
    """The background encoder raised; its error is chained."""


class PipelinedWriter:
    """An `Mp4Writer` driven by a background thread; use as a context manager on the writing rank only.

    `put_frames` takes uint8 RGB [f, H, W, 3] on any device, converts it to yuv420p there and returns once the copies
    are queued; `put_audio` takes float32 [2, N] in [-1, 1]. On a clean exit the encoders are flushed and the file is
    renamed into place (with `commit=False` it stays at `writer.partial_path` for the caller to commit); on an
    exception the partial file is deleted (Mp4Writer's contract) and the exception propagates. A failure to write
    (full disk, read-only folder) surfaces as one-line files.OutputError, the partial file deleted.
    """

    def __init__(self, path: Path, width: int, height: int, fps: int, crf: int, sample_rate: int,
                 device: torch.device, config: OutputConfig = OutputConfig(), commit: bool = True):
        self.writer = Mp4Writer(path, width, height, fps=fps, crf=crf, sample_rate=sample_rate,
                                low_latency=config.low_latency, preset=config.preset, commit=commit)  # validates early
        self.device, self.config = torch.device(device), config
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._queue: queue.Queue = queue.Queue()
        self._free: queue.Queue = queue.Queue()  # host chunk buffers the encoder has finished with
        self._pool_left = config.max_pending_frames // config.chunk_frames  # buffers not allocated yet
        self._pool: list[torch.Tensor] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="h3trt-encoder", daemon=True)
        self.encode_s = 0.0  # encoder-thread time spent encoding and muxing (overlaps the decode)
        self.frames_queued = 0
        self.audio_samples = 0
        # perf_counter() of the last frames handed over (queued) and the last frames encoded; with the writer's own
        # marks (flushed, closed, renamed) they split the host tail.
        self.marks: dict[str, float] = {}

    def __enter__(self) -> PipelinedWriter:
        self._thread.start()
        return self

    def put_frames(self, frames_FHW3: torch.Tensor) -> None:
        if frames_FHW3.dtype != torch.uint8 or frames_FHW3.ndim != 4:
            raise ValueError(f"put_frames takes uint8 [f, H, W, 3], got {frames_FHW3.dtype} "
                             f"{tuple(frames_FHW3.shape)}.")
        if self.config.convert_on_device:  # no swscale on the encoder thread, half the bytes copied
            frames_FHW3 = rgb_to_yuv420(frames_FHW3)  # [f, H * 3 / 2, W]
        self.marks["handed_over"] = time.perf_counter()  # before the copies are queued: the encoder comes after
        for start in range(0, frames_FHW3.shape[0], self.config.chunk_frames):
            chunk = frames_FHW3[start:start + self.config.chunk_frames]
            buffer = self._buffer(chunk.shape[1:])
            self._queue.put(("frames", (buffer, chunk.shape[0]), self._copy(chunk, buffer[:chunk.shape[0]])))
            self.frames_queued += chunk.shape[0]

    def put_audio(self, waveform_2N: torch.Tensor) -> None:
        self._check_alive()
        audio = waveform_2N.detach().float().clamp(-1, 1).cpu().numpy()
        self.audio_samples = int(audio.shape[1])
        self._queue.put(("audio", audio, None))

    def _buffer(self, frame_shape: torch.Size) -> torch.Tensor:
        """A free host chunk buffer [chunk_frames, *frame_shape] (yuv420p or RGB): a new one while the pool is not
        full, else the next one the encoder hands back (waiting for it is the back-pressure)."""
        self._check_alive()
        if self._pool_left:
            self._pool_left -= 1
            self._pool.append(torch.empty((self.config.chunk_frames, *frame_shape), dtype=torch.uint8,
                                          pin_memory=self.cuda))
            return self._pool[-1]
        while True:
            try:
                return self._free.get(timeout=PUT_POLL_S)
            except queue.Empty:
                self._check_alive()

    def _copy(self, chunk: torch.Tensor, host: torch.Tensor) -> torch.cuda.Event | None:
        if not self.cuda:
            host.copy_(chunk)
            return None
        # Copy on a side stream into pinned memory: the D2H transfer overlaps the next tile's kernels, and the
        # encoder thread waits on this chunk's event only.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            host.copy_(chunk, non_blocking=True)
            chunk.record_stream(self.copy_stream)  # the decode may free `chunk` before the copy ran
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return event

    def _check_alive(self) -> None:
        if self._error is not None or not self._thread.is_alive():
            raise self._failure("stopped") from self._error

    def _failure(self, how: str) -> Exception:
        """The encoder thread's error for the producer: writing problems (OSError: a full disk, a read-only folder;
        MediaError: the file could not be created; OutputError: the final rename) as one line naming the file."""
        error = self._error
        if isinstance(error, OutputError):
            return error
        if isinstance(error, (OSError, MediaError)):
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            return OutputError(f"{self.writer.path}: writing the clip failed ({reason}); its temporary file was "
                               "removed.")
        return EncoderThreadFailed(f"the MP4 encoder thread {how}: {error!r}")

    def _run(self) -> None:
        try:
            with self.writer:
                while True:
                    item = self._queue.get()
                    if item is _STOP:
                        break
                    kind, data, event = item
                    if kind == "abort":  # leave Mp4Writer through an exception: it deletes the partial file
                        raise RuntimeError("the decode failed; output discarded")
                    if event is not None:
                        event.synchronize()
                    start = time.perf_counter()
                    if kind == "frames":
                        buffer, count = data
                        w = self.writer
                        (w.write_yuv420 if self.config.convert_on_device else w.write_frames)(buffer[:count].numpy())
                        self._free.put(buffer)
                        self.marks["encoded"] = time.perf_counter()
                    else:
                        self.writer.write_audio(np.ascontiguousarray(data))
                    self.encode_s += time.perf_counter() - start
                start = time.perf_counter()
            self.encode_s += time.perf_counter() - start  # flush both encoders, close, rename
        except BaseException as e:  # noqa: BLE001 - handed to the producer, which raises it
            self._error = e  # a producer waiting for a buffer sees it within PUT_POLL_S

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self._thread.is_alive():
            # Make the thread leave Mp4Writer through an exception, which deletes the partial file.
            self._queue.put(("abort", None, None))
        else:
            self._queue.put(_STOP)
        # The thread ends within a few frames' encode; a Ctrl-C meanwhile waits for it (never leave it in FFmpeg).
        interrupted = join_holding_interrupts(self._thread)
        self._pool.clear()  # freed here, on the thread that allocated them
        while not self._free.empty():
            self._free.get_nowait()
        if interrupted and exc_type is None:
            discard(self.writer.partial_path)
            raise KeyboardInterrupt
        if exc_type is None and self._error is not None:
            raise self._failure("failed") from self._error
