"""VSA's tiles over H3's packed sequence: pure functions of the layout, on the CPU.

Video Sparse Attention as FastH3 runs it (FastVideo `attention/backends/video_sparse_attn_h3.py` `_h3_tile_geometry`,
SGLang `.../backends/video_sparse_attn_h3.py` `_h3_tile_geometry`) cuts the packed sequence into tiles of at most 64
rows and attends tile by tile:
  - the prefix, `[text | condition keyframes | audio]`, in 64-row chunks that never cross a segment: each segment is
    chunked on its own and its last chunk may be partial (an empty segment gives no chunk);
  - then the target video rows in (4, 4, 4) tiles of the (frames, rows, cols) patch grid (the latent (T, H/2, W/2)
    grid), tiles ordered t -> h -> w and rows row-major inside a tile; a grid edge that is not a multiple of 4 gives
    ragged tiles (37 x 24 x 42 at 1344x768, 5 s: the last frame tile holds 1 frame, the last column tile 2 columns).
The kernels read the tiles padded to 64 rows each ("the padded layout"); pad rows are zero and no key ever attends to
them. `VsaGeometry` holds the maps between the packed rows and that layout.

Shape legend: S packed rows, G tiles (prefix tiles first), P = 64 G padded rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import UserError
from ..packing import PackedLayout

VSA_TILE = (4, 4, 4)  # (frames, rows, cols) of one video tile: FastH3's training geometry (the 64-row tile)
VSA_TILE_ROWS = math.prod(VSA_TILE)  # 64: also the prefix chunk and every kernel's block


@dataclass(frozen=True)
class VsaGeometry:
    """The tiles of one packed layout (module docstring)."""

    prefix_segments: tuple[int, ...]  # rows of text, condition video and audio, in packed order (zeros dropped)
    video_grid: tuple[int, int, int]  # (frames, rows, cols) of the target video's patch grid
    sizes: torch.Tensor  # [G] long: the real rows of each tile (1..64)
    num_prefix_tiles: int  # tiles 0 .. num_prefix_tiles - 1 are prefix chunks, the rest video tiles
    padded_rows: torch.Tensor  # [P] long: the packed row at each padded position, -1 at a pad row
    row_slot: torch.Tensor  # [S] long: each packed row's padded position
    row_tile: torch.Tensor  # [S] long: each packed row's tile (row_slot // 64)

    @property
    def num_tiles(self) -> int:
        return self.sizes.shape[0]

    @property
    def num_video_tiles(self) -> int:
        return self.num_tiles - self.num_prefix_tiles

    @property
    def seq_len(self) -> int:
        return self.row_slot.shape[0]

    @property
    def padded_len(self) -> int:
        return self.num_tiles * VSA_TILE_ROWS

    def to(self, device) -> "VsaGeometry":
        return VsaGeometry(self.prefix_segments, self.video_grid, self.sizes.to(device), self.num_prefix_tiles,
                           self.padded_rows.to(device), self.row_slot.to(device), self.row_tile.to(device))


def prefix_chunks(segments: tuple[int, ...], chunk: int = VSA_TILE_ROWS) -> list[int]:
    """The rows of each prefix tile: every segment in `chunk`-row pieces, its last one partial."""
    sizes = []
    for rows in segments:
        if rows < 0:
            raise ValueError(f"a prefix segment has a row count >= 0, got {segments}.")
        full, rest = divmod(rows, chunk)
        sizes += [chunk] * full + ([rest] if rest else [])
    return sizes


def video_tile_order(grid: tuple[int, int, int], tile: tuple[int, int, int] = VSA_TILE) -> tuple[torch.Tensor, list[int]]:
    """(order [F * R * C] long, sizes): the video rows (row-major over the grid) in tile order, tiles t -> h -> w and
    rows row-major inside each; and the real rows of each tile in that order."""
    frames, rows, cols = grid
    if min(grid) < 1:
        raise ValueError(f"a video grid has at least one frame, row and column, got {grid}.")
    index = torch.arange(frames * rows * cols).view(frames, rows, cols)
    pieces, sizes = [], []
    for t in range(0, frames, tile[0]):
        for h in range(0, rows, tile[1]):
            for w in range(0, cols, tile[2]):
                piece = index[t:t + tile[0], h:h + tile[1], w:w + tile[2]].reshape(-1)
                pieces.append(piece)
                sizes.append(piece.numel())
    return torch.cat(pieces), sizes


def tile_geometry(prefix_segments: tuple[int, ...], video_grid: tuple[int, int, int]) -> VsaGeometry:
    """The tiles of a sequence `[prefix segments | video]` whose video rows are `video_grid` row-major."""
    segments = tuple(int(s) for s in prefix_segments if s > 0)
    prefix_sizes = prefix_chunks(segments)
    prefix_len = sum(segments)
    video_order, video_sizes = video_tile_order(video_grid)
    sizes = torch.tensor(prefix_sizes + video_sizes, dtype=torch.long)
    tiles, seq_len = sizes.shape[0], prefix_len + video_order.numel()
    # Rows in tile order (the prefix keeps its own order), and where each lands in the padded layout.
    order = torch.cat([torch.arange(prefix_len), video_order + prefix_len])
    offset_in_tile = torch.arange(seq_len) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    slots = torch.repeat_interleave(torch.arange(tiles), sizes) * VSA_TILE_ROWS + offset_in_tile
    padded_rows = torch.full((tiles * VSA_TILE_ROWS,), -1, dtype=torch.long)
    padded_rows[slots] = order
    row_slot = torch.empty(seq_len, dtype=torch.long)
    row_slot[order] = slots
    return VsaGeometry(segments, tuple(video_grid), sizes, len(prefix_sizes), padded_rows, row_slot,
                       row_slot // VSA_TILE_ROWS)


def layout_segments(layout: PackedLayout) -> tuple[int, int, int]:
    """(text, condition video, audio) rows of a `[text | condition keyframes | audio | video]` layout (t2va, fl2va),
    checked to be contiguous in that order; VSA tiles no other layout (a ref2va layout interleaves its references'
    video and audio, which FastH3 was not trained on). UserError otherwise."""
    L, cond = layout.text_index.numel(), layout.num_condition_video_rows
    audio, video = layout.audio_index.cpu(), layout.video_index.cpu()
    A, S = audio.numel(), layout.seq_len
    expected_video = torch.cat([torch.arange(L, L + cond), torch.arange(L + cond + A, S)])
    if (layout.num_condition_audio_rows or layout.video_grid is None
            or not torch.equal(layout.text_index.cpu(), torch.arange(L))
            or not torch.equal(audio, torch.arange(L + cond, L + cond + A)) or not torch.equal(video, expected_video)
            or math.prod(layout.video_grid) != S - L - cond - A):
        raise UserError("VSA (a FastH3-VSA model's sparse attention) tiles the t2va and fl2va packing, [text | "
                        "keyframes | audio | video]; this request's layout is another (ref2va references are not "
                        "served by FastH3). Run t2va or fl2va requests on this model.")
    return L, cond, A


def layout_geometry(layout: PackedLayout) -> VsaGeometry:
    """The tiles of a t2va / fl2va packed layout (layout_segments checks it)."""
    return tile_geometry(layout_segments(layout), layout.video_grid)
