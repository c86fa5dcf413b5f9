"""An fp8 FastH3-VSA bundle built with --fp8-attention (the tiny VSA twin on the CPU): the build serves FP8 VSA
(build/vsa_choice.py; a CPU build: fp8_emulated, fp8 left out with why) with no dense FP8 attention beside it (no
calibrated attention scales, the halves only), the load honours the record (kernel and tile; a kernel the device
cannot run is refused, never substituted), and an evaluation runs VSA's fine branch in FP8.

Tolerance: a sparse evaluation with fp8_emulated against the same evaluation with the bf16 reference kernel on the
loaded engine: the e4m3 rounding of q, k and v (tests/models/test_vsa_fp8.py bounds the attention at 8% with v of mean
0), diluted through the block's residual stream: bounded at 3% (tests/engines/test_sparse_fp8_bundle.py's), and above 0.
"""

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch

from h3trt.engines import load_checks
from h3trt.engines.bundle import Engine
from h3trt.engines.guard import no_compile
from h3trt.engines.manifest import BundleError, content_sha256, read_manifest
from h3trt.models.vsa import plan as vsa_plan
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.runner import EvalExtras
from h3trt.models.sampler import Schedule
from h3trt.models.tiny import write_tiny_vsa_checkpoint
from h3trt.models.vsa.plan import VsaRun

from helpers import BUNDLE_STEPS, dit_inputs

pytestmark = pytest.mark.build

FP8_VS_BF16_TOL = 3e-2


@pytest.fixture(scope="module")
def fp8_vsa_bundle(tiny_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8vsa")
    ckpt = write_tiny_vsa_checkpoint(tiny_root, root / "ckpt")
    (root / "prompts.txt").write_text("a red fox runs through fresh snow\nwaves break on a rocky shore\n")
    out = root / "bundle"
    proc = subprocess.run([sys.executable, "-m", "h3trt.cli", "build", "--model", str(ckpt), "--output", str(out),
                           "--precision", "fp8", "--calib-prompts", str(root / "prompts.txt"), "--calib-steps", "3",
                           "--device", "cpu", "--fp8-attention", "--profile", "160x96x5", "--steps",
                           str(BUNDLE_STEPS), "--vsa-sparsity", "0.5"], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the fp8_emulated kernel" in proc.stderr + proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    return out


def test_the_build_serves_fp8_vsa_and_no_dense_fp8_attention(fp8_vsa_bundle):
    m = read_manifest(fp8_vsa_bundle)
    assert m.vsa.kernel == "fp8_emulated" and m.vsa.tile is None and "CUDA" in m.vsa.left_out["fp8"]
    assert not (m.quant or {}).get("fp8_attention")
    dit_segments = {n for n in m.segments if not n.startswith(("video_decoder", "audio_decoder"))}
    assert dit_segments == {"embed", "block_pre", "block_post", "final"}
    assert not any(n.endswith(("q_scale", "k_scale", "v_scale")) for n in m.segments["block_pre"]["weights"])


def evaluation(engine, serving):
    """One sparse evaluation of the engine's DiT on the tiny layout with `serving`'s kernel: (outputs, its run)."""
    cfg = engine.dit.cfg
    layout = pack_t2va(text_tags_for(11), 37, 6, 10, 207)
    video, audio, text = dit_inputs(layout, cfg, seed=1)
    unique_t, t_index = row_timesteps(layout, *Schedule(BUNDLE_STEPS).timesteps()[3])
    run = VsaRun(serving)
    run.next_evaluation()
    with torch.no_grad(), no_compile():
        out = engine.dit(video, audio, text.to(torch.bfloat16), unique_t, t_index, layout, EvalExtras(sparse=run))
    return out, run


def test_an_evaluation_runs_vsa_in_fp8(fp8_vsa_bundle):
    engine = Engine.load(fp8_vsa_bundle, "cpu")
    serving = engine.dit.caps.vsa
    assert serving.kernel == "fp8_emulated"
    fp8_out, run = evaluation(engine, serving)
    assert run.report()["kernel"] == "fp8_emulated" and run.report()["sparse_evaluations"] == [0]
    bf16_out, _ = evaluation(engine, dataclasses.replace(serving, kernel="reference"))
    errors = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(fp8_out, bf16_out)]
    assert 0 < max(errors) < FP8_VS_BF16_TOL, errors


def with_vsa_record(bundle, tmp_path, **record):
    """A copy of `bundle` whose manifest's vsa record has `record`'s fields (re-hashed: a GPU build's record)."""
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    path = copy / "manifest.json"
    data = json.loads(path.read_text())
    data["vsa"] = {**data["vsa"], **record}
    data.pop("manifest_sha256")
    data["manifest_sha256"] = content_sha256(data)
    path.write_text(json.dumps(data))
    return copy


def test_the_load_honours_the_recorded_kernel_and_tile(fp8_vsa_bundle, tmp_path, monkeypatch):
    gpu_built = with_vsa_record(fp8_vsa_bundle, tmp_path, kernel="fp8", tile="m64n64w4s3")
    with pytest.raises(BundleError, match="fp8 VSA kernel needs a CUDA GPU"):  # refused, not substituted
        Engine.load(gpu_built, "cpu")
    warmed, served = [], []
    monkeypatch.setattr(load_checks, "vsa_problem", lambda kernel, device: None)
    monkeypatch.setattr(vsa_plan, "warm_fp8_vsa_kernel", lambda *args: warmed.append(args[:2]))
    engine = Engine.load(gpu_built, "cpu")
    assert warmed == [("fp8", "m64n64w4s3")] and (engine.dit.caps.vsa.kernel, engine.dit.caps.vsa.tile) == warmed[0]
    real = vsa_plan.vsa_attention_kernel

    def spy(kernel, tile=None):  # what the request runs: the record's kernel and tile (the emulation stands in)
        served.append((kernel, tile))
        return real("fp8_emulated")

    monkeypatch.setattr(vsa_plan, "vsa_attention_kernel", spy)
    _, run = evaluation(engine, engine.dit.caps.vsa)
    assert set(served) == {("fp8", "m64n64w4s3")} and run.report()["tile"] == "m64n64w4s3"
