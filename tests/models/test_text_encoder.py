"""Parity of H3TextEncoder with diffusers 0.42.1's MiniMax-H3 text encoder blocks, on a tiny random Qwen3-VL.

The oracle side runs diffusers' own blocks (`MiniMaxH3TextEncoderStep`, `MiniMaxH3FL2VATextEncoderStep`,
`MiniMaxH3Ref2VATextEncoderStep`) against the *full* 51-layer tiny Qwen3-VL loaded by transformers, so the expected
token ids, tags and `hidden_states[50]` all come from the oracle's code. Token ids are read on both sides by a
forward pre-hook on the Qwen3-VL base model. Tolerance: fp32, bitwise equal (max abs err 0).

Video references: transformers' Qwen3-VL video processor runs on torchvision only. Where torchvision is installed
the oracle uses it; where it is not (h3trt's own set-up), the oracle's processor is h3trt's reproduction of it
(h3trt/models/qwen_video.py, equal to transformers' bit for bit on stored outputs: tests/models/test_qwen_video.py), and
everything else (frame sampling, timestamps, presentation, the model) is still diffusers' and transformers' code.
"""

import shutil
import types
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, Qwen2TokenizerFast, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
from transformers.utils import is_torchvision_available

from diffusers.modular_pipelines import PipelineState
from diffusers.modular_pipelines.minimax_h3 import encoders as oracle
from diffusers.modular_pipelines.minimax_h3.references import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
)
from h3trt.models.qwen_video import VideoProcessing, preprocess_videos
from h3trt.models.text_encoder import (
    TEXT_ENCODER_LAYER,
    AudioRef,
    H3TextEncoder,
    ImageRef,
    MissingComponentError,
    VideoRef,
)
from h3trt.models.tiny_text_encoder import write_tiny_text_encoder

PROMPT = "A red fox runs through the snowy forest, the camera follows it."


