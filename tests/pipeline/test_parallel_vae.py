"""Tile-parallel VAE decode and the pipelined writer, on the tiny VAEs (CPU, gloo).

Exactness: the same tile decodes on every world size and the writing rank stitches with the single-process code, so
the uint8 frames are bitwise equal to `VideoVAE.decode_stream`'s, and 2 and 4 ranks write MP4s whose decoded frames
and audio equal the 1-rank file's (libx264 is deterministic). Collectives run under launch()'s 60 s timeout.
"""

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist

from h3trt.models.audio_vae import AudioVAE
from h3trt.models.tiny import TINY_HEIGHT, TINY_WIDTH, tiny_audio_vae, tiny_video_vae
from h3trt.models.video_vae import VideoVAE
from h3trt.parallel.launch import init_rank, launch
from h3trt.media.inputs import read_video
from h3trt.media.encoder import OutputConfig
from h3trt.pipeline.parallel_decode import TAIL_STEPS, DecodeResult, deal_waves, decode_and_write, decode_frames

LATENT_H, LATENT_W = TINY_HEIGHT // 16, TINY_WIDTH // 16  # 6 x 10 latents: 96 x 160 px
TILE_PX, TILE_OVERLAP_PX = 64, 16
QUEUE = OutputConfig(chunk_frames=4, max_pending_frames=8)  # toy tiling: 2 x 3 = 6 tiles per window, not a multiple of 4 ranks


def _vaes():
    video = tiny_video_vae()
    video.enable_tiling(TILE_PX, TILE_PX, TILE_OVERLAP_PX, TILE_OVERLAP_PX)
    audio = tiny_audio_vae()
    return (VideoVAE(video, video.config.latents_mean, video.config.latents_std),
            AudioVAE(audio, audio.config.latents_mean, audio.config.latents_std))


def _latents(latent_frames: int, audio_latents: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, 24, latent_frames, LATENT_H, LATENT_W, generator=g)
    return video, torch.randn(2 * audio_latents, 32, generator=g)


