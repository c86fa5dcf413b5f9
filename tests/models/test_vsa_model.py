"""A FastH3-VSA model in h3trt (the tiny twin: H3Config.tiny(vsa_gate=True)): the gate parameter loads from a
checkpoint in native and diffusers names and lands in `blocks.{i}.attn.to_gate_compress.weight`; a block's VSA
attention takes the gate projected from its modulated input; the eager DiT runs each main block's VSA at the
evaluation's and the layer's sparsity (dense first steps, dense layers, sparsity 0 = dense + coarse branch) against
a block loop written from the definition (models/vsa/routing.py vsa_reference); Ulysses sp=2 over gloo equals sp=1 (the
gate travels with q/k/v through the all-to-all); the refusals.

Tolerances: fp32 weights; the DiT against the hand loop differs in summation order only (1e-5 relative, norm);
sp=2 against sp=1 as tests/parallel/test_ulysses.py (1e-5).
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from h3trt.errors import UserError
from h3trt.models.checkpoint.reader import CheckpointError, load_dit
from h3trt.models.checkpoint.writer import diffusers_state_dict, random_state_dict, save_diffusers, save_official
from h3trt.models.config import NUM_MODALITIES, H3Config
from h3trt.models.dit import EagerDiT, build_dit
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.runner import EvalExtras
from h3trt.models.sampler import Schedule
from h3trt.models.vsa.routing import vsa_reference
from h3trt.models.vsa.plan import VsaRun, VsaServing, VsaSettings, vsa_settings
from h3trt.models.vsa.tiles import layout_geometry
from h3trt.parallel.ulysses import forward_sp

from helpers import dit_inputs

pytestmark = pytest.mark.unit

CFG = H3Config.tiny(vsa_gate=True, num_layers=3)
REL_TOL = 1e-5


def vsa_model(seed=0):
    model = build_dit(CFG, torch.float32)
    model.load_state_dict(random_state_dict(CFG, seed))
    return model


def layout(keyframes=(), text=70):
    return pack_t2va(text_tags_for(text), 9, 10, 12, 11, keyframes=keyframes)  # grid 9 x 5 x 6: ragged on t and h


def hand_forward(model, video, audio, text, unique_t, t_index, lay, sparsity_of_layer):
    """The DiT written out block by block, each block's attention the definition (vsa_reference)."""
    x, temb = model.embed(video, audio, text, unique_t, lay.video_index, lay.audio_index, lay.text_index, lay.seq_len)
    adaln_index = t_index * NUM_MODALITIES + lay.token_tags
    rope = model.rope(lay.position_ids)
    geometry = layout_geometry(lay)
    for i, block in enumerate(model.blocks):
        mod = block.modulation(temb)
        q, k, v, gate = block.pre_attention(x, mod, adaln_index, rope)
        h = block.norm1(x) * (1.0 + mod[:, 1].index_select(0, adaln_index)) + mod[:, 0].index_select(0, adaln_index)
        torch.testing.assert_close(gate, (h @ block.attn.to_gate_compress.weight.T).view(q.shape))  # no activation
        attn = vsa_reference(q, k, v, gate, geometry, sparsity_of_layer(i))
        x = block.post_attention(x, attn, mod, adaln_index)
    return model.final(x, temb, t_index, lay.video_index, lay.audio_index)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# ---- the parameter -------------------------------------------------------------------------------------------------

def test_gate_only_in_main_blocks():
    names = [n for n, _ in build_dit(CFG, torch.float32, "meta").named_parameters() if "gate_compress" in n]
    assert names == [f"blocks.{i}.attn.to_gate_compress.weight" for i in range(CFG.num_layers)]
    full = build_dit(H3Config(vsa_gate=True), torch.bfloat16, "meta")
    assert full.blocks[0].attn.to_gate_compress.weight.shape == (7168, 5376)  # [heads * head_dim, hidden]
    assert full.blocks[0].attn.to_gate_compress.bias is None
    assert not any("gate_compress" in n for n, _ in build_dit(H3Config.tiny(), torch.float32, "meta").named_parameters())


@pytest.mark.parametrize("layout_name", ["native", "diffusers"])
def test_gate_loads_from_a_checkpoint(tmp_path, layout_name):
    state = random_state_dict(CFG, 3)
    if layout_name == "native":
        save_official(tmp_path, CFG, {"FL2VA": state}, torch.float32)
        where = tmp_path
        assert "blocks.1.attn.to_gate_compress.weight" in json.loads(
            (tmp_path / "FL2VA/transformer/model.safetensors.index.json").read_text())["weight_map"]
    else:
        save_diffusers(tmp_path, CFG, {"transformer": state}, torch.float32)
        where = tmp_path
        assert "transformer_blocks.1.attn.to_gate_compress.weight" in diffusers_state_dict(state, CFG)
    model, source = load_dit(where, "t2va", torch.float32)
    assert source.config.vsa_gate and model.cfg.vsa_gate
    for i in range(CFG.num_layers):
        assert torch.equal(model.blocks[i].attn.to_gate_compress.weight, state[f"blocks.{i}.attn.to_gate_compress.weight"])


def test_a_block_without_its_gate_is_a_missing_key(tmp_path):
    state = random_state_dict(CFG, 3)
    del state["blocks.2.attn.to_gate_compress.weight"]
    save_official(tmp_path, CFG, {"FL2VA": state}, torch.float32)
    with pytest.raises(CheckpointError, match=r"missing keys \(1\):\n    blocks.2.attn.to_gate_compress.weight"):
        load_dit(tmp_path, "t2va", torch.float32)


