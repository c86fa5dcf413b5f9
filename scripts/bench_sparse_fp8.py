"""scripts/bench_sparse.py's FP8 block-sparse rows (issue 46): the Triton FP8 kernel (h3trt/models/sparse/fp8_triton.py)
at H3's shape, every tile configuration timed in the one run, and the FP8 DiT block around it.

Rows (names as issue 46 asks):
  fp8_sparse_B_S_<tile>   the kernel at B-row blocks, sparsity S, one tile configuration: quantization pass (q, k,
                          v - mu to e4m3 with per-tensor scales, V transposed) + attention, as a bundle calls it
  fp8_sparse_B_S          the fastest served tile of those (`fp8_sparse_best_tile` names it; `_fastacc` tiles,
                          the tensor cores' FP8 accumulator kept over a whole row, are timed but never served)
  fp8_sparse_B_S_attention_only  the best tile's attention kernel alone (its quantization pass apart)
  fp8_block_dense_fp8attn_fa3    one full-width FP8 block with FP8 attention (FA3's FP8 kernel): what an fp8
                          bundle built with --fp8-attention runs densely
  fp8_block_sparse_fp8_64_0.75   the same block split around the fused router + the FP8 sparse kernel (64-row
                          blocks, 0.75, the block's own calibrated q/k/v scales), video query blocks sparse
Each kernel row is checked against the masked bf16 reference over the same kept blocks on a few (head, query block)
cells (`rel_err_vs_masked_reference`: FP8's rounding of q/k/v and of P, a few percent on these i.i.d. values).
"""

from __future__ import annotations

import time
import traceback

import torch

from h3trt.models.sparse.fp8 import fp8_sparse_attention


def fp8_scales(q, k, v):
    """Per-tensor e4m3 scales from each tensor's max, v's after centering (what calibration records)."""
    v_centered = v.float() - v.float().mean(1, keepdim=True)
    return tuple((t.float().abs().amax() / 448.0).reshape(1) for t in (q, k, v_centered))


def fp8_sparse_rows(result, row, skip, selected, q, k, v, plans, all_sparse, check_cells, configs):
    """The kernel rows, every tile; returns {(block, sparsity): best served tile}."""
    from h3trt.models.sparse.kernels import sparse_kernel_problem

    problem = sparse_kernel_problem("fp8", q.device)
    if problem:
        for block, sparsity in configs:
            skip(f"fp8_sparse_{block}_{sparsity:.2f}", problem)
        return {}
    from h3trt.models.sparse.fp8_triton import (BENCH_ONLY_CONFIGS, TILE_CONFIGS, fp8_block_sparse_attention,
                                                fp8_operands, tile_config)

    scales = fp8_scales(q, k, v)
    ms, best = result["ms"], {}
    for block, sparsity in configs:
        tag = f"{block}_{sparsity:.2f}"
        if not selected(f"fp8_sparse_{tag}"):
            continue
        index, sparse_G = plans[block, sparsity], all_sparse[block]
        for tile in [*TILE_CONFIGS[block], *BENCH_ONLY_CONFIGS[block]]:
            name = f"fp8_sparse_{tag}_{tile}"

            def call(index=index, sparse_G=sparse_G, block=block, tile=tile):
                return fp8_sparse_attention(q, k, v, scales, index, sparse_G, block, "fp8", tile)
            try:
                t0 = time.perf_counter()
                out = call()  # the first call compiles (Triton): timed apart
                torch.cuda.synchronize()
                result.setdefault("first_call_s", {})[name] = time.perf_counter() - t0
                result["rel_err_vs_masked_reference"][name] = check_cells(out, q, k, v, index, block)
                del out
            except Exception as e:  # one tile failing (a launch limit, a compile error) is a row, not the end
                result["skipped"][name] = f"{type(e).__name__}: {e}"[:800]
                print(f"{name:36s} failed: {result['skipped'][name]}", flush=True)
                traceback.print_exc()
                continue
            row(name, call)
        served = {t: ms[f"fp8_sparse_{tag}_{t}"] for t in TILE_CONFIGS[block] if f"fp8_sparse_{tag}_{t}" in ms}
        if not served:
            continue
        best[block, sparsity] = tile = min(served, key=served.get)
        ms[f"fp8_sparse_{tag}"] = served[tile]
        result.setdefault("fp8_sparse_best_tile", {})[f"fp8_sparse_{tag}"] = tile
        result["rel_err_vs_masked_reference"][f"fp8_sparse_{tag}"] = \
            result["rel_err_vs_masked_reference"][f"fp8_sparse_{tag}_{tile}"]
        ops = fp8_operands(q, k, v, *scales)
        row(f"fp8_sparse_{tag}_attention_only",
            lambda ops=ops, index=index, sparse_G=sparse_G, block=block, tile=tile:
            fp8_block_sparse_attention(ops, index, sparse_G, block, tile_config(block, tile)))
        del ops
        _new_length_first_call(result, f"fp8_sparse_{tag}", q, k, v, block, sparsity, tile)
    return best


