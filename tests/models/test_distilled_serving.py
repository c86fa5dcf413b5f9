"""What a distilled model runs besides its fused weights (issue 47 items 1, 2 and 5), without building a bundle: an
alpha-less LightX2V Turbo file served as a resident adapter at its family's alpha (as --distilled fuses it), fp8
calibration of a distilled bundle on its family's own schedule (rungs and all), a request's VSA sparsity, and a VSA
kernel whose output differs from the definition left out of the choice, loudly.

Tolerances: the adapter's side branch against the merged weights (fp32, CPU, a whole 2-forward denoise of the tiny
model): max abs error <= ATOL on the final latents, while the 16x stronger diffusers-rule merge moves them by > 100 x
that. A kernel's warm-up check: vsa_kernels.WARM_TOLERANCE (the test exercises it, not its own)."""

import types

import pytest
import torch

from h3trt.adapters.merge import LoraSpec
from h3trt.adapters.spec import AdapterSpec
from h3trt.adapters.use import AdapterUse
from h3trt.build import builder
from h3trt.build.config import BuildConfig, Profile
from h3trt.errors import UserError
from h3trt.jobs.model_source import Entry, ModelSource
from h3trt.models.vsa import kernels as vsa_kernels
from h3trt.models.config import H3Config
from h3trt.models.distilled.families import DistilledSpec
from h3trt.models.distilled.schedule import pdd_schedule
from h3trt.models.distilled.writer import write_fasth3, write_pdd, write_turbo
from h3trt.models.sampler import Schedule
from h3trt.models.vsa.plan import (VsaServing, VsaSettings, check_vsa_request, choose_vsa_kernel, request_vsa_run,
                                   served_vsa_settings)
from h3trt.pipeline.prepare import prepare
from h3trt.request.parse import parse_object
from h3trt.request.request import Request

CFG = H3Config.tiny()
ATOL = 1e-5


def denoised(entry: Entry, request: Request):
    return entry.load("t2va").denoise_request(prepare(request, entry.model.canvas))[2]


def test_an_alpha_less_turbo_adapter_runs_at_its_familys_alpha(tmp_path, tiny_cache):
    """LightX2V's alpha-less Turbo file (rank 16 here) as `--adapter` runs at alpha 8 / rank, as `--distilled` fuses
    it: no `:0.5` needed (rank 128: 0.0625). `--lora` keeps diffusers' rule (alpha == rank), the oracle's."""
    turbo = write_turbo(tmp_path / "turbo.safetensors", CFG, seed=3, rank=16, refiner=False,
                        metadata={"h3trt.steps": "5", "h3trt.video_shift": "6"})
    schedule = {"steps": 3, "video_shift": 6.0, "audio_shift": 3.0}  # any count: Turbo is a LoRA
    adapter = denoised(Entry.local(device="cpu", adapters=(AdapterSpec("t", turbo),)),
                       Request.of("a fox", lora=(AdapterUse("t"),), **schedule))
    fused = denoised(Entry.local(ModelSource.resolve(distilled=DistilledSpec(turbo)), "cpu"),
                     Request.of("a fox", **schedule))
    diffusers_rule = denoised(Entry.local(ModelSource.resolve(loras=(LoraSpec(turbo),)), "cpu"),
                              Request.of("a fox", **schedule))
    for got, want, other in ((adapter.video, fused.video, diffusers_rule.video),
                             (adapter.audio, fused.audio, diffusers_rule.audio)):
        assert (got - want).abs().max().item() <= ATOL
        assert (other - want).abs().max().item() > 100 * ATOL  # alpha == rank is another model


# ---- calibration on the family's schedule ---------------------------------------------------------------------------

@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a fox\n")
    return path


def fp8_config(root, out, prompts, spec, **kw) -> BuildConfig:
    return BuildConfig(root, out, precision="fp8", calib_prompts=prompts, profiles=(Profile(160, 96, 5.0),),
                       device="cpu", distilled=DistilledSpec.parse(str(spec)), **kw)


