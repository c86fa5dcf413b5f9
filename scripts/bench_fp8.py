"""FP8 on one H200: ms per block at the 37,838-token shape, in one run, against the Diffusers eager block; and the
full-size DiT weight bytes per precision.

    python scripts/bench_fp8.py --json $OUT/fp8_h200.json            # one H200, full width
    python scripts/bench_fp8.py --cpu-check --json /tmp/fp8_cpu.json  # toy width on the CPU: proves the script runs
    python scripts/bench_fp8.py --block-sensitivity --json /tmp/fp8_first_last.json   # tiny model, CPU, eager

`--block-sensitivity`: should the first/last blocks stay bf16? The tiny model is calibrated on real trajectories
(two prompts, 4-point schedule), then the same request (6 steps) runs with every block FP8, with only the first or
only the last in bf16, and all bf16; reported: final latent relative error and decoded-video PSNR against bf16.

Rows (all bf16 activations, random weights std 0.02, the Diffusers block's weights loaded into each), one per
attention kernel K of --attention-kernels (default: cudnn fa3 on a GPU; sdpa / emulated with --cpu-check), a
kernel the GPU cannot run skipped with the reason recorded:
  diffusers_eager      Diffusers MiniMaxH3TransformerBlock, eager (default SDPA: cuDNN on the H200)
  h3trt_bf16_K         the h3trt block segment compiled exactly as `h3trt build --attention K` compiles it
  h3trt_fp8_K          the same segment with W8A8 e4m3 linears (torch._scaled_mm, static per-tensor scales), bf16
                       attention through kernel K
  h3trt_fp8_attn_K     plus --fp8-attention: q/k/v quantized with calibrated scales (v centered) into FP8 attention
                       kernel K (h3trt::fp8_sdpa)
  ..._fast             the two fp8 rows again with --fp8-accum fast (FP8 GEMMs keep the tensor cores' accumulator;
                       the unsuffixed rows accumulate exactly, cuBLAS's default)
  h3trt_nvfp4_wo       NVFP4 weight-only (dequantize in the compiled block, bf16 GEMM): memory, not speed (--nvfp4)
Relative errors are of the block's update (output - input) against the bf16 eager block's, at full width.
Scales come from ModelOpt max calibration on the block's own input (one block, one input: a benchmark, not a recipe).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_common import ROOT, write_json  # noqa: E402  (first: it puts this checkout on sys.path)
sys.path.insert(0, str(ROOT / "scripts"))


def _cpu_bench(fn, n=3, warm=1) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[n // 2]


def quantized_copy(block, cfg, recipe, x, mod, idx, rope):
    """A copy of `block` calibrated through ModelOpt on one input (h3trt/calibration/calibrate.py; one block, one
    input: a benchmark, not a recipe), with h3trt's quantized modules filled from its quantizers."""
    from h3trt.calibration.calibrate import calibrate
    from h3trt.calibration.modules import load_quantized_block

    calibrated = copy.deepcopy(block)
    forward = (lambda attn: calibrated(x, mod, idx, rope, attn)) if recipe.needs_calibration_data else None
    tensors = calibrate([calibrated], recipe, forward, log=lambda m: None).export_block(0)
    del calibrated
    return load_quantized_block(copy.deepcopy(block), cfg, recipe, tensors)


def compiled(spec, example, dev):
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from h3trt.build.backends import compile_segment
    from h3trt.engines.loaders import load_segment

    work = Path(tempfile.mkdtemp(prefix=f"bench-{spec.name}-"))
    (work / "segments").mkdir()
    t0 = time.perf_counter()
    with temporary_cache_dir(str(work / "cache")):
        entry = compile_segment("inductor", spec, example, work / "segments")
        seg = load_segment("inductor", {"name": spec.name, **entry}, work, torch.device(dev))
    return seg, time.perf_counter() - t0


