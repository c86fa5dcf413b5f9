"""A tiny, random, offline Qwen3-VL conditioner in the checkpoint's folder layout (`text_encoder/`, `tokenizer/`,
`processor/`), for tests and the embedded tiny default (models/tiny.py). It loads through the same code as the real
Qwen3-VL-32B conditioner (text_encoder.py's H3TextEncoder.from_pretrained)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .text_encoder import (IMAGE_PAD, PROCESSOR_DIR, TEXT_ENCODER_DIR, TEXT_ENCODER_LAYER, TOKENIZER_DIR, VIDEO_PAD,
                           VISION_END, VISION_START)

_TINY_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", VISION_START, VISION_END, "<|vision_pad|>", IMAGE_PAD, VIDEO_PAD]
_TINY_CORPUS = (
    "<Picture 1>: <Picture 2>: <Audio 1>: <Video 1>: <0.2 seconds><1.2 seconds> "
    "A red fox runs through the snowy forest while the camera follows it at sunset, and music plays."
)
_TINY_PATCH, _TINY_MERGE, _TINY_TEMPORAL = 4, 2, 2
_TINY_MEAN_STD = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # Qwen3-VL's own normalisation.


def _tiny_tokenizer():
    """A byte-level BPE with Qwen2's pre-tokenizer, trained on a fixed sentence, as a Qwen2Tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=352, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator([_TINY_CORPUS], trainer)
    trained = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=trained["vocab"], merges=merges)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in _TINY_SPECIAL_TOKENS],
                         special_tokens=True)
    tokenizer._set_processor_class("Qwen3VLProcessor")
    return tokenizer


def write_tiny_text_encoder(component_root: Path, hidden_size: int = 48, seed: int = 0, head_dim: int | None = None,
                            intermediate_size: int | None = None) -> None:
    """Write `text_encoder/`, `tokenizer/` and `processor/` of a tiny random Qwen3-VL under `component_root`.

    The text stack has TEXT_ENCODER_LAYER + 1 layers so that hidden_states[50] is a pre-norm state, as in the real
    64-layer conditioner. The processor folder is written in Qwen3-VL's file layout (preprocessor_config.json,
    video_preprocessor_config.json, tokenizer files) one sub-processor at a time, because transformers cannot
    instantiate a Qwen3VLProcessor without torchvision; Qwen3VLProcessor.from_pretrained reads it back.

    `head_dim` and `intermediate_size` (default hidden_size / 4 and hidden_size) let a conditioner with H3's real
    output width (5120) stay small: 51 layers of 5120-wide attention and MLP would be 7B parameters.
    """
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    if hidden_size % 4:
        raise ValueError(f"hidden_size must be a multiple of 4 (4 attention heads), got {hidden_size}.")
    root = Path(component_root)
    tokenizer = _tiny_tokenizer()
    token_id = tokenizer.convert_tokens_to_ids
    head_dim = head_dim or hidden_size // 4
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size or hidden_size,
            num_hidden_layers=TEXT_ENCODER_LAYER + 1, num_attention_heads=4, num_key_value_heads=1,
            head_dim=head_dim, max_position_embeddings=4096,
            # Interleaved M-RoPE as in Qwen3-VL; the sections split head_dim // 2 over (t, h, w).
            rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_interleaved": True,
                             "mrope_section": [head_dim // 2 - 2 * (head_dim // 6), head_dim // 6, head_dim // 6]},
        ),
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=_TINY_PATCH,
            spatial_merge_size=_TINY_MERGE, temporal_patch_size=_TINY_TEMPORAL, out_hidden_size=hidden_size,
            num_position_embeddings=64, deepstack_visual_indexes=[0],
        ),
        image_token_id=token_id(IMAGE_PAD), video_token_id=token_id(VIDEO_PAD),
        vision_start_token_id=token_id(VISION_START), vision_end_token_id=token_id(VISION_END),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config)
    model.save_pretrained(root / TEXT_ENCODER_DIR)
    tokenizer.save_pretrained(root / TOKENIZER_DIR)

    patches = {"patch_size": _TINY_PATCH, "merge_size": _TINY_MERGE, "temporal_patch_size": _TINY_TEMPORAL}
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 256, "longest_edge": 64 * 64 * 4}, **patches, **_TINY_MEAN_STD
    )
    video_processor = Qwen3VLVideoProcessor(
        size={"shortest_edge": 256, "longest_edge": 64 * 64 * 64}, **patches, **_TINY_MEAN_STD
    )
    processor_dir = root / PROCESSOR_DIR
    tokenizer.save_pretrained(processor_dir)
    image_processor.save_pretrained(processor_dir)
    video_processor.save_pretrained(processor_dir)
