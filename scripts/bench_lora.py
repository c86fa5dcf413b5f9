"""Per-request LoRA adapters on one H200 (issue 38): what a bundle's adapter slots cost per block and per denoise step,
and what switching adapters costs, in one run, against the Diffusers reference block of the same run.

    python scripts/bench_lora.py --json bench/results/lora_h200.json                  # one H200/H100, full width
    python scripts/bench_lora.py --tiny --device cpu --json /tmp/bench_lora_cpu.json   # checks the script (CPU)

On the GPU image, carry .whl/site.tar.xz (scripts/make_gpu_site.sh): ModelOpt for the FP8 scales, fa3-fwd and the
cuDNN frontend for FP8 attention, diffusers for the reference (without it the h3trt eager block is the reference, and
the JSON's `reference` says so). The full-width run should take 3-5 minutes (an estimate from earlier runs' compile
and block times; not yet run), most of it compiling 4 segments and writing and loading the adapters.

Shape: MiniMax-H3 at full width (hidden 5376, 56 heads x 128, SwiGLU 14336), random bf16 weights (std 0.02), 37,838
rows (128 text + 2 x 207 audio + 37 x 24 x 42 video); --tiny: H3Config.tiny() over a 114-row sequence.

Per precision (--precision; fp8 is the headline bundle's recipe: W8A8 e4m3 block linears with static per-tensor
scales from ModelOpt's max calibration on the layer's input, fast accumulation, FP8 attention; --no-fp8-attention
keeps attention in bf16) the `block` segment and its twin with adapters, `block_lora`, are made by the builder's own
functions (build/segments.py block_segment, block_lora_segment over models/lora_slots.py BLOCK_TARGETS, as `h3trt
build --lora-slots N --lora-max-rank R` makes them; their example inputs by build/examples.py lora_examples),
compiled by build/backends.py compile_segment (torch.export, Inductor standalone_compile, saved, loaded) and served by
the bundle's own runner, engines/bundle.py EngineDiT, over --layers layers, each with its own weights and slot banks.
The runner's embed and final are stand-ins that hand back precomputed tensors (they cost the same with and without
adapters), so a row is the runner's block stack: AdaLN tables, RoPE, dispatch, every layer. Rows, ms per block (the
stack's median over --iters rounds after --warmup, each round timing every row once in turn, CUDA events; divided by
--layers):
  no_slots            EngineDiT without slots: the bundle built without --lora-slots
  slots_no_adapter    with N slots of max rank R, an evaluation without adapters: the runner runs `block`
                      (issue 38's bar: <= 1% slower than no_slots)
  slots_scale0        with slots, an adapter at scale 0: `block_lora` with all N entries at scale 0, the padding cost
                      the runner's dispatch avoids
  slots_one_adapter   with slots, one rank-R adapter at scale 1 on every attention and MLP linear of every layer, the
                      other N - 1 entries padded with scale 0, and the runner's eager AdaLN side branch (the bundle's
                      slots include adaln_proj; this adapter leaves it zero) (bar: <= 5% slower than no_slots)
Per step: ms per block x num_layers (50): H3 runs one DiT evaluation per step (CFG-distilled); embed and final are
left out. Against the reference: the Diffusers MiniMaxH3TransformerBlock, eager, bf16, default SDPA, one block.

Switching (the first precision's engine): two full-size rank-R adapters written as safetensors files (ai-toolkit's
original names); read_lora alone (read, sha256, normalise), LoraSlots.load of the read file (checks and the copy into
the banks: the device-side part), LoraSlots.load from the path (both), `select`; then under engines/guard.py
no_compile: the evaluation after switching between resident slots, and after loading the second adapter into the
slot the first held (its output equal to the other slot's: the new data reached the compiled code, no compile).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench_common import ROOT, device_name, median_ms, peak_gib, rel_err, sync, write_json  # noqa: E402  (first)

sys.path.insert(0, str(ROOT / "scripts"))

from h3trt.build.attention_choice import AttentionShape, resolve_attention  # noqa: E402
from h3trt.engines.bundle import EngineDiT  # noqa: E402
from h3trt.engines.guard import no_compile  # noqa: E402
from h3trt.models.config import NUM_MODALITIES, H3Config  # noqa: E402
from h3trt.models.lora_slots import BLOCK_TARGETS, LoraSlots, target_shape  # noqa: E402
from h3trt.models.precision import Precision  # noqa: E402

BF16 = torch.bfloat16
ADAPTED = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")  # issue 38: every attention and MLP linear
BARS = {"slots_no_adapter": 1.01, "slots_one_adapter": 1.05}  # issue 38: at most 1% / 5% slower than no_slots
COMPILED = ("block and block_lora from build/segments.py block_segment / block_lora_segment, example inputs from "
            "build/examples.py lora_examples, compiled by build/backends.py compile_segment('inductor') -> "
            "compile_inductor (torch.export with a symbolic row count, Inductor standalone_compile with the build's "
            "INDUCTOR_OPTIONS, saved), loaded by engines/loaders.py load_segment and served by engines/bundle.py "
            "EngineDiT; the AdaLN adapter is the runner's eager side branch (the segment never takes it)")
CPU_NOTE = ("CPU run at the tiny shape: it checks that the script runs end to end; its timings are not performance "
            "claims.")


@dataclasses.dataclass
class Inputs:
    """One evaluation's tensors at the bench's shape: x [1, S, H] bf16, temb [T, E] fp32 and the layout's indices."""

    layout: object
    x: torch.Tensor
    temb: torch.Tensor
    unique_t: torch.Tensor
    t_index: torch.Tensor
    adaln_index: torch.Tensor
    pos: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]


