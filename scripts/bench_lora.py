"""Per-request LoRA adapters on one H100/H200 (issues 38 and 44): what a bundle's adapter slots cost per block, the
old arithmetic against the new, and what loading and switching adapters cost, in one run, against the Diffusers
reference block of the same run.

    python scripts/bench_lora.py --quick --json $OUT/lora_h100.json        # one H100: both precisions, ~2.5 min
    python scripts/bench_lora.py --json $OUT/lora_h100.json                # 4 layers, 7 rounds: ~3-4 min
    python scripts/bench_lora.py --tiny --device cpu --json /tmp/bench_lora_cpu.json   # checks the script (CPU)

On the GPU image, carry .whl/site.tar.xz (scripts/make_gpu_site.sh): ModelOpt for the FP8 scales, fa3-fwd and the
cuDNN frontend for FP8 attention, diffusers for the reference (without it the h3trt eager block is the reference, and
the JSON's `reference` says so). Durations are estimates from the full-width compile times of earlier runs (8-14 s a
block segment on the H200) until a GPU has run this version; every phase prints its start with the elapsed time and
is bounded by --phase-timeout, and the JSON is rewritten after every phase.

Shape: MiniMax-H3 at full width (hidden 5376, 56 heads x 128, SwiGLU 14336), random bf16 weights (std 0.02), 37,838
rows (128 text + 2 x 207 audio + 37 x 24 x 42 video); --tiny: H3Config.tiny() over a 114-row sequence.

Per precision (--precision; fp8 is the headline bundle's recipe: W8A8 e4m3 block linears with static per-tensor
scales from ModelOpt's max calibration on the layer's input, fast accumulation, FP8 attention; --no-fp8-attention
keeps attention in bf16) the `block` segment and two twins with adapters are made by the builder's own functions
(build/segments.py block_segment, block_lora_segment over adapters/slots.py BLOCK_TARGETS, as `h3trt build
--lora-slots N --lora-max-rank R` makes them; example inputs by build/examples.py lora_examples): `block_lora` in the
FUSED layout (the build's: the rank rows merged into a bf16 weight for the call, or inside an FP8 linear's one GEMM)
and `block_lora_delta` in the DELTA layout (the side branch beside the base linear, the arithmetic before issue 44).
Compiled by build/backends.py compile_segment (torch.export, Inductor standalone_compile, saved, loaded) and served by
the bundle's own runner, engines/bundle.py EngineDiT, over --layers layers, each with its own weights and slot banks.
The runner's embed and final are stand-ins that hand back precomputed tensors (they cost the same with and without
adapters), so a row is the runner's block stack: AdaLN tables, RoPE, dispatch, every layer. Rows, ms per block (the
stack's median over --iters rounds after --warmup, each round timing every row once in turn, CUDA events; divided by
--layers), with N = --slots slots of max rank R = --rank and rank-R adapters on every attention and MLP linear:
  no_slots            EngineDiT without slots: the bundle built without --lora-slots (the base of every ratio)
  slots_no_adapter    with slots, an evaluation without adapters: the runner runs `block` (bar: <= 1.01x)
  slots_scale0        an adapter named at scale 0: not computed (`select` gives None), the runner runs `block`
  slots_one_adapter   one adapter, FUSED (the build's layout; bar: <= 1.05x)
  slots_two_adapters  two adapters in one evaluation, FUSED
  delta_one_adapter   one adapter, DELTA, over its own rank rows: the layout alone, against slots_one_adapter
  old_one_adapter     one adapter, DELTA over every row of every slot (N x R, the others at scale 0): the arithmetic
                      and cost before issue 44 (its 1.094x fp8 / 1.105x bf16 on the H100)
  old_scale0          DELTA over every row at scale 0: what an adapter at scale 0 cost before issue 44
Errors, of the block stack's update (output - input) on random weights: numerical distances, not picture quality:
  update_rel_err_vs_eager          each compiled row against the eager stack of the same arithmetic (the compile's)
  fused_adapter_part_rel_err_vs_bf16_adapter   eager FUSED against eager DELTA (the bf16 side branch beside the
                                   precision's base), on the adapter's own part (with - without): in fp8 the error of
                                   the quantized adapter path (e4m3 rows in the base's GEMM), in bf16 the merged
                                   weight's rounding (fused_update_...: the same on the whole update)
  adapter_moves_the_update_rel     how far the adapter moves the update (at --tiny the rank-64 adapter dwarfs the
                                   64-wide model's update and the residual's rounding: its errors say nothing)
Per step: ms per block x num_layers (50): H3 runs one DiT evaluation per step (CFG-distilled); embed and final are
left out. Against the reference: the Diffusers MiniMaxH3TransformerBlock, eager, bf16, default SDPA, one block.

Loading and switching (scripts/bench_lora_load.py): two full-size rank-R adapter files (0.6 GB at rank 64) read and
loaded (its rows: the one-pass read+hash floor, read_lora, AdapterSlots.read onto the device, the load of a read file,
the load from the path; bar: load_from_path <= read_lora), then under engines/guard.py no_compile on the first
precision's FUSED runner: `select`, the evaluation after switching between resident slots, and after loading the
second adapter into the slot the first held (its output equal to the other slot's: the new data reached the compiled
code, no compile).

--quick: --layers 2 --iters 3 --warmup 1 --load-repeats 1 (the same rows, fewer rounds). Estimated on one H100: ~20 s
of imports, ~15 s of set-up and adapter files, per precision ~40 s compiling three segments and ~20 s of
calibration, timing and references: about 2.5 minutes; `--precision fp8` alone about 1.5.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench_common import ROOT, device_name, median_ms, peak_gib, rel_err, write_json  # noqa: E402  (first)

sys.path.insert(0, str(ROOT / "scripts"))

from bench_lora_load import ADAPTED, load_adapters, switching, timed_s  # noqa: E402
from bench_lora_setup import (Inputs, attention_kernels, block_tensors, layer_blocks, make_inputs,  # noqa: E402
                              random_blocks, recipe_for, reference, shape_of, versions)
from h3trt.adapters.slots import BLOCK_TARGETS, DELTA, FUSED, AdapterRun, AdapterSlots, row_groups  # noqa: E402
from h3trt.engines.bundle import EngineDiT  # noqa: E402
from h3trt.engines.guard import no_compile  # noqa: E402
from h3trt.models.config import NUM_MODALITIES, H3Config  # noqa: E402
from h3trt.models.runner import EvalExtras  # noqa: E402

BF16 = torch.bfloat16
BARS = {"slots_no_adapter": 1.01, "slots_one_adapter": 1.05}  # issues 38/44: at most 1% / 5% slower than no_slots
TWINS = {"block_lora": FUSED, "block_lora_delta": DELTA}  # the compiled twins with adapters, by layout
COMPILED = ("block, block_lora (FUSED) and block_lora_delta (DELTA) from build/segments.py block_segment / "
            "block_lora_segment, example inputs from build/examples.py lora_examples, compiled by "
            "build/backends.py compile_segment('inductor') -> compile_inductor (torch.export with symbolic row and "
            "rank-row counts, Inductor standalone_compile with the build's INDUCTOR_OPTIONS, saved), loaded by "
            "engines/loaders.py load_segment and served by engines/bundle.py EngineDiT; the AdaLN adapter is the "
            "runner's eager side branch (the segment never takes it)")
CPU_NOTE = ("CPU run at the tiny shape: it checks that the script runs end to end; its timings are not performance "
            "claims.")
RANDOM_NOTE = ("errors are on random weights: numerical distances between compiled and eager arithmetic, not picture "
               "quality")
STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


@contextlib.contextmanager
def phase(name: str, seconds: int):
    """A phase of the run, announced with the elapsed time and bounded: TimeoutError after `seconds` (SIGALRM; the
    main thread's Python code, between kernels)."""
    def expired(*_):
        raise TimeoutError(f"phase {name!r} ran past --phase-timeout {seconds} s")

    log(f"{name} ...")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def compile_segments(cfg: H3Config, recipe, dense_kernel: str, layers: list, inp: Inputs, slots: AdapterSlots,
                     work: Path, dev: torch.device) -> tuple[dict, dict, dict]:
    """`block` and its twins with adapters compiled as `h3trt build --lora-slots N --lora-max-rank R` compiles them
    (TWINS: the build's FUSED, and DELTA for the comparison): ({name: spec}, {name: loaded segment},
    {name: compile + load seconds})."""
    from h3trt.build.backends import compile_segment
    from h3trt.build.examples import lora_examples
    from h3trt.build.segments import block_lora_segment, block_segment
    from h3trt.engines.loaders import load_segment
    from h3trt.engines.manifest import AdapterSlotsRecord

    plain = block_segment(cfg, BF16, recipe, attention=dense_kernel)
    specs = {"block": plain}
    for name, layout in TWINS.items():
        twin = block_lora_segment(plain, cfg, BF16, recipe, dense_kernel, slots.targets, layout)
        specs[name] = dataclasses.replace(twin, name=name)
    tensors = block_tensors(layers[0])
    example = [inp.x, layers[0].modulation(inp.temb).contiguous(), inp.adaln_index, *inp.rope,
               *[tensors[n] for n in plain.weights]]
    record = AdapterSlotsRecord(slots.num_slots, slots.max_rank, slots.targets)
    g = torch.Generator().manual_seed(0)
    twin_example = lora_examples(example, specs["block_lora"], cfg, record, g)
    (work / "segments").mkdir(parents=True, exist_ok=True)
    segments, seconds = {}, {}
    for name, spec in specs.items():
        t0 = time.perf_counter()
        entry = compile_segment("inductor", spec, example if name == "block" else twin_example, work / "segments")
        segments[name] = load_segment("inductor", {"name": name, **entry}, work, dev)
        seconds[name] = round(time.perf_counter() - t0, 2)
        log(f"compiled {name} in {seconds[name]:.1f} s")
    return specs, segments, seconds


def engine(cfg_l: H3Config, specs: dict, segments: dict, layers: list, inp: Inputs, dev: torch.device,
           slots: AdapterSlots | None, twin: str = "block_lora") -> EngineDiT:
    """The bundle's runner over `layers` (their own weights, AdaLN tables baked from their own projections), with
    stand-ins for embed (hands back x and temb) and final (hands back x); with `slots`, the bundle built with them,
    its block_lora being the compiled `twin`."""
    from h3trt.engines.adaln import BakedAdaLN
    from h3trt.engines.loaders import LoadedSegment

    T = inp.unique_t.numel()
    tables = {f"blocks.{i}": b.modulation(inp.temb).view(T, NUM_MODALITIES, -1, cfg_l.hidden_size)
              for i, b in enumerate(layers)}
    tables.update(timesteps=inp.unique_t.cpu(), final=torch.zeros(T, 2, cfg_l.hidden_size, dtype=BF16, device=dev))
    x, temb = inp.x, inp.temb
    stand_ins = {"embed": LoadedSegment("embed", lambda *_: (x, temb)),
                 "final": LoadedSegment("final", lambda x_out, *_: (x_out,))}
    entries = {"embed": {"weights": []}, "final": {"weights": []}, "block": {"weights": specs["block"].weights}}
    weights = {"embed": {}, "final": {}, "blocks": {f"blocks.{i}.{n}": t for i, b in enumerate(layers)
                                                    for n, t in block_tensors(b).items()}}
    runners = {"block": segments["block"]}
    if slots is not None:
        spec = specs[twin]
        entries["block_lora"] = {"inputs": spec.inputs, "weights": spec.weights, "lora": spec.lora}
        runners["block_lora"] = segments[twin]
    return EngineDiT(cfg_l, {**stand_ins, **runners}, entries, weights, BakedAdaLN(tables, dev), dev,
                     lora_slots=slots)


def evaluate(dit: EngineDiT, inp: Inputs, adapters=None) -> torch.Tensor:
    """One evaluation's block stack through EngineDiT.__call__ (embed and final are the stand-ins)."""
    (x,) = dit(None, None, None, inp.unique_t, inp.t_index, inp.layout, EvalExtras(adapters=adapters))
    return x


def eager_stack(layers: list, recipe, kernels: dict, inp: Inputs, run: AdapterRun | None,
                layout: str = DELTA) -> torch.Tensor:
    """The same layers eager (models/dit.py Block with the recipe's modules), the adapters of `run` on every linear
    (in `layout`; DELTA: the bf16 side branch beside the base) and on the AdaLN projection as the eager DiT applies
    them: the runner's reference."""
    from h3trt.calibration.modules import ATTENTION_SCALES, attention_fn

    fp8_attention = recipe is not None and recipe.fp8_attention
    kernel = recipe.attention_kernel if fp8_attention else kernels["bf16"].kernel
    x = inp.x
    for i, block in enumerate(layers):
        lora = run.block(i, layout) if run is not None else None
        scales = {n: getattr(block.attn, n) for n in ATTENTION_SCALES} if fp8_attention else None
        x = block(x, block.modulation(inp.temb, lora).contiguous(), inp.adaln_index, inp.rope,
                  attention_fn(scales, kernel), lora)
    return x


def padded_run(slots: AdapterSlots, scale: float) -> AdapterRun:
    """The rows an evaluation carried before issue 44: every row of every slot (K = N entries of max rank R), slot 0
    at `scale` and the others at 0 (the padding the old arithmetic computed)."""
    rows = list(range(slots.num_slots * slots.max_rank))
    scales = [scale] * slots.max_rank + [0.0] * (len(rows) - slots.max_rank)
    return AdapterRun(slots.by_block, *row_groups(rows, scales, slots.device), ((0, scale),))


def timed_rows(slots: AdapterSlots) -> dict[str, tuple[str | None, object]]:
    """Row -> (runner: None for the one without slots, else its twin; the evaluation's adapters)."""
    rows = {"no_slots": (None, None), "slots_no_adapter": ("block_lora", None),
            "slots_scale0": ("block_lora", slots.select([(0, 0.0)])),
            "slots_one_adapter": ("block_lora", slots.select([(0, 1.0)]))}
    if slots.num_slots > 1:
        rows["slots_two_adapters"] = ("block_lora", slots.select([(0, 1.0), (1, 1.0)]))
    rows.update(delta_one_adapter=("block_lora_delta", slots.select([(0, 1.0)])),
                old_one_adapter=("block_lora_delta", padded_run(slots, 1.0)),
                old_scale0=("block_lora_delta", padded_run(slots, 0.0)))
    return rows


def stack_errors(got: dict, want: dict, x: torch.Tensor) -> dict:
    """The compiled rows against the eager stacks of the same arithmetic (the compile's own error), and the FUSED
    layout's adapter part against the DELTA one's, both eager (the layout's own error: in fp8 the quantized adapter
    path against the bf16 adapter), on the update (output - input): the residual alone would hide the error."""
    def update(y):
        return y.float() - x.float()

    def part(y, base):
        return y.float() - base.float()

    return {"update_rel_err_vs_eager": {
                "slots_no_adapter": rel_err(update(got["slots_no_adapter"]), update(want["none"])),
                "slots_one_adapter": rel_err(update(got["slots_one_adapter"]), update(want[FUSED])),
                "delta_one_adapter": rel_err(update(got["delta_one_adapter"]), update(want[DELTA]))},
            "fused_adapter_part_rel_err_vs_bf16_adapter": rel_err(part(want[FUSED], want["none"]),
                                                                  part(want[DELTA], want["none"])),
            "fused_update_rel_err_vs_bf16_adapter": rel_err(update(want[FUSED]), update(want[DELTA])),
            "adapter_moves_the_update_rel": rel_err(update(want[DELTA]), update(want["none"])),
            "scale0_equals_no_adapter_bit_for_bit": torch.equal(got["slots_scale0"], got["slots_no_adapter"]),
            "note": RANDOM_NOTE}


def precision_rows(precision: str, ctx: dict) -> tuple[dict, EngineDiT]:
    """One precision's compiled segments, its timed rows and their errors against the eager layers; and its FUSED
    runner with slots."""
    args, cfg, inp, dev, slots, kernels = (ctx[k] for k in ("args", "cfg", "inp", "dev", "slots", "kernels"))
    recipe = recipe_for(precision, args, kernels)
    with phase(f"{precision}: calibrating {len(ctx['blocks'])} layers", args.phase_timeout):
        t0 = time.perf_counter()
        layers = layer_blocks(ctx["blocks"], cfg, recipe, inp)
    out = {"recipe": recipe.to_dict() if recipe else "bf16 (no quantization)",
           "calibration_s": round(time.perf_counter() - t0, 2),
           "attention_kernel": recipe.attention_kernel if recipe and recipe.fp8_attention else kernels["bf16"].kernel}
    with phase(f"{precision}: compiling block and its twins {list(TWINS)}", args.phase_timeout):
        specs, segments, out["compile_s"] = compile_segments(cfg, recipe, kernels["bf16"].kernel, layers, inp, slots,
                                                             ctx["work"] / precision, dev)
    cfg_l = dataclasses.replace(cfg, num_layers=len(layers))
    runners = {None: engine(cfg_l, specs, segments, layers, inp, dev, None),
               **{twin: engine(cfg_l, specs, segments, layers, inp, dev, slots, twin) for twin in TWINS}}
    rows = timed_rows(slots)
    calls = {row: (lambda r=runner, u=run: evaluate(runners[r], inp, u)) for row, (runner, run) in rows.items()}
    with phase(f"{precision}: timing {len(calls)} rows", args.phase_timeout), no_compile():
        ms = out["ms_per_block"] = {row: t / len(layers) for row, t in
                                    interleaved_ms(calls, dev, args.iters, args.warmup).items()}
        for row, t in ms.items():
            print(f"  {precision} {row:19s} {t:9.3f} ms per block", flush=True)
        got = {row: call() for row, call in calls.items()}
    with phase(f"{precision}: eager references", args.phase_timeout):
        one = slots.select([(0, 1.0)])
        want = {"none": eager_stack(layers, recipe, kernels, inp, None),
                **{layout: eager_stack(layers, recipe, kernels, inp, one, layout) for layout in (FUSED, DELTA)}}
    out.update(stack_errors(got, want, inp.x))
    return out, runners["block_lora"]


def interleaved_ms(calls: dict, dev: torch.device, iters: int, warmup: int) -> dict[str, float]:
    """Median ms of each call over `iters` rounds, every round timing each call once in turn (CUDA events on a GPU,
    the wall clock on the CPU), after `warmup` rounds: a drift of the machine (clocks, heat, another process) spreads
    over every row instead of landing on whichever ran first, which a 1% bar cannot afford."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    times = {row: [] for row in calls}
    for _ in range(iters):
        for row, call in calls.items():
            if dev.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(dev)
                start.record()
                call()
                end.record()
                torch.cuda.synchronize(dev)
                times[row].append(start.elapsed_time(end))
            else:
                times[row].append(timed_s(call, dev)[1] * 1e3)
    return {row: statistics.median(t) for row, t in times.items()}


def summarise(rows: dict, layers_per_step: int, reference_ms: float) -> dict:
    """Ratios to no_slots (the bars), the per-step estimate (ms per block x layers) and the speed-up over the
    reference block."""
    ms = rows["ms_per_block"]
    base = ms["no_slots"]
    ratios = {row: t / base for row, t in ms.items()}
    return {"ratio_to_no_slots": ratios,
            "bars": {row: {"ratio": ratios[row], "at_most": bar, "met": ratios[row] <= bar}
                     for row, bar in BARS.items() if row in ratios},
            "ms_per_step_estimate": {row: t * layers_per_step for row, t in ms.items()},
            "speedup_vs_reference": {row: reference_ms / t for row, t in ms.items()}}


def print_table(result: dict) -> None:
    ref = result["reference"]
    if result.get("note"):
        print(f"\n{result['note']}")
    print(f"\n{result['env']['device']}: reference {ref['name']} {ref['ms']:.3f} ms per block; "
          f"x{result['shape']['layers_per_step']} per step", flush=True)
    print(f"{'precision':9s} {'row':19s} {'ms/block':>10s} {'vs no_slots':>11s} {'s/step est.':>11s} {'vs ref':>7s}")
    for precision, rows in result["precisions"].items():
        for row, t in rows["ms_per_block"].items():
            bar = rows["bars"].get(row)
            mark = f"  bar <= {bar['at_most']:.2f}: {'met' if bar['met'] else 'MISSED'}" if bar else ""
            print(f"{precision:9s} {row:19s} {t:10.3f} {rows['ratio_to_no_slots'][row]:10.4f}x "
                  f"{rows['ms_per_step_estimate'][row] / 1e3:11.3f} {rows['speedup_vs_reference'][row]:6.3f}x{mark}")
        print(f"{precision:9s} FUSED against the bf16 adapter (eager): adapter's part "
              f"{rows['fused_adapter_part_rel_err_vs_bf16_adapter']:.4f}, update "
              f"{rows['fused_update_rel_err_vs_bf16_adapter']:.4f} (relative; the adapter moves the update by "
              f"{rows['adapter_moves_the_update_rel']:.3f}; {RANDOM_NOTE})", flush=True)
    load = result.get("adapter_load", {})
    if load.get("median_s"):
        print(f"adapter ({load['file_bytes'] / 1e6:.0f} MB): " +
              ", ".join(f"{k} {v:.3f} s" for k, v in load["median_s"].items()) +
              (f"; bar load_from_path <= read_lora: {'met' if load['bar']['met'] else 'MISSED'}"
               if "bar" in load else ""), flush=True)
    sw = result.get("switching")
    if sw:
        print(f"switching ({sw['precision']}): select {sw['select_ms']:.3f} ms; evaluation "
              f"{sw['steady_evaluation_ms']:.1f} ms steady, {sw['first_evaluation_after_loading_ms']:.1f} ms first "
              f"after loading into a used slot ({sw['load_b_into_used_slot_0_s']:.3f} s, no compile); the reload "
              f"reached the compiled code: {sw['reload_changed_the_output']}", flush=True)
    for precision, why in result.get("failed", {}).items():
        print(f"{precision}: FAILED {why}", flush=True)


def header(args, cfg: H3Config, layout, inp: Inputs, layers: int, dev: torch.device) -> dict:
    return {"env": {"device": device_name(dev), "torch": torch.__version__, "cuda": torch.version.cuda,
                    "cudnn": torch.backends.cudnn.version() if dev.type == "cuda" else None, **versions(),
                    "timing": f"median of {args.iters} rounds after {args.warmup} warm-up rounds, each round timing "
                              "every row once in turn, " + ("CUDA events" if dev.type == "cuda" else
                                                            "perf_counter (CPU)")},
            "shape": {"rows": layout.seq_len, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
                      "head_dim": cfg.head_dim, "ffn": cfg.ffn_dim, "timesteps": inp.unique_t.numel(),
                      "layers_timed": layers, "layers_per_step": cfg.num_layers, "tiny": args.tiny},
            "slots": {"slots": args.slots, "max_rank": args.rank, "targets": list(BLOCK_TARGETS), "dtype": "bf16",
                      "adapter": f"rank {args.rank} on {list(ADAPTED)} of every block"},
            "precision": list(args.precision), "quick": args.quick, "compiled": COMPILED, "notes": [RANDOM_NOTE],
            "precisions": {}}


def run(args) -> dict:
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    dev = torch.device(args.device)
    cfg, layout = shape_of(args.tiny)
    layers = args.layers or (cfg.num_layers if args.tiny else 2 if args.quick else 4)
    if not 1 <= layers <= cfg.num_layers:
        raise SystemExit(f"--layers must be 1..{cfg.num_layers} (the model's blocks), got {layers}.")
    if "fp8" in args.precision:
        from h3trt.calibration.recipe import check_modelopt

        check_modelopt()  # the FP8 scales come from ModelOpt: refuse before anything is built
    timer = lambda fn: median_ms(fn, dev, args.iters, args.warmup)  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    inp = make_inputs(cfg, layout, dev)
    result = header(args, cfg, layout, inp, layers, dev)
    log(f"{result['env']['device']}: {layout.seq_len} rows, {layers} layers, precisions {args.precision}")
    if dev.type == "cpu":
        result["note"] = CPU_NOTE
    with torch.no_grad(), temporary_cache_dir(str(work / "inductor_cache")):
        with phase("random layers and the reference block", args.phase_timeout):
            blocks = random_blocks(cfg, layers, dev)
            result["reference"] = reference(cfg, blocks[0], inp, dev, timer)
            kernels = attention_kernels(args, cfg, layout, dev)
            result["attention"] = {p: c.to_dict() for p, c in kernels.items()}
        slots = AdapterSlots(cfg, "t2va", args.slots, args.rank, BF16, dev)
        with phase("adapter files: write, read, load", args.phase_timeout):
            result["adapter_load"] = load_adapters(cfg, slots, work, args.rank, dev, args.load_repeats)
        ctx = {"args": args, "cfg": cfg, "inp": inp, "dev": dev, "slots": slots, "kernels": kernels,
               "blocks": blocks, "work": work, "files": result["adapter_load"]["files"]}
        write_json(args.json, result)
        for precision in args.precision:
            slotted = None  # the last precision's runner (its layers, its segments) goes before the next is built
            try:
                rows, slotted = precision_rows(precision, ctx)
                rows.update(summarise(rows, cfg.num_layers, result["reference"]["ms"]))
                result["precisions"][precision] = rows
                if "switching" not in result:  # once, on the first precision that ran
                    with phase(f"{precision}: switching", args.phase_timeout):
                        result["switching"] = {"precision": precision, **switching(
                            lambda run, d=slotted: evaluate(d, inp, run), slots, ctx["files"], dev, args.iters)}
            except Exception as e:  # one precision failing is a row of the report, never the end of the run
                traceback.print_exc()
                result["failed"] = {**result.get("failed", {}), precision: f"{type(e).__name__}: {e}"[:2000]}
            result["peak_memory_gib"] = peak_gib(dev)
            write_json(args.json, result)
    result["notes"].append("ms_per_step_estimate: ms per block x layers_per_step, the block stack of H3's one DiT "
                           "evaluation per step; embed and final (the same with and without adapters) left out.")
    result["total_s"] = round(time.perf_counter() - STARTED, 1)
    write_json(args.json, result)
    print_table(result)
    log("done")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="H3Config.tiny() over a 114-row sequence (what a CPU checks)")
    p.add_argument("--quick", action="store_true", help="--layers 2 --iters 3 --warmup 1 --load-repeats 1 unless "
                   "given: the same rows in about 2.5 minutes on one H100 (an estimate)")
    p.add_argument("--layers", type=int, default=None, help="layers the runner's stack times, each its own weights "
                   "(default 4, --quick 2; --tiny: the tiny model's 2)")
    p.add_argument("--rank", type=int, default=64, help="the adapters' rank and the slots' max rank (default 64)")
    p.add_argument("--slots", type=int, default=2, help="adapter slots N (default 2)")
    p.add_argument("--precision", nargs="+", choices=("fp8", "bf16"), default=["fp8", "bf16"],
                   help="rows per precision, in order; the first also times switching (default: fp8 bf16)")
    p.add_argument("--no-fp8-attention", dest="fp8_attention", action="store_false",
                   help="fp8 rows with bf16 attention (default: FP8 attention, as the headline bundle)")
    p.add_argument("--attention", choices=("auto", "cudnn", "fa3"), default="auto",
                   help="attention kernel, as `h3trt build --attention` (auto: the fastest here; the CPU's own)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per row (default 7, --quick 3; --tiny 9)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2, --quick 1)")
    p.add_argument("--load-repeats", type=int, default=None, help="times each adapter load is timed (default 3, "
                   "--quick 1)")
    p.add_argument("--phase-timeout", type=int, default=300, help="seconds any one phase may take (default 300)")
    p.add_argument("--json", type=Path, default=None, help="write the results here (after every phase)")
    args = p.parse_args()
    args.iters = args.iters or (3 if args.quick else 9 if args.tiny else 7)
    args.warmup = (1 if args.quick else 2) if args.warmup is None else args.warmup
    args.load_repeats = (1 if args.quick else 3) if args.load_repeats is None else args.load_repeats
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here; pass --device cpu (with --tiny to check the script).")
    return 1 if run(args).get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
