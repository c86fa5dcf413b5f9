"""Shared test inputs: the random DiT activations every parity test feeds the model (one generator, drawn in the
order video, audio, text, so a seed reproduces the same tensors wherever it is used)."""

from __future__ import annotations

import torch

from h3trt.models.config import H3Config
from h3trt.models.packing import PackedLayout


def dit_inputs(layout: PackedLayout, cfg: H3Config, seed: int = 0, batch: int = 1,
               text_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random float32 (video [B, V, video_patch_dim], audio [B, A, audio_in_channels], text [B, L, text_dim]) rows
    for `layout`; `text_rows` overrides L (default: the layout's text rows)."""
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(batch, layout.video_index.numel(), cfg.video_patch_dim, generator=g)
    audio = torch.randn(batch, layout.audio_index.numel(), cfg.audio_in_channels, generator=g)
    text = torch.randn(batch, layout.text_index.numel() if text_rows is None else text_rows, cfg.text_dim,
                       generator=g)
    return video, audio, text
