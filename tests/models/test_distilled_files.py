"""The distilled families' files fused into the tiny DiT, each against a merge computed by hand in diffusers' names:
the base weights converted by diffusers' own converter, the file's rule applied there (B @ A, .diff, .diff_b, the
alpha of each family), and h3trt's fused native weights converted the same way must equal it tensor by tensor. That
covers every key kind, the fc1 half order ([value; gate] in diffusers, [gate; value] native) and the QKV rows."""

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from safetensors.torch import load_file, save_file

from h3trt.errors import UserError
from h3trt.models.checkpoint.writer import random_state_dict
from h3trt.models.config import H3Config
from h3trt.models.checkpoint.reader import load_dit
from h3trt.models.distilled.families import FASTH3_LORA_VSA, DistilledSpec, load_distilled
from h3trt.models.distilled.files import DistilledError
from h3trt.models.distilled.merge import merge_distilled
from h3trt.models.distilled.writer import fasth3_header, write_fasth3, write_pdd, write_turbo
from h3trt.models.dit import build_dit

CFG = H3Config.tiny()


@pytest.fixture(scope="module")
def base():
    return random_state_dict(CFG, 0)


def diffusers_state(native: dict) -> dict:
    model = MiniMaxH3Transformer3DModel(**CFG.to_diffusers_kwargs())
    return convert_minimax_h3_transformer_checkpoint_to_diffusers(dict(native), model.config)


def fused(base, spec, task="t2va"):
    model = build_dit(CFG, torch.float32)
    model.load_state_dict(base)
    distilled = load_distilled(spec, CFG, task)
    record = merge_distilled(model, distilled)
    return diffusers_state(model.state_dict()), record, distilled


def by_hand(base, terms):
    """The base in diffusers names, each (name, delta) added in fp64 (the exact sum; h3trt's is fp32)."""
    want = {k: v.double() for k, v in diffusers_state(base).items()}
    for name, delta in terms:
        want[name] = want[name] + delta.double()
    return want


def assert_equal_states(got, want, changed):
    assert set(got) == set(want)
    for name in want:
        err = (got[name].double() - want[name]).abs().max().item()
        scale = want[name].abs().max().item()
        assert err <= 2e-6 * max(scale, 1.0), f"{name}: {err:.3e}"
    assert len(changed) > 0


def test_fasth3_every_key_kind_matches_the_hand_merge(base, tmp_path):
    path = write_fasth3(tmp_path / "fasth3.safetensors", CFG, seed=3)
    tensors = load_file(str(path))
    terms = []
    for key, t in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            terms.append((f"{module}.weight", tensors[f"{module}.lora_B.weight"].double() @ t.double()))  # scale 1
        elif key.endswith(".diff_b"):
            terms.append((key.removesuffix(".diff_b") + ".bias", t))
        elif key.endswith(".diff"):
            terms.append((key.removesuffix(".diff") + ".weight", t))
    got, record, distilled = fused(base, DistilledSpec(path))
    assert_equal_states(got, by_hand(base, terms), terms)
    kinds = {k.rsplit(".", 1)[-1] for k in tensors}
    assert {"diff", "diff_b", "weight"} <= kinds  # .diff, .diff_b and the lora_A/lora_B pairs all present
    assert any("ff.net.0.proj.lora_B" in k for k in tensors) and any("norm_out.norm.diff" == k for k in tensors)
    assert record["family"] == "fasth3" and record["low_rank_tensors"] == int(fasth3_header(tensors, 4)[
        "low_rank_tensors"]) and distilled.serving.tasks == ("t2va",)
    assert record["schedule"]["rungs"] == [0.999, 0.749, 0.5, 0.25]


def test_fasth3_fc1_half_order_is_swapped_into_native(base, tmp_path):
    """A delta on diffusers ff.net.0.proj's first half ([value; ...]) lands on native fc1's second half."""
    rows = 2 * CFG.ffn_dim
    diff = torch.zeros(rows, CFG.hidden_size)
    diff[: CFG.ffn_dim] = 1.0  # diffusers' first half: the value rows
    tensors = {"transformer_blocks.0.ff.net.0.proj.diff": diff}
    path = tmp_path / "fc1.safetensors"
    save_file(tensors, str(path), fasth3_header(tensors, 4))
    model = build_dit(CFG, torch.float32)
    model.load_state_dict(base)
    merge_distilled(model, load_distilled(DistilledSpec(path), CFG, "t2va"))
    delta = model.blocks[0].mlp.fc1.weight - base["blocks.0.mlp.fc1.weight"]
    assert torch.allclose(delta[CFG.ffn_dim:], torch.ones(CFG.ffn_dim, CFG.hidden_size))  # native [gate; value]
    assert delta[: CFG.ffn_dim].abs().max() == 0


