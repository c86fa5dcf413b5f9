"""The H3 video VAE: diffusers' `AutoencoderKLMiniMaxH3` modules driven by h3trt's own decode plan.

Why our own driver: the engine decodes tiles on several ranks and streams finished frames to the encoder while later
windows decode, so the temporal windows and spatial tiles must be explicit data, not loops inside `vae.decode`. The
plan reproduces diffusers' `_decode` exactly (parity-tested):
  - temporal windows of 5 latents + 2 overlap -> 28 frames; drop the 3 pre-pad frames, keep 17, and carry the
    next 5 as the overlap that is linearly blended into the next window (17n + 5 frames from 5n + 2 latents);
  - spatial tiles of 256 px with >= 64 px overlap laid out by diffusers' `_split_tiles`, blended vertically then
    horizontally by `_stitch_tiles`.
Keyframes and reference images are encoded with the posterior sampled under seed 42 and rounded through float16,
as the reference does (diffusers `encode_vae_condition`).

Shape legend: C channels, T frames (latent t, pixel f), H/W height/width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from PIL import Image

from ..errors import UserError
from .precision import Precision, unquantized

PIXEL_MEAN = (0.485, 0.456, 0.406)  # ImageNet: the VAE's pixel convention over [0, 1]
PIXEL_STD = (0.229, 0.224, 0.225)
CONDITION_ENCODE_SEED = 42  # "the seed is part of the contract": the same keyframe always encodes the same way
TILE_PX, TILE_OVERLAP_PX = 256, 64  # the released decode and encode tiling


@dataclass(frozen=True)
class Tile:
    """One spatial tile of a window, in latent units; (row, col) index the stitch grid."""

    row: int
    col: int
    y0: int
    y1: int
    x0: int
    x1: int


@dataclass(frozen=True)
class DecodePlan:
    """Every window and tile a decode runs, and how they are stitched."""

    latent_frames: int
    pad_latents: int  # latents repeated at the end to complete the last window
    windows: tuple[tuple[int, int], ...]  # latent [start, stop) of each window, on the padded latent axis
    tiles: tuple[Tile, ...]  # row-major
    height_overlaps_px: tuple[int, ...]
    width_overlaps_px: tuple[int, ...]
    keep_frames: int  # frames a window contributes (17)
    pre_pad_frames: int  # leading frames of each window chunk that belong to no output frame (3)
    overlap_frames: int  # frames blended between consecutive windows (5)
    num_frames: int  # output frames

    @property
    def grid(self) -> tuple[int, int]:
        return len(self.height_overlaps_px) + 1, len(self.width_overlaps_px) + 1


def plan_decode(vae, latent_frames: int, latent_h: int, latent_w: int) -> DecodePlan:
    """The windows and tiles diffusers' `AutoencoderKLMiniMaxH3._decode` runs for a [C, T, H, W] latent."""
    chunk = vae.tokens_chunk_size  # 5
    drop = vae.config.token_drop  # 3
    ratio_t = vae.temporal_compression_ratio  # 4
    if drop <= 0:
        raise UserError(f"h3trt's decode plan needs the video VAE's token_drop > 0, got {drop}; use the checkpoint's "
                        "released vae/ (it drops 3).")
    num_tokens = latent_frames + drop
    pad = (-num_tokens) % chunk
    num_windows = (num_tokens + pad) // chunk - 1
    windows = tuple((i * chunk, i * chunk + chunk + vae.token_overlap) for i in range(num_windows))
    keep = chunk * ratio_t - vae.frame_pre_padding
    pad_frames = 0
    if pad:
        tail = vae.config.clip_length % ratio_t
        before = latent_frames
        pad_frames = sum(tail if tail and (before + k) % chunk == 0 else ratio_t for k in range(pad))
    num_frames = num_windows * keep + vae.frame_overlap - pad_frames

    ratio = vae.spatial_compression_ratio
    ys, yl, yo = vae._split_tiles(latent_h * ratio, vae.tile_sample_min_height, vae.tile_sample_min_overlap_height)
    xs, xl, xo = vae._split_tiles(latent_w * ratio, vae.tile_sample_min_width, vae.tile_sample_min_overlap_width)
    if not vae.use_tiling:
        ys, yl, yo, xs, xl, xo = [0], [latent_h * ratio], [], [0], [latent_w * ratio], []
    tiles = tuple(
        Tile(r, c, y // ratio, (y + h) // ratio, x // ratio, (x + w) // ratio)
        for r, (y, h) in enumerate(zip(ys, yl))
        for c, (x, w) in enumerate(zip(xs, xl))
    )
    return DecodePlan(latent_frames, pad, windows, tiles, tuple(yo), tuple(xo), keep, vae.frame_pre_padding,
                      vae.frame_overlap, num_frames)


def decode_tile(vae, z_window: torch.Tensor, tile: Tile) -> torch.Tensor:
    """Pixels [B, 3, 28, h, w] of one tile of one window (the unit of work parallel decode distributes)."""
    return vae.decoder(vae.post_quant_conv(z_window[..., tile.y0:tile.y1, tile.x0:tile.x1]))


def decoder_prologue(vae, z_BCThw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`post_quant_conv`, then diffusers' `MiniMaxH3VideoViTDecoder3d.forward` up to its block loop: tokens
    x [B, S, D] (S = t * h * w latent voxels + register tokens + one zero token) and the rotary tables cos / sin
    [B, S, 1, R]. Written out so a compiled decoder can run one compiled block per layer (tested bitwise against
    `vae.decoder`). x is returned in the residual stream's dtype: the first block adds its fp32-scaled branches to it
    (scale1 is pinned to fp32), so upcasting here is exact and every block then sees the same dtype."""
    dec = vae.decoder
    h = vae.post_quant_conv(z_BCThw)
    B, C, T, H, W = h.shape
    x = dec.proj_in(h.permute(0, 2, 3, 4, 1).reshape(B, T * H * W, C))
    register = dec.register_tokens.expand(B, -1, -1).to(x.dtype)
    x = torch.cat([x, register, torch.zeros_like(x[:, :1, :])], dim=1)
    grids = [2.0 * (torch.arange(0.5, size, dtype=torch.float32, device=x.device) / size) - 1.0 for size in (T, H, W)]
    position_ids = torch.stack(torch.meshgrid(*grids, indexing="ij"), dim=-1).flatten(0, 2)
    position_ids = position_ids.unsqueeze(0).expand(B, -1, -1)
    position_ids = torch.cat([position_ids, position_ids.new_zeros((B, dec.num_register_tokens + 1, 3))], dim=1)
    cos, sin = dec.rope(position_ids)
    residual = torch.promote_types(x.dtype, dec.transformer_blocks[0].scale1.dtype)
    return x.to(residual), cos, sin


def decoder_epilogue(vae, x_BSD: torch.Tensor, t: int, h: int, w: int) -> torch.Tensor:
    """The rest of diffusers' decoder forward after its block loop: norm_out (fp32), proj_out, drop the register and
    zero tokens, unpatchify to pixels [B, 3, t * 4, h * 16, w * 16]."""
    dec = vae.decoder
    x = dec.proj_out(dec.norm_out(x_BSD).to(dec.proj_out.weight.dtype))[:, : t * h * w, :]
    B, p, pt = x.shape[0], dec.patch_size, dec.patch_size_t
    x = x.view(B, t, h, w, dec.out_channels, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7).contiguous()
    return x.reshape(B, dec.out_channels, t * pt, h * p, w * p)


def stitch(vae, plan: DecodePlan, tile_pixels: list[torch.Tensor]) -> torch.Tensor:
    """Blend the row-major tile outputs of one window (each [B, 3, f, h, w]) into its frames [B, 3, f, H, W],
    exactly as diffusers' `_stitch_tiles`."""
    rows, cols = plan.grid
    grid = [tile_pixels[r * cols:(r + 1) * cols] for r in range(rows)]
    return vae._stitch_tiles(grid, list(plan.height_overlaps_px), list(plan.width_overlaps_px))


class WindowFrames:
    """Turns stitched windows, pushed in order, into finished frames exactly as diffusers' `_decode` does: drop the
    pre-pad frames, blend the carried overlap into the next window's head, cut the frames of padding latents.

    Push-style so that the single-process stream and the tile-parallel decode (which completes windows as gathered
    tiles arrive) share one copy of this arithmetic. Holds one window's overlap, never the clip.
    """

    def __init__(self, vae, plan: DecodePlan):
        self.vae, self.plan = vae, plan
        self.emitted, self.pushed, self.carry = 0, 0, None

    def push(self, clip_BCFHW: torch.Tensor) -> torch.Tensor:
        """Finished frames [B, 3, f <= keep, H, W] of the next window (VAE output space)."""
        plan = self.plan
        if self.pushed == len(plan.windows):
            raise ValueError(f"All {len(plan.windows)} windows of this plan were already pushed.")
        chunk_frames = plan.keep_frames + plan.pre_pad_frames  # 20
        head = clip_BCFHW[:, :, plan.pre_pad_frames:chunk_frames]
        if self.carry is not None:
            head = self.vae._blend(self.carry, head, plan.overlap_frames, dim=-3)
        self.carry = clip_BCFHW[:, :, chunk_frames + plan.pre_pad_frames:2 * chunk_frames]
        head = head[:, :, : plan.num_frames - self.emitted]
        self.emitted += head.shape[2]
        self.pushed += 1
        return head

    def finish(self) -> torch.Tensor | None:
        """The last window's carried overlap frames, or None if padding cut them all."""
        if self.pushed != len(self.plan.windows):
            raise ValueError(f"finish() after {self.pushed} of {len(self.plan.windows)} windows.")
        tail = self.carry[:, :, : self.plan.num_frames - self.emitted]
        self.carry = None
        self.emitted += tail.shape[2]
        return tail if tail.shape[2] else None


class VideoVAE:
    """A diffusers `AutoencoderKLMiniMaxH3` plus the latent normalisation of the checkpoint."""

    def __init__(self, vae, latents_mean, latents_std, tile_decoders: dict | None = None):
        self.vae = vae.eval().requires_grad_(False)
        # Compiled tile decoders of an engine bundle, by (window latents, tile h, tile w); None: decode eagerly.
        self.tile_decoders: dict[tuple[int, int, int], object] | None = tile_decoders
        self.latents_mean = torch.as_tensor(latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.latents_std = torch.as_tensor(latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)

    def with_tile_decoders(self, tile_decoders: dict | None) -> "VideoVAE":
        """The same weights decoding through a bundle's compiled tile decoders (a new VideoVAE: nothing is switched
        on this one)."""
        return VideoVAE(self.vae, self.latents_mean.flatten(), self.latents_std.flatten(), tile_decoders)

    @property
    def device(self) -> torch.device:
        return self.vae.post_quant_conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.post_quant_conv.weight.dtype

    @property
    def precision(self) -> Precision | str:
        """The --vae-precision these weights are at, read from the weights themselves (so it cannot disagree with
        them): fp8 when the ViT linears hold e4m3 weights, else the dtype of the unpinned decoder tensors."""
        block = self.vae.decoder.transformer_blocks[0]
        if block.attn.to_q.weight.dtype == torch.float8_e4m3fn:
            return Precision.FP8
        return unquantized(self.dtype) or str(self.dtype)

    def plan(self, latent_frames: int, latent_h: int, latent_w: int) -> DecodePlan:
        return plan_decode(self.vae, latent_frames, latent_h, latent_w)

    def denormalize(self, z_BCTHW: torch.Tensor) -> torch.Tensor:
        """Normalised latents [B, C, T, H, W] (the DiT's) -> the VAE's latent space, same shape, fp32."""
        return z_BCTHW * self.latents_std.to(z_BCTHW.device) + self.latents_mean.to(z_BCTHW.device)

    @torch.no_grad()
    def decode_window(self, z_BCTHW: torch.Tensor, plan: DecodePlan, window: int) -> torch.Tensor:
        """All tiles of one window, stitched: [B, 3, 28, H, W] in the VAE's output space (ImageNet-normalised)."""
        z = self.window_latents(z_BCTHW, plan, window)
        return stitch(self.vae, plan, [self.decode_tile(z, tile) for tile in plan.tiles])

    @staticmethod
    def window_latents(z_BCTHW: torch.Tensor, plan: DecodePlan, window: int) -> torch.Tensor:
        """The latent frames of one window: [B, C, t, H, W], a view."""
        start, stop = plan.windows[window]
        return z_BCTHW[:, :, start:stop]

    @torch.no_grad()
    def decode_tile(self, z_window: torch.Tensor, tile: Tile) -> torch.Tensor:
        """Pixels [B, 3, 28, h, w] of one tile of one window: eager, or the bundle's compiled decoder."""
        if self.tile_decoders is None:
            return decode_tile(self.vae, z_window, tile)
        key = (z_window.shape[2], tile.y1 - tile.y0, tile.x1 - tile.x0)
        if key not in self.tile_decoders:
            raise UserError(f"This bundle has no compiled video decoder for a {key[0]}-latent window of {key[1]}x"
                            f"{key[2]} latent tiles (built: {sorted(self.tile_decoders)}); rebuild with this profile.")
        # Compiled code was specialised to contiguous inputs; a tile is a strided view of the window.
        return self.tile_decoders[key](z_window[..., tile.y0:tile.y1, tile.x0:tile.x1].contiguous())

    def tile_shapes(self, latent_frames: int, latent_h: int, latent_w: int) -> list[tuple[int, int, int]]:
        """Distinct (window latents, tile h, tile w) a decode of this latent shape runs: what a bundle compiles."""
        plan = self.plan(latent_frames, latent_h, latent_w)
        windows = {stop - start for start, stop in plan.windows}
        return sorted({(t, tile.y1 - tile.y0, tile.x1 - tile.x0) for t in windows for tile in plan.tiles})

    def prepare(self, latents_BCTHW: torch.Tensor) -> tuple[torch.Tensor, DecodePlan]:
        """Denormalised latents [B, C, T', H, W] on the VAE's device and dtype (T' >= T: padded at the end to whole
        windows by repeating the last frame) from normalised [B, C, T, H, W], and their plan."""
        z = self.denormalize(latents_BCTHW.float()).to(self.device, self.dtype)
        plan = self.plan(*z.shape[2:])
        if plan.pad_latents:
            z = torch.cat([z, z[:, :, -1:].repeat(1, 1, plan.pad_latents, 1, 1)], dim=2)
        return z, plan

    @torch.no_grad()
    def decode_stream(self, latents_BCTHW: torch.Tensor) -> Iterator[torch.Tensor]:
        """Yield finished frames in order, [B, 3, f, H, W] float in [0, 1], one window at a time.

        `latents` are normalised (as the DiT produces them). Peak memory is one window, never the whole clip.
        """
        z, plan = self.prepare(latents_BCTHW)
        frames = WindowFrames(self.vae, plan)
        for w in range(len(plan.windows)):
            yield self.to_unit_range(frames.push(self.decode_window(z, plan, w)))
        tail = frames.finish()
        if tail is not None:
            yield self.to_unit_range(tail)

    @staticmethod
    def to_unit_range(pixels: torch.Tensor) -> torch.Tensor:
        """VAE output pixels [B, 3, F, H, W] (ImageNet-normalised) -> fp32 in [0, 1], same shape."""
        mean = torch.tensor(PIXEL_MEAN, device=pixels.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(PIXEL_STD, device=pixels.device).view(1, -1, 1, 1, 1)
        return (pixels.float() * std + mean).clamp(0, 1)

    @torch.no_grad()
    def encode_condition(self, pixels_BCFHW_uint8: torch.Tensor) -> torch.Tensor:
        """Normalised conditioning latents [1, C, t, h, w] (fp32, CPU) of a keyframe or reference (uint8 pixels)."""
        mean = torch.tensor(PIXEL_MEAN, device=self.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(PIXEL_STD, device=self.device).view(1, -1, 1, 1, 1)
        pixels = (pixels_BCFHW_uint8.to(self.device, torch.float32).div(255.0) - mean) / std
        posterior = self.vae.encode(pixels, return_dict=False)[0]
        latents = posterior.sample(generator=torch.Generator().manual_seed(CONDITION_ENCODE_SEED))
        latents = latents.to(torch.float16).float().cpu()  # the reference rounds through fp16 (~11 bits)
        return (latents - self.latents_mean) / self.latents_std


def image_to_pixels(image: Image.Image) -> torch.Tensor:
    """PIL RGB -> uint8 [1, 3, 1, H, W]."""
    return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)[None, :, None]


def prepare_keyframe(image: Image.Image, height: int, width: int, stretch: bool) -> Image.Image:
    """Fit a keyframe (any PIL mode) to the height x width canvas, in RGB: the first (geometry anchor) is stretched,
    a following one cover-cropped, with the reference's rounding (round the size, centre with (src - dst) // 2),
    LANCZOS either way."""
    image = image.convert("RGB")
    if image.size == (width, height):
        return image
    if stretch:
        return image.resize((width, height), Image.Resampling.LANCZOS)
    scale = max(width / image.size[0], height / image.size[1])
    size = (max(width, round(image.size[0] * scale)), max(height, round(image.size[1] * scale)))
    left, top = max(0, (size[0] - width) // 2), max(0, (size[1] - height) // 2)
    return image.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height))
