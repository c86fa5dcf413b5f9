"""VSA as FastH3 runs it (h3trt/models/vsa/tiles.py, models/vsa/routing.py, models/vsa/kernels.py), on the CPU in fp32,
against `vsa_reference`: the definition row by row (each row's tile from the geometry, tile means by one-hot sums, a
stable sort for the top-k, one [S, S] row mask, the coarse branch), with no padded layout and no kernel.

Also from first principles, without the module's helpers: the tile geometry (FastVideo's `_h3_tile_geometry` order:
segment-pure prefix chunks, (4, 4, 4) video tiles t -> h -> w with ragged edges), the top-k count, which tiles a
query keeps (every prefix tile, k video tiles, prefix queries dense), ties at the threshold (the lower tile; the
peers' torch.topk leaves them unspecified), and the gate branch on every row.

Tolerances: fp32 everywhere; the production path and the reference differ in summation order only (1e-5).
"""

import math

import pytest
import torch

from h3trt.errors import UserError
from h3trt.models.packing import pack_ref2va, pack_t2va, RefBlock, text_tags_for
from h3trt.models.vsa.routing import (coarse_branch, pool_tiles, route_tiles, tile_scores, to_tiles, vsa_attention,
                                      vsa_reference, vsa_topk)
from h3trt.models.vsa.kernels import VSA_KERNELS, vsa_block_attention, vsa_kernel_problem
from h3trt.models.vsa.tiles import layout_geometry, layout_segments, tile_geometry

pytestmark = pytest.mark.unit


def sdpa_dense(q, k, v):
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def qkvg(B, S, N, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, S, N, D, generator=g) for _ in range(4))


# ---- geometry --------------------------------------------------------------------------------------------------------

def test_geometry_h3_shape():
    """1344x768, 5 s: 37 x 24 x 42 video rows -> 10 x 6 x 11 = 660 tiles; text 128 -> 2 chunks, audio 414 -> 6 full
    + one of 30; the notes' k = 66 at 0.9."""
    geo = tile_geometry((128, 0, 414), (37, 24, 42))
    assert geo.num_prefix_tiles == 9 and geo.num_video_tiles == 660
    assert geo.sizes[:9].tolist() == [64, 64] + [64] * 6 + [30]
    assert int(geo.sizes.sum()) == 128 + 414 + 37 * 24 * 42
    assert vsa_topk(0.9, 660) == 66
    # the last frame tile holds one frame: 1 x 4 x 4 = 16 rows, and its last column tile 1 x 4 x 2 = 8
    assert geo.sizes[-1].item() == 8 and geo.sizes[9 + 9 * 66].item() == 16


def test_geometry_order_by_hand():
    """A 5 x 3 x 6 grid (no axis a multiple of 4) after prefix segments (70, 0, 5): every tile's rows listed by hand
    from the definition."""
    prefix, grid = (70, 0, 5), (5, 3, 6)
    geo = tile_geometry(prefix, grid)
    F_, R, C = grid
    expected = [list(range(0, 64)), list(range(64, 70)), list(range(70, 75))]
    for t0 in range(0, F_, 4):
        for h0 in range(0, R, 4):
            for w0 in range(0, C, 4):
                expected.append([75 + (t * R + h) * C + w for t in range(t0, min(F_, t0 + 4))
                                 for h in range(h0, min(R, h0 + 4)) for w in range(w0, min(C, w0 + 4))])
    assert geo.num_prefix_tiles == 3 and geo.sizes.tolist() == [len(t) for t in expected]
    for g, rows in enumerate(expected):
        padded = geo.padded_rows[g * 64:(g + 1) * 64]
        assert padded[:len(rows)].tolist() == rows and (padded[len(rows):] == -1).all()
        assert (geo.row_tile[rows] == g).all()
    assert torch.equal(geo.padded_rows[geo.row_slot], torch.arange(geo.seq_len))


def test_topk_count():
    assert [vsa_topk(s, 10) for s in (0.0, 0.5, 0.9, 0.95, 0.99)] == [10, 5, 1, 1, 1]
    assert vsa_topk(0.9, 7) == 1 and vsa_topk(0.8, 7) == 2  # ceil(0.2 * 7 = 1.4) = 2
    with pytest.raises(ValueError):
        vsa_topk(1.0, 4)