def versions() -> dict:
    """The packages the rows depend on, as installed (None: absent)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("diffusers", "nvidia-modelopt", "fa3-fwd", "nvidia-cudnn-frontend", "triton"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def shape_of(tiny: bool):
    """(config, packed layout): H3 at full width over 37,838 rows, or the tiny config over 114 rows."""
    from bench_dit import AUDIO, LATENT_H, LATENT_T, LATENT_W, TEXT

    from h3trt.models.packing import pack_t2va, text_tags_for

    if tiny:
        return H3Config.tiny(), pack_t2va(text_tags_for(16), 3, 8, 12, 13)
    return H3Config(), pack_t2va(text_tags_for(TEXT), LATENT_T, LATENT_H, LATENT_W, AUDIO)


def make_inputs(cfg: H3Config, layout, dev: torch.device) -> Inputs:
    from h3trt.models.dit import rope_inv_freq, rope_tables
    from h3trt.models.packing import row_timesteps

    g = torch.Generator().manual_seed(0)
    layout = layout.to(dev)
    unique_t, t_index = (t.to(dev) for t in row_timesteps(layout, 0.25, 0.5))
    x = torch.randn(1, layout.seq_len, cfg.hidden_size, generator=g).to(dev, BF16)
    temb = torch.randn(unique_t.numel(), cfg.time_embed_dim, generator=g).to(dev)
    rope = rope_tables(layout.position_ids, rope_inv_freq(cfg).to(dev))
    return Inputs(layout, x, temb, unique_t, t_index, t_index * NUM_MODALITIES + layout.token_tags,
                  layout.position_ids, rope)


def random_blocks(cfg: H3Config, layers: int, dev: torch.device) -> list:
    """`layers` eager h3trt blocks, bf16, every weight N(0, 0.02), made on the device (a full-width block is 385M
    parameters)."""
    from h3trt.models.dit import Block

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        with torch.device(dev):
            block = Block(cfg).to(BF16).eval()
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        blocks.append(block)
    return blocks


def reference(cfg: H3Config, block, inp: Inputs, dev: torch.device, timer) -> dict:
    """The eager reference block's ms: Diffusers' block with `block`'s weights loaded from it (bench_dit's mapping),
    or, where diffusers is not importable, `block` itself eager (the repo's block, bitwise the Diffusers one in
    bench_dit's runs)."""
    from h3trt.models.dit import sdpa_attention

    mod = block.modulation(inp.temb).contiguous()
    try:
        from diffusers.models.transformers.transformer_minimax_h3 import (MiniMaxH3RotaryPosEmbed,
                                                                          MiniMaxH3TransformerBlock)
    except ImportError as e:
        ms = timer(lambda: block(inp.x, mod, inp.adaln_index, inp.rope, sdpa_attention))
        return {"name": "h3trt_eager_block", "ms": ms,
                "why": f"diffusers is not importable here ({type(e).__name__}: {e}): the repo's eager block "
                       "(models/dit.py Block, SDPA) is the reference in its place"}
    from bench_dit import diffusers_block_to_native

    with torch.device(dev):
        ref = MiniMaxH3TransformerBlock(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.ffn_dim,
                                        cfg.time_embed_dim, cfg.norm_eps, cfg.norm_eps).to(BF16).eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.02)
    block.load_state_dict(diffusers_block_to_native(ref), strict=True)  # layer 0 gets the reference's weights
    mod = block.modulation(inp.temb).contiguous()
    rot = MiniMaxH3RotaryPosEmbed(cfg.rope_freq_dim, cfg.rope_theta).to(dev)(inp.pos)
    want = ref(inp.x, inp.temb, inp.adaln_index, rot)
    got = block(inp.x, mod, inp.adaln_index, inp.rope, sdpa_attention)
    ms = timer(lambda: ref(inp.x, inp.temb, inp.adaln_index, rot))
    return {"name": "diffusers_eager_block", "ms": ms, "h3trt_eager_rel_err_vs_diffusers": rel_err(got, want)}


