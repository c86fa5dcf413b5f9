"""Ulysses sequence parallel on one host: per-step time of a full-width 4-block H3 stack at sp=1 and sp=N in one run,
eager and compiled (the segments `h3trt build` compiles: the fused block at sp=1, the pre/post-attention halves
around the exchange at sp=N), and the all-to-all time per layer. The compiled rows are repeated for each
--attention-kernels kernel (keys suffixed _cudnn, _fa3; a kernel the GPUs cannot run is skipped, the reason recorded):
the sp=1 block with the kernel inside, and at sp=N the exchange running it over N / sp heads per rank.

    python scripts/bench_sp.py --gpus 2 --out bench/results/sp_h200x2.json
    python scripts/bench_sp.py --gpus 2 --precision fp8 --out bench/results/sp_fp8_h200x2.json
    python scripts/bench_sp.py --cpu-check          # tiny config, gloo, 2 processes: checks the script itself
    python scripts/bench_sp.py --project 4 8 --out bench/results/sp_projection_h200.json   # one GPU: compute ceiling

--precision fp8: the compiled rows run the blocks as `h3trt build --precision fp8 --sp N` builds them (W8A8 e4m3
linears, static scales from max calibration on each block's own input in the eager sp=1 pass); the eager rows, the
reference and the errors stay bf16 (what the Diffusers reference runs).

Shape: hidden 5376, 56 heads x 128, 37,838 tokens (1344x768, 124 frames), bf16, random weights (std 0.02). The step
is the block stack (embed and heads are negligible at this length and run unsharded). Median of 5 after 2 warm-ups.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from bench_common import ROOT  # noqa: E402  (first: it puts this checkout on sys.path)

TOKENS = 128 + 2 * 207 + 37 * 24 * 42


def _time(fn, device, n=5, warm=2) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[n // 2]


def _worker(rank: int, world: int, store: str, out: str, cpu: bool, precision: str, fp8_attention: bool,
            kernels: list[str]) -> None:
    from h3trt.models.config import H3Config
    from h3trt.models.dit import Block, rope_inv_freq, rope_tables
    from h3trt.parallel.ulysses import UlyssesAttention, UlyssesExchange, padded_length

    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    cfg = H3Config.tiny(num_heads=4, head_dim=32) if cpu else H3Config()
    dtype = torch.float32 if cpu else torch.bfloat16
    tokens = 301 if cpu else TOKENS
    torch.manual_seed(0)  # the same weights and inputs on every rank
    blocks = [Block(cfg).to(device, dtype).eval() for _ in range(4)]
    for b in blocks:
        for p in b.parameters():
            torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, tokens, cfg.hidden_size, device=device, dtype=dtype)
    temb = torch.randn(2, cfg.time_embed_dim, device=device)
    idx = torch.randint(0, 6, (tokens,), device=device)
    cos, sin = rope_tables(torch.rand(tokens, 3, device=device) * 40, rope_inv_freq(cfg).to(device))
    mods = [b.modulation(temb).contiguous() for b in blocks]
    result = {"world": world, "tokens": tokens, "device": str(torch.cuda.get_device_name(device)) if not cpu else "cpu",
              "torch": torch.__version__, "precision": str(dtype), "compiled_precision": precision,
              "fp8_attention": fp8_attention}

    with torch.no_grad():
        def step_sp1():
            h = x
            for b, m in zip(blocks, mods):
                h = b(h, m, idx, (cos, sin))
            return h

        padded = padded_length(tokens, world)
        rows = slice(rank * padded // world, (rank + 1) * padded // world)
        pad = padded - tokens
        xp = torch.nn.functional.pad(x, (0, 0, 0, pad))[:, rows].contiguous()
        idxp = torch.nn.functional.pad(idx, (0, pad))[rows]
        cosp = torch.nn.functional.pad(cos, (0, 0, 0, pad))[rows]
        sinp = torch.nn.functional.pad(sin, (0, 0, 0, pad))[rows]
        attn = UlyssesAttention(UlyssesExchange(dist.group.WORLD, tokens, padded))

        def step_sp():
            h = xp
            for b, m in zip(blocks, mods):
                h = b(h, m, idxp, (cosp, sinp), attn)
            return h

        # Reference on every rank (each rank computes the same single-device result; rank 0's time is reported).
        ref = step_sp1()
        recipe, cblocks = None, blocks  # what the compiled rows run
        if precision == "fp8":
            sys.path.insert(0, str(ROOT / "scripts"))
            from bench_fp8 import quantized_copy

            from h3trt.calibration.recipe import QuantRecipe

            # The kernel is bound per compiled row below; quantizing does not depend on it.
            recipe = QuantRecipe("fp8", calib_steps=2, fp8_attention=fp8_attention,
                                 attention_kernel="emulated" if fp8_attention else "")
            cblocks, h = [], x
            for b, m in zip(blocks, mods):
                cblocks.append(quantized_copy(b, cfg, recipe, h, m, idx, (cos, sin)))
                h = b(h, m, idx, (cos, sin))
        result["ms_per_step_sp1"] = _time(step_sp1, device)
        got = step_sp()
        parts = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(parts, got)
        full = torch.cat(parts, dim=1)[:, :tokens]
        result["rel_err_sp_vs_sp1"] = ((full.float() - ref.float()).norm() / ref.float().norm()).item()
        result[f"ms_per_step_sp{world}"] = _time(step_sp, device)
        # The two all-to-alls of one layer, on tensors of the real sizes.
        N, D = cfg.num_heads, cfg.head_dim
        qkv = torch.randn(world, 3, 1, padded // world, N // world, D, device=device, dtype=dtype)
        o = torch.randn(world, 1, padded // world, N // world, D, device=device, dtype=dtype)
        buf1, buf2 = torch.empty_like(qkv), torch.empty_like(o)

        def a2a():
            dist.all_to_all_single(buf1, qkv)
            dist.all_to_all_single(buf2, o)

        result["ms_all_to_all_per_layer"] = _time(a2a, device)

        # Compiled: the segments exactly as the builder compiles them (weights as inputs, symbolic rows).
        from h3trt.build.backends import compile_segment
        from h3trt.engines.loaders import load_segment
        from h3trt.build.segments import block_post_segment, block_pre_segment, block_segment
        from h3trt.parallel.ulysses import UlyssesExchange

        seg_dir = Path(f"/tmp/h3trt-bench-sp-seg-{rank}")  # laid out as a bundle: segments/<artifact>
        (seg_dir / "segments").mkdir(parents=True, exist_ok=True)

        def compiled(spec, example):
            t0 = time.perf_counter()
            entry = compile_segment("inductor", spec, example, seg_dir / "segments")
            seg = load_segment("inductor", {"name": spec.name, **entry}, seg_dir, device)
            result[f"compile_s_{spec.name}"] = round(time.perf_counter() - t0, 1)
            return seg

        def weights(block, spec):
            tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}  # FP8: e4m3 buffers, scales
            return [tensors[n] for n in spec.weights]

        import dataclasses

        from h3trt.models.attention import bound_attention, kernel_problem

        pre, post = block_pre_segment(cfg, dtype, world, recipe), block_post_segment(cfg, dtype, recipe)
        recv = torch.randn(world, 1, padded // world, N // world, D, device=device, dtype=dtype)
        pre_c = compiled(pre, [xp, mods[0], idxp, cosp, sinp] + weights(cblocks[0], pre))
        post_c = compiled(post, [xp, recv, mods[0], idxp] + weights(cblocks[0], post))
        pre_w, post_w = [weights(b, pre) for b in cblocks], [weights(b, post) for b in cblocks]
        exchange = UlyssesExchange(dist.group.WORLD, tokens, padded)
        result["skipped"], first = {}, None
        attention_precision = "fp32" if dtype == torch.float32 else "bf16"
        for kernel in kernels:  # the compiled rows of each attention kernel (`h3trt build --attention K`)
            fp8_kernel = "emulated" if kernel == "sdpa" else kernel
            fp8 = recipe is not None and recipe.fp8_attention
            problem = kernel_problem(fp8_kernel if fp8 else kernel, "fp8" if fp8 else attention_precision, device)
            if problem:
                result["skipped"][kernel] = problem
                continue
            krecipe = dataclasses.replace(recipe, attention_kernel=fp8_kernel) if fp8 else recipe
            blk = block_segment(cfg, dtype, krecipe, name=f"block_{kernel}", attention=kernel)
            blk_c = compiled(blk, [x, mods[0], idx, cos, sin] + weights(cblocks[0], blk))
            blk_w = [weights(b, blk) for b in cblocks]

            def step_sp1_compiled():
                h = x
                for w, m in zip(blk_w, mods):
                    (h,) = blk_c(h, m, idx, cos, sin, *w)
                return h

            got = step_sp1_compiled()
            result[f"rel_err_compiled_sp1_vs_eager_{kernel}"] = (
                (got.float() - ref.float()).norm() / ref.float().norm()).item()
            result[f"ms_per_step_sp1_compiled_{kernel}"] = _time(step_sp1_compiled, device)
            # What EngineDiT hands the exchange: the bundle's kernel, or each layer's compiled FP8 attention segment.
            attns = [bound_attention(kernel)] * len(cblocks)
            if fp8:
                from h3trt.build.segments import sharded_attention_segment

                spec = dataclasses.replace(sharded_attention_segment(cfg, krecipe), name=f"attention_{kernel}")
                qkv_rows = [torch.randn(1, tokens, N // world, D, device=device, dtype=dtype) for _ in range(3)]
                attn_c = compiled(spec, qkv_rows + weights(cblocks[0], spec))
                attns = [lambda q, k, v, w=weights(b, spec), attn_c=attn_c: attn_c(q, k, v, *w)[0] for b in cblocks]

            def step_sp_compiled():
                h = xp
                for wa, wb, m, a in zip(pre_w, post_w, mods, attns):
                    (qkv,) = pre_c(h, m, idxp, cosp, sinp, *wa)
                    (h,) = post_c(h, exchange(qkv, a), m, idxp, *wb)
                return h

            got = step_sp_compiled()
            dist.all_gather(parts, got)
            full = torch.cat(parts, dim=1)[:, :tokens]
            result[f"rel_err_compiled_sp{world}_vs_eager_sp1_{kernel}"] = (
                (full.float() - ref.float()).norm() / ref.float().norm()).item()
            result[f"ms_per_step_sp{world}_compiled_{kernel}"] = _time(step_sp_compiled, device)
            # Where a sharded layer's time goes: the compiled halves, the exchange (all-to-alls around attention).
            qkv0 = pre_c(xp, mods[0], idxp, cosp, sinp, *pre_w[0])[0]
            out0 = exchange(qkv0, attns[0])
            result[f"ms_layer_exchange_{kernel}"] = _time(lambda: exchange(qkv0, attns[0]), device)
            if first is None:
                first = kernel
                result["ms_layer_pre"] = _time(lambda: pre_c(xp, mods[0], idxp, cosp, sinp, *pre_w[0]), device)
                result["ms_layer_post"] = _time(lambda: post_c(xp, out0, mods[0], idxp, *post_w[0]), device)
            result[f"speedup_compiled_{kernel}"] = (result[f"ms_per_step_sp1_compiled_{kernel}"]
                                                    / result[f"ms_per_step_sp{world}_compiled_{kernel}"])
            result[f"speedup_compiled_vs_eager_sp1_{kernel}"] = (result["ms_per_step_sp1"]
                                                                 / result[f"ms_per_step_sp{world}_compiled_{kernel}"])
        q = torch.randn(1, padded, N // world, D, device=device, dtype=dtype).transpose(1, 2)
        result["ms_layer_sdpa_only"] = _time(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), device)
        q = torch.randn(1, tokens, N, D, device=device, dtype=dtype).transpose(1, 2)
        result["ms_layer_sdpa_sp1"] = _time(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), device)
    result["speedup"] = result["ms_per_step_sp1"] / result[f"ms_per_step_sp{world}"]
    if rank == 0:
        Path(out).write_text(json.dumps(result, indent=1))
        for key, value in result.items():
            print(f"{key:<26} {value}", flush=True)
    dist.destroy_process_group()


def _project(sps: list[int], out: Path) -> None:
    """One GPU, no communication: the per-rank compute of one compiled step at each sp (block_pre on Sp / sp rows,
    SDPA over every row for N / sp heads, block_post on Sp / sp rows; 4 layers) against the compiled sp=1 step.
    Their ratio bounds the sp speedup from above: the all-to-alls come on top (2.0 ms a layer at sp=2 on NVLink)."""
    from h3trt.build.backends import compile_segment
    from h3trt.engines.loaders import load_segment
    from h3trt.build.segments import block_post_segment, block_pre_segment, block_segment
    from h3trt.models.config import H3Config
    from h3trt.models.dit import Block, rope_inv_freq, rope_tables
    from h3trt.parallel.ulysses import padded_length

    device, dtype, cfg, layers = torch.device("cuda", 0), torch.bfloat16, H3Config(), 4
    torch.manual_seed(0)
    block = Block(cfg).to(device, dtype).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tensors = dict(block.named_parameters())
    temb = torch.randn(2, cfg.time_embed_dim, device=device)
    result = {"mode": "projection: one GPU, per-rank compute only", "tokens": TOKENS, "layers": layers,
              "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "ms": {}}
    seg_dir = Path("/tmp/h3trt-bench-sp-project")
    (seg_dir / "segments").mkdir(parents=True, exist_ok=True)

    def compiled(spec, example):
        entry = compile_segment("inductor", spec, example, seg_dir / "segments")
        return load_segment("inductor", {"name": spec.name, **entry}, seg_dir, device)

    def timed(fn) -> float:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[2]

    with torch.no_grad():
        mod = block.modulation(temb).contiguous()
        for sp in [1] + sps:
            padded = padded_length(TOKENS, sp)
            rows, heads = padded // sp, cfg.num_heads // sp
            x = torch.randn(1, rows, cfg.hidden_size, device=device, dtype=dtype)
            idx = torch.randint(0, 6, (rows,), device=device)
            cos, sin = rope_tables(torch.rand(rows, 3, device=device) * 40, rope_inv_freq(cfg).to(device))
            if sp == 1:
                spec = block_segment(cfg, dtype)
                w = [tensors[n] for n in spec.weights]
                seg = compiled(spec, [x, mod, idx, cos, sin, *w])
                result["ms"]["sp1_step"] = layers * timed(lambda: seg(x, mod, idx, cos, sin, *w))
                continue
            pre, post = block_pre_segment(cfg, dtype, sp), block_post_segment(cfg, dtype)
            wa, wb = [tensors[n] for n in pre.weights], [tensors[n] for n in post.weights]
            recv = torch.randn(sp, 1, rows, heads, cfg.head_dim, device=device, dtype=dtype)
            pre_c, post_c = compiled(pre, [x, mod, idx, cos, sin, *wa]), compiled(post, [x, recv, mod, idx, *wb])
            q, k, v = (torch.randn(1, padded, heads, cfg.head_dim, device=device, dtype=dtype).transpose(1, 2)
                       for _ in range(3))
            mask = (torch.arange(padded, device=device) < TOKENS).view(1, 1, 1, padded)
            sdpa = F.scaled_dot_product_attention
            ms = {"pre": timed(lambda: pre_c(x, mod, idx, cos, sin, *wa)),
                  "post": timed(lambda: post_c(x, recv, mod, idx, *wb)),
                  "sdpa": timed(lambda: sdpa(q, k[:, :, :TOKENS], v[:, :, :TOKENS])),
                  "sdpa_with_padding_mask": timed(lambda: sdpa(q, k, v, attn_mask=mask)) if padded != TOKENS else None}
            ms["step"] = layers * (ms["pre"] + ms["sdpa"] + ms["post"])
            ms["ceiling_speedup"] = result["ms"]["sp1_step"] / ms["step"]
            result["ms"][f"sp{sp}"] = ms
            print(f"sp={sp}: {rows} rows x {heads} heads per rank; per layer pre {ms['pre']:.2f} + SDPA {ms['sdpa']:.2f}"
                  f" (with a padding mask: {ms['sdpa_with_padding_mask'] or 0:.2f}) + post {ms['post']:.2f} ms; step "
                  f"{ms['step']:.1f} ms vs sp=1 {result['ms']['sp1_step']:.1f} ms: ceiling {ms['ceiling_speedup']:.2f}x",
                  flush=True)
    out.write_text(json.dumps(result, indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/sp.json")
    p.add_argument("--cpu-check", action="store_true")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16", help="what the compiled rows run")
    p.add_argument("--fp8-attention", action="store_true", help="with --precision fp8: FP8 attention as bundles run it")
    p.add_argument("--attention-kernels", nargs="+", choices=("cudnn", "fa3", "sdpa"),
                   help="compiled rows per attention kernel (default: cudnn fa3 on GPUs, sdpa with --cpu-check)")
    p.add_argument("--project", type=int, nargs="+", metavar="SP",
                   help="one GPU, no communication: per-rank compute of a compiled step at these sp (bf16)")
    args = p.parse_args()
    if args.fp8_attention and args.precision != "fp8":
        p.error("--fp8-attention needs --precision fp8.")
    if args.project:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        _project(args.project, args.out)
        return 0
    world = 2 if args.cpu_check else args.gpus
    store = f"/tmp/h3trt-bench-sp-{os.getpid()}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    kernels = args.attention_kernels or (["sdpa"] if args.cpu_check else ["cudnn", "fa3"])
    mp.spawn(_worker, args=(world, store, str(args.out), args.cpu_check, args.precision, args.fp8_attention, kernels),
             nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
