"""A full FastH3 export loaded as a checkpoint: its fastvideo_inference.json (FastVideo's fasth3-inference-contract-v1,
as the V2 release and the Preview-v1 VSA-DataFree export ship it) gives the checkpoint its ladder and shifts."""

import json
import shutil

import pytest
import torch

from h3trt.build.config import BuildConfig, Profile
from h3trt.jobs.model_source import ModelSource
from h3trt.models.distilled_contract import checkpoint_contract
from h3trt.models.distilled_files import DistilledError

V2 = {"schema_version": "fasth3-inference-contract-v1", "dmd_denoising_steps": [999, 874, 749, 624, 500, 375, 250, 125],
      "num_inference_steps": 9, "transformer_forwards": 8, "video_scheduler_shift": 10.0,
      "audio_scheduler_shift": 3.0, "guidance_scale": 1.0, "task": "t2av", "attention_backend": "VIDEO_SPARSE_ATTN_H3",
      "vsa_tile_size": 64, "vsa_sparsity": 0.8}


@pytest.fixture
def export(tiny_checkpoints, tmp_path):
    root = tmp_path / "fasth3-v2"
    shutil.copytree(tiny_checkpoints["diffusers"], root)
    for name, shift in (("scheduler", 10.0), ("audio_scheduler", 3.0)):
        (root / name).mkdir()
        (root / name / "scheduler_config.json").write_text(json.dumps({"_class_name": "MiniMaxH3Scheduler",
                                                                       "shift": shift}))
    (root / "fastvideo_inference.json").write_text(json.dumps(V2))
    return root


def test_the_v2_sidecar_is_the_checkpoints_schedule(export, tmp_path):
    serving, record = checkpoint_contract(export, (10.0, 3.0))
    s = serving.plan.schedule
    assert (s.steps, s.video_shift, s.audio_shift) == (9, 10.0, 3.0)
    assert torch.allclose(s.video_sigmas, torch.tensor([0.9999, 0.9858, 0.9676, 0.9432, 0.9091, 0.8571, 0.7692,
                                                        0.5882, 0.0]), atol=5e-5)
    assert record["vsa"] == {"attention_backend": "VIDEO_SPARSE_ATTN_H3", "vsa_sparsity": 0.8, "vsa_tile_size": 64}
    model = ModelSource.resolve(model=export)
    assert model.default_steps == 9 and model.distilled_serving.tasks == ("t2va",)
    config = BuildConfig(export, tmp_path / "b", profiles=(Profile(160, 96, 5.0),), device="cpu")
    assert config.steps == (9,) and config.schedules((12.0, 3.0))[0] == s  # the ladder, not the 50-step default
    with pytest.raises(DistilledError, match="serves \\['t2va'\\] only, not ref2va"):
        BuildConfig(export, tmp_path / "b", profiles=(Profile(160, 96, 5.0),), device="cpu", task="ref2va")


@pytest.mark.parametrize("edit,match", [
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
        checkpoint_contract(export, (10.0, 3.0))
    assert "\n" not in str(info.value)
