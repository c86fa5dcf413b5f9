"""Calibration through ModelOpt (h3trt/calibration/calibrate.py) on the CPU, tiny shapes.

  - the exported h3trt tensors are ModelOpt's quantizers' amax: input/weight scale = amax / 448, NVFP4 global
    scale = amax / (6 * 448), pre_quant_scale = the input quantizer's;
  - what each algorithm does to the model: max/percentile leave the weights, SmoothQuant and AWQ fold per-channel
    scales into them (W' * s_in == W) and leave the input scale;
  - the h3trt block reproduces ModelOpt's fake-quantized block on held-out inputs: in fp32 to 5e-4 relative error of
    the block's update (bitwise but for fp32 summation order and e4m3 rounding flips: h3trt quantizes x / (amax/448),
    ModelOpt x * (448/amax), which differ by an ulp, so an element lying on an e4m3 rounding boundary can round the
    other way; measured 1e-7 without a flip and 1.1e-4 with one, on an AVX2 machine whose fc1 input had such an
    element; FP8 attention 2e-2: h3trt's kernel also rounds its output to e4m3 at v's scale, which the
    ModelOpt reference does not; measured 0.9%), against quantization errors of 5-26%. In bf16 the update of this
    tiny block is at bf16's own noise floor (the bf16 eager block is 6.8% from the fp32 one), and ModelOpt computes
    in bf16 from dequantized operands where h3trt's FP8 GEMM accumulates e4m3 operands in fp32: there the bound is
    that floor, measured in the test;
  - the ONNX Q/DQ graph (TensorRT backend) of the same calibration carries the same scales as the h3trt modules;
  - ModelOpt's max is the running max |x| over the calibration data;
  - bad algorithm/precision combinations and a missing ModelOpt are refused before anything loads.
"""

import collections
import copy
import importlib.metadata

import numpy as np
import pytest
import torch

from h3trt.build.config import BuildConfig
from h3trt.errors import UserError
from h3trt.models.config import H3Config
from h3trt.models.packing import row_timesteps
from h3trt.models.precision import QUANT_PRECISIONS
from h3trt.calibration.calibrate import PERCENTILE, attention_core, calibrate, modelopt_config
from h3trt.calibration.formats import FP8_MAX, quantize_fp8
from h3trt.calibration.modules import load_quantized_block
from h3trt.calibration.recipe import BLOCK_LINEARS, QuantRecipe, check_modelopt

from helpers import tiny_block, uninstalled

RECIPES = {
    "fp8_max": QuantRecipe("fp8", "max", calib_steps=2),
    "fp8_max_attn": QuantRecipe("fp8", "max", calib_steps=2, fp8_attention=True, attention_kernel="emulated"),
    "fp8_percentile": QuantRecipe("fp8", "percentile", calib_steps=2),
    "fp8_smoothquant": QuantRecipe("fp8", "smoothquant", calib_steps=2),
    "nvfp4_max": QuantRecipe("nvfp4", "max"),
    "nvfp4_awq_lite": QuantRecipe("nvfp4", "awq_lite", calib_steps=2),
}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _block(dtype, seed=0):
    """A tiny block with random weights, two calibration inputs and a held-out one (another seed, other timesteps);
    channel 3 of the residual stream is an outlier, as real activations have."""
    cfg = H3Config.tiny()
    g = torch.Generator().manual_seed(seed)
    block, layout, rope = tiny_block(cfg, g, dtype)

    def inputs(tv, ta):
        _, t_index = row_timesteps(layout, tv, ta)
        x = torch.randn(1, layout.seq_len, cfg.hidden_size, generator=g)
        x[..., 3] *= 20
        mod = block.modulation(torch.randn(2, cfg.time_embed_dim, generator=g).to(dtype)).contiguous()
        return (x.to(dtype), mod, t_index * 3 + layout.token_tags, rope)

    return cfg, block, [inputs(0.9, 0.8), inputs(0.3, 0.5)], inputs(0.6, 0.4)


