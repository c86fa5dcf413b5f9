"""Checkpoint loading: the official, diffusers and Comfy layouts agree, and bad checkpoints fail with one clear error."""

import json
import shutil

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from safetensors.torch import load_file, save_file

from h3trt.models.checkpoint.reader import CheckpointError, load_dit, locate_transformer
from h3trt.models.weight_layout import deinterleave_qkv, interleave_qkv
from h3trt.models.checkpoint.writer import diffusers_state_dict
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for

from helpers import dit_inputs


def _forward(model, cfg):
    layout = pack_t2va(text_tags_for(6), 2, 4, 4, 5)
    video, audio, text = dit_inputs(layout, cfg, seed=3)
    t, ti = row_timesteps(layout, 0.2, 0.4)
    with torch.no_grad():
        return model(video, audio, text, t, ti, layout.token_tags, layout.position_ids, layout.video_index,
                     layout.audio_index, layout.text_index)


@pytest.mark.parametrize("task", ["t2va", "ref2va"])
def test_three_layouts_give_identical_outputs(task, tiny_cfg, tiny_checkpoints, tiny_states):
    official, src = load_dit(tiny_checkpoints["official"], task, torch.float32)
    assert (src.naming, src.qkv_interleaved) == ("native", True)
    assert src.metadata.video_shift == 12.0 and src.metadata.audio_shift == 3.0
    diffusers, src = load_dit(tiny_checkpoints["diffusers"], task, torch.float32)
    assert src.naming == "diffusers"
    want = _forward(official, tiny_cfg)
    for a, b in zip(want, _forward(diffusers, tiny_cfg)):
        assert torch.equal(a, b)
    if task == "t2va":  # the Comfy file holds the FL2VA weights only
        comfy, src = load_dit(tiny_checkpoints["comfy"], task, torch.float32)
        assert (src.prefix, src.qkv_interleaved) == ("model.diffusion_model.", False)
        assert src.config == tiny_cfg  # inferred from shapes: the file has no config.json
        for a, b in zip(want, _forward(comfy, tiny_cfg)):
            assert torch.equal(a, b)
    # The weights are the ones written, QKV de-interleaved back to [q; k; v].
    part = "FL2VA" if task == "t2va" else "Ref2VA"
    for key, value in tiny_states[part].items():
        assert torch.equal(official.state_dict()[key], value), key


def test_partitions_hold_different_weights(tiny_checkpoints):
    a, _ = load_dit(tiny_checkpoints["official"], "fl2va", torch.float32)
    b, _ = load_dit(tiny_checkpoints["official"], "ref2va", torch.float32)
    assert not torch.equal(a.blocks[0].attn.qkv_proj.weight, b.blocks[0].attn.qkv_proj.weight)


def test_qkv_interleave_roundtrip_and_order():
    heads, hd = 3, 4
    q, k, v = (torch.full((heads * hd, 2), float(i)) + torch.arange(heads * hd)[:, None] * 10 for i in range(3))
    stacked = torch.cat([q, k, v])
    inter = interleave_qkv(stacked, heads, hd)
    # Official row order: [h0: q k v, h1: q k v, ...]
    assert torch.equal(inter[:hd], q[:hd]) and torch.equal(inter[hd:2 * hd], k[:hd])
    assert torch.equal(inter[2 * hd:3 * hd], v[:hd]) and torch.equal(inter[3 * hd:4 * hd], q[hd:2 * hd])
    assert torch.equal(deinterleave_qkv(inter, heads, hd), stacked)


