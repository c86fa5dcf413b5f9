"""The arithmetic of LoRA rank rows (h3trt/adapters/slots.py; issue 44 item 3, issue 45 item 8) against the eager
adapter y = base(x) + sum_k scale_k (x A_k^T) B_k^T, computed here in float64:

  - FUSED on a plain linear (the weight merged for the call) and on NVFP4's dequantized weight: fp32 within 1e-5
    (relative norm); bf16 within 1e-2 (the merged weight is rounded to 8 bits once, as the output is; the bf16 side
    branch, DELTA, is held to the same bound);
  - FUSED on FP8 (the rows inside the base's FP8 GEMM): the adapter's part, and the output, within 10% of the exact
    ones (e4m3 keeps 3 mantissa bits; the rows pass two FP8 GEMMs; measured ~5%), smoothed inputs included, for an
    adapter that moves the output by 30% and for one whose terms outgrow the base's (no saturation);
  - an adapter at scale 0 is not computed, and changes no bit; the rows depend on the adapters only, so slots of any
    count and max rank give the same bytes;
  - the compiled twin (build/segments.py block_lora, Inductor on the CPU) takes any number of rows without compiling
    and equals its eager function; so do the halves' twins of a sparse bundle (block_pre_lora, block_post_lora), which
    together equal the block's.
"""

import pytest
import torch

from helpers import tiny_block_inputs
from lora_cases import CFG, forward, layout_file, model

from h3trt.adapters.slots import (DELTA, LORA_INPUTS, ROW_GROUP, AdapterBlock, AdapterSlots, adapted_linear,
                                  adapter_delta, gather_rows, row_groups)
from h3trt.calibration.formats import FP8, e2m1_values, quantize_fp8
from h3trt.calibration.modules import FP8Linear, NVFP4Linear, SmoothedFP8Linear, SmoothedNVFP4Linear

N_IN, N_OUT = 96, 64  # one part's output rows; qkv-like linears have 3


