"""h3trt.models.packing against the diffusers 0.42.1 MiniMax-H3 reference (the oracle).

Packed layouts (positions, tags, row indices) are compared bit-exactly with `torch.equal`; canvas and duration rules
are compared for equality with the diffusers helpers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3Ref2VAPrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    align_num_frames as d_align_num_frames,
    audio_latent_num_frames as d_audio_latent_num_frames,
    resolve_canvas_size as d_resolve_canvas_size,
    video_latent_num_frames as d_video_latent_num_frames,
)
from diffusers.modular_pipelines.minimax_h3.references import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
)

from h3trt.models import packing
from h3trt.models.packing import (
    Geometry,
    RefBlock,
    align_num_frames,
    audio_latents,
    audio_to_rows,
    frames_for_duration,
    latent_frames,
    pack_ref2va,
    pack_t2va,
    patchify,
    resolve_canvas,
    row_timesteps,
    rows_to_audio,
    span_pairwise,
    span_sequential,
    text_tags_for,
    unpatchify,
    validate_canvas,
)

PATCH = (1, 2, 2)
AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG, TEXT_TAG = 2, 2, 0, 1
FRAMES_PER_CHUNK, LATENTS_PER_CHUNK = 17, 5
SHORT_EDGE, MAX_PIXELS, MULTIPLE = 768, 768 * 1344, 32


# ----------------------------------------------------------------------------------------------------------------------
# Helpers


def assert_layout_equal(ours, ref):
    """`ours` is an h3trt PackedLayout, `ref` the 7-tuple diffusers returns."""
    pos, tags, vidx, aidx, tidx, ncv, nca = ref
    assert ours.position_ids.dtype == torch.float64 and pos.dtype == torch.float64
    assert ours.position_ids.shape == pos.shape
    if not torch.equal(ours.position_ids, pos):
        bad = (ours.position_ids != pos).any(-1).nonzero().flatten()
        r = int(bad[0])
        raise AssertionError(
            f"position_ids differ on {bad.numel()} rows, first row {r}: ours {ours.position_ids[r].tolist()} "
            f"vs diffusers {pos[r].tolist()}"
        )
    assert torch.equal(ours.token_tags, tags)
    assert torch.equal(ours.video_index, vidx)
    assert torch.equal(ours.audio_index, aidx)
    assert torch.equal(ours.text_index, tidx)
    assert ours.num_condition_video_rows == ncv
    assert ours.num_condition_audio_rows == nca
    assert ours.seq_len == pos.shape[0]


def d_t2va(text_tags, T, h, w, A, keyframes, patch=PATCH):
    return MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_tags, T, h, w, A, patch, AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG, keyframe_anchors=tuple(keyframes)
    )


def diffusers_refs(blocks: list[RefBlock], channels: int = 24):
    """Translate h3trt RefBlocks to diffusers' reference objects and the latents the diffusers packer reads shapes from."""
    refs, cond, audio_rows = [], [], []
    for b in blocks:
        if b.kind == "image":
            refs.append(MiniMaxH3ImageReference(image=np.zeros((4, 4, 3), dtype=np.uint8)))
        elif b.kind == "audio":
            refs.append(MiniMaxH3AudioReference(audio=torch.zeros(2, 16)))
        else:
            refs.append(
                MiniMaxH3VideoReference(
                    frames=np.zeros((2, 4, 4, 3), dtype=np.uint8),
                    audio=torch.zeros(2, 16) if b.audio_latents > 0 else None,
                )
            )
        if b.latent_shape is not None:
            cond.append(torch.zeros(1, channels, *b.latent_shape))
        if b.kind == "audio" or (b.kind == "video" and b.audio_latents > 0):
            audio_rows.append(torch.zeros(b.audio_latents * AUDIO_CHANNELS, 32))
    # sanity: the stand-ins carry what the diffusers packer reads
    for r, b in zip(refs, blocks):
        assert r.kind == b.kind
        if b.kind == "video":
            assert r.has_audio == (b.audio_latents > 0)
    return refs, cond, audio_rows


