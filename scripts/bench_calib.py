"""ModelOpt calibration on one H200, per --calib-algo, on a full-width block stack (random weights: numbers measure
how far each algorithm moves the computation, not picture quality).

    python scripts/bench_calib.py --json $OUT/calib_algos_h200.json          # one H200, full width (~2-3 min)
    python scripts/bench_calib.py --cpu-check --json /tmp/calib_cpu.json      # toy width on the CPU: the same code

What one run does, and prints:
  1. ModelOpt's import and version; which of its CUDA extensions the calibrations tried to load (expected: none).
  2. Calibrates a stack of --blocks full-width blocks through h3trt.calibration.calibrate (mtq.quantize), per algorithm:
     fp8 max / percentile / smoothquant, nvfp4 max / awq_lite (weight-only, as the Inductor bundle). The forward
     loop is the stack over --calib-inputs inputs at the 37,838-row T2VA shape, each at another timestep pair's
     modulation; the inputs have log-normal per-channel scales (sigma 1), so the channel-wise algorithms have
     something to act on. Reported: calibration seconds, ModelOpt passes.
  3. Error on a held-out input (another seed and timesteps) against the bf16 eager stack: relative error of the
     stack's update (output - input) and of block 0's update; and h3trt's stack against ModelOpt's fake-quantized
     stack (FP8: ModelOpt's eager e4m3 path, its CUDA extension not built; NVFP4: ModelOpt's Triton kernel). The
     floor under these bf16 numbers: the bf16 eager stack's update against the same stack in fp32.
  4. NVFP4: ModelOpt's Triton fake-quant of every full-width weight against h3trt's dequantization of the weights
     ModelOpt's NVFP4 export packed (elements that differ).
  5. ms per compiled block at the 37,838-row shape (median of 5 after 2 warm-ups, CUDA events), built as `h3trt build`
     builds it: bf16; FP8 with today's scales (max |x| by forward hooks, what h3trt computed before ModelOpt took
     the calibration over), ModelOpt's max and percentile scales: one compiled segment (weights and scales are its
     inputs), so the same kernels, each timed with its own tensors; today's and ModelOpt's max scales are compared
     bitwise. FP8 SmoothQuant (one more multiply, fused into the input quantization); NVFP4 max and awq_lite.
No Diffusers reference here: the bf16 h3trt block is bitwise the Diffusers block (bench/README.md), and the script
needs only torch and the ModelOpt wheels.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

from bench_common import ROOT, rel_err, write_json  # noqa: E402  (first: it puts this checkout on sys.path)
sys.path.insert(0, str(ROOT / "scripts"))

ALGOS = (("fp8", "max"), ("fp8", "percentile"), ("fp8", "smoothquant"), ("nvfp4", "max"), ("nvfp4", "awq_lite"))
TIMESTEPS = ((0.95, 0.9), (0.7, 0.6), (0.45, 0.35), (0.2, 0.1))  # calibration inputs' (video t, audio t)
HELD_OUT = (0.55, 0.5)


class Stack:
    """`n` random full-width blocks (std 0.02, bf16) and their inputs at one packed layout."""

    def __init__(self, cfg, lay, n: int, dev: str, calib_inputs: int):
        from h3trt.models.dit import Block, rope_inv_freq, rope_tables
        from h3trt.models.packing import row_timesteps

        g = torch.Generator(device=dev).manual_seed(0)
        self.blocks = []
        for _ in range(n):
            block = Block(cfg).to(dev, torch.bfloat16).eval().requires_grad_(False)
            for p in block.parameters():
                p.data.normal_(0.0, 0.02, generator=g)
            self.blocks.append(block)
        self.rope = rope_tables(lay.position_ids.to(dev), rope_inv_freq(cfg).to(dev))
        channel = torch.randn(cfg.hidden_size, device=dev, generator=g).exp()  # log-normal channel scales, sigma 1
        temb_dir = torch.randn(2, cfg.time_embed_dim, device=dev, generator=g)

        def inputs(tv, ta, seed):
            gen = torch.Generator(device=dev).manual_seed(seed)
            _, t_index = row_timesteps(lay, tv, ta)
            x = (torch.randn(1, lay.seq_len, cfg.hidden_size, device=dev, generator=gen) * channel).bfloat16()
            temb = temb_dir * torch.tensor([[tv], [ta]], device=dev)  # another modulation per timestep pair
            return x, temb, (t_index * 3 + lay.token_tags).to(dev)

        self.calib = [inputs(tv, ta, 1 + i) for i, (tv, ta) in enumerate(TIMESTEPS[:calib_inputs])]
        self.held_out = inputs(*HELD_OUT, 99)

    def forward(self, blocks, x, temb, idx, attn=None, upto=None):
        from h3trt.models.dit import sdpa_attention

        h = x
        for block in blocks[:upto]:
            h = block(h, block.modulation(temb).contiguous(), idx, self.rope, attn or sdpa_attention)
        return h


def hook_max(stack) -> list[dict[str, torch.Tensor]]:
    """Today's FP8 input scales before ModelOpt: max |x| into each block linear over the calibration inputs, by
    forward pre-hooks (what h3trt's own MaxCalibrator recorded)."""
    from h3trt.calibration.recipe import BLOCK_LINEARS

    seen, hooks = [dict() for _ in stack.blocks], []
    for i, block in enumerate(stack.blocks):
        for name in BLOCK_LINEARS:
            def hook(m, args, i=i, name=name):
                value = args[0].detach().abs().amax().float()
                seen[i][name] = torch.maximum(seen[i][name], value) if name in seen[i] else value
            hooks.append(block.get_submodule(name).register_forward_pre_hook(hook))
    with torch.no_grad():
        for x, temb, idx in stack.calib:
            stack.forward(stack.blocks, x, temb, idx)
    for h in hooks:
        h.remove()
    return seen


def _recipe(precision: str, algo: str):
    from h3trt.calibration.recipe import QuantRecipe

    weight_only = precision == "nvfp4" and algo == "max"  # no calibration data: 0 steps, as the builder records it
    return QuantRecipe(precision, algo, calib_steps=0 if weight_only else 2)


def run(out: Path, cpu_check: bool, n_blocks: int, calib_inputs: int) -> dict:
    from bench_dit import AUDIO, LATENT_H, LATENT_T, LATENT_W, TEXT, bench
    from bench_fp8 import _cpu_bench, compiled

    from h3trt.build.segments import block_segment
    from h3trt.models.config import H3Config
    from h3trt.models.packing import pack_t2va, text_tags_for

    t0 = time.perf_counter()
    from h3trt.calibration import calibrate as calib  # imports ModelOpt, refuses a missing or other release
    from h3trt.calibration.formats import dequantize_nvfp4, fp8_scale
    from h3trt.calibration.modules import load_quantized_block
    from h3trt.calibration.recipe import BLOCK_LINEARS
    import_s = time.perf_counter() - t0
    from modelopt.torch.quantization import extensions

    dev = "cpu" if cpu_check else "cuda"
    timer = _cpu_bench if cpu_check else bench
    if cpu_check:  # toy width, short sequence: the same code path, a few minutes on two cores
        cfg = H3Config(hidden_size=256, num_heads=4, head_dim=64, ffn_dim=512, time_embed_dim=64,
                       time_embed_hidden_dim=256, rope_freq_dim=8)
        lay = pack_t2va(text_tags_for(16), 3, 8, 12, 13)
    else:
        cfg = H3Config()
        lay = pack_t2va(text_tags_for(TEXT), LATENT_T, LATENT_H, LATENT_W, AUDIO)
    import modelopt

    result = {"env": {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                      "cuda": torch.version.cuda, "modelopt": modelopt.__version__, "tokens": lay.seq_len,
                      "hidden": cfg.hidden_size, "heads": cfg.num_heads, "ffn": cfg.ffn_dim, "blocks": n_blocks,
                      "calib_inputs": calib_inputs, "activations": "bf16", "modelopt_import_s": round(import_s, 2)},
              "algorithms": {}, "ms_per_block": {}, "compile_s": {}, "notes": []}
    print(f"ModelOpt {modelopt.__version__} imported in {import_s:.1f} s; {cfg.hidden_size} wide, {lay.seq_len} rows, "
          f"{n_blocks} blocks, bf16 activations, {result['env']['device']}", flush=True)
    stack = Stack(cfg, lay, n_blocks, dev, calib_inputs)
    x, temb, idx = stack.held_out
    with torch.no_grad():
        reference = stack.forward(stack.blocks, x, temb, idx)
        reference0 = stack.forward(stack.blocks, x, temb, idx, upto=1)
        # The floor under every bf16 number below: the bf16 eager stack's update against the same stack in fp32. fp32
        # attention must take the memory-efficient kernel (the math one would hold 56 x S^2 fp32 scores, 320 GB): if
        # it cannot, the floor is recorded as not measured and the run goes on.
        fp32 = [copy.deepcopy(b).float() for b in stack.blocks]
        rope, stack.rope = stack.rope, tuple(t.float() for t in stack.rope)
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backends = [SDPBackend.EFFICIENT_ATTENTION] if dev == "cuda" else [SDPBackend.MATH]
            with sdpa_kernel(backends):
                floor = rel_err(reference - x, stack.forward(fp32, x.float(), temb, idx) - x)
        except RuntimeError as e:
            floor = f"not measured: {str(e)[:200]}"
        result["bf16_vs_fp32_stack_update_rel_err"] = floor
        stack.rope = rope
        del fp32
        if dev == "cuda":
            torch.cuda.empty_cache()
    print(f"bf16 eager stack vs fp32 (the floor): update rel err {floor}", flush=True)
    today = hook_max(stack)
    quantized = {}  # (precision, algo) -> block 0 as h3trt modules, for the timing below
    kept = {}  # key -> (ModelOpt's calibrated stack, its Calibration, h3trt's stack), compared after every calibration

    # NVFP4 fake quantization on a GPU is ModelOpt's Triton kernel; without it ModelOpt would JIT-build its MX CUDA
    # extension with nvcc (minutes). So where the kernel is missing, AWQ and the NVFP4 weight comparison are skipped.
    import modelopt.torch.kernels.quantization.gemm as modelopt_triton

    triton_nvfp4 = dev == "cpu" or (getattr(modelopt_triton, "IS_AVAILABLE", False)
                                    and hasattr(modelopt_triton, "fp4_fake_quant_block"))
    result["env"]["modelopt_triton_nvfp4"] = triton_nvfp4
    algos = [a for a in ALGOS if triton_nvfp4 or a != ("nvfp4", "awq_lite")]
    if not triton_nvfp4:
        result["notes"].append("ModelOpt's Triton NVFP4 kernel is not available here: nvfp4 awq_lite not run.")
    for precision, algo in algos:
        key = f"{precision}_{algo}"
        recipe = _recipe(precision, algo)
        blocks = copy.deepcopy(stack.blocks)

        def forward(attn, blocks=blocks):
            for cx, ctemb, cidx in stack.calib:
                stack.forward(blocks, cx, ctemb, cidx, attn)

        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        calibration = calib.calibrate(blocks, recipe, forward if recipe.needs_calibration_data else None,
                                      log=lambda m: None)
        if dev == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        tensors = [calibration.export_block(i) for i in range(n_blocks)]
        ours = [load_quantized_block(copy.deepcopy(b), cfg, recipe, t) for b, t in zip(stack.blocks, tensors)]
        row = {"calibration_s": round(seconds, 2), "forward_passes": calibration.record["forward_passes"],
               "fake_quant_during_calibration": calibration.record["fake_quant_during_calibration"],
               "amax_block0": calibration.amax(0)}
        if precision == "fp8" and algo == "max":
            # ModelOpt's max is today's max: the input scales of both are compared bitwise.
            row["scales_equal_today_bitwise"] = all(
                torch.equal(tensors[i][f"{n}.input_scale"], fp8_scale(today[i][n])) for i in range(n_blocks)
                for n in BLOCK_LINEARS)
            today_blocks = []
            for b, t, seen in zip(stack.blocks, tensors, today):
                t = dict(t)
                for n in BLOCK_LINEARS:  # today's weight scale is max |W| / 448 too: only the input scale differs
                    t[f"{n}.input_scale"] = fp8_scale(seen[n])
                today_blocks.append(load_quantized_block(copy.deepcopy(b), cfg, recipe, t))
            quantized[("fp8", "today")] = today_blocks[0]
            del today_blocks
        if precision == "nvfp4" and triton_nvfp4:  # ModelOpt's weight fake-quant (Triton) vs h3trt's dequantization
            diff, total, worst = 0, 0, 0.0
            for i, b in enumerate(blocks):
                for n in BLOCK_LINEARS:
                    linear = b.get_submodule(n)
                    with torch.no_grad():
                        theirs = linear.weight_quantizer(linear.weight)
                    t = tensors[i]
                    mine = dequantize_nvfp4(t[f"{n}.weight_packed"], t[f"{n}.weight_block_scale"],
                                            t[f"{n}.weight_global_scale"], theirs.dtype)
                    diff += (mine != theirs).sum().item()
                    total += mine.numel()
                    worst = max(worst, rel_err(mine, theirs))
            row["weights_vs_modelopt_fake_quant"] = {"elements_differing": diff, "elements": total,
                                                     "max_rel_err": worst}
        with torch.no_grad():
            row["stack_update_rel_err_vs_bf16"] = rel_err(stack.forward(ours, x, temb, idx) - x, reference - x)
            row["block0_update_rel_err_vs_bf16"] = rel_err(stack.forward(ours, x, temb, idx, upto=1) - x,
                                                       reference0 - x)
        result["algorithms"][key] = row
        quantized[(precision, algo)] = ours[0]
        print(f"{key:18s} calibrated in {seconds:6.1f} s ({row['forward_passes']} passes); held-out update rel err "
              f"vs bf16: stack {row['stack_update_rel_err_vs_bf16']:.3e}, block 0 "
              f"{row['block0_update_rel_err_vs_bf16']:.3e}", flush=True)
        kept[key] = (blocks, calibration, ours)
        write_json(out, result)

    # The build path never touched ModelOpt's CUDA extensions (each getter caches its attempt on itself).
    result["modelopt_cuda_extensions_tried"] = {
        name: hasattr(getattr(extensions, name), "extension")
        for name in ("get_cuda_ext", "get_cuda_ext_fp8", "get_cuda_ext_mx")}
    print(f"ModelOpt CUDA extensions the calibrations tried to load: {result['modelopt_cuda_extensions_tried']}",
          flush=True)
    # ModelOpt's fake-quantized stack: its FP8 path would JIT-compile a CUDA extension with nvcc (minutes) on first
    # use; marking it absent makes ModelOpt take its own eager e4m3 path, as it does where the extension fails.
    extensions.get_cuda_ext_fp8.extension = None
    for key in list(kept):
        blocks, calibration, ours = kept.pop(key)
        with torch.no_grad():
            h = x
            for i, b in enumerate(blocks):
                h = b(h, b.modulation(temb).contiguous(), idx, stack.rope, calib.attention_core(calibration.tree, i))
            mine = stack.forward(ours, x, temb, idx)
        result["algorithms"][key]["stack_update_rel_err_h3trt_vs_modelopt_fake_quant"] = rel_err(mine - x, h - x)
        result["algorithms"][key]["stack_output_rel_err_h3trt_vs_modelopt_fake_quant"] = rel_err(mine, h)
        print(f"{key:18s} h3trt stack vs ModelOpt fake-quant stack: update rel err "
              f"{result['algorithms'][key]['stack_update_rel_err_h3trt_vs_modelopt_fake_quant']:.3e}", flush=True)
        del blocks, calibration, ours
        if dev == "cuda":
            torch.cuda.empty_cache()
    write_json(out, result)

    # Timing: block 0 of each variant, compiled as the builder compiles it, at the full shape. One compiled segment
    # per module structure; its weights and scales are inputs, so FP8 with today's, ModelOpt-max and percentile scales
    # run the very same compiled code (same kernels), each timed with its own tensors.
    with torch.no_grad():
        mod0 = stack.blocks[0].modulation(temb).contiguous()
    cos, sin = stack.rope
    segments = {"bf16": (None, {"bf16": stack.blocks[0]}),
                "fp8": (_recipe("fp8", "max"), {"fp8_today": quantized[("fp8", "today")],
                                                "fp8_max": quantized[("fp8", "max")],
                                                "fp8_percentile": quantized[("fp8", "percentile")]}),
                "nvfp4": (_recipe("nvfp4", "max"), {"nvfp4_max": quantized[("nvfp4", "max")]})}
    for precision, algo in (("fp8", "smoothquant"), ("nvfp4", "awq_lite")):  # + pre_quant_scale: own structure
        if (precision, algo) not in quantized:
            continue
        key = f"{precision}_{algo}"
        segments[key] = (_recipe(precision, algo), {key: quantized[(precision, algo)]})
    for segment, (recipe, blocks) in segments.items():
        spec = block_segment(cfg, torch.bfloat16, recipe)
        seg = None
        for name, block in blocks.items():
            tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}
            example = [x, mod0, idx, cos, sin, *[tensors[n].detach() for n in spec.weights]]
            if seg is None:
                seg, result["compile_s"][segment] = compiled(spec, example, dev)
            result["ms_per_block"][name] = timer(lambda: seg(*example))
            print(f"compiled block {segment:16s} {name:16s} {result['ms_per_block'][name]:8.2f} ms", flush=True)
            del example
        del seg
        if dev == "cuda":
            torch.cuda.empty_cache()
        write_json(out, result)
    ms = result["ms_per_block"]
    result["fp8_modelopt_max_vs_today"] = ms["fp8_today"] / ms["fp8_max"]
    if dev == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result["notes"].append("Random weights (std 0.02) and log-normal channel scales: errors are numeric only.")
    write_json(out, result)
    print("\n| algorithm | calib s | stack update err vs bf16 | block 0 | h3trt vs ModelOpt | ms/block |")
    print("|---|---|---|---|---|---|")
    for key, row in result["algorithms"].items():
        timed = ms[key]
        print(f"| {key} | {row['calibration_s']} | {row['stack_update_rel_err_vs_bf16']:.3e} | "
              f"{row['block0_update_rel_err_vs_bf16']:.3e} | "
              f"{row['stack_update_rel_err_h3trt_vs_modelopt_fake_quant']:.1e} | {timed:.2f} |")
    print(f"| bf16 | - | {result['bf16_vs_fp32_stack_update_rel_err']} (vs fp32) | - | - | {ms['bf16']:.2f} |")
    print(f"fp8 with today's scales: {ms['fp8_today']:.2f} ms/block; ModelOpt max scales bitwise today's: "
          f"{result['algorithms']['fp8_max']['scales_equal_today_bitwise']}")
    return result


