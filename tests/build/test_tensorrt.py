"""The TensorRT backend on the CPU, tiny model: ONNX export, onnxruntime parity, TensorRT-RTX plan builds.

What runs here and what cannot:
  - every exported graph, as an FP32 twin, matches its eager segment in onnxruntime at a layout other than the one it
    was exported at (so the dynamic dimensions are real), to a relative error (norm) of 1e-5, compared by polygraphy
    (the tool that compares the plans against onnxruntime on a GPU: tensorrt_notes.md section 5);
  - TensorRT-RTX parses and builds every segment for sm_89 (BF16, FP8) and sm_120 (NVFP4) without a GPU; attention
    is one fused kernel (`_gemm_mha_v2` in the plan's layer list) and the plan's activation memory grows linearly,
    not quadratically, with the sequence length;
  - FP8/NVFP4 blocks are calibrated by h3trt.calibration.calibrate (ModelOpt, here over the build's example; the builder
    runs real trajectories) and exported with ModelOpt's quantizers as Q/DQ (tests/calibration/test_calibration.py
    checks these scales are the Inductor modules');
  - NVFP4: ModelOpt's FP4 fake-quant has no CPU kernel, so here its forward is stubbed out for the export; the
    exported graph (TRT_FP4DynamicQuantize + FP4 weights behind two DequantizeLinear) is the real one, its numbers
    are not checked (that needs a CUDA GPU);
  - no plan executes: TensorRT-RTX needs an RTX-class GPU, and this machine has none. The refusal a GPU that cannot
    run the plans gets is checked as a pure function.
"""

import collections
import ctypes
import sys
import time

import numpy as np
import onnx  # the test extras (pip install -e '.[test]'): a missing one fails here, loudly, instead of skipping
import onnxruntime as ort
import pytest
import tensorrt_rtx as trt
import torch

from h3trt.engines.tensorrt_inspect import bind_polygraphy

# This file's plans are TensorRT-RTX's, and polygraphy binds its TensorRT-reading modules to one flavour as they are
# first imported: bound before any is.
bind_polygraphy("tensorrt_rtx")
from polygraphy.backend.base import BaseRunner  # noqa: E402
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx  # noqa: E402
from polygraphy.common import TensorMetadata  # noqa: E402
from polygraphy.comparator import Comparator, L2CompareFunc  # noqa: E402

from h3trt.build.examples import example_inputs
from h3trt.build.config import Profile
from h3trt.build.onnx_export import export_graph, segment_graphs
from h3trt.build.tensorrt import TrtFlavour, build_plan, build_plans, input_shapes, parse_targets, shape_ranges
from h3trt.engines.manifest import BundleError
from h3trt.engines.tensorrt_runtime import pick_profile, plan_device_problem
from h3trt.models.checkpoint.reader import load_dit
from h3trt.models.config import NUM_MODALITIES
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.precision import Precision
from h3trt.calibration.calibrate import calibrate
from h3trt.calibration.recipe import QuantRecipe

pytestmark = pytest.mark.build  # ONNX export, onnxruntime sessions and TensorRT-RTX plan builds

TINY_PROFILE = Profile(160, 96, 5.0)
# Relative L2 error ||got - want|| / ||want|| an fp32 graph may have against its eager segment, per output. Measured:
# about 1e-7 (max absolute error 1.3e-6 on activations of rms 1).
ORT_REL_TOL = 1e-5
RTX = TrtFlavour("tensorrt_rtx", trt.__version__)


class TorchRunner(BaseRunner):
    """A PyTorch callable as a polygraphy runner, on the CPU (polygraphy's PytRunner moves its inputs to CUDA): called
    with the feeds in `input_metadata` order, its outputs named `output_names`."""

    def __init__(self, fn, input_metadata: TensorMetadata, output_names: list[str], name: str):
        super().__init__(name=name, prefix="torch")
        self.fn, self.input_metadata, self.output_names = fn, input_metadata, list(output_names)

    def get_input_metadata_impl(self):
        return self.input_metadata

    def infer_impl(self, feed_dict):
        start = time.perf_counter()
        with torch.no_grad():
            outputs = self.fn(*(feed_dict[name] for name in self.input_metadata))
        self.inference_time = time.perf_counter() - start
        return collections.OrderedDict(zip(self.output_names, outputs if isinstance(outputs, tuple) else (outputs,)))


