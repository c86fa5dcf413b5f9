"""Where block-sparse attention applies (models/sparse/plan.py): which query blocks of a packed layout are sparse,
which evaluations run sparse, and the settings' checks."""

import math

import pytest
import torch

from h3trt.errors import UserError
from h3trt.models.config import AUDIO_TAG, TEXT_TAG, VIDEO_TAG
from h3trt.models.packing import pack_t2va
from h3trt.models.sparse.plan import (DEFAULT_DENSE_STEPS, DEFAULT_MIN_SEQ, SparseSettings, evaluation_is_sparse,
                                      sparse_query_blocks, sparse_settings)

BLOCK = 64


def tiny_layout(keyframes=()):
    """A small packed layout: 70 text rows, 3 latent frames of 32x30 (patch 1x2x2: 240 rows each), 100 audio
    latents (200 rows), optional keyframes (240 condition rows each): blocks of every kind, mixed ones at the
    boundaries, a ragged tail."""
    text_tags = torch.full((70,), TEXT_TAG, dtype=torch.long)
    return pack_t2va(text_tags, 3, 32, 30, 100, (1, 2, 2), keyframes)


def brute_force(layout, block):
    """Block g is sparse iff each of its rows is a video row that is not a condition row."""
    target = set(layout.video_index[layout.num_condition_video_rows:].tolist())
    S = layout.seq_len
    return [all(r in target for r in range(g * block, min(S, (g + 1) * block))) for g in range(math.ceil(S / block))]


@pytest.mark.parametrize("keyframes", [(), ("first",), ("first", "last")])
@pytest.mark.parametrize("block", [64, 32])
def test_only_blocks_of_target_video_rows_are_sparse(keyframes, block):
    layout = tiny_layout(keyframes)
    got = sparse_query_blocks(layout, block)
    assert got.tolist() == brute_force(layout, block)
    assert got.any() and not got.all()  # the layout has both kinds


def test_text_audio_condition_and_mixed_blocks_are_dense():
    layout = tiny_layout(("first",))
    tags = layout.token_tags
    sparse = sparse_query_blocks(layout, BLOCK)
    condition = set(layout.video_index[:layout.num_condition_video_rows].tolist())
    seen = set()
    for g, is_sparse in enumerate(sparse.tolist()):
        rows = range(g * BLOCK, min(layout.seq_len, (g + 1) * BLOCK))
        kinds = {int(tags[r]) for r in rows}
        has_condition = any(r in condition for r in rows)
        if kinds != {VIDEO_TAG} or has_condition:
            assert not is_sparse, f"block {g}: tags {kinds}, condition rows {has_condition}"
            seen.add("mixed" if len(kinds) > 1 else "condition" if has_condition else
                     {TEXT_TAG: "text", AUDIO_TAG: "audio"}[kinds.pop()])
        else:
            assert is_sparse
    assert {"text", "audio", "mixed", "condition"} <= seen  # each kind was checked


def test_a_ragged_last_block_of_video_rows_is_sparse():
    layout = tiny_layout()
    assert layout.seq_len % BLOCK  # ragged
    assert bool(sparse_query_blocks(layout, BLOCK)[-1])


def test_evaluations_before_dense_steps_and_short_attentions_are_dense():
    s = SparseSettings(0.75, dense_steps=3, min_seq=100)
    assert [evaluation_is_sparse(s, i, 100) for i in range(5)] == [False, False, False, True, True]
    assert not evaluation_is_sparse(s, 4, 99)
    assert not evaluation_is_sparse(SparseSettings(0.0, 0, 1), 10, 10_000)  # sparsity 0: dense throughout


def test_defaults_are_subblocks():
    s = sparse_settings(0.5)
    assert (s.dense_steps, s.min_seq) == (DEFAULT_DENSE_STEPS, DEFAULT_MIN_SEQ) == (10, 4096)
    assert not sparse_settings().enabled


@pytest.mark.parametrize("kwargs, named", [
    ({"sparsity": -0.1}, "--sparse-attention"), ({"sparsity": 1.0}, "--sparse-attention"),
    ({"sparsity": float("nan")}, "--sparse-attention"), ({"sparsity": "0.5"}, "--sparse-attention"),
    ({"sparsity": True}, "--sparse-attention"), ({"dense_steps": -1}, "--sparse-dense-steps"),
    ({"dense_steps": 2.5}, "--sparse-dense-steps"), ({"min_seq": 0}, "--sparse-min-seq"),
])
def test_bad_settings_are_refused_by_name(kwargs, named):
    with pytest.raises(UserError, match=named):
        sparse_settings(**kwargs)
    with pytest.raises(UserError, match=named[2:].replace("-", "_")):
        sparse_settings(**kwargs, where="")
