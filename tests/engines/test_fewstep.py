"""Few-step LoRA bundles on the CPU: the tiny model with a random LoRA merged, built for an 8-point schedule with a
non-default video shift, served without compiling, equal to the eager LoRA run and to diffusers with the LoRA loaded;
step caching inside the bundle takes the eager path's decisions.

One bundle is built (in a fresh process, the CLI end to end) and shared by the module. Tolerances: fp32; the compiled
DiT matches the eager merged DiT to a relative error (norm) of 1e-5 at every evaluation of the schedule, and
diffusers (peft, unfused) to 2e-5 x max |output|; a clip served from the bundle decodes to frames within 1 uint8
level (mean) of the eager clip.
"""

import hashlib
import json

import numpy as np
import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from safetensors.torch import load_file, save_file

from h3trt.adapters.merge import LoraSpec, merge_loras
from h3trt.build.adaln import schedule_timesteps
from h3trt.build.config import BuildConfig, Profile
from h3trt.cli import main
from h3trt.engines.bundle import Engine
from h3trt.engines.guard import no_compile
from h3trt.engines.manifest import read_manifest
from h3trt.media.inputs import read_video
from h3trt.models.checkpoint.reader import load_dit
from h3trt.models.dit import EagerDiT
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.sampler import Schedule
from h3trt.models.step_cache import StepCache, StepCacheConfig
from h3trt.models.tiny import TINY_HEIGHT, TINY_REFERENCE_SHORT_EDGE, TINY_WIDTH
from h3trt.pipeline.h3_pipeline import H3Pipeline
from h3trt.pipeline.prepare import prepare
from h3trt.request.request import CanvasDefaults, Request
from lora_cases import ReferencePipe, every_linear_lora

STEPS, VIDEO_SHIFT, SCALE = 8, 5.0, 0.7
SCHEDULE = Schedule(STEPS, VIDEO_SHIFT, 3.0)
REL_TOL = 1e-5
CANVAS = CanvasDefaults(short_edge=TINY_HEIGHT, max_pixels=TINY_WIDTH * TINY_HEIGHT,
                        reference_short_edge=TINY_REFERENCE_SHORT_EDGE)


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory, tiny_cfg):
    """An ai-toolkit style file (diffusion_model. prefix, __metadata__ alpha) over every Linear of the main blocks,
    the refiner, the embeddings and the final layer: AdaLN included, so the baked tables carry it."""
    tensors = every_linear_lora(tiny_cfg, 7, lambda name: 2 if "adaln" in name else 4)
    path = tmp_path_factory.mktemp("lora") / "turbo.safetensors"
    save_file(tensors, str(path), metadata={"alpha": "3"})
    return path


@pytest.fixture(scope="module")
def lora_bundle(bundle_cache, lora_file):
    # A fresh process, as `h3trt build` runs (conftest's BundleCache): a build inside the test process could find
    # kernels earlier tests compiled in memory, which would then never land in the bundle's cache.
    built = bundle_cache.get("--precision", "fp32", "--steps", str(STEPS), "--video-shift", str(VIDEO_SHIFT),
                             "--lora", f"{lora_file}:{SCALE}", timeout=1200)
    assert "merged LoRA turbo.safetensors x 0.7 into FL2VA" in built.stderr
    return built.path


@pytest.fixture(scope="module")
def eager(tiny_root, lora_file):
    model, _ = load_dit(tiny_root, "t2va", torch.float32)
    merge_loras(model, [LoraSpec(lora_file, SCALE)], "t2va")
    return EagerDiT(model)


def test_manifest_records_the_loras_and_the_few_step_schedule(lora_bundle, lora_file):
    m = read_manifest(lora_bundle)
    (lora,) = m.loras
    assert lora["sha256"] == hashlib.sha256(lora_file.read_bytes()).hexdigest() and lora["scale"] == SCALE
    assert lora["partition"] == "FL2VA" and lora["alpha"].startswith("__metadata__ alpha 3")
    assert (m.schedule.steps, m.schedule.video_shift, m.schedule.audio_shift) == (STEPS, VIDEO_SHIFT, 3.0)
    assert m.adaln.baked and m.adaln.timesteps == schedule_timesteps(SCHEDULE).numel()


def _inputs(layout, cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, layout.video_index.numel(), cfg.video_patch_dim, generator=g),
            torch.randn(1, layout.audio_index.numel(), cfg.audio_in_channels, generator=g),
            torch.randn(1, layout.text_index.numel(), cfg.text_dim, generator=g))


