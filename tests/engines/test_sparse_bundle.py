"""A one-process (sp=1) bundle that serves block-sparse attention: `h3trt build --sparse-attention` compiles the
block's two halves beside the fused block, records its default settings and kernel, and serves sparse evaluations
through the halves while dense ones keep the fused block.

Tolerances are test_engine.py's (fp32 bundles): the compiled DiT within a relative error (norm) of 1e-5 of the eager
DiT, a clip's frames within 1 uint8 level (mean) of the eager clip. The tiny model's 1,021 packed rows are 16 routing
blocks of 64: sparsity 0.75 keeps 8 of them (the budget rounds up to 8), so a sparse attention really skips blocks.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from h3trt.cli import main
from h3trt.engines.bundle import Engine
from h3trt.engines.guard import no_compile
from h3trt.engines.manifest import SparseRecord, read_manifest
from h3trt.models.checkpoint.reader import load_dit
from h3trt.models.dit import EagerDiT
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.runner import EvalExtras
from h3trt.models.sampler import Schedule
from h3trt.models.sparse.plan import SparseSettings, sparse_settings
from h3trt.models.sparse.run import SparseRun
from h3trt.media.inputs import read_video

from helpers import BUNDLE_STEPS, PLAIN_BUNDLE, dit_inputs

REL_TOL = 1e-5  # test_engine.py's compiled-vs-eager bound for fp32 bundles
# The bundle's defaults: sparse from the third evaluation on, at the tiny model's short sequences.
SPARSE_FLAGS = ("--sparse-attention", "0.75", "--sparse-dense-steps", "2", "--sparse-min-seq", "1")
RUN = ("--prompt", "a fox", "--quiet", "--steps", str(BUNDLE_STEPS))  # BUNDLE_STEPS - 1 = 5 evaluations


@pytest.fixture(scope="module")
def sparse_bundle(bundle_cache):
    """fp32 CPU inductor bundle of the tiny model built with --sparse-attention 0.75 (first 2 evaluations dense, any
    length sparse), in its own `h3trt build` process (conftest's BundleCache)."""
    built = bundle_cache.get(*PLAIN_BUNDLE, *SPARSE_FLAGS)
    assert "sparse attention reference (default sparsity 0.75)" in built.stdout, built.stdout
    return built.path


def clip(tmp_path: Path, name: str, *flags: str) -> tuple[Path, dict]:
    out = tmp_path / f"{name}.mp4"
    assert main(["run", *RUN, "--output", str(out), *flags]) == 0
    return out, json.loads(out.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def sparse_clips(sparse_bundle, tmp_path_factory, tiny_cache):
    """Clips of one request: the bundle's default (sparse), overridden to 0, kept dense by its dense steps, and the
    eager model's sparse clip with the bundle's settings."""
    root = tmp_path_factory.mktemp("clips")
    engine = ("--engine", str(sparse_bundle))
    return {"default": clip(root, "default", *engine),
            "zero": clip(root, "zero", *engine, "--sparse-attention", "0"),
            "all_dense": clip(root, "all_dense", *engine, "--sparse-dense-steps", str(BUNDLE_STEPS)),
            "eager": clip(root, "eager", *SPARSE_FLAGS)}


def test_the_manifest_records_the_defaults_the_kernel_and_the_halves(sparse_bundle):
    m = read_manifest(sparse_bundle)
    assert m.sparse == SparseRecord(0.75, 2, 1, "reference", 64)
    assert {"block", "block_pre", "block_post"} <= set(m.segments)
    block, pre, post = (m.segments[n]["weights"] for n in ("block", "block_pre", "block_post"))
    # The halves read the block's own tensors: a partition of them, so nothing is stored twice.
    assert sorted(pre + post) == sorted(block) and not set(pre) & set(post)
    with safe_open(str(sparse_bundle / "weights" / "blocks.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == {f"blocks.{i}.{n}" for i in range(m.model_config.num_layers) for n in block}


def _inputs(cfg):
    layout = pack_t2va(text_tags_for(11), 37, 6, 10, 207)  # another text length than the build example
    tv, ta = Schedule(BUNDLE_STEPS).timesteps()[3]
    unique_t, t_index = row_timesteps(layout, tv, ta)
    return (*dit_inputs(layout, cfg), unique_t, t_index, layout)


def test_a_sparse_evaluation_runs_the_halves_and_matches_the_eager_sparse_dit(sparse_bundle, tiny_root):
    engine = Engine.load(sparse_bundle, "cpu")
    assert engine.dit.caps.sparse_kernel == "reference" and engine.load_report["sparse_kernel_s"] >= 0
    eager = EagerDiT(load_dit(tiny_root, "t2va", torch.float32)[0], "reference")
    args = _inputs(eager.cfg)
    calls = {"block": 0, "block_pre": 0, "block_post": 0}
    for name in calls:
        segment = engine.dit.segments[name]
        engine.dit.segments[name] = lambda *a, _s=segment, _n=name: (calls.__setitem__(_n, calls[_n] + 1), _s(*a))[1]
    runs = []
    with torch.no_grad(), no_compile():
        dense = engine.dit(*args)
        assert calls == {"block": 2, "block_pre": 0, "block_post": 0}  # the fused block, one per layer
        outputs = []
        for dit in (engine.dit, eager):
            run = SparseRun(sparse_settings(0.75, 0, 1), "reference")
            run.next_evaluation()
            outputs.append(dit(*args, EvalExtras(sparse=run)))
            runs.append(run.report())
    assert calls == {"block": 2, "block_pre": 2, "block_post": 2}  # the sparse evaluation: the halves, never the block
    for got, want, plain in zip(*outputs, dense):
        err = ((got - want).norm() / want.norm()).item()
        assert err <= REL_TOL, f"relative error {err:.2e} against the eager sparse DiT"
        # It did attend sparsely: far from the dense output (1e-2 video, 1e-4 audio), near the eager one (2e-7).
        assert ((got - plain).norm() / plain.norm()).item() > 100 * err
    assert runs[0] == runs[1] and 0 < runs[0]["kept_fraction"] < 1  # the same blocks routed


def test_a_dense_evaluation_of_a_sparse_request_is_the_fused_block_bit_for_bit(sparse_bundle):
    engine = Engine.load(sparse_bundle, "cpu")
    args = _inputs(engine.dit.cfg)
    run = SparseRun(sparse_settings(0.75, 2, 1), "reference")
    run.next_evaluation()  # evaluation 0: within the dense steps
    with torch.no_grad(), no_compile():
        for got, want in zip(engine.dit(*args, EvalExtras(sparse=run)), engine.dit(*args)):
            assert torch.equal(got, want)
    assert run.report()["sparse_evaluations"] == []


def test_the_bundle_serves_its_default_sparsity_as_the_eager_model_does(sparse_clips):
    (mp4, record), (eager_mp4, eager_record) = sparse_clips["default"], sparse_clips["eager"]
    a, _, _ = read_video(eager_mp4)
    b, _, _ = read_video(mp4)
    assert a.shape == b.shape and np.abs(a.astype(np.float32) - b.astype(np.float32)).mean() <= 1.0
    sparse, want = record["sparse_attention"], eager_record["sparse_attention"]
    assert (sparse["sparsity"], sparse["dense_steps"], sparse["min_seq"], sparse["kernel"]) == (0.75, 2, 1,
                                                                                                 "reference")
    assert sparse["sparse_evaluations"] == want["sparse_evaluations"] == [2, 3, 4]
    assert sparse["kept_fraction"] == pytest.approx(want["kept_fraction"], abs=0.02) and sparse["kept_fraction"] < 1


def test_a_request_overrides_the_default_and_sparsity_0_is_the_dense_clip_bit_for_bit(sparse_clips):
    zero, all_dense, default = sparse_clips["zero"], sparse_clips["all_dense"], sparse_clips["default"]
    assert zero[1]["sparse_attention"] == {"sparsity": 0.0}
    assert all_dense[1]["sparse_attention"]["sparse_evaluations"] == []  # sparse asked, every evaluation dense
    assert zero[0].read_bytes() == all_dense[0].read_bytes()
    assert zero[0].read_bytes() != default[0].read_bytes()


def test_request_lines_and_api_jobs_take_the_bundle_default_unless_they_state_one(sparse_bundle):
    from h3trt.jobs.model_source import Entry, ModelSource
    from h3trt.request.parse import parse_object
    from h3trt.server.service import request_defaults

    entry = Entry.local(ModelSource.resolve(engine=sparse_bundle), "cpu")
    defaults = request_defaults(entry)
    assert entry.model.default_sparse == defaults.sparse == SparseSettings(0.75, 2, 1)

    def request(**data):
        return parse_object({"prompt": "a fox", **data}, 1, Path("."), ("prompt",), defaults).request

    def knobs(r):
        return r.speed.sparse_attention, r.speed.sparse_dense_steps, r.speed.sparse_min_seq

    assert knobs(request()) == (0.75, 2, 1)
    assert knobs(request(sparse_attention=0)) == (0, 2, 1)
    assert knobs(request(sparse_attention=0.5, sparse_min_seq=64)) == (0.5, 2, 64)
    assert knobs(request(profile="quality"))[0] == 0.0  # a profile is the request's own choice
    assert knobs(request(profile="fast")) == (0.8, 10, 1)


def test_explicit_beats_the_bundle_default_beats_the_built_in_one():
    from h3trt.request.parse import profile_fields, with_bundle_sparse

    bundle = SparseSettings(0.6, 3, 128)
    assert with_bundle_sparse(profile_fields(None), None) == profile_fields(None)  # no bundle default: dense
    fields = with_bundle_sparse(profile_fields(None), bundle)
    assert (fields["sparse_attention"], fields["sparse_dense_steps"], fields["sparse_min_seq"]) == (0.6, 3, 128)
    fields = with_bundle_sparse(profile_fields(None, sparse_attention=0.0, sparse_dense_steps=1), bundle)
    assert (fields["sparse_attention"], fields["sparse_dense_steps"], fields["sparse_min_seq"]) == (0.0, 1, 128)
    fields = with_bundle_sparse(profile_fields("balanced"), bundle)
    assert (fields["sparse_attention"], fields["sparse_dense_steps"]) == (0.75, 10)




@pytest.mark.parametrize("flags, line", [
    (["--sparse-attention", "1.5"], "--sparse-attention takes a fraction of key blocks to skip, 0 <= s < 1"),
    (["--sparse-attention", "nan"], "--sparse-attention takes a fraction"),
    (["--sparse-attention", "half"], "--sparse-attention takes a number, got 'half'"),
    (["--sparse-attention", "0.5", "--sparse-min-seq", "0"], "--sparse-min-seq takes a whole number of at least 1"),
    (["--sparse-dense-steps", "3"], "--sparse-dense-steps, --sparse-min-seq and --sparse-kernel set up a bundle"),
    (["--sparse-kernel", "fa4"], "--sparse-dense-steps, --sparse-min-seq and --sparse-kernel set up a bundle"),
    (["--sparse-attention", "0.5", "--sparse-kernel", "fp8"], "--sparse-kernel fp8 runs FP8 attention with each"),
    (["--sparse-attention", "0.5", "--backend", "tensorrt"], "--sparse-attention applies to the inductor and aoti"),
])
def test_bad_sparse_build_flags_are_one_line_before_anything_builds(h3trt, monkeypatch, tmp_path, flags, line):
    import h3trt.build.builder as builder

    monkeypatch.setattr(builder, "build", lambda *a, **k: pytest.fail("the build started"))
    code, err = h3trt("build", "--model", "tiny", "--output", str(tmp_path / "b"), "--device", "cpu", *flags)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"h3trt: error: {line}"), err
    assert not (tmp_path / "b").exists()


def test_fp8_halves_keep_the_quantized_linears_and_read_the_blocks_weights():
    """An fp8 bundle's halves take the block's e4m3 weights and scales (FP8 GEMMs): between them only the attention is
    replaced by the bf16 block-sparse one, and the halves' tensors are the block's, split in two."""
    from h3trt.build.segments import dit_segments
    from h3trt.calibration.recipe import QuantRecipe
    from h3trt.models.config import H3Config

    recipe = QuantRecipe("fp8", "max", calib_steps=2, fp8_attention=True, attention_kernel="emulated")
    segments = {s.name: s for s in dit_segments(H3Config.tiny(), torch.bfloat16, 1, recipe, sparse=True)}
    assert [n for n in segments if n.startswith("block")] == ["block", "block_pre", "block_post"]
    block, pre, post = (set(segments[n].weights) for n in ("block", "block_pre", "block_post"))
    assert not pre & post and pre | post == block
    quantized = {n for n in block if n.endswith(("input_scale", "weight_scale"))}
    assert quantized and {n for n in quantized if n.startswith("attn.qkv_proj.")} <= pre
    assert {n for n in quantized if n.startswith(("mlp.", "attn.out_proj."))} <= post
