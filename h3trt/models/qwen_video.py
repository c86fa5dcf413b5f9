"""Qwen3-VL's video preprocessing without torchvision: reference frames -> `pixel_values_videos` and `video_grid_thw`,
exactly as transformers' `Qwen3VLVideoProcessor` makes them when diffusers calls it (`processor.video_processor(
videos=[frames, ...], do_sample_frames=False, return_tensors="pt")`, each video's frames already sampled at 2 fps by
text_encoder.sample_video_frames, as diffusers' `_sample_video_condition_frames` samples them).

transformers implements that processor on torchvision only (its `BaseVideoProcessor` *is* the torchvision backend),
and torchvision is no dependency of h3trt: `pip install torchvision` on a CPU machine pulls a CUDA torch over the CPU
one. What torchvision does there is three primitives, reproduced here in plain torch as they run on the CPU
(torchvision 0.29, `transforms.v2.functional`):

- resize: `resize_image(uint8, BICUBIC, antialias=True)` is `F.interpolate(mode="bicubic", align_corners=False,
  antialias=True)` on the uint8 frames themselves (bicubic is one of torchvision's native uint8 modes on the CPU), to
  the size `smart_resize` picks; a frame already at that size is left as it is;
- normalize: `(x.float() - mean / rescale_factor) / (std / rescale_factor)`, the 1/255 rescale fused into the mean
  and std in float32 (`TorchvisionBackend._fuse_mean_std_and_rescale_factor`, then `normalize_image`);
- RGB conversion: a no-op on the 3-channel frames h3trt decodes.

The settings are read as `Qwen3VLVideoProcessor.from_pretrained` resolves them from the checkpoint's `processor/`
folder, and the output size is transformers' own `smart_resize` (both pure Python, no torchvision); the patch layout
is `Qwen3VLVideoProcessor.patchify`'s, written out here. tests/models/test_qwen_video.py compares the result with
transformers' processor run with torchvision (outputs stored in tests/data/).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError

PROCESSOR_CLASS = "Qwen3VLVideoProcessor"  # what a Qwen3-VL checkpoint's video_preprocessor_config.json names
BICUBIC = 3  # PIL's resample code, Qwen3-VL's `resample`: the one interpolation reproduced here


class VideoProcessorError(UserError):
    """A checkpoint whose video processor settings are not the Qwen3-VL preprocessing reproduced here."""


@dataclass(frozen=True)
class VideoProcessing:
    """The settings of Qwen3-VL's video preprocessing that shape its output, as transformers resolves them."""

    patch_size: int  # spatial patch edge of the vision tower, pixels
    temporal_patch_size: int  # frames merged into one vision block
    merge_size: int  # patches merged per side into one LLM token
    min_pixels: int  # size["shortest_edge"]: smart_resize's lower bound on frames x height x width
    max_pixels: int  # size["longest_edge"]: its upper bound (before the per-frame cap)
    image_mean: tuple[float, ...]  # per channel, on the 0..1 scale
    image_std: tuple[float, ...]
    rescale_factor: float  # 1/255: uint8 levels to 0..1, fused into mean and std
    cap_pixels_per_frame: bool  # qwen-vl-utils' per-frame pixel cap (transformers: None means off, with a warning)
    max_video_tokens: int  # the cap's per-frame token ceiling

    def __post_init__(self):
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1:
            raise VideoProcessorError(f"Video processor patch sizes must be positive, got patch_size {self.patch_size},"
                                      f" temporal_patch_size {self.temporal_patch_size}, merge_size {self.merge_size}.")

    @property
    def factor(self) -> int:
        """Frame height and width become multiples of this: one merged patch."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_processor(cls, processor) -> "VideoProcessing":
        """The settings of a transformers `Qwen3VLVideoProcessor` (constructed without torchvision: only its
        attributes are read). Settings that would take another path than the one reproduced here are refused."""
        where = f"the video processor ({type(processor).__name__})"
        unsupported = [f"{name}={getattr(processor, name)!r}" for name in ("do_resize", "do_rescale", "do_normalize")
                       if getattr(processor, name) is not True]
        if int(processor.resample) != BICUBIC:
            unsupported.append(f"resample={processor.resample!r} (Qwen3-VL's is {BICUBIC}, bicubic)")
        size = processor.size
        if not size.shortest_edge or not size.longest_edge:
            unsupported.append(f"size={size!r} (needs shortest_edge and longest_edge)")
        if unsupported:
            raise VideoProcessorError(
                f"{where} sets {', '.join(unsupported)}; h3trt reproduces Qwen3-VL's video preprocessing as its "
                "checkpoints configure it (resize, rescale and normalize on, bicubic). Use the processor/ folder "
                "the MiniMax-H3 checkpoint ships.")
        return cls(patch_size=int(processor.patch_size), temporal_patch_size=int(processor.temporal_patch_size),
                   merge_size=int(processor.merge_size), min_pixels=int(size.shortest_edge),
                   max_pixels=int(size.longest_edge), image_mean=_channels(processor.image_mean),
                   image_std=_channels(processor.image_std), rescale_factor=float(processor.rescale_factor),
                   cap_pixels_per_frame=bool(processor.cap_pixels_per_frame),
                   max_video_tokens=int(processor.max_video_tokens))

    @classmethod
    def from_pretrained(cls, processor_dir: Path) -> "VideoProcessing":
        """The settings in a checkpoint's `processor/` folder, resolved by transformers itself (processor_config.json,
        then video_preprocessor_config.json, then preprocessor_config.json, over the class defaults)."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor  # heavy import

        config, _ = Qwen3VLVideoProcessor.get_video_processor_dict(processor_dir, local_files_only=True)
        kind = config.get("video_processor_type", PROCESSOR_CLASS)
        if kind != PROCESSOR_CLASS:
            raise VideoProcessorError(f"{processor_dir} configures a {kind}; MiniMax-H3's conditioner reads video "
                                      f"references through Qwen3-VL's {PROCESSOR_CLASS}. Use the processor/ folder "
                                      "the checkpoint ships.")
        return cls.from_processor(Qwen3VLVideoProcessor.from_dict(config))


