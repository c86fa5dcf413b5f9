"""`h3trt eval` without a bundle build: the latents it records per step (a synthetic DiT whose trajectory is known),
the checks it makes on both sides before either runs, and the DiT runners passed in when a pipeline or an engine is
built rather than swapped in afterwards."""

from __future__ import annotations

import ast
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import h3trt.eval as eval_module
from h3trt.cli import main
from h3trt.errors import UserError
from h3trt.eval import StepRecorder, compare, reference_entry, trace
from h3trt.models.runner import NO_EXTRAS, RunnerCaps
from h3trt.models.sampler import euler_step, initial_latents
from h3trt.pipeline.loading import load_checkpoint
from h3trt.pipeline.h3_pipeline import H3Pipeline
from h3trt.request.request import Request
from h3trt.pipeline.prepare import prepare

from helpers import REPO
from stand_ins import manifest_dict

pytestmark = pytest.mark.unit

PACKAGE = REPO / "h3trt"
REQUEST = Request.of("a red fox runs through fresh snow", seed=3, steps=5, width=160, height=96)


class ScaledVelocity:
    """A synthetic DiT: the velocity is `scale` times the rows it is given, so the trajectory is known in closed
    form (each Euler step scales the rows)."""

    caps = RunnerCaps()

    def __init__(self, cfg, scale: float):
        self.cfg, self.scale = cfg, scale

    def __call__(self, video, audio, text, unique_t, t_index, layout, extras=NO_EXTRAS):
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
    start = initial_latents(REQUEST.inputs.seed, geo.latent_frames, geo.latent_height, geo.latent_width, geo.audio_latents,
                            cfg.patch_size, cfg.in_channels, cfg.audio_in_channels)
    video, audio, sv, sa = start.video, start.audio, schedule.video_sigmas, schedule.audio_sigmas
    assert len(got.video_steps) == len(got.audio_steps) == schedule.num_evaluations == REQUEST.schedule.steps - 1
    for i, (tv, ta) in enumerate(schedule.timesteps()):
        video, audio = euler_step(video, video, tv, sv[i], sv[i + 1]), euler_step(audio, audio, ta, sa[i], sa[i + 1])
        assert torch.equal(got.video_steps[i], video) and torch.equal(got.audio_steps[i], audio), f"step {i + 1}"


def test_per_step_error_grows_from_step_to_step(parts, unit_trace):
    """Two runners that differ by 1% in velocity drift apart step by step: every step's error is its own."""
    result = compare(trace(_pipeline(parts, 1.01), prepare(REQUEST)), unit_trace)
    for modality in ("video", "audio"):
        errors = result["latent_rel_err_per_step"][modality]
        assert len(errors) == REQUEST.schedule.steps - 1 and errors[0] > 0
        assert all(a < b for a, b in zip(errors, errors[1:])), (modality, errors)


def test_trace_refuses_a_pipeline_without_a_recorder(parts):
    with pytest.raises(TypeError, match="StepRecorder"):
        trace(H3Pipeline.from_components(parts, "cpu"), prepare(REQUEST))


# ----------------------------------------------------------------------------------------------------------------------
# The reference, checked before either side runs


def _bundle(root: Path, **changes) -> Path:
    """A folder with a valid manifest (a tiny fp32 CPU bundle's, 6 steps): enough for everything eval checks first."""
    root.mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps(manifest_dict(**{"schedule.steps": 6, **changes})))
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
    assert reference_entry(str(_bundle(tmp_path / "b")), "cpu").model.kind == "bundle"
    assert reference_entry("tiny", "cpu").model.kind == "tiny"


# ----------------------------------------------------------------------------------------------------------------------
# Runners are passed in when a pipeline or an engine is built


