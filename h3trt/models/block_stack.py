"""The DiT block stack, run the same way by every backend: the eager reference (`H3DiT.forward`), Ulysses sequence
parallelism (parallel/ulysses.py), a bundle's compiled segments (engines/bundle.py EngineDiT) and TensorRT plans
(engines/tensorrt_runtime.py TrtDiT). They differ only in the block callable; the row shard and the step cache are
arguments here, so the order "shard the rows, run every layer (or what the cache lets run), gather" exists once.

Shape legend as in `h3trt.models.dit`: B batch, S packed rows (Sl: this rank's rows under a shard, padding
included), H hidden, R rotary dims.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from .step_cache import CacheContext

# (layer index, x [B, Sl, H], adaln_index [Sl], rope (cos [Sl, R], sin [Sl, R])) -> x [B, Sl, H]: one block on the
# rows this process holds, the sharded attention's exchange (if any) inside it.
BlockFn = Callable[[int, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


class RowSharding(Protocol):
    """This rank's rows of a packed sequence padded to a multiple of sp (parallel/ulysses.py `RowShard`); models/
    names only what the runner calls, so it imports nothing above it."""

    group: object  # the sp process group whose ranks hold the other rows
    live_rows: int  # this rank's leading rows that are not padding

    def local(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """`t` with its row dimension `dim` (S rows) padded and cut to this rank's Sl rows."""

    def gather(self, x_BSlH: torch.Tensor) -> torch.Tensor:
        """Every rank's rows [B, Sl, H] -> [B, S, H], padding dropped."""


def run_block_stack(x_BSH: torch.Tensor, num_layers: int, block_fn: BlockFn, adaln_index_S: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor], cache: CacheContext | None = None,
                    shard: RowSharding | None = None) -> torch.Tensor:
    """Every block over the packed stream x [B, S, H] (all rows, on every rank), returning [B, S, H].

    `adaln_index_S` [S] and `rope` ([S, R] each) are the whole sequence's; with `shard` the runner keeps this rank's
    rows of x, of the index and of the tables, runs the blocks on them and gathers every rank's rows (padding dropped)
    at the end. `cache` (models/step_cache.py) may skip all blocks, or all but block 0; under a shard it decides on
    values every rank shares, so every rank skips the same blocks."""
    group = live_rows = None
    if shard is not None:
        x_BSH = shard.local(x_BSH, 1)
        adaln_index_S = shard.local(adaln_index_S, 0)
        rope = (shard.local(rope[0], 0), shard.local(rope[1], 0))
        group, live_rows = shard.group, shard.live_rows

    def layer(i: int, x: torch.Tensor) -> torch.Tensor:
        return block_fn(i, x, adaln_index_S, rope)

    if cache is None:
        for i in range(num_layers):
            x_BSH = layer(i, x_BSH)
    else:
        x_BSH = cache.run_blocks(x_BSH, num_layers, layer, group, live_rows)
    return shard.gather(x_BSH) if shard is not None else x_BSH
