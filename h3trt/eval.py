"""`h3trt eval`: the same requests (same seeds) through an engine bundle and a reference, compared step by step.

  0. check both sides against every request before either loads (`evaluate`; `reference_entry` for --reference)
  1. run every request through the engine (A), its DiT wrapped in a StepRecorder that keeps a copy of the latents
     entering each evaluation; keep the final latents, the decoded frames and the waveform; free it
  2. the same through the reference (B: another bundle, a checkpoint folder, or "tiny")
  3. per request and mean: latent relative error per step (video and audio target rows), decoded-video PSNR and SSIM,
     audio log-spectral distance

Random weights (the tiny model, a fake full-size checkpoint) make picture quality meaningless: on them these numbers
measure how far a precision moves the computation, not how good the clip looks.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .engines.manifest import MANIFEST
from .errors import UserError
from .models.packing import unpatchify
from .runtime.entry import Entry
from .runtime.pipeline import H3Pipeline
from .runtime.request import Prepared, Request, prepare

PSNR_CAP_DB = 100.0  # identical outputs: reported as 100 dB, not infinity (JSON has no infinity)
SSIM_WINDOW, SSIM_SIGMA = 11, 1.5  # Wang et al. 2004
LSD_FFT, LSD_HOP, LSD_EPS = 1024, 256, 1e-10


@dataclass
class Trace:
    """What one request produced on one side: latents entering each evaluation and after the last, decoded media."""

    video_steps: list[torch.Tensor]  # [V_target, C] per step (after step 1 .. after the last), fp32
    audio_steps: list[torch.Tensor]
    frames: torch.Tensor  # [T, 3, H, W] in [0, 1], fp32
    waveform: torch.Tensor  # [2, N]


class StepRecorder:
    """A DiT runner (EagerDiT's signature) that keeps a copy of the latent rows each evaluation receives, then runs the
    DiT it wraps. A pipeline is built with it as its DiT (`load_recording`).

    A copy, not the rows themselves: the sampler steps its latents in place (models/sampler.py `denoise_batch`), and
    on the CPU `.float().cpu()` of fp32 rows returns the same storage, so every step would read as the last one."""

    def __init__(self, dit):
        self.dit, self.cfg = dit, dit.cfg
        self.inputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # per evaluation: (video [V, C], audio [A, C]), fp32

    def __call__(self, video, audio, text, unique_t, t_index, layout, **kwargs):
        self.inputs.append((video[0].to("cpu", torch.float32, copy=True),
                            audio[0].to("cpu", torch.float32, copy=True)))
        return self.dit(video, audio, text, unique_t, t_index, layout, **kwargs)  # kwargs: the step cache


def load_recording(source: Entry, task: str) -> H3Pipeline:
    """`source`'s pipeline for `task` with a StepRecorder as its DiT, passed in when the pipeline is built. The
    default canvas: the requests carry theirs (given, or the engine bundle's profile's)."""
    parts = source.components(task)
    return H3Pipeline.from_components(replace(parts, dit=StepRecorder(parts.dit)), source.device)


@torch.no_grad()
def trace(pipeline: H3Pipeline, prepared: Prepared) -> Trace:
    """One prepared request (runtime/request.py `prepare`, default canvas) through a pipeline whose DiT is a
    StepRecorder (`load_recording`)."""
    recorder = pipeline.dit
    if not isinstance(recorder, StepRecorder):
        raise TypeError(f"trace needs a pipeline built with a StepRecorder as its DiT (eval.load_recording), got "
                        f"{type(recorder).__name__}.")
    recorder.inputs.clear()
    _, layout, final = pipeline.denoise_request(prepared)
    cv, ca = layout.num_condition_video_rows, layout.num_condition_audio_rows
    video_steps = [v[cv:] for v, _ in recorder.inputs[1:]] + [final.video[cv:].float().cpu()]
    audio_steps = [a[ca:] for _, a in recorder.inputs[1:]] + [final.audio[ca:].float().cpu()]
    geo, cfg = prepared.geometry, recorder.cfg
    latents = unpatchify(final.video[cv:], (cfg.in_channels, geo.latent_frames, geo.latent_height, geo.latent_width),
                         cfg.patch_size)
    frames = torch.cat([chunk[0].float().cpu() for chunk in pipeline.video_vae.decode_stream(latents)], dim=1)
    waveform = pipeline.audio_vae.decode_rows(final.audio[ca:]).float().cpu().clamp(-1, 1)
    return Trace(video_steps, audio_steps, frames.permute(1, 0, 2, 3).clamp(0, 1), waveform)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Over all frames, both in [0, 1]; capped at PSNR_CAP_DB."""
    mse = F.mse_loss(a.double(), b.double()).item()
    return PSNR_CAP_DB if mse == 0 else min(PSNR_CAP_DB, 10.0 * math.log10(1.0 / mse))


def ssim(a_T3HW: torch.Tensor, b_T3HW: torch.Tensor) -> float:
    """Mean SSIM of the luma (BT.601) frames, Gaussian window 11 / sigma 1.5, valid region."""
    device = a_T3HW.device  # on the frames' device (scripts/bench_vae.py scores full-size frames on the GPU)
    weights = torch.tensor([0.299, 0.587, 0.114], dtype=torch.float64, device=device).view(1, 3, 1, 1)
    x, y = ((t.double() * weights).sum(1, keepdim=True) for t in (a_T3HW, b_T3HW))
    coords = torch.arange(SSIM_WINDOW, dtype=torch.float64, device=device) - SSIM_WINDOW // 2
    g = torch.exp(-coords ** 2 / (2 * SSIM_SIGMA ** 2))
    g = g / g.sum()
    window = (g[:, None] * g[None, :]).view(1, 1, SSIM_WINDOW, SSIM_WINDOW)

    def blur(t):
        return F.conv2d(t, window)

    c1, c2 = 0.01 ** 2, 0.03 ** 2
    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx ** 2, blur(y * y) - my ** 2, blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return s.mean().item()


def log_spectral_distance(a_CN: torch.Tensor, b_CN: torch.Tensor) -> float:
    """dB: per STFT frame sqrt(mean over bins of (10 log10 Pa - 10 log10 Pb)^2), averaged over frames and channels."""
    window = torch.hann_window(LSD_FFT, dtype=torch.float64)

    def power_db(w):
        spec = torch.stft(w.double(), LSD_FFT, LSD_HOP, window=window, return_complex=True)
        return 10.0 * torch.log10(spec.abs() ** 2 + LSD_EPS)

    return (power_db(a_CN) - power_db(b_CN)).pow(2).mean(dim=-2).sqrt().mean().item()


def compare(a: Trace, b: Trace) -> dict:
    video = [rel_err(x, y) for x, y in zip(a.video_steps, b.video_steps)]
    audio = [rel_err(x, y) for x, y in zip(a.audio_steps, b.audio_steps)]
    return {"latent_rel_err_per_step": {"video": video, "audio": audio},
            "final_latent_rel_err": {"video": video[-1], "audio": audio[-1]},
            "psnr_db": psnr(a.frames, b.frames), "ssim": ssim(a.frames, b.frames),
            "audio_lsd_db": log_spectral_distance(a.waveform, b.waveform)}


def reference_entry(reference: str, device: str) -> Entry:
    """`eval --reference`, resolved before anything runs: 'tiny' (the embedded model, eager), a bundle (a folder with
    a manifest, which is read and checked here), or a checkpoint (its layout is checked against the requests' task
    by `evaluate`, before either side loads)."""
    if reference == "tiny":
        return Entry.resolve(device=device)
    path = Path(reference)
    if not path.exists():
        raise UserError(f"--reference {reference} does not exist; pass an engine bundle (h3trt build), a MiniMax-H3 "
                        "checkpoint folder, or 'tiny'.")
    if (path / MANIFEST).exists():
        return Entry.resolve(engine=path, device=device)
    return Entry.resolve(model=path, device=device)


def evaluate(engine: Entry, reference: Entry, reqs: list[Request], log=print) -> dict:
    """`reqs` (h3trt/runtime/requests.py: read_eval_requests) through the engine bundle and the reference, on the
    engine's device, one side in memory at a time. Both sides are checked against every request first (a missing or
    wrong checkpoint, a bundle not built for a request's task, canvas or schedule), so neither fails after the other
    ran."""
    if engine.manifest is None:
        raise UserError(f"--engine {engine.root} must be a bundle (h3trt build); the reference may be any model.")
    manifest = engine.manifest
    tasks = {r.task == "ref2va" for r in reqs}
    if len(tasks) > 1:
        raise UserError("--requests mixes ref2va with t2va/fl2va requests; they use different partitions. Evaluate "
                        "them in separate runs.")
    task = reqs[0].task
    prepared = [prepare(r) for r in reqs]  # the default canvas: each request's is given or the engine's profile's
    for source in (engine, reference):
        source.component_root(task)  # a checkpoint without the task's transformer fails here (CheckpointError)
        for p in prepared:
            source.admit(p)
    traces = {}
    for side, source in (("engine", engine), ("reference", reference)):
        pipeline = load_recording(source, task)
        traces[side] = []
        for i, p in enumerate(prepared):
            traces[side].append(trace(pipeline, p))
            log(f"{side}: request {i + 1}/{len(reqs)} done")
        del pipeline  # one side in memory at a time: two full-size DiTs would not fit one GPU
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    per_request = [{"prompt": r.prompt, "seed": r.seed, **compare(a, b)}
                   for r, a, b in zip(reqs, traces["engine"], traces["reference"])]
    keys = ("psnr_db", "ssim", "audio_lsd_db")
    mean = {k: sum(p[k] for p in per_request) / len(per_request) for k in keys}
    for modality in ("video", "audio"):
        steps = [p["latent_rel_err_per_step"][modality] for p in per_request]
        mean[f"latent_rel_err_per_step_{modality}"] = [sum(s) / len(s) for s in zip(*steps)]
        mean[f"final_latent_rel_err_{modality}"] = mean[f"latent_rel_err_per_step_{modality}"][-1]
    return {"engine": str(engine.root), "engine_precision": manifest.precision,
            "engine_quant": _quant_summary(manifest), "reference": "tiny" if reference.source == "tiny" else str(reference.root), "device": engine.device, "requests": per_request, "mean": mean}


def _quant_summary(manifest) -> dict | None:
    quant = manifest.quant
    return None if quant is None else {k: v for k, v in quant.items() if k != "amax"}


def table(result: dict) -> str:
    rows = [f"engine {result['engine']} ({result['engine_precision']}) vs reference {result['reference']}",
            "| request | seed | final latent rel. err (video / audio) | PSNR dB | SSIM | audio LSD dB |",
            "|---|---|---|---|---|---|"]
    for p in result["requests"]:
        f = p["final_latent_rel_err"]
        rows.append(f"| {p['prompt'][:40]} | {p['seed']} | {f['video']:.2e} / {f['audio']:.2e} | {p['psnr_db']:.2f} | "
                    f"{p['ssim']:.4f} | {p['audio_lsd_db']:.3f} |")
    m = result["mean"]
    rows.append(f"| **mean** | | {m['final_latent_rel_err_video']:.2e} / {m['final_latent_rel_err_audio']:.2e} | "
                f"{m['psnr_db']:.2f} | {m['ssim']:.4f} | {m['audio_lsd_db']:.3f} |")
    rows.append("latent rel. err per step (video, mean): " +
                " ".join(f"{e:.1e}" for e in m["latent_rel_err_per_step_video"]))
    return "\n".join(rows)
