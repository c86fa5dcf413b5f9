"""VSA (FastH3's sparse attention, h3trt/models/vsa/routing.py) at MiniMax-H3's shape against the dense attention of the
same run, on one GPU (issue 47, item 4 and the bar "VSA attention at 0.9 <= 0.2x the dense FP8 attention").

    python scripts/bench_vsa.py --json bench/results/vsa_<card>.json      # one H100 / H200, ~3-4 min
    python scripts/bench_vsa.py --tiny --json /tmp/vsa_tiny.json          # CPU, small shape: proves it runs

Shape: 1344x768, 5 s, t2va: 128 text + 2 x 207 audio + 37 x 24 x 42 video = 37,838 rows x 56 heads x 128, bf16,
batch 1 (9 prefix tiles, 660 video tiles, 43,776 padded rows); q/k structured as scripts/bench_sparse.py's (smooth
low-rank + noise), v and the gate random. CUDA events, --warmup calls then the median of --iters. Rows (a kernel that
is not installed, or fails, is a row of `skipped` with why):
  fa3_bf16_dense, cudnn_dense   h3trt::attention over the packed rows (the dense bf16 attention)
  fp8_fa3_dense, fp8_cudnn_dense  FP8 attention (h3trt::fp8_sdpa, e4m3 q/k/v, per-tensor scales, v centered): the bar's
                                baseline is the faster of the two
  vsa_<kernel>_<s>              the whole VSA attention of one block as the DiT runs it (models/vsa/routing.py
                                vsa_attention): the tile gather of q/k/v, fp32 pooling, scores, routing, the
                                block-sparse kernel, the untile and the gated coarse branch; kernel fa4 (64 x 64, ragged
                                tiles through FA4's document mask), flex (compiled) and fp8-<tile> (the Triton FP8
                                block-sparse kernel, models/vsa/fp8.py, each of its 64-row tiles, its per-call device
                                scales and quantization pass included); s = 0.9 (FastH3 v1) and 0.8 (V2)
  vsa_<kernel>_<s>_kernel_only  the block-sparse kernel alone, on pre-tiled q/k/v and a fixed routing
  vsa_routing_<s>               everything but the kernel (the routing's and the coarse branch's cost)
  vsa_dense_s0                  sparsity 0 (a dense-first step): the dense kernel + the coarse branch
  vsa_fp8_scales                the FP8 VSA's per-call scales and mu alone (three reductions over q, k, v): what the
                                dynamic scales cost against calibrated ones
The FP8 dense rows time fp8_sdpa on q/k/v quantized beforehand; the fp8 VSA rows include their own quantization.
`bars`: the issue's "VSA attention at 0.9 <= 0.2x the dense FP8 attention of the same run", each kernel's whole VSA
at 0.9 over the faster FP8 dense row, and `vsa_0.9_best` the fastest of them.
Checks: `ragged_check_rel_err`, each kernel's whole VSA on a small ragged geometry (bf16) against the definition in
fp32 (models/vsa/routing.py vsa_reference); each VSA row's output on 2 heads at H3's shape against the same VSA with the
reference kernel (masked SDPA over the padded tiles); `ratio_to_fp8_dense` = VSA ms / the faster FP8 dense ms.
first_call_at_new_length_s: the fa4 VSA kernel's first call at a second canvas (does it recompile per length?).
With --tiny (CPU): reference and flex (unfused) kernels only, perf_counter timings: it checks the script runs.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

from bench_common import ROOT, record_row, rel_err, write_json  # noqa: E402  (first: puts this checkout on sys.path)
sys.path.insert(0, str(ROOT / "scripts"))

from bench_sparse import _fp8_rows, structured_qk  # noqa: E402
from h3trt.models.attention import attention, kernel_problem  # noqa: E402
from h3trt.models.packing import pack_t2va, text_tags_for  # noqa: E402
from h3trt.models.vsa.routing import (pool_tiles, route_tiles, tile_scores, to_tiles, vsa_attention,  # noqa: E402
                                      vsa_topk)
from h3trt.models.vsa.fp8 import vsa_attention_kernel, vsa_fp8_scales, vsa_problem  # noqa: E402
from h3trt.models.vsa.kernels import vsa_block_attention  # noqa: E402
from h3trt.models.vsa.tiles import layout_geometry  # noqa: E402

H3_CANVAS = (128, 37, 48, 84, 207)  # text rows, latent frames, latent h, latent w, audio latents: 1344x768, 5 s
TINY_CANVAS = (40, 9, 12, 20, 30)
SECOND_CANVAS = (128, 37, 42, 96, 207)  # 1536x672: another sequence length, for the recompile check


def geometry_of(canvas, device):
    text, frames, h, w, audio = canvas
    return layout_geometry(pack_t2va(text_tags_for(text), frames, h, w, audio)).to(device)


def run(args) -> dict:
    device = torch.device("cpu" if args.tiny else "cuda")
    canvas, N, D = (TINY_CANVAS, 4, 32) if args.tiny else (H3_CANVAS, 56, 128)
    geo = geometry_of(canvas, device)
    S, dtype = geo.seq_len, torch.bfloat16
    result = {"env": {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "torch": torch.__version__, "cuda": torch.version.cuda,
                      "shape": {"rows": S, "heads": N, "head_dim": D, "tiles": geo.num_tiles,
                                "prefix_tiles": geo.num_prefix_tiles, "padded_rows": geo.padded_len},
                      "iters": args.iters, "warmup": args.warmup,
                      "timing": "CUDA events, median" if device.type == "cuda" else "perf_counter, median (CPU)"},
              "ms": {}, "skipped": {}, "rel_err_vs_reference_kernel": {}, "kept_video_tiles": {}, "notes": []}
    skipped = result["skipped"]
    t0 = time.perf_counter()

    def row(name, fn):
        record_row(result, name, fn, device, args.iters, args.warmup, args.json, t0)

    def skip(name, why):
        skipped[name] = why
        print(f"{name:30s} skipped: {why}", flush=True)
        write_json(args.json, result)

    _ragged_check(result, kernels_of(args), N, D, device, args)
    q, k = structured_qk(S, N, D, device, dtype)
    g = torch.Generator().manual_seed(1)
    v, gate = (torch.randn(1, S, N, D, generator=g).to(device, dtype) for _ in range(2))
    dense = _dense_rows(q, k, v, device, row, skip)
    kernels = kernels_of(args)
    for sparsity in args.sparsities:
        result["kept_video_tiles"][str(sparsity)] = vsa_topk(sparsity, geo.num_video_tiles)
        _vsa_rows(result, row, skip, q, k, v, gate, geo, sparsity, kernels, dense, device)
    row("vsa_dense_s0", lambda: vsa_attention(q, k, v, gate, geo, 0.0, None, dense))
    _scales_row(row, q, k, v, geo)
    _bars(result)
    if not args.tiny and vsa_problem("fa4", device) is None:
        _new_length(result, N, D, device)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    write_json(args.json, result)
    return result


def kernels_of(args) -> tuple[tuple[str, str, str | None], ...]:
    """(row name, kernel, fp8 tile) of each kernel timed."""
    if args.tiny:
        every = (("reference", "reference", None), ("flex", "flex", None), ("fp8_emulated", "fp8_emulated", None))
    else:
        from h3trt.models.sparse.fp8_triton import TILE_CONFIGS

        every = (("fa4", "fa4", None), ("flex", "flex", None), *((f"fp8-{t}", "fp8", t) for t in TILE_CONFIGS[64]))
    return tuple(k for k in every if args.kernels is None or k[1] in args.kernels)


def _scales_row(row, q, k, v, geo):
    """The FP8 VSA's per-call scales and mu alone, on the tiled q/k/v (what models/vsa/fp8.py computes per call)."""
    with torch.no_grad():
        tiled = [to_tiles(x, geo) for x in (q, k, v)]
    row("vsa_fp8_scales", lambda: vsa_fp8_scales(*tiled, geo.sizes))