def test_layout_segments_t2va_fl2va_and_ref2va_refused():
    tags = text_tags_for(20)
    t2va = pack_t2va(tags, 6, 12, 10, 9)
    assert layout_segments(t2va) == (20, 0, 18) and t2va.video_grid == (6, 6, 5)
    fl2va = pack_t2va(tags, 6, 12, 10, 9, keyframes=("first", "last"))
    assert layout_segments(fl2va) == (20, 60, 18)
    geo = layout_geometry(fl2va)
    assert geo.prefix_segments == (20, 60, 18) and geo.seq_len == fl2va.seq_len
    ref = pack_ref2va(tags, [RefBlock("image", (1, 12, 10)), RefBlock("audio", audio_latents=3)], 6, 12, 10, 9)
    with pytest.raises(UserError, match="t2va and fl2va"):
        layout_segments(ref)


# ---- routing ---------------------------------------------------------------------------------------------------------

def test_route_keeps_prefix_and_topk_video():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 9, 9, generator=g)
    index, sparse_G = route_tiles(scores, 3, 0.5)
    assert sparse_G.tolist() == [False] * 3 + [True] * 6
    k = vsa_topk(0.5, 6)
    for b in range(2):
        for n in range(3):
            for q in range(3, 9):
                row = index[b, n, q].tolist()
                assert row[:3] == [0, 1, 2] and row == sorted(row)
                best = (scores[b, n, q, 3:].argsort(descending=True)[:k] + 3).sort().values.tolist()
                assert row[3:] == best


def test_route_ties_go_to_lower_tile_and_peers_rule():
    """Four video key tiles tie at the threshold: the lower ones are kept. The peers (FastVideo _build_block_mask,
    SGLang _topk_tile_lists) take torch.topk's indices, whose order among ties is unspecified; where no tie straddles
    the threshold the kept sets agree."""
    scores = torch.zeros(1, 1, 8, 8)
    scores[..., 2:, 2:] = torch.tensor([5.0, 1.0, 1.0, 1.0, 1.0, -2.0])  # video tiles 0..5 (absolute 2..7)
    index, _ = route_tiles(scores, 2, 0.5)  # k = 3 of 6: tile 2 (5.0), then two of the four tied at 1.0
    assert index[0, 0, 2:, 2:].tolist() == [[2, 3, 4]] * 6
    untied = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(1))
    ours, _ = route_tiles(untied, 2, 0.5)
    peers = (untied[..., 2:, 2:].topk(3, dim=-1).indices + 2).sort(-1).values
    assert torch.equal(ours[..., 2:, 2:].long(), peers)


def test_route_dense_when_k_keeps_every_video_tile():
    index, sparse_G = route_tiles(torch.randn(1, 2, 5, 5), 2, 0.1)  # ceil(0.9 * 3) = 3 = every video tile
    assert not sparse_G.any() and index.shape[-1] == 5


# ---- the attention against the definition ----------------------------------------------------------------------------

CASES = [  # (prefix segments, video grid, sparsity)
    ((70, 0, 20), (5, 3, 6), 0.6),  # ragged on every axis, a partial text and audio chunk
    ((64, 10, 0), (4, 4, 8), 0.5),  # tiles exactly 4 x 4 x 4, condition rows, no audio
    ((33, 0, 130), (9, 5, 2), 0.9),  # k = 1 of 9 video tiles
    ((12, 0, 14), (6, 2, 9), 0.0),  # dense, coarse branch kept
]


@pytest.mark.parametrize("prefix,grid,sparsity", CASES)
@pytest.mark.parametrize("kernel", ["reference", "flex"])
def test_vsa_attention_matches_definition(prefix, grid, sparsity, kernel):
    geo = tile_geometry(prefix, grid)
    q, k, v, gate = qkvg(2, geo.seq_len, 3, 16, seed=sum(prefix))
    out, kept = vsa_attention(q, k, v, gate, geo, sparsity,
                              lambda *a: vsa_block_attention(*a, kernel), sdpa_dense)
    ref = vsa_reference(q, k, v, gate, geo, sparsity)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (kept < 1.0) == (sparsity > 0 and vsa_topk(sparsity, geo.num_video_tiles) < geo.num_video_tiles)


