"""Tile-parallel video decode over the ranks of one process group, and the decode-and-write stage (4-5).

Every rank of `group` calls with the same latents. The work is exactly the single-GPU decode's: the (window, tile)
pairs of `VideoVAE.plan`, in window-major order, dealt out in waves of one tile per rank. After each wave the tiles
are gathered on the group's first rank, which stitches a window as soon as its last tile arrives (the same `stitch`
and `WindowFrames` the single-process stream uses, so the frames are bitwise equal on one device type), converts it
to uint8 on the device and hands it to the background encoder while the next waves decode. Only that rank ever
holds pixels of more than one tile, and never more than one window plus one wave of them.

Audio decodes beside the video on the group's last rank (the one with the fewest tiles), on its own thread and CUDA
stream, and reaches the writing rank in one broadcast after the first window, so AAC is encoded long before the end.

Shape legend: B batch (1), C channels, T latent frames, F pixel frames, H/W height/width.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from ..media.encoder import OutputConfig, PipelinedWriter
from ..media.output_files import DEFAULT_CRF, join_holding_interrupts
from ..models.packing import AUDIO_SAMPLE_RATE, FPS
from ..models.video_vae import DecodePlan, VideoVAE, WindowFrames, stitch

WRITER_RANK = 0  # group rank that stitches, converts and writes; it also decodes its share of tiles


def deal_waves(num_jobs: int, world: int) -> list[list[int | None]]:
    """Job index each rank decodes in each wave: wave i gives rank r job i * world + r, or None past the end.

    A rank with None still joins that wave's gather (with a zero tile), so a tile count that the world size does not
    divide cannot leave the other ranks waiting in a collective nobody else enters.
    """
    if num_jobs < 1 or world < 1:
        raise ValueError(f"deal_waves needs num_jobs >= 1 and world >= 1, got {num_jobs} and {world}.")
    return [[j if (j := i * world + r) < num_jobs else None for r in range(world)]
            for i in range(math.ceil(num_jobs / world))]


def tile_output_shape(video_vae: VideoVAE, plan: DecodePlan, batch: int) -> tuple[int, ...]:
    """[B, 3, F, h, w] of every tile's pixels. Gathers need one shape, and diffusers' tiling gives it: equal
    windows (5 + 2 latents) and equal tiles (the tile size, or the whole frame when it fits in one tile)."""
    sizes = {(t.y1 - t.y0, t.x1 - t.x0) for t in plan.tiles}
    lengths = {stop - start for start, stop in plan.windows}
    if len(sizes) != 1 or len(lengths) != 1:
        raise ValueError(f"Tile-parallel decode needs equal tiles and windows; this plan has tile sizes {sorted(sizes)}"
                         f" and window lengths {sorted(lengths)} (latent units).")
    (h, w), (t,) = sizes.pop(), lengths
    dec = video_vae.vae.decoder
    return batch, dec.out_channels, t * dec.patch_size_t, h * dec.patch_size, w * dec.patch_size


def to_uint8_frames(frames_BCFHW: torch.Tensor) -> torch.Tensor:
    """Finished frames in the VAE's output space -> uint8 [F, H, W, 3] on the same device (batch item 0)."""
    unit = VideoVAE.to_unit_range(frames_BCFHW)
    return (unit[0].permute(1, 2, 3, 0) * 255.0).round().to(torch.uint8).contiguous()


