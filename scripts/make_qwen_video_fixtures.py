"""Reference outputs of transformers' own Qwen3VLVideoProcessor (torchvision backend) for
tests/models/test_qwen_video.py.

h3trt reproduces that processor without torchvision (h3trt/models/qwen_video.py). Its tests run where torchvision is
not installed, so they compare against outputs this script stores, made once in a throwaway environment that has it
(torch's CUDA wheel comes with it; nothing of it is needed by h3trt):

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch==2.14.1 torchvision==0.29.1 transformers==5.24.0 numpy
    PYTHONPATH=. /tmp/tv/bin/python scripts/make_qwen_video_fixtures.py tests/data/qwen_video_reference.npz

`--check tests/data/qwen_video_reference.npz` records in memory and compares with the stored file instead: how a
transformers release is admitted into setup.py's range (checked so: 5.17.0, 5.24.0, 5.25.0).

The processor is called as diffusers' MiniMax-H3 text encoder calls it (`videos=[...]`, `do_sample_frames=False`,
`return_tensors="pt"`). Each case is one call: its settings (the processor's constructor kwargs, as a checkpoint's
video_preprocessor_config.json gives them), its uint8 videos and the two tensors the processor returns. The cases
cover every branch of the arithmetic: a resize up and down (antialiased bicubic), smart_resize's small-frame and
pixel-budget branches, the per-frame pixel cap, an odd frame count (the last frame repeated), a frame already at its
size (no resize), two videos of one shape (batched together by the processor), Qwen3-VL's 16 px patches and a mean
and std other than 0.5. It also runs h3trt's implementation in that environment and prints the largest difference.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import transformers
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.utils import is_torchvision_available

TINY = dict(patch_size=4, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
CLIP_MEAN_STD = dict(image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])


def noise(shape, seed):
    return np.random.RandomState(seed).randint(0, 256, shape, dtype=np.uint8)


def gradient_with_noise(shape, seed):
    """Smooth content (a resize mostly interpolates) with a little noise (every tap still matters)."""
    t, h, w, _ = shape
    ramp = np.linspace(0, 1, h)[:, None, None] * np.linspace(1, 0, w)[None, :, None] * np.array([255, 200, 120])
    frames = ramp[None] + np.arange(t)[:, None, None, None] * 9 + noise(shape, seed).astype(np.float64) / 16
    return np.clip(frames, 0, 255).astype(np.uint8)


CASES = {
    # The tiny model's processor: 3 frames (odd: the last repeated) scaled up from 13x21 to 16x24, twice (one batch
    # for both), and a 16x24 video already on the 8 px grid (not resized).
    "tiny_upscale_odd_frames_and_unresized": (
        dict(TINY, size={"shortest_edge": 256, "longest_edge": 64 * 64 * 64}),
        [noise((3, 13, 21, 3), 1), noise((4, 16, 24, 3), 2), noise((3, 13, 21, 3), 3)]),
    # A pixel budget of 2048: 34x46 frames scaled down to 16x24 (antialiasing matters).
    "budget_downscale": (
        dict(TINY, size={"shortest_edge": 256, "longest_edge": 2048}),
        [gradient_with_noise((4, 34, 46, 3), 4)]),
    # Frames smaller than a merged patch: smart_resize scales them up to 8x16 first.
    "frames_below_one_patch": (
        dict(TINY, size={"shortest_edge": 256, "longest_edge": 64 * 64 * 64}),
        [noise((2, 5, 9, 3), 5)]),
    # qwen-vl-utils' per-frame pixel cap (cap_pixels_per_frame): 4 frames of 40x40 down to 32x32 (uncapped, they
    # would stay 40x40).
    "per_frame_pixel_cap": (
        dict(TINY, size={"shortest_edge": 1024, "longest_edge": 64 * 64 * 64}, cap_pixels_per_frame=True,
             max_video_tokens=16),
        [gradient_with_noise((4, 40, 40, 3), 6)]),
    # Qwen3-VL's own patch geometry (16 px patches, 2x2 merge: 32 px tokens) and a mean and std other than 0.5.
    "qwen3_vl_patches_clip_mean_std": (
        dict(patch_size=16, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 4096, "longest_edge": 1 << 20},
             **CLIP_MEAN_STD),
        [noise((2, 40, 56, 3), 7)]),
}


def record() -> tuple[dict, dict]:
    """Every case through transformers' processor here: (arrays, index) as the fixture file holds them."""
    if not is_torchvision_available():
        raise SystemExit("run this where torchvision is installed (see the docstring): it records transformers' own "
                         "torchvision processor")
    from h3trt.models.qwen_video import VideoProcessing, preprocess_videos

    arrays, index = {}, {"transformers": transformers.__version__, "torch": torch.__version__,
                         "torchvision": __import__("torchvision").__version__, "cases": {}}
    for name, (settings, videos) in CASES.items():
        processor = Qwen3VLVideoProcessor(**settings)
        out = processor(videos=videos, do_sample_frames=False, return_tensors="pt")
        index["cases"][name] = {"settings": settings, "videos": len(videos)}
        for i, video in enumerate(videos):
            arrays[f"{name}/video{i}"] = video
        arrays[f"{name}/pixel_values_videos"] = out["pixel_values_videos"].numpy()
        arrays[f"{name}/video_grid_thw"] = out["video_grid_thw"].numpy()
        ours = preprocess_videos(videos, VideoProcessing.from_processor(processor))
        same_grid = torch.equal(ours["video_grid_thw"], out["video_grid_thw"])
        diff = (ours["pixel_values_videos"] - out["pixel_values_videos"]).abs().max().item() if same_grid else None
        print(f"{name}: grid {out['video_grid_thw'].tolist()}, pixel_values {tuple(out['pixel_values_videos'].shape)},"
              f" h3trt max abs diff {diff}")
    return arrays, index


def main(out_path: str) -> None:
    arrays, index = record()
    arrays["index.json"] = np.frombuffer(json.dumps(index, indent=1).encode(), dtype=np.uint8)
    np.savez_compressed(out_path, **arrays)
    print(f"wrote {out_path}")


def check(stored_path: str) -> None:
    """Whether this transformers' processor still makes the stored outputs bit for bit: the step before widening
    setup.py's transformers range (the fixtures stand for every release in it)."""
    arrays, _ = record()
    stored = np.load(stored_path)
    differ = sorted(k for k in {*arrays, *stored.files} - {"index.json"}
                    if k not in arrays or k not in stored.files or arrays[k].dtype != stored[k].dtype
                    or not np.array_equal(arrays[k], stored[k]))
    if differ:
        raise SystemExit(f"transformers {transformers.__version__} makes other outputs than {stored_path} "
                         f"({', '.join(differ)}): keep setup.py's bound below it, or adapt h3trt/models/qwen_video.py "
                         "and re-record")
    print(f"transformers {transformers.__version__}: every case equals {stored_path} bit for bit")


if __name__ == "__main__":
    check(sys.argv[2]) if sys.argv[1:2] == ["--check"] else main(sys.argv[1])