def test_reference_rows_by_hand():
    """One video query row of the reference against softmax over exactly its kept rows, gathered by hand, plus its
    tile's coarse term; and a prefix row against all rows."""
    geo = tile_geometry((40, 0, 6), (5, 5, 5))
    q, k, v, gate = qkvg(1, geo.seq_len, 1, 8, seed=7)
    ref = vsa_reference(q, k, v, gate, geo, 0.7)
    tiles = [geo.padded_rows[g * 64:g * 64 + int(n)] for g, n in enumerate(geo.sizes)]
    means = lambda x: torch.stack([x[0, t, 0].mean(0) for t in tiles])  # noqa: E731
    scores = means(q) @ means(k).T / math.sqrt(8)
    coarse = torch.softmax(scores, -1) @ means(v)
    Gp, kv = geo.num_prefix_tiles, vsa_topk(0.7, geo.num_video_tiles)
    for row in (0, 45, geo.seq_len - 1):
        g = int(geo.row_tile[row])
        if g < Gp:
            keep = list(range(geo.num_tiles))
        else:
            keep = list(range(Gp)) + (scores[g, Gp:].argsort(descending=True, stable=True)[:kv] + Gp).tolist()
        keys = torch.cat([tiles[j] for j in keep])
        w = torch.softmax(q[0, row, 0] @ k[0, keys, 0].T / math.sqrt(8), -1)
        expected = w @ v[0, keys, 0] + coarse[g] * gate[0, row, 0]
        torch.testing.assert_close(ref[0, row, 0], expected, rtol=1e-5, atol=1e-5)


def test_gate_branch_on_every_row():
    """With v's tile means zero... no: with the gate zero the output is the sparse attention alone; with q, k zero
    the scores are uniform, so every row gets the mean of the tile means times its gate."""
    geo = tile_geometry((70, 0, 20), (5, 3, 6))
    q, k, v, gate = qkvg(1, geo.seq_len, 2, 8, seed=5)
    zero = torch.zeros_like(gate)
    with_gate = vsa_reference(q, k, v, gate, geo, 0.5)
    without = vsa_reference(q, k, v, zero, geo, 0.5)
    out, _ = vsa_attention(q, k, v, zero, geo, 0.5, lambda *a: vsa_block_attention(*a, "reference"), sdpa_dense)
    torch.testing.assert_close(out, without, rtol=1e-5, atol=1e-5)
    assert (with_gate - without).abs().amax(dim=(0, 2, 3)).gt(0).all()  # every row, prefix rows included
    qz = torch.zeros_like(q)
    uniform = vsa_reference(qz, qz, v, gate, geo, 0.5) - vsa_reference(qz, qz, v, zero, geo, 0.5)
    tile_means = pool_tiles(to_tiles(v, geo), geo)  # [1, N, G, D]
    torch.testing.assert_close(uniform, tile_means.mean(2)[:, None] * gate, rtol=1e-5, atol=1e-5)


def test_sparsity_zero_is_dense_plus_coarse():
    geo = tile_geometry((12, 0, 14), (6, 2, 9))
    q, k, v, gate = qkvg(1, geo.seq_len, 2, 8, seed=2)
    out, kept = vsa_attention(q, k, v, gate, geo, 0.0, lambda *a: 1 / 0, sdpa_dense)  # no block kernel runs
    scores = tile_scores(pool_tiles(to_tiles(q, geo), geo), pool_tiles(to_tiles(k, geo), geo))
    coarse = coarse_branch(scores, pool_tiles(to_tiles(v, geo), geo)).permute(0, 2, 1, 3)[:, geo.row_tile]
    torch.testing.assert_close(out, sdpa_dense(q, k, v) + coarse * gate, rtol=1e-5, atol=1e-5)
    assert kept == 1.0