def _calibrated(recipe, dtype):
    cfg, block, calib, held_out = _block(dtype)
    original = copy.deepcopy(block)

    def forward(attn):
        for args in calib:
            block(*args, attn)

    calibration = calibrate([block], recipe, forward if recipe.needs_calibration_data else None, log=lambda m: None)
    return cfg, original, block, calibration, calib, held_out


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_exported_tensors_are_modelopts_amax(name):
    recipe = RECIPES[name]
    _, original, block, calibration, _, _ = _calibrated(recipe, torch.float32)
    tensors, quantizers, amax = calibration.export_block(0), calibration.quantizers(0), calibration.amax(0)
    for linear in BLOCK_LINEARS:
        module = block.get_submodule(linear)
        wq, iq = module.weight_quantizer, module.input_quantizer
        assert wq is quantizers[f"{linear}.weight_quantizer"] and amax[f"{linear}.weight"] == pytest.approx(
            wq.amax.item(), abs=1e-6)  # the manifest rounds to 6 decimals
        # The weight as the algorithm left it: max and percentile never touch it, SmoothQuant and AWQ fold their
        # per-input-channel scales in, so that W' * pre_quant_scale (per column) is the original weight again.
        weight, before = module.weight, original.get_submodule(linear).weight
        assert wq.amax.item() == pytest.approx(weight.abs().max().item(), rel=1e-6)
        if recipe.smooths_inputs:
            pqs = tensors[f"{linear}.pre_quant_scale"]
            assert torch.equal(pqs, iq.pre_quant_scale.reshape(-1)) and pqs.shape == (weight.shape[1],)
            assert not torch.equal(weight, before) and rel(weight * pqs, before) < 1e-5
        else:
            assert torch.equal(weight, before) and f"{linear}.pre_quant_scale" not in tensors
        if recipe.precision == "fp8":
            assert tensors[f"{linear}.input_scale"].item() == pytest.approx(iq.amax.item() / FP8_MAX, rel=1e-6)
            assert tensors[f"{linear}.weight_scale"].item() == pytest.approx(wq.amax.item() / FP8_MAX, rel=1e-6)
            assert torch.equal(tensors[f"{linear}.weight"], quantize_fp8(weight, tensors[f"{linear}.weight_scale"]))
            assert amax[f"{linear}.input"] == pytest.approx(iq.amax.item(), abs=1e-6)
        else:
            assert not iq.is_enabled and f"{linear}.input" not in amax  # weight-only
            assert tensors[f"{linear}.weight_global_scale"].item() == pytest.approx(wq.amax.item() / (6 * FP8_MAX),
                                                                                    rel=1e-6)
    if recipe.calib_algo == "smoothquant":  # alpha 1: every input channel scaled to max 1, so the tensor's max is 1
        assert all(amax[f"{n}.input"] == pytest.approx(1.0, rel=1e-3) for n in BLOCK_LINEARS)
    if recipe.fp8_attention:
        core = block.attn.core if hasattr(block.attn, "core") else calibration.tree.blocks[0].attn.core
        for n in "qkv":
            assert tensors[f"attn.{n}_scale"].item() == pytest.approx(
                getattr(core, f"{n}_bmm_quantizer").amax.item() / FP8_MAX, rel=1e-6)


def test_percentile_clips_below_max_and_max_is_the_running_max():
    _, _, max_block, max_cal, calib, _ = _calibrated(RECIPES["fp8_max"], torch.float32)
    _, _, _, pct_cal, _, _ = _calibrated(RECIPES["fp8_percentile"], torch.float32)
    # ModelOpt's max over the two calibration inputs is the running max |x| entering each linear (what h3trt's own
    # max calibration recorded before ModelOpt took it over).
    seen = collections.defaultdict(float)
    plain = copy.deepcopy(_block(torch.float32)[1])
    hooks = [plain.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: seen.__setitem__(n, max(seen[n], a[0].abs().max().item()))) for n in BLOCK_LINEARS]
    with torch.no_grad():
        for args in calib:
            plain(*args)
    for h in hooks:
        h.remove()
    maxes, pcts = max_cal.amax(0), pct_cal.amax(0)
    for n in BLOCK_LINEARS:
        assert maxes[f"{n}.input"] == pytest.approx(seen[n], abs=1e-6)
        assert pcts[f"{n}.input"] < maxes[f"{n}.input"]  # the 99.99th percentile clips the top
        assert pcts[f"{n}.weight"] == maxes[f"{n}.weight"]  # weights stay max
    assert pct_cal.record["percentile"] == PERCENTILE == 99.99