# Assignments of these attributes on an object after it was built switch its behaviour; runners are passed in when
# it is built instead (docs/architecture.md, "The layers").
SWITCHES = ("dit", "video_decoders", "tile_decoders", "cfg_group")
# Where one is still made (none since load_bundle builds the video VAE with its tile decoders: with_tile_decoders).
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

    manifest = Manifest.from_dict(manifest_dict())
    assert Engine(Path("b"), manifest, None, {}, compiled_video_decoder=False).video_decoders(None) is None
    assert Engine(Path("b"), manifest, None, {}).video_decoders(None) == {}  # an Inductor bundle's, here none


# ----------------------------------------------------------------------------------------------------------------------
# SSIM and PSNR in YUV420, against FFmpeg's own ssim and psnr filters (PyAV's bundled FFmpeg, libavfilter)


def ffmpeg_filter(name: str, planes_a, planes_b) -> list[dict]:
    """Per-frame metadata of FFmpeg's `name` filter (ssim or psnr) over yuv420p frame pairs."""
    from fractions import Fraction

    import av

    (t, h, w), graph = planes_a[0].shape, av.filter.Graph()
    sources = [graph.add_buffer(width=w, height=h, format="yuv420p", time_base=Fraction(1, 24)) for _ in range(2)]
    node, sink = graph.add(name), graph.add("buffersink")
    sources[0].link_to(node, 0, 0)
    sources[1].link_to(node, 0, 1)
    node.link_to(sink)
    graph.configure()
    out = []
    for i in range(t):
        for source, planes in zip(sources, (planes_a, planes_b)):
            frame = av.VideoFrame.from_ndarray(torch.cat([p[i].reshape(-1) for p in planes]).view(h * 3 // 2, w)
                                               .numpy(), format="yuv420p")
            frame.pts = i
            source.push(frame)
        out.append({k.rsplit(".", 1)[-1] if name == "ssim" else k[len("lavfi.psnr."):]: float(v)
                    for k, v in sink.pull().metadata.items()})
    return out


def frames_pair(t=3, h=60, w=100):
    """Smooth frames plus noise, and a copy with more noise: SSIM well inside (0, 1). 100x60: the chroma planes (50x30)
    are not whole 4x4 blocks, so the pixels FFmpeg leaves out are left out here too."""
    g = torch.Generator().manual_seed(5)
    ramp = torch.linspace(0, 1, w).view(1, 1, 1, w) * torch.linspace(0.2, 0.9, h).view(1, 1, h, 1)
    a = (ramp.expand(t, 3, h, w) * torch.tensor([1.0, 0.6, 0.3]).view(1, 3, 1, 1)
         + 0.05 * torch.randn(t, 3, h, w, generator=g)).clamp(0, 1)
    return a, (a + 0.08 * torch.randn(t, 3, h, w, generator=g)).clamp(0, 1)


def test_ssim_yuv420_is_ffmpegs():
    a, b = frames_pair()
    got = eval_module.yuv420_metrics(a, b)
    per_frame = ffmpeg_filter("ssim", eval_module.yuv420_planes(a), eval_module.yuv420_planes(b))
    want = sum(f["All"] for f in per_frame) / len(per_frame)
    assert 0.3 < want < 0.95, want  # a pair that tells the windows apart
    assert abs(got["ssim_yuv420"] - want) < 2e-6, (got, want)  # FFmpeg prints 6 decimals
    for plane in "yuv":
        mean = sum(f[plane.upper()] for f in per_frame) / len(per_frame)
        assert abs(got["ssim_yuv420_planes"][plane] - mean) < 2e-6


def test_psnr_yuv420_is_ffmpegs_average():
    a, b = frames_pair()
    got = eval_module.yuv420_metrics(a, b)["psnr_yuv420_db"]
    per_frame = ffmpeg_filter("psnr", eval_module.yuv420_planes(a), eval_module.yuv420_planes(b))
    mse = sum(f["mse_avg"] for f in per_frame) / len(per_frame)  # FFmpeg's average: of the frames' MSE, then dB
    assert abs(got - 10 * math.log10(255 ** 2 / mse)) < 1e-4, got
    same = eval_module.yuv420_metrics(a, a)
    assert abs(same["ssim_yuv420"] - 1.0) < 1e-12 and same["psnr_yuv420_db"] == eval_module.PSNR_CAP_DB


# ----------------------------------------------------------------------------------------------------------------------
# eval --profile: a profile's clip against the lossless clip of the same request, end to end on the tiny model


def test_eval_needs_a_reference_or_a_profile(tmp_path, no_model_load, capsys):
    requests = tmp_path / "r.jsonl"
    requests.write_text('{"prompt": "a fox", "steps": 8, "resolution": "160x96"}\n')
    assert main(["eval", "--engine", "tiny", "--requests", str(requests), "--device", "cpu"]) == 2
    assert "needs --reference" in capsys.readouterr().err
    requests.write_text('{"prompt": "a fox", "steps": 8, "resolution": "160x96", "profile": "fast"}\n')
    assert main(["eval", "--engine", "tiny", "--profile", "balanced", "--requests", str(requests),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "request(s) 1 of --requests state their own" in err[0], err


class LatentVAEs:
    """Stand-in VAEs whose output is a fixed function of the latents (the tiny VAEs' real decode of a 5 s clip takes
    minutes on two busy cores; the metrics themselves are checked against FFmpeg above): frames are the sigmoid of
    the first three latent channels, upsampled to 48x32; audio the tanh of the rows, stretched to 4096 samples."""

    def decode_stream(self, latents):
        x = torch.sigmoid(latents[:, :3].float())
        yield torch.nn.functional.interpolate(x, size=(x.shape[2], 32, 48), mode="nearest")

    def decode_rows(self, rows):
        wave = torch.tanh(rows.float().reshape(1, 1, -1))
        return torch.nn.functional.interpolate(wave, size=4096, mode="linear").expand(2, 1, 4096)[:, 0]


def test_eval_profile_compares_with_the_lossless_run_of_the_same_engine(tmp_path, capsys, monkeypatch, parts):
    """`h3trt eval --engine tiny --profile balanced`, through the command line: the tiny DiT runs each side (8
    steps: 7 evaluations, the 4 of the warm-up and then the cache's), the model loaded once for both sides."""
    loads = []

    def load_recording(source, task, vsa_settings=None):
        assert vsa_settings is None  # the tiny engine has no VSA
        loads.append(source)
        vaes = LatentVAEs()
        return H3Pipeline.from_components(replace(parts, dit=StepRecorder(parts.dit), video_vae=vaes,
                                                  audio_vae=vaes), "cpu")

    monkeypatch.setattr(eval_module, "load_recording", load_recording)
    requests, out = tmp_path / "r.jsonl", tmp_path / "eval.json"
    requests.write_text('{"prompt": "a red fox runs through fresh snow", "seed": 3, "steps": 8, '
                        '"resolution": "160x96"}\n')
    assert main(["eval", "--engine", "tiny", "--profile", "balanced", "--requests", str(requests), "--json", str(out),
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    (r,) = result["requests"]
    assert len(loads) == 1  # one engine serves both sides
    assert result["profile"] == "balanced" and result["reference"] == "tiny, lossless"
    assert result["random_weights"] and "numerical distance, not picture quality" in result["note"]
    assert "numerical distance, not picture quality" in printed and "SSIM YUV420" in printed
    cache = r["step_cache"]
    assert cache["reference"] is None and cache["engine"]["computed"] + cache["engine"]["skipped"] == 7
    assert cache["engine"]["skipped"] >= 1 and cache["engine"]["computed"] >= 5  # the warm-up ran every block
    assert 0 < r["ssim_yuv420"] < 1 and 0 < r["psnr_yuv420_db"] < eval_module.PSNR_CAP_DB  # skips moved the clip
    assert r["latent_rel_err_per_step"]["video"][:4] == [0.0] * 4  # identical through the warm-up
    assert r["audio_lsd_db"] > 0 and r["denoise_s"]["engine"] > 0 and r["denoise_s"]["reference"] > 0