def run(out: Path, cpu_check: bool, kernels: list[str] | None = None, nvfp4: bool = True,
        accums: tuple[str, ...] = ("exact", "fast")) -> dict:
    from bench_common import rel_err
    from bench_dit import TEXT, AUDIO, LATENT_T, bench, block_pair
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed

    from h3trt.build.segments import block_segment
    from h3trt.models.config import H3Config
    from h3trt.models.packing import pack_t2va, text_tags_for
    from h3trt.calibration.build import dit_weight_bytes
    from h3trt.models.attention import kernel_problem
    from h3trt.calibration.recipe import QuantRecipe

    torch.manual_seed(0)
    dev = "cpu" if cpu_check else "cuda"
    timer = _cpu_bench if cpu_check else bench
    if cpu_check:  # toy width, short sequence: the same code path, seconds on two cores
        cfg = H3Config(hidden_size=256, num_heads=4, head_dim=64, ffn_dim=512, time_embed_dim=64,
                       time_embed_hidden_dim=256, rope_freq_dim=8)
        lay = pack_t2va(text_tags_for(16), 3, 8, 12, 13)
    else:
        cfg = H3Config()
        lay = pack_t2va(text_tags_for(TEXT), LATENT_T, 48, 84, AUDIO)
    H, N = cfg.hidden_size, lay.seq_len
    env = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "cuda": torch.version.cuda, "tokens": N, "hidden": H, "heads": cfg.num_heads, "ffn": cfg.ffn_dim,
           "activations": "bf16"}
    result = {"env": env, "ms_per_block": {}, "rel_err_vs_bf16_eager": {}, "compile_s": {}, "notes": []}
    ms = result["ms_per_block"]
    ref, ours, x, temb, idx, pos, mod, (cos, sin) = block_pair(cfg, lay, dev)
    with torch.no_grad():
        rot = None if cpu_check else MiniMaxH3RotaryPosEmbed().to(dev)(pos)
        if rot is not None:
            ms["diffusers_eager"] = timer(lambda: ref(x, temb, idx, rot))
            print(f"diffusers block eager (bf16)     {ms['diffusers_eager']:8.2f} ms", flush=True)
        want = ours(x, mod, idx, (cos, sin))

        # (row, recipe, bf16 attention kernel, the precision the row's attention runs in)
        rows = []
        result["skipped"] = {}
        for kernel in kernels or (["sdpa"] if cpu_check else ["cudnn", "fa3"]):
            fp8_kernel = "emulated" if kernel == "sdpa" else kernel
            variants = [(f"h3trt_bf16_{kernel}", None, "bf16")]
            for accum in accums:
                tag = "" if accum == "exact" else f"_{accum}"  # unsuffixed: exact, as rows were named before
                variants += [
                    (f"h3trt_fp8_{kernel}{tag}", QuantRecipe("fp8", calib_steps=2, fp8_accum=accum), "bf16"),
                    (f"h3trt_fp8_attn_{fp8_kernel}{tag}", QuantRecipe("fp8", calib_steps=2, fp8_attention=True,
                                                                      attention_kernel=fp8_kernel, fp8_accum=accum),
                     "fp8")]
            for name, recipe, precision in variants:
                problem = kernel_problem(fp8_kernel if precision == "fp8" else kernel, precision, torch.device(dev))
                if problem:
                    result["skipped"][name] = problem
                    print(f"{name:32s} skipped: {problem}", flush=True)
                else:
                    rows.append((name, recipe, kernel))
        if nvfp4:
            rows.append(("h3trt_nvfp4_wo", QuantRecipe("nvfp4"), "sdpa" if cpu_check else "cudnn"))
        for name, recipe, kernel in rows:
            block = ours if recipe is None else quantized_copy(ours, cfg, recipe, x, mod, idx, (cos, sin))
            spec = block_segment(cfg, torch.bfloat16, recipe, attention=kernel)
            tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}
            example = [x, mod, idx, cos, sin, *[tensors[n].detach() for n in spec.weights]]
            seg, result["compile_s"][name] = compiled(spec, example, dev)
            (y,) = seg(*example)
            # Of the block's update (output - input): the residual alone would hide the quantization error.
            result["rel_err_vs_bf16_eager"][name] = rel_err(y.float() - x.float(), want.float() - x.float())
            ms[name] = timer(lambda: seg(*example))
            base = f"  {ms['diffusers_eager'] / ms[name]:.3f}x vs Diffusers eager" if "diffusers_eager" in ms else ""
            print(f"{name:32s} {ms[name]:8.2f} ms  update rel err vs bf16 eager {result['rel_err_vs_bf16_eager'][name]:.2e}"
                  f"{base}", flush=True)
            del seg, example, block
            if dev == "cuda":
                torch.cuda.empty_cache()
            write_json(out, result)
    if "diffusers_eager" in ms:
        result["speedup_vs_diffusers_eager"] = {k: ms["diffusers_eager"] / v for k, v in ms.items()}
    if dev == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    full = H3Config()
    result["full_size_dit_weight_bytes"] = {
        "bf16": dit_weight_bytes(full, None, 99), "fp8": dit_weight_bytes(full, QuantRecipe("fp8", calib_steps=2), 99),
        "nvfp4": dit_weight_bytes(full, QuantRecipe("nvfp4"), 99)}
    for prec, b in result["full_size_dit_weight_bytes"].items():
        print(f"full-size DiT weights, {prec:5s} (AdaLN baked, 99 timesteps): {b['total'] / 1e9:6.2f} GB "
              f"({b['total'] / 2**30:6.2f} GiB), blocks {b['blocks'] / 1e9:.2f} GB", flush=True)
    result["notes"].append("Row suffixes name the attention kernel (h3trt/models/attention.py); h3trt_nvfp4_wo runs "
                           "bf16 attention through cudnn (sdpa on the CPU).")
    write_json(out, result)
    return result


