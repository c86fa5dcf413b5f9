"""h3trt's Qwen3-VL video preprocessing (h3trt/models/qwen_video.py, no torchvision) against transformers' own
`Qwen3VLVideoProcessor`, which runs on torchvision only.

torchvision is not installed here (h3trt does not depend on it), so the oracle's outputs were recorded once by
scripts/make_qwen_video_fixtures.py in a throwaway environment with torchvision 0.29.1, torch 2.14.1 and
transformers 5.24.0 (the versions are in the file's index; the script's --check found 5.17.0 and 5.25.0 to make
them bit for bit too, and setup.py's transformers range stands for those checked): tests/data/qwen_video_reference.npz holds, per case, the
processor's settings, its uint8 input videos and the `pixel_values_videos` and `video_grid_thw` it returned, called as
diffusers calls it (`do_sample_frames=False`). The cases cover a bicubic resize up and down, smart_resize's
small-frame and budget branches, the per-frame pixel cap, an odd frame count, an unresized video, two videos of one
shape, 16 px patches and a non-0.5 mean and std. Tolerance: none; equal bit for bit (also at every
ATEN_CPU_CAPABILITY of this machine: default, avx2, avx512).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from h3trt.models.qwen_video import VideoProcessing, VideoProcessorError, preprocess_videos
from h3trt.models.tiny_text_encoder import write_tiny_text_encoder
from helpers import DATA, setup_requirements

FIXTURES = DATA / "qwen_video_reference.npz"


@pytest.fixture(scope="module")
def reference():
    data = np.load(FIXTURES)
    return data, json.loads(bytes(data["index.json"]))


def test_the_fixtures_stand_for_the_installed_transformers(reference):
    """The fixtures were recorded by one release and checked bit for bit against the others of setup.py's range
    (scripts/make_qwen_video_fixtures.py --check): the installed transformers and the recording one lie in it."""
    _, index = reference
    (requirement,) = setup_requirements("transformers")
    assert len(index["cases"]) == 5 and requirement.specifier.contains(index["transformers"])
    assert requirement.specifier.contains(transformers.__version__), (
        f"transformers {transformers.__version__} is outside {requirement}, the range these fixtures were checked "
        "against: pip install -e '.[test]', or check the release with scripts/make_qwen_video_fixtures.py --check "
        "and widen setup.py's bound")


@pytest.mark.parametrize("name", ["tiny_upscale_odd_frames_and_unresized", "budget_downscale",
                                  "frames_below_one_patch", "per_frame_pixel_cap", "qwen3_vl_patches_clip_mean_std"])
def test_equals_transformers_processor_bit_for_bit(reference, name):
    data, index = reference
    case = index["cases"][name]
    settings = VideoProcessing.from_processor(Qwen3VLVideoProcessor(**case["settings"]))
    videos = [data[f"{name}/video{i}"] for i in range(case["videos"])]
    ours = preprocess_videos(videos, settings)
    expected_grid = torch.from_numpy(data[f"{name}/video_grid_thw"])
    expected = torch.from_numpy(data[f"{name}/pixel_values_videos"])
    assert torch.equal(ours["video_grid_thw"], expected_grid)
    assert ours["pixel_values_videos"].dtype == expected.dtype == torch.float32
    assert torch.equal(ours["pixel_values_videos"], expected)


def test_settings_are_read_from_a_checkpoints_processor_folder(tmp_path):
    write_tiny_text_encoder(tmp_path)
    settings = VideoProcessing.from_pretrained(tmp_path / "processor")
    assert (settings.patch_size, settings.merge_size, settings.temporal_patch_size) == (4, 2, 2)
    assert (settings.min_pixels, settings.max_pixels) == (256, 64 * 64 * 64)
    assert settings.image_mean == settings.image_std == (0.5, 0.5, 0.5) and not settings.cap_pixels_per_frame


@pytest.mark.parametrize("change, message", [
    ({"resample": 2}, "resample=2"),
    ({"do_normalize": False}, "do_normalize=False"),
    ({"size": {"height": 64, "width": 64}}, "needs shortest_edge and longest_edge"),
])
def test_settings_it_does_not_reproduce_are_refused(change, message):
    with pytest.raises(VideoProcessorError, match=message):
        VideoProcessing.from_processor(Qwen3VLVideoProcessor(**change))


def test_another_processor_type_is_refused(tmp_path):
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"video_processor_type": "LlavaVideoProcessor"}))
    with pytest.raises(VideoProcessorError, match="configures a LlavaVideoProcessor"):
        VideoProcessing.from_pretrained(tmp_path)