def assert_agree(runner, reference: TorchRunner, feeds: dict[str, torch.Tensor], rel_tol: float = ORT_REL_TOL) -> dict:
    """Runs `runner` and `reference` on `feeds` through polygraphy's Comparator; every output must have the same shape
    and a relative L2 error of at most `rel_tol` (polygraphy's L2 distance against rel_tol x the reference output's
    norm). A failure names each output that missed with its relative, max absolute and max relative errors. Returns
    the reference's outputs."""
    results = Comparator.run([runner, reference], data_loader=[feeds])
    got, want = results[runner.name][0], results[reference.name][0]
    norms = {name: float(torch.linalg.vector_norm(out.double())) for name, out in want.items()}
    accuracy = Comparator.compare_accuracy(results, compare_func=L2CompareFunc(
        l2_threshold={name: rel_tol * norm for name, norm in norms.items()}))
    if not accuracy:
        missed = []
        for output, result in accuracy[0][(runner.name, reference.name)][0].items():
            if result:
                continue
            g, w = got[output].double(), want[output].double()
            if g.shape != w.shape:  # polygraphy compares no values across shapes
                missed.append(f"{output}: shape {tuple(g.shape)}, want {tuple(w.shape)}")
                continue
            diff = (g - w).abs()
            missed.append(f"{output}: relative error {result.l2_norm / norms[output]:.2e} > {rel_tol:.0e} (max abs "
                          f"{diff.max().item():.2e}, max rel {(diff / w.abs().clamp_min(1e-30)).max().item():.2e})")
        pytest.fail(f"{runner.name} vs {reference.name}: " + "; ".join(missed))
    return want


def assert_graph_matches(path, eager, feeds: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The ONNX graph at `path` in onnxruntime against `eager` (the eager segment, called with the feeds in order) by
    assert_agree. Returns the eager outputs, in the graph's output order."""
    outputs = [o.name for o in onnx.load(str(path), load_external_data=False).graph.output]
    reference = TorchRunner(eager, TensorMetadata().from_feed_dict(feeds), outputs, f"eager {path.stem}")
    want = assert_agree(OnnxrtRunner(SessionFromOnnx(str(path)), name=f"onnxruntime {path.stem}"), reference, feeds)
    return tuple(want[name] for name in outputs)


@pytest.fixture(scope="module")
def fp32_graphs(tmp_path_factory, tiny_root):
    model, _ = load_dit(tiny_root, "t2va", torch.float32)
    examples = example_inputs(model, TINY_PROFILE.geometry, torch.device("cpu"))
    out = tmp_path_factory.mktemp("onnx_fp32")
    paths = {}
    for name, (module, spec) in segment_graphs(model).items():
        example = examples["block" if name.startswith("block_") else name][:len(spec.inputs)]
        paths[name] = export_graph(module, spec, example, out / f"{name}.onnx")
    return model, paths


def _other_layout_inputs(model):
    """Another request than the export example: 11 text rows, both keyframes, another frame count, t=(0.6, 0.3)."""
    cfg = model.cfg
    layout = pack_t2va(text_tags_for(11, [range(2, 5)]), 7, 6, 10, 23, cfg.patch_size, ("first", "last"))
    g = torch.Generator().manual_seed(1)
    video = torch.randn(1, layout.video_index.numel(), cfg.video_patch_dim, generator=g)
    audio = torch.randn(1, layout.audio_index.numel(), cfg.audio_in_channels, generator=g)
    text = torch.randn(1, layout.text_index.numel(), cfg.text_dim, generator=g)
    unique_t, t_index = row_timesteps(layout, 0.6, 0.3)
    return layout, video, audio, text, unique_t, t_index


def test_onnx_fp32_twin_matches_eager_segments_in_onnxruntime(fp32_graphs):
    model, paths = fp32_graphs
    layout, video, audio, text, unique_t, t_index = _other_layout_inputs(model)
    assert unique_t.numel() == 3  # video t, audio t, condition rows: T differs from nothing the export fixed
    # embed: the eager DiT's embed
    x, temb = assert_graph_matches(
        paths["embed"],
        lambda video, audio, text, timesteps, video_index, audio_index, text_index, token_tags: model.embed(
            video, audio, text, timesteps, video_index, audio_index, text_index, token_tags.shape[0]),
        dict(video=video, audio=audio, text=text, timesteps=unique_t, video_index=layout.video_index,
             audio_index=layout.audio_index, text_index=layout.text_index, token_tags=layout.token_tags))
    # every layer: the eager block with SDPA, on the eager output of the one before
    with torch.no_grad():
        cos, sin = model.rope(layout.position_ids)
        adaln_index = t_index * NUM_MODALITIES + layout.token_tags
        for i, block in enumerate(model.blocks):
            (x,) = assert_graph_matches(
                paths[f"block_{i}"], lambda x, mod, adaln_index, cos, sin: block(x, mod, adaln_index, (cos, sin)),
                dict(x=x, mod=block.modulation(temb).contiguous(), adaln_index=adaln_index, cos=cos, sin=sin))
        mod = model.final_layer.modulation(temb).contiguous()
    # final: both heads (their shapes included)
    assert_graph_matches(paths["final"], model.final_layer, dict(x=x, mod=mod, timestep_index=t_index,
                                                                 video_index=layout.video_index,
                                                                 audio_index=layout.audio_index))


def test_onnx_graphs_are_export_friendly(fp32_graphs):
    """No aten RMSNorm, no SDPA op: MatMul-Softmax-MatMul per attention; every tensor in one external data file."""
    _, paths = fp32_graphs
    for name, path in paths.items():
        model = onnx.load(str(path), load_external_data=False)
        ops = collections.Counter(n.op_type for n in model.graph.node)
        assert "RMSNormalization" not in ops and "Attention" not in ops
        attention_layers = 2 if name == "embed" else (1 if name.startswith("block_") else 0)  # tiny: 2 refiner blocks
        assert ops["Softmax"] == attention_layers, f"{name}: {ops['Softmax']} Softmax"
        assert path.with_name(path.name + ".data").is_file()
        assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer if t.dims and
                   np.prod(t.dims) * 4 > 1024)