@pytest.mark.parametrize("dtype, tol, attn_tol", [(torch.float32, 5e-4, 2e-2), (torch.bfloat16, None, None)])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_h3trt_block_reproduces_modelopts_fake_quantized_block(name, dtype, tol, attn_tol):
    from h3trt.build.segments import block_segment

    recipe = RECIPES[name]
    cfg, original, block, calibration, _, held_out = _calibrated(recipe, dtype)
    x = held_out[0]
    with torch.no_grad():
        reference = original(*held_out)
        fake = block(*held_out, attention_core(calibration.tree, 0))  # ModelOpt's fake-quantized block
        ours_block = load_quantized_block(copy.deepcopy(original), cfg, recipe, calibration.export_block(0))
        spec = block_segment(cfg, dtype, recipe)
        weights = {**dict(ours_block.named_parameters()), **dict(ours_block.named_buffers())}
        ours = spec.fn(*held_out[:3], *held_out[3], *[weights[n] for n in spec.weights])
    quant_err = rel(fake - x, reference - x)
    repro_err = rel(ours - x, fake - x)
    limit = attn_tol if recipe.fp8_attention else tol
    if dtype == torch.bfloat16:  # bf16's own rounding of this block's update: the eager block against fp32
        as32 = [t.float() if t.is_floating_point() else t for t in held_out[:3]]
        with torch.no_grad():
            reference32 = copy.deepcopy(original).float()(*as32, tuple(r.float() for r in held_out[3]))
        limit = rel(reference.float() - as32[0], reference32 - as32[0])
        assert 0.02 < limit < 0.2
    assert 0.01 < quant_err < 0.3, f"{name}: quantization moved the block's update by {quant_err:.2e}"
    assert repro_err < limit, f"{name} {dtype}: h3trt vs ModelOpt {repro_err:.2e} (tolerance {limit:.0e})"


@pytest.mark.build  # an ONNX export, as tests/build/test_tensorrt.py's
@pytest.mark.parametrize("name", ["fp8_max", "fp8_smoothquant"])
def test_onnx_qdq_carries_the_scales_of_the_inductor_modules(name, tiny_root, tmp_path):
    """One calibration, both backends: the TRT_FP8QuantizeLinear scales of the exported ONNX block are the
    input_scale / weight_scale of h3trt's modules (bf16 in the graph: compared at bf16 resolution); SmoothQuant's
    pre_quant_scale is a Mul in front of each input quantizer."""
    import onnx
    from onnx import numpy_helper

    from h3trt.build.examples import example_inputs
    from h3trt.build.config import Profile
    from h3trt.build.onnx_export import export_graph, segment_graphs
    from h3trt.models.checkpoint.reader import load_dit

    recipe = RECIPES[name]
    model, _ = load_dit(tiny_root, "t2va", torch.bfloat16)
    examples = example_inputs(model, Profile(160, 96, 5.0).geometry, torch.device("cpu"))
    example = examples["block"][:5]

    def forward(attn):
        x, mod, idx, cos, sin = example
        model.blocks[0](x, mod, idx, (cos, sin), attn)

    calibration = calibrate(model.blocks[:1], recipe, forward, log=lambda m: None)
    tensors = calibration.export_block(0)
    module, spec = segment_graphs(model)["block_0"]
    graph = onnx.load(str(export_graph(module, spec, example, tmp_path / "block_0.onnx")), load_external_data=True)
    values = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    values.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.graph.node
                   if n.op_type == "Constant" and n.attribute and n.attribute[0].type == onnx.AttributeProto.TENSOR})
    scales = [float(np.asarray(values[n.input[1]], dtype=np.float32).reshape(-1)[0])
              for n in graph.graph.node if n.op_type == "TRT_FP8QuantizeLinear" and n.input[1] in values]
    assert len(scales) == 8  # input and weight of the four linears
    want = [tensors[f"{n}.{k}"].item() for n in BLOCK_LINEARS for k in ("input_scale", "weight_scale")]
    bf16 = lambda v: torch.tensor(v).bfloat16().float().item()  # noqa: E731
    assert sorted(bf16(v) for v in want) == pytest.approx(sorted(scales), rel=1e-6)
    mul_constants = [np.asarray(values[i], dtype=np.float32).reshape(-1) for n in graph.graph.node
                     if n.op_type == "Mul" for i in n.input if i in values]
    for linear in BLOCK_LINEARS:
        if recipe.smooths_inputs:  # the same per-channel scale the Inductor module multiplies its input by
            pqs = tensors[f"{linear}.pre_quant_scale"].float().numpy()
            assert any(c.shape == pqs.shape and np.array_equal(c, pqs) for c in mul_constants), linear
    if not recipe.smooths_inputs:
        assert "attn.qkv_proj.pre_quant_scale" not in tensors


