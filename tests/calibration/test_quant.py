"""FP8 / NVFP4 on the CPU: formats, the quantized block against the bf16 block, an FP8 tiny bundle calibrated through
ModelOpt (SmoothQuant) and built end to end, and `h3trt eval` of it against the eager tiny model. The calibration
itself (ModelOpt's algorithms, the export of their scales to both backends) is tests/calibration/test_calibration.py.

Tolerances (relative error, Frobenius): an e4m3 per-tensor round trip of a Gaussian is ~2.6%, so an FP8 block stays
within 5% of the bf16 block; NVFP4 (E2M1, ~9.6% per weight) within 15%. The compiled FP8 DiT must differ from the
unquantized DiT (quantization happened) by less than 10%.
"""

import json
import math

import pytest
import torch

from h3trt.build.config import BuildConfig
from h3trt.cli import main
from h3trt.engines.bundle import Engine
from h3trt.eval import PSNR_CAP_DB, log_spectral_distance, psnr, ssim
from h3trt.models.checkpoint.reader import load_dit
from h3trt.models.config import H3Config
from h3trt.models.dit import Block, EagerDiT
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.calibration.build import dit_weight_bytes
from h3trt.calibration.calibrate import calibrate, read_prompts
from h3trt.calibration.formats import FP8, FP8_MAX, dequantize_nvfp4, e2m1_values, fp8_linear, fp8_scale, quantize_fp8
from h3trt.calibration.modules import load_quantized_block
from h3trt.calibration.recipe import QuantRecipe, parse_exclusions

from helpers import tiny_block_inputs

STEPS = 6  # the FP8 bundle's baked schedule: a short one, so the eval runs in seconds
# The bundle tests come first: the build must not follow an in-process compile of another test in this module (the
# nvfp4 segment below), whose compiled kernels would be found in memory instead of landing in the bundle's cache.


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def fp8_bundle(tmp_path_factory, bundle_cache):
    """FP8 tiny bundle: calibrated through ModelOpt's SmoothQuant on two prompts, block 1 kept in bf16, FP8 attention
    on; AdaLN for 6 steps. `h3trt build` in a fresh process (the CLI flags end to end; conftest's BundleCache): a build
    inside the test process can find kernels that earlier tests compiled in memory, which then never land in the
    bundle's cache."""
    prompts = tmp_path_factory.mktemp("fp8") / "prompts.txt"
    prompts.write_text("# calibration prompts\na red fox runs through fresh snow\nwaves break on a rocky shore\n")
    return bundle_cache.get("--precision", "fp8", "--calib-prompts", str(prompts), "--calib-steps", "3",
                            "--calib-algo", "smoothquant", "--quant-exclude", "blocks.1", "--fp8-attention", "--steps",
                            str(STEPS), timeout=1200).path