def _group_rank_world(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _comm_device(group, device: torch.device) -> torch.device:
    return device if group is not None and dist.get_backend(group) == "nccl" else torch.device("cpu")


def _agree(group, rank: int, world: int, shape: tuple[int, ...], error: Exception | None) -> None:
    """Every rank checks its inputs before the first collective, then all learn whether any rank refused and whether
    the latent shapes agree, so a bad call fails on every rank with the reason instead of hanging the others."""
    if group is None:
        if error is not None:
            raise error
        return
    device = _comm_device(group, torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                          else torch.device("cpu"))
    mine = torch.tensor([0 if error is not None else 1, *shape], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    every = [tuple(t.tolist()) for t in every]
    if error is not None:
        raise error
    refused = [r for r, row in enumerate(every) if row[0] == 0]
    if refused:
        raise ValueError(f"group rank(s) {refused} refused the decode (see their error); rank {rank} stops too.")
    shapes = {row[1:] for row in every}
    if len(shapes) != 1:
        raise ValueError(f"The ranks of the decode group hold different latent shapes {[r[1:] for r in every]}; "
                         "every rank must pass the same latents.")


@torch.no_grad()
def decode_frames(video_vae: VideoVAE, latents_BCTHW: torch.Tensor, group=None,
                  between_waves: Callable[[int], None] | None = None,
                  marks: dict[str, float] | None = None) -> Iterator[torch.Tensor]:
    """Finished frames as uint8 [F, H, W, 3] on the VAE's device, in order, one window at a time.

    Yields on group rank 0 only; every rank must exhaust the iterator (it runs the collectives). `between_waves(i)`
    runs on every rank after wave i's gather was issued (a fixed point for other collectives). `marks["last_tile"]`
    is set on rank 0 when the last tile is on hand (device synchronised): the start of the host tail.
    """
    rank, world = _group_rank_world(group)
    z, plan = video_vae.prepare(latents_BCTHW)
    shape = tile_output_shape(video_vae, plan, z.shape[0])
    out_dtype = video_vae.vae.decoder.proj_out.weight.dtype
    jobs = [(w, t) for w in range(len(plan.windows)) for t in range(len(plan.tiles))]
    waves = deal_waves(len(jobs), world)
    dst = None if group is None else dist.get_global_rank(group, WRITER_RANK)
    frames = WindowFrames(video_vae.vae, plan)
    tiles_of: dict[int, list] = {}
    done_windows = 0

    def decode(job: int | None) -> torch.Tensor:
        if job is None:
            # This rank has no tile left in this wave but still joins the gather, so uneven counts cannot hang.
            return torch.zeros(shape, dtype=out_dtype, device=z.device)
        w, t = jobs[job]
        pixels = video_vae.decode_tile(video_vae.window_latents(z, plan, w), plan.tiles[t])
        if tuple(pixels.shape) != shape or pixels.dtype != out_dtype:
            raise ValueError(f"A decoded tile is {pixels.dtype} {tuple(pixels.shape)}, expected {out_dtype} {shape}.")
        return pixels

    def collect(wave: int, work, gathered) -> Iterator[torch.Tensor]:
        nonlocal done_windows
        if work is not None:
            work.wait()
        if rank != WRITER_RANK:
            return
        if wave == len(waves) - 1 and marks is not None:
            if z.device.type == "cuda":
                torch.cuda.synchronize(z.device)
            marks["last_tile"] = time.perf_counter()
        for r, job in enumerate(waves[wave]):
            if job is not None:
                w, t = jobs[job]
                tiles_of.setdefault(w, [None] * len(plan.tiles))[t] = gathered[r]
        # Jobs are window-major, so windows complete in order.
        while done_windows in tiles_of and all(p is not None for p in tiles_of[done_windows]):
            clip = stitch(video_vae.vae, plan, tiles_of.pop(done_windows))
            done_windows += 1
            yield to_uint8_frames(frames.push(clip))

    pending = None
    for i, wave in enumerate(waves):
        local = decode(wave[rank])
        if group is None:
            work, gathered = None, [local]
        else:
            gathered = [torch.empty_like(local) for _ in range(world)] if rank == WRITER_RANK else None
            work = dist.gather(local, gathered, dst=dst, group=group, async_op=True)
        if pending is not None:  # the previous wave's tiles travel while this wave decoded
            yield from collect(*pending)
        pending = (i, work, gathered)
        if between_waves is not None:
            between_waves(i)
    yield from collect(*pending)
    if rank == WRITER_RANK:
        tail = frames.finish()
        if tail is not None:
            yield to_uint8_frames(tail)


class _AudioDecode:
    """The audio decode on its own thread (and CUDA stream), so it runs while this rank decodes video tiles."""

    def __init__(self, audio_vae, audio_rows: torch.Tensor, on_done: Callable[[torch.Tensor], None] | None = None):
        self.audio_vae, self.rows, self.on_done = audio_vae, audio_rows, on_done
        self.waveform, self.seconds, self.error = None, 0.0, None
        self.thread = threading.Thread(target=self._run, name="h3trt-audio-decode", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            device = self.audio_vae.device
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else nullcontext()):
                self.waveform = self.audio_vae.decode_rows(self.rows)  # ends with a copy to the host: synchronised
            self.seconds = time.perf_counter() - start
            if self.on_done is not None:
                self.on_done(self.waveform)
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread by result()
            self.error = e

    def join(self) -> None:
        """Wait for the thread, through Ctrl-C too (it ends by itself within one audio decode), then deliver it."""
        if join_holding_interrupts(self.thread):
            raise KeyboardInterrupt

    def result(self) -> torch.Tensor:
        self.join()
        if self.error is not None:
            raise RuntimeError(f"audio decode failed: {self.error}") from self.error
        return self.waveform


def _validate(video_vae: VideoVAE, video_latents: torch.Tensor, audio_rows: torch.Tensor) -> None:
    channels = video_vae.vae.config.latent_channels
    if video_latents.ndim != 5 or video_latents.shape[0] != 1 or video_latents.shape[1] != channels:
        raise ValueError(f"video latents must be [1, {channels}, T, H, W], got {tuple(video_latents.shape)}.")
    if audio_rows.ndim != 2 or audio_rows.shape[0] % 2 or audio_rows.shape[0] == 0:
        raise ValueError(f"audio rows must be [2A, C] (left then right channel), got {tuple(audio_rows.shape)}.")


# The host tail as consecutive steps, each named by where it ends: (step, mark it ends at). Marks are perf_counter()
# times: last_tile (decode_frames), handed_over / encoded (PipelinedWriter), audio_flushed ... renamed (Mp4Writer).
TAIL_STEPS = (
    ("to_encoder", "handed_over"),  # stitch the last window, blend, uint8 + YUV on the device, copies queued
    ("encode", "encoded"),  # the last frames through x264 (waits for their device-to-host copies)
    ("audio_flush", "audio_flushed"),  # the decode loop ends (a single process joins its audio thread); AAC flushed
    ("video_flush", "video_flushed"),  # x264's delayed frames (none with zerolatency)
    ("close_faststart", "closed"),  # the index written, then moved to the front: a second pass over the file
    ("rename", "renamed"),  # os.replace of the partial file
    ("join", "end"),  # the encoder thread joined, buffers released
)


def tail_steps(marks: dict[str, float]) -> dict[str, float]:
    """Seconds of each TAIL_STEPS step from `marks` (they sum to end - last_tile)."""
    previous, steps = marks["last_tile"], {}
    for step, mark in TAIL_STEPS:
        steps[step], previous = marks[mark] - previous, marks[mark]
    return steps


@dataclass(frozen=True)
class DecodeResult:
    """What `decode_and_write` did on one rank of its group. Its JSON is the fields in this order (the dict the
    function returned before it was a type; a rank's record file in tests/pipeline/test_parallel_vae.py)."""

    frames: int  # frames decoded (on the writing rank: handed to the encoder)
    audio_samples: int  # stereo samples written (0 on a rank that does not write)
    wrote: bool  # this rank wrote the MP4 (the group's first)
    mp4_temp: Path | None  # commit=False, on the writing rank: the finished MP4 under its temporary name
    # video_decode (until the last frames were queued), audio_decode (on its rank); on the writing rank also mux
    # (encoder-thread time, overlapping the decode) and decode_tail_s (last tile on hand -> MP4 closed or renamed)
    timings_s: dict[str, float]
    tail_s: dict[str, float]  # decode_tail_s as consecutive TAIL_STEPS steps, on the writing rank; elsewhere {}

    def to_json(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "mp4_temp": str(self.mp4_temp) if self.mp4_temp is not None else None}

    @classmethod
    def from_json(cls, data: dict) -> DecodeResult:
        temp = data["mp4_temp"]
        return cls(**{**data, "mp4_temp": Path(temp) if temp is not None else None})


class _AudioToWriter:
    """The audio's way to the writing rank. It decodes on the group's last rank (the one with the fewest tiles: jobs
    are dealt from rank 0), on its own thread. One process hands the waveform from that thread straight to AAC; a
    group broadcasts it once, at a fixed wave (the one that deals window 0's last tile) on every rank, with its
    decode time, so AAC is encoded long before the video ends."""

    def __init__(self, audio_vae, audio_rows: torch.Tensor, video_vae: VideoVAE, video_latents: torch.Tensor, group,
                 writer: PipelinedWriter | None):
        self.group, self.writer, self.device = group, writer, video_vae.device
        self.rank, self.world = _group_rank_world(group)
        self.audio_rank = self.world - 1
        self.num_samples = audio_rows.shape[0] // 2 * audio_vae.hop_length
        self.seconds = 0.0  # the audio decode's time: its own rank's, or the writer's copy from the broadcast
        self.handoff_wave = (len(video_vae.plan(*video_latents.shape[2:]).tiles) - 1) // self.world
        self.decode = None
        if self.rank == self.audio_rank:
            self.decode = _AudioDecode(audio_vae, audio_rows, self._put if self.world == 1 else None)

    def _checked(self, waveform: torch.Tensor) -> torch.Tensor:
        if tuple(waveform.shape) != (2, self.num_samples):
            raise ValueError(f"audio decode gave {tuple(waveform.shape)}, expected (2, {self.num_samples}).")
        return waveform

    def _put(self, waveform: torch.Tensor) -> None:  # one process: on the audio thread
        self.writer.put_audio(self._checked(waveform))

    def between_waves(self, i: int) -> None:
        if self.world == 1 or i != self.handoff_wave:
            return
        buf = torch.empty(2 * self.num_samples + 1, dtype=torch.float32, device=_comm_device(self.group, self.device))
        if self.rank == self.audio_rank:
            buf.copy_(torch.cat([self._checked(self.decode.result()).reshape(-1), torch.tensor([self.decode.seconds])]))
        dist.broadcast(buf, src=dist.get_global_rank(self.group, self.audio_rank), group=self.group)
        if self.rank == WRITER_RANK:
            host = buf.cpu()
            self.seconds = float(host[-1])
            self.writer.put_audio(host[:-1].view(2, self.num_samples))

    def finish(self) -> None:
        """After the video: a single process's audio thread may still be running; its error surfaces here."""
        if self.decode is not None:
            self.decode.result()
            self.seconds = self.decode.seconds

    def join(self) -> None:
        """On a failure: never leave the audio thread inside torch (exiting under it aborts the process, SIGABRT)."""
        if self.decode is not None:
            self.decode.join()


def _open_writer(video_vae: VideoVAE, video_latents: torch.Tensor, audio_rows: torch.Tensor, output: Path, group,
                 fps: int, crf: int, sample_rate: int, output_config: OutputConfig,
                 commit: bool) -> PipelinedWriter | None:
    """Everything that can refuse the call, before the first collective: the inputs on every rank, the output path,
    size and encoder on the writing rank (its writer, None elsewhere); then the group agrees (`_agree`)."""
    rank, world = _group_rank_world(group)
    writer, error = None, None
    try:
        _validate(video_vae, video_latents, audio_rows)
        if rank == WRITER_RANK:
            height, width = (s * video_vae.vae.spatial_compression_ratio for s in video_latents.shape[3:])
            writer = PipelinedWriter(output, width, height, fps, crf, sample_rate, video_vae.device, output_config,
                                     commit=commit)
    except ValueError as e:  # MediaError is a ValueError
        error = e
    _agree(group, rank, world, tuple(video_latents.shape) + tuple(audio_rows.shape), error)
    return writer


@torch.no_grad()
def decode_and_write(video_vae: VideoVAE, audio_vae, video_latents: torch.Tensor, audio_rows: torch.Tensor,
                     output: Path, group=None, fps: int = FPS, crf: int = DEFAULT_CRF,
                     sample_rate: int = AUDIO_SAMPLE_RATE, output_config: OutputConfig = OutputConfig(),
                     commit: bool = True, on_frames: Callable[[int], None] | None = None) -> DecodeResult:
    """Stages 4-5: decode video (tile-parallel over `group`) and audio, and write the MP4 on group rank 0.

    Every rank of `group` (None: this process alone) calls with the same normalised latents [1, C, T, H, W] and
    audio rows [2A, C], and gets its DecodeResult. With `commit=False` the finished MP4 stays under its temporary
    name, returned as mp4_temp on the writing rank, for the caller to commit with its record (output_files.commit);
    on any failure or interrupt nothing is left behind and no thread is left running. `on_frames(n)`: called on the
    writing rank with the number of frames handed to the encoder so far.
    """
    # 1. Open: every rank checks, the writer opens its MP4; the group agrees before any other collective.
    writer = _open_writer(video_vae, video_latents, audio_rows, output, group, fps, crf, sample_rate, output_config,
                          commit)
    start = time.perf_counter()
    # 2. Audio beside the video, on its own rank and thread.
    audio = _AudioToWriter(audio_vae, audio_rows, video_vae, video_latents, group, writer)
    # 3. Video, a window at a time into the encoder; the writer closes (and renames, with commit) at the end.
    marks: dict[str, float] = {}
    frames = 0
    try:
        with writer if writer is not None else nullcontext():
            for chunk in decode_frames(video_vae, video_latents, group, audio.between_waves, marks):
                writer.put_frames(chunk)
                frames += chunk.shape[0]
                if on_frames is not None:
                    on_frames(frames)
            audio.finish()
            decoded = time.perf_counter()
    except BaseException:
        audio.join()
        raise
    end = time.perf_counter()
    # 4. What this rank did.
    timings = {"video_decode": decoded - start, "audio_decode": audio.seconds}
    tail = {}
    if writer is not None:
        timings.update(mux=writer.encode_s, decode_tail_s=end - marks["last_tile"])
        tail = tail_steps({**marks, **writer.marks, **writer.writer.marks, "end": end})
    return DecodeResult(frames, writer.audio_samples if writer else 0, writer is not None,
                        writer.writer.partial_path if writer is not None and not commit else None,
                        {k: round(v, 4) for k, v in timings.items()}, {k: round(v, 4) for k, v in tail.items()})