def _new_length_first_call(result, name, q, k, v, block, sparsity, tile):
    """The first call at another sequence length after the kernel ran at S: steady time, not seconds, means one
    compile serves every length (the lengths are not specialised on)."""
    from h3trt.models.sparse.attention import subblock_route

    rows = q.shape[1] - 4999
    q2, k2, v2 = (t[:, :rows].contiguous() for t in (q, k, v))
    index, _ = subblock_route(q2, k2, sparsity, q.shape[-1] ** -0.5, block=block)
    sparse_G = torch.ones(-(-rows // block), dtype=torch.bool, device=q.device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fp8_sparse_attention(q2, k2, v2, fp8_scales(q2, k2, v2), index, sparse_G, block, "fp8", tile)
    torch.cuda.synchronize()
    result.setdefault("first_call_at_new_length_s", {})[name] = time.perf_counter() - t0


def fp8_block_rows(result, row, tile: str | None):
    """One full-width FP8 block with FP8 attention (calibrated on its own input, as bench_fp8 does): dense (the fused
    block segment, FA3's FP8 attention) against block_pre + the fused router + the FP8 sparse kernel at 64-row
    blocks, 0.75, with the block's calibrated scales + block_post, all compiled as `h3trt build` compiles them."""
    from bench_common import rel_err
    from bench_dit import block_pair, layout
    from bench_fp8 import compiled, quantized_copy

    from h3trt.build.segments import block_post_segment, block_pre_segment, block_segment
    from h3trt.calibration.recipe import QuantRecipe
    from h3trt.models.attention import kernel_problem
    from h3trt.models.config import H3Config
    from h3trt.models.sparse.router import route_blocks, router_for

    dev, cfg, lay = "cuda", H3Config(), layout()
    problem = kernel_problem("fa3", "fp8", torch.device(dev))
    if problem:
        result["skipped"]["fp8_block_dense_fp8attn_fa3"] = problem
        return
    ref, ours, x, temb, idx, pos, mod, (cos, sin) = block_pair(cfg, lay, dev)
    del ref
    recipe = QuantRecipe("fp8", calib_steps=2, fp8_attention=True, attention_kernel="fa3")
    with torch.no_grad():
        block = quantized_copy(ours, cfg, recipe, x, mod, idx, (cos, sin))
        tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}
        scales = tuple(tensors[f"attn.{n}"].detach() for n in ("q_scale", "k_scale", "v_scale"))

        def segment(spec, acts):
            seg, _ = compiled(spec, [*acts, *[tensors[n].detach() for n in spec.weights]], dev)
            return seg, [tensors[n].detach() for n in spec.weights]

        dense, w = segment(block_segment(cfg, torch.bfloat16, recipe), [x, mod, idx, cos, sin])
        row("fp8_block_dense_fp8attn_fa3", lambda: dense(x, mod, idx, cos, sin, *w))
        (want,) = dense(x, mod, idx, cos, sin, *w)
        pre, w_pre = segment(block_pre_segment(cfg, torch.bfloat16, 1, recipe), [x, mod, idx, cos, sin])
        (qkv,) = pre(x, mod, idx, cos, sin, *w_pre)  # [sp=1, 3, B, S, N, D]
        post, w_post = segment(block_post_segment(cfg, torch.bfloat16, recipe), [x, qkv[:, 0], mod, idx])
        video = torch.zeros(lay.seq_len, dtype=torch.bool)
        video[lay.video_index.long()] = True
        G = -(-lay.seq_len // 64)
        sparse_G = torch.nn.functional.pad(video, (0, G * 64 - lay.seq_len)).view(G, 64).all(1).to(dev)
        result["fp8_block_sparse_query_blocks"] = f"{int(sparse_G.sum())} of {G}"

        def sparse_block():
            (qkv,) = pre(x, mod, idx, cos, sin, *w_pre)
            q, k, v = qkv[0].unbind(0)
            index, _ = route_blocks(q, k, 0.75, cfg.head_dim ** -0.5, router_for(q.device))
            out = fp8_sparse_attention(q, k, v, scales, index, sparse_G, 64, "fp8", tile)
            (y,) = post(x, out[None], mod, idx, *w_post)
            return y

        row("fp8_block_sparse_fp8_64_0.75", sparse_block)
        result["fp8_block_sparse_fp8_update_rel_err_vs_dense"] = rel_err(sparse_block().float() - x.float(),
                                                                         want.float() - x.float())
        ms = result["ms"]
        if "fp8_block_dense_fp8attn_fa3" in ms and "fp8_block_sparse_fp8_64_0.75" in ms:
            result["fp8_block_sparse_speedup"] = ms["fp8_block_dense_fp8attn_fa3"] / ms["fp8_block_sparse_fp8_64_0.75"]