def test_fp8_bundle_records_the_recipe_and_serves(fp8_bundle, tiny_root):
    engine = Engine.load(fp8_bundle, "cpu")
    q = engine.manifest.quant
    assert engine.manifest.precision == "fp8" and q["calib_algo"] == "smoothquant" and q["calib_prompts"] == 2
    assert q["modelopt"]["version"] == "0.47.0" and q["modelopt"]["algorithm"] == "smoothquant"
    assert q["modelopt"]["modelopt_algorithm"] == {"method": "smoothquant", "alpha": 1.0}
    assert q["modelopt"]["forward_passes"] == 1 and q["calib_steps"] == 3
    assert q["exclude_blocks"] == [1] and q["layer_segments"] == ["block", "block_hp"] and q["fp8_attention"]
    assert q["attention_kernel"] == "emulated"  # a CPU build bakes the reference kernel; a GPU build, cuDNN's
    assert "torch._scaled_mm" in q["execution"] and "token_refiner" in q["always_high_precision"]
    assert q["fp8_accum"] == "fast" and QuantRecipe.from_dict(q).fp8_accum == "fast"  # the default, recorded
    assert all(v > 0 for v in q["amax"]["blocks.0"].values()) and set(engine.segments) >= {"block", "block_hp"}
    from safetensors.torch import load_file

    blocks = load_file(str(fp8_bundle / "weights" / "blocks.safetensors"))
    assert blocks["blocks.0.mlp.fc1.weight"].dtype == FP8 and blocks["blocks.1.mlp.fc1.weight"].dtype == torch.bfloat16
    assert blocks["blocks.0.attn.q_scale"].item() == pytest.approx(q["amax"]["blocks.0"]["attn.q"] / FP8_MAX, rel=1e-5)
    # SmoothQuant's per-channel scales travel as the linears' pre_quant_scale; the smoothed inputs' range is ~1.
    assert blocks["blocks.0.mlp.fc1.pre_quant_scale"].shape == (engine.manifest.model_config.hidden_size,)
    assert "blocks.1.mlp.fc1.pre_quant_scale" not in blocks
    assert q["amax"]["blocks.0"]["mlp.fc1.input"] == pytest.approx(1.0, rel=1e-2)

    eager = EagerDiT(load_dit(tiny_root, "t2va", torch.bfloat16)[0])
    layout = pack_t2va(text_tags_for(11), 7, 6, 10, 23)
    g = torch.Generator().manual_seed(3)
    args = (torch.randn(1, layout.video_index.numel(), eager.cfg.video_patch_dim, generator=g),
            torch.randn(1, layout.audio_index.numel(), eager.cfg.audio_in_channels, generator=g),
            torch.randn(1, 11, eager.cfg.text_dim, generator=g).bfloat16())
    from h3trt.build.adaln import schedule_timesteps
    from h3trt.models.sampler import Schedule

    tv = schedule_timesteps(Schedule(STEPS, 12.0, 3.0))[-3].item()
    unique_t, t_index = row_timesteps(layout, tv, tv)
    with torch.no_grad():
        for got, want in zip(engine.dit(*args, unique_t, t_index, layout), eager(*args, unique_t, t_index, layout)):
            assert 0 < rel(got, want) < 0.1


def test_eval_cli_compares_the_fp8_bundle_with_the_eager_model(fp8_bundle, tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "a red fox runs through fresh snow", "seed": 3}\n')
    out = tmp_path / "eval.json"
    assert main(["eval", "--engine", str(fp8_bundle), "--reference", "tiny", "--requests", str(requests),
                 "--json", str(out), "--device", "cpu"]) == 0
    result = json.loads(out.read_text())
    (r,) = result["requests"]
    steps = r["latent_rel_err_per_step"]
    assert len(steps["video"]) == len(steps["audio"]) == STEPS - 1
    assert all(0 < e < 0.5 for e in steps["video"] + steps["audio"])
    # Each step's own error: the quantized trajectory drifts from the eager one (flat on the CPU before the recorder
    # copied the latents the sampler updates in place).
    assert steps["video"][0] < steps["video"][-1] and len(set(steps["video"])) == len(steps["video"])
    assert 10 < r["psnr_db"] < PSNR_CAP_DB and 0 < r["ssim"] <= 1 and r["audio_lsd_db"] >= 0
    assert result["mean"]["psnr_db"] == r["psnr_db"] and result["engine_quant"]["precision"] == "fp8"
    assert "PSNR dB" in capsys.readouterr().out
    assert main(["eval", "--engine", str(fp8_bundle), "--reference", "tiny", "--requests", str(requests),
                 "--json", str(out)]) == 2  # never overwrites a result


