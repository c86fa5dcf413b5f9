"""h3trt command line: parse the arguments, call one function.

    h3trt run --prompt "..." --output clip.mp4 [--image first.png] [--last-image last.png] [--ref FILE ...] [...]
    h3trt run --requests FILE --out-dir DIR [--max-batch N] [...]
    h3trt serve [--engine DIR | --model PATH] [--port 8000] [--api-key KEY] [--data-dir DIR] [...]
    h3trt build --model PATH|tiny --output DIR [--precision bf16|fp8|nvfp4] [...]
    h3trt eval | inspect | verify | keygen

What each command does lives below the CLI (runtime/run.py for run, server/ for serve, build/ for build); this module
only turns arguments into their calls. It imports nothing heavy at the top: torch and the model code load inside
`main`, where an interrupt (Ctrl-C, or SIGTERM, treated alike) during the first second's imports is one line too.
Errors the user can fix are one line on stderr and exit status 2; a failed job or rank is one line and exit 1; an
interrupt exits 130. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from .errors import UserError  # imports nothing: the one class a user's mistake raises, caught once in `main`

VAE_PRECISION_HELP = ("video VAE precision: fp32 (the checkpoint's), bf16 (as the reference pipeline loads it, "
                      "load_components(dtype=torch.bfloat16): decoder blocks bf16, diffusers' _keep_in_fp32_modules - "
                      "encoder, norms, scales - fp32), or fp8 (opt-in: bf16 plus W8A8 e4m3 ViT linears with per-token "
                      "activation scales). Default: bf16 on CUDA, fp32 on the CPU. Keyframe encode and the audio VAE "
                      "stay fp32 at every precision, as in the reference")


def _run_parser(sub) -> None:
    from .models.packing import DEFAULT_DURATION
    from .models.sampler import DEFAULT_GUIDANCE, DEFAULT_SEED, DEFAULT_STEPS
    from .models.step_cache import DEFAULT_MAX_SKIP_STEPS, DEFAULT_RETENTION_RATIO, DEFAULT_THRESHOLDS
    from .runtime.files import DEFAULT_CRF

    p = sub.add_parser("run", help="generate one MP4 clip (H.264 + AAC 32 kHz stereo, 24 fps)",
                       description="Generate one clip. t2va by default; --image/--last-image make it fl2va, "
                                   "--ref makes it ref2va.")
    p.add_argument("--prompt", help="the text prompt, UTF-8, at most 1024 tokens (required unless --requests)")
    p.add_argument("--output", type=Path, help="output .mp4, a .json with timings beside it (required unless --requests)")
    p.add_argument("--image", type=Path, help="first keyframe (PNG/JPEG/WebP): fl2va")
    p.add_argument("--last-image", type=Path, help="last keyframe: fl2va")
    p.add_argument("--ref", type=Path, nargs="+", default=(), help="references for ref2va: images, audio, videos, "
                                                                   "in the order the model should read them")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help=f"noise seed, -2^63 <= seed < 2^64 (default {DEFAULT_SEED})")
    p.add_argument("--steps", type=int, default=None,
                   help="sigma grid points; steps - 1 DiT evaluations (default: a bundle's baked schedule, else "
                        f"{DEFAULT_STEPS})")
    p.add_argument("--width", type=int, help="canvas width, a multiple of 32 (default: the model's canvas)")
    p.add_argument("--height", type=int, help="canvas height, a multiple of 32")
    p.add_argument("--duration", type=float, default=DEFAULT_DURATION,
                   help="seconds, 5 to 14.375, rounded up to 17n + 5 frames at 24 fps (default 5 -> 124 frames; "
                        "14.375 -> 345, the longest)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="MiniMax-H3 checkpoint folder (official layout: FL2VA/ and "
                                                   "Ref2VA/). Default: the embedded tiny model")
    source.add_argument("--engine", type=Path, help="an engine bundle made by `h3trt build` (serves without compiling)")
    p.add_argument("--trust", type=Path, metavar="KEY.pub", help="with --engine: serve the bundle only if its manifest "
                                                                 "is signed by this Ed25519 public key and every file "
                                                                 "matches it (checked before any of its code loads)")
    p.add_argument("--device", default=None, type=_device, help="cpu or cuda[:N] (default: cuda if available)")
    _lora_argument(p, "eager --model runs; a bundle has its LoRAs merged at build time")
    p.add_argument("--crf", default=DEFAULT_CRF, type=_crf, metavar="0..51",
                   help=f"H.264 constant rate factor, 0..51 (default {DEFAULT_CRF})")
    p.add_argument("--vae-precision", help=VAE_PRECISION_HELP + "; with --engine, the bundle's (a different value is "
                                           "refused)")
    p.add_argument("--video-shift", type=float, help="video sigma shift (default: the checkpoint's, 12)")
    p.add_argument("--audio-shift", type=float, help="audio sigma shift (default: the checkpoint's, 3)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--profile-step", type=int, metavar="N",
                   help="measure evaluation N's host overhead (GPU idle time between its kernels, torch.profiler) "
                        "into the record's step_profile")
    batch = p.add_argument_group("batch: many requests from one JSONL file, the model loaded once")
    batch.add_argument("--requests", type=Path, help="JSONL, one request per line: id, task, prompt, image/last_image/"
                                                     "refs, seed, resolution WxH, duration, steps (validated first)")
    batch.add_argument("--out-dir", type=Path, help="OUT/<id>.mp4 + OUT/<id>.json per request, OUT/timeline.json/png; "
                                                    "a rerun skips requests whose outputs exist and verify")
    batch.add_argument("--max-batch", type=_positive, default=1, help="requests of one layout denoised together along the "
                                                                "batch dimension (default 1)")
    batch.add_argument("--fail-fast", action="store_true", help="stop at the first failed request (default: record "
                                                                "it and go on)")
    p.add_argument("--guidance", type=float, default=DEFAULT_GUIDANCE,
                   help="classifier-free guidance scale (default 1 = off: H3 is guidance-distilled and needs none)")
    p.add_argument("--negative-prompt", help="the negative branch's prompt (required with --guidance > 1)")
    cache = p.add_argument_group("step caching (opt-in; diffusers' FirstBlockCache / MagCache semantics)")
    cache.add_argument("--cache", choices=("first-block", "mag"), help="skip DiT evaluations a cached residual "
                                                                       "predicts (default: off)")
    cache.add_argument("--cache-threshold", type=float,
                       help="first-block: relative change of block 0's residual (default "
                            f"{DEFAULT_THRESHOLDS['first-block']}); mag: accumulated error (default "
                            f"{DEFAULT_THRESHOLDS['mag']})")
    cache.add_argument("--mag-ratios", help="mag: the model's magnitude ratios, R1,R2,... or a .json list "
                                            "(interpolated to the steps; recorded in the clip's JSON)")
    cache.add_argument("--mag-calibrate", action="store_true", help="mag: skip nothing and record this model's "
                                                                    "ratios in the clip's JSON")
    cache.add_argument("--cache-max-skip", type=int, default=DEFAULT_MAX_SKIP_STEPS,
                       help=f"mag: consecutive skips at most (default {DEFAULT_MAX_SKIP_STEPS})")
    cache.add_argument("--cache-retention", type=float, default=DEFAULT_RETENTION_RATIO,
                       help=f"mag: leading fraction of the steps never skipped (default {DEFAULT_RETENTION_RATIO})")
    _mesh_arguments(p)

def _positive(text: str) -> int:
    """A count of ranks, groups or jobs: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number of at least 1, got {text!r}")
    return value