def d_ref2va(text_tags, blocks, T, h, w, A, patch=PATCH):
    refs, cond, audio_rows = diffusers_refs(blocks)
    return MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        text_tags, refs, cond, audio_rows, T, h, w, A, patch, AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG
    )


def d_row_timesteps(layout, video_t, audio_t):
    return MiniMaxH3SetTimestepsStep.build_row_timesteps(
        layout.video_index,
        layout.audio_index,
        layout.num_condition_video_rows,
        layout.num_condition_audio_rows,
        layout.text_index.numel(),
        float(video_t),
        float(audio_t),
        max(float(video_t), 0.999),
        1.0,
    )


# ----------------------------------------------------------------------------------------------------------------------
# 1. t2va / fl2va layouts

# (text rows, latent frames, latent h, latent w, audio latents per channel, patch)
T2VA_GEOMETRIES = [
    pytest.param(12, 7, 4, 4, 40, PATCH, id="square-7f"),
    pytest.param(31, 37, 6, 10, 207, PATCH, id="long-37f-6x10"),
    pytest.param(9, 12, 8, 4, 70, PATCH, id="portrait-12f-8x4"),
    pytest.param(5, 17, 4, 6, 113, PATCH, id="17f-4x6"),
    pytest.param(40, 37, 48, 84, 207, PATCH, id="released-canvas-768x1344"),
    pytest.param(7, 9, 3, 5, 20, (1, 1, 1), id="patch111-odd"),
]

KEYFRAMES = [
    pytest.param((), id="t2va"),
    pytest.param(("first",), id="first"),
    pytest.param(("last",), id="last"),
    pytest.param(("first", "last"), id="first+last"),
    pytest.param(("last", "first"), id="last+first"),
]


