"""The pipelined writer's RGB -> yuv420p conversion on the device (h3trt/media/encoder.py).

`rgb_to_yuv420` replaces swscale's conversion on the encoder thread; it must write what swscale would (BT.709 limited
range, the same chroma filter) up to rounding. Lossless H.264 (CRF 0) makes the comparison through a real MP4 exact:
the decoded planes are the encoder's input.
"""

import av
import numpy as np
import pytest
import torch
from av.video.reformatter import ColorRange, Colorspace, Interpolation

from h3trt.media.mp4 import X264_PRESETS
from h3trt.media.encoder import OutputConfig, PipelinedWriter, rgb_to_yuv420

H, W, T = 96, 160, 12


def swscale_yuv420(frames: np.ndarray) -> np.ndarray:
    """What Mp4Writer.write_frames hands x264: swscale's conversion with the writer's settings."""
    return np.stack([av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(
        format="yuv420p", dst_colorspace=Colorspace.ITU709, src_color_range=ColorRange.JPEG,
        dst_color_range=ColorRange.MPEG, interpolation=Interpolation.BILINEAR | Interpolation.ACCURATE_RND,
    ).to_ndarray() for rgb in frames])


def smooth_frames() -> np.ndarray:
    """Moving smooth colour fields with mild noise: what a decoder gives, not x264's worst case."""
    y, x = np.mgrid[0:H, 0:W]
    frames = np.stack([np.stack([128 + 100 * np.sin((x + 5 * t) / 15) * np.cos(y / 11), y * 255 / (H - 1),
                                 128 + 90 * np.sin((x + y - 7 * t) / 25)], -1) for t in range(T)])
    noise = np.random.default_rng(0).normal(0, 2, frames.shape)
    return np.clip(frames + noise, 0, 255).round().astype(np.uint8)


@pytest.mark.parametrize("height, width", [(96, 160), (768, 1344), (18, 22)])
def test_rgb_to_yuv420_is_swscale_up_to_rounding(height, width):
    frames = np.random.default_rng(height).integers(0, 256, (2, height, width, 3), dtype=np.uint8)
    got = rgb_to_yuv420(torch.from_numpy(frames))
    want = swscale_yuv420(frames)
    assert got.dtype == torch.uint8 and tuple(got.shape) == want.shape == (2, height * 3 // 2, width)
    diff = np.abs(got.numpy().astype(int) - want)
    assert diff.max() <= 1, diff.max()  # rounding only: same matrix, range and chroma filter
    assert (diff != 0).mean() < 0.02, (diff != 0).mean()
    # Saturated colours and both ends of the range land where swscale puts them (limits 16..235 / 16..240).
    flat = np.zeros((1, 8, 8, 3), np.uint8)
    for rgb in ((0, 0, 0), (255, 255, 255), (255, 0, 0), (0, 0, 255)):
        flat[:] = rgb
        assert np.abs(rgb_to_yuv420(torch.from_numpy(flat)).numpy().astype(int) - swscale_yuv420(flat)).max() <= 1


def test_rgb_to_yuv420_rejects_odd_sizes_and_other_dtypes():
    with pytest.raises(ValueError, match="even frame size"):
        rgb_to_yuv420(torch.zeros(1, 9, 8, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        rgb_to_yuv420(torch.zeros(1, 8, 8, 3))


def _write_lossless(path, frames: np.ndarray, convert_on_device: bool) -> np.ndarray:
    """Write through the pipelined writer at CRF 0 (lossless) and return the decoded yuv420p planes and colour tags."""
    config = OutputConfig(chunk_frames=5, max_pending_frames=10, convert_on_device=convert_on_device)
    with PipelinedWriter(path, W, H, 24, 0, 32000, torch.device("cpu"), config) as writer:
        writer.put_frames(torch.from_numpy(frames[:7]))
        writer.put_audio(torch.zeros(2, 16000))
        writer.put_frames(torch.from_numpy(frames[7:]))
    with av.open(str(path)) as container:
        cc = container.streams.video[0].codec_context
        tags = (cc.colorspace, cc.color_range, cc.color_primaries, cc.color_trc)
        return np.stack([f.to_ndarray() for f in container.decode(video=0)]).astype(int), tags


def test_device_conversion_writes_what_swscale_would(tmp_path):
    frames = smooth_frames()
    new, new_tags = _write_lossless(tmp_path / "device.mp4", frames, convert_on_device=True)
    old, old_tags = _write_lossless(tmp_path / "swscale.mp4", frames, convert_on_device=False)
    assert new.shape == old.shape == (T, H * 3 // 2, W)
    assert np.array_equal(new, rgb_to_yuv420(torch.from_numpy(frames)).numpy())  # x264 got exactly these planes
    diff = np.abs(new - old)
    assert diff.max() <= 1 and (diff != 0).mean() < 0.02, (diff.max(), (diff != 0).mean())
    # Both streams tagged BT.709 (1) limited range (MPEG = 1), so players convert back with the matrix we used.
    assert new_tags == old_tags == (1, 1, 1, 1)


def test_output_config_names_x264_presets():
    assert OutputConfig().preset in X264_PRESETS
    with pytest.raises(ValueError, match="not an x264 preset"):
        OutputConfig(preset="turbo")