def attention_kernels(args, cfg: H3Config, layout, dev: torch.device) -> dict:
    """The kernels the build would bake (build/attention_choice.py resolve_attention, `--attention` as given): the
    block-dtype attention's, and FP8 attention's where an fp8 row runs it."""
    shape = AttentionShape(layout.seq_len, cfg.num_heads, cfg.head_dim)
    choices = {"bf16": resolve_attention(args.attention, Precision.BF16, dev, shape)}
    if "fp8" in args.precision and args.fp8_attention:
        choices["fp8"] = resolve_attention(args.attention, Precision.FP8, dev, shape)
    return choices


def recipe_for(precision: str, args, kernels: dict):
    """None for bf16; fp8: the recipe of `h3trt build --precision fp8 [--fp8-attention] --fp8-accum fast`."""
    from h3trt.calibration.recipe import QuantRecipe

    if precision == "bf16":
        return None
    fp8_attention = args.fp8_attention
    return QuantRecipe("fp8", calib_steps=2, fp8_attention=fp8_attention, fp8_accum="fast",
                       attention_kernel=kernels["fp8"].kernel if fp8_attention else "")


def layer_blocks(blocks: list, cfg: H3Config, recipe, inp: Inputs) -> list:
    """The layers as the recipe serves them: the bf16 blocks, or copies quantized with scales from ModelOpt's max
    calibration on the layer's input (bench_fp8.quantized_copy: one input, a benchmark, not a recipe)."""
    if recipe is None:
        return blocks
    from bench_fp8 import quantized_copy

    with torch.no_grad():
        return [quantized_copy(b, cfg, recipe, inp.x, b.modulation(inp.temb).contiguous(), inp.adaln_index, inp.rope)
                for b in blocks]


def block_tensors(block) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in [*block.named_parameters(), *block.named_buffers()]}


def compile_pair(cfg: H3Config, recipe, dense_kernel: str, layers: list, inp: Inputs, slots: LoraSlots,
                 work: Path, dev: torch.device) -> tuple[dict, dict, dict]:
    """`block` and `block_lora` compiled as `h3trt build --lora-slots N --lora-max-rank R` compiles them:
    ({name: spec}, {name: loaded segment}, {name: compile + load seconds})."""
    from h3trt.build.backends import compile_segment
    from h3trt.build.examples import lora_examples
    from h3trt.build.segments import block_lora_segment, block_segment
    from h3trt.engines.loaders import load_segment
    from h3trt.engines.manifest import LoraSlotsRecord

    plain = block_segment(cfg, BF16, recipe, attention=dense_kernel)
    twin = block_lora_segment(plain, cfg, BF16, recipe, dense_kernel, slots.targets)
    tensors = block_tensors(layers[0])
    example = [inp.x, layers[0].modulation(inp.temb).contiguous(), inp.adaln_index, *inp.rope,
               *[tensors[n] for n in plain.weights]]
    record = LoraSlotsRecord(slots.num_slots, slots.max_rank, slots.targets)
    g = torch.Generator().manual_seed(0)
    examples = {"block": example, "block_lora": lora_examples(example, twin, cfg, record, g)}
    (work / "segments").mkdir(parents=True, exist_ok=True)
    segments, seconds = {}, {}
    for spec in (plain, twin):
        t0 = time.perf_counter()
        entry = compile_segment("inductor", spec, examples[spec.name], work / "segments")
        segments[spec.name] = load_segment("inductor", {"name": spec.name, **entry}, work, dev)
        seconds[spec.name] = round(time.perf_counter() - t0, 2)
        print(f"  compiled {spec.name} in {seconds[spec.name]:.1f} s", flush=True)
    return {"block": plain, "block_lora": twin}, segments, seconds


