"""The H3 video decoder on one GPU at every precision against Diffusers' bf16 decoder (--gpus 1, the default), or
tile-parallel decode + pipelined MP4 encode, 1 GPU against N (--gpus N).

The full-size H3 video decoder (diffusers `AutoencoderKLMiniMaxH3` defaults: 36 ViT blocks, dim 2048; random
weights) on a 1344x768, 124-frame latent [1, 24, 37, 48, 84] (7 windows x 28 tiles of 256 px), and the released audio
decoder architecture on 207 audio latents.

--gpus 1, the precision axis, one process, one run of each row after a warm-up (about 4 minutes on an H200):
  Diffusers bf16 loaded as `pipe.load_components(dtype=torch.bfloat16)` loads it (its own loading function and
  `_keep_in_fp32_modules`), `vae.decode` of the clip; h3trt fp32 / bf16 / fp8 (dynamic per-token, and static
  calibrated) eager and compiled (the bundle's in / block / out segments, launched and replayed as one CUDA graph per
  tile). Per row: s per clip (fp32 and eager fp8: one window timed, x 7), speedup vs Diffusers bf16, PSNR / SSIM of
  window 0's 17 frames vs the fp32 decoder and vs Diffusers bf16 (random weights: numeric distance only); then the
  host tail of decode_and_write with the fastest bf16 decoder and the audio decoder's time (compiled too when over 5%
  of the video decode).
--gpus N: ranks self-launched (NCCL, NVLS off), eager decoder at --vae-precision. Per world size, median of --repeats
after one warm-up:
  decode_s       tile-parallel decode to uint8 frames on the writing rank, nothing encoded (the 1.8x bar)
  total_s        decode_and_write: decode + audio + H.264/AAC encode to an MP4 (what `h3trt run` pays)
  tail_s         host tail: last tile on hand -> MP4 renamed into place (the 0.3 s bar), and its steps
                 (tail_steps_s: to_encoder, encode, audio_flush, video_flush, close_faststart, rename, join)
and the encoder thread's busy time, the MP4's size (it depends on --preset) and each rank's peak GPU memory.

  python scripts/bench_vae.py --json bench/results/vae_precision_h200.json        # precision axis, 1 H200
  python scripts/bench_vae.py --tiny                                             # its dry run on this CPU
  python scripts/bench_vae.py --gpus 2 --json bench/results/vae_h200x2.json     # on 2 H200s
  python scripts/bench_vae.py --gpus 2 --cpu-check                               # toy decoder, gloo, this CPU

The precision axis and the random VAEs it and the tile-parallel phases decode are bench_vae_precision.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from bench_common import sync  # noqa: E402  (first: this checkout's h3trt)
from bench_vae_precision import (AUDIO_COMPILE_FRACTION, FULL, TOY, precision_axis, print_axis,  # noqa: E402
                                 random_vaes)

from h3trt.models.audio_vae import AudioVAE  # noqa: E402
from h3trt.models.vae_precision import VAE_PRECISIONS, VAEPrecision, place  # noqa: E402
from h3trt.models.video_vae import VideoVAE  # noqa: E402
from h3trt.calibration.vae_fp8 import quantize_video_decoder  # noqa: E402
from h3trt.parallel.launch import init_rank, launch  # noqa: E402
from h3trt.media.mp4 import X264_PRESETS  # noqa: E402
from h3trt.media.encoder import OutputConfig, rgb_to_yuv420  # noqa: E402
from h3trt.pipeline.parallel_decode import TAIL_STEPS, decode_and_write, decode_frames  # noqa: E402
from h3trt.media.output_files import write_json_atomic  # noqa: E402

WAIT_S = 1800  # side barrier while rank 0 runs the 1-GPU phase alone


def build_vaes(device: torch.device, precision: VAEPrecision, toy: bool) -> tuple[VideoVAE, AudioVAE]:
    """The parallel phases' VAEs: the video VAE placed as h3trt loads it at `precision` (diffusers' rule; fp8
    quantized), decoded eagerly."""
    video, audio = random_vaes(device, toy)
    video = place(video, device, precision.dtype)
    if precision.quantized:
        quantize_video_decoder(video, "dynamic")
    return (VideoVAE(video, [0.0] * 24, [1.0] * 24),
            AudioVAE(audio, [0.0] * 32, [1.0] * 32))


def _decode_only(video: VideoVAE, z: torch.Tensor, group, keep: list | None = None) -> float:
    """Seconds to decode every frame. With `keep`, the frames are also appended to it as host yuv420p, and the
    number of frames after the last tile is appended last (for --encoder-sweep): converted on the device and copied
    synchronously, ~10 ms a window, inside the timing."""
    sync(video.device)
    marks: dict[str, float] = {}
    after_last_tile = 0
    start = time.perf_counter()
    for frames in decode_frames(video, z, group, marks=marks):
        if keep is not None:
            keep.append(rgb_to_yuv420(frames).cpu().numpy())
            after_last_tile += frames.shape[0] if "last_tile" in marks else 0
    sync(video.device)
    seconds = time.perf_counter() - start
    if keep is not None:
        keep.append(after_last_tile)
    return seconds


# --encoder-sweep: x264 settings for the tail, run in the parent process (a host process, as the encoder thread is)
# on the 1-GPU decode's frames after the ranks are done. The frame-threaded rows keep zerolatency's "nothing held
# back" (no lookahead, no B-frames) but thread across frames instead of slices.
NO_DELAY_FRAME_THREADS = {"x264-params": "rc-lookahead=0:sync-lookahead=0:bframes=0:sliced-threads=0"}
SWEEP = (
    ("medium", {"tune": "zerolatency"}), ("faster", {"tune": "zerolatency"}), ("veryfast", {"tune": "zerolatency"}),
    ("superfast", {"tune": "zerolatency"}), ("medium", NO_DELAY_FRAME_THREADS), ("veryfast", NO_DELAY_FRAME_THREADS),
)
SWEEP_IDLE_S = 1.0  # the encoder waits this long for the last window (a real run: seconds), so in-flight work ends


def encoder_sweep(yuv: np.ndarray, tail_frames: int, out_dir: Path, crf: int = 18) -> list[dict]:
    """Per SWEEP row: seconds from handing x264 the last `tail_frames` frames to the MP4 closed (encode, flush,
    faststart), the file size and PSNR over all yuv420p planes against the input."""
    import av

    height, width = yuv.shape[1] * 2 // 3, yuv.shape[2]
    rows = []
    for preset, options in SWEEP:
        path = out_dir / "sweep.mp4"
        container = av.open(str(path), "w", format="mp4", container_options={"movflags": "+faststart"})
        stream = container.add_stream("libx264", rate=24, options={"crf": str(crf), "preset": preset, **options})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"

        def encode(i: int) -> None:
            frame = av.VideoFrame.from_ndarray(yuv[i], format="yuv420p")
            frame.pts = i
            container.mux(stream.encode(frame))

        head = len(yuv) - tail_frames
        start = time.perf_counter()
        for i in range(head):
            encode(i)
        head_s = time.perf_counter() - start
        time.sleep(SWEEP_IDLE_S)
        start = time.perf_counter()
        for i in range(head, len(yuv)):
            encode(i)
        container.mux(stream.encode(None))
        container.close()
        tail_s = time.perf_counter() - start
        with av.open(str(path)) as decoded:
            out = np.stack([f.to_ndarray() for f in decoded.decode(video=0)])
        mse = float(np.mean((out.astype(np.float32) - yuv.astype(np.float32)) ** 2))
        rows.append({"preset": preset, "options": options, "tail_frames": tail_frames, "tail_s": tail_s,
                     "head_ms_per_frame": 1e3 * head_s / max(head, 1), "mp4_mb": path.stat().st_size / 1e6,
                     "psnr_db": 10 * math.log10(255.0 ** 2 / max(mse, 1e-12))})
        path.unlink()
    return rows


def _phase(video, audio, z, rows, group, out_dir: Path, repeats: int, tag: str, output: OutputConfig,
           keep: list | None = None) -> dict:
    """Warm-up, then `repeats` decode-only and decode+write runs over `group` (None: this rank alone); `keep`: see
    _decode_only (the last repeat fills it)."""
    decode_and_write(video, audio, z[:, :, :7], rows[:20], out_dir / f"warm_{tag}.mp4", group=group,
                     output_config=output)
    decode, total, tail, mux, steps, sizes = [], [], [], [], [], []
    for i in range(repeats):
        decode.append(_decode_only(video, z, group, keep if i == repeats - 1 else None))
        start = time.perf_counter()
        path = out_dir / f"{tag}_{i}.mp4"  # a new name each run: replacing a big file would time its unlink
        record = decode_and_write(video, audio, z, rows, path, group=group, output_config=output)
        total.append(time.perf_counter() - start)
        if record.wrote:
            tail.append(record.timings_s["decode_tail_s"])
            mux.append(record.timings_s["mux"])
            steps.append(record.tail_s)
            sizes.append(path.stat().st_size / 1e6)
    med = statistics.median
    return {"decode_s": med(decode), "total_s": med(total), "tail_s": med(tail) if tail else None,
            "encoder_busy_s": med(mux) if mux else None, "mp4_mb": med(sizes) if sizes else None,
            # median of each step of the host tail (TAIL_STEPS, consecutive; they sum to about tail_s)
            "tail_steps_s": {k: med(s[k] for s in steps) for k, _ in TAIL_STEPS} if steps else None,
            "runs": {"decode_s": decode, "total_s": total, "tail_s": tail, "tail_steps_s": steps}}


def _rank(rank: int, world: int, store: str, opts: dict, out_dir: Path) -> None:
    device_type = "cpu" if opts["cpu_check"] else "cuda"
    init_rank(rank, world, store, device_type)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    shape = TOY if opts["cpu_check"] else FULL
    video, audio = build_vaes(device, VAEPrecision(opts["dtype"]), opts["cpu_check"])
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, 24, shape["latent_frames"], shape["height"] // 16, shape["width"] // 16, generator=g)
    rows = torch.randn(2 * shape["audio_latents"], 32, generator=g)
    waiter = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=WAIT_S))
    results = {}
    output = OutputConfig(preset=opts["preset"])
    if rank == 0:  # 1 GPU: this rank alone, the others wait
        keep = [] if opts["encoder_sweep"] else None
        results["1"] = _phase(video, audio, z, rows, None, out_dir, opts["repeats"], "w1", output, keep)
        if keep:
            np.save(out_dir / "frames.npy", np.concatenate(keep[:-1]))
            (out_dir / "tail_frames.txt").write_text(str(keep[-1]))
        if device.type == "cuda":
            results["1"]["peak_gib"] = [torch.cuda.max_memory_allocated(device) / 2**30]
    dist.barrier(group=waiter)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    results[str(world)] = _phase(video, audio, z, rows, dist.group.WORLD, out_dir, opts["repeats"], f"w{world}",
                                  output)
    peaks = [None] * world
    dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0)
    if rank == 0:
        results[str(world)]["peak_gib"] = peaks
        plan = video.plan(shape["latent_frames"], shape["height"] // 16, shape["width"] // 16)
        record = {
            "bench": "vae_decode", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": opts["dtype"], "cpu_check": opts["cpu_check"],
            "shape": {**shape, "frames": plan.num_frames, "windows": len(plan.windows), "tiles_per_window":
                      len(plan.tiles), "decoder_layers": video.vae.config.decoder_num_layers,
                      "decoder_dim": video.vae.config.decoder_num_attention_heads
                      * video.vae.config.decoder_attention_head_dim},
            "repeats": opts["repeats"], "host_cpus": os.cpu_count(),
            "output": {"preset": output.preset, "low_latency": output.low_latency,
                       "convert_on_device": output.convert_on_device, "chunk_frames": output.chunk_frames},
            "results": results,
            "decode_speedup": results["1"]["decode_s"] / results[str(world)]["decode_s"],
            "total_speedup": results["1"]["total_s"] / results[str(world)]["total_s"],
        }
        (out_dir / "result.json").write_text(json.dumps(record, indent=1))


# ----------------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=1, help="1 (default): the precision axis on one GPU; N >= 2: "
                                                            "1 GPU against N GPUs, tile-parallel")
    parser.add_argument("--json", type=Path, help="write the result here")
    axis = parser.add_argument_group("the precision axis (--gpus 1)")
    axis.add_argument("--tiny", action="store_true", help="dry run: toy decoder at 160x96 on this CPU")
    axis.add_argument("--fp32-compiled", action="store_true", help="also compile the fp32 decoder (one window)")
    axis.add_argument("--fp8-fresh-check", action="store_true",
                      help="also run the fresh-process bundle check on the fp8 decoder (bf16's always runs; ~20 s)")
    axis.add_argument("--audio-compile", choices=("auto", "always", "never"), default="auto",
                      help=f"compile the audio decoder too: auto = when its eager decode is over "
                           f"{100 * AUDIO_COMPILE_FRACTION:.0f}%% of the video decode stage")
    par = parser.add_argument_group("tile-parallel phases (--gpus N >= 2)")
    par.add_argument("--repeats", type=int, default=3)
    par.add_argument("--vae-precision", choices=tuple(VAE_PRECISIONS), default="bf16",
                     help="the eager decoder's precision (h3trt's placement: diffusers' rule)")
    par.add_argument("--cpu-check", action="store_true", help="toy decoder at 160x96 on this CPU with gloo")
    par.add_argument("--encoder-sweep", action="store_true",
                     help="after the ranks: encode the 1-GPU decode's frames with each SWEEP setting on this host "
                          "(tail seconds, MB, PSNR)")
    par.add_argument("--preset", choices=X264_PRESETS, default=OutputConfig().preset,
                     help="x264 preset of the pipelined writer (default: OutputConfig's)")
    args = parser.parse_args()
    # The fresh-process check (h3trt.build.verify) runs in a child: it must import this checkout's h3trt.
    repo = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    if args.gpus == 1:
        if not args.tiny and not torch.cuda.is_available():
            parser.error("the precision axis needs a CUDA GPU; pass --tiny for the CPU dry run.")
        # No autograd anywhere in the axis: Diffusers' decode outside no_grad kept every tile's activations (OOM at
        # 123 GiB on the H200, twice).
        with torch.no_grad():
            record = precision_axis(args)
        print_axis(record)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(args.json, record)
        return
    if args.gpus < 2:
        parser.error(f"--gpus must be 1 (precision axis) or at least 2 (tile-parallel), got {args.gpus}.")
    if not args.cpu_check and torch.cuda.device_count() < args.gpus:
        parser.error(f"--gpus {args.gpus} needs {args.gpus} visible GPUs, found {torch.cuda.device_count()}; "
                     "pass --cpu-check for the toy run on the CPU.")
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast is off on the lent H200 machines (KINDS.md)
    opts = {"cpu_check": args.cpu_check, "dtype": "fp32" if args.cpu_check else args.vae_precision,
            "repeats": args.repeats, "preset": args.preset, "encoder_sweep": args.encoder_sweep}
    with tempfile.TemporaryDirectory(prefix="bench-vae-") as tmp:
        launch(_rank, args.gpus, (opts, Path(tmp)))
        record = json.loads((Path(tmp) / "result.json").read_text())
        if args.encoder_sweep:
            record["encoder_sweep"] = encoder_sweep(np.load(Path(tmp) / "frames.npy"),
                                                    int((Path(tmp) / "tail_frames.txt").read_text()), Path(tmp))
    w = str(args.gpus)
    s = record["shape"]
    print(f"video decoder {s['decoder_layers']} blocks x {s['decoder_dim']}, {s['width']}x{s['height']}, "
          f"{s['frames']} frames ({s['windows']} windows x {s['tiles_per_window']} tiles), {record['dtype']}, "
          f"{record['device']}, median of {record['repeats']}; x264 {record['output']['preset']}, "
          f"{record['host_cpus']} host CPUs")
    print(f"{'GPUs':>5} {'decode s':>9} {'decode+encode s':>16} {'host tail s':>12} {'encoder busy s':>15} "
          f"{'MP4 MB':>7} {'peak GiB/rank':>14}")
    for key in ("1", w):
        r = record["results"][key]
        peaks = "/".join(f"{p:.1f}" for p in r.get("peak_gib", []))
        print(f"{key:>5} {r['decode_s']:9.3f} {r['total_s']:16.3f} {r['tail_s']:12.3f} {r['encoder_busy_s']:15.3f} "
              f"{r['mp4_mb']:7.1f} {peaks:>14}")
    print("host tail steps, s: " + f"{'GPUs':>5} " + " ".join(f"{k:>15}" for k, _ in TAIL_STEPS))
    for key in ("1", w):
        steps = record["results"][key]["tail_steps_s"]
        print(" " * 20 + f"{key:>5} " + " ".join(f"{steps[k]:15.3f}" for k, _ in TAIL_STEPS))
    for row in record.get("encoder_sweep", []):
        threading = "frame threads" if "x264-params" in row["options"] else "zerolatency"
        print(f"sweep {row['preset']:>9} {threading:>13}: last {row['tail_frames']} frames + flush + close "
              f"{row['tail_s']:.3f} s, earlier frames {row['head_ms_per_frame']:.1f} ms each, {row['mp4_mb']:.2f} MB, "
              f"PSNR {row['psnr_db']:.2f} dB")
    print(f"decode speedup {record['decode_speedup']:.2f}x (bar 1.8x), decode+encode {record['total_speedup']:.2f}x; "
          f"host tail at {w} GPUs {record['results'][w]['tail_s']:.3f} s (bar 0.3 s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.json, record)


if __name__ == "__main__":
    main()
