"""LoRA adapters in slots beside the weights (h3trt/adapters/slots.py) against the same files merged
(h3trt/adapters/merge.py merge_loras, itself checked against diffusers in tests/adapters/test_lora.py).

The files are test_lora.py's (lora_cases.py writes them), in every layout, restricted to the main blocks' linears
(slots hold only those; the rest is refused, see test_refusals_name_the_problem_and_the_fix). fp32 eager: unmerged
equals merged to ATOL; no adapter is bit-identical to the model that never heard of slots.
"""

import pytest
import torch

from lora_cases import (CFG, FORMATS, LAYOUT, block_factors, fmt_diffusers, fmt_original, forward, layout_file, model,
                        original_factors, write)

from h3trt.adapters import slots as slots_module
from h3trt.adapters.merge import LoraSpec
from h3trt.adapters.slots import AdapterBlock, AdapterSlots
from h3trt.errors import UserError
from h3trt.models.dit import sdpa_attention
from h3trt.models.packing import row_timesteps

ATOL = 1e-5


def assert_close(got, want, base=None):
    for g, w in zip(got, want):
        err = (g - w).abs().max().item()
        assert err <= ATOL, f"max abs err {err:.3e} > {ATOL}"
    if base is not None:  # the adapter moved the output far beyond the tolerance
        assert max((w - b).abs().max().item() for w, b in zip(want, base)) > 100 * ATOL


def slots(n=2, rank=8, **kw) -> AdapterSlots:
    return AdapterSlots(CFG, "t2va", n, rank, torch.float32, **kw)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_unmerged_equals_merged_for_each_layout(name, state, tmp_path):
    path = layout_file(tmp_path, name, 1)
    base = model(state)
    s = slots()
    record = s.load(1, path)
    assert_close(forward(base, s.select([(1, 0.8)])), forward(model(state, [LoraSpec(path, 0.8)])), forward(base))
    assert record.rank == 4 and len(record.sha256) == 64 and record.component == "transformer"
    assert set(record.targets) == {f"blocks.{m.split('.')[1]}.{m.split('.', 2)[2]}" for m in block_factors(1)}


def test_no_adapter_is_the_model_without_slots_bit_for_bit(state, tmp_path, monkeypatch):
    """A slotted model with adapters resident, evaluated without one, runs no side branch at all."""
    plain = forward(model(state))
    s = slots()
    s.load(0, layout_file(tmp_path, "kohya_alpha_tensors", 1))
    dit = model(state)
    assert s.select([]) is None
    monkeypatch.setattr(slots_module, "gather_rows", lambda *a: pytest.fail("the side branch ran"))
    for got, want in zip(forward(dit, s.select([])), plain):
        assert torch.equal(got, want)
    with pytest.raises(pytest.fail.Exception, match="side branch ran"):  # the patch is the one the model calls
        forward(dit, s.select([(0, 1.0)]))


def test_two_adapters_resident_each_evaluation_picks_its_own(state, tmp_path):
    a, b = layout_file(tmp_path, "original_alpha_less", 2), layout_file(tmp_path, "diffusers_adapter_metadata", 3)
    base = model(state)
    s = slots()
    s.load(0, a)
    s.load(1, b)
    want_a, want_b = forward(model(state, [LoraSpec(a, 0.7)])), forward(model(state, [LoraSpec(b, -0.5)]))
    for slot, scale, want in ((0, 0.7, want_a), (1, -0.5, want_b), (0, 0.7, want_a)):  # interleaved
        assert_close(forward(base, s.select([(slot, scale)])), want, forward(base))
    # Both in one evaluation, at their own strengths: the two merged together.
    assert_close(forward(base, s.select([(0, 0.7), (1, -0.5)])),
                 forward(model(state, [LoraSpec(a, 0.7), LoraSpec(b, -0.5)])))
    # A smaller adapter (attention only) replaces slot 0's: nothing of the first one stays behind.
    small = write(tmp_path / "attn.safetensors", fmt_original(block_factors(4, "blocks.0.attn")))
    s.load(0, small)
    assert_close(forward(base, s.select([(0, 1.3)])), forward(model(state, [LoraSpec(small, 1.3)])), forward(base))


