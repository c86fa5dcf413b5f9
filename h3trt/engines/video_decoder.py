"""The compiled video decoder of one (window, tile) shape: `in`, the `block` segment once per layer, `out`
(h3trt/build/segments.py), bound to the live VAE's tensors, optionally replayed as one CUDA graph.

Why a CUDA graph: one tile is 38 compiled calls (about 15 kernels each) for ~20 ms of GPU work; replaying them as
one graph takes the Python launch work off the host, which the tile-parallel decode's gather, stitch and the encoder
thread share. Replay runs the same kernels on the same tensors, so its pixels equal the launched path's bitwise.
The graph is captured on the first tile of its shape (after one warm-up run), with the capture limited to this
thread: the audio decode runs on its own thread and stream meanwhile.
"""

from __future__ import annotations

import torch

# The segments of one (window, tile) shape, named video_decoder_<part>_<T>x<H>x<W> (h3trt/build/segments.py builds them).
VIDEO_DECODER_PARTS = ("in", "block", "out")


def video_decoder_names(window_latents: int, tile_h: int, tile_w: int) -> dict[str, str]:
    return {part: f"video_decoder_{part}_{window_latents}x{tile_h}x{tile_w}" for part in VIDEO_DECODER_PARTS}


def parse_video_decoder_name(name: str) -> tuple[str, tuple[int, int, int]] | None:
    """"video_decoder_block_7x16x16" -> ("block", (7, 16, 16)); None for any other segment."""
    for part in VIDEO_DECODER_PARTS:
        prefix = f"video_decoder_{part}_"
        if name.startswith(prefix):
            return part, tuple(int(v) for v in name.removeprefix(prefix).split("x"))
    return None


class TileDecoder:
    """z [1, C, t, h, w] (contiguous) -> pixels [1, 3, 4t, 16h, 16w]; segments are {"in", "block", "out"}: loaded
    segment callables, entries their manifest entries (weight names)."""

    def __init__(self, segments: dict, entries: dict, vae, cuda_graph: bool):
        tensors = {**dict(vae.named_parameters()), **dict(vae.named_buffers())}
        self.seg_in, self.seg_block, self.seg_out = (segments[p] for p in ("in", "block", "out"))
        self.w_in = [tensors[n] for n in entries["in"]["weights"]]
        self.w_blocks = [[tensors[f"decoder.transformer_blocks.{i}.{n}"] for n in entries["block"]["weights"]]
                         for i in range(len(vae.decoder.transformer_blocks))]
        self.w_out = [tensors[n] for n in entries["out"]["weights"]]
        self.cuda_graph = cuda_graph
        self.graph = self.static_z = self.static_pixels = None

    def launch(self, z: torch.Tensor) -> torch.Tensor:
        x, cos, sin = self.seg_in(z, *self.w_in)
        for w in self.w_blocks:
            (x,) = self.seg_block(x, cos, sin, *w)
        (pixels,) = self.seg_out(x, *self.w_out)
        return pixels

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if not (self.cuda_graph and z.is_cuda):
            return self.launch(z)
        if self.graph is None:
            self._capture(z)
        self.static_z.copy_(z)
        self.graph.replay()
        # The next replay overwrites the static output; the caller keeps tiles until their window is stitched.
        return self.static_pixels.clone()

    def _capture(self, z: torch.Tensor) -> None:
        self.static_z = z.clone()
        side = torch.cuda.Stream(z.device)
        side.wait_stream(torch.cuda.current_stream(z.device))
        with torch.cuda.stream(side):  # warm-up off the capture stream (cuBLAS workspaces, lazy inits)
            self.launch(self.static_z)
        torch.cuda.current_stream(z.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.static_pixels = self.launch(self.static_z)
        self.graph = graph