def _crf(text: str) -> int:
    """--crf: H.264's constant rate factor, checked when the arguments are read (not after the generation)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= 51:
        raise argparse.ArgumentTypeError(f"takes a whole number in H.264's range 0..51 (lower is better quality, "
                                         f"default 23), got {text!r}")
    return value


def _device(text: str) -> str:
    """--device: checked when the arguments are read (torch.device takes mps, xla, ... and a run would fall back to
    the CPU for any of them)."""
    if text in ("cpu", "cuda") or (text.startswith("cuda:") and text[len("cuda:"):].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"takes cpu, cuda or cuda:N (N a GPU index), got {text!r}")


def _lora_argument(p, where: str) -> None:
    from .models.lora import LoraSpec

    p.add_argument("--lora", action="append", type=LoraSpec.parse, default=[], metavar="FILE[:SCALE]",
                   help=f"merge a LoRA .safetensors into the DiT at SCALE (default 1); repeatable ({where}). Every "
                        "layout diffusers' MiniMax-H3 loader reads: diffusers/peft, ai-toolkit, ComfyUI, kohya, "
                        "musubi-tuner, DiffSynth-Studio")


def _mesh_arguments(p) -> None:
    mesh = p.add_argument_group("parallel (mesh axes replica x cfg x sp = ranks)")
    mesh.add_argument("--gpus", type=_positive, default=1,
                      help="local ranks to spawn (one GPU each; CPU processes over gloo on a CPU-only machine). Under "
                           "torchrun leave it out: the world comes from torchrun")
    mesh.add_argument("--sp", type=_positive, help="Ulysses sequence-parallel degree: ranks sharing one sequence (default: "
                                             "a bundle's, else every rank not used by --cfg/--replicas)")
    mesh.add_argument("--cfg", type=_positive, help="1, or 2 to run the two --guidance branches on two rank groups "
                                              "(default: a bundle's, else 1)")
    mesh.add_argument("--replicas", type=_positive, help="independent rank groups, each serving different requests "
                                                   "(default: the ranks left over)")



def _serve_parser(sub) -> None:
    from .runtime.files import DEFAULT_CRF
    from .server.options import (DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_MAX_QUEUE, DEFAULT_PORT, DEFAULT_RETENTION,
                              DEFAULT_UPLOAD_MB)

    p = sub.add_parser("serve", help="serve the OpenAI Videos job API (POST /v1/videos ...) over long-lived workers",
                       description="Load the model once per replica group and serve video jobs over HTTP: the OpenAI "
                                   "Videos API, a job store that survives restarts, /health, /ready, /metrics and a "
                                   "page at /.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="MiniMax-H3 checkpoint folder (default: the embedded tiny model)")
    source.add_argument("--engine", type=Path, help="an engine bundle made by `h3trt build`")
    p.add_argument("--trust", type=Path, metavar="KEY.pub", help="with --engine: serve the bundle only if signed by "
                                                                 "this Ed25519 public key")
    p.add_argument("--device", default=None, type=_device,
                   help="cpu or cuda (default: a bundle's, else cuda if available)")
    p.add_argument("--vae-precision", help=VAE_PRECISION_HELP)
    _lora_argument(p, "eager --model serving")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; another address needs an API "
                                                "key)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0: any free "
                                                                  "port, printed when ready)")
    p.add_argument("--api-key", help="Bearer token clients must send (default: $H3TRT_API_KEY; without one the server "
                                     "binds to 127.0.0.1 only)")
    p.add_argument("--data-dir", type=Path, default=Path("h3trt-serve"),
                   help="the job store (jobs.sqlite3), uploads and finished clips (default ./h3trt-serve)")
    p.add_argument("--max-queue", type=_positive, default=DEFAULT_MAX_QUEUE,
                   help=f"queued jobs at most; beyond it POST answers 429 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--retention", default=DEFAULT_RETENTION,
                   help=f"how long a finished job's clip, record and row are kept, e.g. 30m, 24h, 7d (default "
                        f"{DEFAULT_RETENTION}); expired together")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help=f"on SIGTERM, seconds running jobs may take to finish (default {DEFAULT_DRAIN_TIMEOUT_S:g}); "
                        "queued jobs stay in the store")
    p.add_argument("--max-upload-mb", type=float, default=DEFAULT_UPLOAD_MB,
                   help=f"a request body's size limit, uploads included (default {DEFAULT_UPLOAD_MB:g} MB)")
    p.add_argument("--crf", default=DEFAULT_CRF, type=_crf, metavar="0..51",
                   help=f"H.264 constant rate factor, 0..51 (default {DEFAULT_CRF})")
    _mesh_arguments(p)
    from .fleet.options import DEFAULT_JOBS_PER_REPLICA, DEFAULT_LEASE

    fleet = p.add_argument_group("a fleet (Ray Serve; README, 'A fleet'): the mesh flags describe one replica group")
    fleet.add_argument("--ray", metavar="ADDRESS", help="deploy to the Ray cluster at ADDRESS (auto, or HEAD:6379) "
                                                        "instead of serving here; returns once the replicas serve")
    fleet.add_argument("--store", metavar="URL", help="with --ray: the shared job store, e.g. "
                                                      "postgresql+psycopg://USER@HOST/DB")
    fleet.add_argument("--storage", metavar="URL", help="with --ray: clips and uploads, a path every node mounts or "
                                                        "an fsspec URL (s3://bucket/prefix)")
    fleet.add_argument("--min-replicas", type=int, default=1, help="with --ray: worker replicas at least (default 1)")
    fleet.add_argument("--max-replicas", type=int, default=None, help="with --ray: worker replicas at most (default: "
                                                                      "--min-replicas)")
    fleet.add_argument("--jobs-per-replica", type=float, default=DEFAULT_JOBS_PER_REPLICA,
                       help="with --ray: the queue depth (queued + running jobs) one replica holds before the "
                            "autoscaler adds one (default 1)")
    fleet.add_argument("--lease", default=DEFAULT_LEASE, help="with --ray: a running job whose replica stopped renewing "
                                                              f"its lease this long ago runs again elsewhere (default "
                                                              f"{DEFAULT_LEASE})")


def step_cache_from_args(args):
    """The request's StepCacheConfig, or None when --cache is not given (the cache flags alone are an error)."""
    from .models.step_cache import DEFAULT_THRESHOLDS, StepCacheConfig

    if args.cache is None:
        given = [f for f, v in (("--cache-threshold", args.cache_threshold), ("--mag-ratios", args.mag_ratios),
                                ("--mag-calibrate", args.mag_calibrate)) if v]
        if given:
            raise UserError(f"{' '.join(given)} configure step caching; add --cache first-block or --cache mag.")
        return None
    ratios = None
    if args.mag_ratios is not None:
        ratios = parse_mag_ratios(args.mag_ratios)
    threshold = DEFAULT_THRESHOLDS[args.cache] if args.cache_threshold is None else args.cache_threshold
    return StepCacheConfig(args.cache, threshold, ratios, args.cache_max_skip, args.cache_retention,
                           args.mag_calibrate)


