"""scripts/bench_lora.py's pieces that decide what its GPU rows mean, untimed: the adapter file it writes is read by
the slots as a rank-R adapter on every attention and MLP linear of every block and nothing else (so its
`slots_one_adapter` row measures what issue 38 names), its `old_*` rows carry every row of every slot as the
arithmetic before issue 44 did, and its summary sets each row against the runner without slots with the bars'
direction right."""

import sys

import pytest
import torch

from helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))

import bench_lora  # noqa: E402
import bench_lora_load  # noqa: E402

from h3trt.adapters.slots import AdapterSlots  # noqa: E402
from h3trt.models.config import H3Config  # noqa: E402


def test_the_bench_adapter_loads_into_the_slots_on_every_attention_and_mlp_linear_only(tmp_path):
    cfg = H3Config.tiny()
    path = tmp_path / "adapter.safetensors"
    assert bench_lora_load.write_adapter(path, cfg, 8, 0, torch.device("cpu")) == path.stat().st_size
    slots = AdapterSlots(cfg, "t2va", 2, 8)
    record = slots.load(0, path)
    assert record.rank == 8 and record.layout == "original names"
    assert set(record.targets) == {f"blocks.{i}.{n}" for i in range(cfg.num_layers) for n in bench_lora.ADAPTED}
    for i in range(cfg.num_layers):
        for local in bench_lora.ADAPTED:
            down, up = slots.banks[f"blocks.{i}.{local}"]
            assert down[0].abs().amin(dim=-1).gt(0).all() and up[0].abs().amax() > 0  # all 8 rows filled
            assert not down[1].any() and not up[1].any()
        down, up = slots.banks[f"blocks.{i}.adaln_proj.linear"]
        assert not down.any() and not up.any()  # the bundle's AdaLN slot stays zero: the row adapts what 38 names


def test_the_summary_sets_each_row_against_no_slots_and_checks_the_bars():
    rows = {"ms_per_block": {"no_slots": 100.0, "slots_no_adapter": 101.5, "slots_scale0": 110.0,
                             "slots_one_adapter": 104.0}}
    out = bench_lora.summarise(rows, 50, 120.0)
    assert out["ratio_to_no_slots"]["slots_one_adapter"] == pytest.approx(1.04)
    assert out["bars"]["slots_no_adapter"] == {"ratio": pytest.approx(1.015), "at_most": 1.01, "met": False}
    assert out["bars"]["slots_one_adapter"]["met"] is True
    assert out["ms_per_step_estimate"]["no_slots"] == pytest.approx(5000.0)
    assert out["speedup_vs_reference"]["slots_scale0"] == pytest.approx(120.0 / 110.0)


def test_the_old_rows_carry_every_row_of_every_slot_and_the_new_ones_the_adapters_own(tmp_path):
    cfg = H3Config.tiny()
    slots = AdapterSlots(cfg, "t2va", 2, 24, torch.float32)
    for slot, rank in ((0, 20), (1, 24)):
        path = tmp_path / f"rank{rank}.safetensors"
        bench_lora_load.write_adapter(path, cfg, rank, slot, torch.device("cpu"))
        slots.load(slot, path)
    rows = bench_lora.timed_rows(slots)
    assert rows["no_slots"] == (None, None) and rows["slots_no_adapter"] == ("block_lora", None)
    assert rows["slots_scale0"] == ("block_lora", None)  # not computed: the runner runs the plain block
    twin, one = rows["slots_one_adapter"]
    assert twin == "block_lora" and one.rows.numel() == 32 and one.row_scales.sum().item() == 20  # rank 20, padded
    assert rows["slots_two_adapters"][1].row_scales.sum().item() == 44
    for row, scale in (("old_one_adapter", 1.0), ("old_scale0", 0.0)):
        twin, old = rows[row]
        assert twin == "block_lora_delta" and sorted(set(old.rows.flatten().tolist())) == list(range(48))
        assert old.row_scales.flatten()[:24].tolist() == [scale] * 24 and not old.row_scales.flatten()[24:].any()
    assert rows["delta_one_adapter"][0] == "block_lora_delta"
