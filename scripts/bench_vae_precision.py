"""bench_vae.py --gpus 1, the precision axis on one GPU (issue 16): the H3 video decoder at every precision, eager and
compiled as a bundle compiles it, against Diffusers' bf16 decoder loaded as its pipeline loads it (bench_vae.py's
docstring says what each row measures); and the random full-size VAEs and the bundle's compiled-decoder path that
every VAE bench builds on (bench_vae.py's tile-parallel phases, bench_vae_compile.py).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_common import rebuild_video_vae_rope, released_audio_vae, timed_call

from h3trt.models.audio_vae import AudioVAE
from h3trt.models.vae_precision import VAEPrecision, place
from h3trt.models.video_vae import VideoVAE
from h3trt.calibration.vae_fp8 import quantize_video_decoder
from h3trt.pipeline.parallel_decode import decode_and_write, decode_frames

FULL = dict(width=1344, height=768, latent_frames=37, audio_latents=207)  # 124 frames, 5 s
TOY = dict(width=160, height=96, latent_frames=12, audio_latents=30)  # 39 frames
BARS = {"bf16_s": 5.0, "bf16_goal_s": 4.0, "fp8_speedup": 1.3, "tail_s": 0.3}
AUDIO_COMPILE_FRACTION = 0.05  # compile the audio decoder when its eager decode is more than this of the video decode


def random_vaes(device: torch.device, toy: bool):
    """The diffusers video VAE (fp32, random weights: biases 0, norm scales and block scales 1, the rest N(0, 0.02))
    and audio VAE, both on `device`; toy: the tiny configs, tiled 64/16 (6 tiles a window at 160x96)."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    torch.manual_seed(0)
    if toy:
        video = AutoencoderKLMiniMaxH3(block_out_channels=(32,) * 6, decoder_num_layers=2,
                                       decoder_num_attention_heads=2, decoder_ffn_mult=2).to(device)
        audio = AutoencoderKLMiniMaxH3Audio(encoder_dim=8, latent_dim=64, decoder_dim=128)
    else:
        with torch.device("meta"):
            video = AutoencoderKLMiniMaxH3()  # the released architecture
        video = video.to_empty(device=device)
        audio = released_audio_vae()  # the released architecture
    with torch.no_grad():
        for name, p in video.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:  # norm scales, block scales
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    rebuild_video_vae_rope(video, device)
    if toy:
        video.enable_tiling(64, 64, 16, 16)
    return video, audio.to(device).eval()


def _from_checkpoint(checkpoint: dict, config, device, tiling) -> "torch.nn.Module":
    """A diffusers video VAE holding the fp32 `checkpoint` tensors (assigned, not copied), on `device`."""
    from diffusers import AutoencoderKLMiniMaxH3

    with torch.device("meta"):
        model = AutoencoderKLMiniMaxH3.from_config(config)
    model.load_state_dict(checkpoint, strict=True, assign=True)
    rebuild_video_vae_rope(model, device)
    model.enable_tiling(*tiling)
    return model.eval()