def engine(cfg_l: H3Config, specs: dict, segments: dict, layers: list, inp: Inputs, dev: torch.device,
           slots: LoraSlots | None) -> EngineDiT:
    """The bundle's runner over `layers` (their own weights, AdaLN tables baked from their own projections), with
    stand-ins for embed (hands back x and temb) and final (hands back x); with `slots`, the bundle built with them."""
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
        entries["block_lora"] = {"weights": specs["block_lora"].weights, "lora": specs["block_lora"].lora}
        runners["block_lora"] = segments["block_lora"]
    return EngineDiT(cfg_l, {**stand_ins, **runners}, entries, weights, BakedAdaLN(tables, dev), dev,
                     lora_slots=slots)


def evaluate(dit: EngineDiT, inp: Inputs, lora=None) -> torch.Tensor:
    """One evaluation's block stack through EngineDiT.__call__ (embed and final are the stand-ins)."""
    (x,) = dit(None, None, None, inp.unique_t, inp.t_index, inp.layout, lora=lora)
    return x


def eager_stack(layers: list, recipe, kernels: dict, inp: Inputs, run) -> torch.Tensor:
    """The same layers eager (models/dit.py Block with the recipe's modules), the adapters of `run` (a LoraRun, or
    None) on every linear and on the AdaLN projection as the eager DiT applies them: the runner's reference."""
    from h3trt.calibration.modules import ATTENTION_SCALES, attention_fn

    fp8_attention = recipe is not None and recipe.fp8_attention
    kernel = recipe.attention_kernel if fp8_attention else kernels["bf16"].kernel
    x = inp.x
    for i, block in enumerate(layers):
        lora = run.block(i) if run is not None else None
        scales = {n: getattr(block.attn, n) for n in ATTENTION_SCALES} if fp8_attention else None
        x = block(x, block.modulation(inp.temb, lora).contiguous(), inp.adaln_index, inp.rope,
                  attention_fn(scales, kernel), lora)
    return x


def write_adapter(path: Path, cfg: H3Config, rank: int, seed: int, dev: torch.device) -> int:
    """A rank-`rank` LoRA on every attention and MLP linear of all cfg.num_layers blocks, bf16, in ai-toolkit's
    original names (`diffusion_model.blocks.{i}.{linear}.lora_A|B.weight`; no alpha: scaling 1): its size in bytes.
    Drawn on `dev` (the full size is 300M values), written from the CPU."""
    from safetensors.torch import save_file

    g = torch.Generator(dev).manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for local in ADAPTED:
            n_in, n_out, _ = target_shape(cfg, local)
            key = f"diffusion_model.blocks.{i}.{local}"
            down = torch.randn(rank, n_in, generator=g, device=dev) / n_in ** 0.5
            up = 0.3 * torch.randn(n_out, rank, generator=g, device=dev) / rank ** 0.5
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = (t.to("cpu", BF16) for t in (down, up))
    save_file(tensors, str(path))
    return path.stat().st_size


def timed_s(fn, dev: torch.device) -> tuple[object, float]:
    """(fn(), seconds), the device synchronised before and after."""
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t0


def load_adapters(cfg: H3Config, slots: LoraSlots, work: Path, rank: int, dev: torch.device, repeats: int) -> dict:
    """Write adapters A and B, time reading and loading them; leaves A in slot 0 and B in slot 1 (one slot: A)."""
    from h3trt.models.lora_file import read_lora

    files = {name: work / f"adapter_{name}.safetensors" for name in ("A", "B")}
    t0 = time.perf_counter()
    nbytes = {name: write_adapter(path, cfg, rank, seed, dev) for seed, (name, path) in enumerate(files.items())}
    out = {"files": {n: str(p) for n, p in files.items()}, "file_bytes": nbytes["A"],
           "write_s": round(time.perf_counter() - t0, 3), "layers": cfg.num_layers, "rank": rank,
           "linears": list(ADAPTED), "page_cache": "the files were just written: reads come from the page cache"}
    read_s, copy_s, load_s = [], [], []
    for _ in range(repeats):
        lora, seconds = timed_s(lambda: read_lora(files["A"], cfg.head_dim), dev)
        read_s.append(seconds)
        copy_s.append(timed_s(lambda: slots.load(0, lora), dev)[1])
        if slots.num_slots > 1:
            load_s.append(timed_s(lambda: slots.load(1, files["B"]), dev)[1])
    out.update(read_lora_s=read_s, load_read_file_s=copy_s, load_from_path_s=load_s,
               median_s={"read_lora": statistics.median(read_s), "load_read_file": statistics.median(copy_s),
                         **({"load_from_path": statistics.median(load_s)} if load_s else {})})
    out["slot_record"] = dataclasses.asdict(slots.records[0])
    print(f"adapter: {nbytes['A'] / 1e6:.0f} MB, read {out['median_s']['read_lora']:.3f} s, into a slot "
          f"{out['median_s']['load_read_file']:.3f} s", flush=True)
    return out


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


