"""Video and audio VAE: h3trt's decode plan and loaders against diffusers 0.42.1 on tiny configs."""

import json

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

from h3trt.models.checkpoint.reader import CheckpointError
from h3trt.models.checkpoint.vae import (
    audio_vae_kwargs, load_audio_vae, load_video_vae, save_audio_vae, save_video_vae, video_vae_diffusers_to_native,
    video_vae_native_to_diffusers,
)
from h3trt.models.video_vae import PIXEL_MEAN, PIXEL_STD, VideoVAE


@pytest.fixture(scope="module")
def video_vae():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return AutoencoderKLMiniMaxH3(
        block_out_channels=(32,) * 6, decoder_num_layers=2, decoder_num_attention_heads=2, decoder_ffn_mult=2,
        latents_mean=tuple(torch.randn(24, generator=gen).mul(0.1).tolist()),
        latents_std=tuple(torch.rand(24, generator=gen).add(0.5).tolist()),
    ).eval()


@pytest.fixture(scope="module")
def audio_vae():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    return AutoencoderKLMiniMaxH3Audio(
        encoder_dim=8, latent_dim=64, decoder_dim=128,
        latents_mean=torch.randn(32, generator=gen).mul(0.1).tolist(),
        latents_std=torch.rand(32, generator=gen).add(0.5).tolist(),
    ).eval()