def test_unloading_a_slot_empties_it_and_leaves_the_others_bit_for_bit(state, tmp_path):
    base = model(state)
    s = slots()
    s.load(0, layout_file(tmp_path, "musubi_flattened", 1))
    s.load(1, layout_file(tmp_path, "diffsynth_interleaved_qkv", 2))
    before = forward(base, s.select([(1, 1.0)]))
    s.unload(0)
    assert all(not down[0].any() and not up[0].any() for down, up in s.banks.values())
    assert sorted(s.records) == [1]
    for got, want in zip(forward(base, s.select([(1, 1.0)])), before):
        assert torch.equal(got, want)
    with pytest.raises(UserError, match="slot 0 holds no adapter; load one into it first"):
        s.select([(0, 1.0)])
    s.unload(1)
    assert not any(t.any() for pair in s.banks.values() for t in pair)


def one_line_error(match: str, fn, *args):
    with pytest.raises(UserError, match=match) as info:
        fn(*args)
    assert "\n" not in str(info.value)


def test_refusals_name_the_problem_and_the_fix(state, tmp_path):
    rank4 = layout_file(tmp_path, "kohya_alpha_tensors", 1)
    adaln = write(tmp_path / "adaln.safetensors", fmt_original(block_factors(2, "blocks.0.adaln")))  # rank 2
    s = slots(rank=2)
    s.load(0, adaln)
    held = [t.clone() for pair in s.banks.values() for t in pair]
    one_line_error(r"has rank 4, over the slots' max rank 2; create the slots with max rank >= 4", s.load, 0, rank4)
    assert all(torch.equal(t, h) for t, h in zip((t for p in s.banks.values() for t in p), held))  # slot kept
    assert s.records[0].file == "adaln.safetensors"

    for scale in (float("nan"), float("inf"), "1.0"):
        one_line_error(r"LoRA scale .* for slot 0 is not a finite number", s.select, [(0, scale)])
    for slot in (2, -1):
        one_line_error(rf"LoRA slot {slot} does not exist: there are 2 slot\(s\), 0 to 1; pick one", s.select,
                       [(slot, 1.0)])
    one_line_error(r"LoRA slot 5 does not exist", s.load, 5, adaln)
    one_line_error(r"slot 1 holds no adapter", s.select, [(1, 1.0)])

    everything = write(tmp_path / "all.safetensors", fmt_original(original_factors(1)))  # refiner, heads, ...
    one_line_error(r"not a linear of the main blocks'.*Merge this LoRA instead", slots().load, 0, everything)
    one_line_error(r"adapts blocks.0.[a-z_.]+, which these slots do not hold.*create the slots with it among their targets",
                   slots(targets=("attn.qkv_proj",)).load, 0, rank4)
    # lora.py's own refusals come through: the wrong partition, DoRA.
    ref = write(tmp_path / "ref.safetensors", fmt_diffusers(block_factors(2), "transformer_ref"))
    one_line_error(r"trained against the Ref2VA partition", slots().load, 0, ref)
    dora = dict(fmt_original(block_factors(2)), **{"blocks.0.attn.qkv_proj.dora_scale": torch.ones(1, 64)})
    one_line_error(r"is a DoRA adapter", slots().load, 0, write(tmp_path / "dora.safetensors", dora))
    with pytest.raises(UserError, match="at least one slot"):
        slots(n=0)