def diffusers_as_the_pipeline_loads(checkpoint: dict, config, device, tiling):
    """What `pipe.load_components(dtype=torch.bfloat16)` gives: from_pretrained(torch_dtype=bf16)'s own loading
    function (`load_model_dict_into_meta`, with the class's `_keep_in_fp32_modules`) over an empty-weights model, fed
    the same fp32 tensors from memory instead of 10 GB of safetensors from disk; then `.to(device)`, as `pipe.to`."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLMiniMaxH3
    from diffusers.models.model_loading_utils import load_model_dict_into_meta

    with init_empty_weights():
        model = AutoencoderKLMiniMaxH3.from_config(config)
    load_model_dict_into_meta(model, checkpoint, dtype=torch.bfloat16,
                              keep_in_fp32_modules=AutoencoderKLMiniMaxH3._keep_in_fp32_modules,
                              device_map={"": device})
    model = model.to(device).eval()
    model.enable_tiling(*tiling)
    return model


def _unit(video_BCFHW: torch.Tensor) -> torch.Tensor:
    """ImageNet-normalised VAE output -> [0, 1] float frames [F, 3, H, W] (the pipelines' arithmetic)."""
    return VideoVAE.to_unit_range(video_BCFHW)[0].permute(1, 0, 2, 3)


def _window_frames(video: VideoVAE, z1: torch.Tensor) -> torch.Tensor:
    """The 17 finished frames of window 0 (exactly one window's tiles decoded), float [17, 3, H, W] in [0, 1]
    (decode_stream yields them already in the unit range)."""
    with torch.no_grad():
        return next(iter(video.decode_stream(z1)))[0].permute(1, 0, 2, 3)


def _clip_s(video: VideoVAE, z: torch.Tensor) -> float:
    """Every frame of the clip to uint8 on the device, as `h3trt run` decodes (nothing encoded)."""
    return timed_call(video.device, lambda: [None for _ in decode_frames(video, z)])[1]


def _diffusers_clip(model, z: torch.Tensor) -> torch.Tensor:
    """MiniMaxH3VideoDecodeStep on the device: decode (latents_mean 0 / std 1 here), unit range, uint8."""
    with torch.no_grad():
        frames = _unit(model.decode(z, return_dict=False)[0])
    return (frames * 255.0).round().to(torch.uint8)


def _compile_decoders(video: VideoVAE, z: torch.Tensor, work: Path, options: dict,
                      fresh_check: dict | None = None) -> tuple[dict, float]:
    """The bundle's path for every tile shape of `z`: in / block / out segments compiled (inductor), saved, loaded.
    Returns ({key: (segments, entries)}, compile seconds). With `fresh_check` (a dict to fill), the saved segments are
    first loaded and checked in a fresh process under the no-compile guard, exactly as `h3trt build` checks a bundle
    before writing it, with the Inductor cache as it stood right after compiling (nothing run or loaded here yet)."""
    from h3trt.build.backends import compile_segment
    from h3trt.build.examples import video_decoder_specs
    from h3trt.engines.loaders import load_segment
    from h3trt.engines.video_decoder import parse_video_decoder_name

    shapes = video.tile_shapes(*z.shape[2:])
    start = time.perf_counter()
    specs, examples = video_decoder_specs(video, shapes)
    (work / "segments").mkdir(parents=True, exist_ok=True)
    entries = {name: {"name": name, **compile_segment("inductor", spec, examples[name], work / "segments", options),
                      "inputs": spec.inputs, "weights": spec.weights}
               for name, spec in specs.items()}
    compile_s = time.perf_counter() - start
    if fresh_check is not None:
        fresh_check.update(_fresh_process_check(video, work, entries, examples, specs))
    out: dict = {}
    for name, entry in entries.items():
        part, key = parse_video_decoder_name(name)
        segments, bound = out.setdefault(key, ({}, {}))
        segments[part], bound[part] = load_segment("inductor", entry, work, video.device), entry
    return out, compile_s


def _fresh_process_check(video: VideoVAE, work: Path, entries: dict, examples: dict, specs: dict) -> dict:
    """h3trt build's step 6 on these segments: `check_in_fresh_process` over a copy of this process's Inductor cache
    (the bundle's inductor_cache/). Whether a full-size decoder compiled here would ship as a loadable bundle."""
    import shutil

    from h3trt.build.check import BuildError, check_in_fresh_process
    from h3trt.build.config import BuildConfig

    start = time.perf_counter()
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    shutil.copytree(cache, work / "inductor_cache", dirs_exist_ok=True)
    config = BuildConfig(work, work / "unused", device=str(video.device.type), vae_precision=video.precision)
    try:
        check_in_fresh_process(work, config, entries, examples, specs)
        result = {"fresh_process_load": "ok"}
    except BuildError as e:
        result = {"fresh_process_load": "FAILED", "fresh_process_error": str(e)[-1500:]}
    return {**result, "fresh_process_check_s": time.perf_counter() - start}


def _serve(video: VideoVAE, compiled: dict, cuda_graph: bool) -> VideoVAE:
    from h3trt.engines.video_decoder import TileDecoder

    video.tile_decoders = {key: TileDecoder(segs, entries, video.vae, cuda_graph)
                           for key, (segs, entries) in compiled.items()}
    return video


def precision_axis(args) -> dict:
    """Every row decodes the same random latent with the same random fp32 weights: s per clip, and frames of window 0
    scored against the fp32 decoder and Diffusers' bf16 decoder (random weights: numeric distance only)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from h3trt.eval import psnr, ssim
    from h3trt.calibration.vae_fp8 import calibrate_video_decoder

    wall = time.perf_counter()
    device = torch.device("cpu" if args.tiny else "cuda")
    shape = TOY if args.tiny else FULL
    video_fp32, audio_model = random_vaes(device, args.tiny)
    config = video_fp32.config
    tiling = (video_fp32.tile_sample_min_height, video_fp32.tile_sample_min_width,
              video_fp32.tile_sample_min_overlap_height, video_fp32.tile_sample_min_overlap_width)
    checkpoint = {k: v.detach() for k, v in video_fp32.state_dict().items()}
    del video_fp32
    g = torch.Generator().manual_seed(0)
    lh, lw = shape["height"] // 16, shape["width"] // 16
    z = torch.randn(1, 24, shape["latent_frames"], lh, lw, generator=g).to(device)
    rows_audio = torch.randn(2 * shape["audio_latents"], 32, generator=g)
    z_cal = torch.randn(1, 24, 7, lh, lw, generator=g).to(device)  # the static-FP8 calibration latent: not z
    z1 = z[:, :, :7]  # window 0
    windows = len(VideoVAE(_from_checkpoint(checkpoint, config, device, tiling), [0.0] * 24, [1.0] * 24)
                  .plan(*z.shape[2:]).windows)
    options = {"compile_threads": min(16, os.cpu_count() or 1)}  # kernels as a bundle's; compiled in parallel

    def h3trt_vae(name: str, activations: str = "dynamic", amax=None) -> VideoVAE:
        precision = VAEPrecision(name)
        model = place(_from_checkpoint(checkpoint, config, device, tiling), device, precision.dtype)
        if precision.quantized:
            quantize_video_decoder(model, activations, amax)
        return VideoVAE(model, [0.0] * 24, [1.0] * 24)

    rows, refs = [], {}

    def add(name, precision, mode, clip_s, per_window, frames, **extra):
        row = {"name": name, "precision": precision, "mode": mode, "s_per_clip": clip_s,
               "clip_from": f"1 window x {windows}" if per_window else f"{windows} windows", **extra}
        for ref, key in (("fp32", "vs_fp32"), ("diffusers_bf16", "vs_bf16")):
            if ref in refs:
                row[key] = {"psnr_db": psnr(frames, refs[ref]), "ssim": ssim(frames, refs[ref])}
        rows.append(row)
        print(f"  {name}: {clip_s:.3f} s per clip ({row['clip_from']})", flush=True)
        return row

    def failed(name, precision, mode, error):
        rows.append({"name": name, "precision": precision, "mode": mode, "s_per_clip": None, "clip_from": "",
                     "error": repr(error)[:500]})
        print(f"  {name} ({mode}) FAILED: {error!r}"[:300], flush=True)

    def free():
        if device.type == "cuda":
            torch.cuda.empty_cache()

    with tempfile.TemporaryDirectory(prefix="bench-vae-axis-") as tmp, temporary_cache_dir(f"{tmp}/inductor"):
        work = Path(tmp)
        # 1. Diffusers bf16, loaded as the pipeline loads it: the speed reference and the bf16 quality reference.
        ref = diffusers_as_the_pipeline_loads(checkpoint, config, device, tiling)
        refs["diffusers_bf16"], _ = timed_call(device, lambda: _unit(ref.decode(z1, return_dict=False)[0][:, :, :17]))
        _, diffusers_s = timed_call(device, lambda: _diffusers_clip(ref, z))
        bf16 = h3trt_vae("bf16")
        placement = {k: v.dtype for k, v in bf16.vae.state_dict().items()} == {k: v.dtype for k, v in
                                                                               ref.state_dict().items()}
        del ref
        free()
        add("diffusers bf16 (pipeline load)", "bf16", "eager", diffusers_s, False, refs["diffusers_bf16"])

        # 2. fp32, the quality reference (one window: a whole clip is ~48 s on an H200).
        fp32 = h3trt_vae("fp32")
        refs["fp32"], window_s = timed_call(device, lambda: _window_frames(fp32, z1))
        add("h3trt fp32", "fp32", "eager", window_s * windows, True, refs["fp32"])
        if args.fp32_compiled:
            compiled, compile_s = _compile_decoders(fp32, z, work / "fp32", options)
            _serve(fp32, compiled, cuda_graph=False)
            _window_frames(fp32, z1)
            frames, window_s = timed_call(device, lambda: _window_frames(fp32, z1))
            add("h3trt fp32", "fp32", "compiled", window_s * windows, True, frames, compile_s=compile_s)
        del fp32
        free()

        # 3. bf16 eager: the reference's numerics through h3trt's decode plan (bitwise Diffusers on one device).
        frames = _window_frames(bf16, z1)
        add("h3trt bf16", "bf16", "eager", _clip_s(bf16, z), False, frames,
            bitwise_diffusers=bool(torch.equal(frames, refs["diffusers_bf16"])), placement_matches_diffusers=placement)

        # 4-7. Compiled, launched and replayed as one CUDA graph per tile (bitwise equal); the faster is "chosen". A
        # row that raises is recorded with its error and the run goes on: one GPU run has to answer every question.
        def compiled_rows(name: str, video: VideoVAE, graphs=(False, True),
                          fresh: bool = False) -> tuple[dict | None, dict | None]:
            check = {} if fresh else None
            try:
                compiled, compile_s = _compile_decoders(video, z, work / name.replace(" ", "_"), options, check)
            except Exception as e:  # noqa: BLE001 - recorded in the result, printed
                failed(name, video.precision, "compiled", e)
                return None, None
            best, frames_of = None, {}
            for graph in graphs:
                mode = "compiled + CUDA graph" if graph else "compiled"
                try:
                    _serve(video, compiled, graph)
                    frames_of[graph] = _window_frames(video, z1)  # warm-up (and capture)
                    row = add(name, video.precision, mode, _clip_s(video, z), False, frames_of[graph],
                              compile_s=compile_s, cuda_graph=graph, **(check or {}))
                except Exception as e:  # noqa: BLE001
                    failed(name, video.precision, mode, e)
                    continue
                best = row if best is None or row["s_per_clip"] < best["s_per_clip"] else best
            if len(frames_of) == 2:
                best["graph_bitwise_launched"] = bool(torch.equal(frames_of[False], frames_of[True]))
            if best is not None:
                best["chosen"] = True
            return best, compiled

        bf16_best, bf16_compiled = compiled_rows("h3trt bf16", bf16, fresh=True)
        graph = (bf16_best["cuda_graph"],) if bf16_best else (False, True)
        try:
            fp8_eager = h3trt_vae("fp8")
            frames, window_s = timed_call(device, lambda: _window_frames(fp8_eager, z1))
            add("h3trt fp8 dynamic", "fp8", "eager", window_s * windows, True, frames)
            del fp8_eager
        except Exception as e:  # noqa: BLE001
            failed("h3trt fp8 dynamic", "fp8", "eager", e)
        fp8_best, _ = compiled_rows("h3trt fp8 dynamic", h3trt_vae("fp8"), fresh=args.fp8_fresh_check)
        free()
        bf16_eager = h3trt_vae("bf16")
        amax = calibrate_video_decoder(bf16_eager, z_cal)
        del bf16_eager
        static_best, _ = compiled_rows("h3trt fp8 static", h3trt_vae("fp8", "static", amax), graph)
        free()

        # 8. Host tail: the chosen bf16 decoder (eager if compiling failed) through decode_and_write (H.264/AAC MP4).
        audio = AudioVAE(audio_model, [0.0] * 32, [1.0] * 32)
        bf16.tile_decoders = None
        if bf16_best is not None:
            _serve(bf16, bf16_compiled, bf16_best["cuda_graph"])
        decode_and_write(bf16, audio, z1, rows_audio[:40], work / "warm.mp4")
        record = decode_and_write(bf16, audio, z, rows_audio, work / "clip.mp4")
        tail = {"decoder": "bf16 " + (("compiled + CUDA graph" if bf16_best["cuda_graph"] else "compiled")
                                      if bf16_best else "eager"),
                "decode_tail_s": record.timings_s["decode_tail_s"], "steps_s": record.tail_s,
                "video_decode_s": record.timings_s["video_decode"],
                "audio_decode_beside_video_s": record.timings_s["audio_decode"],
                "mp4_mb": (work / "clip.mp4").stat().st_size / 1e6}

        # 9. Audio decoder alone (full size, fp32: the reference pins all of it to fp32).
        audio.decode_rows(rows_audio)
        runs = [timed_call(device, lambda: audio.decode_rows(rows_audio))[1] for _ in range(3)]
        audio_s = statistics.median(runs)
        fraction = audio_s / record.timings_s["video_decode"]
        audio_record = {"eager_s": audio_s, "runs_s": runs, "fraction_of_video_decode": fraction,
                        "threshold": AUDIO_COMPILE_FRACTION, "precision": "fp32 (every tensor pinned by diffusers)"}
        if args.audio_compile == "always" or (args.audio_compile == "auto" and fraction > AUDIO_COMPILE_FRACTION):
            try:
                audio_record.update(_compiled_audio(audio, rows_audio, work / "audio", options))
            except Exception as e:  # noqa: BLE001
                audio_record["compile_error"] = repr(e)[:500]

    bf16_s = bf16_best["s_per_clip"] if bf16_best else None
    fp8_s = min((r["s_per_clip"] for r in (fp8_best, static_best) if r), default=None)
    return {
        "bench": "vae_precision_axis", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "tiny": args.tiny,
        "shape": {**shape, "frames": VideoVAE(_from_checkpoint(checkpoint, config, device, tiling), [0.0] * 24,
                                             [1.0] * 24).plan(*z.shape[2:]).num_frames, "windows": windows,
                  "decoder_layers": config.decoder_num_layers,
                  "decoder_dim": config.decoder_num_attention_heads * config.decoder_attention_head_dim},
        "weights": "random (biases 0, norm and block scales 1, else N(0, 0.02)): quality is numeric distance only",
        "quality_frames": "the 17 frames of window 0 (one window's tiles), float [0, 1]",
        "rows": [{**r, "speedup_vs_diffusers": diffusers_s / r["s_per_clip"] if r["s_per_clip"] else None}
                 for r in rows],
        "host_tail": tail, "audio": audio_record, "bars": BARS,
        "verdict": {"bf16_s": bf16_s, "bf16_bar_met": bf16_s is not None and bf16_s <= BARS["bf16_s"],
                    "bf16_goal_met": bf16_s is not None and bf16_s <= BARS["bf16_goal_s"],
                    "fp8_speedup_vs_bf16": bf16_s / fp8_s if bf16_s and fp8_s else None, "tail_s": tail["decode_tail_s"],
                    "cuda_graph_chosen": bf16_best["cuda_graph"] if bf16_best else None,
                    "audio_compile_needed": fraction > AUDIO_COMPILE_FRACTION},
        "wall_s": time.perf_counter() - wall,
    }


def _compiled_audio(audio: AudioVAE, rows_audio: torch.Tensor, work: Path, options: dict) -> dict:
    """The audio decoder compiled for this clip length (the bundle's path), timed like the eager one."""
    from h3trt.build.backends import compile_segment
    from h3trt.engines.loaders import load_segment
    from h3trt.build.segments import audio_decoder_segment
    from h3trt.models.packing import AUDIO_CHANNELS, rows_to_audio

    latents = rows_to_audio(rows_audio.float(), AUDIO_CHANNELS).to(audio.device)  # [2, C, A]: mean 0 / std 1 here
    spec = audio_decoder_segment(audio.vae, latents.shape[-1])
    tensors = {**dict(audio.vae.named_parameters()), **dict(audio.vae.named_buffers())}
    weights = [tensors[n].detach() for n in spec.weights]
    start = time.perf_counter()
    (work / "segments").mkdir(parents=True, exist_ok=True)
    entry = {"name": spec.name, **compile_segment("inductor", spec, [latents] + weights, work / "segments", options)}
    segment = load_segment("inductor", entry, work, audio.device)
    compile_s = time.perf_counter() - start
    with torch.no_grad():
        want = audio.vae.decode(latents, return_dict=False)[0]
        got = segment(latents, *weights)[0]
        runs = [timed_call(audio.device, lambda: segment(latents, *weights)[0].cpu())[1] for _ in range(3)]
    return {"compiled_s": statistics.median(runs), "compiled_runs_s": runs, "compile_s": compile_s,
            "compiled_rel_err": ((got - want).norm() / want.norm()).item()}


def print_axis(record: dict) -> None:
    s = record["shape"]
    print(f"video decoder {s['decoder_layers']} blocks x {s['decoder_dim']}, {s['width']}x{s['height']}, "
          f"{s['frames']} frames ({s['windows']} windows), {record['device']}, torch {record['torch']}; "
          f"{record['weights']}; quality on {record['quality_frames']}")
    print(f"{'decoder':<31} {'mode':<22} {'s / clip':>8} {'from':>13} {'vs Diffusers':>12} {'PSNR/SSIM vs fp32':>18} "
          f"{'PSNR/SSIM vs bf16':>18} {'compile s':>9}")
    for r in record["rows"]:
        if r["s_per_clip"] is None:
            print(f"{r['name']:<31} {r['mode']:<22} FAILED: {r['error']}"[:240])
            continue
        q = {k: f"{r[k]['psnr_db']:.1f} / {r[k]['ssim']:.4f}" if k in r else "" for k in ("vs_fp32", "vs_bf16")}
        compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else ""
        mark = " *" if r.get("chosen") else ""
        print(f"{r['name']:<31} {r['mode'] + mark:<22} {r['s_per_clip']:8.3f} {r['clip_from']:>13} "
              f"{r['speedup_vs_diffusers']:11.2f}x {q['vs_fp32']:>18} {q['vs_bf16']:>18} {compile_s:>9}")
    for r in record["rows"]:
        for key in ("bitwise_diffusers", "placement_matches_diffusers", "graph_bitwise_launched",
                    "fresh_process_load", "fresh_process_error"):
            if key in r:
                print(f"  {r['name']} ({r['mode']}): {key} = {r[key]}")
    t, a, v, b = record["host_tail"], record["audio"], record["verdict"], record["bars"]
    print(f"decode_and_write with {t['decoder']}: video decode {t['video_decode_s']:.3f} s, audio beside it "
          f"{t['audio_decode_beside_video_s']:.3f} s; host tail {t['decode_tail_s']:.3f} s (bar {b['tail_s']} s); "
          + ", ".join(f"{k} {x:.3f}" for k, x in t["steps_s"].items()))
    compiled = (f"; compiled {a['compiled_s']:.3f} s (compile {a['compile_s']:.1f} s, rel err "
                f"{a['compiled_rel_err']:.1e})" if "compiled_s" in a else "")
    compiled += f"; compile FAILED: {a['compile_error']}" if "compile_error" in a else ""
    print(f"audio decode alone (fp32, eager): {a['eager_s']:.3f} s = {100 * a['fraction_of_video_decode']:.1f}% of "
          f"the video decode (compile above {100 * a['threshold']:.0f}%){compiled}")
    bf16 = f"{v['bf16_s']:.3f} s" if v["bf16_s"] else "FAILED"
    fp8 = f"{v['fp8_speedup_vs_bf16']:.2f}x" if v["fp8_speedup_vs_bf16"] else "n/a"
    print(f"compiled bf16 decode {bf16} (bar {b['bf16_s']} s: {'met' if v['bf16_bar_met'] else 'NOT met'}; goal "
          f"{b['bf16_goal_s']} s: {'met' if v['bf16_goal_met'] else 'not met'}); fp8 {fp8} bf16 (bar "
          f"{b['fp8_speedup']}x); CUDA graph chosen: {v['cuda_graph_chosen']}; wall {record['wall_s']:.0f} s")