def diffusers_frames(vae, z_normalized):
    """diffusers' MiniMaxH3VideoDecodeStep arithmetic: denormalise, decode, ImageNet -> [0, 1]."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(z_normalized * std + mean, return_dict=False)[0]
    pm = torch.tensor(PIXEL_MEAN).view(1, -1, 1, 1, 1)
    ps = torch.tensor(PIXEL_STD).view(1, -1, 1, 1, 1)
    return (video.float() * ps + pm).clamp(0, 1)


@pytest.mark.parametrize("tile", [(256, 64), (64, 16), (96, 32)], ids=["1tile", "6tiles", "2tiles"])
@pytest.mark.parametrize("latent_frames", [7, 12, 9], ids=["22f", "39f_window", "30f_padded"])
def test_streamed_decode_is_bitwise_diffusers(video_vae, tile, latent_frames):
    video_vae.enable_tiling(tile[0], tile[0], tile[1], tile[1])
    try:
        ours = VideoVAE(video_vae, video_vae.config.latents_mean, video_vae.config.latents_std)
        z = torch.randn(1, 24, latent_frames, 6, 8, generator=torch.Generator().manual_seed(latent_frames))
        chunks = list(ours.decode_stream(z))
        want = diffusers_frames(video_vae, z)
        got = torch.cat(chunks, dim=2)
        assert got.shape == want.shape
        assert torch.equal(got, want)  # same device, same kernels: bitwise
        plan = ours.plan(latent_frames, 6, 8)
        assert plan.num_frames == want.shape[2]
        assert sum(c.shape[2] for c in chunks) == plan.num_frames
        assert len(chunks) <= len(plan.windows) + 1  # one chunk per window, plus the trailing overlap
        assert all(c.shape[2] <= plan.keep_frames for c in chunks)  # streamed a window at a time
    finally:
        video_vae.enable_tiling(256, 256, 64, 64)


def test_plan_geometry_of_the_validated_shape(video_vae):
    """1344x768, 124 frames: 37 latents -> 7 windows of 5+2 latents, 124 frames; 256 px tiles over 768x1344."""
    plan = VideoVAE(video_vae, [0.0] * 24, [1.0] * 24).plan(37, 48, 84)
    assert plan.num_frames == 124 and len(plan.windows) == 7 and plan.pad_latents == 0
    assert plan.windows[0] == (0, 7) and plan.windows[-1] == (30, 37)
    assert (plan.keep_frames, plan.pre_pad_frames, plan.overlap_frames) == (17, 3, 5)
    assert plan.grid == (4, 7)
    assert all(o >= 64 for o in plan.height_overlaps_px + plan.width_overlaps_px)


def test_condition_encode_matches_diffusers(video_vae):
    ours = VideoVAE(video_vae, video_vae.config.latents_mean, video_vae.config.latents_std)
    pixels = torch.randint(0, 256, (1, 3, 1, 64, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = encode_vae_condition(video_vae, pixels, PIXEL_MEAN, PIXEL_STD, 42)
    got = ours.encode_condition(pixels)
    assert got.shape == (1, 24, 1, 4, 6)
    assert torch.equal(got, want)


def test_video_vae_official_layout_roundtrip(tmp_path, video_vae):
    save_video_vae(tmp_path, video_vae, tile_px=96, tile_overlap_px=32)
    loaded = load_video_vae(tmp_path)
    for key, value in video_vae.state_dict().items():
        assert torch.equal(loaded.vae.state_dict()[key], value), key
    assert (loaded.vae.tile_sample_min_height, loaded.vae.tile_sample_min_overlap_width) == (96, 32)
    assert torch.equal(loaded.vae.decoder.rope.inv_freq, video_vae.decoder.rope.inv_freq)
    assert torch.equal(loaded.latents_std, torch.tensor(video_vae.config.latents_std).view(1, -1, 1, 1, 1))


def test_native_video_vae_names_of_the_released_model():
    """The released architecture maps onto the 560 native names the official file holds (diffusers' conversion
    script's key plan), with the QKV rows interleaved per head."""
    with torch.device("meta"):
        vae = AutoencoderKLMiniMaxH3()
    native = video_vae_diffusers_to_native(vae.state_dict(), 32, 64)
    assert len(native) == 560
    for name in ("encoder.down.1.block.0.nin_shortcut.weight", "encoder.down.3.downsample.conv.weight",
                 "decoder.x_embedder.weight", "decoder.register_tokens", "decoder.mask_token",
                 "decoder.transformer_blocks.35.attn.to_qkv.bias", "decoder.transformer_blocks.0.ff.w1.weight"):
        assert name in native, name
    assert "encoder.down.4.downsample.conv.weight" not in native  # levels 4, 5 do not downsample
    assert "encoder.down.2.block.0.nin_shortcut.weight" not in native  # 256 -> 256 needs no shortcut
    assert tuple(native["decoder.transformer_blocks.0.attn.to_qkv.weight"].shape) == (6144, 2048)


def test_native_qkv_and_swiglu_order():
    heads, hd, dim = 2, 4, 8
    q, k, v = (torch.arange(heads * hd * dim, dtype=torch.float32).view(heads * hd, dim) + 1000 * i for i in range(3))
    state = {"decoder.transformer_blocks.0.attn.to_q.weight": q, "decoder.transformer_blocks.0.attn.to_k.weight": k,
             "decoder.transformer_blocks.0.attn.to_v.weight": v, "decoder.proj_in.weight": torch.zeros(dim, 24),
             "decoder.transformer_blocks.0.ff.net.0.proj.weight": torch.cat([torch.ones(3, dim), -torch.ones(3, dim)])}
    native = video_vae_diffusers_to_native(state, heads, hd)
    qkv = native["decoder.transformer_blocks.0.attn.to_qkv.weight"]
    assert torch.equal(qkv[:hd], q[:hd]) and torch.equal(qkv[hd:2 * hd], k[:hd]) and torch.equal(qkv[2 * hd:3 * hd], v[:hd])
    assert torch.equal(native["decoder.transformer_blocks.0.ff.w1.weight"][:3], -torch.ones(3, dim))  # gate first
    back = video_vae_native_to_diffusers(native, heads, hd)
    for key in state:
        assert torch.equal(back[key], state[key])


def test_audio_decode_and_encode_match_diffusers(tmp_path, audio_vae):
    save_audio_vae(tmp_path, audio_vae)
    ours = load_audio_vae(tmp_path)
    rows = torch.randn(2 * 9, 32, generator=torch.Generator().manual_seed(0))
    wave = ours.decode_rows(rows)
    # diffusers MiniMaxH3AfterDenoiseStep + MiniMaxH3AudioDecodeStep
    mean = torch.tensor(audio_vae.config.latents_mean).view(1, -1, 1)
    std = torch.tensor(audio_vae.config.latents_std).view(1, -1, 1)
    with torch.no_grad():
        want = audio_vae.decode(rows.reshape(2, 9, 32).permute(0, 2, 1) * std + mean, return_dict=False)[0]
    want = want.float().permute(1, 0, 2)[0]
    assert wave.shape == (2, 9 * 800)
    assert torch.equal(wave, want)
    # diffusers MiniMaxH3Ref2VAReferenceEncoderStep: posterior mean, normalised, channel-major rows
    audio = torch.randn(2, 8000, generator=torch.Generator().manual_seed(1)).clamp(-1, 1)
    with torch.no_grad():
        lat = audio_vae.encode(audio[:, None], return_dict=False)[0].mode().float().transpose(1, 2)
    want_rows = ((lat - mean.view(1, 1, -1)) / std.view(1, 1, -1)).reshape(-1, 32)
    assert torch.equal(ours.encode_rows(audio), want_rows)


def test_audio_metadata_maps_to_the_released_decoder_kernels():
    kwargs = audio_vae_kwargs(
        {"encoder_dim": 64, "encoder_rates": [2, 4, 4, 5, 5], "latent_dim": 2048, "vae_latent_channels": 32,
         "decoder_dim": 1024, "decoder_rates": [5, 5, 2, 2, 2, 2, 2], "sample_rate": 32000},
        {"latents_mean": [0.0] * 32, "latents_std": [1.0] * 32, "sample_rate": 32000, "latent_channels": 32})
    assert kwargs["decoder_kernel_sizes"] == (9, 9, 4, 4, 4, 4, 4)
    with pytest.raises(CheckpointError, match="sample_rate"):
        audio_vae_kwargs({**{"encoder_dim": 64, "encoder_rates": [2], "latent_dim": 64, "vae_latent_channels": 32,
                             "decoder_dim": 128, "decoder_rates": [2], "sample_rate": 32000}},
                         {"latents_mean": [0.0] * 32, "latents_std": [1.0] * 32, "sample_rate": 44100})


def test_vae_errors_name_the_file(tmp_path, video_vae):
    with pytest.raises(CheckpointError, match="neither video_vae/"):
        load_video_vae(tmp_path)
    save_video_vae(tmp_path, video_vae)
    source = tmp_path / "video_vae" / "source" / "model.safetensors"
    source.write_bytes(source.read_bytes()[:64])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        load_video_vae(tmp_path)
    config = tmp_path / "video_vae" / "config.json"
    data = json.loads(config.read_text())
    del data["latents_mean"]
    config.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="latents_mean"):
        load_video_vae(tmp_path)