def wall_ms(fn, dev: torch.device, iters: int) -> float:
    """Median wall-clock ms of fn() with the device synchronised around each call: what a caller waits, the host's
    part included (select is host work and a small copy; CUDA events would time only the device's share)."""
    return statistics.median(timed_s(fn, dev)[1] for _ in range(iters)) * 1e3


def switching(dit: EngineDiT, slots: LoraSlots, inp: Inputs, files: dict, dev: torch.device, iters: int) -> dict:
    """Under no_compile: switch between resident slots, then load B where A was; the evaluations that follow, and
    the steady evaluation, all by the wall clock."""
    one = [(0, 1.0)]
    out = {"timing": f"wall clock, device synchronised; steady and select: median of {iters}",
           "select_ms": wall_ms(lambda: slots.select(one), dev, iters)}
    with no_compile():
        out["steady_evaluation_ms"] = wall_ms(lambda: evaluate(dit, inp, slots.select(one)), dev, iters)
        with_a = evaluate(dit, inp, slots.select(one))
        if slots.num_slots > 1:
            with_b, seconds = timed_s(lambda: evaluate(dit, inp, slots.select([(1, 1.0)])), dev)
            out["first_evaluation_after_switching_slots_ms"] = seconds * 1e3
        out["load_b_into_slot_0_s"] = timed_s(lambda: slots.load(0, files["B"]), dev)[1]
        after, seconds = timed_s(lambda: evaluate(dit, inp, slots.select(one)), dev)
        out["first_evaluation_after_loading_ms"] = seconds * 1e3
    out["no_compile"] = "every evaluation above ran under engines/guard.py no_compile: nothing compiled"
    out["reload_changed_the_output"] = not torch.equal(after, with_a)
    if slots.num_slots > 1:
        out["reloaded_slot_equals_the_other_slot"] = torch.equal(after, with_b)
    return out


def precision_rows(precision: str, ctx: dict, timer) -> tuple[dict, EngineDiT]:
    """One precision's compiled pair, its four runner rows and the runner's error against the eager layers; and its
    runner with slots."""
    args, cfg, inp, dev, slots, kernels = (ctx[k] for k in ("args", "cfg", "inp", "dev", "slots", "kernels"))
    recipe = recipe_for(precision, args, kernels)
    t0 = time.perf_counter()
    layers = layer_blocks(ctx["blocks"], cfg, recipe, inp)
    out = {"recipe": recipe.to_dict() if recipe else "bf16 (no quantization)",
           "calibration_s": round(time.perf_counter() - t0, 2),
           "attention_kernel": recipe.attention_kernel if recipe and recipe.fp8_attention else kernels["bf16"].kernel}
    specs, segments, out["compile_s"] = compile_pair(cfg, recipe, kernels["bf16"].kernel, layers, inp, slots,
                                                     ctx["work"] / precision, dev)
    cfg_l = dataclasses.replace(cfg, num_layers=len(layers))
    plain = engine(cfg_l, specs, segments, layers, inp, dev, None)
    slotted = engine(cfg_l, specs, segments, layers, inp, dev, slots)
    uses = {"slots_scale0": [(0, 0.0)], "slots_one_adapter": [(0, 1.0)]}
    calls = {"no_slots": lambda: evaluate(plain, inp), "slots_no_adapter": lambda: evaluate(slotted, inp),
             **{row: (lambda u=u: evaluate(slotted, inp, slots.select(u))) for row, u in uses.items()}}
    with no_compile():
        ms = out["ms_per_block"] = {row: t / len(layers) for row, t in
                                    interleaved_ms(calls, dev, args.iters, args.warmup).items()}
        for row, t in ms.items():
            print(f"  {precision} {row:18s} {t:9.3f} ms per block", flush=True)
        got = {row: evaluate(slotted, inp, slots.select(u)) for row, u in uses.items()}
        got["slots_no_adapter"] = evaluate(slotted, inp)
    want = {"slots_no_adapter": eager_stack(layers, recipe, kernels, inp, None),
            "slots_one_adapter": eager_stack(layers, recipe, kernels, inp, slots.select([(0, 1.0)]))}
    def update(y):  # of the block stack (output - input): the residual alone would hide the error
        return y.float() - inp.x.float()

    out["update_rel_err_vs_eager"] = {row: rel_err(update(got[row]), update(w)) for row, w in want.items()}
    # block_lora at scale 0 adds exact zeros, but it is another compiled graph than `block` (other fusions): equal to
    # rounding, not bit for bit; a request without adapters runs `block` itself, which is.
    out["scale0_rel_err_vs_no_adapter"] = rel_err(got["slots_scale0"], got["slots_no_adapter"])
    out["adapter_moves_the_update_rel"] = rel_err(update(got["slots_one_adapter"]), update(got["slots_no_adapter"]))
    return out, slotted


