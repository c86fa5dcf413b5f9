"""`h3trt eval` without a bundle build: the latents it records per step (a synthetic DiT whose trajectory is known),
the checks it makes on both sides before either runs, and the DiT runners passed in when a pipeline or an engine is
built rather than swapped in afterwards."""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import h3trt.eval as eval_module
from h3trt.cli import main
from h3trt.errors import UserError
from h3trt.eval import StepRecorder, compare, reference_entry, trace
from h3trt.models.sampler import euler_step, initial_latents
from h3trt.runtime.loading import load_checkpoint
from h3trt.runtime.pipeline import H3Pipeline
from h3trt.runtime.request import Request, prepare

from test_requests import _manifest_dict

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "h3trt"
REQUEST = Request("a red fox runs through fresh snow", seed=3, steps=5, width=160, height=96)


class ScaledVelocity:
    """A synthetic DiT: the velocity is `scale` times the rows it is given, so the trajectory is known in closed
    form (each Euler step scales the rows)."""

    def __init__(self, cfg, scale: float):
        self.cfg, self.scale = cfg, scale

    def __call__(self, video, audio, text, unique_t, t_index, layout, cache=None):
        return self.scale * video, self.scale * audio


class NoDecode:
    """Stand-in VAEs: the latents are what this file checks, and the tiny audio VAE's decode alone takes ~20 s on two
    busy cores. Shapes as trace reads them: frame chunks [3, T, H, W] (H, W above the SSIM window), [2, N] audio (N
    above the LSD FFT)."""

    def decode_stream(self, latents):
        yield (torch.zeros(3, 2, 16, 16),)

    def decode_rows(self, rows):
        return torch.zeros(2, 2048)


@pytest.fixture(scope="module")
def parts(tiny_root):
    """The tiny model's text encoder (the DiT is replaced below), stand-in VAEs."""
    return replace(load_checkpoint(tiny_root, "t2va", "cpu"), video_vae=NoDecode(), audio_vae=NoDecode())


def _pipeline(parts, scale: float) -> H3Pipeline:
    return H3Pipeline.from_components(replace(parts, dit=StepRecorder(ScaledVelocity(parts.dit.cfg, scale))), "cpu")


@pytest.fixture(scope="module")
def unit_trace(parts):
    """REQUEST's trace under velocity = the rows themselves."""
    return trace(_pipeline(parts, 1.0), prepare(REQUEST))


def test_each_step_records_that_steps_latents(parts, unit_trace):
    """The rows after every step, as the sampler's own Euler update produces them from the seed's noise: before the
    fix every entry held the final rows (the recorder kept a view of the latents the sampler updates in place)."""
    got, prepared = unit_trace, prepare(REQUEST)
    cfg, geo, schedule = parts.dit.cfg, prepared.geometry, _pipeline(parts, 1.0).schedule(REQUEST)
    start = initial_latents(REQUEST.seed, geo.latent_frames, geo.latent_height, geo.latent_width, geo.audio_latents,
                            cfg.patch_size, cfg.in_channels, cfg.audio_in_channels)
    video, audio, sv, sa = start.video, start.audio, schedule.video_sigmas, schedule.audio_sigmas
    assert len(got.video_steps) == len(got.audio_steps) == schedule.num_evaluations == REQUEST.steps - 1
    for i, (tv, ta) in enumerate(schedule.timesteps()):
        video, audio = euler_step(video, video, tv, sv[i], sv[i + 1]), euler_step(audio, audio, ta, sa[i], sa[i + 1])
        assert torch.equal(got.video_steps[i], video) and torch.equal(got.audio_steps[i], audio), f"step {i + 1}"


def test_per_step_error_grows_from_step_to_step(parts, unit_trace):
    """Two runners that differ by 1% in velocity drift apart step by step: every step's error is its own."""
    result = compare(trace(_pipeline(parts, 1.01), prepare(REQUEST)), unit_trace)
    for modality in ("video", "audio"):
        errors = result["latent_rel_err_per_step"][modality]
        assert len(errors) == REQUEST.steps - 1 and errors[0] > 0
        assert all(a < b for a, b in zip(errors, errors[1:])), (modality, errors)


