"""A distilled bundle of the tiny model on the CPU: a PDD file at 6 forwards (explicit rungs: the (8, 8, 4, 4, 4, 4)
split; one fused head per forward) built in fp32, served without compiling, equal to the eager merged model at every
evaluation of its schedule; `h3trt run --engine` needs no flag for its schedule and its clip matches the eager
`run --distilled` clip; and every misuse of a distilled file is one line before anything loads.

Tolerances, as tests/engines/test_fewstep.py: fp32; the compiled DiT against the eager one to a relative error (norm) of
1e-5 at each evaluation; decoded frames within 1 uint8 level (mean)."""

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from h3trt.cli import main
from h3trt.engines.bundle import Engine
from h3trt.engines.guard import no_compile
from h3trt.engines.manifest import read_manifest
from h3trt.media.inputs import read_video
from h3trt.models.distilled.families import DistilledSpec
from h3trt.models.distilled.schedule import pdd_schedule
from h3trt.models.distilled.writer import write_fasth3, write_pdd, write_turbo
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.pipeline.loading import load_checkpoint

REL_TOL = 1e-5
SCHEDULE = pdd_schedule(6).schedule


@pytest.fixture(scope="module")
def pdd_file(tmp_path_factory, tiny_cfg):
    return write_pdd(tmp_path_factory.mktemp("pdd") / "pdd.safetensors", tiny_cfg, seed=11)


