"""A build a block at a time (h3trt/build/stream.py) against the whole-DiT build, on the CPU: the same bundle, file by
file; never more than one block's weights (beside the few kept for the compile) materialized at once; the fit check
that picks between them, and its one-line refusal.

The CPU stands in for the GPU through the same code path: `--memory-budget` (or a fake `free_memory`) between the two
needs forces the streamed build, as a GPU too small for the whole DiT does. A pair of full builds (the CLI, fresh
processes: FP8 with SmoothQuant's folded weights, FP8 attention, a block kept in bf16, a merged LoRA, two schedules)
compares every file; the other configurations compare their weight files and records after the bake (the phases that
differ between the two ways), which takes seconds. The distilled files' pair and bakes are
tests/build/test_build_stream_distilled.py's (a pair of builds is two minutes on two cores: the two pairs in one file
made the suite's longest file, which bounds `--dist loadfile`). The model is the tiny one at 4 layers, so that a phase
that held every block would show in the accountant.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3trt.adapters.merge import LoraSpec
from h3trt.build import builder
from h3trt.build.block_loader import BlockLoader
from h3trt.build.config import BuildConfig, Profile
from h3trt.build.examples import example_inputs
from h3trt.build.memory import GIB, DeviceMemory, kept_layers, memory_needs
from h3trt.build.plan import plan_build
from h3trt.engines.weights_io import SafetensorsWriter, write_safetensors
from h3trt.errors import UserError
from h3trt.models.checkpoint import reader as checkpoint_module
from h3trt.models.checkpoint.reader import locate_transformer, read_native_state_dict
from h3trt.models.checkpoint.stream import CheckpointTensors
from h3trt.models.config import H3Config

from stream_pairs import (LAYERS, PROFILE, assert_same_bundle, build_pair, compare_weights, config, streamed_budget,
                          weights_of)

pytestmark = pytest.mark.usefixtures("no_bundle_served_here")  # conftest.py

FULL_FLAGS = ["--precision", "fp8", "--fp8-attention", "--calib-algo", "smoothquant", "--calib-steps", "3",
              "--quant-exclude", "blocks.1", "--steps", "6,4"]


@pytest.fixture(scope="module")
def bundle_pair(tmp_path_factory, tiny4):
    """The same build whole and a block at a time, each `h3trt build` in a fresh process."""
    out = tmp_path_factory.mktemp("pair")
    flags = FULL_FLAGS + ["--calib-prompts", str(tiny4 / "prompts.txt"), "--lora", f"{tiny4 / 'lora.safetensors'}:0.7"]
    budget = streamed_budget(config(tiny4, out / "x", precision="fp8", fp8_attention=True, calib_algo="smoothquant",
                                    calib_steps=3, quant_exclude=("blocks.1",), steps=(6, 4),
                                    calib_prompts=tiny4 / "prompts.txt",
                                    loras=(LoraSpec(tiny4 / "lora.safetensors", 0.7),)))
    return build_pair(out, tiny4, flags, budget)


@pytest.mark.build
def test_streamed_bundle_equals_whole_bundle_file_by_file(bundle_pair):
    manifest = assert_same_bundle(*bundle_pair)
    assert "block 4/4: calibrated, quantized, baked and written" in bundle_pair[2]["streamed"]
    assert manifest["quant"]["calib_algo"] == "smoothquant" and manifest["quant"]["layer_segments"][1] == "block_hp"


@pytest.mark.parametrize("cfg_kw", [
    pytest.param({"precision": "bf16", "steps": (50, 8), "sparse_attention": 0.5, "lora_slots": 2,
                  "lora_max_rank": 4}, id="bf16-steps50,8-sparse-slots"),
    pytest.param({"precision": "fp32", "keep_adaln": True, "sp": 2}, id="fp32-keep-adaln-sp2"),
    pytest.param({"precision": "nvfp4", "steps": (6,)}, id="nvfp4-weight-only"),
    pytest.param({"precision": "fp8", "calib_algo": "percentile", "calib_steps": 4, "quant_exclude": ("mlp.fc2",),
                  "sp": 2, "fp8_attention": True}, id="fp8-percentile-sp2"),
])
def test_streamed_weights_equal_whole_weights(tmp_path, tiny4, cfg_kw, monkeypatch):
    if cfg_kw.get("calib_algo") == "percentile":
        cfg_kw = {**cfg_kw, "calib_prompts": tiny4 / "prompts.txt"}
    dit, calibration = compare_weights(tmp_path, cfg_kw, tiny4)
    # What the compile then asks of the streamed model: every example input at hand (the kept blocks), none on meta.
    cfg = config(tiny4, tmp_path / "unused", **cfg_kw)
    examples = example_inputs(dit.model, PROFILE.geometry, torch.device("cpu"), cfg.sp, calibration.recipe,
                              cfg.sparse is not None, cfg.slots)
    assert examples and not [n for n, ts in examples.items() for t in ts if t.is_meta]


def test_streamed_phases_hold_one_block_at_a_time(tmp_path, tiny4, monkeypatch):
    """The loader counts every block it materializes and how many were alive at once: a phase that kept blocks (or
    the whole model) would raise the count to the number of layers. Nothing reads the checkpoint whole either."""
    def refuse(*args, **kwargs):
        raise AssertionError("a streamed build read the whole checkpoint")

    monkeypatch.setattr(builder, "load_dit", refuse)
    monkeypatch.setattr(checkpoint_module, "read_native_state_dict", refuse)
    cfg = config(tiny4, tmp_path / "unused", precision="fp8", calib_prompts=tiny4 / "prompts.txt", calib_steps=3)
    needs = memory_needs(cfg, locate_transformer(cfg.model_root, cfg.task), cfg.precision.spec.dtype)
    plan, dit, calibration, _ = weights_of(cfg, tmp_path / "w", needs.streamed())
    loader, kept = dit.blocks, kept_layers(calibration.recipe, LAYERS)
    assert plan.streamed and kept == {0}
    # 3 grid points: 2 evaluations per trajectory, the first runs every block; then the one pass over the blocks.
    assert loader.loads == 2 * LAYERS
    assert loader.peak_alive == 1 + len(kept) < LAYERS
    assert [i for i, b in enumerate(dit.model.blocks) if not b.norm1.weight.is_meta] == sorted(kept)
    # The accountant sees what a caller holds on to: three blocks kept alive count three.
    held = [loader.load(i) for i in (1, 2, 3)]
    assert loader.alive() == len(held) + len(kept) and loader.peak_alive == 4
    loader.close()


def test_fit_check_refuses_in_one_line_before_anything_loads(tmp_path, tiny4, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(builder, "load_dit", refuse)
    cfg = config(tiny4, tmp_path / "b", precision="fp8", calib_prompts=tiny4 / "prompts.txt", calib_steps=3)
    needs = memory_needs(cfg, locate_transformer(cfg.model_root, cfg.task), cfg.precision.spec.dtype)
    free = needs.streamed() - 1
    with pytest.raises(UserError) as e:
        builder.build(cfg, log=lambda m: None, free_memory=lambda device: DeviceMemory(free, "cuda:0 (a small GPU)"))
    message = str(e.value)
    assert "\n" not in message and not (tmp_path / "b").exists()
    assert f"a block at a time it needs about {needs.streamed() / GIB:.3g} GiB" in message
    assert f"cuda:0 (a small GPU) has {free / GIB:.3g} GiB free" in message
    for part in ("largest block", "activations at 1,021 rows", "resident embed/final", "recorded calibration inputs",
                 "--canvas", "--calib-prompts"):
        assert part in message, part
    # Whole where it fits, a block at a time where only that fits; --memory-budget lowers what the device has.
    plan = plan_build(cfg, lambda m: None, lambda d: DeviceMemory(needs.whole(), "gpu"))
    assert not plan.streamed
    plan = plan_build(cfg, lambda m: None, lambda d: DeviceMemory(needs.whole() - 1, "gpu"))
    assert plan.streamed and "building a block at a time" in plan.memory.describe()
    budgeted = config(tiny4, tmp_path / "b", precision="fp8", calib_prompts=tiny4 / "prompts.txt", calib_steps=3,
                      memory_budget=(needs.whole() - 1) / GIB)
    assert plan_build(budgeted, lambda m: None, lambda d: DeviceMemory(100 * GIB, "gpu")).streamed


def test_full_size_fp8_build_streams_on_an_h100_and_not_on_an_h200(tmp_path):
    """The estimates at full size (a meta model: nothing allocated) against the cards: an 80 GB H100 (79.2 GiB free)
    builds fp8 a block at a time within 40 GiB; an H200 (139.8 GiB free) whole, as it did (bench/results/
    e2e_h200_s8_build.log)."""
    root = tmp_path / "ckpt"
    (root / "transformer").mkdir(parents=True)
    from h3trt.models.checkpoint.names import to_native_config

    (root / "transformer" / "config.json").write_text(json.dumps(to_native_config(H3Config())))
    save_file({"x": torch.zeros(1)}, str(root / "transformer" / "model.safetensors"))
    (root / "prompts.txt").write_text("a fox\n")
    cfg = BuildConfig(root / "transformer", tmp_path / "b", precision="fp8", fp8_attention=True,
                      calib_prompts=root / "prompts.txt", calib_steps=2, profiles=(Profile(1344, 768, 5.0),),
                      device="cpu")
    needs = memory_needs(cfg, locate_transformer(cfg.model_root), torch.bfloat16)
    # The full-size video VAE (2.6B parameters, fp32 as released: its file's bytes), which this folder leaves out.
    needs = dataclasses.replace(needs, video_decoder=10_400_000_000)
    assert needs.rows == 38755 and 1.2 * GIB < needs.block < 1.3 * GIB
    assert 79.2 * GIB < needs.whole() < 139.8 * GIB
    assert needs.streamed() < 40 * GIB


def test_checkpoint_tensors_read_every_layout_as_load_dit_does(tiny_checkpoints):
    """models/checkpoint/stream.py converts official (interleaved QKV), diffusers (names, to_q/k/v, fc1 halves) and
    Comfy (prefix) tensors as read_native_state_dict does, bit for bit."""
    for layout, path in tiny_checkpoints.items():
        source = locate_transformer(path, "t2va")
        tensors = CheckpointTensors(source)
        got = tensors.read_cpu(list(tensors.tensors.values()))
        want = read_native_state_dict(source)
        assert sorted(got) == sorted(want), layout
        for name, value in want.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), (layout, name)


def test_block_loader_gives_load_dit_s_blocks(tiny_checkpoints):
    from h3trt.models.checkpoint.reader import load_dit

    model, source = load_dit(tiny_checkpoints["official"], "t2va", dtype=torch.bfloat16)
    loader = BlockLoader(CheckpointTensors(source), source.config, torch.bfloat16, torch.device("cpu"), None)
    try:
        for i in reversed(range(source.config.num_layers)):
            want, got = model.blocks[i].state_dict(), loader.load(i).state_dict()
            assert sorted(want) == sorted(got)
            assert all(torch.equal(want[n], got[n]) and want[n].dtype == got[n].dtype for n in want)
    finally:
        loader.close()


def test_safetensors_writer_writes_write_safetensors_bytes_in_any_order(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"b.w": torch.randn(3, 5, generator=g).to(torch.bfloat16), "a.s": torch.randn(1, generator=g),
               "c.q": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn), "d": torch.tensor(3.0)}
    size = write_safetensors(tmp_path / "one.safetensors", tensors, {"k": "v"})
    with SafetensorsWriter(tmp_path / "two.safetensors", {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()},
                           {"k": "v"}) as writer:
        for name in reversed(list(tensors)):
            writer.write(name, tensors[name])
    assert writer.data_bytes == size
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "two.safetensors").read_bytes()
    with pytest.raises(RuntimeError, match="never written"):
        with SafetensorsWriter(tmp_path / "three.safetensors", {"x": (torch.float32, (2,))}):
            pass
    assert not list(tmp_path.glob("*three*"))
    with pytest.raises(UserError, match="declared"):
        with SafetensorsWriter(tmp_path / "four.safetensors", {"x": (torch.float32, (2,))}) as w:
            w.write("x", torch.zeros(3))
    assert not list(tmp_path.glob("*four*"))


def test_memory_budget_flag_is_checked(capsys):
    from h3trt.cli import main

    with pytest.raises(SystemExit) as e:
        main(["build", "--model", "tiny", "--output", "x", "--memory-budget", "0"])
    assert e.value.code == 2 and "--memory-budget" in capsys.readouterr().err
    with pytest.raises(UserError, match="--memory-budget"):
        BuildConfig(Path("m"), Path("o"), memory_budget=-1.0)


@pytest.mark.parametrize("extra, message", [
    ({"adaln_t_table": torch.zeros(4, 4)}, "pruned MiniMax-H3 checkpoint"),
    ({"rope.inv_freq": torch.ones(3)}, "rope.inv_freq .* does not match rope_theta"),
])
def test_both_readers_refuse_a_pruned_checkpoint_and_a_wrong_rope_alike(tmp_path, tiny_cfg, tiny_states, extra,
                                                                        message):
    """A checkpoint read whole (read_native_state_dict) and one read a block at a time (CheckpointTensors) refuse a
    pruned AdaLN table and a rope.inv_freq that is not the config's with the same one line (models/checkpoint/reader.py
    check_unpruned, check_rope_inv_freq)."""
    from h3trt.models.checkpoint.reader import CheckpointError
    from h3trt.models.checkpoint.writer import save_comfy

    path = save_comfy(tmp_path / "h3.safetensors", tiny_cfg, tiny_states["FL2VA"], torch.float32)
    stored = load_file(path)
    prefix = next(k for k in stored if k.endswith("rope.inv_freq")).removesuffix("rope.inv_freq")
    save_file({**stored, **{prefix + k: v for k, v in extra.items()}}, path)
    source = locate_transformer(path, "t2va")
    for read in (read_native_state_dict, CheckpointTensors):
        with pytest.raises(CheckpointError, match=message):
            read(source)