def test_waves_deal_every_tile_once_and_pad_idle_ranks():
    for jobs, world in [(6, 4), (28, 2), (196, 8), (3, 4), (1, 1)]:
        waves = deal_waves(jobs, world)
        dealt = [j for wave in waves for j in wave if j is not None]
        assert sorted(dealt) == list(range(jobs))
        assert all(len(wave) == world for wave in waves)  # idle ranks appear as None, and still join the gather
        assert len(waves) == -(-jobs // world)
    assert deal_waves(6, 4) == [[0, 1, 2, 3], [4, 5, None, None]]
    with pytest.raises(ValueError, match="num_jobs >= 1"):
        deal_waves(0, 2)


def test_one_process_frames_are_bitwise_the_stream():
    video, _ = _vaes()
    z, _ = _latents(12, 1)  # 39 frames, 2 windows + the carried overlap
    got = torch.cat(list(decode_frames(video, z)))
    # decode_stream yields [0, 1] floats; the pipeline's uint8 rule was (x * 255).round() per frame.
    want = torch.cat([(c[0].permute(1, 2, 3, 0) * 255.0).round().to(torch.uint8) for c in video.decode_stream(z)])
    assert got.dtype == torch.uint8 and got.shape == (39, 96, 160, 3)
    assert torch.equal(got, want)


def _one_thread(fn):
    """Run fn with one intra-op thread: the spawned ranks use one too, so every world size runs the same kernels
    (and 4 ranks do not oversubscribe two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _write_worker(rank, world, store, out_dir, latent_frames, audio_latents):
    torch.set_num_threads(1)
    init_rank(rank, world, store, "cpu")
    video, audio = _vaes()
    z, rows = _latents(latent_frames, audio_latents)
    try:  # a bad output on the writing rank: every rank refuses before any collective but the agreement
        decode_and_write(video, audio, z, rows, out_dir / "missing" / "clip.mp4", group=dist.group.WORLD)
    except ValueError as e:
        (out_dir / f"world{world}_rank{rank}.refused").write_text(str(e))
    record = decode_and_write(video, audio, z, rows, out_dir / f"world{world}.mp4", group=dist.group.WORLD)
    (out_dir / f"world{world}_rank{rank}.json").write_text(json.dumps(record.to_json()))


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_write_the_same_mp4_as_one_process(tmp_path, world):
    """17 latents: 56 frames, 3 windows x 6 tiles = 18 tiles; over 4 ranks the last wave has 2 idle ranks."""
    latent_frames, audio_latents = 17, 30
    video, audio = _vaes()
    z, rows = _latents(latent_frames, audio_latents)
    one = _one_thread(lambda: decode_and_write(video, audio, z, rows, tmp_path / "world1.mp4"))
    assert one.wrote and one.frames == 56 and one.timings_s["decode_tail_s"] >= 0
    launch(_write_worker, world, (tmp_path, latent_frames, audio_latents))

    video1, fps1, audio1 = read_video(tmp_path / "world1.mp4")
    assert video1.shape == (56, 96, 160, 3) and fps1 == 24
    assert audio1 is not None and audio1.shape[0] == 2
    video_n, _, audio_n = read_video(tmp_path / f"world{world}.mp4")
    assert np.array_equal(video_n, video1), f"world {world}: frames differ from one process's"
    assert np.array_equal(audio_n, audio1), f"world {world}: audio differs from one process's"
    records = [DecodeResult.from_json(json.loads((tmp_path / f"world{world}_rank{r}.json").read_text()))
               for r in range(world)]
    assert [r.wrote for r in records] == [True] + [False] * (world - 1)
    assert records[0].frames == 56 and records[0].audio_samples == audio_latents * 800
    assert records[0].timings_s["audio_decode"] > 0  # decoded on the last rank, broadcast with its time
    # The host tail splits into consecutive steps on the writing rank (rounded to 0.1 ms each).
    tail = records[0].tail_s
    assert list(tail) == [step for step, _ in TAIL_STEPS] and min(tail.values()) >= 0
    assert sum(tail.values()) == pytest.approx(records[0].timings_s["decode_tail_s"], abs=1e-3)
    assert all(r.tail_s == {} for r in records[1:])
    refused = [(tmp_path / f"world{world}_rank{r}.refused").read_text() for r in range(world)]
    assert "missing does not exist" in refused[0]
    assert all("group rank(s) [0] refused the decode" in m for m in refused[1:])
    assert not list(tmp_path.glob(".*partial")) and not (tmp_path / "missing").exists()


def _peak_cpu_bytes(fn, trace_path) -> int:
    """Peak bytes held by torch's CPU allocator while fn runs: the largest running total the profiler recorded
    (sampled at every allocation and free of this thread, which runs the whole decode)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    assert totals, "the profiler recorded no CPU allocations"
    return max(totals) - min(totals[0], totals[-1])


def test_peak_decode_memory_does_not_grow_with_clip_length(tmp_path):
    """5 s (124 frames, 37 latents) and 10 s (244 frames, 73 latents) at 160x96 with 6 tiles a window: the peak of
    the decode plus the pipelined writer is set by one window and one wave, not by the clip."""
    video, audio = _vaes()
    peaks, clip_bytes = {}, {}
    for seconds, latents in ((5, 37), (10, 73)):
        z, rows = _latents(latents, 1)
        path = tmp_path / f"{seconds}s.mp4"

        def run():
            decode_and_write(video, audio, z, rows, path, output_config=QUEUE)

        peaks[seconds] = _peak_cpu_bytes(run, tmp_path / f"{seconds}s.json")
        clip_bytes[seconds] = 4 * 3 * video.plan(latents, LATENT_H, LATENT_W).num_frames * 96 * 160
    assert clip_bytes[10] > 1.9 * clip_bytes[5]
    # Twice the clip, the same peak: what may differ is how full the encoder's queue was (bounded by the config,
    # and by how far the encoder thread lagged on a busy machine). Both stay under one float copy of the clip.
    queue_bytes = QUEUE.max_pending_frames * 96 * 160 * 3
    assert peaks[10] <= peaks[5] + queue_bytes + 256 * 1024, (peaks, queue_bytes)
    assert peaks[10] < 0.75 * clip_bytes[10], (peaks, clip_bytes)
