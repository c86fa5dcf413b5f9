"""--vae-precision: h3trt's bf16 video VAE against diffusers 0.42.1 loaded with from_pretrained(torch_dtype=bf16), the
precision rules (which tensors end up fp32), the refusals, and the FP8 decoder against bf16. Tiny VAE, CPU.

Tolerances: bf16 decode vs diffusers bf16 on the same device: 0 (bitwise; same modules, same kernels). bf16 vs fp32:
PSNR >= 30 dB and not bitwise (bf16 really ran). FP8 (dynamic and static) vs bf16: PSNR >= 30 dB. Keyframe encode
under bf16 rules: bitwise the fp32 encode and diffusers' bf16 encode.
"""

import re

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from diffusers.models.modeling_utils import get_parameter_dtype
from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

from h3trt.build.config import BuildConfig
from h3trt.cli import main
from h3trt.eval import psnr
from h3trt.models.tiny import tiny_audio_vae
from h3trt.models.checkpoint.vae import load_audio_vae, load_video_vae, save_audio_vae, save_video_vae
from h3trt.models.vae_precision import VAEPrecision, fp32_pinned, skips_low_precision
from h3trt.models.video_vae import PIXEL_MEAN, PIXEL_STD
from h3trt.calibration.vae_fp8 import (DECODER_LINEARS, FP8StaticLinear, FP8TokenLinear, calibrate_video_decoder,
                                       load_video_vae_at, quantize_video_decoder)

TILE, OVERLAP = 64, 16  # 6 tiles a window at 96x128: the stitch runs in bf16 too


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """One random tiny video VAE (non-zero block scales and register tokens, so every block acts) written twice: the
    official layout h3trt reads and the diffusers layout from_pretrained reads."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    vae = AutoencoderKLMiniMaxH3(
        block_out_channels=(32,) * 6, decoder_num_layers=2, decoder_num_attention_heads=2, decoder_ffn_mult=2,
        latents_mean=tuple(torch.randn(24, generator=gen).mul(0.1).tolist()),
        latents_std=tuple(torch.rand(24, generator=gen).add(0.5).tolist())).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith(("scale1", "scale2", "register_tokens")) or "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen).mul(0.3).add(1.0 if "norm" in name else 0.5))
    root = tmp_path_factory.mktemp("vae")
    save_video_vae(root / "official", vae, tile_px=TILE, tile_overlap_px=OVERLAP)
    vae.save_pretrained(root / "diffusers")
    return root


def _diffusers(roots, dtype):
    vae = AutoencoderKLMiniMaxH3.from_pretrained(str(roots / "diffusers"), torch_dtype=dtype).eval()
    vae.enable_tiling(TILE, TILE, OVERLAP, OVERLAP)
    return vae


def _diffusers_frames(vae, z):
    """diffusers' MiniMaxH3VideoDecodeStep arithmetic."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(z * std + mean, return_dict=False)[0]
    return (video.float() * torch.tensor(PIXEL_STD).view(1, -1, 1, 1, 1)
            + torch.tensor(PIXEL_MEAN).view(1, -1, 1, 1, 1)).clamp(0, 1)


def _latents(seed=0):
    return torch.randn(1, 24, 12, 6, 8, generator=torch.Generator().manual_seed(seed))  # 39 frames, 2 windows


def test_bf16_places_every_tensor_as_from_pretrained(roots):
    want = _diffusers(roots, torch.bfloat16)
    ours = load_video_vae(roots / "official", "cpu", torch.bfloat16)
    got = ours.vae.state_dict()
    for name, tensor in want.state_dict().items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name
    assert ours.vae.decoder.rope.inv_freq.dtype == want.decoder.rope.inv_freq.dtype == torch.float32  # not persistent
    dtypes = {n: t.dtype for n, t in got.items()}
    # The module whose substring match broke the earlier bf16 attempt: "quant_conv" is not a component of its name.
    assert dtypes["post_quant_conv.weight"] == torch.bfloat16 and dtypes["quant_conv.weight"] == torch.float32
    for name in ("decoder.proj_in.weight", "decoder.register_tokens", "decoder.transformer_blocks.1.attn.to_q.weight",
                 "decoder.transformer_blocks.0.ff.net.2.bias", "decoder.proj_out.weight"):
        assert dtypes[name] == torch.bfloat16, name
    for name in ("decoder.transformer_blocks.0.norm1.weight", "decoder.transformer_blocks.1.scale2",
                 "decoder.norm_out.bias", "encoder.conv_in.weight"):
        assert dtypes[name] == torch.float32, name
    assert all(d == torch.float32 for n, d in dtypes.items() if n.startswith("encoder."))
    # Every tensor of a module diffusers' _skip_layerwise_casting_patterns names ("norm") is fp32 already.
    skipped = [n for n in dtypes if any(re.search(p, n.rsplit(".", 1)[0])
                                        for p in ours.vae._skip_layerwise_casting_patterns)]
    assert len(skipped) > 4 and all(dtypes[n] == torch.float32 for n in skipped)
    assert skips_low_precision(ours.vae, "decoder.transformer_blocks.0.norm2")
    assert not skips_low_precision(ours.vae, "decoder.transformer_blocks.0.attn.to_q")
    assert {n for n in dtypes if dtypes[n] == torch.float32} == {n for n in dtypes if fp32_pinned(ours.vae, n)}
    assert ours.precision == "bf16" and load_video_vae(roots / "official").precision == "fp32"