def test_bf16_inputs_keep_fp32_scores():
    """bf16 q/k/v/gate: the routing is the one the fp32 definition makes from the same bf16 values (pooling and
    scores in fp32), and the output is within bf16 rounding of it."""
    geo = tile_geometry((70, 0, 20), (5, 3, 6))
    q, k, v, gate = (x.bfloat16() for x in qkvg(1, geo.seq_len, 2, 16, seed=9))
    out, _ = vsa_attention(q, k, v, gate, geo, 0.6, lambda *a: vsa_block_attention(*a, "reference"), sdpa_dense)
    assert out.dtype == torch.bfloat16
    ref = vsa_reference(q, k, v, gate, geo, 0.6)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_kernel_table():
    assert VSA_KERNELS == ("reference", "flex", "fa4")
    assert vsa_kernel_problem("reference", "cpu") is None
    assert "CUDA" in vsa_kernel_problem("fa4", "cpu") and "CUDA" in vsa_kernel_problem("flex", "cpu")


def test_fa4_plumbing_against_a_stand_in(monkeypatch):
    """The fa4 kernel's call (FA4 itself needs an sm_90 GPU: scripts/bench_vsa.py checks it there): a stand-in
    `_flash_attn_fwd` applies FA4's block-sparse contract in torch (full blocks as they are, mask blocks through the
    mask_mod, each list ascending and disjoint) with the mask_mod's rule on the aux tensor (n >= threshold[n]); the
    result must be the definition's."""
    import sys
    import types

    from h3trt.models.vsa import kernels as vsa_kernels

    calls = []

    class BlockSparseTensorsTorch:
        def __init__(self, mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx, block_size):
            self.__dict__.update(locals())

    def _flash_attn_fwd(q, k, v, tile_mn, block_sparse_tensors, mask_mod, aux_tensors):
        t, (threshold,) = block_sparse_tensors, aux_tensors
        assert tile_mn == t.block_size == (64, 64) and mask_mod == "real-keys"
        B, P, N, _ = q.shape
        allowed = torch.zeros(B, N, P // 64, P, dtype=torch.bool)
        for b, n, g in torch.cartesian_prod(*(torch.arange(s) for s in t.full_block_cnt.shape)).tolist():
            full = t.full_block_idx[b, n, g, :t.full_block_cnt[b, n, g]].long()
            part = t.mask_block_idx[b, n, g, :t.mask_block_cnt[b, n, g]].long()
            for blocks in (full, part):
                assert bool((blocks[1:] > blocks[:-1]).all())
            assert not set(full.tolist()) & set(part.tolist())
            cols = torch.arange(P).view(-1, 64)
            allowed[b, n, g, cols[full].reshape(-1)] = True
            real = cols[part].reshape(-1)
            allowed[b, n, g, real[real >= threshold[real].long()]] = True
        calls.append(int(t.mask_block_cnt.sum()))
        mask = allowed.repeat_interleave(64, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), attn_mask=mask)
        return out.transpose(1, 2), None

    interface = types.SimpleNamespace(_flash_attn_fwd=_flash_attn_fwd)
    sparsity = types.SimpleNamespace(BlockSparseTensorsTorch=BlockSparseTensorsTorch)
    monkeypatch.setattr(vsa_kernels, "fa4_modules", lambda: (interface, BlockSparseTensorsTorch))
    monkeypatch.setattr(vsa_kernels, "_fa4_real_keys", lambda: "real-keys")
    monkeypatch.setitem(sys.modules, "flash_attn.cute.block_sparsity", sparsity)
    geo = tile_geometry((70, 0, 20), (5, 3, 6))
    q, k, v, gate = qkvg(1, geo.seq_len, 2, 16, seed=4)
    out, _ = vsa_attention(q, k, v, gate, geo, 0.6, lambda *a: vsa_block_attention(*a, "fa4"), sdpa_dense)
    torch.testing.assert_close(out, vsa_reference(q, k, v, gate, geo, 0.6), rtol=1e-5, atol=1e-5)
    assert calls and calls[0] > 0  # ragged tiles went as mask blocks