def test_modelopt_config_holds_only_what_the_recipe_quantizes():
    cpu = torch.device("cpu")
    config = modelopt_config(RECIPES["fp8_percentile"], cpu)
    names = [e["quantizer_name"] for e in config["quant_cfg"]]
    assert names == ["*", "*weight_quantizer", "*input_quantizer"] and config["algorithm"] == {"method": "max"}
    assert config["quant_cfg"][1]["cfg"]["num_bits"] == (4, 3)  # ModelOpt's FP8_DEFAULT_CFG format
    assert config["quant_cfg"][2]["cfg"]["calibrator"][2] == {"percentile": 99.99}
    nvfp4 = modelopt_config(RECIPES["nvfp4_awq_lite"], cpu)
    assert [e["quantizer_name"] for e in nvfp4["quant_cfg"]] == ["*", "*weight_quantizer"]  # weight-only
    assert nvfp4["quant_cfg"][1]["cfg"]["block_sizes"][-1] == 16 and nvfp4["algorithm"]["method"] == "awq_lite"
    assert "backend" in nvfp4["quant_cfg"][1]["cfg"]  # ModelOpt's NVFP4 export math on the CPU
    assert "backend" not in modelopt_config(RECIPES["nvfp4_awq_lite"], torch.device("cuda"))["quant_cfg"][1]["cfg"]
    trt = modelopt_config(QuantRecipe("nvfp4", fp4_activations=True, calib_steps=2), torch.device("cuda"))
    assert [e["quantizer_name"] for e in trt["quant_cfg"]] == ["*", "*weight_quantizer", "*input_quantizer"]
    excluded = QuantRecipe("fp8", calib_steps=2, exclude_blocks=(1,), exclude_linears=("mlp.fc2",))
    from h3trt.calibration.calibrate import calibration_tree

    cfg, block, _, _ = _block(torch.float32)
    tree = calibration_tree([block, copy.deepcopy(block)], excluded)
    assert sorted(n for n, _ in tree.named_modules() if n.count(".") == 3) == [
        "blocks.0.attn.out_proj", "blocks.0.attn.qkv_proj", "blocks.0.mlp.fc1"]


def test_bad_combinations_are_refused_before_anything_loads(tiny_root, tmp_path, monkeypatch):
    import h3trt.build.builder as builder

    monkeypatch.setattr(builder, "load_dit", lambda *a, **k: pytest.fail("loaded a model"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red fox\n")
    bad = {("fp8", "awq_lite"): "AWQ searches scales for 4-bit block weights",
           ("nvfp4", "smoothquant"): "no activation ranges to clip or smooth",
           ("nvfp4", "percentile"): "no activation ranges to clip or smooth",
           ("fp8", "gptq"): r"it takes max, percentile, smoothquant \(default max\); h3trt drives ModelOpt's"}
    for (precision, algo), message in bad.items():
        with pytest.raises(ValueError, match=message):
            BuildConfig(tiny_root, tmp_path / "b", precision=precision, calib_algo=algo, calib_prompts=prompts)
    with pytest.raises(ValueError, match="apply to --precision fp8/nvfp4, not bf16"):
        BuildConfig(tiny_root, tmp_path / "b", calib_algo="max")
    with pytest.raises(ValueError, match="needs --calib-prompts FILE .* for --calib-algo awq_lite"):
        BuildConfig(tiny_root, tmp_path / "b", precision="nvfp4", calib_algo="awq_lite")
    with pytest.raises(ValueError, match="--fp8-attention is h3trt's FP8 attention op"):
        BuildConfig(tiny_root, tmp_path / "b", precision="fp8", calib_prompts=prompts, fp8_attention=True,
                    backend="tensorrt", device="cpu")
    assert BuildConfig(tiny_root, tmp_path / "b", precision="nvfp4").recipe_for("").calib_steps == 0  # weights only
    # the README's defaults
    assert {p: p.spec.calib_algos[0] for p in QUANT_PRECISIONS} == {"fp8": "max", "nvfp4": "max"}
    # ModelOpt missing, or another release: refused with the fix, before the model loads.
    real = importlib.metadata.version
    uninstalled(monkeypatch, "nvidia-modelopt")
    with pytest.raises(UserError, match=r"pip install 'h3trt\[calibration\]'"):  # one line, exit 2
        BuildConfig(tiny_root, tmp_path / "b", precision="fp8", calib_prompts=prompts)
    monkeypatch.setattr(importlib.metadata, "version", lambda n: "0.99.0" if n == "nvidia-modelopt" else real(n))
    with pytest.raises(UserError, match="written against nvidia-modelopt 0.47.0; found 0.99.0"):
        check_modelopt()
    BuildConfig(tiny_root, tmp_path / "b", precision="bf16")  # bf16 never needs ModelOpt