@pytest.fixture(scope="module")
def bf16_model(tiny_root):
    model, _ = load_dit(tiny_root, "t2va", torch.bfloat16)
    return model, example_inputs(model, TINY_PROFILE.geometry, torch.device("cpu"))


def _calibrated_model(tiny_root, precision: str):
    """A fresh bf16 tiny DiT whose blocks ModelOpt calibrated (max) on the build's example: what the builder hands
    build_plans, without the trajectories."""
    model, _ = load_dit(tiny_root, "t2va", torch.bfloat16)
    examples = example_inputs(model, TINY_PROFILE.geometry, torch.device("cpu"))
    x, mod, adaln_index, cos, sin = examples["block"][:5]

    def forward(attn):
        h = x
        for block in model.blocks:
            h = block(h, mod, adaln_index, (cos, sin), attn)

    # NVFP4 as TensorRT runs it: FP4 activations too, their global range calibrated like FP8's.
    recipe = QuantRecipe(precision, calib_steps=2, fp4_activations=precision == "nvfp4")
    calibrate(model.blocks, recipe, forward, log=lambda m: None)
    return model, examples


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP8])
def test_rtx_builds_every_segment_for_sm89(precision, bf16_model, tiny_root, tmp_path):
    model, examples = bf16_model if precision == "bf16" else _calibrated_model(tiny_root, precision)
    logs = []
    entries = build_plans(model, examples, [TINY_PROFILE.geometry, Profile(192, 96, 5.0).geometry], precision,
                          ("sm89",), RTX, tmp_path, logs.append)
    assert sorted(entries) == ["block_0", "block_1", "embed", "final"]
    for name, entry in entries.items():
        assert (tmp_path / entry["artifact"]).stat().st_size == entry["plan_bytes"] > 0
        assert len(entry["profiles"]) == 2  # one optimization profile per bundle profile
        if name != "final":  # the final layer has no attention
            assert entry["fused_attention"], f"{name}: attention is not one fused kernel"
        quantized = name.startswith("block_") and precision != "bf16"
        assert entry["quantized"] == (precision if quantized else None)
        assert ("FP8" in entry["gemm_types"]) == quantized, f"{name}: GEMMs read {entry['gemm_types']}"
    assert len(logs) == 4