def rel(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def banks(parts: int, n_out: int = N_OUT, slots: int = 3, rank: int = 24, seed: int = 0):
    """Slot banks down [N, P, R, I], up [N, P, R, O] with an adapter of rank 24 in slot 0 and of rank 5 in slot 2
    (rows past 5 zero, as a load leaves them), and those two selected at 0.7 and -1.3: (banks, rows, scales)."""
    g = torch.Generator().manual_seed(seed)
    down = torch.randn(slots, parts, rank, N_IN, generator=g) / N_IN ** 0.5
    up = 0.3 * torch.randn(slots, parts, rank, n_out, generator=g) / rank ** 0.5
    for t in (down, up):
        t[1] = 0
        t[2, :, 5:] = 0
    rows = list(range(rank)) + list(range(2 * rank, 2 * rank + 5))
    rows_GR, scales_GR = row_groups(rows, [0.7] * rank + [-1.3] * 5, torch.device("cpu"))
    return (down, up), rows_GR.reshape(-1), scales_GR.reshape(-1)


def exact(x, weight, down_NPRI, up_NPRO, uses) -> torch.Tensor:
    """x W^T + sum over (slot, scale, rank) of scale (x A^T) B^T, float64, parts stacked along the outputs."""
    x = x.double()
    y = x @ weight.double().T
    for slot, scale, rank in uses:
        parts = [scale * (x @ down_NPRI[slot, p, :rank].double().T) @ up_NPRO[slot, p, :rank].double()
                 for p in range(down_NPRI.shape[1])]
        y = y + torch.cat(parts, dim=-1)
    return y


USES = ((0, 0.7, 24), (2, -1.3, 5))


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_a_plain_linear_computes_with_the_merged_weight(parts, dtype, tol):
    (down, up), rows, scales = banks(parts)
    linear = torch.nn.Linear(N_IN, parts * N_OUT, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.02)
    linear = linear.to(dtype)
    x = torch.randn(2, 37, N_IN).to(dtype)
    factors = [gather_rows(b.to(dtype), rows) for b in (down, up)]
    assert factors[0].shape == (parts, 32, N_IN)  # 29 rows of the adapters' own ranks, padded to two groups
    want = exact(x, linear.weight, down.to(dtype), up.to(dtype), USES)
    fused = adapted_linear(linear, x, *factors, scales)
    side = linear(x) + adapter_delta(x, *factors, scales).to(dtype)  # DELTA
    assert fused.dtype == dtype and rel(fused, want) <= tol and rel(side, want) <= tol
    assert rel(linear(x), want) > 0.1  # the adapters move the output far beyond the bound


def nvfp4_linear(n_out: int, smoothed: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cls = SmoothedNVFP4Linear if smoothed else NVFP4Linear
    linear = cls(n_out, N_IN, torch.float32) if smoothed else cls(n_out, N_IN)
    linear.weight_packed.copy_(torch.randint(0, 256, linear.weight_packed.shape, generator=g, dtype=torch.uint8))
    linear.weight_block_scale.copy_((0.01 + 0.02 * torch.rand(linear.weight_block_scale.shape, generator=g)).to(FP8))
    if smoothed:
        linear.pre_quant_scale.copy_(0.5 + torch.rand(N_IN, generator=g))
    return linear


def dequantized(linear) -> torch.Tensor:
    packed = linear.weight_packed
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).view(packed.shape[0], -1)
    weight = e2m1_values(codes).view(codes.shape[0], -1, 16) * linear.weight_block_scale.float()[..., None]
    weight = (weight * linear.weight_global_scale).view(codes.shape[0], -1)
    return weight * linear.pre_quant_scale if hasattr(linear, "pre_quant_scale") else weight  # as an unsmoothed W


@pytest.mark.parametrize("smoothed", [False, True])
def test_nvfp4_merges_the_rows_into_the_weight_it_dequantizes(smoothed):
    (down, up), rows, scales = banks(3)
    linear = nvfp4_linear(3 * N_OUT, smoothed)
    x = torch.randn(2, 37, N_IN)
    got = adapted_linear(linear, x, *(gather_rows(b, rows) for b in (down, up)), scales)
    want = exact(x, dequantized(linear), down, up, USES)
    assert rel(got, want) <= 1e-5 and rel(linear(x), want) > 1e-2


@pytest.mark.parametrize("smoothed", [False, True])
@pytest.mark.parametrize("weight_std", [0.1, 0.01])  # the adapter moves y by ~30%; by ~3x (its terms outgrow W's)
def test_fp8_takes_the_rows_into_its_gemm_within_the_stated_bound(smoothed, weight_std):
    (down, up), rows, scales = banks(3)
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(3 * N_OUT, N_IN, generator=g) * weight_std
    x = torch.randn(2, 37, N_IN, generator=g)
    linear = SmoothedFP8Linear(3 * N_OUT, N_IN, torch.float32) if smoothed else FP8Linear(3 * N_OUT, N_IN)
    pre = 0.5 + torch.rand(N_IN, generator=g) if smoothed else torch.ones(N_IN)
    if smoothed:
        linear.pre_quant_scale.copy_(pre)
    linear.weight_scale.fill_((weight / pre).abs().max().item() / 448)
    linear.weight.copy_(quantize_fp8(weight / pre, linear.weight_scale))
    linear.input_scale.fill_((x * pre).abs().max().item() / 448)
    got = adapted_linear(linear, x, *(gather_rows(b, rows) for b in (down, up)), scales)
    delta = exact(x, torch.zeros_like(weight), down, up, USES)
    exact_y = exact(x, weight, down, up, USES)
    err = rel(got.double() - linear(x).double(), delta)
    assert err <= 0.10 and rel(got, exact_y) <= 0.10, f"the adapter's part is off the exact one by {err:.3f}"
    assert (delta.norm() / linear(x).norm()).item() > 0.1  # a real adapter, not one lost in the base's error


def test_a_linear_without_fused_arithmetic_is_refused():
    class Odd(torch.nn.Module):
        def forward(self, x):
            return x

    (down, up), rows, scales = banks(1)
    with pytest.raises(TypeError, match="Odd has no fused LoRA arithmetic"):
        AdapterBlock({"mlp.fc2": (down, up)}, rows, scales)("mlp.fc2", Odd(), torch.randn(3, N_IN))
    with pytest.raises(ValueError, match="LoRA layout 'merged': pick one of"):
        AdapterBlock({}, rows, scales, "merged")


def test_an_adapter_at_scale_0_is_not_computed_and_changes_no_bit(state, tmp_path):
    s = AdapterSlots(CFG, "t2va", 2, 8, torch.float32)
    s.load(0, layout_file(tmp_path, "kohya_alpha_tensors", 1))
    s.load(1, layout_file(tmp_path, "original_alpha_less", 2))
    assert s.select([(0, 0.0)]) is None and s.select([(0, 0.0), (1, 0)]) is None  # the base model, exactly
    one, with_zero = s.select([(1, 0.7)]), s.select([(0, 0.0), (1, 0.7)])
    assert torch.equal(one.rows, with_zero.rows) and torch.equal(one.row_scales, with_zero.row_scales)
    assert with_zero.uses == ((0, 0.0), (1, 0.7)) and one.rows.shape == (2, ROW_GROUP)
    base = model(state)
    for got, want in zip(forward(base, with_zero), forward(base, one)):
        assert torch.equal(got, want)


def test_the_bytes_do_not_depend_on_the_slots_count_or_max_rank(state, tmp_path):
    """`run --adapter` fits its slots to its files (here 2 of rank 4); `serve --lora-dir` makes 4 of rank 64 and puts
    the adapters where they fall: the same adapters at the same scales give the same bytes, in both layouts."""
    a, b = layout_file(tmp_path, "kohya_alpha_tensors", 1), layout_file(tmp_path, "diffusers_prefixed", 2)
    fitted, roomy = AdapterSlots(CFG, "t2va", 2, 4, torch.float32), AdapterSlots(CFG, "t2va", 4, 64, torch.float32)
    for slots, (slot_a, slot_b) in ((fitted, (0, 1)), (roomy, (3, 1))):
        slots.load(slot_a, a)
        slots.load(slot_b, b)
    base = model(state)
    want_run, got_run = fitted.select([(0, 0.8), (1, -0.4)]), roomy.select([(3, 0.8), (1, -0.4)])
    for got, want in zip(forward(base, got_run), forward(base, want_run)):
        assert torch.equal(got, want)
    for name, bank in fitted.banks.items():
        for mine, theirs in zip(bank, roomy.banks[name]):
            assert torch.equal(gather_rows(mine, want_run.rows.reshape(-1)),
                               gather_rows(theirs, got_run.rows.reshape(-1)))
    x = torch.randn(2, 5, CFG.hidden_size)
    linear = torch.nn.Linear(CFG.hidden_size, 3 * CFG.inner_dim, bias=False)
    got = got_run.block(0, DELTA)("attn.qkv_proj", linear, x)
    assert torch.equal(got, want_run.block(0, DELTA)("attn.qkv_proj", linear, x))


def fp8_block(block, cfg):
    """`block` (bf16) with calibration's FP8Linear on every block linear, scales from each weight's and a fixed input
    amax (a compile test, not a calibration)."""
    from h3trt.calibration.modules import quantized_template
    from h3trt.calibration.recipe import QuantRecipe

    recipe = QuantRecipe("fp8", calib_steps=2)
    weights = {n: block.get_submodule(n).weight.detach().float() for n in recipe.quantized_linears()}
    quantized_template(block, cfg, recipe)
    for name, w in weights.items():
        linear = block.get_submodule(name)
        linear.weight_scale.fill_(w.abs().max().item() / 448)
        linear.weight.copy_(quantize_fp8(w, linear.weight_scale))
        linear.input_scale.fill_(8.0 / 448)
    return block, recipe


def compiled(spec, example, tmp_path):
    """`spec` as `h3trt build --lora-slots` compiles it (torch.export with G dynamic, Inductor), saved and loaded."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from h3trt.build.backends import compile_segment
    from h3trt.engines.loaders import load_segment

    with temporary_cache_dir(str(tmp_path / "cache")):
        (tmp_path / "segments").mkdir(exist_ok=True)
        entry = compile_segment("inductor", spec, example, tmp_path / "segments")
        return load_segment("inductor", {"name": spec.name, **entry}, tmp_path, torch.device("cpu"))


def filled_slots(cfg, g) -> AdapterSlots:
    """Two bf16 slots of max rank 24 on layer 0: slot 0 of rank 24, slot 1 of rank 9 (rows past 9 zero)."""
    slots = AdapterSlots(cfg, "t2va", 2, 24, torch.bfloat16)
    for down, up in slots.by_block[0].values():
        for bank in (down, up):
            bank.copy_(torch.randn(bank.shape, generator=g) / bank.shape[-1] ** 0.5)
            bank[1, :, 9:] = 0
    slots.records.update({0: slots_record(24), 1: slots_record(9)})
    return slots


# Evaluations with 2, 3 and 6 row groups: one adapter, two, one taken thrice.
ROW_SETS = (([(1, 0.9)], 2), ([(0, 0.5), (1, -1.1)], 3), ([(0, 0.5), (0, 0.25), (0, 0.1), (1, 0.6)], 6))


def block_under_test(precision: str):
    """The tiny block (bf16, or with FP8 linears), its inputs, and its recipe."""
    from h3trt.models.config import H3Config

    cfg = H3Config.tiny()
    block, inputs = tiny_block_inputs(cfg)
    recipe = None
    if precision == "fp8":
        block, recipe = fp8_block(block, cfg)
    return cfg, block, inputs, recipe


@pytest.mark.build
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_compiled_twin_takes_any_row_count_without_compiling_and_equals_eager(precision, tmp_path):
    """block_lora as `h3trt build --lora-slots` compiles it: evaluations with 2, 3 and 6 row groups run the one
    artifact under the no-compile guard and equal the eager function (bf16: 1e-2, its rounding in two fusions)."""
    from h3trt.adapters.slots import BLOCK_TARGETS
    from h3trt.build.examples import lora_examples
    from h3trt.build.segments import block_lora_segment, block_segment
    from h3trt.engines.guard import no_compile
    from h3trt.engines.manifest import AdapterSlotsRecord

    cfg, block, (x, mod, adaln_index, rope), recipe = block_under_test(precision)
    plain = block_segment(cfg, torch.bfloat16, recipe)
    twin = block_lora_segment(plain, cfg, torch.bfloat16, recipe, "sdpa", BLOCK_TARGETS)
    assert twin.inputs[-2:] == list(LORA_INPUTS) and twin.dynamic["lora_rows"] == {0: "G"}
    tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}
    weights = [tensors[n] for n in plain.weights]
    g = torch.Generator().manual_seed(3)
    example = lora_examples([x, mod, adaln_index, *rope, *weights], twin, cfg, AdapterSlotsRecord(2, 24, BLOCK_TARGETS),
                            g)
    slots = filled_slots(cfg, g)
    segment = compiled(twin, example, tmp_path)
    inputs = slots.block_inputs(0)
    with torch.no_grad(), no_compile():
        for uses, groups in ROW_SETS:
            run = slots.select(uses)
            assert run.rows.shape == (groups, ROW_GROUP)
            args = [x, mod, adaln_index, *rope, run.rows, run.row_scales, *weights,
                    *[inputs[n] for n in twin.lora]]
            want = twin.fn(*args)
            got = segment(*args)[0]
            assert rel(got, want) <= 1e-2 and rel(want, plain.fn(x, mod, adaln_index, *rope, *weights)) > 1e-2


# The compiled pre half's q/k/v against its eager function: FP8's leave two FP8 GEMMs (the rows in the base's) with
# no residual stream to dilute e4m3's rounding, which the compiled and the eager code meet on bf16 inputs rounded in
# different fusions (measured 1.5e-2 to 1.9e-2; bf16: 3e-3).
QKV_TOL = {"bf16": 1e-2, "fp8": 5e-2}


@pytest.mark.build
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_compiled_halves_twins_take_any_row_count_and_compose_to_the_block_twin(precision, tmp_path):
    """block_pre_lora and block_post_lora (`h3trt build --sparse-attention --lora-slots`), compiled as the build
    compiles them: evaluations with 2, 3 and 6 row groups run the two artifacts under the no-compile guard; each
    equals its eager function (bf16: 1e-2), and pre -> attention -> post equals the fused block_lora's eager function
    on the same rows (the same arithmetic, cut in two), while the adapters move it by more than 1e-2."""
    from h3trt.adapters.slots import BLOCK_TARGETS, segment_lora_names
    from h3trt.build.examples import lora_examples
    from h3trt.build.segments import (block_lora_segment, block_post_segment, block_pre_segment, block_segment,
                                      half_lora_segment)
    from h3trt.engines.bundle import one_rank_exchange
    from h3trt.engines.guard import no_compile
    from h3trt.engines.manifest import AdapterSlotsRecord
    from h3trt.models.dit import sdpa_attention

    cfg, block, (x, mod, adaln_index, rope), recipe = block_under_test(precision)
    tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}
    pre, post = block_pre_segment(cfg, torch.bfloat16, 1, recipe), block_post_segment(cfg, torch.bfloat16, recipe)
    twins = [half_lora_segment(h, cfg, torch.bfloat16, recipe, BLOCK_TARGETS) for h in (pre, post)]
    assert [t.name for t in twins] == ["block_pre_lora", "block_post_lora"]
    assert twins[0].lora + twins[1].lora == segment_lora_names(BLOCK_TARGETS)  # each half's own linears, all of them
    assert twins[0].lora == ["attn.qkv_proj.lora_down", "attn.qkv_proj.lora_up"]
    g = torch.Generator().manual_seed(3)
    w_pre, w_post = ([tensors[n] for n in h.weights] for h in (pre, post))
    with torch.no_grad():
        attn = one_rank_exchange(pre.fn(x, mod, adaln_index, *rope, *w_pre), sdpa_attention)
    record = AdapterSlotsRecord(2, 24, BLOCK_TARGETS)
    examples = [lora_examples([x, mod, adaln_index, *rope, *w_pre], twins[0], cfg, record, g),
                lora_examples([x, attn, mod, adaln_index, *w_post], twins[1], cfg, record, g)]
    segments = [compiled(t, e, tmp_path) for t, e in zip(twins, examples)]
    plain = block_segment(cfg, torch.bfloat16, recipe)
    block_twin = block_lora_segment(plain, cfg, torch.bfloat16, recipe, "sdpa", BLOCK_TARGETS)
    w_block = [tensors[n] for n in plain.weights]
    slots = filled_slots(cfg, g)
    inputs = slots.block_inputs(0)
    with torch.no_grad(), no_compile():
        for uses, groups in ROW_SETS:
            run = slots.select(uses)
            assert run.rows.shape == (groups, ROW_GROUP)
            rows = (run.rows, run.row_scales)
            pre_args = [x, mod, adaln_index, *rope, *rows, *w_pre, *[inputs[n] for n in twins[0].lora]]
            qkv = segments[0](*pre_args)[0]
            assert rel(qkv, twins[0].fn(*pre_args)) <= QKV_TOL[precision]
            post_args = [x, one_rank_exchange(qkv, sdpa_attention), mod, adaln_index, *rows, *w_post,
                         *[inputs[n] for n in twins[1].lora]]
            got = segments[1](*post_args)[0]
            assert rel(got, twins[1].fn(*post_args)) <= 1e-2
            want = block_twin.fn(x, mod, adaln_index, *rope, *rows, *w_block, *[inputs[n] for n in block_twin.lora])
            assert rel(got, want) <= 1e-2 and rel(want, plain.fn(x, mod, adaln_index, *rope, *w_block)) > 1e-2


def slots_record(rank: int):
    from h3trt.adapters.slots import SlotRecord

    return SlotRecord("f.safetensors", "f.safetensors", "0" * 64, "test", "alpha-less", "transformer", rank,
                      (), 0)