def test_fp8_quantization_saturates_and_scales():
    x = torch.tensor([0.0, 1.0, -3.0, 1e6, -1e6])
    scale = fp8_scale(torch.tensor(3.0))
    q = quantize_fp8(x, scale)
    assert q.dtype == FP8 and torch.isfinite(q.float()).all()
    assert q.float().abs().max().item() == FP8_MAX  # beyond the calibrated range: saturate, never inf
    assert (q.float() * scale)[2].item() == -3.0  # amax maps exactly onto the e4m3 maximum
    assert torch.isfinite(fp8_scale(torch.tensor(0.0))).all() and fp8_scale(torch.tensor(0.0)).item() > 0


def test_fp8_linear_is_the_gemm_of_the_quantized_operands():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 64, generator=g).bfloat16()
    w = torch.randn(48, 64, generator=g) * 0.05
    ws, xs = fp8_scale(w.abs().amax()), fp8_scale(x.float().abs().amax())
    wq = quantize_fp8(w, ws)
    y = fp8_linear(x, wq, ws, xs)  # torch._scaled_mm, on the CPU too
    want = torch.nn.functional.linear(quantize_fp8(x, xs).float() * xs, wq.float() * ws)
    assert y.shape == (3, 40, 48) and y.dtype == torch.bfloat16
    assert rel(y, want) < 8e-3  # the bf16 output rounding only
    assert rel(y, torch.nn.functional.linear(x.float(), w)) < 0.05


@pytest.mark.parametrize("accum", ["fast", "exact"])
def test_fp8_accumulation_is_baked_into_the_block_code(accum):
    """--fp8-accum reaches every FP8 GEMM of the block the builder compiles: the exported graph's _scaled_mm calls
    carry use_fast_accum (the CPU kernel ignores it, so the code is what can be checked here)."""
    from h3trt.calibration.modules import quantized_template

    cfg = H3Config.tiny()
    block = quantized_template(Block(cfg), cfg, QuantRecipe("fp8", calib_steps=2, fp8_accum=accum))
    x = torch.randn(1, 5, cfg.hidden_size)
    calls = []
    for name in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
        graph = torch.export.export(block.get_submodule(name), (x if name != "mlp.fc2" else
                                                                torch.randn(1, 5, cfg.ffn_dim),)).graph
        calls += [n for n in graph.nodes if n.target == torch.ops.aten._scaled_mm.default]
    assert len(calls) == 4
    names = [a.name for a in torch.ops.aten._scaled_mm.default._schema.arguments]

    def fast(call) -> bool:
        given = {**dict(zip(names, call.args)), **call.kwargs}
        return given.get("use_fast_accum", False)

    assert all(fast(c) is (accum == "fast") for c in calls)