def test_a_distilled_bundle_calibrates_on_its_familys_rungs(tiny_root, tmp_path, prompts, monkeypatch):
    fasth3 = write_fasth3(tmp_path / "f.safetensors", CFG)
    config = fp8_config(tiny_root, tmp_path / "b", prompts, fasth3)
    served = config.schedules((12.0, 3.0))[0]
    assert served.rungs == (0.999, 0.749, 0.5, 0.25)
    assert config.calibration_steps == 5 and config.calibration_schedule(served) == served
    # --calib-steps 3: the family's first 2 forwards exactly (the same timesteps), not a 3-point uniform grid
    short = fp8_config(tiny_root, tmp_path / "b", prompts, fasth3, calib_steps=3).calibration_schedule(served)
    assert short.timesteps() == served.timesteps()[:2] and short.timesteps() != Schedule(3, 12.0, 3.0).timesteps()
    with pytest.raises(UserError, match="--calib-steps 7: a distilled bundle calibrates on its family's schedule of "
                                        "5 grid points") as info:
        fp8_config(tiny_root, tmp_path / "b", prompts, fasth3, calib_steps=7)
    assert "\n" not in str(info.value)
    # PDD's 8 forwards (9 points, over the 8-point cap of a base bundle): the whole family schedule by default
    pdd = fp8_config(tiny_root, tmp_path / "b", prompts, write_pdd(tmp_path / "p.safetensors", CFG))
    assert pdd.calibration_steps == 9
    assert pdd.calibration_schedule(pdd_schedule(8).schedule) == pdd_schedule(8).schedule
    # A base bundle keeps its capped uniform grid at the served shifts
    base = BuildConfig(tiny_root, tmp_path / "b", precision="fp8", calib_prompts=prompts, steps=50,
                       profiles=(Profile(160, 96, 5.0),), device="cpu")
    assert base.calibration_schedule(Schedule(50, 5.0, 3.0)) == Schedule(8, 5.0, 3.0)
    # The build's calibration phase hands the trajectories that schedule.
    seen = {}

    def fake_calibrate_dit(model, recipe, root, calib_prompts, profile, schedule, **kw):
        seen["schedule"] = schedule
        return recipe, {}

    monkeypatch.setattr(builder, "calibrate_dit", fake_calibrate_dit)
    plan = types.SimpleNamespace(fp8_kernel="", vsa_kernel=None)
    dit = types.SimpleNamespace(model=None, source=types.SimpleNamespace(component_root=tiny_root),
                                schedules=(served,))
    builder.calibrate(config, plan, dit, log=lambda m: None)
    assert seen["schedule"] == served and seen["schedule"].rungs == served.rungs


# ---- a request's VSA sparsity ------------------------------------------------------------------------------------

def test_a_requests_vsa_sparsity(tmp_path):
    serving = VsaServing(served_vsa_settings(None), "reference")
    dense = request_vsa_run(serving, False, 0.0)
    assert dense.settings.sparsity == 0.0 and dense.report()["sparsity_from"] == "the request's vsa_sparsity"
    assert request_vsa_run(serving, False).settings.sparsity == 0.9  # the model's
    assert request_vsa_run(None, False) is None
    for call, match in ((lambda: check_vsa_request(None, False, 0.5), "vsa_sparsity sets a FastH3-VSA model's VSA"),
                        (lambda: check_vsa_request(serving, True, None), "SubBlock's sparse_attention does not apply"),
                        (lambda: parse_object({"prompt": "a", "vsa_sparsity": 1.5}, 1, tmp_path, ("prompt",)),
                         "vsa_sparsity is the share of video key tiles")):
        with pytest.raises(UserError, match=match) as info:
            call()
        assert "\n" not in str(info.value)
    line = parse_object({"prompt": "a", "vsa_sparsity": 0}, 1, tmp_path, ("prompt",))
    assert line.request.speed.vsa_sparsity == 0.0