def parse_mag_ratios(text: str) -> tuple[float, ...]:
    """R1,R2,... or a .json file: a list of numbers, {"mag_ratios": [...]}, or an --mag-calibrate clip record."""
    if text.endswith(".json"):
        path = Path(text)
        if not path.is_file():
            raise UserError(f"--mag-ratios {path} does not exist; pass R1,R2,... or an existing .json file.")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"--mag-ratios {path} cannot be read as JSON ({e}); pass a JSON list of numbers, or the "
                            "clip record of an --mag-calibrate run.") from None
        if isinstance(data, dict) and isinstance(data.get("step_cache"), dict):  # an --mag-calibrate run's record
            data = ((data["step_cache"].get("branches") or {}).get("cond") or {}).get("mag_ratios_calibrated")
        values = data.get("mag_ratios") if isinstance(data, dict) else data
        if not isinstance(values, list):
            raise UserError(f"--mag-ratios {path} must hold a JSON list of numbers, {{\"mag_ratios\": [...]}}, or "
                            "the clip record of an --mag-calibrate run.")
    else:
        values = text.split(",")
    try:
        return tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise UserError(f"--mag-ratios must be numbers (R1,R2,... or a .json list), got {text!r}.") from None


def entry_from_args(args):
    """The one Entry of an `h3trt run` or `serve` (one clip, --requests or HTTP; one process or a mesh)."""
    from .runtime.entry import Entry

    return Entry.resolve(args.engine, args.model, args.device, args.trust, args.vae_precision, tuple(args.lora),
                         args.gpus, args.cfg, args.sp, args.replicas)