def _bars(result):
    """VSA over the faster FP8 dense attention: every VSA row, and the bar at 0.9 (the whole VSA, best kernel)."""
    ms = result["ms"]
    fp8 = [ms[n] for n in ("fp8_fa3_dense", "fp8_cudnn_dense") if n in ms]
    if not fp8:
        return
    result["ratio_to_fp8_dense"] = {n: round(t / min(fp8), 4) for n, t in ms.items() if n.startswith("vsa_")}
    whole = {n: t for n, t in ms.items() if n.startswith("vsa_") and n.endswith("_0.9") and "routing" not in n}
    if whole:
        best = min(whole, key=whole.get)
        result["bars"] = {"vsa_0.9_le_0.2x_fp8_dense": {"best": best, "ratio": round(whole[best] / min(fp8), 4),
                                                        "met": whole[best] <= 0.2 * min(fp8)}}


def _ragged_check(result, kernels, N, D, device, args):
    """Each kernel on a small ragged geometry (partial text and audio chunks, tiles ragged on every video axis)
    against the definition (models/vsa/routing.py vsa_reference, fp32): the error of the whole VSA attention, before any
    timing."""
    from h3trt.models.vsa.routing import vsa_reference
    from h3trt.models.vsa.tiles import tile_geometry

    geo = tile_geometry((70, 0, 20), (5, 3, 6)).to(device)
    g = torch.Generator().manual_seed(2)
    q, k, v, gate = (torch.randn(1, geo.seq_len, N, D, generator=g).to(device, torch.bfloat16) for _ in range(4))
    want = vsa_reference(*(x.cpu() for x in (q, k, v, gate)), geo.to("cpu"), 0.6)
    checks = result["ragged_check_rel_err"] = {}
    for name, kernel, tile in kernels:
        try:
            with torch.no_grad():
                got, _ = vsa_attention(q, k, v, gate, geo, 0.6, vsa_attention_kernel(kernel, tile),
                                       lambda a, b, c: attention(a, b, c, "sdpa"))
            checks[name] = round(rel_err(got.cpu(), want), 6)
        except Exception as e:  # noqa: BLE001 - reported; the timed rows say the same kernel failed
            checks[name] = f"{type(e).__name__}: {e}"[:800]
        print(f"ragged check {name}: {checks[name]}", flush=True)
    write_json(args.json, result)