def test_nvfp4_modules_decode_modelopts_packing_exactly():
    """h3trt's NVFP4 dequantization reads the weights ModelOpt's NVFP4 export packs (E2M1 codes, element 2j in the
    low nibble, E4M3 block scales, fp32 global scale) exactly as ModelOpt decodes them."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    grid = e2m1_values(torch.arange(16, dtype=torch.uint8))
    assert grid.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    # Every code, in rows of 32 = two NVFP4 groups (survives exactly); then a Gaussian (E2M1's ~10% error).
    for w, tol in ((grid.repeat(4, 2) * 0.01, 1e-6), (torch.randn(64, 96, generator=torch.Generator().manual_seed(1)),
                                                     0.12)):
        global_scale = w.abs().amax() / (6 * 448)
        packed, block_scale, global_scale = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=global_scale)
        theirs = packed.dequantize(torch.float32, scale=block_scale, double_scale=global_scale, block_sizes={-1: 16})
        ours = dequantize_nvfp4(packed._quantized_data, block_scale, global_scale.reshape(1), torch.float32)
        assert packed._quantized_data.shape == (w.shape[0], w.shape[1] // 2) and block_scale.dtype == FP8
        assert torch.equal(ours, theirs) and rel(ours, w) < tol


@pytest.mark.build
@pytest.mark.parametrize("recipe, tol", [
    (QuantRecipe("fp8", calib_steps=2), 0.05),
    (QuantRecipe("fp8", calib_steps=2, fp8_attention=True, attention_kernel="emulated", exclude_linears=("mlp.fc2",)),
     0.05),
    (QuantRecipe("nvfp4"), 0.15),
    (QuantRecipe("nvfp4", "awq_lite", calib_steps=2), 0.15),
])
def test_quantized_block_stays_close_to_bf16(recipe, tol):
    """The block segment over the modules calibrated through ModelOpt (one block, one input), against the bf16 block;
    NVFP4 also compiled (its weight-only dequantization and AWQ's input scale in one Inductor graph)."""
    import copy

    from h3trt.build.backends import compile_segment
    from h3trt.engines.loaders import load_segment
    from h3trt.build.segments import block_segment

    cfg = H3Config.tiny()
    block, args = tiny_block_inputs(cfg)
    with torch.no_grad():
        want = block(*args)
    calibrated = copy.deepcopy(block)
    forward = (lambda attn: calibrated(*args, attn)) if recipe.needs_calibration_data else None
    tensors = calibrate([calibrated], recipe, forward, log=lambda m: None).export_block(0)
    load_quantized_block(block, cfg, recipe, tensors)
    spec = block_segment(cfg, torch.bfloat16, recipe)
    weights = {**dict(block.named_parameters()), **dict(block.named_buffers())}
    assert all(n in weights for n in spec.weights)
    assert ("mlp.fc1.pre_quant_scale" in spec.weights) == recipe.smooths_inputs
    with torch.no_grad():
        got = spec.fn(*args[:3], *args[3], *[weights[n] for n in spec.weights])
    err = rel(got, want)
    assert 0 < err < tol, f"{recipe.precision}: relative error {err:.3e} (tolerance {tol})"
    if recipe.precision == "nvfp4":  # the compiled weight-only segment computes the same values
        import tempfile
        from pathlib import Path

        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        example = [*args[:3], *args[3], *[weights[n] for n in spec.weights]]
        with tempfile.TemporaryDirectory() as tmp, temporary_cache_dir(f"{tmp}/cache"):
            (Path(tmp) / "segments").mkdir()
            entry = compile_segment("inductor", spec, example, Path(tmp) / "segments")
            seg = load_segment("inductor", {"name": "block", **entry}, Path(tmp), torch.device("cpu"))
            assert rel(seg(*example)[0], got) < 2e-2


def test_recipe_and_build_options_are_validated(tiny_root, tmp_path):
    assert parse_exclusions(["blocks.3", "mlp.fc2", "blocks.0"]) == ((0, 3), ("mlp.fc2",))
    with pytest.raises(ValueError, match="name a whole block"):
        parse_exclusions(["final_layer"])
    with pytest.raises(ValueError, match="needs --precision fp8"):
        QuantRecipe("nvfp4", fp8_attention=True)
    with pytest.raises(ValueError, match="nothing would be quantized"):
        QuantRecipe("nvfp4", exclude_linears=("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"))
    with pytest.raises(ValueError, match="needs --calib-prompts"):
        BuildConfig(tiny_root, tmp_path / "b", precision="fp8")
    with pytest.raises(ValueError, match="apply to --precision fp8/nvfp4"):
        BuildConfig(tiny_root, tmp_path / "b", precision="bf16", fp8_attention=True)
    with pytest.raises(ValueError, match="at least 2"):
        BuildConfig(tiny_root, tmp_path / "b", precision="fp8", calib_prompts=tmp_path / "p", calib_steps=1)
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="has no prompts"):
        read_prompts(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="--fp8-accum must be one of"):
        QuantRecipe("fp8", calib_steps=2, fp8_accum="tf32")
    with pytest.raises(ValueError, match="--fp8-accum .* applies to --precision fp8 \\(got nvfp4\\)"):
        BuildConfig(tiny_root, tmp_path / "b", precision="nvfp4", fp8_accum="exact")
    with pytest.raises(ValueError, match="not to --backend tensorrt"):
        BuildConfig(tiny_root, tmp_path / "b", precision="fp8", calib_prompts=tmp_path / "p", fp8_accum="fast",
                    backend="tensorrt")
    # A bundle recorded before the field existed ran cuBLAS's default, exact accumulation.
    legacy = {k: v for k, v in QuantRecipe("fp8", calib_steps=2).to_dict().items() if k != "fp8_accum"}
    assert QuantRecipe.from_dict(legacy).fp8_accum == "exact"
    with pytest.raises(ValueError, match="blocks \\[7\\] do not exist"):
        QuantRecipe("nvfp4", exclude_blocks=(7,)).check_layers(2)


