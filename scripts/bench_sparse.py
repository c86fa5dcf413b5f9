"""Block-sparse attention on one H100 or H200 at MiniMax-H3's shape, in one run (issues 36 and 46).

    python scripts/bench_sparse.py --no-block              # kernels: bench/results/sparse_<card>.json (h100, h200)
    python scripts/bench_sparse.py --rows 'fp8_block|fp8_fa3' --json bench/results/sparse_block_h100.json
    python scripts/bench_sparse.py --tiny --json /tmp/sparse_tiny.json        # CPU, small shape: proves it runs

Shape: 37,838 rows (128 text + 2 x 207 audio + 37 x 24 x 42 video) x 56 heads x 128, bf16, batch 1; CUDA events,
--warmup calls then the median of --iters. Rows, each skipped with its reason where the kernel is not installed:
  cudnn_dense           cuDNN SDPA (h3trt::attention kernel cudnn)
  fa3_bf16_dense        FlashAttention-3 bf16 (h3trt::attention kernel fa3): the anchor every ratio is against
  fp8_{fa3,cudnn}_dense FP8 attention (h3trt::fp8_sdpa) on e4m3 q/k/v with per-tensor scales (v centered as built)
  fa4_dense             FlashAttention-4's dense forward (flash_attn.cute flash_attn_func)
  fa4_sparse_B_S        h3trt::sparse_attention kernel fa4, B-row blocks (64: SubBlock's; 128), sparsity S
  flex_sparse_128_0.75  kernel flex (FlexAttention under torch.compile, 128-row blocks)
  router_B_S            subblock_route (the chunked torch router: the CPU's, and the reference) at that shape,
                        n_q = n_k = 4
  router_B_S_triton     the fused Triton router (the path the DiT calls on CUDA, models/sparse/router_triton.py);
                        router_parity says in how many (head, query block) rows its blocks differ from torch's
  fp8_sparse_B_S[_tile] the Triton FP8 block-sparse kernel, every tile configuration, and the best served one
                        (scripts/bench_sparse_fp8.py says what each row times); `bars` holds issue 46's ratios
  fp8_block_*           the FP8 block with FP8 attention, dense and around the FP8 sparse kernel (--block)
Every sparse row is checked against the masked reference on a few (head, query block) cells, and reports the share
of the softmax mass its kept blocks hold (sampled query rows, exact softmax over every key), for two kinds of q/k:
  random      i.i.d. normal q/k: flat attention, every block holds about the same mass, so no router can do better
              than the kept fraction; a floor, not the real model's number
  structured  smooth low-rank plus noise: q = k = low-frequency position features through a per-head projection
              (attention peaked around each row's own position, sharpness varying by head) + 0.3 noise; closer to
              video attention, still synthetic. Timings use these q/k.
--block (GPU, if the FP8 path builds): one full-width FP8 DiT block (random weights, ModelOpt max calibration on
its own input, bf16 attention) compiled as `h3trt build` compiles it, dense (block segment, fa3) against the split
block (block_pre and block_post segments) around the router the DiT runs there (Triton on CUDA) + fa4 sparse
attention at 0.75 (video query blocks sparse, the rest dense, as the DiT gates them).
first_call_at_new_length_s: each GPU sparse kernel's first call at a second sequence length (does it recompile?).
With --tiny (CPU): the reference, flex (unfused) and fp8_emulated kernels only, perf_counter timings: it checks the
script runs. --rows REGEX runs only the rows whose names match (re.search); every line printed carries the seconds
since the start, and the JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
import traceback
from pathlib import Path

import torch

from bench_common import ROOT, median_ms, write_json  # noqa: E402  (first: it puts this checkout on sys.path)
sys.path.insert(0, str(ROOT / "scripts"))

from h3trt.models.attention import attention, kernel_problem  # noqa: E402
from h3trt.models.sparse.attention import sparse_budget, subblock_route  # noqa: E402
from h3trt.models.sparse.kernels import (fa4_modules, flex_sparse_attention, sparse_attention,  # noqa: E402
                                         sparse_kernel_problem)
from h3trt.models.sparse.router import route_blocks, router_for  # noqa: E402
from h3trt.models.sparse.fp8 import fp8_sparse_attention  # noqa: E402
from bench_sparse_fp8 import fp8_block_rows, fp8_scales, fp8_sparse_rows  # noqa: E402

H3_ROWS, H3_HEADS, H3_DIM = 128 + 2 * 207 + 37 * 24 * 42, 56, 128
T0 = time.perf_counter()


def stamp() -> str:
    return f"[{time.perf_counter() - T0:7.1f} s]"


def card_name(device_name: str) -> str:
    """h100 / h200 / the name's last word, lower case: the result file's suffix."""
    for card in ("h100", "h200", "b200"):
        if card in device_name.lower():
            return card
    return device_name.lower().split()[-1] if device_name else "cpu"


def timer(device, iters: int, warmup: int):
    """Median milliseconds of a call on `device` (bench_common.median_ms)."""
    return lambda fn: median_ms(fn, device, iters, warmup)


def structured_qk(S, N, D, device, dtype, seed=0):
    """q = k = (low-frequency features of the row's position) x (a per-head orthonormal projection) + 0.3 noise, scaled
    so the logit between rows s and s' is beta_h / 8 * sum_f cos(2 pi f (s - s') / S), beta_h in [4, 12]."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(S, dtype=torch.float64) / S
    freqs = torch.arange(1, 9, dtype=torch.float64)
    angle_SF = 2 * math.pi * pos[:, None] * freqs
    phi_SF = torch.cat([torch.sin(angle_SF), torch.cos(angle_SF)], 1)
    beta_N = torch.linspace(4, 12, N, dtype=torch.float64)
    W_NFD = torch.linalg.qr(torch.randn(N, D, 16, generator=g, dtype=torch.float64)).Q.transpose(1, 2)
    amp_N = (beta_N * D ** 0.5 / 8).sqrt()
    base_SND = torch.einsum("sf,nfd->snd", phi_SF, W_NFD) * amp_N[None, :, None]
    q = base_SND + 0.3 * torch.randn(S, N, D, generator=g, dtype=torch.float64)
    k = base_SND + 0.3 * torch.randn(S, N, D, generator=g, dtype=torch.float64)
    return q[None].to(device, dtype), k[None].to(device, dtype)


