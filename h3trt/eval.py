"""`h3trt eval`: the same requests (same seeds) through an engine bundle and a reference, compared step by step.

  0. check both sides against every request before either loads (`evaluate`; `reference_entry` for --reference)
  1. run every request through the engine (A), its DiT wrapped in a StepRecorder that keeps a copy of the latents
     entering each evaluation; keep the final latents, the decoded frames and the waveform; free it
  2. the same through the reference (B: another bundle, a checkpoint folder, or "tiny")
  3. per request and mean: latent relative error per step (video and audio target rows), decoded-video PSNR and SSIM
     (RGB luma), SSIM and PSNR over every frame in YUV420 as FFmpeg's ssim / psnr filters compute them (the peers'
     metric), audio log-spectral distance; the denoise time of each side

`--profile NAME` (request/fields.py PROFILES) compares that profile's clip with the lossless clip of the same request: the
engine side runs each request with the profile, the reference side (the same engine unless --reference is given)
without step cache or sparsity. Each side's step-cache record says what it computed and skipped.

Random weights (the tiny model, a fake full-size checkpoint) make picture quality meaningless: on them these numbers
measure how far a precision or a profile moves the computation, not how good the clip looks (RANDOM_WEIGHTS_NOTE,
printed and recorded with every result).
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .engines.manifest import MANIFEST
from .errors import UserError
from .jobs.admission import admit
from .jobs.model_source import Entry, ModelSource, SourceKind
from .media.encoder import rgb_to_yuv420
from .models.distilled.families import DistilledSpec
from .models.lora_format import sha256_of
from .models.packing import unpatchify
from .models.runner import NO_EXTRAS, EvalExtras
from .models.vsa.plan import VsaSettings
from .pipeline.evaluation import new_step_cache
from .pipeline.h3_pipeline import H3Pipeline
from .pipeline.prepare import Prepared
from .pipeline.records import StageTimer
from .request.parse import profile_fields
from .request.request import Request

PSNR_CAP_DB = 100.0  # identical outputs: reported as 100 dB, not infinity (JSON has no infinity)
SSIM_WINDOW, SSIM_SIGMA = 11, 1.5  # Wang et al. 2004
LSD_FFT, LSD_HOP, LSD_EPS = 1024, 256, 1e-10
# FFmpeg's ssim filter (x264's): 8x8 windows on a 4-pixel grid, 8-bit constants scaled by the 64 samples of a window.
FF_SSIM_C1 = int(.01 * .01 * 255 * 255 * 64 + .5)
FF_SSIM_C2 = int(.03 * .03 * 255 * 255 * 64 * 63 + .5)
YUV_CHUNK = 8  # frames scored at a time: a full-size clip's 124 frames in float64 at once would take gigabytes
RANDOM_WEIGHTS_NOTE = ("On random weights (the tiny model, a fake full-size checkpoint) these numbers are numerical "
                       "distance, not picture quality.")


@dataclass
class Trace:
    """What one request produced on one side: latents entering each evaluation and after the last, decoded media."""

    video_steps: list[torch.Tensor]  # [V_target, C] per step (after step 1 .. after the last), fp32
    audio_steps: list[torch.Tensor]
    frames: torch.Tensor  # [T, 3, H, W] in [0, 1], fp32
    waveform: torch.Tensor  # [2, N]
    denoise_s: float = 0.0  # the denoise stage's wall time (device synchronised)
    step_cache: dict | None = field(default=None)  # the step cache's record (models/step_cache.py), None: none


class StepRecorder:
    """A DiT runner (EagerDiT's signature) that keeps a copy of the latent rows each evaluation receives, then runs the
    DiT it wraps. A pipeline is built with it as its DiT (`load_recording`).

    A copy, not the rows themselves: the sampler steps its latents in place (models/sampler.py `denoise_batch`), and
    on the CPU `.float().cpu()` of fp32 rows returns the same storage, so every step would read as the last one."""

    def __init__(self, dit, vsa_settings: VsaSettings | None = None):
        self.dit, self.cfg, self.caps = dit, dit.cfg, dit.caps  # it serves what it wraps serves (models/runner.py)
        if self.caps.vsa is not None and vsa_settings is not None:  # the other side's settings, its own kernel
            self.caps = replace(self.caps, vsa=replace(self.caps.vsa, settings=vsa_settings))
        self.inputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # per evaluation: (video [V, C], audio [A, C]), fp32

    def __call__(self, video, audio, text, unique_t, t_index, layout, extras: EvalExtras = NO_EXTRAS):
        self.inputs.append((video[0].to("cpu", torch.float32, copy=True),
                            audio[0].to("cpu", torch.float32, copy=True)))
        return self.dit(video, audio, text, unique_t, t_index, layout, extras)


def load_recording(source: Entry, task: str, vsa_settings: VsaSettings | None = None) -> H3Pipeline:
    """`source`'s pipeline for `task` with a StepRecorder as its DiT, passed in when the pipeline is built. The
    default canvas: the requests carry theirs (given, or the engine bundle's profile's). `vsa_settings`: a FastH3-VSA
    model runs these (the engine bundle's, on the reference side) in place of its own."""
    parts = source.components(task)
    return H3Pipeline.from_components(replace(parts, dit=StepRecorder(parts.dit, vsa_settings)), source.launch.device)


@torch.no_grad()
def trace(pipeline: H3Pipeline, prepared: Prepared) -> Trace:
    """One prepared request (pipeline/prepare.py `prepare`, default canvas) through a pipeline whose DiT is a
    StepRecorder (`load_recording`)."""
    recorder = pipeline.dit
    if not isinstance(recorder, StepRecorder):
        raise TypeError(f"trace needs a pipeline built with a StepRecorder as its DiT (eval.load_recording), got "
                        f"{type(recorder).__name__}.")
    recorder.inputs.clear()
    timer, cache = StageTimer(pipeline.device), new_step_cache(prepared.request, pipeline.schedule(prepared.request))
    _, layout, final = pipeline.denoise_request(prepared, timer=timer, cache=cache)
    cv, ca = layout.num_condition_video_rows, layout.num_condition_audio_rows
    video_steps = [v[cv:] for v, _ in recorder.inputs[1:]] + [final.video[cv:].float().cpu()]
    audio_steps = [a[ca:] for _, a in recorder.inputs[1:]] + [final.audio[ca:].float().cpu()]
    geo, cfg = prepared.geometry, recorder.cfg
    latents = unpatchify(final.video[cv:], (cfg.in_channels, geo.latent_frames, geo.latent_height, geo.latent_width),
                         cfg.patch_size)
    frames = torch.cat([chunk[0].float().cpu() for chunk in pipeline.video_vae.decode_stream(latents)], dim=1)
    waveform = pipeline.audio_vae.decode_rows(final.audio[ca:]).float().cpu().clamp(-1, 1)
    return Trace(video_steps, audio_steps, frames.permute(1, 0, 2, 3).clamp(0, 1), waveform,
                 timer.seconds.get("denoise", 0.0), cache.report() if cache is not None else None)


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


def yuv420_planes(frames_T3HW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Frames in [0, 1] -> the uint8 Y [T, H, W], U and V [T, H/2, W/2] planes the clip's H.264 encoder receives:
    rounded to uint8 as parallel_vae.to_uint8_frames rounds, then media/encoder.py's BT.709 limited-range 4:2:0
    conversion (swscale's). So the metric scores the clip as encoded, without the codec's own loss."""
    t, _, h, w = frames_T3HW.shape
    rgb = (frames_T3HW.permute(0, 2, 3, 1).float() * 255.0).round().to(torch.uint8)
    planes = rgb_to_yuv420(rgb.contiguous()).view(t, -1)
    y, chroma = planes[:, :h * w].view(t, h, w), (h // 2) * (w // 2)
    u = planes[:, h * w:h * w + chroma].view(t, h // 2, w // 2)
    return y, u, planes[:, h * w + chroma:].view(t, h // 2, w // 2)


def ffmpeg_plane_ssim(a_THW: torch.Tensor, b_THW: torch.Tensor) -> torch.Tensor:
    """Per frame [T], FFmpeg's ssim filter on one 8-bit plane: the sums of each 4x4 block, combined into 8x8
    windows at a 4-pixel stride ((H/4 - 1) x (W/4 - 1) windows; pixels past the last whole 4x4 block ignored), SSIM
    per window with FFmpeg's integer constants, the mean over windows. Sums in float64 are exact for 8-bit data."""
    t, h, w = a_THW.shape
    bh, bw = h // 4, w // 4
    if bh < 2 or bw < 2:
        raise ValueError(f"FFmpeg's SSIM needs planes of at least 8x8 pixels, got {w}x{h}.")
    a, b = (x[:, :bh * 4, :bw * 4].double() for x in (a_THW, b_THW))

    def windows(x):  # [T, bh*4, bw*4] -> 8x8 window sums [T, bh - 1, bw - 1]
        blocks = x.view(t, bh, 4, bw, 4).sum((2, 4))
        return blocks[:, :-1, :-1] + blocks[:, 1:, :-1] + blocks[:, :-1, 1:] + blocks[:, 1:, 1:]

    s1, s2, ss, s12 = windows(a), windows(b), windows(a * a + b * b), windows(a * b)
    variances, covariance = ss * 64 - s1 * s1 - s2 * s2, s12 * 64 - s1 * s2
    score = ((2 * s1 * s2 + FF_SSIM_C1) * (2 * covariance + FF_SSIM_C2)
             / ((s1 * s1 + s2 * s2 + FF_SSIM_C1) * (variances + FF_SSIM_C2)))
    return score.mean((1, 2))


def yuv420_metrics(a_T3HW: torch.Tensor, b_T3HW: torch.Tensor) -> dict:
    """SSIM and PSNR over every frame in YUV420, as FFmpeg's ssim and psnr filters report them for a yuv420p pair
    (SGLang's metric for H3's profiles: its tables give SSIM "Y" and "All"): per frame, each plane's SSIM weighted by
    its share of the samples (Y 4/6, U and V 1/6 each), averaged over frames; PSNR from the same weighting of the
    planes' mean squared errors, averaged over frames, then 10 log10(255^2 / mse) (capped at PSNR_CAP_DB)."""
    ssim_sum, plane_sums, mse_sum, frames = 0.0, [0.0, 0.0, 0.0], 0.0, a_T3HW.shape[0]
    for start in range(0, frames, YUV_CHUNK):
        pa, pb = (yuv420_planes(x[start:start + YUV_CHUNK]) for x in (a_T3HW, b_T3HW))
        areas = torch.tensor([p[0].numel() for p in pa], dtype=torch.float64)
        weights = areas / areas.sum()
        per_plane = [ffmpeg_plane_ssim(x, y) for x, y in zip(pa, pb)]  # [T] each
        mse = [(x.double() - y.double()).pow(2).mean((1, 2)) for x, y in zip(pa, pb)]
        ssim_sum += sum(wt * p for wt, p in zip(weights.tolist(), per_plane)).sum().item()
        mse_sum += sum(wt * m for wt, m in zip(weights.tolist(), mse)).sum().item()
        plane_sums = [acc + p.sum().item() for acc, p in zip(plane_sums, per_plane)]
    mse = mse_sum / frames
    return {"ssim_yuv420": ssim_sum / frames,
            "ssim_yuv420_planes": dict(zip("yuv", (p / frames for p in plane_sums))),
            "psnr_yuv420_db": PSNR_CAP_DB if mse == 0 else min(PSNR_CAP_DB, 10.0 * math.log10(255.0 ** 2 / mse))}


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
            "psnr_db": psnr(a.frames, b.frames), "ssim": ssim(a.frames, b.frames), **yuv420_metrics(a.frames, b.frames),
            "audio_lsd_db": log_spectral_distance(a.waveform, b.waveform),
            "denoise_s": {"engine": a.denoise_s, "reference": b.denoise_s},
            "step_cache": {side: None if t.step_cache is None else {k: t.step_cache[k] for k in ("computed", "skipped")}
                           for side, t in (("engine", a), ("reference", b))}}


def reference_entry(reference: str, device: str, distilled: DistilledSpec | None = None) -> Entry:
    """`eval --reference`, resolved before anything runs: 'tiny' (the embedded model, eager), a bundle (a folder with
    a manifest, which is read and checked here), or a checkpoint (its layout is checked against the requests' task
    by `evaluate`, before either side loads); `distilled`: fused into an eager reference (a distilled engine's
    file: the eager merged model)."""
    if reference == SourceKind.TINY:
        return Entry.local(ModelSource.resolve(distilled=distilled), device)
    path = Path(reference)
    if not path.exists():
        raise UserError(f"--reference {reference} does not exist; pass an engine bundle (h3trt build), a MiniMax-H3 "
                        "checkpoint folder, or 'tiny'.")
    if (path / MANIFEST).exists():
        return Entry.local(ModelSource.resolve(engine=path, distilled=distilled), device)
    return Entry.local(ModelSource.resolve(model=path, distilled=distilled), device)


def check_distilled_sides(engine: Entry, reference: Entry) -> None:
    """A distilled engine is compared with the same distilled file on the other side (the eager merged model, or a
    bundle built from it): the same sha256, or one line saying what to pass."""
    def sha(entry: Entry) -> str | None:
        m = entry.model
        if m.manifest is not None:
            return m.manifest.distilled["sha256"] if m.manifest.distilled else None
        return sha256_of(m.distilled.path) if m.distilled is not None else None

    ours, theirs = sha(engine), sha(reference)
    if ours == theirs:
        return
    if ours is not None and theirs is None:
        m = engine.model
        raise UserError(f"--engine {m.root} runs a distilled file ({m.manifest.distilled['file']}, sha256 "
                        f"{ours[:12]}); pass --distilled with that file so the eager reference fuses it too.")
    raise UserError(f"the engine's distilled file (sha256 {str(ours)[:12]}) and the reference's ({str(theirs)[:12]}) "
                    "differ: compare the same distilled checkpoint on both sides.")


def evaluate(engine: Entry, reference: Entry | None, reqs: list[Request], log=print,
             profile: str | None = None) -> dict:
    """`reqs` (h3trt/request/parse.py: read_eval_requests) through the engine and the reference, on the engine's
    device, one model in memory at a time. Both sides are checked against every request first (a missing or wrong
    checkpoint, a bundle not built for a request's task, canvas or schedule), so neither fails after the other ran.
    `profile`: the engine side runs it, the reference side runs lossless; `reference` None: the engine itself (any
    model; loaded once for both sides). Without a profile the engine must be a bundle (what eval measures then is
    what its build changed)."""
    if reference is None and profile is None:
        raise UserError("h3trt eval needs --reference (a bundle, a checkpoint or 'tiny') or --profile NAME (the "
                        "engine's clip with that profile against its own lossless clip).")
    if profile is None and engine.model.manifest is None:
        raise UserError(f"--engine {engine.model.root} must be a bundle (h3trt build); the reference may be any model.")
    if len({r.task == "ref2va" for r in reqs}) > 1:
        raise UserError("--requests mixes ref2va with t2va/fl2va requests; they use different partitions. Evaluate "
                        "them in separate runs.")
    if reference is not None:
        check_distilled_sides(engine, reference)
    task, sources = reqs[0].task, {"engine": engine, "reference": reference or engine}
    sides = {"engine": reqs, "reference": reqs}
    if profile is not None:
        stated = [str(i + 1) for i, r in enumerate(reqs)
                  if r.speed.profile or r.speed.cache or r.speed.sparse_attention]
        if stated:
            raise UserError(f"--profile {profile} sets the engine side's step cache and sparsity, and the reference "
                            f"side runs lossless; request(s) {', '.join(stated)} of --requests state their own "
                            "(profile, cache keys): drop those keys.")
        sides = {"engine": [r.replaced(**profile_fields(profile)) for r in reqs],
                 "reference": [r.replaced(**profile_fields("lossless")) for r in reqs]}
    # Each side's requests admitted to that side's model (jobs/admission.py), on the engine's canvas defaults (a
    # bundle's requests already carry its profile's canvas). The reference's side first: a reference that cannot
    # serve them (another task's checkpoint, a bundle of another canvas) is named before the engine's files are read.
    checked: set[Path] = set()
    prepared = {side: [admit(sources[side], r, canvas=engine.model.canvas, checked=checked) for r in sides[side]]
                for side in ("reference", "engine")}
    traces = _run_sides(sources, prepared, task, log)
    per_request = [{"prompt": r.inputs.prompt, "seed": r.inputs.seed, **compare(a, b)}
                   for r, a, b in zip(reqs, traces["engine"], traces["reference"])]
    manifest = engine.model.manifest
    return {"engine": _name(engine), "engine_precision": manifest.precision if manifest else None,
            "engine_quant": _quant_summary(manifest) if manifest else None, "profile": profile,
            "reference": _name(reference) if reference is not None else f"{_name(engine)}, lossless",
            "device": engine.launch.device, "random_weights": engine.model.tiny or sources["reference"].model.tiny,
            "note": RANDOM_WEIGHTS_NOTE, "requests": per_request, "mean": _means(per_request)}


def _run_sides(sources: dict, prepared: dict, task: str, log) -> dict[str, list[Trace]]:
    """Each side's requests through its source; a source serving both sides is loaded once, and a model leaves
    memory before the next loads (two full-size DiTs would not fit one GPU)."""
    traces, pipeline, loaded = {}, None, None
    for side, source in sources.items():
        if source is not loaded:
            pipeline = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            # A FastH3-VSA reference runs the engine bundle's VSA settings (its --vsa-* flags), its own kernel
            engine = sources["engine"].model.manifest
            engine_vsa = engine.vsa if engine is not None else None
            pipeline = load_recording(source, task, engine_vsa.settings if engine_vsa is not None else None)
            loaded = source
        traces[side] = []
        for i, p in enumerate(prepared[side]):
            traces[side].append(trace(pipeline, p))
            log(f"{side}: request {i + 1}/{len(prepared[side])} done")
    return traces


def _means(per_request: list[dict]) -> dict:
    keys = ("psnr_db", "ssim", "ssim_yuv420", "psnr_yuv420_db", "audio_lsd_db")
    mean = {k: sum(p[k] for p in per_request) / len(per_request) for k in keys}
    for modality in ("video", "audio"):
        steps = [p["latent_rel_err_per_step"][modality] for p in per_request]
        mean[f"latent_rel_err_per_step_{modality}"] = [sum(s) / len(s) for s in zip(*steps)]
        mean[f"final_latent_rel_err_{modality}"] = mean[f"latent_rel_err_per_step_{modality}"][-1]
    seconds = {side: sum(p["denoise_s"][side] for p in per_request) for side in ("engine", "reference")}
    mean["denoise_s"] = {side: total / len(per_request) for side, total in seconds.items()}
    mean["denoise_speedup"] = seconds["reference"] / seconds["engine"] if seconds["engine"] > 0 else None
    return mean


def _name(source: Entry) -> str:
    return "tiny" if source.model.kind.embedded else str(source.model.root)


def _quant_summary(manifest) -> dict | None:
    quant = manifest.quant
    return None if quant is None else {k: v for k, v in quant.items() if k != "amax"}


def table(result: dict) -> str:
    against = f"profile {result['profile']} vs " if result.get("profile") else ""
    rows = [f"engine {result['engine']} ({result['engine_precision'] or 'eager'}) {against}reference "
            f"{result['reference']}",
            "| request | seed | final latent rel. err (video / audio) | SSIM YUV420 | PSNR YUV420 dB | RGB PSNR dB | "
            "SSIM (luma) | audio LSD dB | denoise s (engine / reference) | evaluations computed / skipped |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["requests"]:
        f, t, cache = p["final_latent_rel_err"], p["denoise_s"], p["step_cache"]["engine"]
        evals = f"{cache['computed']} / {cache['skipped']}" if cache else "all / 0"
        rows.append(f"| {p['prompt'][:40]} | {p['seed']} | {f['video']:.2e} / {f['audio']:.2e} | "
                    f"{p['ssim_yuv420']:.4f} | {p['psnr_yuv420_db']:.2f} | {p['psnr_db']:.2f} | {p['ssim']:.4f} | "
                    f"{p['audio_lsd_db']:.3f} | {t['engine']:.2f} / {t['reference']:.2f} | {evals} |")
    m = result["mean"]
    speedup = f"{m['denoise_speedup']:.2f}x" if m["denoise_speedup"] else "-"
    rows.append(f"| **mean** | | {m['final_latent_rel_err_video']:.2e} / {m['final_latent_rel_err_audio']:.2e} | "
                f"{m['ssim_yuv420']:.4f} | {m['psnr_yuv420_db']:.2f} | {m['psnr_db']:.2f} | {m['ssim']:.4f} | "
                f"{m['audio_lsd_db']:.3f} | {m['denoise_s']['engine']:.2f} / {m['denoise_s']['reference']:.2f} "
                f"({speedup}) | |")
    rows.append("latent rel. err per step (video, mean): " +
                " ".join(f"{e:.1e}" for e in m["latent_rel_err_per_step_video"]))
    if result["random_weights"]:
        rows.append(f"note: {result['note']}")
    return "\n".join(rows)
