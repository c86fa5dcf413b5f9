"""MiniMax-H3's text conditioning: Qwen3-VL's unnormalised hidden state after decoder layer 50.

The oracle is diffusers 0.42.1 (`modular_pipelines/minimax_h3/encoders.py`). Each task presents the prompt
differently, and the presentation is part of the checkpoint contract:

* t2va: the prompt verbatim, no chat template, no special tokens.
* fl2va: per keyframe `"<Picture i>: "` plus a vision block, then the prompt.
* ref2va: per reference, in order and numbered per modality, `"<Audio j>: "` (label only, a waveform never reaches
  the conditioner; a video with a soundtrack gets it *before* its video label), `"<Picture i>: "` plus a vision
  block, or `"<Video k>: "` plus one `"<{t:.1f} seconds>"` + vision block per merged frame pair; then the prompt.

Every segment is tokenized on its own (never the concatenated string). A vision block is `<|vision_start|>`, its
pads and `<|vision_end|>`, and *all* of those rows are tagged 0 (the video tag of the transformer's AdaLN table);
labels, timestamps and the prompt are tagged 1.

Only the first 50 decoder layers are built and loaded, and the final RMSNorm is replaced by an identity, so the
model's `last_hidden_state` *is* diffusers' `hidden_states[50]` of the full 64-layer stack.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..errors import UserError
from .checkpoint.reader import check_component_files
from .qwen_video import VideoProcessing, preprocess_videos

TEXT_ENCODER_LAYER = 50  # MiniMax-H3 conditions on hidden_states[50] of Qwen3-VL-32B (64 layers).
TEXT_TAG = 1  # Per-row modality tags index the transformer's AdaLN table: a checkpoint contract.
VISION_TAG = 0  # A vision block's rows (start, pads, end) carry the *video* tag.
MINIMAX_H3_FPS = 24.0  # References reach the text encoder normalised onto MiniMax-H3's 24 fps clock.
VIDEO_SAMPLE_FPS = 2.0  # The conditioner reads a reference video at 2 fps.

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# Qwen's mm_token_type_ids (internal to the conditioner, distinct from MiniMax-H3's tags): they drive M-RoPE.
_QWEN_TEXT, _QWEN_IMAGE, _QWEN_VIDEO = 0, 1, 2

# The folders a diffusers-layout MiniMax-H3 checkpoint keeps the conditioner in.
TEXT_ENCODER_DIR, TOKENIZER_DIR, PROCESSOR_DIR = "text_encoder", "tokenizer", "processor"


def quiet_transformers() -> None:
    """Turn off transformers' weight-loading progress bars: h3trt reports its own progress, a bar per load is noise."""
    from transformers.utils import logging as hf_logging  # heavy: see _first_layers_model

    hf_logging.disable_progress_bar()


class MissingComponentError(UserError):
    """A conditioner folder is absent from the checkpoint root."""


@functools.cache
def _first_layers_model():
    """Qwen3VLModel built with TEXT_ENCODER_LAYER decoder layers: the checkpoint's deeper layers and lm_head are
    expected to stay unread, so they are kept out of the load report; any other unexpected key is still reported.

    transformers takes seconds to import and only loading or writing a text encoder needs it, so it is imported
    here and in the other transformers entry points of this module, not with the module (which every `h3trt`
    command imports)."""
    from transformers import Qwen3VLModel

    class _Qwen3VLFirstLayers(Qwen3VLModel):
        _keys_to_ignore_on_load_unexpected = [
            rf"(^|\.)layers\.(?!(?:{'|'.join(str(i) for i in range(TEXT_ENCODER_LAYER))})\.)\d+\.",
            r"(^|\.)lm_head\.",
        ]

    return _Qwen3VLFirstLayers


@dataclass
class TextConditioning:
    """`embeds` [1, L, hidden] in the encoder's dtype; `tags` [L] long on CPU (1 text, 0 vision-block rows)."""

    embeds: torch.Tensor
    tags: torch.Tensor


@dataclass
class ImageRef:
    """An image reference, already normalised by the caller (diffusers: resized to a 2048 short edge)."""

    image: Image.Image


@dataclass
class AudioRef:
    """An audio reference: only its `"<Audio j>: "` label reaches the text encoder."""


@dataclass
class VideoRef:
    """A video reference normalised onto 24 fps and its canvas. `has_audio` puts `"<Audio j>: "` before its label."""

    frames: np.ndarray  # uint8 [T, H, W, 3]
    fps: float = MINIMAX_H3_FPS
    has_audio: bool = False


