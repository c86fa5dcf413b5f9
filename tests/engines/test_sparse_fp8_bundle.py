"""An fp8 bundle with FP8 attention that serves block-sparse attention: the build records the FP8 sparse kernel it
chose (a CPU build: fp8_emulated; build/sparse_choice.py), the load honours the record (kernel and tile), and a
sparse evaluation runs each layer's FP8 sparse attention with that layer's calibrated q/k/v scales between the
halves; built with --lora-slots too, a sparse evaluation with an adapter runs it through the halves' twins with
adapters around the same FP8 sparse attention.

Tolerance: the sparse evaluation with FP8 sparse attention against the same evaluation with the bf16 masked
reference over the same routed blocks (the kernel swapped on the loaded engine): the FP8 error of q/k/v's e4m3
rounding (tests/calibration/test_fp8_attention.py bounds the dense op at 8% of the attention), diluted through the
block's residual stream: measured 0.4%, bounded at 3%, and above 0 (the FP8 path ran); with an adapter at 0.7 measured
1.1%, while the adapter moves the output by 19%.
"""

import dataclasses
import json
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

from h3trt.engines import bundle as bundle_module
from h3trt.engines.bundle import Engine, bundle_sparse_kernel
from h3trt.engines.caps import bundle_caps
from h3trt.engines.guard import no_compile
from h3trt.models.sparse import run as sparse_run
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.runner import EvalExtras
from h3trt.models.sampler import Schedule
from h3trt.models.sparse.plan import SparseSettings
from h3trt.models.sparse.run import SparseRun
from h3trt.pipeline.h3_pipeline import H3Pipeline
from h3trt.request.request import Speed

from helpers import BUNDLE_STEPS, dit_inputs

SPARSE_FLAGS = ("--sparse-attention", "0.75", "--sparse-dense-steps", "2", "--sparse-min-seq", "1")
FP8_VS_BF16_TOL = 3e-2