def block_sensitivity(out: Path) -> dict:
    from h3trt.eval import StepRecorder, compare, trace
    from h3trt.models.checkpoint.reader import load_dit
    from h3trt.models.dit import EagerDiT
    from h3trt.models.tiny import ensure_tiny_checkpoint
    from h3trt.calibration.calibrate import calibrate
    from h3trt.calibration.trajectories import trajectory_forward
    from h3trt.models.sampler import Schedule
    from h3trt.calibration.modules import load_quantized_block
    from h3trt.calibration.recipe import QuantRecipe
    from h3trt.pipeline.loading import eager_components
    from h3trt.pipeline.h3_pipeline import H3Pipeline
    from h3trt.pipeline.prepare import prepare
    from h3trt.request.request import Request

    base, source = load_dit(ensure_tiny_checkpoint(), "t2va", torch.bfloat16)
    root = source.component_root
    n = base.cfg.num_layers
    recipe = QuantRecipe("fp8", calib_steps=4)
    calibrated = copy.deepcopy(base)
    forward = trajectory_forward(calibrated, root, ["a red fox runs through fresh snow", "waves break on a rocky shore"],
                                 Schedule(4, 12.0, 3.0), 160, 96, 5.0, log=lambda m: None)
    calibration = calibrate(calibrated.blocks, recipe, forward, log=lambda m: None)
    tensors = [calibration.export_block(i) for i in range(n)]
    components = eager_components(root, torch.device("cpu"), torch.bfloat16)
    request = Request.of("a lighthouse at night, rain on the glass", seed=5, steps=6, width=160, height=96)

    def run(quantized: list[int]):
        model = copy.deepcopy(base)
        for i in quantized:
            load_quantized_block(model.blocks[i], model.cfg, recipe, tensors[i])
        pipeline = H3Pipeline(StepRecorder(EagerDiT(model)), *components, (12.0, 3.0), torch.device("cpu"))
        return trace(pipeline, prepare(request))

    reference = run([])
    variants = {"all_fp8": list(range(n)), "first_bf16": list(range(1, n)), "last_bf16": list(range(n - 1))}
    result = {"model": f"tiny ({n} blocks, random weights)", "request": request.inputs.prompt, "steps": request.schedule.steps,
              "against": "all blocks bf16", "variants": {}}
    for name, quantized in variants.items():
        c = compare(run(quantized), reference)
        result["variants"][name] = {"quantized_blocks": quantized, "final_latent_rel_err": c["final_latent_rel_err"],
                                    "psnr_db": c["psnr_db"], "ssim": c["ssim"], "audio_lsd_db": c["audio_lsd_db"]}
        f = c["final_latent_rel_err"]
        print(f"{name:12s} blocks {quantized}: final latent rel err video {f['video']:.2e} audio {f['audio']:.2e}, "
              f"PSNR {c['psnr_db']:.2f} dB, audio LSD {c['audio_lsd_db']:.3f} dB", flush=True)
    write_json(out, result)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True, help="where to write the results")
    p.add_argument("--cpu-check", action="store_true", help="toy width on the CPU (no Diffusers timing row)")
    p.add_argument("--attention-kernels", nargs="+", choices=("cudnn", "fa3", "sdpa"),
                   help="a row per kernel (default: cudnn fa3 on a GPU, sdpa with --cpu-check)")
    p.add_argument("--no-nvfp4", action="store_true", help="leave out the NVFP4 weight-only row")
    p.add_argument("--fp8-accums", nargs="+", choices=("exact", "fast"), default=("exact", "fast"),
                   help="FP8 GEMM accumulation of the fp8 rows (h3trt build --fp8-accum); fast rows end in _fast")
    p.add_argument("--block-sensitivity", action="store_true",
                   help="tiny model on the CPU: first/last block in bf16 vs all FP8, against all bf16")
    args = p.parse_args()
    if args.block_sensitivity:
        block_sensitivity(args.json)
    else:
        run(args.json, args.cpu_check, args.attention_kernels, not args.no_nvfp4, tuple(args.fp8_accums))
    return 0


if __name__ == "__main__":
    sys.exit(main())