def _image(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def _video(frames: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (frames, 16, 24, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny_text_encoder")
    write_tiny_text_encoder(root)
    return root


@pytest.fixture(scope="module")
def encoder(tiny_root) -> H3TextEncoder:
    return H3TextEncoder.from_pretrained(tiny_root, dtype=torch.float32)


class _ReproducedVideoProcessor:
    """What diffusers reads of transformers' video processor, served by h3trt's torchvision-free reproduction."""

    def __init__(self, processor_dir: Path):
        self.settings = VideoProcessing.from_pretrained(processor_dir)
        self.temporal_patch_size = self.settings.temporal_patch_size

    def __call__(self, videos, do_sample_frames, return_tensors):
        assert do_sample_frames is False and return_tensors == "pt"
        return preprocess_videos(videos, self.settings)


def _oracle_processor(root: Path):
    """The real Qwen3VLProcessor. Without torchvision transformers cannot construct one (its video processor is a
    torchvision class), so the real class is assembled around the checkpoint's tokenizer and image processor, with
    the reproduced video processor (see the module docstring)."""
    if is_torchvision_available():
        return Qwen3VLProcessor.from_pretrained(root / "processor", local_files_only=True)
    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.tokenizer = Qwen2TokenizerFast.from_pretrained(root / "processor", local_files_only=True)
    processor.image_processor = AutoImageProcessor.from_pretrained(root / "processor", local_files_only=True)
    processor.video_processor = _ReproducedVideoProcessor(root / "processor")
    processor.image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return processor


@pytest.fixture(scope="module")
def components(tiny_root):
    """What diffusers' blocks read off `MiniMaxH3ModularPipeline`, with the full (untruncated) tiny Qwen3-VL."""
    return types.SimpleNamespace(
        text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(
            tiny_root / "text_encoder", dtype=torch.float32, local_files_only=True
        ).eval(),
        tokenizer=Qwen2TokenizerFast.from_pretrained(tiny_root / "tokenizer", local_files_only=True),
        processor=_oracle_processor(tiny_root),
        text_encoder_layer=TEXT_ENCODER_LAYER,
        text_tag=1,
        video_tag=0,
        fps=24,
        _execution_device=torch.device("cpu"),
    )


@contextmanager
def _recorded_inputs(model: torch.nn.Module):
    """The keyword arguments of every forward of the Qwen3-VL base model inside the block."""
    calls = []
    handle = model.register_forward_pre_hook(lambda _, args, kwargs: calls.append(kwargs), with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def _run_oracle(block, components, **inputs):
    """Run one diffusers block; returns (token ids, mm_token_type_ids, embeds, tags)."""
    state = PipelineState()
    for name, value in inputs.items():
        state.set(name, value)
    with _recorded_inputs(components.text_encoder.model) as calls:
        block(components, state)
    (call,) = calls
    return call["input_ids"][0].tolist(), call["mm_token_type_ids"], state.get("prompt_embeds"), state.get(
        "text_token_tags"
    )


def _run_ours(encoder: H3TextEncoder, method: str, *args):
    with _recorded_inputs(encoder.model) as calls:
        conditioning = getattr(encoder, method)(*args)
    (call,) = calls
    return call["input_ids"][0].tolist(), call["mm_token_type_ids"], conditioning


def _assert_same(ours, expected, expect_tags: list[int] | None = None):
    ids, mm_types, conditioning = ours
    oracle_ids, oracle_mm_types, oracle_embeds, oracle_tags = expected
    assert ids == oracle_ids
    assert torch.equal(mm_types, oracle_mm_types)
    assert conditioning.tags.dtype == torch.long and torch.equal(conditioning.tags, oracle_tags)
    if expect_tags is not None:
        assert conditioning.tags.tolist() == expect_tags
    assert conditioning.embeds.shape == (1, len(ids), 48) == oracle_embeds.shape
    assert (conditioning.embeds - oracle_embeds).abs().max().item() == 0.0


def _vision_tags(ids: list[int], tokenizer) -> list[int]:
    """Tags by the presentation rule: 0 on every row from <|vision_start|> through <|vision_end|>, else 1."""
    start, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    tags, inside = [], False
    for token in ids:
        inside = inside or token == start
        tags.append(0 if inside else 1)
        inside = inside and token != end
    return tags


def test_t2va_matches_diffusers_and_is_pre_norm(encoder, components):
    ours = _run_ours(encoder, "encode_t2va", PROMPT)
    expected = _run_oracle(oracle.MiniMaxH3TextEncoderStep(), components, prompt=PROMPT)
    assert ours[0] == components.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    _assert_same(ours, expected, expect_tags=[1] * len(ours[0]))

    # Only layers 0..49 exist and no final norm runs: the result is neither the normed last state nor norm(h[50]).
    assert len(encoder.model.language_model.layers) == TEXT_ENCODER_LAYER
    full = components.text_encoder.model(input_ids=torch.tensor([ours[0]]), output_hidden_states=True)
    embeds = ours[2].embeds
    assert torch.equal(embeds, full.hidden_states[TEXT_ENCODER_LAYER])
    assert not torch.allclose(embeds, full.hidden_states[-1], atol=1e-3)
    assert not torch.allclose(embeds, components.text_encoder.model.language_model.norm(embeds), atol=1e-3)


@pytest.mark.parametrize("num_keyframes", [1, 2])
def test_fl2va_matches_diffusers(encoder, components, num_keyframes):
    keyframes = [_image(32, 48, seed) for seed in range(num_keyframes)]
    ours = _run_ours(encoder, "encode_fl2va", PROMPT, keyframes)
    expected = _run_oracle(oracle.MiniMaxH3FL2VATextEncoderStep(), components, prompt=PROMPT, keyframes=keyframes)
    _assert_same(ours, expected, expect_tags=_vision_tags(ours[0], components.tokenizer))
    # A 32x48 keyframe is 4x6 merged patches at patch 4 / merge 2: 24 pads per block, one block per keyframe.
    image_pad = components.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ours[0].count(image_pad) == 24 * num_keyframes
    assert ours[2].tags.tolist().count(0) == 26 * num_keyframes


def test_ref2va_images_and_audio_match_diffusers(encoder, components):
    images = [_image(32, 48, 3), _image(48, 40, 4)]
    ours = _run_ours(encoder, "encode_ref2va", PROMPT, [ImageRef(images[0]), AudioRef(), ImageRef(images[1])])
    references = [
        MiniMaxH3ImageReference(image=images[0]),
        MiniMaxH3AudioReference(audio=torch.zeros(2, 64)),
        MiniMaxH3ImageReference(image=images[1]),
    ]
    expected = _run_oracle(
        oracle.MiniMaxH3Ref2VATextEncoderStep(), components, prompt=PROMPT, normalized_references=references
    )
    _assert_same(ours, expected, expect_tags=_vision_tags(ours[0], components.tokenizer))
    text = components.tokenizer.decode([token for token, tag in zip(ours[0], ours[2].tags.tolist()) if tag == 1])
    assert text == f"<Picture 1>: <Audio 1>: <Picture 2>: {PROMPT}"


def test_ref2va_with_video_matches_diffusers(encoder, components):
    image, videos = _image(32, 48, 5), [_video(30, 6), _video(13, 7)]
    ours = _run_ours(encoder, "encode_ref2va", PROMPT, [
        VideoRef(videos[0], fps=24.0, has_audio=True), ImageRef(image), AudioRef(), VideoRef(videos[1], fps=24.0),
    ])
    references = [
        MiniMaxH3VideoReference(frames=videos[0], fps=24.0, audio=torch.zeros(2, 64)),
        MiniMaxH3ImageReference(image=image),
        MiniMaxH3AudioReference(audio=torch.zeros(2, 64)),
        MiniMaxH3VideoReference(frames=videos[1], fps=24.0),
    ]
    expected = _run_oracle(
        oracle.MiniMaxH3Ref2VATextEncoderStep(), components, prompt=PROMPT, normalized_references=references
    )
    _assert_same(ours, expected, expect_tags=_vision_tags(ours[0], components.tokenizer))
    text = components.tokenizer.decode([token for token, tag in zip(ours[0], ours[2].tags.tolist()) if tag == 1])
    # 30 frames at 24 fps read at 2 fps: frames 0, 12, 24 (+ 24 repeated) -> blocks at 0.25 s ("0.2", half to even)
    # and 1.0 s; 13 frames: frames 0, 12 -> one block.
    assert text == (
        "<Audio 1>: <Video 1>: <0.2 seconds><1.0 seconds><Picture 1>: <Audio 2>: <Video 2>: <0.2 seconds>" + PROMPT
    )


def test_video_reference_off_the_24fps_clock_is_rejected(encoder):
    with pytest.raises(ValueError, match="24 fps"):
        encoder.encode_ref2va(PROMPT, [VideoRef(_video(30, 0), fps=30.0)])


def test_missing_tokenizer_folder_names_it(tiny_root, tmp_path):
    root = tmp_path / "checkpoint"
    shutil.copytree(tiny_root, root)
    shutil.rmtree(root / "tokenizer")
    with pytest.raises(MissingComponentError, match=r"tokenizer is missing") as error:
        H3TextEncoder.from_pretrained(root, dtype=torch.float32)
    assert isinstance(error.value, ValueError) and str(root / "tokenizer") in str(error.value)


@pytest.mark.parametrize("task", ["t2va", "fl2va"])
def test_empty_prompt_is_rejected(encoder, task):
    with pytest.raises(ValueError, match="zero tokens"):
        if task == "t2va":
            encoder.encode_t2va("")
        else:
            encoder.encode_fl2va("", [_image(32, 48, 0)])


def test_tiny_writer_is_deterministic_small_and_reloadable(tiny_root, tmp_path):
    write_tiny_text_encoder(tmp_path / "again")
    files = sorted(path.relative_to(tiny_root) for path in tiny_root.rglob("*") if path.is_file())
    assert files == sorted(path.relative_to(tmp_path / "again") for path in (tmp_path / "again").rglob("*")
                           if path.is_file())
    assert all((tiny_root / f).read_bytes() == (tmp_path / "again" / f).read_bytes() for f in files)
    assert sum((tiny_root / f).stat().st_size for f in files) < 5 * 2**20

    tokenizer = Qwen2TokenizerFast.from_pretrained(tiny_root / "tokenizer", local_files_only=True)
    config = Qwen3VLForConditionalGeneration.config_class.from_pretrained(tiny_root / "text_encoder")
    assert config.text_config.num_hidden_layers == TEXT_ENCODER_LAYER + 1
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    image_processor = AutoImageProcessor.from_pretrained(tiny_root / "processor", local_files_only=True)
    assert (image_processor.patch_size, image_processor.merge_size) == (
        config.vision_config.patch_size, config.vision_config.spatial_merge_size
    )
