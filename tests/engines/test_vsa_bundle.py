"""A FastH3-VSA bundle (the tiny twin, h3trt/models/tiny.py write_tiny_vsa_checkpoint): `h3trt build` on a checkpoint
whose blocks carry attn.to_gate_compress compiles the block's two halves and no fused block, records the VSA settings
and kernel in the manifest, and serves VSA between the halves (the gate in block_pre's buffer) in every evaluation,
at the eager model's values; a served clip's record says what ran; the refusals.

Tolerances are test_engine.py's (fp32 bundles): the compiled DiT within a relative error (norm) of 1e-5 of the eager
DiT. The tiny canvas (160x96, 5 s) has 37 x 3 x 5 video rows: 20 video tiles, ragged in t and w; sparsity 0.5 keeps
10 of them.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3trt.build.config import BuildConfig, Profile
from h3trt.cli import main
from h3trt.engines.bundle import Engine
from h3trt.engines.guard import no_compile
from h3trt.engines.manifest import BundleError, Manifest, read_manifest
from h3trt.errors import UserError
from h3trt.models.checkpoint.reader import load_dit
from h3trt.models.dit import EagerDiT
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.runner import EvalExtras
from h3trt.models.sampler import Schedule
from h3trt.models.tiny import write_tiny_vsa_checkpoint
from h3trt.models.vsa.plan import VsaRun, VsaServing, VsaSettings

from helpers import BUNDLE_STEPS, dit_inputs

pytestmark = pytest.mark.build

REL_TOL = 1e-5
VSA_FLAGS = ("--vsa-sparsity", "0.5", "--vsa-dense-first-steps", "1", "--vsa-dense-layers", "1")
SERVING = VsaServing(VsaSettings(0.5, 1, (1,)), "reference")
CANVAS = ("--width", "160", "--height", "96")  # the bundle's one profile (built from a path: not the tiny default)


@pytest.fixture(scope="module")
def vsa_root(tiny_root, tmp_path_factory):
    return write_tiny_vsa_checkpoint(tiny_root, tmp_path_factory.mktemp("vsa") / "ckpt")


@pytest.fixture(scope="module")
def vsa_bundle(vsa_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("vsa_bundle") / "bundle"
    proc = subprocess.run([sys.executable, "-m", "h3trt.cli", "build", "--model", str(vsa_root), "--output", str(out),
                           "--precision", "fp32", "--device", "cpu", "--profile", "160x96x5", "--steps",
                           str(BUNDLE_STEPS), *VSA_FLAGS], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "VSA (FastH3-VSA model): the reference kernel" in proc.stderr, proc.stderr[-3000:]
    return out


def test_manifest_records_vsa_and_the_halves_only(vsa_bundle):
    m = read_manifest(vsa_bundle)
    assert m.model_config.vsa_gate and m.vsa == SERVING
    dit_segments = {n for n in m.segments if not n.startswith(("video_decoder", "audio_decoder"))}
    assert dit_segments == {"embed", "block_pre", "block_post", "final"}
    assert "attn.to_gate_compress.weight" in m.segments["block_pre"]["weights"]
    assert "attn.to_gate_compress.weight" not in m.segments["block_post"]["weights"]


def test_manifest_vsa_record_is_checked(vsa_bundle):
    data = json.loads((vsa_bundle / "manifest.json").read_text())
    assert Manifest.from_dict(data).vsa == SERVING
    for bad in ({**data, "vsa": None}, {**data, "vsa": {**data["vsa"], "sparsity": 1.5}},
                {**data, "vsa": {**data["vsa"], "kernel": "tk"}}, {**data, "vsa": {**data["vsa"], "dense_layers": [-1]}}):
        with pytest.raises(BundleError, match="'vsa'"):
            Manifest.from_dict(bad)


def test_engine_matches_the_eager_vsa_dit(vsa_bundle, vsa_root):
    engine = Engine.load(vsa_bundle, "cpu")
    assert engine.dit.caps.vsa == SERVING
    eager = EagerDiT(load_dit(vsa_root, "t2va", torch.float32)[0], vsa=SERVING)
    layout = pack_t2va(text_tags_for(13), 37, 6, 10, 207)  # another text length than the build's example
    tv, ta = Schedule(BUNDLE_STEPS).timesteps()[2]
    unique_t, t_index = row_timesteps(layout, tv, ta)
    args = (*dit_inputs(layout, eager.cfg), unique_t, t_index, layout)
    runs = [VsaRun(SERVING) for _ in range(2)]
    outputs = {0: [], 1: []}
    with torch.no_grad(), no_compile():
        for evaluation in range(2):  # the first dense (the coarse branch kept), the second sparse but block 1
            for run, dit in zip(runs, (engine.dit, eager)):
                run.next_evaluation()
                outputs[evaluation].append(dit(*args, EvalExtras(sparse=run)))
    for evaluation, (got, want) in outputs.items():
        for g, w in zip(got, want):
            err = ((g - w).norm() / w.norm()).item()
            assert err <= REL_TOL, f"evaluation {evaluation}: relative error {err:.2e}"
    assert runs[0].report() == runs[1].report() and runs[0].report()["sparse_evaluations"] == [1]
    with pytest.raises(ValueError, match="VsaRun"), torch.no_grad():
        engine.dit(*args)


def test_a_served_clip_runs_vsa_and_says_so(vsa_bundle, tmp_path, tiny_cache):
    out = tmp_path / "clip.mp4"
    assert main(["run", "--engine", str(vsa_bundle), "--prompt", "a fox", "--quiet", "--steps", str(BUNDLE_STEPS),
                 *CANVAS, "--output", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())["sparse_attention"]
    assert record["mode"] == "vsa" and record["sparsity"] == 0.5 and record["kernel"] == "reference"
    assert record["sparse_evaluations"] == list(range(1, BUNDLE_STEPS - 1))  # evaluation 0 dense


def test_a_sparse_attention_request_is_refused(vsa_bundle, h3trt, tmp_path):
    code, err = h3trt("run", "--engine", str(vsa_bundle), "--prompt", "a fox", "--quiet", "--steps",
                      str(BUNDLE_STEPS), *CANVAS, "--sparse-attention", "0.5", "--output", str(tmp_path / "x.mp4"))
    assert code == 2 and len(err) == 1 and "this model is FastH3-VSA" in err[0], err


def test_build_refusals(vsa_root, tiny_root, tmp_path):
    def config(root, **kw):
        return BuildConfig(root, tmp_path / "b", "t2va", "bf16", (Profile.parse("160x96x5"),), device="cpu", **kw)

    with pytest.raises(UserError, match="not a VSA model"):
        config(tiny_root, vsa_sparsity=0.5).check_vsa(False)
    with pytest.raises(UserError, match="FastH3-VSA model.*--sparse-attention"):
        config(vsa_root, sparse_attention=0.5).check_vsa(True)
    with pytest.raises(UserError, match="--vsa-sparsity"):
        config(vsa_root, vsa_sparsity=1.5)


@pytest.fixture(scope="module")
def vsa_sp2_bundle(vsa_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("vsa_sp2") / "bundle"
    proc = subprocess.run([sys.executable, "-m", "h3trt.cli", "build", "--model", str(vsa_root), "--output", str(out),
                           "--precision", "fp32", "--device", "cpu", "--profile", "160x96x5", "--steps",
                           str(BUNDLE_STEPS), "--sp", "2", *VSA_FLAGS], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _sp2_rank(rank, world, store, bundle, root, out):
    from h3trt.parallel.launch import init_rank
    from h3trt.parallel.mesh import MeshConfig, build_mesh

    init_rank(rank, world, store, "cpu")
    par = build_mesh(MeshConfig(sp=2), "cpu", world, 2)
    engine = Engine.load(bundle, "cpu", par.config, par.sp_group)
    eager = EagerDiT(load_dit(root, "t2va", torch.float32)[0], vsa=SERVING)
    layout = pack_t2va(text_tags_for(8), 37, 6, 10, 23, keyframes=("first",))  # 8 + 15 + 46 + 555 rows: odd, padded
    args = (*dit_inputs(layout, eager.cfg), *row_timesteps(layout, *Schedule(BUNDLE_STEPS).timesteps()[1]), layout)
    errors = []
    runs = [VsaRun(SERVING) for _ in range(2)]
    with torch.no_grad():
        for _ in range(2):  # the first evaluation dense (the coarse branch kept), the second sparse but block 1
            outputs = []
            for dit, run in zip((engine.dit, eager), runs):
                run.next_evaluation()
                outputs.append(dit(*args, EvalExtras(sparse=run)))
            errors += [((a - b).norm() / b.norm()).item() for a, b in zip(*outputs)]
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"errors": errors, "report": runs[0].report()}))


def test_sp2_bundle_exchanges_the_gate_and_matches_eager(vsa_sp2_bundle, vsa_root, tmp_path):
    """The sp=2 halves: block_pre's send buffer holds q, k, v and the gate ([2, 4, ...]); each rank routes its head."""
    from h3trt.parallel.launch import launch

    assert read_manifest(vsa_sp2_bundle).vsa == SERVING
    launch(_sp2_rank, 2, (vsa_sp2_bundle, vsa_root, tmp_path))
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert max(result["errors"]) <= REL_TOL, f"rank {rank}: {result['errors']}"
        assert result["report"]["sparse_evaluations"] == [1]
