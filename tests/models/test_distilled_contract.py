"""A full FastH3 export loaded as a checkpoint: its fastvideo_inference.json (FastVideo's fasth3-inference-contract-v1,
as the V2 release and the Preview-v1 VSA-DataFree export ship it) gives the checkpoint its ladder and shifts."""

import json
import shutil

import pytest
import torch

from h3trt.build.config import BuildConfig, Profile
from h3trt.errors import UserError
from h3trt.jobs.model_source import ModelSource
from h3trt.models.checkpoint.writer import random_state_dict, save_diffusers
from h3trt.models.config import H3Config
from h3trt.models.distilled.contract import checkpoint_contract
from h3trt.models.distilled.files import DistilledError
from h3trt.models.tiny import write_tiny_vsa_checkpoint
from h3trt.pipeline.loading import load_checkpoint

V2 = {"schema_version": "fasth3-inference-contract-v1", "dmd_denoising_steps": [999, 874, 749, 624, 500, 375, 250, 125],
      "num_inference_steps": 9, "transformer_forwards": 8, "video_scheduler_shift": 10.0,
      "audio_scheduler_shift": 3.0, "guidance_scale": 1.0, "task": "t2av", "attention_backend": "VIDEO_SPARSE_ATTN_H3",
      "vsa_tile_size": 64, "vsa_sparsity": 0.8}


VSA_CFG = H3Config.tiny(vsa_gate=True)


@pytest.fixture
def export(tiny_checkpoints, tmp_path):
    """A tiny V2-like export: a diffusers layout whose transformer's blocks carry the VSA gate, schedulers at 10 / 3,
    the V2 sidecar."""
    root = tmp_path / "fasth3-v2"
    shutil.copytree(tiny_checkpoints["diffusers"], root, ignore=shutil.ignore_patterns("transformer"))
    save_diffusers(root, VSA_CFG, {"transformer": random_state_dict(VSA_CFG, 5)}, torch.float32)
    for name, shift in (("scheduler", 10.0), ("audio_scheduler", 3.0)):
        (root / name).mkdir()
        (root / name / "scheduler_config.json").write_text(json.dumps({"_class_name": "MiniMaxH3Scheduler",
                                                                       "shift": shift}))
    (root / "fastvideo_inference.json").write_text(json.dumps(V2))
    return root


def test_the_v2_sidecar_is_the_checkpoints_schedule(export, tmp_path):
    serving, record = checkpoint_contract(export, (10.0, 3.0), vsa_gate=True)
    s = serving.plan.schedule
    assert (s.steps, s.video_shift, s.audio_shift) == (9, 10.0, 3.0)
    assert torch.allclose(s.video_sigmas, torch.tensor([0.9999, 0.9858, 0.9676, 0.9432, 0.9091, 0.8571, 0.7692,
                                                        0.5882, 0.0]), atol=5e-5)
    assert record["vsa"] == serving.vsa == {"trained_sparsity": 0.8, "tile_size": 64,
                                            "from": "fastvideo_inference.json vsa_sparsity"}
    assert record["contract"]["attention_backend"] == "VIDEO_SPARSE_ATTN_H3"
    model = ModelSource.resolve(model=export)
    assert model.default_steps == 9 and model.distilled_serving.tasks == ("t2va",)
    config = BuildConfig(export, tmp_path / "b", profiles=(Profile(160, 96, 5.0),), device="cpu")
    assert config.steps == (9,) and config.schedules((12.0, 3.0))[0] == s  # the ladder, not the 50-step default
    with pytest.raises(DistilledError, match="serves \\['t2va'\\] only, not ref2va"):
        BuildConfig(export, tmp_path / "b", profiles=(Profile(160, 96, 5.0),), device="cpu", task="ref2va")


def test_the_sidecars_sparsity_is_the_default_a_flag_overrides(export, tmp_path):
    """One source of truth for what a VSA bundle serves: the manifest's `vsa` (the flag over what the export was
    distilled at), saying where its sparsity came from; the distilled record keeps what the export states."""
    def served(**kw):
        config = BuildConfig(export, tmp_path / "b", profiles=(Profile(160, 96, 5.0),), device="cpu", **kw)
        return config.vsa(VSA_CFG.num_layers)

    assert (served().sparsity, served().sparsity_from) == (0.8, "fastvideo_inference.json vsa_sparsity")
    flagged = served(vsa_sparsity=0.5)
    assert (flagged.sparsity, flagged.sparsity_from) == (0.5, "--vsa-sparsity (the file was distilled at 0.8)")
    assert served(vsa_sparsity=0.8).sparsity_from == "--vsa-sparsity"