@pytest.fixture(scope="module")
def fp8_sparse_bundle(tmp_path_factory, tiny_root):
    """`h3trt build --precision fp8 --fp8-attention --sparse-attention 0.75 --lora-slots 1 --lora-max-rank 4` of the
    tiny model on the CPU (calibrated on two prompts), in its own process (the slots change nothing of an evaluation
    without adapters: test_sparse_lora_bundle.py)."""
    root = tmp_path_factory.mktemp("fp8sparse")
    (root / "prompts.txt").write_text("a red fox runs through fresh snow\nwaves break on a rocky shore\n")
    out = root / "bundle"
    proc = subprocess.run([sys.executable, "-m", "h3trt.cli", "build", "--model", "tiny", "--output", str(out),
                           "--precision", "fp8", "--calib-prompts", str(root / "prompts.txt"), "--calib-steps", "3",
                           "--device", "cpu", "--fp8-attention", "--profile", "160x96x5", "--steps",
                           str(BUNDLE_STEPS), *SPARSE_FLAGS, "--lora-slots", "1", "--lora-max-rank", "4"],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sparse attention fp8_emulated (default sparsity 0.75)" in proc.stdout, proc.stdout
    return out


def test_the_build_records_the_fp8_kernel_it_chose(fp8_sparse_bundle):
    sparse = json.loads((fp8_sparse_bundle / "manifest.json").read_text())["sparse"]
    assert (sparse["kernel"], sparse["block"], sparse["tile"], sparse["requested"]) == ("fp8_emulated", 64, None,
                                                                                      "auto")
    assert sparse["measured_ms"] == {}  # a CPU build times nothing


def sparse_evaluation(engine, seed=1, lora=None):
    """One sparse evaluation of the engine's DiT on the tiny model's layout, with the adapters `lora` (a AdapterRun) or
    none; (outputs, the SparseRun)."""
    cfg = engine.dit.cfg
    layout = pack_t2va(text_tags_for(11), 37, 6, 10, 207)
    video, audio, text = dit_inputs(layout, cfg, seed=seed)
    text = text.to(torch.bfloat16)  # an fp8 bundle's text rows arrive in its compute dtype
    unique_t, t_index = row_timesteps(layout, *Schedule(BUNDLE_STEPS).timesteps()[3])  # a baked step
    run = SparseRun(SparseSettings(0.75, dense_steps=0, min_seq=1), engine.dit.caps.sparse_kernel)
    run.next_evaluation()
    with torch.no_grad(), no_compile():
        out = engine.dit(video, audio, text, unique_t, t_index, layout, EvalExtras(sparse=run, adapters=lora))
    return out, run


def test_a_sparse_evaluation_runs_fp8_sparse_attention_with_each_layers_scales(fp8_sparse_bundle, monkeypatch):
    engine = Engine.load(fp8_sparse_bundle, "cpu")
    assert engine.dit.caps.sparse_kernel == "fp8_emulated"
    blocks = load_file(str(fp8_sparse_bundle / "weights" / "blocks.safetensors"))
    layers = engine.dit.cfg.num_layers
    want = [tuple(blocks[f"blocks.{i}.attn.{n}"].item() for n in ("q_scale", "k_scale", "v_scale"))
            for i in range(layers)]
    assert len(set(want)) == layers  # the layers' calibrated scales differ: a wrong layer's would show
    seen = []
    real = sparse_run.fp8_sparse_attention

    def spy(q, k, v, scales, *args):
        seen.append(tuple(s.item() for s in scales))
        return real(q, k, v, scales, *args)

    monkeypatch.setattr(sparse_run, "fp8_sparse_attention", spy)
    fp8_out, run = sparse_evaluation(engine)
    assert seen == want and 0 < run.report()["kept_fraction"] < 1
    # The same evaluation with the bf16 masked reference over the same blocks: FP8's rounding apart.
    engine.dit.caps, engine.dit.sparse_scales = dataclasses.replace(engine.dit.caps, sparse_kernel="reference"), None
    bf16_out, _ = sparse_evaluation(engine)
    errors = [((a - b).norm() / b.norm()).item() for a, b in zip(fp8_out, bf16_out)]
    assert 0 < max(errors) < FP8_VS_BF16_TOL, errors


def test_an_adapter_runs_through_the_halves_twins_around_the_fp8_sparse_attention(fp8_sparse_bundle, monkeypatch,
                                                                                   tmp_path):
    from lora_cases import fmt_original, tiny_factors, write

    from h3trt.adapters.resident import ResidentAdapters
    from h3trt.adapters.spec import AdapterSpec
    from h3trt.adapters.use import AdapterUse

    engine = Engine.load(fp8_sparse_bundle, "cpu")
    m = engine.manifest
    adapter = write(tmp_path / "a.safetensors", fmt_original(tiny_factors(1)))
    side = ResidentAdapters((AdapterSpec("a", adapter, 0.7),), m.model_config, m.task, torch.bfloat16,
                            torch.device("cpu"), slots=engine.dit.lora_slots)
    lora = side.select((AdapterUse("a"),))
    seen, calls = [], []
    real = sparse_run.fp8_sparse_attention
    monkeypatch.setattr(sparse_run, "fp8_sparse_attention", lambda q, k, v, scales, *a: (seen.append(scales),
                                                                                         real(q, k, v, scales, *a))[1])
    for name in ("block_pre_lora", "block_post_lora"):
        segment = engine.dit.segments[name]
        engine.dit.segments[name] = lambda *a, _s=segment, _n=name: (calls.append(_n), _s(*a))[1]
    adapted, run = sparse_evaluation(engine, lora=lora)
    layers = m.model_config.num_layers
    assert len(seen) == layers and sorted(set(calls)) == ["block_post_lora", "block_pre_lora"]
    assert len(calls) == 2 * layers and 0 < run.report()["kept_fraction"] < 1
    plain, _ = sparse_evaluation(engine)
    # The same evaluation with the bf16 masked reference over the same blocks: FP8's rounding apart.
    engine.dit.caps, engine.dit.sparse_scales = dataclasses.replace(engine.dit.caps, sparse_kernel="reference"), None
    bf16, _ = sparse_evaluation(engine, lora=lora)
    for a, b, p in zip(adapted, bf16, plain):
        err = ((a - b).norm() / b.norm()).item()
        assert 0 < err < FP8_VS_BF16_TOL and ((a - p).norm() / p.norm()).item() > 3 * FP8_VS_BF16_TOL


def test_a_served_clip_is_fp8_sparse_and_its_record_names_the_kernel(fp8_sparse_bundle, tmp_path, tiny_cache):
    from h3trt.cli import main

    out = tmp_path / "clip.mp4"
    assert main(["run", "--engine", str(fp8_sparse_bundle), "--prompt", "a fox", "--quiet", "--steps",
                 str(BUNDLE_STEPS), "--output", str(out)]) == 0
    sparse = json.loads(out.with_suffix(".json").read_text())["sparse_attention"]
    assert sparse["kernel"] == "fp8_emulated" and sparse["sparse_evaluations"] == [2, 3, 4]
    assert sparse["router"] == "torch" and 0 < sparse["kept_fraction"] < 1


def test_the_load_warms_the_recorded_kernel_and_tile_and_requests_get_the_tile(fp8_sparse_bundle, monkeypatch):
    """A GPU bundle's record (fp8, its measured tile) is what the load compiles and what every request runs."""
    from h3trt.engines.manifest import read_manifest

    manifest = read_manifest(fp8_sparse_bundle)
    manifest = dataclasses.replace(manifest, sparse=dataclasses.replace(manifest.sparse, kernel="fp8",
                                                                        tile="m64n64w4s3"))
    warmed = []
    monkeypatch.setattr(bundle_module, "warm_sparse", lambda *args: warmed.append(args))
    assert bundle_sparse_kernel(fp8_sparse_bundle, manifest, torch.device("cpu")) == ("fp8", None)
    assert warmed[0][0] == "fp8" and warmed[0][5:] == (64, "m64n64w4s3")
    caps = bundle_caps(manifest)  # what the loaded runner serves, from its manifest
    pipeline = types.SimpleNamespace(dit=types.SimpleNamespace(caps=caps), device=torch.device("cpu"))
    request = types.SimpleNamespace(speed=Speed(sparse_attention=0.75))
    run = H3Pipeline.new_sparse_run(pipeline, request)
    assert (run.kernel, run.tile, run.report()["tile"]) == ("fp8", "m64n64w4s3", "m64n64w4s3")