def test_fp8_graph_has_modelopt_qdq_and_is_refused_for_ampere(bf16_model, tiny_root, tmp_path):
    model, examples = bf16_model
    module, spec = segment_graphs(model)["block_0"]
    example = examples["block"][:5]
    quantized, _ = segment_graphs(_calibrated_model(tiny_root, "fp8")[0])["block_0"]
    path = export_graph(quantized, spec, example, tmp_path / "block_0.onnx")
    ops = collections.Counter((n.domain, n.op_type) for n in onnx.load(str(path), load_external_data=False).graph.node)
    # 4 linears: input + weight Q/DQ each
    assert ops[("trt", "TRT_FP8QuantizeLinear")] == 8 and ops[("trt", "TRT_FP8DequantizeLinear")] == 8
    shapes = [input_shapes(spec, example, shape_ranges(model.cfg, TINY_PROFILE.geometry))]
    with pytest.raises(RuntimeError, match="fp8"):
        build_plan(RTX, path, tmp_path / "block_0.plan", shapes, ("sm86",))
    with torch.no_grad():  # the fake-quantized block stays close to the bf16 one
        want = module(*example).float()
        err = ((quantized(*example).float() - want).norm() / want.norm()).item()
    assert err < 5e-2, f"FP8 block relative error {err:.2e}"


def test_nvfp4_graph_builds_for_sm120_only(tiny_root, tmp_path, monkeypatch):
    import modelopt.torch.quantization.tensor_quant as tensor_quant

    # CPU only: ModelOpt's FP4 fake-quant kernel needs CUDA; the graph comes from the op's ONNX symbolic regardless.
    monkeypatch.setattr(tensor_quant, "_dynamic_block_quantize_forward", lambda ctx, x, *a, **k: x)
    model, examples = _calibrated_model(tiny_root, "nvfp4")
    quantized, spec = segment_graphs(model)["block_1"]
    example = examples["block"][:5]
    path = export_graph(quantized, spec, example, tmp_path / "block_1.onnx", nvfp4=True)
    ops = collections.Counter((n.domain, n.op_type) for n in onnx.load(str(path), load_external_data=False).graph.node)
    assert ops[("trt", "TRT_FP4DynamicQuantize")] == 4 and ops[("", "DequantizeLinear")] == 16
    shapes = [input_shapes(spec, example, shape_ranges(model.cfg, TINY_PROFILE.geometry))]
    report = build_plan(RTX, path, tmp_path / "block_1.plan", shapes, ("sm120",))
    assert report["fused_attention"] and report["plan_bytes"] > 0
    assert "FP4E2M1" in report["gemm_types"], report["gemm_types"]  # FP4 GEMMs (their block scales are FP8)
    with pytest.raises(RuntimeError, match="fp4"):
        build_plan(RTX, path, tmp_path / "sm89.plan", shapes, ("sm89",))