@pytest.fixture(scope="module")
def pdd_bundle(tmp_path_factory, tiny_root, pdd_file):
    out = tmp_path_factory.mktemp("pdd-bundle") / "bundle"
    proc = subprocess.run([sys.executable, "-m", "h3trt.cli", "build", "--model", "tiny", "--output", str(out),
                           "--device", "cpu", "--precision", "fp32", "--distilled", f"{pdd_file}@steps=7"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fused pdd pdd.safetensors" in proc.stderr
    return out


def test_manifest_records_the_family_the_rungs_and_the_file(pdd_bundle, pdd_file):
    m = read_manifest(pdd_bundle)
    assert m.distilled["family"] == "pdd" and m.distilled["sha256"] == hashlib.sha256(pdd_file.read_bytes()).hexdigest()
    assert m.schedules == (m.schedule,) and m.schedule.rungs == (1.0, 0.75, 0.5, 0.375, 0.25, 0.125)
    assert (m.schedule.steps, m.schedule.video_shift, m.schedule.audio_shift) == (7, 12.0, 3.0)
    assert m.distilled["vsa"] is None and m.distilled["spec"]["steps"] == 7
    final = load_file(str(pdd_bundle / "weights" / "final.safetensors"))
    assert final["pdd.video_out.weight"].shape[0] == 6 and final["pdd.audio_out.bias"].shape[0] == 6


def test_bundle_equals_the_eager_merged_model_at_every_forward(pdd_bundle, pdd_file, tiny_root):
    engine = Engine.load(pdd_bundle, "cpu")
    eager = load_checkpoint(tiny_root, "t2va", "cpu", distilled=DistilledSpec.parse(f"{pdd_file}@steps=7")).dit
    layout = pack_t2va(text_tags_for(11, [range(2, 6)]), 7, 6, 10, 23, keyframes=("first",))
    g = torch.Generator().manual_seed(0)
    cfg = eager.cfg
    args = (torch.randn(1, layout.video_index.numel(), cfg.video_patch_dim, generator=g),
            torch.randn(1, layout.audio_index.numel(), cfg.audio_in_channels, generator=g),
            torch.randn(1, layout.text_index.numel(), cfg.text_dim, generator=g))
    outputs = []
    with torch.no_grad(), no_compile():
        for tv, ta in SCHEDULE.timesteps():
            unique_t, t_index = row_timesteps(layout, tv, ta)
            got, want = engine.dit(*args, unique_t, t_index, layout), eager(*args, unique_t, t_index, layout)
            for a, b in zip(got, want):
                err = ((a - b).norm() / b.norm()).item()
                assert err <= REL_TOL, f"relative error {err:.2e} at t=({tv}, {ta})"
            outputs.append(got[0])
    # each forward ran its own head: the same input at two forwards gives two outputs
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(outputs, outputs[1:]))


def test_run_serves_the_bundle_like_the_eager_distilled_run(pdd_bundle, pdd_file, tmp_path, tiny_cache):
    eager_out, engine_out = tmp_path / "eager.mp4", tmp_path / "engine.mp4"
    assert main(["run", "--prompt", "a fox", "--output", str(eager_out), "--quiet", "--distilled",
                 f"{pdd_file}@steps=7"]) == 0
    assert main(["run", "--engine", str(pdd_bundle), "--prompt", "a fox", "--output", str(engine_out),
                 "--quiet"]) == 0  # no --steps: the family's schedule is the bundle's
    a, _, _ = read_video(eager_out)
    b, _, _ = read_video(engine_out)
    assert a.shape == b.shape and np.abs(a.astype(np.float32) - b.astype(np.float32)).mean() <= 1.0
    for out in (eager_out, engine_out):
        record = json.loads(out.with_suffix(".json").read_text())
        assert record["evaluations"] == 6 and record["distilled"]["family"] == "pdd"
        assert record["distilled"]["schedule"]["rungs"] == [1.0, 0.75, 0.5, 0.375, 0.25, 0.125]
    # the bundle's text encoder encoded the clip's prompt while the DiT loaded (its warm-up): the same frames
    assert json.loads(engine_out.with_suffix(".json").read_text())["load"]["text_prefetched"] == 1


def test_eager_fasth3_runs_its_rungs(tiny_cfg, tmp_path, tiny_cache):
    fasth3 = write_fasth3(tmp_path / "fasth3.safetensors", tiny_cfg, seed=2)
    out = tmp_path / "f.mp4"
    assert main(["run", "--distilled", str(fasth3), "--prompt", "a fox", "--output", str(out), "--quiet"]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert (record["steps"], record["evaluations"], record["shifts"]) == (5, 4, {"video": 12.0, "audio": 3.0})
    assert record["distilled"]["schedule"]["rungs"] == [0.999, 0.749, 0.5, 0.25]
    assert record["distilled"]["sha256"] == hashlib.sha256(fasth3.read_bytes()).hexdigest()
    assert set(record["decode_tail_steps_s"]) >= {"to_encoder", "encode", "rename"}


def test_misuse_is_one_line_before_anything_loads(pdd_bundle, pdd_file, tiny_cfg, tmp_path, tiny_cache, capsys,
                                                  no_model_load):
    from PIL import Image
    from safetensors.torch import save_file

    fasth3 = write_fasth3(tmp_path / "fasth3.safetensors", tiny_cfg, seed=1)
    turbo = write_turbo(tmp_path / "turbo.safetensors", tiny_cfg, rank=8)
    ref_turbo = tmp_path / "ref.safetensors"  # a Ref2VA-only file: its layers are transformer_ref.
    save_file({f"transformer_ref.{k.removeprefix('base_model.model.').replace('.default', '')}": v
               for k, v in load_file(str(turbo)).items()}, str(ref_turbo))
    image = tmp_path / "first.png"
    Image.new("RGB", (160, 96), (200, 40, 40)).save(image)
    out = str(tmp_path / "x.mp4")
    cases = [
        (["run", "--engine", str(pdd_bundle), "--prompt", "a", "--output", out, "--steps", "9"],
         "runs 6 forwards \\(steps 7\\).*rebuild"),
        (["run", "--engine", str(pdd_bundle), "--prompt", "a", "--output", out, "--adapter", f"t={turbo}"],
         "a LoRA per request is not served"),
        (["run", "--engine", str(pdd_bundle), "--prompt", "a", "--output", out, "--distilled", str(pdd_file)],
         "a bundle was built with its own"),
        (["run", "--distilled", str(fasth3), "--prompt", "a", "--output", out, "--guidance", "3",
          "--negative-prompt", "b"], "runs CFG off"),
        (["run", "--distilled", str(turbo), "--prompt", "a", "--output", out], "states no schedule"),
        (["run", "--distilled", str(fasth3), "--prompt", "a", "--output", out, "--image", str(image)],
         "serves \\['t2va'\\] only, not fl2va"),
        (["run", "--distilled", str(fasth3), "--prompt", "a", "--output", out, "--adapter", f"t={turbo}"],
         "fasth3 distilled checkpoint, which is fused into the weights: a LoRA per request is not served"),
        (["build", "--model", "tiny", "--output", str(tmp_path / "b0"), "--device", "cpu", "--distilled",
          f"{ref_turbo}@family=turbo,steps=5,video_shift=6"], "serves \\['ref2va'\\] only, not t2va"),
        (["build", "--model", "tiny", "--output", str(tmp_path / "b1"), "--device", "cpu", "--distilled",
          str(fasth3), "--task", "ref2va"], "serves \\['t2va'\\] only, not ref2va"),
        (["build", "--model", "tiny", "--output", str(tmp_path / "b2"), "--device", "cpu", "--distilled",
          str(fasth3), "--steps", "9"], "--steps: a distilled bundle bakes the schedule"),
        (["build", "--model", "tiny", "--output", str(tmp_path / "b3"), "--device", "cpu", "--distilled",
          str(pdd_file), "--lora-slots", "1", "--lora-max-rank", "4"], "--lora-slots: this model runs a pdd"),
        (["build", "--model", "tiny", "--output", str(tmp_path / "b4"), "--device", "cpu", "--distilled",
          f"{pdd_file}@steps=6"], "PDD runs 4, 6 or 8 forwards"),
        (["build", "--model", "tiny", "--output", str(tmp_path / "b5"), "--device", "cpu", "--distilled",
          str(fasth3), "--lora", str(turbo)], "stacks with no other LoRA"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and __import__("re").search(message, err), (argv, err)