def cmd_run(args) -> int:
    from .runtime.run import run_clip, run_requests

    if args.requests is not None:
        if args.profile_step is not None:
            raise UserError("--profile-step measures one request's step; run that request alone (without "
                            "--requests).")
        check_batch_args(args)
        return run_requests(entry_from_args(args), args.requests, args.out_dir, args.max_batch, args.fail_fast,
                            args.crf, args.quiet)
    if args.prompt is None or args.output is None:
        raise UserError("h3trt run needs --prompt and --output (or --requests FILE --out-dir DIR for a batch).")
    from .runtime.request import Request

    entry = entry_from_args(args)
    steps = args.steps if args.steps is not None else entry.default_steps
    request = Request(args.prompt, args.image, args.last_image, tuple(args.ref), args.seed, steps, args.width,
                      args.height, args.duration, args.video_shift, args.audio_shift, args.guidance,
                      args.negative_prompt, step_cache_from_args(args))
    return run_clip(entry, request, args.output, args.crf, args.overwrite, args.quiet, args.profile_step)


def cmd_serve(args) -> int:
    from .server.main import serve
    from .server.options import ServeOptions

    if args.ray is not None:
        from .fleet.deploy import deploy
        from .fleet.options import FleetOptions

        if args.max_replicas is None:
            args.max_replicas = args.min_replicas
        return deploy(entry_from_args(args), ServeOptions.from_args(args), FleetOptions.from_args(args))
    given = [flag for flag, value in (("--store", args.store), ("--storage", args.storage),
                                      ("--max-replicas", args.max_replicas)) if value is not None]
    if given:
        raise _user_error(f"{' '.join(given)} configure a fleet; add --ray ADDRESS (README, 'A fleet'). One node keeps "
                          "its jobs and clips in --data-dir.")
    return serve(entry_from_args(args), ServeOptions.from_args(args))