def test_build_cli_refuses_bad_quantization_flags(tiny_cache, tmp_path, capsys):
    base = ["build", "--model", "tiny", "--output", str(tmp_path / "b"), "--device", "cpu"]
    assert main(base + ["--precision", "fp8"]) == 2
    assert "needs --calib-prompts" in capsys.readouterr().err
    assert main(base + ["--precision", "nvfp4", "--quant-exclude", "final_layer"]) == 2
    assert "name a whole block (blocks.N) or a block linear" in capsys.readouterr().err
    assert main(base + ["--precision", "nvfp4", "--fp8-attention"]) == 2
    assert "--fp8-attention needs --precision fp8" in capsys.readouterr().err
    assert main(base + ["--precision", "fp8", "--calib-algo", "awq_lite"]) == 2
    assert "--calib-algo awq_lite does not apply to --precision fp8: it takes max, percentile, smoothquant" in \
        capsys.readouterr().err
    assert main(base + ["--precision", "nvfp4", "--calib-algo", "awq_lite"]) == 2
    assert "needs --calib-prompts FILE (one prompt per line) for --calib-algo awq_lite" in capsys.readouterr().err
    assert main(base + ["--calib-algo", "max"]) == 2
    assert "apply to --precision fp8/nvfp4, not bf16" in capsys.readouterr().err
    assert main(base + ["--fp8-accum", "exact"]) == 2
    assert "--fp8-accum sets how" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_full_size_weight_bytes():
    full = H3Config()
    bf16 = dit_weight_bytes(full, None, 99)
    fp8 = dit_weight_bytes(full, QuantRecipe("fp8", calib_steps=2), 99)
    nvfp4 = dit_weight_bytes(full, QuantRecipe("nvfp4"), 99)
    linear_params = 50 * (5376 * 3 * 7168 + 7168 * 5376 + 5376 * 2 * 14336 + 14336 * 5376)
    assert bf16["blocks"] - fp8["blocks"] == linear_params - 50 * 4 * 2 * 4  # 1 byte less each, + 2 fp32 scales
    assert fp8["blocks"] - nvfp4["blocks"] == linear_params * 7 // 16 + 50 * 4 * 4  # 4.5 bits; one global scale
    assert fp8["embed"] == bf16["embed"] and fp8["adaln_tables"] == bf16["adaln_tables"]
    assert fp8["total"] < 21 * 2**30 and bf16["total"] > 41e9


def test_eval_metrics():
    a = torch.rand(4, 3, 24, 32, generator=torch.Generator().manual_seed(0))
    assert psnr(a, a) == PSNR_CAP_DB and ssim(a, a) == pytest.approx(1.0)
    assert psnr((a + 0.1).clamp(0, 1), a) < psnr((a + 0.01).clamp(0, 1), a)
    assert psnr(torch.full_like(a, 0.6), torch.full_like(a, 0.5)) == pytest.approx(20.0)
    assert ssim(torch.rand_like(a), a) < 0.2
    w = torch.randn(2, 8000, generator=torch.Generator().manual_seed(1))
    assert log_spectral_distance(w, w) == 0.0
    assert log_spectral_distance(0.5 * w, w) == pytest.approx(20 * math.log10(2), rel=1e-6)  # 6.02 dB everywhere