def test_fused_attention_memory_is_linear_in_sequence_length(bf16_model, tmp_path):
    """Unfused, one layer's scores at S rows are heads x S^2 bf16 values: 1 GiB at S = 16384 for the tiny model's 2
    heads. The plan's activation memory must stay far below that and grow ~linearly (4x rows -> < 8x, not 16x)."""
    model, examples = bf16_model
    graphs = segment_graphs(model)
    module, spec = graphs["block_0"]
    example = examples["block"][:5]
    path = export_graph(module, spec, example, tmp_path / "block_0.onnx")
    ranges = shape_ranges(model.cfg, TINY_PROFILE.geometry)
    activation = {}
    for rows in (4096, 16384):
        r = dict(ranges, S=(rows // 2, rows, rows))
        activation[rows] = build_plan(RTX, path, tmp_path / f"{rows}.plan", [input_shapes(spec, example, r)],
                                      ("sm89",))["activation_bytes"]
    scores_16k = model.cfg.num_heads * 16384 ** 2 * 2
    assert activation[16384] < scores_16k / 10, activation
    assert activation[16384] < 8 * activation[4096], activation


def test_parse_targets_and_shape_ranges(tiny_cfg):
    assert parse_targets(None, Precision.NVFP4, RTX) == ("sm120",)
    assert parse_targets("sm_89, sm120", Precision.FP8, RTX) == ("sm89", "sm120")
    with pytest.raises(ValueError, match="sm90"):
        parse_targets("sm90", Precision.BF16, RTX)
    with pytest.raises(ValueError, match="nvfp4 cannot be built for sm89"):
        parse_targets("sm89,sm120", Precision.NVFP4, RTX)
    geo = TINY_PROFILE.geometry
    r = shape_ranges(tiny_cfg, geo)
    rows_per_frame = (geo.latent_height // 2) * (geo.latent_width // 2)
    assert r["V"] == tuple(geo.latent_frames * rows_per_frame + k * rows_per_frame for k in (0, 1, 2))
    assert r["S"][2] == r["L"][2] + r["V"][2] + r["A"][2] and r["M"] == (3, 6, 9)


def test_pick_profile_and_gpu_refusals():
    profiles = [{"x": [[1, 10, 4], [1, 20, 4], [1, 30, 4]]}, {"x": [[1, 31, 4], [1, 40, 4], [1, 50, 4]]}]
    assert pick_profile(profiles, {"x": (1, 30, 4)}, "block_0") == 0
    assert pick_profile(profiles, {"x": (1, 45, 4)}, "block_0") == 1
    with pytest.raises(BundleError, match=r"no optimization profile .*Rebuild with a --canvas"):
        pick_profile(profiles, {"x": (1, 60, 4)}, "block_0")
    info = {"flavour": "tensorrt_rtx", "version": "1.7.1.116", "targets": ["sm89", "sm120"]}
    installed = {"tensorrt_rtx": "1.7.1.116"}
    h200 = plan_device_problem(info, "NVIDIA H200", (9, 0), installed)
    assert "NVIDIA H200" in h200 and "9.0" in h200 and "sm89, sm120" in h200 and "full-TensorRT" in h200
    ampere = plan_device_problem(info, "NVIDIA RTX A6000", (8, 6), installed)
    assert "8.6" in ampere and "--trt-targets sm86" in ampere
    assert "has none" in plan_device_problem(info, None, None, installed)
    assert "install tensorrt_rtx==1.7.1.116" in plan_device_problem(info, "NVIDIA GeForce RTX 5090", (12, 0),
                                                                     {"tensorrt_rtx": "1.8.0"})
    assert plan_device_problem(info, "NVIDIA GeForce RTX 4090", (8, 9), installed) is None


@pytest.fixture(scope="module")
def fp8_trt_bundle(tiny_cache, tmp_path_factory):
    """`h3trt build --backend tensorrt`: an FP8 bundle of the tiny model for sm89 + sm120 with two profiles."""
    from h3trt.cli import main

    root = tmp_path_factory.mktemp("trt_bundle")
    prompts = root / "prompts.txt"
    prompts.write_text("a red fox runs through fresh snow\n")
    assert main(["build", "--model", "tiny", "--output", str(root / "trt"), "--backend", "tensorrt", "--precision",
                 "fp8", "--trt-targets", "sm89,sm120", "--device", "cpu", "--profile", "160x96x5", "--profile",
                 "192x96x5", "--calib-prompts", str(prompts), "--calib-steps", "2"]) == 0
    return root / "trt"


def test_h3trt_build_tensorrt_bundle(fp8_trt_bundle, tmp_path, capsys):
    """The CLI end to end: the manifest records flavour, version and targets; every file hashes; serving the bundle on
    this GPU-less machine is refused naming the plans' targets."""
    from h3trt.cli import main
    from h3trt.engines.bundle import Engine
    from h3trt.engines.manifest import read_manifest

    out = fp8_trt_bundle
    manifest = read_manifest(out)
    quant = manifest.quant  # calibrated through ModelOpt on a trajectory, as the Inductor bundles are
    assert quant["calib_algo"] == "max" and quant["modelopt"]["version"] == "0.47.0" and quant["calib_prompts"] == 1
    assert quant["execution"].startswith("TensorRT FP8 GEMMs") and set(quant["amax"]) == {"blocks.0", "blocks.1"}
    assert manifest.tensorrt["flavour"] == "tensorrt_rtx" and manifest.tensorrt["version"] == trt.__version__
    assert manifest.tensorrt["targets"] == ["sm89", "sm120"] and manifest.device == "cuda"
    assert sorted(manifest.segments) == ["block_0", "block_1", "embed", "final"]
    assert all(len(e["profiles"]) == 2 for e in manifest.segments.values())
    assert all(e["fused_attention"] for n, e in manifest.segments.items() if n != "final")
    assert [e["quantized"] for e in manifest.segments.values()] == [None, "fp8", "fp8", None]
    assert not (out / "weights" / "blocks.safetensors").exists()  # the plans embed the weights
    assert main(["verify", str(out)]) == 0
    with pytest.raises(BundleError, match=r"tensorrt_rtx .* plans for sm89, sm120.*has none"):
        Engine.load(out, "cpu")
    capsys.readouterr()
    assert main(["build", "--model", "tiny", "--output", str(tmp_path / "x"), "--backend", "tensorrt",
                 "--trt-targets", "sm90"]) == 2
    assert "Hopper (sm90)" in capsys.readouterr().err


def test_inspect_shows_graphs_and_plans_through_polygraphy(fp8_trt_bundle, fp32_graphs, tmp_path, monkeypatch,
                                                           capsys):
    """What `h3trt inspect` adds for a tensorrt bundle: polygraphy's view of its ONNX graphs (a graph is copied in:
    the builder keeps none) and of its plans, which on this GPU-less machine is one plain sentence saying polygraphy
    could not load them and why. Nothing of polygraphy's log reaches stdout (inspect prints JSON there)."""
    import dataclasses
    import json
    import shutil

    import polygraphy

    from h3trt.engines.manifest import read_manifest
    from h3trt.engines.tensorrt_inspect import inspect_trt_bundle

    model, paths = fp32_graphs
    root = tmp_path / "bundle"
    shutil.copytree(fp8_trt_bundle, root)
    for src in (paths["block_0"], paths["block_0"].with_name("block_0.onnx.data")):
        shutil.copy(src, root / "segments" / src.name)
    manifest = read_manifest(root)
    manifest = dataclasses.replace(manifest, files={**manifest.files, "segments/block_0.onnx": None})
    capsys.readouterr()
    view = inspect_trt_bundle(root, manifest)
    assert capsys.readouterr().out == ""
    json.dumps(view)  # printed within inspect's JSON
    assert view["version"] == polygraphy.__version__
    graph = onnx.load(str(paths["block_0"]), load_external_data=False)
    shown = view["onnx"]["segments/block_0.onnx"]
    assert list(view["onnx"]) == ["segments/block_0.onnx"] and list(shown["inputs"]) == segment_graphs(model)[
        "block_0"][1].inputs and list(shown["outputs"]) == ["x_out"]
    h = model.cfg.hidden_size
    assert shown["inputs"]["x"] == f"float32 (1, 'S', {h})" and shown["inputs"]["mod"] == f"float32 ('M', 6, {h})"
    assert shown["inputs"]["adaln_index"] == "int64 ('S',)" and shown["outputs"]["x_out"].endswith(f"'S', {h})")
    assert (shown["opset"], shown["nodes"], shown["initializers"]) == (20, len(graph.graph.node),
                                                                       len(graph.graph.initializer))
    plans = view["plans"]
    assert plans.startswith(f"polygraphy could not load segments/embed.plan with tensorrt_rtx {trt.__version__}, so "
                            "none of the 4 plans is shown: Could not deserialize engine (")
    assert "plans for sm89, sm120; TensorRT plans run on a CUDA GPU and this process has none" in plans
    # Other bundles have nothing to show; without polygraphy the view says how to get it.
    assert inspect_trt_bundle(root, dataclasses.replace(manifest, backend="inductor", files={})) is None
    monkeypatch.setitem(sys.modules, "polygraphy", None)
    assert inspect_trt_bundle(root, manifest) == ("not installed: `pip install polygraphy==0.53.6` shows this "
                                                  "bundle's 1 ONNX graph(s) and 4 plan(s)")


def test_plan_view_reads_a_loaded_plan_through_polygraphy(fp8_trt_bundle, monkeypatch):
    """Where a plan loads (an RTX-class GPU of its targets; none here), its view is what polygraphy reads from the
    engine: checked on a stand-in engine with block_0's inputs, outputs and dynamic dimensions."""
    import types

    from h3trt.engines.manifest import read_manifest
    from polygraphy.backend.trt import loader

    from h3trt.engines.tensorrt_inspect import plan_view

    entry = read_manifest(fp8_trt_bundle).segments["block_0"]
    box = entry["profiles"][0]  # dynamic where min != max: -1, as a plan reports it
    shapes = {n: tuple(lo if lo == hi else -1 for lo, hi in zip(box[n][0], box[n][2])) for n in entry["inputs"]}
    shapes["x_out"] = shapes["x"]

    class Engine:
        num_layers, num_optimization_profiles, names = 42, 2, entry["inputs"] + entry["outputs"]
        num_io_tensors = len(names)

        def get_tensor_name(self, index):
            return self.names[index]

        def get_tensor_mode(self, name):
            return trt.TensorIOMode.INPUT if name in entry["inputs"] else trt.TensorIOMode.OUTPUT

        def get_tensor_dtype(self, name):
            return trt.DataType.INT64 if name == "adaln_index" else trt.DataType.BF16

        def get_tensor_shape(self, name):
            return shapes[name]

        def get_tensor_format(self, name, profile):
            return trt.TensorFormat.LINEAR

        def create_execution_context(self):
            return types.SimpleNamespace(active_optimization_profile=0)

    monkeypatch.setattr(loader, "EngineFromBytes", lambda data: lambda: Engine())
    h = read_manifest(fp8_trt_bundle).model_config.hidden_size
    view = plan_view(fp8_trt_bundle / "segments" / "block_0.plan", "tensorrt_rtx")
    assert view["inputs"]["x"] == f"bfloat16 (1, -1, {h})" and view["inputs"]["adaln_index"] == "int64 (-1,)"
    assert list(view["inputs"]) == entry["inputs"] and view["outputs"] == {"x_out": f"bfloat16 (1, -1, {h})"}
    assert (view["layers"], view["profiles"]) == (42, 2)
    with pytest.raises(RuntimeError, match="loaded for tensorrt_rtx earlier in this process"):
        bind_polygraphy("tensorrt")  # the full TensorRT's plans: not in a process bound to TensorRT-RTX


class _OrtAsTensorRT:
    """A stand-in for the `tensorrt_rtx` runtime API TrtSegment uses, executing the ONNX graph in onnxruntime through
    the same raw device addresses (here host pointers). It checks the wrapper's plumbing: profile choice, input
    dtypes and shapes, output allocation and order, and TrtDiT's wiring of embed / layers / final / AdaLN / RoPE."""

    class DataType:
        FLOAT, HALF, BF16, INT64, INT32, BOOL = "float32", "float16", "bfloat16", "int64", "int32", "bool"

    class Logger:
        WARNING = 0

        def __init__(self, level):
            pass

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, plan: bytes):
            return _OrtAsTensorRT.Engine(plan.decode())

    class Engine:
        def __init__(self, onnx_path: str):
            self.session = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
            types = {"tensor(float)": "float32", "tensor(int64)": "int64"}
            self.dtypes = {t.name: types[t.type] for t in self.session.get_inputs() + self.session.get_outputs()}

        def get_tensor_dtype(self, name):
            return self.dtypes[name]

        def create_runtime_config(self):
            return None

        def create_execution_context(self, runtime_config=None):
            return _OrtAsTensorRT.Context(self)

    class Context:
        def __init__(self, engine):
            self.engine, self.shapes, self.addresses, self.results, self.profiles = engine, {}, {}, None, []

        def set_optimization_profile_async(self, index, stream):
            self.profiles.append(index)

        def set_input_shape(self, name, shape):
            self.shapes[name], self.results = tuple(shape), None

        def set_tensor_address(self, name, address):
            self.addresses[name] = address

        def _read(self, name):
            dtype = np.dtype(self.engine.dtypes[name])
            count = int(np.prod(self.shapes[name]))
            buffer = (ctypes.c_char * (count * dtype.itemsize)).from_address(self.addresses[name])
            return np.frombuffer(buffer, dtype=dtype).reshape(self.shapes[name]).copy()

        def _run(self):
            if self.results is None:
                feeds = {i.name: self._read(i.name) for i in self.engine.session.get_inputs()}
                outputs = self.engine.session.run(None, feeds)
                self.results = dict(zip([o.name for o in self.engine.session.get_outputs()], outputs))
            return self.results

        def get_tensor_shape(self, name):
            return self._run()[name].shape

        def execute_async_v3(self, stream):
            for name, value in self._run().items():
                value = np.ascontiguousarray(value)
                ctypes.memmove(self.addresses[name], value.ctypes.data, value.nbytes)
            return True


@pytest.mark.parametrize("adaln", ["baked", "live"])
def test_trt_dit_runs_the_segment_interface_like_eager(adaln, fp32_graphs):
    """TrtDiT over TrtSegments (onnxruntime standing in for the plans' executor) equals the eager DiT."""
    from h3trt.build.adaln import bake_tables
    from h3trt.engines.adaln import BakedAdaLN, LiveAdaLN
    from h3trt.engines.tensorrt_runtime import TrtDiT, TrtSegment
    from h3trt.models.dit import EagerDiT

    model, paths = fp32_graphs
    cfg, cpu = model.cfg, torch.device("cpu")
    geometry = TINY_PROFILE.geometry
    segments = {}
    for name, (_, spec) in segment_graphs(model).items():
        ranges = dict(shape_ranges(cfg, geometry), L=(1, 16, 64))
        example = example_inputs(model, geometry, cpu)["block" if name.startswith("block_") else name]
        entry = {"name": name, "artifact": f"{name}.plan", "inputs": spec.inputs,
                 "outputs": [f"{o}_out" if o in spec.inputs else o for o in spec.outputs],
                 "profiles": [{k: [list(s) for s in v] for k, v in input_shapes(spec, example, ranges).items()}]}
        segments[name] = TrtSegment(_OrtAsTensorRT, str(paths[name]).encode(), entry, cpu, "tensorrt_rtx")
    sd = model.state_dict()
    layout = pack_t2va(text_tags_for(13), geometry.latent_frames, geometry.latent_height, geometry.latent_width,
                       geometry.audio_latents, cfg.patch_size, ("first",))
    tv, ta = 0.6, 0.3
    if adaln == "baked":
        schedule_values = torch.tensor(sorted({tv, ta, 0.999, 1.0}), dtype=torch.float32)
        modulation = BakedAdaLN(bake_tables(model, schedule_values), cpu)
    else:
        weights = {**{f"blocks.{i}.{p}": sd[f"blocks.{i}.adaln_proj.linear.{p}"] for i in range(cfg.num_layers)
                      for p in ("weight", "bias")},
                   **{f"final.{p}": sd[f"final_layer.adaln_proj.linear.{p}"] for p in ("weight", "bias")}}
        modulation = LiveAdaLN(weights, cfg.num_layers, cfg.hidden_size, cpu)
    dit = TrtDiT(cfg, segments, modulation, cpu)
    g = torch.Generator().manual_seed(3)
    video = torch.randn(1, layout.video_index.numel(), cfg.video_patch_dim, generator=g)
    audio = torch.randn(1, layout.audio_index.numel(), cfg.audio_in_channels, generator=g)
    text = torch.randn(1, layout.text_index.numel(), cfg.text_dim, generator=g)
    unique_t, t_index = row_timesteps(layout, tv, ta)
    feeds = dict(video=video, audio=audio, text=text, unique_t=unique_t, t_index=t_index)
    meta = TensorMetadata().from_feed_dict(feeds)
    eager = EagerDiT(model)
    assert_agree(TorchRunner(lambda *x: dit(*x, layout), meta, ["video", "audio"], f"TrtDiT {adaln}"),
                 TorchRunner(lambda *x: eager(*x, layout), meta, ["video", "audio"], "EagerDiT"), feeds)
    with pytest.raises(BundleError, match="no optimization profile"):  # 65 text rows: past this test's L range
        long = pack_t2va(text_tags_for(65), geometry.latent_frames, geometry.latent_height, geometry.latent_width,
                         geometry.audio_latents, cfg.patch_size)
        dit(torch.randn(1, long.video_index.numel(), cfg.video_patch_dim), audio,
            torch.randn(1, 65, cfg.text_dim), *row_timesteps(long, tv, ta), long)