def test_a_vsa_sidecar_on_a_checkpoint_without_the_gate_is_refused(export):
    with pytest.raises(DistilledError, match="declares VSA attention .* carry no VSA gate") as info:
        checkpoint_contract(export, (10.0, 3.0), vsa_gate=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("edit,match", [
    ({"vsa_tile_size": 128}, "vsa_tile_size 128; h3trt's VSA tiles are FastH3's 64 tokens"),
    ({"vsa_sparsity": 1.5}, "vsa_sparsity must be a number in \\[0, 1\\)"),
    ({"transformer_forwards": 4}, "as many rungs as transformer_forwards"),
    ({"video_scheduler_shift": 12.0}, "disagrees with the checkpoint's scheduler config"),
    ({"guidance_scale": 3.0}, "runs CFG off"),
    ({"pdd_steps": 32, "model_type": "ref2va"}, "PDD as its Acc LoRA file"),
    ({"schema_version": "v9"}, "schema_version must be"),
    ({"dmd_denoising_steps": [999, 999, 749, 624, 500, 375, 250, 125]}, "strictly decreasing"),
])
def test_a_bad_sidecar_is_one_line(export, edit, match):
    (export / "fastvideo_inference.json").write_text(json.dumps({**V2, **edit}))
    with pytest.raises(Exception, match=match) as info:
        checkpoint_contract(export, (10.0, 3.0), vsa_gate=True)
    assert "\n" not in str(info.value)


def test_a_vsa_export_loads_as_a_checkpoint_serving_its_sidecars_vsa(tiny_root, tmp_path):
    """A full VSA-DataFree export (its gates checkpoint tensors, the sidecar beside them) is a FastH3-VSA checkpoint
    serving its ladder and its sidecar's sparsity; build's record and the eager run's are the same."""
    export = write_tiny_vsa_checkpoint(tiny_root, tmp_path / "export")
    (export / "FL2VA" / "fastvideo_inference.json").write_text(json.dumps({
        "schema_version": "fasth3-inference-contract-v1", "dmd_denoising_steps": [999, 749, 500, 250],
        "num_inference_steps": 5, "transformer_forwards": 4, "attention_backend": "VIDEO_SPARSE_ATTN_H3",
        "vsa_sparsity": 0.8, "vsa_tile_size": 64}))
    parts = load_checkpoint(export, "t2va", "cpu")
    settings = parts.dit.caps.vsa.settings
    assert parts.dit.cfg.vsa_gate and (settings.sparsity, settings.sparsity_from) == (
        0.8, "fastvideo_inference.json vsa_sparsity")
    assert parts.distilled.plan.schedule.rungs == (0.999, 0.749, 0.5, 0.25)
    assert parts.distilled_record["vsa"]["trained_sparsity"] == 0.8 and parts.distilled.vsa == parts.distilled_record[
        "vsa"]
    config = BuildConfig(export, tmp_path / "b", profiles=(Profile(160, 96, 5.0),), device="cpu")
    assert config.vsa(parts.dit.cfg.num_layers) == settings and config.contract[1]["vsa"] == parts.distilled.vsa


def test_a_folder_that_is_no_checkpoint_fails_at_the_load_after_the_flags(tmp_path):
    """With --distilled FILE (its export check) or without (the sidecar's read), a --model folder that is no
    checkpoint is not read by BuildConfig: a flag's own mistake is the one line, and the folder's fails at the load."""
    from h3trt.models.distilled.families import DistilledSpec
    from h3trt.models.distilled.writer import write_fasth3

    fasth3 = write_fasth3(tmp_path / "f.safetensors", H3Config.tiny())
    folder = tmp_path / "not-a-checkpoint"
    folder.mkdir()
    for kw in ({}, {"distilled": DistilledSpec(fasth3)}):
        with pytest.raises(UserError, match="--fp8-accum sets how"):
            BuildConfig(folder, tmp_path / "b", device="cpu", fp8_accum="fast", **kw)
        assert BuildConfig(folder, tmp_path / "b", device="cpu", **kw).contract is None