def summarise(rows: dict, layers_per_step: int, reference_ms: float) -> dict:
    """Ratios to no_slots (the bars), the per-step estimate (ms per block x layers) and the speed-up over the
    reference block."""
    ms = rows["ms_per_block"]
    base = ms["no_slots"]
    ratios = {row: t / base for row, t in ms.items()}
    return {"ratio_to_no_slots": ratios,
            "bars": {row: {"ratio": ratios[row], "at_most": bar, "met": ratios[row] <= bar}
                     for row, bar in BARS.items()},
            "ms_per_step_estimate": {row: t * layers_per_step for row, t in ms.items()},
            "speedup_vs_reference": {row: reference_ms / t for row, t in ms.items()}}


def print_table(result: dict) -> None:
    ref = result["reference"]
    if result.get("note"):
        print(f"\n{result['note']}")
    print(f"\nreference {ref['name']}: {ref['ms']:.3f} ms per block; x{result['shape']['layers_per_step']} per step",
          flush=True)
    print(f"{'precision':9s} {'row':18s} {'ms/block':>10s} {'vs no_slots':>11s} {'s/step est.':>11s} "
          f"{'vs ref':>7s}")
    for precision, rows in result["precisions"].items():
        for row, t in rows["ms_per_block"].items():
            bar = rows["bars"].get(row)
            mark = f"  bar <= {bar['at_most']:.2f}: {'met' if bar['met'] else 'MISSED'}" if bar else ""
            print(f"{precision:9s} {row:18s} {t:10.3f} {rows['ratio_to_no_slots'][row]:10.4f}x "
                  f"{rows['ms_per_step_estimate'][row] / 1e3:11.3f} {rows['speedup_vs_reference'][row]:6.3f}x{mark}")
    med, sw = result["adapter_load"]["median_s"], result.get("switching")
    print(f"adapter ({result['adapter_load']['file_bytes'] / 1e6:.0f} MB): read_lora {med['read_lora']:.3f} s, "
          f"LoraSlots.load of the read file {med['load_read_file']:.3f} s", flush=True)
    if sw:
        print(f"switching ({sw['precision']}): select {sw['select_ms']:.3f} ms; evaluation "
              f"{sw['steady_evaluation_ms']:.1f} ms steady, {sw['first_evaluation_after_loading_ms']:.1f} ms first "
              "after a load (no compile); the "
              f"reload reached the compiled code: {sw['reload_changed_the_output']}", flush=True)
    for precision, why in result.get("failed", {}).items():
        print(f"{precision}: FAILED {why}", flush=True)