def test_bf16_decode_is_bitwise_diffusers_bf16(roots):
    z = _latents()
    ours = load_video_vae(roots / "official", "cpu", torch.bfloat16)
    got = torch.cat(list(ours.decode_stream(z)), dim=2)
    want = _diffusers_frames(_diffusers(roots, torch.bfloat16), z)
    assert got.shape == want.shape == (1, 3, 39, 96, 128)
    assert torch.equal(got, want)
    fp32 = torch.cat(list(load_video_vae(roots / "official").decode_stream(z)), dim=2)
    assert torch.equal(fp32, _diffusers_frames(_diffusers(roots, torch.float32), z))  # fp32 stays bitwise too
    assert not torch.equal(got, fp32) and psnr(got, fp32) >= 30.0


def test_keyframe_encode_keeps_the_reference_fp32_rules(roots):
    pixels = torch.randint(0, 256, (1, 3, 1, 64, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    bf16 = load_video_vae(roots / "official", "cpu", torch.bfloat16).encode_condition(pixels)
    fp32 = load_video_vae(roots / "official").encode_condition(pixels)
    with torch.no_grad():
        want = encode_vae_condition(_diffusers(roots, torch.bfloat16), pixels, PIXEL_MEAN, PIXEL_STD, 42)
    assert torch.equal(bf16, fp32) and torch.equal(bf16, want)


def test_audio_vae_is_fp32_at_every_precision(tmp_path):
    vae = tiny_audio_vae()
    save_audio_vae(tmp_path, vae)
    vae.save_pretrained(tmp_path / "diffusers")
    ours = load_audio_vae(tmp_path, "cpu", torch.bfloat16).vae
    want = AutoencoderKLMiniMaxH3Audio.from_pretrained(str(tmp_path / "diffusers"), torch_dtype=torch.bfloat16)
    assert {t.dtype for t in want.state_dict().values() if t.is_floating_point()} == {torch.float32}
    assert {n: t.dtype for n, t in ours.state_dict().items()} == {n: t.dtype for n, t in want.state_dict().items()}


def test_precision_values_and_refusals(tmp_path, capsys):
    assert VAEPrecision.default("cuda").name == "bf16" and VAEPrecision.default("cpu").name == "fp32"
    assert VAEPrecision.resolve(None, "cuda:1").name == "bf16"
    assert VAEPrecision.resolve("fp8", "cpu").dtype == torch.bfloat16
    for bad in ("fp16", "BF16", "int8", ""):
        with pytest.raises(ValueError, match=r"--vae-precision must be one of \['fp32', 'bf16', 'fp8'\]"):
            VAEPrecision(bad)
    with pytest.raises(ValueError, match="--vae-precision must be one of"):
        BuildConfig(tmp_path, tmp_path / "b", vae_precision="fp16", device="cpu")
    assert BuildConfig(tmp_path, tmp_path / "b", device="cpu").vae.name == "fp32"
    assert BuildConfig(tmp_path, tmp_path / "b", device="cuda").vae.name == "bf16"
    out = tmp_path / "clip.mp4"
    assert main(["run", "--prompt", "a fox", "--output", str(out), "--vae-precision", "fp16", "--quiet"]) == 2
    assert "--vae-precision must be one of" in capsys.readouterr().err and not out.exists()


# ---- FP8 ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_fp8_decoder_runs_and_is_close_to_bf16(roots, activations):
    z = _latents(1)
    bf16 = load_video_vae(roots / "official", "cpu", torch.bfloat16)
    want = torch.cat(list(bf16.decode_stream(z)), dim=2)
    fp8 = load_video_vae(roots / "official", "cpu", torch.bfloat16)
    amax = calibrate_video_decoder(fp8, _latents(2)) if activations == "static" else None
    quantize_video_decoder(fp8.vae, activations, amax)
    cls = FP8TokenLinear if activations == "dynamic" else FP8StaticLinear
    blocks = fp8.vae.decoder.transformer_blocks
    assert all(isinstance(b.get_submodule(n), cls) for b in blocks for n in DECODER_LINEARS)
    assert all(get_parameter_dtype(b.attn.to_q) == torch.bfloat16 for b in blocks)  # the block's compute dtype
    assert fp8.precision == "fp8"
    # What FP8 leaves alone keeps the bf16 rules: norms and scales fp32, proj_in/out bf16, the encoder fp32.
    state = fp8.vae.state_dict()
    assert state["decoder.transformer_blocks.0.norm1.weight"].dtype == torch.float32
    assert state["decoder.proj_out.weight"].dtype == torch.bfloat16
    assert state["encoder.conv_in.weight"].dtype == torch.float32
    got = torch.cat(list(fp8.decode_stream(z)), dim=2)
    assert got.shape == want.shape and not torch.equal(got, want)
    assert psnr(got, want) >= 30.0, psnr(got, want)


def test_fp8_refusals(roots):
    vae = load_video_vae(roots / "official").vae  # fp32-placed
    with pytest.raises(ValueError, match="quantizes a bf16-placed VAE"):
        quantize_video_decoder(vae)
    bf16 = load_video_vae(roots / "official", "cpu", torch.bfloat16).vae
    with pytest.raises(ValueError, match="need amax"):
        quantize_video_decoder(bf16, "static")
    with pytest.raises(ValueError, match="must be one of"):
        quantize_video_decoder(bf16, "per-tensor")
    quantize_video_decoder(bf16)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_video_decoder(bf16)
    assert load_video_vae_at(roots / "official", "cpu", VAEPrecision("fp8")).precision == "fp8"


# ---- compiled decoder ----------------------------------------------------------------------------------------------

def test_decoder_split_is_bitwise_the_diffusers_decoder(roots):
    """in -> every block -> out (the seams the compiled decoder uses) equals `decoder(post_quant_conv(z))`."""
    from h3trt.models.video_vae import decoder_epilogue, decoder_prologue

    for dtype in (torch.float32, torch.bfloat16):
        vae = load_video_vae(roots / "official", "cpu", dtype).vae
        z = _latents(3)[:, :, :7, :4, :4].to(dtype)
        with torch.no_grad():
            want = vae.decoder(vae.post_quant_conv(z))
            x, cos, sin = decoder_prologue(vae, z)
            for block in vae.decoder.transformer_blocks:
                x = block(x, (cos, sin))
            assert torch.equal(decoder_epilogue(vae, x, 7, 4, 4), want), dtype


def compiled_tile_error(official: str, precision: str, work: str) -> dict:
    """The bundle's path: the in / block / out segments compiled and saved (inductor), loaded, bound to the VAE's
    tensors by TileDecoder, against the eager decoder at the same precision. Runs in its own process (the test
    below): compiles earlier in a process, into another Inductor cache folder, were seen to leave a kernel out of a
    later bundle's cache, so a test suite that compiles here must not share its process with bundle builds."""
    import json as _json
    from pathlib import Path

    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from h3trt.build.backends import compile_segment
    from h3trt.build.segments import video_decoder_segments
    from h3trt.engines.guard import no_compile
    from h3trt.engines.loaders import load_segment
    from h3trt.engines.video_decoder import TileDecoder
    from h3trt.models.video_vae import decoder_prologue

    work = Path(work)
    video_vae = load_video_vae_at(Path(official), "cpu", VAEPrecision(precision))
    vae = video_vae.vae
    specs = video_decoder_segments(vae, 7, 4, 4)
    z = _latents(4)[:, :, :7, :4, :4].to(torch.bfloat16)
    tensors = {**dict(vae.named_parameters()), **dict(vae.named_buffers())}
    block = dict(vae.decoder.transformer_blocks[0].named_parameters())
    block.update(vae.decoder.transformer_blocks[0].named_buffers())
    with torch.no_grad():
        x, cos, sin = decoder_prologue(vae, z)
    examples = [[z] + [tensors[n] for n in specs[0].weights], [x, cos, sin] + [block[n] for n in specs[1].weights],
                [x] + [tensors[n] for n in specs[2].weights]]
    (work / "segments").mkdir(parents=True)
    with temporary_cache_dir(str(work.parent / "inductor_cache")):  # shared: in / out compile to the same kernels
        entries = {part: {"name": spec.name, **compile_segment("inductor", spec, ex, work / "segments"),
                          "weights": spec.weights}
                   for part, spec, ex in zip(("in", "block", "out"), specs, examples)}
        with no_compile():
            loaded = {part: load_segment("inductor", e, work, "cpu") for part, e in entries.items()}
            decoder = TileDecoder(loaded, entries, vae, cuda_graph=True)  # a CUDA graph is never used on the CPU
            with torch.no_grad():
                got = decoder(z)
    with torch.no_grad():
        want = vae.decoder(vae.post_quant_conv(z))
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    return _json.loads(_json.dumps({"err": err, "dtypes": [str(got.dtype), str(want.dtype)],
                                    "shapes": [list(got.shape), list(want.shape)]}))


@pytest.mark.build
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_compiled_tile_decoder_at_precision(roots, tmp_path, precision):
    """compiled_tile_error in a fresh process, within the precision's verify_rel_tol (what a build's check allows)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_vae_precision as t; "
            "print(json.dumps(t.compiled_tile_error(*sys.argv[2:])))")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(roots / "official"), precision,
                           str(roots / f"compiled_{precision}")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["dtypes"] == ["torch.bfloat16"] * 2 and result["shapes"] == [[1, 3, 28, 64, 64]] * 2
    assert result["err"] <= VAEPrecision(precision).verify_rel_tol, result["err"]