def test_trace_refuses_a_pipeline_without_a_recorder(parts):
    with pytest.raises(TypeError, match="StepRecorder"):
        trace(H3Pipeline.from_components(parts, "cpu"), prepare(REQUEST))


# ----------------------------------------------------------------------------------------------------------------------
# The reference, checked before either side runs


def _bundle(root: Path, **changes) -> Path:
    """A folder with a valid manifest (a tiny fp32 CPU bundle's, 6 steps): enough for everything eval checks first."""
    root.mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps(_manifest_dict(**{"schedule.steps": 6, **changes})))
    return root


@pytest.fixture
def eval_inputs(tmp_path, monkeypatch, no_model_load):
    """An engine bundle and a requests file; any load of either side fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a side was loaded before the reference was checked")

    monkeypatch.setattr(eval_module, "load_recording", refuse, raising=False)
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "a red fox runs through fresh snow", "seed": 3}\n')
    return _bundle(tmp_path / "engine"), requests


@pytest.mark.parametrize("kind, message", [
    ("missing", "does not exist"),
    ("not_a_checkpoint", "is not a MiniMax-H3 checkpoint"),
    ("corrupt_bundle", "manifest.json is corrupted"),
    ("bundle_for_another_canvas", "was not built for 160x96"),
    ("checkpoint_without_the_task", "serves ['ref2va'], not 't2va'"),
])
def test_a_bad_reference_is_refused_before_anything_runs(tmp_path, tiny_root, eval_inputs, capsys, kind, message):
    engine, requests = eval_inputs
    reference = tiny_root / "Ref2VA" if kind == "checkpoint_without_the_task" else tmp_path / "reference"
    if kind == "not_a_checkpoint":
        reference.mkdir()
    if kind == "corrupt_bundle":
        reference.mkdir()
        (reference / "manifest.json").write_text("{")
    if kind == "bundle_for_another_canvas":
        _bundle(reference, profiles=[{"width": 192, "height": 96, "seconds": 5.0, "num_frames": 124}])
    code = main(["eval", "--engine", str(engine), "--reference", str(reference), "--requests", str(requests),
                 "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_reference_entry_names_the_flag_and_what_it_takes(tmp_path):
    with pytest.raises(UserError, match=r"--reference .*missing does not exist; pass an engine bundle \(h3trt "
                                        r"build\), a MiniMax-H3 checkpoint folder, or 'tiny'"):
        reference_entry(str(tmp_path / "missing"), "cpu")
    assert reference_entry(str(_bundle(tmp_path / "b")), "cpu").is_bundle
    assert reference_entry("tiny", "cpu").source == "tiny"


# ----------------------------------------------------------------------------------------------------------------------
# Runners are passed in when a pipeline or an engine is built


# Assignments of these attributes on an object after it was built switch its behaviour (STYLE.md, "Still to retire").
SWITCHES = ("dit", "video_decoders", "tile_decoders", "cfg_group")
# Where one is still made: load_bundle sets the video VAE's compiled tile decoders once the VAE is loaded.
STILL_TO_RETIRE: set[tuple[str, str]] = set()


def attribute_switches(root: Path = PACKAGE) -> set[tuple[str, str]]:
    """(file, attribute) for every `<object>.<attribute> = ...` of SWITCHES outside the object's own methods."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if (isinstance(t, ast.Attribute) and t.attr in SWITCHES
                        and not (isinstance(t.value, ast.Name) and t.value.id == "self")):
                    found.add((path.relative_to(root).as_posix(), t.attr))
    return found


def test_no_runner_is_swapped_in_after_construction():
    """eval.py built its recording pipeline by swapping `pipeline.dit`, and a TensorRT engine had its
    `video_decoders` replaced by a lambda; both now pass theirs in when they are built."""
    assert attribute_switches() <= STILL_TO_RETIRE


def test_a_tensorrt_engine_is_built_without_compiled_video_decoders():
    from h3trt.engines.bundle import Engine
    from h3trt.engines.manifest import Manifest

    manifest = Manifest.from_dict(_manifest_dict())
    assert Engine(Path("b"), manifest, None, {}, compiled_video_decoder=False).video_decoders(None) is None
    assert Engine(Path("b"), manifest, None, {}).video_decoders(None) == {}  # an Inductor bundle's, here none