def run(args) -> dict:
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    dev = torch.device(args.device)
    cfg, layout = shape_of(args.tiny)
    layers = args.layers or (cfg.num_layers if args.tiny else 4)
    if not 1 <= layers <= cfg.num_layers:
        raise SystemExit(f"--layers must be 1..{cfg.num_layers} (the model's blocks), got {layers}.")
    if "fp8" in args.precision:
        from h3trt.calibration.recipe import check_modelopt

        check_modelopt()  # the FP8 scales come from ModelOpt: refuse before anything is built
    timer = lambda fn: median_ms(fn, dev, args.iters, args.warmup)  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    inp = make_inputs(cfg, layout, dev)
    result = {"env": {"device": device_name(dev), "torch": torch.__version__, "cuda": torch.version.cuda,
                      "cudnn": torch.backends.cudnn.version() if dev.type == "cuda" else None, **versions(),
                      "timing": f"median of {args.iters} rounds after {args.warmup} warm-up rounds, each "
                                "round timing every row once in turn, " +
                                ("CUDA events" if dev.type == "cuda" else "perf_counter (CPU)")},
              "shape": {"rows": layout.seq_len, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
                        "head_dim": cfg.head_dim, "ffn": cfg.ffn_dim, "timesteps": inp.unique_t.numel(),
                        "layers_timed": layers, "layers_per_step": cfg.num_layers, "tiny": args.tiny},
              "slots": {"slots": args.slots, "max_rank": args.rank, "targets": list(BLOCK_TARGETS),
                        "dtype": "bf16", "adapter": f"rank {args.rank} on {list(ADAPTED)} of every block"},
              "precision": list(args.precision), "compiled": COMPILED, "notes": [], "precisions": {}}
    if dev.type == "cpu":
        result["note"] = CPU_NOTE
    with torch.no_grad(), temporary_cache_dir(str(work / "inductor_cache")):
        blocks = random_blocks(cfg, layers, dev)
        result["reference"] = reference(cfg, blocks[0], inp, dev, timer)
        kernels = attention_kernels(args, cfg, layout, dev)
        result["attention"] = {p: c.to_dict() for p, c in kernels.items()}
        slots = LoraSlots(cfg, "t2va", args.slots, args.rank, BF16, dev)
        result["adapter_load"] = load_adapters(cfg, slots, work, args.rank, dev, args.load_repeats)
        ctx = {"args": args, "cfg": cfg, "inp": inp, "dev": dev, "slots": slots, "kernels": kernels,
               "blocks": blocks, "work": work, "result": result, "files": result["adapter_load"]["files"]}
        write_json(args.json, result)
        for precision in args.precision:
            slotted = None  # the last precision's runner (its layers, its segments) goes before the next is built
            try:
                rows, slotted = precision_rows(precision, ctx, timer)
                rows.update(summarise(rows, cfg.num_layers, result["reference"]["ms"]))
                result["precisions"][precision] = rows
                if "switching" not in result:  # once, on the first precision that ran
                    result["switching"] = {"precision": precision,
                                           **switching(slotted, slots, inp, ctx["files"], dev, args.iters)}
            except Exception as e:  # one precision failing is a row of the report, never the end of the run
                traceback.print_exc()
                result["failed"] = {**result.get("failed", {}), precision: f"{type(e).__name__}: {e}"[:2000]}
            result["peak_memory_gib"] = peak_gib(dev)
            write_json(args.json, result)
    result["notes"].append("ms_per_step_estimate: ms per block x layers_per_step, the block stack of H3's one DiT "
                           "evaluation per step; embed and final (the same with and without adapters) left out.")
    write_json(args.json, result)
    print_table(result)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="H3Config.tiny() over a 114-row sequence (what a CPU checks)")
    p.add_argument("--layers", type=int, default=None, help="layers the runner's stack times, each its own weights "
                   "(default 4; --tiny: the tiny model's 2)")
    p.add_argument("--rank", type=int, default=64, help="the adapters' rank and the slots' max rank (default 64)")
    p.add_argument("--slots", type=int, default=2, help="adapter slots N, block_lora's K (default 2)")
    p.add_argument("--precision", nargs="+", choices=("fp8", "bf16"), default=["fp8", "bf16"],
                   help="rows per precision, in order; the first also times switching (default: fp8 bf16)")
    p.add_argument("--no-fp8-attention", dest="fp8_attention", action="store_false",
                   help="fp8 rows with bf16 attention (default: FP8 attention, as the headline bundle)")
    p.add_argument("--attention", choices=("auto", "cudnn", "fa3"), default="auto",
                   help="attention kernel, as `h3trt build --attention` (auto: the fastest here; the CPU's own)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per row (default 7; 9 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2)")
    p.add_argument("--load-repeats", type=int, default=3, help="times each adapter load is timed (default 3)")
    p.add_argument("--json", type=Path, default=None, help="write the results here (after every precision)")
    args = p.parse_args()
    args.iters = args.iters or (9 if args.tiny else 7)
    args.warmup = 2 if args.warmup is None else args.warmup
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here; pass --device cpu (with --tiny to check the script).")
    return 1 if run(args).get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