def check_batch_args(args) -> None:
    """--requests takes every request from its file: the one-clip flags are refused."""
    single = [flag for flag, value in (("--prompt", args.prompt), ("--output", args.output), ("--image", args.image),
                                       ("--last-image", args.last_image), ("--ref", args.ref)) if value]
    if single:
        raise UserError(f"--requests takes every request from its file; drop {' '.join(single)}.")
    if args.out_dir is None:
        raise UserError("--requests needs --out-dir DIR (OUT/<id>.mp4 and OUT/<id>.json per request).")
    if args.cache is not None:
        raise UserError("--cache decides per request, and a batch run shares one DiT evaluation per step across "
                        "requests; run cached requests one at a time (h3trt run --prompt ... --cache ...).")


def _build_parser(sub) -> None:
    from .calibration.recipe import FP8_ACCUMS
    from .engines.manifest import BACKENDS
    from .models.checkpoint import TASKS
    from .models.precision import DIT_PRECISIONS
    from .models.sampler import DEFAULT_STEPS

    p = sub.add_parser("build", help="compile an engine bundle ahead of time",
                       description="Compile the DiT segments of a checkpoint into an engine bundle.")
    p.add_argument("--model", required=True, help="checkpoint folder, or 'tiny' for the embedded tiny model")
    p.add_argument("--output", required=True, type=Path, help="bundle folder to create")
    p.add_argument("--precision", default="bf16", choices=DIT_PRECISIONS,
                   help="bf16 (default), fp32, fp8 (W8A8, calibrated) or nvfp4 (weight-only on Hopper)")
    p.add_argument("--calib-prompts", type=Path, help="fp8, awq_lite: text file, one calibration prompt per line")
    p.add_argument("--calib-steps", type=int, default=None,
                   help="fp8, awq_lite: sigma grid points per calibration trajectory (default: the bundle's --steps "
                        "when <= 8, so a few-step bundle calibrates on the timesteps it serves; else 8)")
    p.add_argument("--calib-algo", help="ModelOpt calibration algorithm: fp8 max (default), percentile or "
                                        "smoothquant; nvfp4 max (default) or awq_lite")
    p.add_argument("--quant-exclude", nargs="+", default=(), metavar="NAME",
                   help="fp8/nvfp4: keep in bf16 whole blocks (blocks.N) and/or a block linear in every block "
                        "(attn.qkv_proj, attn.out_proj, mlp.fc1, mlp.fc2)")
    p.add_argument("--fp8-attention", action="store_true", help="fp8: q/k/v in e4m3 with calibrated scales, through "
                                                                    "the --attention kernel (a CPU build: emulated)")
    p.add_argument("--fp8-accum", choices=FP8_ACCUMS, default=None,
                   help="fp8: how the GEMMs accumulate: fast (default; the FP8 tensor cores' accumulator over the "
                        "whole reduction: a full-width H3 block 2.5%% faster on the H200, its error unchanged) or "
                        "exact (fp32 promotion, cuBLAS's default). Recorded in the manifest")
    p.add_argument("--attention", default="auto", choices=("auto", "cudnn", "fa3"),
                   help="attention kernel, bf16 and --fp8-attention alike: auto (default: the fastest measured on the "
                        "build GPU at the bundle's shape; on a CPU, torch SDPA or the FP8 emulation), cudnn, or fa3 "
                        "(FlashAttention-3, Hopper; pip install 'h3trt[fa3]'). Recorded in the manifest; a machine "
                        "that cannot run it refuses the bundle")
    p.add_argument("--profile", action="append", default=None,
                   help="WIDTHxHEIGHTxSECONDS a request may use; repeatable (default 1344x768x5, tiny 160x96x5)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"the schedule the AdaLN tables are baked for (default {DEFAULT_STEPS})")
    p.add_argument("--video-shift", type=float, help="video sigma shift to bake (default: the checkpoint's)")
    p.add_argument("--audio-shift", type=float, help="audio sigma shift to bake (default: the checkpoint's)")
    p.add_argument("--device", default=None, type=_device,
                   help="cuda or cpu (default: cuda if available); the bundle runs there")
    p.add_argument("--backend", default="inductor", choices=BACKENDS,
                   help="inductor (default), aoti, or tensorrt (ONNX -> TensorRT plans)")
    p.add_argument("--trt-targets", default=None,
                   help="tensorrt with TensorRT-RTX: compute capabilities to build for, e.g. sm89,sm120 "
                        "(default: sm89,sm120; nvfp4: sm120)")
    p.add_argument("--keep-adaln", action="store_true", help="keep adaln_proj weights: serve any schedule")
    p.add_argument("--vae-precision", help=VAE_PRECISION_HELP + " (of --device). The video decoder is compiled at it "
                                           "and the bundle serves it")
    _lora_argument(p, "merged before calibration, AdaLN baking and compiling; the manifest records each file's sha256")
    p.add_argument("--task", default=TASKS[0], choices=TASKS,
                   help="t2va/fl2va (FL2VA partition, default t2va) or ref2va (Ref2VA)")
    p.add_argument("--sp", type=_positive, default=1, help="Ulysses sequence-parallel degree the bundle serves (must divide "
                                                     "the attention heads: 1, 2, 4, 7, 8, 14, 28 or 56 for H3)")
    p.add_argument("--cfg", type=_positive, default=1, help="guidance-branch parallel degree the bundle is launched with: 1 "
                                                      "(default; H3 is guidance-distilled) or 2")
    p.add_argument("--overwrite", action="store_true", help="replace an existing bundle")
    p.add_argument("--sign", type=Path, metavar="KEY", help="sign the manifest with this Ed25519 private key (PEM; "
                                                            "`h3trt keygen KEY` makes one), writing manifest.sig")
    e = sub.add_parser("eval", help="compare an engine bundle with a reference on the same requests and seeds")
    e.add_argument("--engine", required=True, type=Path, help="the bundle under test (e.g. an fp8 build)")
    e.add_argument("--reference", required=True, help="a bundle, a checkpoint folder, or 'tiny' (eager)")
    e.add_argument("--requests", required=True, type=Path,
                   help="JSON lines, the schema of `run --requests` (id and task optional): {\"prompt\": ..., "
                        "\"seed\": ...} (resolution or width/height, duration, steps default to the engine's)")
    e.add_argument("--json", type=Path, help="write the per-request and mean metrics here")
    e.add_argument("--device", default=None, type=_device,
                   help="cpu or cuda (default: where the engine bundle was built)")
    sub.add_parser("inspect", help="print a bundle's manifest").add_argument("bundle", type=Path)
    q = sub.add_parser("verify", help="re-hash every file of a bundle; with --trust, check who signed it")
    q.add_argument("bundle", type=Path)
    q.add_argument("--trust", type=Path, metavar="KEY.pub", help="the Ed25519 public key the bundle must be signed "
                                                                 "with")
    k = sub.add_parser("keygen", help="make an Ed25519 key pair for signing bundles (KEY and KEY.pub)")
    k.add_argument("key", type=Path, help="private key path (mode 0600); the public key goes to KEY.pub")


def cmd_build(args) -> int:
    import torch

    from .build.builder import build
    from .build.config import BuildConfig, Profile
    from .engines.signing import key_fingerprint, load_private_key, sign_bundle
    from .models.tiny import TINY_HEIGHT, TINY_WIDTH, ensure_tiny_checkpoint

    tiny = args.model == "tiny"
    default_profile = f"{TINY_WIDTH}x{TINY_HEIGHT}x5" if tiny else "1344x768x5"
    profiles = tuple(Profile.parse(p) for p in (args.profile or [default_profile]))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_root = ensure_tiny_checkpoint() if tiny else Path(args.model)
    config = BuildConfig(model_root, args.output, args.task, args.precision, profiles, args.steps, args.video_shift,
                         args.audio_shift, device, args.backend, args.keep_adaln, args.sp, args.overwrite, tiny,
                         cfg=args.cfg, trt_targets=args.trt_targets, calib_prompts=args.calib_prompts,
                         calib_steps=args.calib_steps, quant_exclude=tuple(args.quant_exclude),
                         fp8_attention=args.fp8_attention, attention=args.attention, vae_precision=args.vae_precision,
                         loras=tuple(args.lora), calib_algo=args.calib_algo, fp8_accum=args.fp8_accum)
    key = load_private_key(args.sign) if args.sign is not None else None  # a bad key fails before the build
    manifest = build(config, log=lambda m: print(f"h3trt build: {m}", file=sys.stderr),
                     sign=(lambda root: sign_bundle(root, key)) if key is not None else None)
    signed = f"signed by key {key_fingerprint(key.public_key())[:16]}" if key is not None else "unsigned"
    print(f"wrote {args.output}: {manifest.backend} {manifest.precision} bundle for {manifest.arch}, "
          f"{len(manifest.files)} files, {manifest.total_bytes / 1e6:.1f} MB; AdaLN "
          f"{'baked' if manifest.adaln.baked else 'kept'}; video decoder {manifest.vae_precision}; "
          f"manifest_sha256 {manifest.manifest_sha256}, {signed}")
    return 0


def cmd_eval(args) -> int:
    from .eval import evaluate, reference_entry, table
    from .runtime.entry import Entry
    from .runtime.files import write_json_atomic
    from .runtime.requests import read_eval_requests

    if args.json is not None and args.json.exists():
        raise UserError(f"{args.json} already exists; choose another --json path.")
    engine = Entry.resolve(engine=args.engine, device=args.device)
    requests = read_eval_requests(args.requests, engine.manifest)  # every line checked before any model loads
    result = evaluate(engine, reference_entry(args.reference, engine.device), requests,
                      log=lambda m: print(f"h3trt eval: {m}", file=sys.stderr))
    print(table(result))
    if args.json is not None:
        write_json_atomic(args.json, result)
    return 0


def cmd_inspect(args) -> int:
    from .engines.manifest import read_manifest
    from .engines.signing import read_signature
    from .engines.tensorrt_inspect import inspect_trt_bundle

    manifest = read_manifest(args.bundle)
    # Every recorded field as written (`raw`), the long tables summarised.
    summary = {k: v for k, v in manifest.raw.items() if k not in ("files", "segments")}
    summary["segments"] = {k: v["artifact"] for k, v in manifest.segments.items()}
    summary["files"] = f"{len(manifest.files)} files, {manifest.total_bytes} bytes"
    signature = read_signature(args.bundle)
    summary["signature"] = (f"ed25519 by key {signature['key_sha256']} (not checked: h3trt verify --trust KEY.pub)"
                            if signature else "unsigned")
    polygraphy_view = inspect_trt_bundle(args.bundle, manifest)  # tensorrt bundles: ONNX graphs and plans
    if polygraphy_view is not None:
        summary["polygraphy"] = polygraphy_view
    print(json.dumps(summary, indent=1))
    return 0


def cmd_verify(args) -> int:
    from .engines.manifest import read_manifest, verify_files
    from .engines.signing import key_fingerprint, load_public_key, read_signature, read_trusted_manifest

    manifest = read_trusted_manifest(args.bundle, args.trust) if args.trust else read_manifest(args.bundle)
    problems = verify_files(args.bundle, manifest)
    if problems:
        for p in problems:
            print(f"h3trt verify: {p}", file=sys.stderr)
        print(f"h3trt: error: {args.bundle}: {len(problems)} file(s) do not match the manifest; re-copy or rebuild.",
              file=sys.stderr)
        return 1
    if args.trust:
        print(f"{args.bundle}: signed by the trusted key {key_fingerprint(load_public_key(args.trust))[:16]}, and all "
              f"{len(manifest.files)} files match its manifest (manifest_sha256 {manifest.manifest_sha256})")
    else:
        # A bundle is executable code; without a signature anyone who can change a file can change its hash too.
        print(f"{args.bundle}: all {len(manifest.files)} files match the manifest (manifest_sha256 "
              f"{manifest.manifest_sha256}); this detects accidental changes only: pass --trust KEY.pub to check "
              f"who built it{' (the bundle is signed)' if read_signature(args.bundle) else ''}")
    return 0


def cmd_keygen(args) -> int:
    from .engines.signing import generate_key, key_fingerprint, load_public_key

    private, public = generate_key(args.key)
    print(f"wrote {private} (private: keep it; h3trt build --sign {private}) and {public} (public: h3trt run/verify "
          f"--trust {public}); key {key_fingerprint(load_public_key(public))[:16]}")
    return 0


def choose_gpu(args) -> None:
    """Make the process's GPU its cuda:0 before anything starts CUDA (why: h3trt/parallel/devices.py): a torchrun rank
    takes GPU #LOCAL_RANK of the node, `--device cuda:N` takes GPU #N; `--device` then reads `cuda`."""
    from .parallel.devices import cuda_index, pin_own_gpu, torchrun_local_rank

    device = getattr(args, "device", None)
    index = cuda_index(device)
    local_rank = torchrun_local_rank()
    if args.command in ("run", "serve") and (local_rank is not None or getattr(args, "gpus", 1) > 1 or
                                            args.command == "serve"):
        if index is not None:
            raise UserError(f"--device {device} names one GPU, but on a mesh each rank takes its own (GPU #local "
                            "rank of the visible ones); pass --device cuda, and restrict the GPUs with "
                            "CUDA_VISIBLE_DEVICES if you need to.")
        if local_rank is not None and device != "cpu":
            pin_own_gpu(local_rank)
    elif index is not None:
        pin_own_gpu(index)
        args.device = "cuda"


COMMANDS = {"run": "cmd_run", "serve": "cmd_serve", "build": "cmd_build", "eval": "cmd_eval",
            "inspect": "cmd_inspect", "verify": "cmd_verify", "keygen": "cmd_keygen"}


def build_parser() -> argparse.ArgumentParser:
    from .runtime.args import OneLineParser  # usage mistakes are one line too (argparse's own print 16)

    parser = OneLineParser(prog="h3trt", description="Compiled inference engine for MiniMax-H3.")
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    _serve_parser(sub)
    _build_parser(sub)
    return parser


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    # SIGTERM ends a run as Ctrl-C does: temporaries removed, what was finished kept, one line (`serve` installs its
    # own: it drains). Installed before anything heavy is imported, so a signal in the first second is handled too.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        return _call(args)
    except KeyboardInterrupt as e:
        from .runtime.files import InterruptedAfterCommit, remove_own_temps

        remove_own_temps()  # whatever an unwinding frame did not get to
        if isinstance(e, InterruptedAfterCommit):
            print(f"h3trt: interrupted after writing {' and '.join(map(str, e.targets))}.", file=sys.stderr)
        else:
            print("h3trt: interrupted; no output was written (temporary files removed).", file=sys.stderr)
        return 130


def _call(args) -> int:
    """Run the command. A UserError (OutputRefused included) is the user's to fix: one line, exit 2. A failed output,
    rank, job or bundle check (the work was attempted and says why it failed): one line, exit 1. Anything else (a
    ValueError or RuntimeError included) is a bug or a broken install and propagates with its traceback."""
    from .build.check import BuildError
    from .parallel.launch import RankFailed
    from .runtime.files import OutputError
    from .runtime.jobs import JobFailed

    try:
        choose_gpu(args)
        return globals()[COMMANDS[args.command]](args)
    except UserError as e:
        print(f"h3trt: error: {' '.join(str(e).split()) if not _multiline(e) else str(e)}", file=sys.stderr)
        return 2
    except (OutputError, RankFailed, JobFailed, BuildError) as e:  # attempted: the result could not be made/written
        print(f"h3trt: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


def _multiline(error: Exception) -> bool:
    """A checkpoint's errors list one problem per line (missing keys, shapes); they keep their lines."""
    from .models.checkpoint import CheckpointError

    return isinstance(error, CheckpointError)


if __name__ == "__main__":
    sys.exit(main())