@dataclass
class _Presentation:
    """Token ids and MiniMax-H3 tags, built segment by segment exactly as diffusers tokenizes them."""

    tokenizer: object
    ids: list[int] = field(default_factory=list)
    tags: list[int] = field(default_factory=list)

    def text(self, value: str) -> int:
        ids = self.tokenizer(value, add_special_tokens=False)["input_ids"]
        self.ids += ids
        self.tags += [TEXT_TAG] * len(ids)
        return len(ids)

    def vision(self, pad_token: str, num_tokens: int) -> None:
        convert = self.tokenizer.convert_tokens_to_ids
        ids = [convert(VISION_START)] + [convert(pad_token)] * num_tokens + [convert(VISION_END)]
        self.ids += ids
        self.tags += [VISION_TAG] * len(ids)

    def prompt(self, prompt: str) -> None:
        if not isinstance(prompt, str):
            raise ValueError(f"MiniMax-H3 packs one request into one sequence: `prompt` must be a str, got {type(prompt)}.")
        if self.text(prompt) == 0:
            raise UserError(f"The prompt {prompt!r} tokenizes to zero tokens; pass a non-empty prompt.")


def sample_video_frames(
    frames: np.ndarray, fps: float, sample_fps: float, temporal_patch: int
) -> tuple[list[np.ndarray], list[float]]:
    """The frames the conditioner reads (every `fps / sample_fps`-th of `frames` uint8 [T, H, W, 3], deduplicated,
    each [H, W, 3]) and one timestamp per vision block.

    Qwen3-VL merges sampled frames in groups of `temporal_patch` (repeating the last one), and a block is labelled with
    the mean timestamp of its group. Mirrors diffusers' `_sample_video_condition_frames` step for step.
    """
    stride = fps / sample_fps
    indices, cursor = [], 0.0
    while round(cursor) < frames.shape[0]:
        if not indices or round(cursor) > indices[-1]:
            indices.append(round(cursor))
        cursor += stride
    if len(indices) < temporal_patch:
        minimum = round((temporal_patch - 1) * stride) + 1
        raise UserError(
            f"A reference video is read at {sample_fps:g} fps in groups of {temporal_patch} frames, so it needs at "
            f"least {minimum} frames at {fps:g} fps; got {frames.shape[0]}. Pass a longer reference."
        )
    timestamps = [index / sample_fps for index in range(len(indices))]
    timestamps += [timestamps[-1]] * (-len(timestamps) % temporal_patch)
    blocks = [
        (timestamps[i] + timestamps[i + temporal_patch - 1]) / 2 for i in range(0, len(timestamps), temporal_patch)
    ]
    return [frames[index] for index in indices], blocks


def _require_dir(root: Path, name: str) -> Path:
    path = root / name
    if not path.is_dir():
        raise MissingComponentError(
            f"MiniMax-H3 text encoder: folder {path} is missing; point component_root at a diffusers-layout "
            f"MiniMax-H3 checkpoint holding {TEXT_ENCODER_DIR}/, {TOKENIZER_DIR}/ and {PROCESSOR_DIR}/."
        )
    return path


def check_text_encoder_files(component_root: Path) -> None:
    """The conditioner's three folders exist and every file a loader reads reads back whole (headers and JSON only:
    checkpoint.reader.check_component_files), so a truncated file is one line naming it; cheap enough to run before any
    model loads."""
    for name in (TEXT_ENCODER_DIR, TOKENIZER_DIR, PROCESSOR_DIR):
        check_component_files(_require_dir(Path(component_root), name), weights=name == TEXT_ENCODER_DIR)


