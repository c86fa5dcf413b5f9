"""The SubBlock router on one GPU at MiniMax-H3's shape: the torch router against the fused Triton one (issue 36
item 1), their blocks compared, and the Triton kernels' compiles counted.

    python scripts/bench_router.py --json bench/results/router_h200.json      # one H200 (or H100)
    TRITON_INTERPRET=1 python scripts/bench_router.py --json /tmp/router.json  # CPU, tiny shapes: proves it runs

Shape: 37,838 rows x 56 heads x 128, bf16, batch 1, n_q = n_k = 4, sparsity 0.75; CUDA events, median of 7 after 2
warm-up calls. Stages, each written to the JSON as it ends (a stage that fails is a row with its error):
  recompile_check   warm as warm_router does (20 blocks, aligned and ragged), then route at H3's length and at another:
                    the Triton kernels' compiled-variant count must not grow (lengths are not specialised on)
  h3_64_structured  64-row blocks, structured q/k (bench_sparse.py's): torch router ms, Triton ms for each dot
                    precision (tf32x3, ieee), the scores' distance to torch's, and the rows whose kept blocks differ
                    from the torch router's and from the reference's, with the fp32 score gap between the swapped
                    blocks (a near-tie is all a difference can be); pool, scores and top-k timed apart
  sweep_scores_64   the score kernel's tile and warp choices
  h3_64_random      the same on i.i.d. q/k (flat scores: the most near-ties)
  h3_128_structured 128-row blocks
  small_parity      every n pair, ragged and unequal lengths, B = 2, both block sizes, and exact ties
`bar` divides the Triton router's time by bench/README.md's H200 FP8 sparse block (61.84 ms; the bar is <= 2%) and
by the 64-row sparse attention (24.1 ms).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import torch
import triton

import bench_common  # noqa: E402,F401  (first: it puts this checkout on sys.path)

from h3trt.models.sparse import router_triton as fused  # noqa: E402
from h3trt.models.sparse.attention import (_topk_lowest_first, subblock_route, subblock_route_reference,  # noqa: E402
                                           subblock_scores)
from h3trt.models.sparse.router_triton import (_pool_kernel, _score_kernel, _topk_kernel,  # noqa: E402
                                               pool_subblocks_triton, subblock_route_triton, subblock_scores_triton,
                                               topk_lowest_first_triton)

SPARSE_ATTENTION_MS, FP8_SPARSE_BLOCK_MS = 24.1, 61.84  # bench/README.md, H200, session 14
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SYNC = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
RESULT = {"env": {}, "runs": {}, "bar": {}}
JSON_PATH: Path | None = None


def dump():
    bar = {}
    for name, r in RESULT["runs"].items():
        for prec in fused.DOT_PRECISIONS:
            ms = r.get(f"ms_triton_route_{prec}") if isinstance(r, dict) else None
            if ms is not None and r.get("block") == 64 and DEV == "cuda":  # a CPU (interpreter) run proves it runs
                bar[f"{name}_{prec}"] = {"triton_ms": ms, "torch_ms": r["ms_torch_route"],
                                         "share_of_fp8_sparse_block": ms / FP8_SPARSE_BLOCK_MS,
                                         "share_of_sparse_attention": ms / SPARSE_ATTENTION_MS,
                                         "bar_2pct_of_block_met": ms / FP8_SPARSE_BLOCK_MS <= 0.02}
    RESULT["bar"] = bar
    if JSON_PATH is not None:
        JSON_PATH.parent.mkdir(parents=True, exist_ok=True)
        JSON_PATH.write_text(json.dumps(RESULT, indent=1, default=float))


def cuda_ms(fn, iters=7, warmup=2):
    if DEV == "cpu":
        iters, warmup = 1, 0
    for _ in range(warmup):
        fn()
    SYNC()
    ts = []
    for _ in range(iters):
        if DEV == "cpu":
            t0 = time.perf_counter(); fn(); ts.append((time.perf_counter() - t0) * 1e3); continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        SYNC()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def structured_qk(S, N, D, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    pos = torch.arange(S, dtype=torch.float64, device=DEV) / S
    freqs = torch.arange(1, 9, dtype=torch.float64, device=DEV)
    ang = 2 * math.pi * pos[:, None] * freqs
    phi = torch.cat([torch.sin(ang), torch.cos(ang)], 1)
    beta = torch.linspace(4, 12, N, dtype=torch.float64, device=DEV)
    W = torch.linalg.qr(torch.randn(N, D, 16, generator=g, dtype=torch.float64, device=DEV)).Q.transpose(1, 2)
    amp = (beta * D ** 0.5 / 8).sqrt()
    base = torch.einsum("sf,nfd->snd", phi, W) * amp[None, :, None]
    q = base + 0.3 * torch.randn(S, N, D, generator=g, dtype=torch.float64, device=DEV)
    k = base + 0.3 * torch.randn(S, N, D, generator=g, dtype=torch.float64, device=DEV)
    return q[None].to(torch.bfloat16), k[None].to(torch.bfloat16)


def compare(got, want, ref_scores):
    """rows whose kept set differs, and how far apart (in the torch fp32 scores) the swapped blocks were."""
    differ = (got != want).any(-1)
    rows = int(differ.sum())
    out = {"rows_differing": rows, "rows": int(differ.numel())}
    if rows:
        K = ref_scores.shape[-1]
        s = ref_scores[differ]
        g, w = got[differ].long(), want[differ].long()
        thr = s.gather(1, w).amin(1)
        low = s.gather(1, g).amin(1)
        gap = (thr - low)
        out["max_gap_at_threshold"] = gap.max().item()
        out["max_rel_gap_at_threshold"] = (gap / thr.abs().clamp_min(1e-30)).max().item()
        out["blocks_differing"] = int(((torch.zeros_like(s, dtype=torch.int8).scatter_(1, g, 1)
                                        != torch.zeros_like(s, dtype=torch.int8).scatter_(1, w, 1)).sum()) // 2)
    return out


def stage(name, fn):
    t0 = time.time()
    try:
        RESULT["runs"][name] = fn()
    except Exception as e:
        RESULT["runs"][name] = {"error": f"{type(e).__name__}: {e}"[:1500]}
        traceback.print_exc()
    print(name, round(time.time() - t0, 1), "s", json.dumps(RESULT["runs"][name])[:600], flush=True)
    dump()


def h3(block, q, k, kind, precisions=("tf32x3", "ieee")):
    S, N, D = q.shape[1], q.shape[2], q.shape[3]
    scale = D ** -0.5
    r = {"block": block, "n_q": 4, "n_k": 4, "sparsity": 0.75, "inputs": kind}
    want, topk = subblock_route(q, k, 0.75, scale, block=block)
    r["topk"], r["key_blocks"] = topk, -(-S // block)
    ref, _ = subblock_route_reference(q, k, 0.75, scale, block=block)
    ref_scores = subblock_scores(q, k, scale, block=block)
    r["torch_chunked_vs_reference"] = compare(want, ref, ref_scores)
    r["ms_torch_route"] = cuda_ms(lambda: subblock_route(q, k, 0.75, scale, block=block))
    for prec in precisions:
        t0 = time.time()
        got, t2 = subblock_route_triton(q, k, 0.75, scale, block=block, precision=prec)
        SYNC()
        r[f"first_call_s_{prec}"] = time.time() - t0
        assert t2 == topk
        sc = subblock_scores_triton(q, k, scale, block=block, precision=prec)
        d = (sc - ref_scores).abs()
        r[f"score_max_abs_diff_{prec}"] = d.max().item()
        r[f"score_max_rel_diff_{prec}"] = (d / ref_scores.abs().clamp_min(1e-6)).max().item()
        r[f"vs_torch_route_{prec}"] = compare(got, want, ref_scores)
        r[f"vs_reference_{prec}"] = compare(got, ref, ref_scores)
        r[f"ms_triton_route_{prec}"] = cuda_ms(lambda: subblock_route_triton(q, k, 0.75, scale, block=block,
                                                                             precision=prec))
        r[f"ms_scores_only_{prec}"] = cuda_ms(lambda: subblock_scores_triton(q, k, scale, block=block, precision=prec))
    r["ms_pool_q_and_k"] = cuda_ms(lambda: (pool_subblocks_triton(q, 4, block, scale),
                                            pool_subblocks_triton(k, 4, block)))
    flat = ref_scores.view(-1, ref_scores.shape[-1])
    r["ms_topk_triton"] = cuda_ms(lambda: topk_lowest_first_triton(flat, topk))
    saved = fused.TOPK_WARPS
    for w in (1, 2, 4, 8):
        fused.TOPK_WARPS = w
        r[f"ms_topk_triton_w{w}"] = cuda_ms(lambda: topk_lowest_first_triton(flat, topk))
    fused.TOPK_WARPS = saved
    r["ms_topk_torch"] = cuda_ms(lambda: _topk_lowest_first(flat, topk))
    if topk == ref_scores.shape[-1]:
        return r
    top2 = ref_scores.view(-1, ref_scores.shape[-1]).topk(topk + 1, dim=-1).values
    edge = (top2[:, topk - 1] - top2[:, topk]) / top2[:, topk - 1].abs().clamp_min(1e-30)
    r["reference_rows_with_rel_gap_at_threshold_below"] = {str(t): int((edge <= t).sum())
                                                           for t in (0, 1e-7, 1e-6, 1e-5)}
    r["topk_triton_equals_torch_on_same_scores"] = bool(torch.equal(topk_lowest_first_triton(flat, topk),
                                                                    _topk_lowest_first(flat, topk)))
    return r


def sweep(q, k):
    """score-kernel launch configs at H3's shape, 64-row blocks, n = 4/4."""
    out = {}
    saved = (fused.SCORE_TILE_G, fused.SCORE_TILE_K, fused.SCORE_WARPS)
    configs = [("tf32x3", 64, 64, 4), ("tf32x3", 64, 64, 8), ("tf32x3", 128, 64, 8), ("tf32x3", 64, 128, 8),
               ("tf32x3", 128, 128, 8), ("ieee", 64, 64, 4), ("ieee", 64, 64, 8), ("ieee", 32, 64, 4)]
    t_start = time.time()
    for prec, tg, tk, w in configs:
        if time.time() - t_start > 45:
            out["stopped"] = "time"
            break
        fused.SCORE_TILE_G, fused.SCORE_TILE_K, fused.SCORE_WARPS = tg, tk, w
        try:
            out[f"{prec}_{tg}x{tk}_w{w}"] = cuda_ms(lambda: subblock_scores_triton(q, k, 128 ** -0.5, precision=prec),
                                                    iters=5, warmup=1)
        except Exception as e:
            out[f"{prec}_{tg}x{tk}_w{w}"] = f"{type(e).__name__}: {e}"[:300]
    fused.SCORE_TILE_G, fused.SCORE_TILE_K, fused.SCORE_WARPS = saved
    return out


