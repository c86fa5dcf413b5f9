"""A FastH3-VSA bundle made of a base checkpoint and a FastVideo fastvideo-lora-v2 file with `.set_weight` gates
(`h3trt build --distilled FILE`, the tiny model, fp32, on the CPU): the manifest records the family's rungs, the file
and what it was distilled at (`distilled.vsa`) beside what the bundle serves (`vsa`: sparsity 0.9 from that file, the
kernel and the faster ones left out); the bundle equals the eager merged model (`run --distilled FILE`) at every
forward, VSA included; `run --engine` and `run --distilled` make the same clip with VSA on the family's schedule, the
same clip dense (`--vsa-sparsity 0`) says so, `h3trt eval` compares the two sides; every misuse of the pair is one
line before anything loads.

Tolerances are test_vsa_bundle.py's and test_distilled_bundle.py's (fp32 bundles): the compiled DiT within a relative
error (norm) of 1e-5 of the eager DiT at each evaluation; decoded frames within 1 uint8 level (mean). The tiny canvas
(160x96, 5 s) has 20 video tiles: at 0.9 each video query tile keeps 2."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from h3trt.cli import main
from h3trt.engines.bundle import Engine
from h3trt.engines.guard import no_compile
from h3trt.engines.manifest import read_manifest
from h3trt.media.inputs import read_video
from h3trt.models.distilled.families import FASTH3_LORA_VSA, DistilledSpec
from h3trt.models.distilled.schedule import fasth3_schedule
from h3trt.models.distilled.writer import write_fasth3
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.runner import EvalExtras
from h3trt.models.tiny import write_tiny_vsa_checkpoint
from h3trt.models.vsa.plan import VsaRun
from h3trt.pipeline.loading import load_checkpoint

pytestmark = pytest.mark.build

REL_TOL = 1e-5
SCHEDULE = fasth3_schedule().schedule  # 4 forwards on the release's rungs, 12 / 3


@pytest.fixture(scope="module")
def vsa_file(tmp_path_factory, tiny_cfg):
    return write_fasth3(tmp_path_factory.mktemp("fasth3-vsa") / "vsa-datafree.safetensors", tiny_cfg, seed=21,
                        gates=True)


@pytest.fixture(scope="module")
def vsa_bundle(tmp_path_factory, tiny_root, vsa_file):
    out = tmp_path_factory.mktemp("fasth3-vsa-bundle") / "bundle"
    proc = subprocess.run([sys.executable, "-m", "h3trt.cli", "build", "--model", "tiny", "--output", str(out),
                           "--device", "cpu", "--precision", "fp32", "--distilled", str(vsa_file)],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fused fasth3 vsa-datafree.safetensors" in proc.stderr
    assert "VSA (FastH3-VSA model): the reference kernel" in proc.stderr  # fa4 and flex left out, each with why
    assert "VSA kernel fa4 left out" in proc.stderr and "VSA kernel flex left out" in proc.stderr
    return out


def test_manifest_records_the_file_what_it_was_distilled_at_and_what_is_served(vsa_bundle, vsa_file):
    m = read_manifest(vsa_bundle)
    assert m.model_config.vsa_gate and m.tasks == ("t2va",)
    assert len(m.schedules) == 1 and (m.schedule.steps, m.schedule.video_shift, m.schedule.audio_shift) == (5, 12.0, 3.0)
    assert m.schedule.rungs == SCHEDULE.rungs == (0.999, 0.749, 0.5, 0.25)
    assert m.distilled["family"] == "fasth3" and m.distilled["set_weight_tensors"] == m.model_config.num_layers
    assert m.distilled["vsa"] == {"trained_sparsity": 0.9, "tile_size": 64, "from": FASTH3_LORA_VSA}
    served = m.vsa.to_dict()
    assert (served["sparsity"], served["sparsity_from"], served["kernel"]) == (0.9, FASTH3_LORA_VSA, "reference")
    assert set(served["left_out"]) == {"fa4", "flex"}
    assert {n for n in m.segments if not n.startswith(("video_decoder", "audio_decoder"))} == {
        "embed", "block_pre", "block_post", "final"}


def test_bundle_equals_the_eager_merged_model_at_every_forward(vsa_bundle, vsa_file, tiny_root):
    engine = Engine.load(vsa_bundle, "cpu")
    eager = load_checkpoint(tiny_root, "t2va", "cpu", distilled=DistilledSpec(vsa_file)).dit
    assert eager.cfg.vsa_gate and eager.caps.vsa.settings == engine.dit.caps.vsa.settings
    layout = pack_t2va(text_tags_for(11), 37, 6, 10, 207)
    g = torch.Generator().manual_seed(0)
    cfg = eager.cfg
    args = (torch.randn(1, layout.video_index.numel(), cfg.video_patch_dim, generator=g),
            torch.randn(1, layout.audio_index.numel(), cfg.audio_in_channels, generator=g),
            torch.randn(1, layout.text_index.numel(), cfg.text_dim, generator=g))
    runs = [VsaRun(engine.dit.caps.vsa), VsaRun(eager.caps.vsa)]
    with torch.no_grad(), no_compile():
        for tv, ta in SCHEDULE.timesteps():
            unique_t, t_index = row_timesteps(layout, tv, ta)
            outputs = []
            for run, dit in zip(runs, (engine.dit, eager)):
                run.next_evaluation()
                outputs.append(dit(*args, unique_t, t_index, layout, EvalExtras(sparse=run)))
            for a, b in zip(*outputs):
                err = ((a - b).norm() / b.norm()).item()
                assert err <= REL_TOL, f"relative error {err:.2e} at t=({tv}, {ta})"
    assert runs[0].report() == runs[1].report() and runs[0].report()["sparse_evaluations"] == [0, 1, 2, 3]


def _clip(path):
    frames, _, _ = read_video(path)
    return frames.astype(np.float32), json.loads(path.with_suffix(".json").read_text())


def test_run_engine_and_run_distilled_make_the_same_vsa_clip(vsa_bundle, vsa_file, tmp_path, tiny_cache):
    eager, engine, dense = tmp_path / "eager.mp4", tmp_path / "engine.mp4", tmp_path / "dense.mp4"
    assert main(["run", "--distilled", str(vsa_file), "--prompt", "a fox", "--output", str(eager), "--quiet"]) == 0
    assert main(["run", "--engine", str(vsa_bundle), "--prompt", "a fox", "--output", str(engine), "--quiet"]) == 0
    assert main(["run", "--engine", str(vsa_bundle), "--prompt", "a fox", "--output", str(dense), "--quiet",
                 "--vsa-sparsity", "0"]) == 0
    (a, ra), (b, rb), (c, rc) = _clip(eager), _clip(engine), _clip(dense)
    assert a.shape == b.shape and np.abs(a - b).mean() <= 1.0
    for record in (ra, rb):
        assert (record["steps"], record["evaluations"]) == (5, 4)
        assert record["distilled"]["schedule"]["rungs"] == [0.999, 0.749, 0.5, 0.25]
        assert record["distilled"]["vsa"]["trained_sparsity"] == 0.9
        attn = record["sparse_attention"]
        assert (attn["mode"], attn["sparsity"], attn["sparse_evaluations"]) == ("vsa", 0.9, [0, 1, 2, 3])
        assert attn["kept_fraction"] < 1.0
    attn = rc["sparse_attention"]  # the same bundle, the same clip, dense (the coarse branch kept)
    assert (attn["sparsity"], attn["sparse_evaluations"], attn["kept_fraction"]) == (0.0, [], 1.0)
    assert attn["sparsity_from"] == "the request's vsa_sparsity" and np.abs(c - b).mean() > 0.0


def test_eval_compares_the_bundle_with_the_eager_merged_model(vsa_bundle, vsa_file, tmp_path, tiny_cache):
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps({"prompt": "a fox", "seed": 3}) + "\n")
    out = tmp_path / "eval.json"
    assert main(["eval", "--engine", str(vsa_bundle), "--reference", "tiny", "--distilled", str(vsa_file),
                 "--requests", str(requests), "--device", "cpu", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    mean = result["mean"]
    assert len(mean["latent_rel_err_per_step_video"]) == 4  # the family's 4 forwards on both sides
    assert mean["final_latent_rel_err_video"] <= 1e-4 and mean["final_latent_rel_err_audio"] <= 1e-4


def test_misuse_is_one_line_before_anything_loads(vsa_bundle, vsa_file, tiny_root, tiny_cfg, tmp_path, tiny_cache,
                                                  capsys, no_model_load):
    dense = write_fasth3(tmp_path / "dense.safetensors", tiny_cfg, seed=1)
    export = write_tiny_vsa_checkpoint(tiny_root, tmp_path / "export")  # a full VSA export: its gates, a sidecar
    (export / "FL2VA" / "fastvideo_inference.json").write_text(json.dumps({
        "schema_version": "fasth3-inference-contract-v1", "dmd_denoising_steps": [999, 749, 500, 250],
        "num_inference_steps": 5, "transformer_forwards": 4, "vsa_sparsity": 0.9, "vsa_tile_size": 64}))
    out = str(tmp_path / "x.mp4")

    def build(*extra):
        return ["build", "--model", "tiny", "--output", str(tmp_path / "b"), "--device", "cpu", *extra]

    cases = [
        (build("--distilled", str(vsa_file), "--sparse-attention", "0.5"),
         "this checkpoint is a FastH3-VSA model.*--sparse-attention cannot serve"),
        (build("--distilled", str(vsa_file), "--vsa-sparsity", "1.5"), "--vsa-sparsity takes the share"),
        (build("--distilled", str(vsa_file), "--task", "ref2va"), "serves \\['t2va'\\] only, not ref2va"),
        (build("--distilled", str(vsa_file), "--lora-slots", "1", "--lora-max-rank", "4"),
         "--lora-slots: this model runs a fasth3 distilled checkpoint"),
        (build("--distilled", str(dense), "--vsa-sparsity", "0.5"), "not a VSA model"),
        (["build", "--model", str(export), "--output", str(tmp_path / "b"), "--device", "cpu", "--distilled",
          str(vsa_file)], "is a distilled export already"),
        (["run", "--engine", str(vsa_bundle), "--prompt", "a", "--output", out, "--sparse-attention", "0.5"],
         "this model is FastH3-VSA"),
        (["run", "--engine", str(vsa_bundle), "--prompt", "a", "--output", out, "--vsa-sparsity", "1"],
         "--vsa-sparsity takes the share"),
        (["run", "--engine", str(vsa_bundle), "--prompt", "a", "--output", out, "--steps", "9"],
         "runs 4 forwards \\(steps 5\\)"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(message, err), (argv, err)