@pytest.mark.build
def test_a_compiled_block_does_not_recompile_when_the_adapter_changes(state, tmp_path):
    """The block segment's form: the factors and the slot choice are inputs. Loading another adapter into the slot,
    switching slots and strengths: one graph, compiled once (Inductor on the CPU), each call equal to eager."""
    from torch._dynamo.utils import counters

    dit = model(state)
    block = dit.blocks[0]
    s = slots()
    names = list(s.block_inputs(0))

    def block_lora(x, mod, adaln_index, cos, sin, lora_rows, lora_row_scales, *bank):
        lora = AdapterBlock.from_inputs(dict(zip(names, bank)), lora_rows, lora_row_scales)
        return block(x, mod, adaln_index, (cos, sin), sdpa_attention, lora)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block_lora, backend="inductor", dynamic=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, LAYOUT.token_tags.numel(), CFG.hidden_size, generator=g)
    unique_t, t_index = row_timesteps(LAYOUT, 0.3125, 0.55)
    temb = dit.time_embedder(unique_t)
    adaln_index = t_index * 3 + LAYOUT.token_tags
    cos, sin = dit.rope(LAYOUT.position_ids)
    s.load(0, layout_file(tmp_path, "original_alpha_less", 1))
    s.load(1, layout_file(tmp_path, "peft_dump_unprefixed", 2))
    outputs = []
    for load, slot, scale in ((None, 0, 1.0), ("kohya_alpha_tensors", 0, 1.0), (None, 1, 0.5), (None, 0, -2.0)):
        if load:
            s.load(slot, layout_file(tmp_path, load, 3))
        run = s.select([(slot, scale)])
        mod = block.modulation(temb, run.block(0))
        with torch.no_grad():
            got = compiled(x, mod, adaln_index, cos, sin, run.rows, run.row_scales, *s.block_inputs(0).values())
            want = block(x, mod, adaln_index, (cos, sin), sdpa_attention, run.block(0))
        assert (got - want).abs().max().item() <= 1e-4
        outputs.append(got)
    assert not torch.equal(outputs[0], outputs[1])  # the reload reached the compiled code
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_an_fp8_base_takes_the_rows_into_its_own_gemm_and_is_left_untouched(tmp_path):
    """The slots' default dtype is bf16; beside calibration's W8A8 FP8Linear the FUSED layout computes A's rows from
    the base's own e4m3 input and adds the up-projection inside the base's one FP8 GEMM (formats.fp8_adapter_linear),
    never writing to the base's buffers. Tolerance: the adapter's part of the output (y - base(x), fp32 activations,
    peft's scaling folded) within 10% (relative norm) of the bf16 side branch scale * (x @ A^T) @ B^T: e4m3 keeps 3
    mantissa bits, and the rows pass two FP8 GEMMs (the base's own error against its fp32 weights is ~4% here)."""
    from h3trt.calibration.formats import FP8
    from h3trt.calibration.modules import FP8Linear

    s = AdapterSlots(CFG, "t2va", 2, 8)
    assert all(t.dtype == torch.bfloat16 for pair in s.banks.values() for t in pair)
    factors = block_factors(1, "blocks.1.mlp.fc2")
    s.load(1, write(tmp_path / "fc2.safetensors", fmt_original(factors, "diffusion_model.")))
    down, up = factors["blocks.1.mlp.fc2"]
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(CFG.hidden_size, CFG.ffn_dim, generator=g) / CFG.ffn_dim ** 0.5
    base = FP8Linear(CFG.hidden_size, CFG.ffn_dim)
    base.weight_scale.fill_(weight.abs().max() / 448)
    base.weight.copy_((weight / base.weight_scale).to(FP8))
    x = torch.randn(2, 37, CFG.ffn_dim, generator=g)
    base.input_scale.fill_(x.abs().max() / 448)
    held = [t.clone() for t in base.buffers()]
    run = s.select([(1, 0.6)])
    got = run.block(1)("mlp.fc2", base, x)
    assert all(torch.equal(a, b) for a, b in zip(base.buffers(), held))
    want = 0.6 * (x @ down.bfloat16().float().T) @ up.bfloat16().float().T
    err = ((got - base(x)) - want).norm() / want.norm()
    assert err <= 0.10, f"adapter part off the bf16 branch by {err:.3f}"
    assert (got - base(x)).norm() > 0.1 * base(x).norm()  # and it moved the output
    delta = run.block(1, layout=slots_module.DELTA)("mlp.fc2", base, x)  # the bf16 branch beside it: the reference
    assert ((delta - base(x)) - want).norm() / want.norm() < 1e-2
