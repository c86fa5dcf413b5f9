"""Pipelined media output: device uint8 frames -> pinned host chunks -> PyAV on a background thread.

Why a thread: H.264 encoding is host work that would otherwise sit between decoded windows on the critical path.
The decode loop hands over frames as soon as a window is finished and goes on decoding; the encoder thread (the only
thread that touches the `Mp4Writer`) encodes them meanwhile, and encodes AAC the moment the audio arrives. What is
left after the last tile (the "host tail") is the last window's frames plus the encoders' flush.

Copies run on their own CUDA stream into pinned buffers, so a device-to-host copy overlaps the next tile's decode;
the encoder thread waits on each chunk's event, never on the device as a whole. The host buffers are a fixed pool of
`max_pending_frames // chunk_frames` chunks, allocated once and handed back by the encoder thread after use: a slow
encoder back-pressures the decode instead of letting host memory grow with clip length, and no pinned memory is
allocated per chunk.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .media import Mp4Writer

PUT_POLL_S = 0.5  # how often a blocked producer re-checks that the encoder thread is still alive
_STOP = object()


@dataclass(frozen=True)
class OutputConfig:
    """How finished frames travel to the encoder."""

    chunk_frames: int = 8  # frames per device-to-host copy (a window's 17 frames -> 3 copies)
    max_pending_frames: int = 64  # frames queued for the encoder before the decode waits (1344x768: 3 MB each)
    # x264 encodes each frame as it arrives (zerolatency tune) rather than holding ~40 in its lookahead, so what is
    # left after the last tile is that window's frames, not the buffered backlog (the host tail; media.py measures it).
    low_latency: bool = True

    def __post_init__(self):
        if self.chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {self.chunk_frames}.")
        if self.max_pending_frames < self.chunk_frames:
            raise ValueError(f"max_pending_frames ({self.max_pending_frames}) must hold at least one chunk "
                             f"(chunk_frames = {self.chunk_frames}).")


class EncoderThreadFailed(RuntimeError):
    """The background encoder raised; its error is chained."""


class PipelinedWriter:
    """An `Mp4Writer` driven by a background thread; use as a context manager on the writing rank only.

    `put_frames` takes uint8 [f, H, W, 3] on any device and returns once the copies are queued; `put_audio` takes
    float32 [2, N] in [-1, 1]. On a clean exit the encoders are flushed and the file is renamed into place; on an
    exception the partial file is deleted (Mp4Writer's contract) and the exception propagates.
    """

    def __init__(self, path: Path, width: int, height: int, fps: int, crf: int, sample_rate: int,
                 device: torch.device, config: OutputConfig = OutputConfig()):
        self.writer = Mp4Writer(path, width, height, fps=fps, crf=crf, sample_rate=sample_rate,
                                low_latency=config.low_latency)  # validates early
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

    def __enter__(self) -> PipelinedWriter:
        self._thread.start()
        return self

    def put_frames(self, frames_FHW3: torch.Tensor) -> None:
        if frames_FHW3.dtype != torch.uint8 or frames_FHW3.ndim != 4:
            raise ValueError(f"put_frames takes uint8 [f, H, W, 3], got {frames_FHW3.dtype} "
                             f"{tuple(frames_FHW3.shape)}.")
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
        """A free host chunk buffer [chunk_frames, H, W, 3]: a new one while the pool is not full, else the next one
        the encoder hands back (waiting for it is the back-pressure)."""
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
            raise EncoderThreadFailed(f"the MP4 encoder thread stopped: {self._error!r}") from self._error

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
                        self.writer.write_frames(buffer[:count].numpy())
                        self._free.put(buffer)
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
        self._thread.join()
        self._pool.clear()  # freed here, on the thread that allocated them
        while not self._free.empty():
            self._free.get_nowait()
        if exc_type is None and self._error is not None:
            raise EncoderThreadFailed(f"the MP4 encoder thread failed: {self._error}") from self._error