def test_fasth3_vsa_file_makes_a_fasth3_vsa_model_of_a_base_checkpoint(tiny_root, tmp_path):
    """A fastvideo-lora-v2 file with `.set_weight` gates fused into a base checkpoint (no gates of its own): the model
    is built with the gate (vsa_gate), every block's gate is the file's tensor, the rest fused as for the dense file,
    and what it was distilled at (0.9, 64-token tiles) is the distilled record's `vsa`."""
    path = write_fasth3(tmp_path / "vsa.safetensors", CFG, seed=4, gates=True)
    distilled = load_distilled(DistilledSpec(path), CFG, "t2va")
    assert distilled.fusion.counts["set_weight_tensors"] == CFG.num_layers
    assert sorted(distilled.fusion.assigned()) == [f"blocks.{i}.attn.to_gate_compress.weight"
                                                   for i in range(CFG.num_layers)]
    assert distilled.serving.vsa == {"trained_sparsity": 0.9, "tile_size": 64, "from": FASTH3_LORA_VSA}
    assert distilled.serving.with_gates(CFG).vsa_gate and distilled.record()["vsa"]["trained_sparsity"] == 0.9
    base, _ = load_dit(tiny_root, "t2va", torch.float32)
    assert not base.cfg.vsa_gate  # the tiny base checkpoint has no gate
    model, source = load_dit(tiny_root, "t2va", torch.float32, supplied=distilled.fusion.assigned())
    assert model.cfg.vsa_gate and source.config.vsa_gate
    merge_distilled(model, distilled)
    want = load_file(str(path))
    for i in range(CFG.num_layers):
        assert torch.equal(model.blocks[i].attn.to_gate_compress.weight,
                           want[f"transformer_blocks.{i}.attn.to_gate_compress.set_weight"])
    assert not torch.equal(model.blocks[0].mlp.fc1.weight, base.blocks[0].mlp.fc1.weight)  # the rest fused too
    # A model built without the gate (not through load_dit's `supplied`) refuses before anything changes.
    plain = build_dit(CFG, torch.float32)
    plain.load_state_dict(base.state_dict())
    with pytest.raises(DistilledError, match="a VSA gate, but this model has none"):
        merge_distilled(plain, distilled)
    assert torch.equal(plain.blocks[0].mlp.fc1.weight, base.blocks[0].mlp.fc1.weight)


def test_fasth3_file_with_some_blocks_gates_is_refused(tmp_path):
    from h3trt.models.distilled.writer import fasth3_tensors

    tensors = fasth3_tensors(CFG, 1, gates=True)
    del tensors["transformer_blocks.1.attn.to_gate_compress.set_weight"]
    path = tmp_path / "partial.safetensors"
    save_file(tensors, str(path), fasth3_header(tensors, 4))  # its counts consistent: only the gates are short
    with pytest.raises(DistilledError, match="sets the VSA gate .* of 1 of the 2 main blocks") as info:
        load_distilled(DistilledSpec(path), CFG, "t2va")
    assert "\n" not in str(info.value)


def test_pdd_trunk_matches_the_hand_merge_with_alpha_over_rank(base, tmp_path):
    path = write_pdd(tmp_path / "pdd.safetensors", CFG, seed=5, rank=4, alpha=2.0)
    tensors = load_file(str(path))
    terms = [(k.removesuffix(".lora_down") + ".weight",
              tensors[k.removesuffix("_down") + "_up"].double() @ t.double() * (2.0 / 4))
             for k, t in tensors.items() if k.endswith(".lora_down")]
    assert any(".adaln_proj.linear." in name for name, _ in terms)
    got, record, distilled = fused(base, DistilledSpec(path))
    # The heads are per forward (models/distilled/pdd.py), not merged into proj_out: the trunk alone is compared.
    assert_equal_states(got, by_hand(base, terms), terms)
    assert record["family"] == "pdd" and distilled.plan.schedule.steps == 9
    assert set(distilled.heads) == {"video_out.weight", "video_out.bias", "audio_out.weight", "audio_out.bias"}