def test_bundle_equals_eager_and_diffusers_with_the_lora(lora_bundle, eager, tiny_root, lora_file):
    engine = Engine.load(lora_bundle, "cpu")
    layout = pack_t2va(text_tags_for(11, [range(2, 6)]), 7, 6, 10, 23, keyframes=("first",))
    args = _inputs(layout, eager.cfg)
    with torch.no_grad(), no_compile():
        for tv, ta in SCHEDULE.timesteps():  # every evaluation the baked tables serve (the first: one distinct t)
            unique_t, t_index = row_timesteps(layout, tv, ta)
            for got, want in zip(engine.dit(*args, unique_t, t_index, layout), eager(*args, unique_t, t_index, layout)):
                err = ((got - want).norm() / want.norm()).item()
                assert err <= REL_TOL, f"relative error {err:.2e} at t=({tv}, {ta})"

    # The same LoRA through diffusers: the official shards read by diffusers' converter, the file by its loader.
    state = {}
    for f in sorted((tiny_root / "FL2VA" / "transformer").glob("*.safetensors")):
        state.update(load_file(str(f)))
    ref = MiniMaxH3Transformer3DModel(**eager.cfg.to_diffusers_kwargs())
    ref.load_state_dict(convert_minimax_h3_transformer_checkpoint_to_diffusers(state, ref.config,
                                                                                 qkv_layout="interleaved"))
    ref = ref.float().eval()
    ReferencePipe(ref).load_lora_weights(str(lora_file), adapter_name="turbo")
    ref.set_adapters(["turbo"], [SCALE])
    tv, ta = SCHEDULE.timesteps()[3]
    unique_t, t_index = row_timesteps(layout, tv, ta)
    with torch.no_grad(), no_compile():
        ours = engine.dit(*args, unique_t, t_index, layout)
    with torch.no_grad():
        theirs = ref(hidden_states=args[0], audio_hidden_states=args[1], encoder_hidden_states=args[2],
                     timestep=unique_t, timestep_indices=t_index, token_tags=layout.token_tags,
                     position_ids=layout.position_ids, video_indices=layout.video_index,
                     audio_indices=layout.audio_index, text_indices=layout.text_index, return_dict=False)
    for a, b in zip(ours, theirs):
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert scale > 0.1 and err <= 2e-5 * scale, f"max abs err {err:.3e} vs {scale:.3e}"


def test_run_serves_the_bundle_like_the_eager_lora_run(lora_bundle, lora_file, tmp_path, tiny_cache):
    eager_out, engine_out = tmp_path / "eager.mp4", tmp_path / "engine.mp4"
    assert main(["run", "--prompt", "a fox", "--output", str(eager_out), "--quiet", "--steps", str(STEPS),
                 "--video-shift", str(VIDEO_SHIFT), "--lora", f"{lora_file}:{SCALE}"]) == 0
    # No --steps: a bundle's baked schedule is the run's default.
    assert main(["run", "--engine", str(lora_bundle), "--prompt", "a fox", "--output", str(engine_out),
                 "--quiet"]) == 0
    a, _, _ = read_video(eager_out)
    b, _, _ = read_video(engine_out)
    assert a.shape == b.shape and np.abs(a.astype(np.float32) - b.astype(np.float32)).mean() <= 1.0
    for out in (eager_out, engine_out):
        record = json.loads(out.with_suffix(".json").read_text())
        assert record["evaluations"] == STEPS - 1 and record["loras"][0]["scale"] == SCALE


@pytest.mark.parametrize("config", [StepCacheConfig("first-block", 0.3),
                                    StepCacheConfig("mag", 0.08, (0.99, 0.97, 0.95, 0.9), retention_ratio=0.0)])
def test_cached_bundle_takes_the_eager_decisions(lora_bundle, tiny_root, lora_file, config):
    request = Request.of("a fox", steps=STEPS, video_shift=VIDEO_SHIFT, cache=config)
    results = []
    for pipeline in (H3Pipeline.load(tiny_root, "t2va", "cpu", CANVAS, loras=(LoraSpec(lora_file, SCALE),)),
                     H3Pipeline.load_engine(lora_bundle, "cpu", CANVAS)):
        cache = StepCache(config, SCHEDULE.num_evaluations)
        with no_compile():
            _, _, final = pipeline.denoise_request(prepare(request, CANVAS), cache=cache)
        results.append((final, cache.report()))
    (want, eager_report), (got, bundle_report) = results
    skipped = eager_report["branches"]["cond"]["skipped_steps"]
    assert bundle_report["branches"]["cond"]["skipped_steps"] == skipped
    assert 0 < len(skipped) < SCHEDULE.num_evaluations - 1
    for a, b in ((got.video, want.video), (got.audio, want.audio)):
        assert ((a - b).norm() / b.norm()).item() <= 1e-4


def test_fp8_calibration_runs_on_the_few_step_schedule(tiny_root, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a fox\n")

    def calib(steps, **kw):
        return BuildConfig(tiny_root, tmp_path / "b", precision="fp8", steps=steps, calib_prompts=prompts,
                           profiles=(Profile(160, 96, 5.0),), device="cpu", **kw).calibration_steps

    assert calib(4) == 4 and calib(6) == 6 and calib(8) == 8  # the timesteps the bundle serves
    assert calib(50) == 8 and calib(4, calib_steps=3) == 3  # a 50-step bundle: an 8-point grid; explicit wins


def test_lora_misuse_is_one_clear_line(lora_bundle, lora_file, tmp_path, tiny_cache, capsys):
    ref_only = {k.replace("diffusion_model.", ""): v for k, v in load_file(str(lora_file)).items()}
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_minimax_h3_lora_to_diffusers

    converted = _convert_non_diffusers_minimax_h3_lora_to_diffusers(ref_only)
    ref_file = tmp_path / "ref.safetensors"
    save_file({"transformer_ref" + k.removeprefix("transformer"): v.contiguous() for k, v in converted.items()},
              str(ref_file))
    cases = [
        (["run", "--prompt", "a fox", "--output", str(tmp_path / "a.mp4"), "--lora", str(ref_file)],
         "trained against the Ref2VA partition"),
        (["run", "--engine", str(lora_bundle), "--prompt", "a fox", "--output", str(tmp_path / "b.mp4"), "--lora",
          str(lora_file)], "this bundle was built without LoRA slots"),  # its LoRA is merged; no slots for another
        (["build", "--model", "tiny", "--output", str(tmp_path / "c"), "--device", "cpu", "--lora",
          str(tmp_path / "missing.safetensors")], "does not exist"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(argv) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("h3trt: error:")]
        assert len(err) == 1 and message in err[0], err