def test_name_mapping_matches_diffusers_converter(tiny_cfg, tiny_states):
    """Our native -> diffusers mapping equals diffusers' own single-file converter on the same tensors."""
    native = tiny_states["FL2VA"]
    config = MiniMaxH3Transformer3DModel(**tiny_cfg.to_diffusers_kwargs()).config
    theirs = convert_minimax_h3_transformer_checkpoint_to_diffusers(dict(native), config, qkv_layout="stacked")
    ours = diffusers_state_dict(native, tiny_cfg)
    assert set(ours) == set(theirs)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_diffusers_loads_the_diffusers_layout_we_write(tiny_cfg, tiny_checkpoints):
    ref = MiniMaxH3Transformer3DModel.from_pretrained(str(tiny_checkpoints["diffusers"] / "transformer"),
                                                      torch_dtype=torch.float32)
    ours, _ = load_dit(tiny_checkpoints["official"], "t2va", torch.float32)
    layout = pack_t2va(text_tags_for(6), 2, 4, 4, 5)
    video, audio, text = dit_inputs(layout, tiny_cfg, seed=3)  # the tiny config: video rows 96, audio rows 32
    t, ti = row_timesteps(layout, 0.2, 0.4)
    with torch.no_grad():
        b = ref(video, audio, text, t, ti, layout.token_tags, layout.position_ids, layout.video_index,
                layout.audio_index, layout.text_index, return_dict=False)
    for x, y in zip(_forward(ours, tiny_cfg), b):
        assert (x - y).abs().max() <= 1e-5 * y.abs().max()


# ---------------------------------------------------------------------------------------------------------------------
# Strictness and clear errors


@pytest.fixture
def official_copy(tmp_path, tiny_checkpoints):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["official"], dst)
    return dst


def _edit_shard(root, fn):
    folder = root / "FL2VA" / "transformer"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"]["blocks.1.mlp.fc2.weight"]
    tensors = load_file(str(shard))
    fn(tensors)
    save_file(tensors, str(shard))


def test_missing_key_is_named(official_copy):
    _edit_shard(official_copy, lambda t: t.pop("blocks.1.mlp.fc2.weight"))
    with pytest.raises(CheckpointError, match=r"missing keys \(1\):\s+blocks\.1\.mlp\.fc2\.weight"):
        load_dit(official_copy, "t2va")


def test_wrong_shape_is_named(official_copy):
    def shrink(t):
        t["blocks.1.mlp.fc2.weight"] = t["blocks.1.mlp.fc2.weight"][:, :-1].contiguous()
    _edit_shard(official_copy, shrink)
    with pytest.raises(CheckpointError, match=r"shape mismatches \(1\):\s+blocks\.1\.mlp\.fc2\.weight: checkpoint"):
        load_dit(official_copy, "t2va")


def test_all_problems_in_one_error(official_copy):
    def several(t):
        t.pop("blocks.1.mlp.fc2.weight")
        t["blocks.1.mlp.extra.weight"] = torch.zeros(2)
    _edit_shard(official_copy, several)
    with pytest.raises(CheckpointError) as info:
        load_dit(official_copy, "t2va")
    msg = str(info.value)
    assert "blocks.1.mlp.fc2.weight" in msg and "unexpected keys (1)" in msg and "blocks.1.mlp.extra.weight" in msg


def test_corrupted_shard_is_named(official_copy):
    shard = sorted((official_copy / "FL2VA" / "transformer").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"corrupted or truncated"):
        load_dit(official_copy, "t2va")


def test_missing_shard_is_named(official_copy):
    shard = sorted((official_copy / "Ref2VA" / "transformer").glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        locate_transformer(official_copy, "ref2va")


def test_bad_release_metadata(official_copy):
    index_path = official_copy / "FL2VA" / "model_index.json"
    index = json.loads(index_path.read_text())
    index["_minimax_h3"]["schema_version"] = 2
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="schema_version must be 1"):
        locate_transformer(official_copy, "t2va")


def test_task_outside_partition(official_copy):
    with pytest.raises(CheckpointError, match=r"serves \['ref2va'\], not 't2va'"):
        locate_transformer(official_copy / "Ref2VA", "t2va")


def test_missing_model_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        locate_transformer(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="not a MiniMax-H3 checkpoint"):
        locate_transformer(tmp_path)