def test_run_vsa_sparsity_on_a_model_without_the_gate_is_one_line(h3trt, tmp_path, tiny_root):
    code, err = h3trt("run", "--model", str(tiny_root), "--prompt", "a fox", "--output", str(tmp_path / "x.mp4"),
                      "--quiet", "--steps", "2", "--vsa-sparsity", "0.5")
    assert code == 2 and len(err) == 1 and "vsa_sparsity sets a FastH3-VSA model's VSA" in err[0], err


# ---- the VSA kernel's warm-up check ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_vsa_kernel_that_computes_the_definition_passes_its_warm_up(monkeypatch, dtype):
    """flex on the CPU (its unfused implementation) is the definition within WARM_TOLERANCE: the check takes it."""
    monkeypatch.setattr(vsa_kernels, "vsa_kernel_problem", lambda kernel, device: None)
    vsa_kernels.warm_vsa_kernel("flex", "cpu", 2, 16, dtype)


def test_a_vsa_kernel_whose_output_differs_is_left_out_loudly(monkeypatch):
    """A kernel that runs but misreads the masks (here: flex attending pad rows too, as an FA4 whose mask_mod
    plumbing differed from h3trt's stand-in would) fails its warm-up; the choice leaves it out with why, logs it and
    records it, and a load that asks for it refuses."""
    real = vsa_kernels.flex_vsa_attention

    def misread(q, k, v, index, sparse_G, sizes, compiled):
        return real(q, k, v, index, sparse_G, torch.full_like(sizes, vsa_kernels.VSA_TILE_ROWS), compiled)

    monkeypatch.setattr(vsa_kernels, "flex_vsa_attention", misread)
    monkeypatch.setattr(vsa_kernels, "vsa_kernel_problem", lambda kernel, device: None if kernel != "fa4" else "no fa4")
    lines = []
    kernel, left_out = choose_vsa_kernel("cpu", 2, 16, torch.float32, lines.append)
    assert kernel == "reference" and set(left_out) == {"fa4", "flex"}
    assert "differs from the fp32 reference on the warm-up tiles" in left_out["flex"]
    assert any(line.startswith("VSA kernel flex left out: the flex VSA kernel does not run on cpu") for line in lines)
    served = VsaServing(VsaSettings(), kernel, left_out)
    assert VsaServing.from_dict(served.to_dict()).left_out == left_out  # recorded in a bundle's manifest


def test_max_batch_on_a_fasth3_vsa_model_is_refused_before_any_job(h3trt, tmp_path, tiny_root):
    """VSA counts one request's evaluations, so a FastH3-VSA model never shares a denoise: --max-batch 2 is one line at
    start (before it, serve's batch claim paired such jobs and the pipeline then failed both)."""
    vsa = write_fasth3(tmp_path / "fasth3-vsa.safetensors", CFG, seed=3, gates=True)
    plain = write_fasth3(tmp_path / "fasth3.safetensors", CFG, seed=3)
    requests = tmp_path / "r.jsonl"
    # The cheapest canvas (tests/serving.py SMALL's): a tiny model named by its path is no embedded default, so lines
    # without one ran the plain model's two clips at the full-size default canvas (3 minutes of CI for a batch check).
    line = '{"id": "%s", "task": "t2va", "prompt": "a %s", "width": 128, "height": 32}\n'
    requests.write_text(line % ("a", "fox") + line % ("b", "cat"))
    for file, refused in ((vsa, True), (plain, False)):
        code, err = h3trt("run", "--model", str(tiny_root), "--distilled", str(file), "--requests", str(requests),
                          "--out-dir", str(tmp_path / file.stem), "--max-batch", "2", "--quiet")
        if refused:
            assert code == 2 and len(err) == 1 and "a FastH3-VSA model denoises each request alone" in err[0], err
            assert not (tmp_path / file.stem).exists() or not any((tmp_path / file.stem).iterdir())
        else:
            assert code == 0, err