# What importing ModelOpt 0.47 and running the calibration needs beyond torch (bench/README.md lists the wheels).
# huggingface_hub's own dependencies depend on its version (2.x: httpx2, httpcore2, truststore; the GPU image's 1.33:
# httpx), so only the hub itself is listed.
MODELOPT_NEEDS = ("modelopt", "scipy", "pulp", "pydantic", "pydantic_core", "annotated_types", "typing_inspection",
                  "omegaconf", "yaml", "regex", "rich", "tqdm", "packaging", "safetensors", "numpy", "requests",
                  "urllib3", "idna", "certifi", "huggingface_hub")


def main() -> int:
    import importlib.util

    missing = [m for m in MODELOPT_NEEDS if importlib.util.find_spec(m) is None]
    if missing:  # all at once, before a device minute is spent
        raise SystemExit(f"not importable: {', '.join(missing)}. Install the ModelOpt wheels first "
                         "(scripts/install_missing_wheels.sh .whl/calib_a and .whl/calib_b; bench/README.md).")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True, help="where to write the results")
    p.add_argument("--cpu-check", action="store_true", help="toy width on the CPU (proves the script runs)")
    p.add_argument("--blocks", type=int, default=4, help="full-width blocks in the stack (default 4)")
    p.add_argument("--calib-inputs", type=int, default=2, choices=range(1, len(TIMESTEPS) + 1),
                   help="calibration inputs (timestep pairs) per pass (default 2)")
    args = p.parse_args()
    run(args.json, args.cpu_check, args.blocks, args.calib_inputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