def test_shard_index_names_two_files_for_one_key(official_copy):
    """A tensor present in two shards is refused rather than silently taking one."""
    folder = official_copy / "FL2VA" / "transformer"
    shards = sorted(folder.glob("*.safetensors"))
    a = load_file(str(shards[0]))
    b = load_file(str(shards[1]))
    key = next(iter(a))
    b[key] = a[key]
    save_file(b, str(shards[1]))
    with pytest.raises(CheckpointError, match="more than one shard"):
        load_dit(official_copy, "t2va")


def test_a_folder_saved_by_diffusers_modular_pipeline_loads_with_its_shifts(tiny_cfg, tiny_states, tiny_checkpoints,
                                                                            tmp_path):
    """diffusers' own MiniMaxH3ModularPipeline.save_pretrained writes modular_model_index.json (no model_index.json)
    and scheduler/ + audio_scheduler/ configs: the folder loads, gives the official layout's outputs, and its shifts
    (here 7 and 2, not the released 12 and 3) are the checkpoint's."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks

    transformer = MiniMaxH3Transformer3DModel(**tiny_cfg.to_diffusers_kwargs())
    transformer.load_state_dict(diffusers_state_dict(tiny_states["FL2VA"], tiny_cfg))
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(transformer=transformer, scheduler=MiniMaxH3Scheduler(shift=7.0),
                           audio_scheduler=MiniMaxH3Scheduler(shift=2.0))
    pipe.save_pretrained(str(tmp_path / "modular"), overwrite_modular_index=True)
    assert (tmp_path / "modular" / "modular_model_index.json").exists()
    assert not (tmp_path / "modular" / "model_index.json").exists()

    source = locate_transformer(tmp_path / "modular", "t2va")
    assert source.naming == "diffusers" and source.shifts == (7.0, 2.0)
    model, _ = load_dit(tmp_path / "modular", "t2va", torch.float32)
    official, _ = load_dit(tiny_checkpoints["official"], "t2va", torch.float32)
    for a, b in zip(_forward(model, tiny_cfg), _forward(official, tiny_cfg)):
        assert torch.equal(a, b)


def test_scheduler_shifts_of_a_diffusers_layout_are_honoured(tiny_checkpoints, tmp_path):
    root = tmp_path / "diffusers"
    shutil.copytree(tiny_checkpoints["diffusers"], root)
    assert locate_transformer(root, "t2va").shifts == (12.0, 3.0)  # no scheduler configs: the released shifts
    (root / "audio_scheduler").mkdir()
    (root / "audio_scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "MiniMaxH3Scheduler",
                                                                                "shift": 5.0}))
    assert locate_transformer(root, "ref2va").shifts == (12.0, 5.0)  # video keeps the released 12
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps({"shift": -1}))
    with pytest.raises(CheckpointError, match="shift must be a positive number"):
        locate_transformer(root, "t2va")


def test_component_files_are_read_back_once_until_they_change(tmp_path, monkeypatch):
    """A server checks the text encoder's files at every admission: a file that read back whole is not read again
    while it is unchanged, and one cut short after that is named at the next check."""
    from h3trt.models.checkpoint import reader as checkpoint

    folder = tmp_path / "text_encoder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8, "pad": "x" * 1000}))
    save_file({"w": torch.zeros(4, 4)}, str(folder / "model.safetensors"))
    reads = []
    read_json = checkpoint._read_json
    monkeypatch.setattr(checkpoint, "_read_json", lambda path: reads.append(path.name) or read_json(path))
    checkpoint.check_component_files(folder, weights=True)
    checkpoint.check_component_files(folder, weights=True)
    assert reads == ["config.json"]
    config = folder / "config.json"
    config.write_bytes(config.read_bytes()[:100])  # cut short after it was checked
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON .*corrupted or truncated"):
        checkpoint.check_component_files(folder, weights=True)
    shard = folder / "model.safetensors"
    config.write_text("{}")
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"model.safetensors is not a readable safetensors file"):
        checkpoint.check_component_files(folder, weights=True)