@pytest.mark.parametrize("alpha,scale", [(None, 8.0 / 8), ("16", 16.0 / 8)])
def test_turbo_peft_root_and_alpha_rules(base, tmp_path, alpha, scale):
    """LightX2V's PEFT dump with `base_model.model.`: alpha from the header, else the family default 8 (here rank 8:
    scale 1 either way for the default, so rank 16 checks it is not alpha == rank)."""
    path = write_turbo(tmp_path / "turbo.safetensors", CFG, seed=6, rank=16, alpha=None if alpha is None else 16,
                       metadata={"h3trt.steps": "5", "h3trt.video_shift": "6"})
    tensors = load_file(str(path))
    want_scale = (8.0 if alpha is None else 16.0) / 16
    terms = [(k.removeprefix("base_model.model.").removesuffix(".lora_A.default.weight") + ".weight",
              tensors[k.replace("lora_A", "lora_B")].double() @ t.double() * want_scale)
             for k, t in tensors.items() if ".lora_A." in k]
    got, record, distilled = fused(base, DistilledSpec(path))
    assert_equal_states(got, by_hand(base, terms), terms)
    assert record["family"] == "turbo" and distilled.plan.schedule.steps == 5
    assert (distilled.plan.schedule.video_shift, distilled.plan.schedule.audio_shift) == (6.0, 3.0)


def test_turbo_without_a_schedule_is_refused_naming_the_table(tmp_path):
    path = write_turbo(tmp_path / "t.safetensors", CFG, rank=8)
    with pytest.raises(DistilledError, match="states no schedule.*@steps=5,video_shift=6.*sources conflict"):
        load_distilled(DistilledSpec(path), CFG, "t2va")
    spec = DistilledSpec.parse(f"{path}@steps=9,video_shift=12,alpha=8")
    assert load_distilled(spec, CFG, "t2va").plan.schedule.steps == 9


@pytest.mark.parametrize("edit,match", [
    (lambda t, h: h.update(low_rank_tensors="2"), "declares low_rank_tensors=2 but the file holds"),
    (lambda t, h: h.pop("diff_tensors"), "omits diff_tensors"),
    (lambda t, h: h.update(base_model="Wan-AI/Wan2.1"), "another base model"),
    (lambda t, h: t.update({"proj_in.diff_m": torch.zeros(3)}), r"proj_in.diff_m .*does not know what a .diff_m"),
    (lambda t, h: t.update({"proj_in.lora_C": torch.zeros(3)}), "none of .lora_A"),
    (lambda t, h: t.update({"proj_in.diff": torch.zeros(5, 5)}), "a file for another model size"),
])
def test_fasth3_refusals_are_one_line(tmp_path, edit, match):
    from h3trt.models.distilled.writer import fasth3_tensors

    tensors = fasth3_tensors(CFG, 1)
    header = fasth3_header(tensors, 4)
    edit(tensors, header)
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), header)
    model = build_dit(CFG, torch.float32)
    with pytest.raises(UserError, match=match) as info:
        merge_distilled(model, load_distilled(DistilledSpec(path), CFG, "t2va"))
    assert "\n" not in str(info.value)


def test_family_detection_and_spec_refusals(tmp_path):
    turbo = write_turbo(tmp_path / "t.safetensors", CFG, rank=8, metadata={"h3trt.steps": "5",
                                                                            "h3trt.video_shift": "12"})
    with pytest.raises(DistilledError, match="serves \\['ref2va'\\]|names no distilled family"):
        bare = tmp_path / "bare.safetensors"
        save_file({"x.weight": torch.zeros(2)}, str(bare))
        load_distilled(DistilledSpec(bare), CFG, "t2va")
    with pytest.raises(UserError, match="is a turbo file, which takes .* not \\['grid'\\]"):
        load_distilled(DistilledSpec.parse(f"{turbo}@grid=uniform"), CFG, "t2va")
    fasth3 = write_fasth3(tmp_path / "f.safetensors", CFG)
    with pytest.raises(DistilledError, match="serves \\['t2va'\\] only, not ref2va"):
        load_distilled(DistilledSpec(fasth3), CFG, "ref2va")
    with pytest.raises(UserError, match="family must be one of"):
        DistilledSpec.parse(f"{fasth3}@family=lcm")
    pdd = write_pdd(tmp_path / "p.safetensors", CFG)
    with pytest.raises(DistilledError, match="PDD runs 4, 6 or 8 forwards"):
        load_distilled(DistilledSpec.parse(f"{pdd}@steps=6"), CFG, "t2va")