@pytest.mark.parametrize("keyframes", KEYFRAMES)
@pytest.mark.parametrize("L,T,h,w,A,patch", T2VA_GEOMETRIES)
def test_pack_t2va_matches_diffusers(L, T, h, w, A, patch, keyframes):
    if keyframes:
        # fl2va: some text rows belong to a vision block and are tagged 0
        text_tags = text_tags_for(L, [range(1, min(L, 4)), range(L - 2, L)])
        assert (text_tags == 0).any() and (text_tags == 1).any()
    else:
        text_tags = torch.ones(L, dtype=torch.long)
    ours = pack_t2va(text_tags, T, h, w, A, patch, keyframes=keyframes)
    ref = d_t2va(text_tags, T, h, w, A, keyframes, patch)
    assert_layout_equal(ours, ref)
    rows_per_frame = (h // patch[1]) * (w // patch[2])
    assert ours.num_condition_video_rows == len(keyframes) * rows_per_frame
    assert ours.seq_len == L + (len(keyframes) + T) * rows_per_frame + 2 * A


def test_a_layouts_digest_is_equal_for_equal_layouts_and_differs_in_any_field():
    """PackedLayout.digest is the one rule of "the same layout" (a batched denoise's, jobs/work.py layout_key's):
    layouts packed alike digest alike, and a change to any one field (a value, a shape or a dtype of a tensor, the
    condition rows, the video grid) changes the digest."""
    import dataclasses

    tags = torch.ones(5, dtype=torch.long)
    layout = pack_t2va(tags, 3, 4, 6, 10, keyframes=("first",))
    assert pack_t2va(tags.clone(), 3, 4, 6, 10, keyframes=("first",)).digest() == layout.digest()
    assert layout.to("cpu").digest() == layout.digest()
    changed = {}
    for f in dataclasses.fields(layout):
        value = getattr(layout, f.name)
        if isinstance(value, torch.Tensor):
            bumped = value.clone()
            bumped.view(-1)[-1] += 1
            other_dtype = torch.int32 if value.is_floating_point() else torch.float64
            changed[f.name] = [bumped, value[:-1], value.to(other_dtype)]
        elif f.name == "video_grid":
            changed[f.name] = [None, (value[0] + 1, *value[1:])]
        else:
            changed[f.name] = [value + 1]
    assert set(changed) == {f.name for f in dataclasses.fields(layout)}
    digests = {layout.digest()}
    for name, values in changed.items():
        for value in values:
            digests.add(dataclasses.replace(layout, **{name: value}).digest())
    assert len(digests) == 1 + sum(len(v) for v in changed.values())
    # the same other layouts pack differently: a longer text, another canvas, another keyframe
    assert len({layout.digest(), pack_t2va(torch.ones(6, dtype=torch.long), 3, 4, 6, 10, keyframes=("first",)).digest(),
                pack_t2va(tags, 3, 4, 8, 10, keyframes=("first",)).digest(),
                pack_t2va(tags, 3, 4, 6, 10, keyframes=("last",)).digest()}) == 4


def test_t2va_last_anchor_needs_pairwise_sum(monkeypatch):
    """Sensitivity check: at 37 latent frames the two summation orders differ in the last ulp, and the diffusers
    'last' anchor follows numpy's pairwise sum; summing sequentially instead must break the comparison."""
    L, T, h, w, A = 31, 37, 6, 10, 207
    assert span_pairwise(T) != span_sequential(T)
    assert L + span_pairwise(T) - 5 / 3 != L + span_sequential(T) - 5 / 3
    tags = torch.ones(L, dtype=torch.long)
    ref = d_t2va(tags, T, h, w, A, ("last",))
    assert_layout_equal(pack_t2va(tags, T, h, w, A, keyframes=("last",)), ref)
    monkeypatch.setattr(packing, "span_pairwise", span_sequential)
    mutated = pack_t2va(tags, T, h, w, A, keyframes=("last",))
    assert not torch.equal(mutated.position_ids, ref[0])


def test_pack_t2va_rejects_bad_anchor():
    with pytest.raises(ValueError, match="anchor"):
        pack_t2va(torch.ones(3, dtype=torch.long), 7, 4, 4, 10, keyframes=("middle",))


def test_text_tags_for():
    tags = text_tags_for(10, [range(2, 5), range(8, 10)])
    assert tags.dtype == torch.long
    assert tags.tolist() == [1, 1, 0, 0, 0, 1, 1, 1, 0, 0]


# ----------------------------------------------------------------------------------------------------------------------
# 2. ref2va layouts

REF2VA_CASES = [
    pytest.param(
        14,
        [RefBlock("image", (1, 8, 12)), RefBlock("image", (1, 6, 4)), RefBlock("audio", audio_latents=30)],
        (7, 4, 6, 40),
        id="two-images+audio",
    ),
    pytest.param(
        20,
        [RefBlock("video", (7, 4, 4), audio_latents=25), RefBlock("image", (1, 4, 8)),
         RefBlock("audio", audio_latents=12)],
        (12, 6, 4, 70),
        id="video-with-soundtrack(span wins)+image+audio",
    ),
    pytest.param(
        9,
        [RefBlock("audio", audio_latents=5), RefBlock("video", (2, 6, 6), audio_latents=60),
         RefBlock("image", (1, 4, 4))],
        (7, 4, 4, 40),
        id="audio+video-with-long-soundtrack(audio wins)+image",
    ),
    pytest.param(
        11,
        [RefBlock("image", (1, 4, 6)), RefBlock("video", (37, 4, 6), audio_latents=0)],
        (17, 4, 6, 113),
        id="image+silent-video-37f",
    ),
    pytest.param(
        6,
        [RefBlock("video", (37, 6, 4), audio_latents=0), RefBlock("video", (17, 4, 4), audio_latents=100),
         RefBlock("audio", audio_latents=3)],
        (37, 6, 10, 207),
        id="silent-37f+video-17f-soundtrack+audio",
    ),
]


@pytest.mark.parametrize("L,blocks,target", REF2VA_CASES)
def test_pack_ref2va_matches_diffusers(L, blocks, target):
    T, h, w, A = target
    text_tags = text_tags_for(L, [range(2, 5)])
    ours = pack_ref2va(text_tags, blocks, T, h, w, A, PATCH)
    ref = d_ref2va(text_tags, blocks, T, h, w, A, PATCH)
    assert_layout_equal(ours, ref)
    assert ours.num_condition_audio_rows == 2 * sum(b.audio_latents for b in blocks)


def test_ref2va_video_clock_needs_sequential_sum(monkeypatch):
    """Sensitivity check: a 37-frame reference video advances the clock by the sequential sum; the pairwise sum
    differs in the last ulp there and must break the comparison."""
    L = 11
    blocks = [RefBlock("image", (1, 4, 6)), RefBlock("video", (37, 4, 6))]
    T, h, w, A = 17, 4, 6, 113
    tags = torch.ones(L, dtype=torch.long)
    ref = d_ref2va(tags, blocks, T, h, w, A)
    assert_layout_equal(pack_ref2va(tags, blocks, T, h, w, A), ref)
    assert (L + 1.0) + span_sequential(37) != (L + 1.0) + span_pairwise(37)
    monkeypatch.setattr(packing, "span_sequential", span_pairwise)
    mutated = pack_ref2va(tags, blocks, T, h, w, A)
    assert not torch.equal(mutated.position_ids, ref[0])


def test_refblock_validation():
    with pytest.raises(ValueError):
        RefBlock("text")
    with pytest.raises(ValueError):
        RefBlock("image")
    with pytest.raises(ValueError):
        RefBlock("image", (2, 4, 4))
    with pytest.raises(ValueError):
        RefBlock("audio", audio_latents=0)


# ----------------------------------------------------------------------------------------------------------------------
# 3. Per-row timesteps


def _layouts():
    tags = text_tags_for(13, [range(3, 7)])
    return {
        "t2va": pack_t2va(torch.ones(13, dtype=torch.long), 7, 4, 6, 40),
        "fl2va": pack_t2va(tags, 7, 4, 6, 40, keyframes=("first", "last")),
        "ref2va": pack_ref2va(
            tags,
            [RefBlock("video", (7, 4, 4), audio_latents=25), RefBlock("image", (1, 4, 8)),
             RefBlock("audio", audio_latents=12)],
            7, 4, 6, 40,
        ),
    }


LAYOUTS = _layouts()

T_PAIRS = [
    (0.0, 0.0),
    (0.25, 0.6),
    (0.5, 0.5),
    (0.9989, 0.97),
    (0.999, 0.999),
    (0.9995, 0.9999),  # video t above the condition level: condition rows take max(t, 0.999)
    (0.99999, 1.0),
]


def _schedule_pairs():
    """(video t, audio t) of real evaluations, the float32 grid passed on as Python floats as diffusers does."""
    from diffusers import MiniMaxH3Scheduler

    v, a = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    v.set_timesteps(50)
    a.set_timesteps(50)
    return [(float(v.timesteps[i]), float(a.timesteps[i])) for i in (0, 1, 24, 47, 48)]


T_PAIRS += _schedule_pairs()


@pytest.mark.parametrize("video_t,audio_t", T_PAIRS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_row_timesteps_match_diffusers(name, video_t, audio_t):
    layout = LAYOUTS[name]
    u, inv = row_timesteps(layout, video_t, audio_t)
    du, dinv = d_row_timesteps(layout, video_t, audio_t)
    assert u.dtype == du.dtype == torch.float32
    assert torch.equal(u, du)
    assert torch.equal(inv, dinv)
    assert inv.shape == (layout.seq_len,)
    # the semantics spelled out: condition video rows at max(t, 0.999), reference audio at 1.0
    per_row = u[inv]
    cv, ca = layout.num_condition_video_rows, layout.num_condition_audio_rows
    if cv:
        assert torch.all(per_row[layout.video_index[:cv]] == torch.tensor(max(video_t, 0.999), dtype=torch.float32))
    if ca:
        assert torch.all(per_row[layout.audio_index[:ca]] == 1.0)
    assert torch.all(per_row[layout.audio_index[ca:]] == torch.tensor(audio_t, dtype=torch.float32))
    assert torch.all(per_row[layout.video_index[cv:]] == torch.tensor(video_t, dtype=torch.float32))


# ----------------------------------------------------------------------------------------------------------------------
# 4. Canvas and duration rules

ASPECTS = [
    (16, 9), (9, 16), (1, 1), (4, 3), (3, 4), (21, 9), (9, 21), (4, 1), (1, 4), (2.35, 1), (1920, 1080),
    (1080, 1920), (1280, 720), (7, 3), (3, 2), (2, 3), (5, 4), (1.001, 1), (3.99, 1), (1, 3.99), (640, 480),
    (1344, 768), (768, 1344), (17, 5), (5, 17),
]


@pytest.mark.parametrize("aw,ah", ASPECTS)
def test_resolve_canvas_matches_diffusers(aw, ah):
    ours = resolve_canvas(aw, ah)
    assert ours == d_resolve_canvas_size(aw, ah, MULTIPLE, SHORT_EDGE, MAX_PIXELS)
    assert ours[0] % 32 == 0 and ours[1] % 32 == 0


def test_resolve_canvas_random_ratios_match_diffusers():
    rng = np.random.default_rng(0)
    for ratio in np.exp(rng.uniform(math.log(0.25), math.log(4.0), 300)):
        assert resolve_canvas(float(ratio), 1.0) == d_resolve_canvas_size(
            float(ratio), 1.0, MULTIPLE, SHORT_EDGE, MAX_PIXELS
        )


def test_validate_canvas_accepts_every_resolved_canvas():
    """A canvas resolve_canvas produced for some aspect ratio is a canvas H3 generates, so validate_canvas must accept
    it. (Known failure: validate_canvas re-resolves the canvas from the *rounded* aspect, whose own canvas can be one
    multiple of 32 narrower, e.g. resolve_canvas(1.8, 1) == (768, 1376) but the canvas for 1376:768 is 768x1344.)"""
    rejected = {}
    for ratio in [a / b for a, b in ASPECTS] + list(np.linspace(0.25, 4.0, 601)) + [1.8, 2.35]:
        h, w = resolve_canvas(float(ratio), 1.0)
        try:
            validate_canvas(h, w)
        except ValueError:
            rejected.setdefault((h, w), round(float(ratio), 4))
    assert not rejected, f"validate_canvas rejects resolved canvases (h, w) -> first aspect ratio: {rejected}"


def test_resolve_canvas_known_values():
    assert resolve_canvas(16, 9) == (768, 1344)
    assert resolve_canvas(9, 16) == (1344, 768)
    assert resolve_canvas(1, 1) == (768, 768)


@pytest.mark.parametrize("aw,ah", [(5, 1), (1, 5), (4.01, 1), (0, 1), (1, -2)])
def test_resolve_canvas_rejects_like_diffusers(aw, ah):
    with pytest.raises(ValueError):
        d_resolve_canvas_size(aw, ah, MULTIPLE, SHORT_EDGE, MAX_PIXELS)
    with pytest.raises(ValueError, match="aspect ratio"):
        resolve_canvas(aw, ah)


@pytest.mark.parametrize("h,w", [(768, 1344), (1344, 768), (768, 768), (480, 832), (512, 512), (384, 1536), (32, 32)])
def test_validate_canvas_accepts(h, w):
    validate_canvas(h, w)


@pytest.mark.parametrize(
    "h,w,match",
    [
        (768, 3840, "aspect ratio"),  # 5:1
        (3840, 768, "aspect ratio"),  # 1:5
        (770, 1344, "multiples of 32"),
        (768, 1350, "multiples of 32"),
        (0, 768, "multiples of 32"),
        (800, 1344, "larger than"),
        (1024, 1024, "larger than"),
    ],
)
def test_validate_canvas_rejects(h, w, match):
    with pytest.raises(ValueError, match=match):
        validate_canvas(h, w)


def test_frame_rules_match_diffusers():
    for n in range(1, 500):
        aligned = align_num_frames(n)
        assert aligned == d_align_num_frames(n, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK), n
        assert aligned % 17 == 5 and 0 <= aligned - n < 17
        assert latent_frames(aligned) == d_video_latent_num_frames(aligned, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK)
        assert audio_latents(n) == d_audio_latent_num_frames(n)
        if n % 17 != 5:
            with pytest.raises(ValueError):
                d_video_latent_num_frames(n, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK)
            with pytest.raises(ValueError, match="17n \\+ 5"):
                latent_frames(n)
    for bad in (0, -3):
        with pytest.raises(ValueError):
            align_num_frames(bad)


def test_released_clip_geometry():
    assert align_num_frames(124) == 124
    assert latent_frames(124) == 37
    assert audio_latents(124) == 207
    g = Geometry(768, 1344, 124)
    assert (g.latent_frames, g.latent_height, g.latent_width, g.audio_latents) == (37, 48, 84, 207)
    assert g.audio_samples == 207 * 800


def _diffusers_duration_rule(seconds):
    """The diffusers pipeline takes a frame count: ceil(seconds * 24), snapped up to 17n + 5, and rejects an aligned
    count outside 5..15 s."""
    aligned = d_align_num_frames(math.ceil(seconds * 24), FRAMES_PER_CHUNK, LATENTS_PER_CHUNK)
    return aligned if 5.0 <= aligned / 24 <= 15.0 else None


def test_frames_for_duration_matches_diffusers_rule():
    """Within the stated range (from 5 s) the frame count is diffusers'. Below it h3trt refuses what diffusers' rule,
    which checks the frame count once rounded up, lets through (4.9 s: 118 frames, rounded up to 124)."""
    seconds = [s / 8 for s in range(24, 136)] + [5.1, 7.3, 10.01, 14.37, 14.375, 14.376, 4.9999, 4.9]
    accepted = 0
    for s in seconds:
        expected = _diffusers_duration_rule(s)
        if expected is None or s < 5:
            with pytest.raises(ValueError, match="Unsupported duration"):
                frames_for_duration(s)
        else:
            assert frames_for_duration(s) == expected, s
            accepted += 1
    assert accepted > 50


def test_frames_for_duration_known_values_and_errors():
    assert frames_for_duration(5) == 124
    assert frames_for_duration(5.0) == 124
    assert frames_for_duration(14.375) == 345  # the longest clip: 20 * 17 + 5 frames
    for bad in (3, 16, 15.5, 4.9, 4.9999, 14.376):
        with pytest.raises(ValueError, match="Unsupported duration") as e:
            frames_for_duration(bad)
        assert "takes 5 to 14.375 s" in str(e.value) and "124 to 345 frames" in str(e.value)
    assert _diffusers_duration_rule(4.9) == 124  # the reference's frame rule would round 4.9 s into range
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive number of seconds"):
            frames_for_duration(bad)


# ----------------------------------------------------------------------------------------------------------------------
# 5. Row packing of latents


@pytest.mark.parametrize(
    "shape,patch",
    [((1, 24, 7, 4, 6), (1, 2, 2)), ((2, 3, 4, 6, 8), (2, 2, 2)), ((1, 5, 3, 6, 4), (1, 3, 1)), ((1, 24, 1, 48, 84), (1, 2, 2))],
)
def test_patchify_matches_diffusers_and_roundtrips(shape, patch):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    rows = patchify(x, patch)
    assert torch.equal(rows, patchify_video_latents(x, patch))
    assert rows.is_contiguous()
    if shape[0] == 1:
        back = unpatchify(rows, shape[1:], patch)
        assert back.shape == x.shape
        assert torch.equal(back, x)


def test_patchify_rejects_indivisible():
    with pytest.raises(ValueError):
        patchify(torch.zeros(1, 2, 3, 5, 4), (1, 2, 2))


@pytest.mark.parametrize("A", [1, 7, 207])
def test_audio_rows_roundtrip_and_convention(A):
    x = torch.randn(2, 32, A, generator=torch.Generator().manual_seed(A))
    rows = audio_to_rows(x)
    assert rows.shape == (2 * A, 32)
    # diffusers' MiniMaxH3PrepareLatentsStep: audio_latents.permute(0, 2, 1).reshape(-1, 32)
    assert torch.equal(rows, x.permute(0, 2, 1).reshape(-1, 32))
    # channel-major: all left latents, then all right
    assert torch.equal(rows[:A], x[0].T) and torch.equal(rows[A:], x[1].T)
    assert torch.equal(rows_to_audio(rows), x)