def compiled_count():
    """Compiled variants of the three kernels (Triton's per-device kernel caches; None under the interpreter)."""
    if not hasattr(_score_kernel, "device_caches"):
        return None
    return sum(len(c[0]) for fn in (_pool_kernel, _score_kernel, _topk_kernel) for c in fn.device_caches.values())


def recompile_check(S, N, D):
    """warm as warm_router does (20 blocks, aligned and ragged), then route at H3's length and another: compiles?"""
    g = torch.Generator(device="cpu").manual_seed(0)
    for rows in (20 * 64, 20 * 64 + 1):
        q, k = (torch.randn(1, rows, N, D, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
        subblock_route_triton(q, k, 0.5, D ** -0.5)
    SYNC()
    after_warm = compiled_count()
    out = {"compiled_after_warm": after_warm}
    for rows in (S, S - S // 8 - 1):
        q = torch.randn(1, rows, N, D, device=DEV, dtype=torch.bfloat16)
        t0 = time.time()
        subblock_route_triton(q, q, 0.75, D ** -0.5)
        SYNC()
        out[f"first_call_s_at_{rows}"] = time.time() - t0
        out[f"compiled_after_{rows}"] = compiled_count()
    return out


def small_parity():
    """every n, ragged tails, unequal lengths, B = 2: exact equality with the reference (and which precision)."""
    out = {}
    torch.manual_seed(0)
    small = DEV == "cpu"
    for n_q, n_k in ((1, 1), (4, 4)) if small else ((1, 1), (2, 2), (4, 4), (8, 8), (1, 8), (8, 2)):
        for rows, krows in ((64 * (5 if small else 50) + 37, 64 * (4 if small else 47) + 3), (64 * 4, 64 * 4)):
            q = torch.randn(2, rows, 4, 128, device=DEV, dtype=torch.bfloat16)
            k = torch.randn(2, krows, 4, 128, device=DEV, dtype=torch.bfloat16)
            for block in (64, 128):
                ref, T = subblock_route_reference(q, k, 0.75, 128 ** -0.5 * 4, n_q, n_k, block)
                for prec in ("tf32x3", "ieee"):
                    got, _ = subblock_route_triton(q, k, 0.75, 128 ** -0.5 * 4, n_q, n_k, block, precision=prec)
                    key = f"{n_q}x{n_k}_{rows}x{krows}_{block}_{prec}"
                    out[key] = int((got != ref).any(-1).sum())
    # exact ties: duplicated key blocks
    k = -torch.ones(1, 64 * 24, 2, 128, device=DEV)
    for j in (3, 10, 15, 20):
        k[:, 64 * j:64 * (j + 1)] = 2.0
    for j in (1, 5, 7, 8, 12, 22):
        k[:, 64 * j:64 * (j + 1)] = 1.0
    q = torch.ones(1, 64 * 3, 2, 128, device=DEV)
    want = torch.tensor([1, 3, 5, 7, 8, 10, 15, 20], dtype=torch.int32, device=DEV).expand(1, 2, 3, 8)
    for prec in ("tf32x3", "ieee"):
        got, _ = subblock_route_triton(q.bfloat16(), k.bfloat16(), 0.7, 0.25 / 8, precision=prec)
        out[f"ties_{prec}"] = bool(torch.equal(got, want))
    return out


def main():
    RESULT["env"] = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (TRITON_INTERPRET)",
                     "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
                     "timing": "CUDA events, median of 7 after 2 warm-up calls"}
    dump()
    S, N, D = (128 + 2 * 207 + 37 * 24 * 42, 56, 128) if DEV == "cuda" else (64 * 9 + 5, 2, 128)
    stage("recompile_check", lambda: recompile_check(S, N, D))
    q, k = structured_qk(S, N, D)
    stage("h3_64_structured", lambda: h3(64, q, k, "structured"))
    stage("sweep_scores_64", lambda: sweep(q, k))
    qr, kr = torch.randn_like(q), torch.randn_like(k)
    stage("h3_64_random", lambda: h3(64, qr, kr, "random"))
    del qr, kr
    stage("h3_128_structured", lambda: h3(128, q, k, "structured"))
    stage("small_parity", small_parity)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    JSON_PATH = p.parse_args().json
    main()