def _channels(value) -> tuple[float, ...]:
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else (float(value),)


def resized_size(num_frames: int, height: int, width: int, settings: VideoProcessing) -> tuple[int, int]:
    """(height, width) Qwen3VLVideoProcessor.resize gives a video of `num_frames` frames of height x width:
    transformers' `smart_resize`, its pixel budget capped per frame when `cap_pixels_per_frame` is set."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    max_pixels = settings.max_pixels
    if settings.cap_pixels_per_frame:
        frame_cap = settings.max_video_tokens * settings.factor * settings.factor
        per_frame = max(min(frame_cap, settings.max_pixels // num_frames), int(settings.min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    return smart_resize(num_frames=num_frames, height=height, width=width, temporal_factor=settings.temporal_patch_size,
                        factor=settings.factor, min_pixels=settings.min_pixels, max_pixels=max_pixels)


def patchify(video_TCHW: torch.Tensor, settings: VideoProcessing) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Qwen3VLVideoProcessor.patchify for one video [T, C, H, W] (H and W multiples of `settings.factor`): the last
    frame repeated up to a multiple of temporal_patch_size, then rows [grid_t * grid_h * grid_w, C * tp * p * p] in
    the vision tower's order (merge windows together, each patch's values channel, then frame, then pixel)."""
    tp, p, m = settings.temporal_patch_size, settings.patch_size, settings.merge_size
    if pad := -video_TCHW.shape[0] % tp:
        video_TCHW = torch.cat([video_TCHW, video_TCHW[-1:].expand(pad, -1, -1, -1)])
    frames, channels, height, width = video_TCHW.shape
    grid = (frames // tp, height // p, width // p)
    patches = video_TCHW.view(grid[0], tp, channels, grid[1] // m, m, p, grid[2] // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(grid[0] * grid[1] * grid[2], channels * tp * p * p), grid


def preprocess_video(frames_THWC: np.ndarray, settings: VideoProcessing) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One video, uint8 [T, H, W, 3] (T >= temporal_patch_size) -> (its rows of `pixel_values_videos`, float32
    [grid_t * grid_h * grid_w, 3 * temporal_patch * patch * patch], and its (grid_t, grid_h, grid_w))."""
    video_TCHW = torch.from_numpy(frames_THWC).permute(0, 3, 1, 2).contiguous()
    num_frames, _, height, width = video_TCHW.shape
    size = resized_size(num_frames, height, width, settings)
    if size != (height, width):
        video_TCHW = torch.nn.functional.interpolate(video_TCHW, size=size, mode="bicubic", align_corners=False,
                                                     antialias=True)
    # torch.tensor of Python floats is float32, and so is each product: the fused constants transformers computes.
    mean = (torch.tensor(settings.image_mean) * (1.0 / settings.rescale_factor)).view(-1, 1, 1)
    std = (torch.tensor(settings.image_std) * (1.0 / settings.rescale_factor)).view(-1, 1, 1)
    return patchify(video_TCHW.to(torch.float32).sub_(mean).div_(std), settings)


def preprocess_videos(videos: list[np.ndarray], settings: VideoProcessing) -> dict[str, torch.Tensor]:
    """Videos (each uint8 [T, H, W, 3]) -> {"pixel_values_videos": float32 [sum of rows, patch dim],
    "video_grid_thw": int64 [V, 3]}, the videos' rows concatenated in order, as the processor returns them."""
    processed = [preprocess_video(video, settings) for video in videos]
    return {"pixel_values_videos": torch.cat([rows for rows, _ in processed]),
            "video_grid_thw": torch.tensor([grid for _, grid in processed])}