# ---- the eager DiT ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keyframes", [(), ("first",)])
def test_eager_dit_matches_the_definition_per_evaluation_and_layer(keyframes):
    model, lay = vsa_model(), layout(keyframes)
    video, audio, text = dit_inputs(lay, CFG, seed=1)
    unique_t, t_index = row_timesteps(lay, 0.4, 0.7)
    settings = vsa_settings(0.6, 1, (2,), CFG.num_layers)
    run = VsaRun(VsaServing(settings, "reference"))
    dit = EagerDiT(model, vsa=VsaServing(settings, "reference"))
    with torch.no_grad():
        outs = []
        for evaluation in range(2):
            run.next_evaluation()
            got = dit(video, audio, text, unique_t, t_index, lay, EvalExtras(sparse=run))
            want = hand_forward(model, video, audio, text, unique_t, t_index, lay,
                                lambda i: 0.0 if evaluation < 1 or i == 2 else 0.6)
            for g, w in zip(got, want):
                assert rel(g, w) <= REL_TOL
            outs.append(got)
        dense_all = hand_forward(model, video, audio, text, unique_t, t_index, lay, lambda i: 0.0)
    assert rel(outs[0][0], dense_all[0]) <= REL_TOL and rel(outs[1][0], dense_all[0]) > 1e-3  # it did go sparse
    report = run.report()
    assert report["sparse_evaluations"] == [1] and report["mode"] == "vsa" and 0 < report["kept_fraction"] < 1


def test_eager_dit_needs_its_vsa_run():
    model, lay = vsa_model(), layout()
    video, audio, text = dit_inputs(lay, CFG)
    unique_t, t_index = row_timesteps(lay, 0.4, 0.7)
    with pytest.raises(ValueError, match="VsaRun"), torch.no_grad():
        EagerDiT(model)(video, audio, text, unique_t, t_index, lay)
    with pytest.raises(ValueError, match="VSA's attention"), torch.no_grad():
        model(video, audio, text, unique_t, t_index, lay.token_tags, lay.position_ids, lay.video_index,
              lay.audio_index, lay.text_index)


def test_settings_refusals():
    assert vsa_settings() == VsaSettings(0.9, 0, ())
    for kwargs, flag in (({"sparsity": 1.0}, "--vsa-sparsity"), ({"dense_first_steps": -1}, "--vsa-dense-first"),
                         ({"dense_layers": [3], "num_layers": 3}, "--vsa-dense-layers"),
                         ({"dense_layers": [1, 1]}, "--vsa-dense-layers")):
        with pytest.raises(UserError, match=flag):
            vsa_settings(**kwargs)


# ---- Ulysses ---------------------------------------------------------------------------------------------------------

def _worker(rank, world, store, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model, lay = vsa_model(), layout(("first",), text=71)
        video, audio, text = dit_inputs(lay, CFG, seed=2)
        unique_t, t_index = row_timesteps(lay, 0.4, 0.7)
        settings = vsa_settings(0.6, 0, (1,), CFG.num_layers)
        for runner in ("sp", "one"):
            run = VsaRun(VsaServing(settings, "reference"))
            run.next_evaluation()
            with torch.no_grad():
                if runner == "sp":
                    got = forward_sp(model, dist.group.WORLD, video, audio, text, unique_t, t_index, lay,
                                     EvalExtras(sparse=run))
                else:
                    want = EagerDiT(model)(video, audio, text, unique_t, t_index, lay, EvalExtras(sparse=run))
        errors = [rel(g, w) for g, w in zip(got, want)]
        (out_dir / f"rank{rank}.json").write_text(json.dumps(errors))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_sp2_matches_sp1(tmp_path):
    """Each rank routes its own head after the exchange, the gate exchanged with q/k/v; the sequence (71 text + 30
    keyframe + 22 audio + 270 video = 393 rows) is odd, so the last rank holds a padding row."""
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), tmp_path), nprocs=2, join=True)
    for rank in range(2):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert max(errors) <= REL_TOL, f"rank {rank}: relative errors {errors}"


# ---- calibration -----------------------------------------------------------------------------------------------------

def test_calibration_trajectories_attend_with_vsa(tiny_root, tmp_path):
    """An fp8 build calibrates a FastH3-VSA model on trajectories that attend as it serves: VSA at its settings, the
    calibration's core as the dense attention (here: only the first, dense step calls it, once per block)."""
    from h3trt.calibration.trajectories import trajectory_forward
    from h3trt.models.dit import sdpa_attention
    from h3trt.models.tiny import write_tiny_vsa_checkpoint

    root = write_tiny_vsa_checkpoint(tiny_root, tmp_path / "vsa")
    model, source = load_dit(root, "t2va", torch.float32)
    dense_calls = []

    def core(q, k, v):
        dense_calls.append(q.shape[1])
        return sdpa_attention(q, k, v)

    forward = trajectory_forward(model, source.component_root, ["a fox"], Schedule(3, 12.0, 3.0), 160, 96, 5.0,
                                 log=lambda m: None, vsa=VsaServing(VsaSettings(0.5, 1, ()), "reference"))
    forward(core)  # 2 evaluations: the first dense, the second sparse
    assert len(dense_calls) == model.cfg.num_layers
    with pytest.raises(ValueError, match="VsaRun"):
        trajectory_forward(model, source.component_root, ["a fox"], Schedule(3, 12.0, 3.0), 160, 96, 5.0,
                           log=lambda m: None)(core)