def _dense_rows(q, k, v, device, row, skip):
    """The dense baselines; returns the dense attention a VSA evaluation that keeps every tile runs."""
    bf16 = [kern for kern in ("fa3", "cudnn") if device.type == "cuda" and kernel_problem(kern, "bf16", device) is None]
    for kern in ("fa3", "cudnn"):
        name = "fa3_bf16_dense" if kern == "fa3" else "cudnn_dense"
        if kern in bf16:
            row(name, lambda kern=kern: attention(q, k, v, kern))
        else:
            skip(name, kernel_problem(kern, "bf16", device) if device.type == "cuda" else "CPU run")
    if device.type == "cuda":
        _fp8_rows(q, k, v, device, row, skip)
    kern = bf16[0] if bf16 else "sdpa"
    return lambda a, b, c: attention(a, b, c, kern)


def _vsa_rows(result, row, skip, q, k, v, gate, geo, sparsity, kernels, dense, device):
    """The whole VSA attention per kernel, its kernel alone, the routing alone, and the error against the reference
    kernel on two heads."""
    tag = f"{sparsity:g}"
    with torch.no_grad():
        q_t, k_t, v_t = (to_tiles(x, geo) for x in (q, k, v))
        scores = tile_scores(pool_tiles(q_t, geo), pool_tiles(k_t, geo))
        index, sparse_G = route_tiles(scores, geo.num_prefix_tiles, sparsity)
        sizes = geo.sizes.to(device)
        heads = slice(0, 2)
        want, _ = vsa_attention(q[:, :, heads], k[:, :, heads], v[:, :, heads], gate[:, :, heads], geo, sparsity,
                                lambda *a: vsa_block_attention(*a, "reference"), dense)
    for label, kernel, tile in kernels:
        name = f"vsa_{label}_{tag}"
        problem = vsa_problem(kernel, device)
        if problem is not None:
            skip(name, problem)
            continue
        block_fn = vsa_attention_kernel(kernel, tile)
        try:
            with torch.no_grad():
                got, _ = vsa_attention(q, k, v, gate, geo, sparsity, block_fn, dense)
            result["rel_err_vs_reference_kernel"][name] = round(rel_err(got[:, :, heads], want), 6)
        except Exception as e:  # noqa: BLE001 - reported, the other rows still run
            skip(name, f"{type(e).__name__}: {e}"[:800])
            traceback.print_exc()
            continue
        row(name, lambda block_fn=block_fn: vsa_attention(q, k, v, gate, geo, sparsity, block_fn, dense))
        row(f"{name}_kernel_only", lambda block_fn=block_fn: block_fn(q_t, k_t, v_t, index, sparse_G, sizes))
    row(f"vsa_routing_{tag}", lambda: _routing_only(q, k, v, gate, geo, sparsity))


def _routing_only(q, k, v, gate, geo, sparsity):
    """VSA without its block-sparse kernel: what the routing and the coarse branch cost."""
    from h3trt.models.vsa.routing import add_gated, coarse_branch, from_tiles

    q_t, k_t, v_t = (to_tiles(x, geo) for x in (q, k, v))
    scores = tile_scores(pool_tiles(q_t, geo), pool_tiles(k_t, geo))
    route_tiles(scores, geo.num_prefix_tiles, sparsity)
    return add_gated(from_tiles(q_t, geo), coarse_branch(scores, pool_tiles(v_t, geo)), gate, geo)


def _new_length(result, N, D, device):
    """The fa4 VSA kernel's first call at another canvas: a JIT that compiles per sequence length shows up here."""
    geo = geometry_of(SECOND_CANVAS, device)
    q, k, v, gate = (torch.randn(1, geo.seq_len, N, D, device=device, dtype=torch.bfloat16) for _ in range(4))
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        vsa_attention(q, k, v, gate, geo, 0.9, lambda *a: vsa_block_attention(*a, "fa4"),
                      lambda a, b, c: attention(a, b, c, "sdpa"))
    torch.cuda.synchronize()
    result["first_call_at_new_length_s"] = round(time.perf_counter() - start, 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="write the results here (rewritten after every row)")
    p.add_argument("--tiny", action="store_true", help="CPU, small shape, reference/flex only (checks the script)")
    p.add_argument("--iters", type=int, default=7, help="timed calls per row, the median reported (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before them (default 2)")
    p.add_argument("--kernels", default=None, type=lambda text: set(text.split(",")), metavar="K[,K...]",
                   help="time only these VSA kernels (fa4, flex, fp8; --tiny: reference, flex, fp8_emulated); default "
                        "all: a short device call takes --kernels fp8 --sparsities 0.9")
    p.add_argument("--sparsities", default=(0.9, 0.8), metavar="S[,S...]",
                   type=lambda text: tuple(float(x) for x in text.split(",")), help="VSA sparsities (default 0.9,0.8)")
    run(p.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