class H3TextEncoder:
    """Qwen3-VL truncated to 50 decoder layers without its final norm, plus MiniMax-H3's per-task presentations."""

    def __init__(self, model, tokenizer, image_processor, processor_dir: Path):
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self._processor_dir = processor_dir
        self._video_processing: VideoProcessing | None = None  # read at the first video reference
        self.image_pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.video_pad_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        if (self.image_pad_id, self.video_pad_id) != (model.config.image_token_id, model.config.video_token_id):
            raise UserError(
                f"Tokenizer pad ids ({self.image_pad_id}, {self.video_pad_id}) disagree with the text encoder's "
                f"image/video token ids ({model.config.image_token_id}, {model.config.video_token_id}); the "
                f"{TOKENIZER_DIR}/ and {TEXT_ENCODER_DIR}/ folders must come from the same checkpoint."
            )

    @classmethod
    def from_pretrained(
        cls, component_root: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16
    ) -> "H3TextEncoder":
        """Load `text_encoder/`, `tokenizer/` and `processor/` from a diffusers-layout checkpoint, offline."""
        from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLConfig  # heavy: see _first_layers_model

        root = Path(component_root)
        check_text_encoder_files(root)
        encoder_dir, tokenizer_dir, processor_dir = (root / name for name in (TEXT_ENCODER_DIR, TOKENIZER_DIR,
                                                                             PROCESSOR_DIR))
        config = Qwen3VLConfig.from_pretrained(encoder_dir, local_files_only=True)
        num_layers = config.text_config.num_hidden_layers
        if num_layers <= TEXT_ENCODER_LAYER:
            # With exactly 50 layers the checkpoint's own last state would be post-norm: not the conditioning.
            raise UserError(
                f"{encoder_dir} has {num_layers} decoder layers, but MiniMax-H3 reads hidden_states"
                f"[{TEXT_ENCODER_LAYER}] of a deeper stack; use the Qwen3-VL-32B conditioner the checkpoint ships."
            )
        # Build and load only layers 0..49: the checkpoint's later layers and lm_head are left unread.
        config.text_config.num_hidden_layers = TEXT_ENCODER_LAYER
        model = _first_layers_model().from_pretrained(
            encoder_dir, config=config, dtype=dtype, device_map=str(torch.device(device)), local_files_only=True
        )
        # The output after the last kept layer is hidden_states[50] only if the final RMSNorm is skipped.
        model.language_model.norm = torch.nn.Identity()
        model.eval()
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        image_processor = AutoImageProcessor.from_pretrained(processor_dir, local_files_only=True)
        return cls(model, tokenizer, image_processor, processor_dir)

    @property
    def device(self) -> torch.device:
        return self.model.language_model.embed_tokens.weight.device

    @property
    def video_processing(self) -> VideoProcessing:
        """The checkpoint's Qwen3-VL video processor settings (qwen_video.py runs them without torchvision). Read at
        the first video reference, so a checkpoint's video settings never stand in the way of other requests."""
        if self._video_processing is None:
            self._video_processing = VideoProcessing.from_pretrained(self._processor_dir)
        return self._video_processing

    def encode_t2va(self, prompt: str) -> TextConditioning:
        """The prompt verbatim: no chat template, no special tokens. Returns embeds [1, L, hidden], tags [L]."""
        presentation = _Presentation(self.tokenizer)
        presentation.prompt(prompt)
        return self._encode(presentation, {})

    def encode_fl2va(self, prompt: str, keyframes: list[Image.Image]) -> TextConditioning:
        """`"<Picture i>: "` + vision block per keyframe (PIL RGB, already on the target canvas), then the prompt.
        Returns embeds [1, L, hidden], tags [L] (0 on the vision blocks' rows)."""
        if not keyframes:
            raise ValueError("fl2va needs at least one keyframe; use encode_t2va for a text-only request.")
        vision = self.image_processor(images=list(keyframes), return_tensors="pt")
        counts = self._image_token_counts(vision["image_grid_thw"])
        presentation = _Presentation(self.tokenizer)
        for index, count in enumerate(counts):
            presentation.text(f"<Picture {index + 1}>: ")
            presentation.vision(IMAGE_PAD, count)
        presentation.prompt(prompt)
        inputs = {"pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}
        return self._encode(presentation, inputs)

    def encode_ref2va(self, prompt: str, references: list[ImageRef | AudioRef | VideoRef]) -> TextConditioning:
        """One label per reference in request order, numbered per modality, then the prompt. Returns embeds
        [1, L, hidden], tags [L] (0 on the vision blocks' rows)."""
        if not references:
            raise ValueError("ref2va needs at least one reference; use encode_t2va for a text-only request.")
        for index, reference in enumerate(references):
            if not isinstance(reference, (ImageRef, AudioRef, VideoRef)):
                raise ValueError(f"references[{index}] must be an ImageRef, AudioRef or VideoRef, got {type(reference)}.")
        if all(isinstance(reference, AudioRef) for reference in references):
            raise ValueError("An audio reference must be paired with at least one image or video reference.")

        # Vision tensors are batched per modality while the presentation follows request order: Qwen3-VL fills the
        # n-th pad run of a modality with the n-th entry of that modality's batch, so the two agree.
        inputs: dict[str, torch.Tensor] = {}
        image_counts: list[int] = []
        images = [reference.image for reference in references if isinstance(reference, ImageRef)]
        if images:
            vision = self.image_processor(images=images, return_tensors="pt")
            inputs.update(pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"])
            image_counts = self._image_token_counts(vision["image_grid_thw"])
        video_counts, video_timestamps = self._video_features(
            [reference for reference in references if isinstance(reference, VideoRef)], inputs
        )

        presentation = _Presentation(self.tokenizer)
        counts = {"image": 0, "video": 0, "audio": 0}
        for reference in references:
            if isinstance(reference, AudioRef) or (isinstance(reference, VideoRef) and reference.has_audio):
                counts["audio"] += 1
                presentation.text(f"<Audio {counts['audio']}>: ")
            if isinstance(reference, ImageRef):
                counts["image"] += 1
                presentation.text(f"<Picture {counts['image']}>: ")
                presentation.vision(IMAGE_PAD, image_counts[counts["image"] - 1])
            elif isinstance(reference, VideoRef):
                counts["video"] += 1
                presentation.text(f"<Video {counts['video']}>: ")
                for timestamp in video_timestamps[counts["video"] - 1]:
                    # "{:.1f}" rounds half to even: the first 2 fps pair renders as "<0.2 seconds>", as in diffusers.
                    presentation.text(f"<{timestamp:.1f} seconds>")
                    presentation.vision(VIDEO_PAD, video_counts[counts["video"] - 1])
        presentation.prompt(prompt)
        return self._encode(presentation, inputs)

    def _image_token_counts(self, grid_thw: torch.Tensor) -> list[int]:
        merge = self.image_processor.merge_size**2
        return [int(grid.prod()) // merge for grid in grid_thw]

    def _video_features(
        self, videos: list[VideoRef], inputs: dict[str, torch.Tensor]
    ) -> tuple[list[int], list[list[float]]]:
        """Pixel tensors of the video references into `inputs`; per-block token counts and block timestamps."""
        if not videos:
            return [], []
        for video in videos:
            frames = video.frames
            if not (isinstance(frames, np.ndarray) and frames.dtype == np.uint8 and frames.ndim == 4
                    and frames.shape[3] == 3):
                raise ValueError("VideoRef.frames must be a uint8 numpy array [T, H, W, 3].")
            if float(video.fps) != MINIMAX_H3_FPS:
                raise ValueError(
                    f"VideoRef.fps is {video.fps:g}, but the text encoder reads references normalised onto "
                    f"MiniMax-H3's {MINIMAX_H3_FPS:g} fps clock; resample the frames to {MINIMAX_H3_FPS:g} fps first."
                )
        settings = self.video_processing
        temporal_patch = settings.temporal_patch_size
        sampled = [sample_video_frames(v.frames, MINIMAX_H3_FPS, VIDEO_SAMPLE_FPS, temporal_patch) for v in videos]
        features = preprocess_videos([np.stack(frames) for frames, _ in sampled], settings)
        inputs.update(pixel_values_videos=features["pixel_values_videos"], video_grid_thw=features["video_grid_thw"])
        merge = settings.merge_size**2
        counts = [int(grid[1]) * int(grid[2]) // merge for grid in features["video_grid_thw"]]
        timestamps = [blocks for _, blocks in sampled]
        for blocks, grid in zip(timestamps, features["video_grid_thw"]):
            if int(grid[0]) != len(blocks):
                raise ValueError(f"The video processor made {int(grid[0])} vision blocks, the labels {len(blocks)}.")
        return counts, timestamps

    @torch.no_grad()
    def _encode(self, presentation: _Presentation, vision_inputs: dict[str, torch.Tensor]) -> TextConditioning:
        """One truncated conditioner call, with the same arguments diffusers' `get_qwen3vl_prompt_embeds` passes."""
        device = self.device
        input_ids = torch.tensor([presentation.ids], dtype=torch.long, device=device)
        mm_token_type_ids = torch.full_like(input_ids, _QWEN_TEXT)
        mm_token_type_ids[input_ids == self.image_pad_id] = _QWEN_IMAGE
        mm_token_type_ids[input_ids == self.video_pad_id] = _QWEN_VIDEO
        kwargs = {
            name: value.to(device, self.model.dtype) if name.startswith("pixel_") else value.to(device)
            for name, value in vision_inputs.items()
        }
        self.model.rope_deltas = None  # Qwen caches M-RoPE deltas for generation; every call here stands alone.
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=mm_token_type_ids,
            use_cache=False,
            **kwargs,
        )
        return TextConditioning(
            embeds=outputs.last_hidden_state, tags=torch.tensor(presentation.tags, dtype=torch.long)
        )