def kept_mass(q, k, index, block, rows_per_head=64, heads=8, seed=0):
    """Mean over sampled (head, query row) of the softmax mass on the kept key blocks (fp32, every key)."""
    _, S, N, D = q.shape
    g = torch.Generator().manual_seed(seed)
    masses = []
    for n in torch.linspace(0, N - 1, min(heads, N)).round().long().tolist():
        rows = torch.randint(0, S, (rows_per_head,), generator=g).to(q.device)
        p = torch.softmax(q[0, rows, n].float() @ k[0, :, n].float().T * D ** -0.5, -1)  # [r, Sk]
        K = -(-k.shape[1] // block)
        p_block = torch.nn.functional.pad(p, (0, K * block - k.shape[1])).view(len(rows), K, block).sum(-1)
        kept = index[0, n, rows // block].long()  # [r, T]
        masses.append(p_block.gather(1, kept).sum(1))
    return torch.cat(masses).mean().item()


def check_cells(out, q, k, v, index, block, heads=2):
    """Max relative error of `out` against attention over exactly the kept rows, on a few (head, query block)."""
    S = q.shape[1]
    G = -(-S // block)
    errs = []
    for n in range(heads):
        for g in (0, G // 2, G - 1):
            rows = slice(g * block, min(S, (g + 1) * block))
            keys = torch.cat([torch.arange(j * block, min(k.shape[1], (j + 1) * block), device=q.device)
                              for j in index[0, n, g].tolist()])
            ref = torch.softmax(q[0, rows, n].float() @ k[0, keys, n].float().T * q.shape[-1] ** -0.5, -1) \
                @ v[0, keys, n].float()
            errs.append(((out[0, rows, n].float() - ref).norm() / ref.norm()).item())
    return max(errs)


class Rows:
    """The run's result and how a row gets into it: timed (`row`), skipped with why (`skip`), or not selected."""

    def __init__(self, args, result: dict, ms_of):
        self.args, self.result, self.ms_of = args, result, ms_of
        self.ms, self.skipped = result["ms"], result["skipped"]

    def selected(self, name: str) -> bool:
        return self.args.rows is None or re.search(self.args.rows, name) is not None

    def row(self, name, fn):
        if not self.selected(name):
            return
        try:
            self.ms[name] = self.ms_of(fn)
            print(f"{stamp()} {name:36s} {self.ms[name]:9.3f} ms", flush=True)
        except Exception as e:  # one kernel failing is a row of the report, never the end of the run
            self.fail(name, e)
        write_json(self.args.json, self.result)

    def skip(self, name, why):
        self.skipped[name] = why
        print(f"{stamp()} {name:36s} skipped: {why}", flush=True)

    def fail(self, name, e):
        self.skipped[name] = f"{type(e).__name__}: {e}"[:800]
        print(f"{stamp()} {name:36s} failed: {self.skipped[name]}", flush=True)
        traceback.print_exc()


def run(args) -> dict:
    device = torch.device("cpu" if args.tiny else "cuda")
    S, N, D = (64 * 40 + 13, 4, 32) if args.tiny else (H3_ROWS, H3_HEADS, H3_DIM)
    dtype = torch.bfloat16
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    if args.json is None:
        args.json = ROOT / "bench" / "results" / f"sparse_{card_name(name)}.json"
    result = {"env": {"device": name, "card": card_name(name), "torch": torch.__version__, "cuda": torch.version.cuda,
                      "shape": {"rows": S, "heads": N, "head_dim": D, "batch": 1}, "dtype": str(dtype),
                      "iters": args.iters, "warmup": args.warmup, "rows": args.rows,
                      "timing": "CUDA events, median" if device.type == "cuda" else "perf_counter, median (CPU)"},
              "ms": {}, "skipped": {}, "rel_err_vs_masked_reference": {}, "kept_mass": {}, "kept_blocks": {},
              "notes": [], "finished": False}
    rows = Rows(args, result, timer(device, args.iters, args.warmup))
    print(f"{stamp()} {name}: {S} rows x {N} heads x {D}, writing {args.json}", flush=True)
    q, k = structured_qk(S, N, D, device, dtype)
    v = torch.randn(1, S, N, D, device=device, dtype=dtype)
    _dense_rows(rows, q, k, v, device)
    configs = [(64, 0.75), (64, 0.80), (128, 0.75), (128, 0.80)]
    plans = _routing(rows, q, k, configs, device)
    all_sparse = {block: torch.ones(-(-S // block), dtype=torch.bool, device=device) for block in (64, 128)}
    _sparse_kernel_rows(rows, q, k, v, configs, plans, all_sparse, device)
    best = {}
    if device.type == "cuda":
        best = fp8_sparse_rows(result, rows.row, rows.skip, rows.selected, q, k, v, plans, all_sparse, check_cells,
                               configs)
    else:  # the CPU's FP8 sparse kernel: the emulation (scripts/bench_sparse_fp8.py's scales)
        scales = fp8_scales(q, k, v)
        rows.row("fp8_emulated_sparse_64_0.75", lambda: fp8_sparse_attention(
            q, k, v, scales, plans[64, 0.75], all_sparse[64], 64, "fp8_emulated"))
    if args.block and device.type == "cuda":
        for fn, names in ((lambda: _fp8_block_rows(result, rows.ms_of, rows.row), ("fp8_block_dense_fa3",)),
                          (lambda: fp8_block_rows(result, rows.row, best.get((64, 0.75), args.fp8_tile)),
                           ("fp8_block_dense_fp8attn_fa3", "fp8_block_sparse_fp8_64_0.75"))):
            if any(rows.selected(n) for n in names):
                try:
                    fn()
                except Exception as e:
                    rows.fail(names[0], e)
    _summary(result)
    result["finished"] = True
    write_json(args.json, result)
    print(f"{stamp()} done: {args.json}", flush=True)
    return result


def _dense_rows(rows, q, k, v, device):
    """1. dense kernels: the anchors every ratio is against."""
    if device.type != "cuda":
        rows.row("sdpa_dense", lambda: attention(q, k, v, "sdpa"))
        _fp8_rows(q, k, v, device, rows.row, rows.skip, kernels=("fa3", "emulated"))  # the CPU's: emulated
        return
    for kernel in ("cudnn", "fa3"):
        problem = kernel_problem(kernel, "bf16", device)
        name = "cudnn_dense" if kernel == "cudnn" else "fa3_bf16_dense"
        if problem:
            rows.skip(name, problem)
        else:
            rows.row(name, lambda kernel=kernel: attention(q, k, v, kernel))
    _fp8_rows(q, k, v, device, rows.row, rows.skip)
    if rows.selected("fa4_dense"):
        try:
            interface, _ = fa4_modules()
            rows.row("fa4_dense", lambda: interface.flash_attn_func(q, k, v))
        except Exception as e:
            rows.skip("fa4_dense", f"{type(e).__name__}: {e}")


def _routing(rows, q, k, configs, device) -> dict:
    """2. routing, its cost and its kept mass: the index every sparse row runs over, by (block, sparsity)."""
    result, D = rows.result, q.shape[-1]
    q_rand, k_rand = torch.randn_like(q), torch.randn_like(k)
    plans = {}
    for block, sparsity in configs:
        tag = f"{block}_{sparsity:.2f}"
        index, topk = subblock_route(q, k, sparsity, D ** -0.5, block=block)
        rand_index, _ = subblock_route(q_rand, k_rand, sparsity, D ** -0.5, block=block)
        plans[block, sparsity] = index
        K = -(-q.shape[1] // block)
        result["kept_blocks"][tag] = {"topk": topk, "of": K, "kept_fraction": topk / K,
                                      "budget": sparse_budget(K, sparsity)}
        result["kept_mass"][tag] = {"structured": kept_mass(q, k, index, block),
                                    "random": kept_mass(q_rand, k_rand, rand_index, block)}
        print(f"{stamp()} routing {tag}: {topk}/{K} blocks kept, softmax mass kept {result['kept_mass'][tag]}",
              flush=True)
        if sparsity == 0.75:
            rows.row(f"router_{tag}", lambda block=block: subblock_route(q, k, 0.75, D ** -0.5, block=block))
            if device.type == "cuda" and rows.selected(f"router_{tag}_triton"):
                _triton_router_row(result, rows.row, rows.skip, q, k, index, tag, block)
    return plans


def _sparse_kernel_rows(rows, q, k, v, configs, plans, all_sparse, device):
    """3. the bf16 sparse kernels over the router's index (fa4, flex; the reference and flex unfused on the CPU)."""
    kernels = [("fa4", block, sparsity) for block, sparsity in configs] + [("flex", 128, 0.75)]
    if device.type != "cuda":
        kernels = [("reference", 64, 0.75), ("reference", 128, 0.75), ("flex_unfused", 128, 0.75)]
    for kernel, block, sparsity in kernels:
        name = f"{kernel}_sparse_{block}_{sparsity:.2f}"
        if not rows.selected(name):
            continue
        index, sparse_G = plans[block, sparsity], all_sparse[block]
        if kernel == "flex_unfused":  # CPU only: flex's eager implementation (the fused kernel needs CUDA)
            def call(index=index, sparse_G=sparse_G, block=block):
                return flex_sparse_attention(q, k, v, index, sparse_G, block, compiled=False)
        else:
            problem = sparse_kernel_problem(kernel, device)
            if problem:
                rows.skip(name, problem)
                continue

            def call(index=index, sparse_G=sparse_G, block=block, kernel=kernel):
                return sparse_attention(q, k, v, index, sparse_G, block, kernel)
        try:
            t0 = time.perf_counter()
            out = call()  # the first call compiles (CuTe JIT, Inductor): timed apart
            if device.type == "cuda":
                torch.cuda.synchronize()
            rows.result.setdefault("first_call_s", {})[name] = time.perf_counter() - t0
            rows.result["rel_err_vs_masked_reference"][name] = check_cells(out, q, k, v, index, block)
            del out
        except Exception as e:
            rows.fail(name, e)
            continue
        rows.row(name, call)
        if device.type == "cuda" and name in rows.ms:
            _new_length_first_call(rows.result, name, q, k, v, block, sparsity, kernel)


# Issue 46's bars: (row, anchor row, the most the ratio row / anchor may be).
BARS = (("fp8_sparse_64_0.75", "fp8_fa3_dense", 0.33), ("fp8_sparse_128_0.75", "fp8_fa3_dense", 0.25),
        ("fp8_block_sparse_fp8_64_0.75", "fp8_block_dense_fp8attn_fa3", 1 / 1.5))


def _summary(result) -> None:
    """Ratios against the anchors, the router's share, and issue 46's bars (met or not, with the numbers)."""
    ms = result["ms"]
    anchor = "fa3_bf16_dense" if "fa3_bf16_dense" in ms else next(iter(ms), None)
    result["ratio_anchor"] = anchor
    if anchor:
        result["speedup_vs_anchor"] = {name: ms[anchor] / t for name, t in ms.items() if not name.startswith("router")}
        result["notes"].append(f"speedup_vs_anchor: {anchor} ms / row ms (>1 faster).")
    for name in [n for n in ms if n.startswith("router_")]:
        block = name.split("_")[1]
        sparse = f"fa4_sparse_{block}_0.75"
        if sparse in ms:
            result.setdefault("router_share_of_sparse_attention", {})[name] = ms[name] / (ms[name] + ms[sparse])
        for blk in ("fp8_block_sparse_fa4_64_0.75", "fp8_block_sparse_fp8_64_0.75"):
            if blk in ms and block == "64":  # the bar: <= 2% of a sparse block
                result.setdefault("router_share_of_fp8_sparse_block", {})[f"{name}/{blk}"] = ms[name] / ms[blk]
    for name, base, most in BARS:
        if name in ms and base in ms:
            result.setdefault("bars", {})[name] = {"ratio": ms[name] / ms[base], "vs": base, "bar": most,
                                                   "met": ms[name] / ms[base] <= most}
    result["notes"].append("kept_mass 'random': i.i.d. q/k (flat attention: mass ~ kept fraction); 'structured': "
                           "smooth low-rank q = k plus noise (synthetic; not the real model's attention).")


def _triton_router_row(result, row, skip, q, k, torch_index, tag, block):
    """The fused router's time at this shape, and the rows where its blocks differ from the torch router's (a
    difference can only be a near-tie at the threshold: scores within a few fp32 ulp)."""
    name = f"router_{tag}_triton"
    try:
        router_for(q.device)
        index, _ = route_blocks(q, k, 0.75, q.shape[-1] ** -0.5, "triton", block=block)
    except Exception as e:
        skip(name, f"{type(e).__name__}: {e}"[:800])
        return
    differ = (index != torch_index).any(-1)
    result.setdefault("router_parity", {})[name] = {"rows_differing_from_torch": int(differ.sum()),
                                                   "rows": differ.numel()}
    row(name, lambda: route_blocks(q, k, 0.75, q.shape[-1] ** -0.5, "triton", block=block))


def _new_length_first_call(result, name, q, k, v, block, sparsity, kernel):
    """The first call at another sequence length (S - 4,999 rows), after the kernel ran at S: about the steady time
    means the compiled kernel serves any length; seconds mean it compiles per length (then the load's warm-up cannot
    cover every request, and the DiT must pad to a fixed set of lengths)."""
    rows = q.shape[1] - 4999
    q2, k2, v2 = (t[:, :rows].contiguous() for t in (q, k, v))
    index, _ = subblock_route(q2, k2, sparsity, q.shape[-1] ** -0.5, block=block)
    sparse_G = torch.ones(-(-rows // block), dtype=torch.bool, device=q.device)
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sparse_attention(q2, k2, v2, index, sparse_G, block, kernel)
        torch.cuda.synchronize()
        result.setdefault("first_call_at_new_length_s", {})[name] = time.perf_counter() - t0
    except Exception as e:
        result.setdefault("first_call_at_new_length_s", {})[name] = f"{type(e).__name__}: {e}"[:400]


def _fp8_rows(q, k, v, device, row, skip, kernels=("fa3", "cudnn")):
    from h3trt.calibration.formats import FP8_MAX
    from h3trt.calibration.fp8_attention import center_rows, fp8_sdpa

    v_centered, _ = center_rows(v)
    scales = [(t.float().abs().amax() / FP8_MAX).reshape(1) for t in (q, k, v_centered)]
    q8, k8, v8 = ((t.float() / s).to(torch.float8_e4m3fn) for t, s in zip((q, k, v_centered), scales))
    for kernel in kernels:
        problem = kernel_problem(kernel, "fp8", device)
        if problem:
            skip(f"fp8_{kernel}_dense", problem)
        else:
            row(f"fp8_{kernel}_dense", lambda kernel=kernel: fp8_sdpa(q8, k8, v8, *scales, kernel))


def _fp8_block_rows(result, ms_of, row):
    """One full-width FP8 block: the block segment with dense fa3 attention, against block_pre + router + fa4 sparse
    attention (video query blocks sparse) + block_post, all compiled as `h3trt build` compiles them."""
    from bench_common import rel_err
    from bench_dit import block_pair, layout
    from bench_fp8 import compiled, quantized_copy

    from h3trt.build.segments import block_post_segment, block_pre_segment, block_segment
    from h3trt.calibration.recipe import QuantRecipe
    from h3trt.models.config import H3Config

    dev, cfg, lay = "cuda", H3Config(), layout()
    problem = kernel_problem("fa3", "bf16", torch.device(dev)) or sparse_kernel_problem("fa4", torch.device(dev))
    if problem:
        result["skipped"]["fp8_block"] = problem
        return
    ref, ours, x, temb, idx, pos, mod, (cos, sin) = block_pair(cfg, lay, dev)
    del ref
    recipe = QuantRecipe("fp8", calib_steps=2)
    with torch.no_grad():
        block = quantized_copy(ours, cfg, recipe, x, mod, idx, (cos, sin))
        tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}

        def segment(spec, acts):
            seg, _ = compiled(spec, [*acts, *[tensors[n].detach() for n in spec.weights]], dev)
            return seg, [tensors[n].detach() for n in spec.weights]

        dense, w = segment(block_segment(cfg, torch.bfloat16, recipe, attention="fa3"), [x, mod, idx, cos, sin])
        row("fp8_block_dense_fa3", lambda: dense(x, mod, idx, cos, sin, *w))
        (want,) = dense(x, mod, idx, cos, sin, *w)
        pre, w_pre = segment(block_pre_segment(cfg, torch.bfloat16, 1, recipe), [x, mod, idx, cos, sin])
        (qkv,) = pre(x, mod, idx, cos, sin, *w_pre)  # [sp=1, 3, B, S, N, D]
        post_spec = block_post_segment(cfg, torch.bfloat16, recipe)
        post, w_post = segment(post_spec, [x, qkv[:, 0], mod, idx])
        video = torch.zeros(lay.seq_len, dtype=torch.bool)
        video[lay.video_index.long()] = True
        G = -(-lay.seq_len // 64)
        sparse_G = torch.nn.functional.pad(video, (0, G * 64 - lay.seq_len)).view(G, 64).all(1).to(dev)
        result["fp8_block_sparse_query_blocks"] = f"{int(sparse_G.sum())} of {G}"
        scale = cfg.head_dim ** -0.5

        def split(sparse: bool):
            (qkv,) = pre(x, mod, idx, cos, sin, *w_pre)
            q, k, v = qkv[0, 0], qkv[0, 1], qkv[0, 2]
            if sparse:
                index, _ = route_blocks(q, k, 0.75, scale, router_for(q.device))
                out = sparse_attention(q, k, v, index, sparse_G, 64, "fa4")
            else:
                out = attention(q, k, v, "fa3")
            (y,) = post(x, out[None], mod, idx, *w_post)
            return y

        row("fp8_block_split_dense_fa3", lambda: split(False))
        row("fp8_block_sparse_fa4_64_0.75", lambda: split(True))
        result["fp8_block_sparse_update_rel_err_vs_dense"] = rel_err(split(True).float() - x.float(),
                                                                     want.float() - x.float())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None,
                   help="write the results here (default: bench/results/sparse_<card>.json)")
    p.add_argument("--tiny", action="store_true", help="CPU, small shape, reference/flex only (checks the script)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per row (default 7; 3 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; 1 with --tiny)")
    p.add_argument("--no-block", dest="block", action="store_false", help="skip the FP8 DiT block rows")
    p.add_argument("--rows", default=None, metavar="REGEX", help="run only the rows whose names match (re.search)")
    p.add_argument("--fp8-tile", default=None, metavar="TILE", help="the FP8 sparse kernel's tile in the block rows "
                                                                   "when this run times no 64-row tile (default: the "
                                                                   "first listed, or this run's fastest)")
    args = p.parse_args()
    args.iters = args.iters or (3 if args.tiny else 7)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
