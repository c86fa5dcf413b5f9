"""The `h3trt` command line's arguments: one subparser per command, each flag checked as it is read (cli/args.py's
types), every usage mistake one line (OneLineParser). Model code loads only for the defaults it names."""

from __future__ import annotations

from pathlib import Path

from .args import OneLineParser, crf, device, positive, positive_float, shift_list, steps_list

VAE_PRECISION_HELP = ("video VAE precision: fp32 (the checkpoint's), bf16 (as the reference pipeline loads it, "
                      "load_components(dtype=torch.bfloat16): decoder blocks bf16, diffusers' _keep_in_fp32_modules - "
                      "encoder, norms, scales - fp32), or fp8 (opt-in: bf16 plus W8A8 e4m3 ViT linears with per-token "
                      "activation scales). Default: bf16 on CUDA, fp32 on the CPU. Keyframe encode and the audio VAE "
                      "stay fp32 at every precision, as in the reference")



def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="h3trt", description="Compiled inference engine for MiniMax-H3.")
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    _serve_parser(sub)
    _build_parser(sub)
    _bundle_parsers(sub)
    return parser


def _run_parser(sub) -> None:
    from ..media.output_files import DEFAULT_CRF
    from ..models.packing import DEFAULT_DURATION
    from ..models.sampler import DEFAULT_GUIDANCE, DEFAULT_SEED, DEFAULT_STEPS, MAX_STEPS, MIN_STEPS
    from ..request.fields import FLAG_NAMES as flag  # a request field's flag: the field table's

    p = sub.add_parser("run", help="generate one MP4 clip (H.264 + AAC 32 kHz stereo, 24 fps)",
                       description="Generate one clip. t2va by default; --image/--last-image make it fl2va, "
                                   "--ref makes it ref2va.")
    p.add_argument(flag["prompt"], help="the text prompt, UTF-8, at most 1024 tokens (required unless --requests)")
    p.add_argument("--output", type=Path, help="output .mp4, a .json with timings beside it (required unless --requests)")
    p.add_argument(flag["image"], type=Path, help="first keyframe (PNG/JPEG/WebP): fl2va")
    p.add_argument(flag["last_image"], type=Path, help="last keyframe: fl2va")
    p.add_argument(flag["refs"], type=Path, nargs="+", default=(), help="references for ref2va: images, audio, videos, "
                                                                   "in the order the model should read them")
    p.add_argument(flag["seed"], type=int, default=DEFAULT_SEED,
                   help=f"noise seed, -2^63 <= seed < 2^64 (default {DEFAULT_SEED})")
    p.add_argument(flag["steps"], type=int, default=None,
                   help=f"sigma grid points, {MIN_STEPS} to {MAX_STEPS}; steps - 1 DiT evaluations (default: a "
                        f"bundle's first baked schedule, else {DEFAULT_STEPS})")
    p.add_argument(flag["width"], type=int, help="canvas width, a multiple of 32 (default: the model's canvas)")
    p.add_argument(flag["height"], type=int, help="canvas height, a multiple of 32")
    p.add_argument(flag["duration"], type=float, default=DEFAULT_DURATION,
                   help="seconds, 5 to 14.375, rounded up to 17n + 5 frames at 24 fps (default 5 -> 124 frames; "
                        "14.375 -> 345, the longest)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="MiniMax-H3 checkpoint folder (official layout: FL2VA/ and "
                                                   "Ref2VA/). Default: the embedded tiny model")
    source.add_argument("--engine", type=Path, help="an engine bundle made by `h3trt build` (serves without compiling)")
    p.add_argument("--trust", type=Path, metavar="KEY.pub", help="with --engine: serve the bundle only if its manifest "
                                                                 "is signed by this Ed25519 public key and every file "
                                                                 "matches it (checked before any of its code loads)")
    p.add_argument("--device", default=None, type=device, help="cpu or cuda[:N] (default: cuda if available)")
    _lora_argument(p, "--engine: a bundle built with --lora-slots applies the file to every request as an adapter, "
                      "unmerged (one of its slots); a bundle without slots refuses it")
    _adapter_argument(p, "a --requests line picks them with its \"lora\" key")
    _distilled_argument(p, "fused into the checkpoint (--model, or the tiny model), run eagerly; a bundle carries its "
                           "own (h3trt build --distilled)")
    p.add_argument("--crf", default=DEFAULT_CRF, type=crf, metavar="0..51",
                   help=f"H.264 constant rate factor, 0..51 (default {DEFAULT_CRF})")
    p.add_argument("--vae-precision", help=VAE_PRECISION_HELP + "; with --engine, the bundle's (a different value is "
                                           "refused)")
    p.add_argument(flag["video_shift"], type=float, help="video sigma shift (default: the checkpoint's, 12)")
    p.add_argument(flag["audio_shift"], type=float, help="audio sigma shift (default: the checkpoint's, 3)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file; with --requests, "
                   "files in OUT this batch did not make")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--profile-step", type=int, metavar="N",
                   help="measure evaluation N's host overhead (GPU idle time between its kernels, torch.profiler) "
                        "into the record's step_profile")
    batch = p.add_argument_group("batch: many requests from one JSONL file, the model loaded once")
    batch.add_argument("--requests", type=Path, help="JSONL, one request per line: id, task, prompt, image/last_image/"
                                                     "refs, seed, resolution WxH, duration, steps (validated first)")
    batch.add_argument("--out-dir", type=Path, help="OUT/<id>.mp4 + OUT/<id>.json per request, OUT/timeline.json/png; "
                                                    "a rerun skips requests whose outputs exist and verify")
    batch.add_argument("--max-batch", type=positive, default=1, help="requests of one layout denoised together along the "
                                                                "batch dimension (default 1)")
    batch.add_argument("--fail-fast", action="store_true", help="stop at the first failed request (default: record "
                                                                "it and go on)")
    p.add_argument(flag["guidance"], type=float, default=DEFAULT_GUIDANCE,
                   help="classifier-free guidance scale (default 1 = off: H3 is guidance-distilled and needs none)")
    p.add_argument(flag["negative_prompt"], help="the negative branch's prompt (required with --guidance > 1)")
    _speed_arguments(p)
    _mesh_arguments(p)


def _speed_arguments(p) -> None:
    """`h3trt run`'s speed flags: the profiles, block-sparse attention and step caching, in that order."""
    from ..models.step_cache import DEFAULT_MAX_SKIP_STEPS, DEFAULT_RETENTION_RATIO, DEFAULT_THRESHOLDS
    from ..request.fields import FLAG_NAMES as flag
    from ..request.fields import PROFILE_NAMES

    speed = p.add_argument_group("speed profiles (README, 'Speed profiles'): step reuse and sparse attention by name")
    speed.add_argument(flag["profile"], choices=PROFILE_NAMES,
                       help="lossless (default: every block of every step), quality, balanced or fast; a step-cache "
                            "or sparse flag given too overrides the profile's value for that knob")
    sparse = p.add_argument_group("block-sparse attention (README, 'Block-sparse attention'; SubBlock's routing)")
    sparse.add_argument(flag["sparse_attention"], type=float, metavar="SPARSITY",
                        help="fraction of key blocks each video query block skips, 0 <= s < 1 (default: the "
                             "profile's, else the bundle's --sparse-attention, else 0: dense); text, audio, "
                             "condition and mixed query blocks stay dense")
    sparse.add_argument(flag["sparse_dense_steps"], type=int, metavar="N",
                        help="the first N denoise steps stay dense (default 10; both guidance branches of a step "
                             "are one)")
    sparse.add_argument(flag["sparse_min_seq"], type=int, metavar="ROWS",
                        help="attentions over fewer rows stay dense (default 4096)")
    sparse.add_argument(flag["vsa_sparsity"], type=float, metavar="S",
                        help="a FastH3-VSA model's VSA sparsity for this clip, 0 <= s < 1 (0: dense attention, the "
                             "coarse branch kept; default: the model's; README, 'VSA')")
    cache = p.add_argument_group("step caching (opt-in; diffusers' FirstBlockCache / MagCache semantics)")
    cache.add_argument(flag["cache"], choices=("first-block", "mag"), help="skip DiT evaluations a cached residual "
                                                                       "predicts (default: off, or the profile's)")
    cache.add_argument(flag["cache_threshold"], type=float,
                       help="first-block: relative change of block 0's residual (default "
                            f"{DEFAULT_THRESHOLDS['first-block']}); mag: accumulated error (default "
                            f"{DEFAULT_THRESHOLDS['mag']}); inf: every skip the warm-up and --cache-max-skip allow "
                            "(a profile's fastest clip, for benchmarks)")
    cache.add_argument(flag["cache_warmup"], type=int, metavar="N",
                       help="first-block: the first N evaluations of each branch run every block (default 0, "
                            "diffusers'; Cache-DiT's max_warmup_steps)")
    cache.add_argument(flag["cache_max_skip"], type=int, metavar="K",
                       help=f"consecutive skipped evaluations at most, then one runs every block (mag: default "
                            f"{DEFAULT_MAX_SKIP_STEPS}; first-block: default no limit, diffusers'; Cache-DiT's "
                            "max_continuous_cached_steps)")
    cache.add_argument("--mag-ratios", help="mag: the model's magnitude ratios, R1,R2,... or a .json list "
                                            "(interpolated to the steps; recorded in the clip's JSON)")
    cache.add_argument("--mag-calibrate", action="store_true", help="mag: skip nothing and record this model's "
                                                                    "ratios in the clip's JSON")
    cache.add_argument("--cache-retention", type=float,
                       help=f"mag: leading fraction of the steps never skipped (default {DEFAULT_RETENTION_RATIO})")


def _lora_argument(p, where: str) -> None:
    from ..adapters.merge import LoraSpec

    p.add_argument("--lora", action="append", type=LoraSpec.parse, default=[], metavar="FILE[:SCALE]",
                   help=f"merge a LoRA .safetensors into the DiT at SCALE (default 1, -100 to 100); repeatable "
                        f"({where}). Every layout diffusers' MiniMax-H3 loader reads: diffusers/peft, ai-toolkit, "
                        "ComfyUI, kohya, musubi-tuner, DiffSynth-Studio")


def _distilled_argument(p, where: str) -> None:
    p.add_argument("--distilled", metavar="FILE[@key=value,...]",
                   help=f"a distilled checkpoint (FastH3 fastvideo-lora-v2, LightX2V Turbo, alibaba-pai PDD; the "
                        f"family from its header, or @family=): {where}. The model then runs its family's schedule "
                        "(README, 'Distilled checkpoints'); keys: family, steps, video_shift, audio_shift (Turbo), "
                        "alpha (Turbo without a header alpha), grid=rungs|uniform (FastH3 v1)")


def _adapter_argument(p, how: str) -> None:
    from ..adapters.spec import AdapterSpec

    p.add_argument("--adapter", action="append", type=AdapterSpec.parse, default=[],
                   metavar="NAME=FILE[:SCALE][@steps=N,video_shift=S,audio_shift=S]",
                   help=f"keep a LoRA resident beside the DiT under NAME, NOT merged: only the requests that name it "
                        f"run with it, at their own strength (SCALE: its default, 1; -100 to 100); repeatable ({how}). "
                        "--lora merges into the weights for every request instead. --engine: a bundle built with "
                        "--lora-slots N --lora-max-rank R (up to N adapters, each of rank <= R). @...: the adapter's "
                        "own schedule (a Turbo LoRA's), over the file's __metadata__ h3trt.steps, h3trt.video_shift, "
                        "h3trt.audio_shift: a request naming it that states no steps or shift runs these")


def slots_bound() -> str:
    """--lora-slots' upper bound, for --help: the slots' bytes against the memory that holds them."""
    from ..adapters.memory import unit_bytes
    from ..models.config import H3Config

    return (f"what the memory holds: N x R x {unit_bytes(H3Config()) / 1e6:.1f} MB (full-size H3, bf16) must fit in "
            "the GPU's memory (the host's on the CPU); more is refused, naming the largest N and R that fit")


def _mesh_arguments(p) -> None:
    mesh = p.add_argument_group("parallel (mesh axes replica x cfg x sp = ranks)")
    mesh.add_argument("--gpus", type=positive, default=1,
                      help="local ranks to spawn (one GPU each; CPU processes over gloo on a CPU-only machine). Under "
                           "torchrun leave it out: the world comes from torchrun")
    mesh.add_argument("--sp", type=positive, help="Ulysses sequence-parallel degree: ranks sharing one sequence (default: "
                                             "a bundle's, else every rank not used by --cfg/--replicas)")
    mesh.add_argument("--cfg", type=positive, help="1, or 2 to run the two --guidance branches on two rank groups "
                                              "(default: a bundle's, else 1)")
    mesh.add_argument("--replicas", type=positive, help="independent rank groups, each serving different requests "
                                                   "(default: the ranks left over)")



def _serve_parser(sub) -> None:
    from ..media.output_files import DEFAULT_CRF
    from ..server.options import (DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_MAX_QUEUE, DEFAULT_PORT, DEFAULT_RETENTION,
                                  DEFAULT_UPLOAD_MB, OPENABLE)

    p = sub.add_parser("serve", help="serve the OpenAI Videos job API (POST /v1/videos ...) over long-lived workers",
                       description="Load the model once per replica group and serve video jobs over HTTP: the OpenAI "
                                   "Videos API, a job store that survives restarts, /health, /ready, /metrics and a "
                                   "page at /.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="MiniMax-H3 checkpoint folder (default: the embedded tiny model)")
    source.add_argument("--engine", type=Path, help="an engine bundle made by `h3trt build`")
    p.add_argument("--trust", type=Path, metavar="KEY.pub", help="with --engine: serve the bundle only if signed by "
                                                                 "this Ed25519 public key")
    p.add_argument("--device", default=None, type=device,
                   help="cpu or cuda (default: a bundle's, else cuda if available)")
    p.add_argument("--vae-precision", help=VAE_PRECISION_HELP)
    _lora_argument(p, "--engine: as an adapter on every job, in a bundle built with --lora-slots")
    _adapter_argument(p, "a POST /v1/videos job picks them with its \"lora\" field; GET /v1/loras lists them")
    _distilled_argument(p, "fused into the checkpoint on every rank, run eagerly; a bundle carries its own")
    from ..adapters.shape import SERVE_MAX_RANK, SERVE_SLOTS

    p.add_argument("--lora-dir", type=Path, metavar="DIR",
                   help="every DIR/*.safetensors is a resident adapter named by its file stem (scale 1), besides "
                        "--adapter; while the server runs, POST /v1/loras loads another file of DIR and DELETE "
                        "/v1/loras/NAME unloads one (behind the API key; kept across restarts in --data-dir)")
    p.add_argument("--lora-slots", type=positive, metavar="N",
                   help=f"adapters the eager DiT holds at once, the most one job may name (default with --lora-dir: "
                        f"max({SERVE_SLOTS}, adapters at start); else the adapters at start); others load on demand "
                        f"into the least recently used slot. At most {slots_bound()}")
    p.add_argument("--lora-max-rank", type=positive, metavar="R",
                   help=f"the slots' max LoRA rank (default with --lora-dir: max({SERVE_MAX_RANK}, the largest at "
                        "start); else the largest at start); a larger adapter is refused. Bounded with --lora-slots")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; another address needs an API "
                                                "key)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0: any free "
                                                                  "port, printed when ready)")
    p.add_argument("--api-key", help="Bearer token clients must send (default: $H3TRT_API_KEY; without one the server "
                                     "binds to 127.0.0.1 only)")
    p.add_argument("--data-dir", type=Path, default=Path("h3trt-serve"),
                   help="the job store (jobs.sqlite3), uploads and finished clips (default ./h3trt-serve)")
    p.add_argument("--max-queue", type=positive, default=DEFAULT_MAX_QUEUE,
                   help=f"queued jobs at most; beyond it POST answers 429 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--retention", default=DEFAULT_RETENTION,
                   help=f"how long a finished job's clip, record and row are kept, e.g. 30m, 24h, 7d (default "
                        f"{DEFAULT_RETENTION}); expired together")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help=f"on SIGTERM, seconds running jobs may take to finish (default {DEFAULT_DRAIN_TIMEOUT_S:g}); "
                        "queued jobs stay in the store")
    p.add_argument("--open", action="append", choices=OPENABLE, metavar="|".join(OPENABLE),
                   help="serve this endpoint without the API key (repeatable): metrics (/metrics, for Prometheus "
                        "scrapers that send no key), docs (/docs and /openapi.json); /health, /ready and the page are "
                        "always open, /v1 never")
    p.add_argument("--max-batch", type=positive, default=1,
                   help="queued jobs of one batch key (task, canvas, frames, schedule, adapters; unguided, uncached, "
                        "dense) a replica group takes at once and denoises as one batch where their packed layouts "
                        "agree (default 1; a bundle compiled for batch 1 takes 1)")
    p.add_argument("--max-upload-mb", type=float, default=DEFAULT_UPLOAD_MB,
                   help=f"a request body's size limit, uploads included (default {DEFAULT_UPLOAD_MB:g} MB)")
    p.add_argument("--crf", default=DEFAULT_CRF, type=crf, metavar="0..51",
                   help=f"H.264 constant rate factor, 0..51 (default {DEFAULT_CRF})")
    _mesh_arguments(p)
    from ..fleet.options import DEFAULT_JOBS_PER_REPLICA, DEFAULT_LEASE

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


def _build_parser(sub) -> None:
    from ..calibration.recipe import FP8_ACCUMS
    from ..engines.manifest import BACKENDS
    from ..models.checkpoint.reader import TASKS
    from ..models.precision import DIT_PRECISIONS

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
                                                                    "the --attention kernel (a CPU build: emulated); "
                                                                    "on a FastH3-VSA model, VSA's fp8 kernel raced "
                                                                    "against fa4 (per-call scales)")
    p.add_argument("--fp8-accum", choices=FP8_ACCUMS, default=None,
                   help="fp8: how the GEMMs accumulate: fast (default; the FP8 tensor cores' accumulator over the "
                        "whole reduction: a full-width H3 block 2.5%% faster on the H200, its error unchanged) or "
                        "exact (fp32 promotion, cuBLAS's default). Recorded in the manifest")
    p.add_argument("--attention", default="auto", choices=("auto", "cudnn", "fa3"),
                   help="attention kernel, bf16 and --fp8-attention alike: auto (default: the fastest measured on the "
                        "build GPU at the bundle's shape; on a CPU, torch SDPA or the FP8 emulation), cudnn, or fa3 "
                        "(FlashAttention-3, Hopper; pip install 'h3trt[fa3]'). Recorded in the manifest; a machine "
                        "that cannot run it refuses the bundle")
    p.add_argument("--canvas", "--profile", dest="profile", action="append", default=None, metavar="WxHxS",
                   help="WIDTHxHEIGHTxSECONDS a request may use; repeatable (default 1344x768x5, tiny 160x96x5). "
                        "--profile is its older name (run's --profile is a speed profile, not a canvas)")
    _schedule_arguments(p)
    p.add_argument("--device", default=None, type=device,
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
    _distilled_argument(p, "fused in fp32 before calibration, AdaLN baking and compiling; the bundle bakes its "
                           "family's schedule and serves only that (its manifest records the family, the schedule and "
                           "the file's sha256)")
    slots = p.add_argument_group("per-request LoRA adapters (README, 'Serving')")
    slots.add_argument("--lora-slots", type=positive, metavar="N",
                       help="with --lora-max-rank: compile the block with N adapter slots beside the plain block, so "
                            "run/serve --engine take --adapter NAME=FILE[:SCALE] (up to N, rank <= R) and a request "
                            "picks them by its \"lora\" field; no adapter in a request runs the plain block. With "
                            "--sparse-attention the halves get their twins too (adapters on sparse evaluations). "
                            f"sp=1, inductor or aoti. At most {slots_bound()}")
    slots.add_argument("--lora-max-rank", type=positive, metavar="R",
                       help="with --lora-slots: the largest LoRA rank a slot holds (the banks are N x R per linear); "
                            "bounded with --lora-slots")
    p.add_argument("--task", default=TASKS[0], choices=TASKS,
                   help="t2va/fl2va (FL2VA partition, default t2va) or ref2va (Ref2VA)")
    p.add_argument("--sp", type=positive, default=1, help="Ulysses sequence-parallel degree the bundle serves (must divide "
                                                     "the attention heads: 1, 2, 4, 7, 8, 14, 28 or 56 for H3)")
    p.add_argument("--cfg", type=positive, default=1, help="guidance-branch parallel degree the bundle is launched with: 1 "
                                                      "(default; H3 is guidance-distilled) or 2")
    _build_attention_arguments(p)
    p.add_argument("--memory-budget", type=positive_float, metavar="GIB",
                   help="device memory the build may hold at once, at most what the device has free (default: what "
                        "it has free). The DiT goes onto the device whole where it fits in this, else a block at a "
                        "time (the same bundle, bit for bit); a build that fits neither way is refused before "
                        "anything loads, naming what it needs")
    p.add_argument("--overwrite", action="store_true", help="replace an existing bundle")
    p.add_argument("--sign", type=Path, metavar="KEY", help="sign the manifest with this Ed25519 private key (PEM; "
                                                            "`h3trt keygen KEY` makes one), writing manifest.sig")


def _build_attention_arguments(p) -> None:
    """build's sparse attention: SubBlock's block-sparse serving, or a FastH3-VSA checkpoint's VSA settings."""
    sparse = p.add_argument_group("block-sparse attention (README, 'Block-sparse attention')")
    sparse.add_argument("--sparse-attention", type=float, metavar="SPARSITY",
                        help="serve block-sparse attention: compile the block's two halves around it (sp=1) and the "
                             "kernel, and make SPARSITY (0 <= s < 1; 0: dense unless a request asks) its requests' "
                             "default; a request's own value or profile wins. Without it an sp=1 bundle serves "
                             "dense attention only")
    sparse.add_argument("--sparse-dense-steps", type=int, metavar="N",
                        help="with --sparse-attention: the default of the first N denoise steps kept dense (10)")
    sparse.add_argument("--sparse-min-seq", type=int, metavar="ROWS",
                        help="with --sparse-attention: the default of the shortest attention made sparse (4096)")
    sparse.add_argument("--sparse-kernel", default="auto", choices=("auto", "fa4", "fp8", "reference", "fp8_emulated"),
                        help="with --sparse-attention: the block-sparse kernel. auto (default): on a GPU the fastest "
                             "measured at the bundle's shape of fa4 (FlashAttention-4, bf16) and, with "
                             "--fp8-attention, fp8 (Triton, FP8 with the layers' scales; its tile timed too); on a "
                             "CPU fp8_emulated with --fp8-attention, else reference")
    vsa = p.add_argument_group("FastH3-VSA (a checkpoint whose blocks carry attn.to_gate_compress; README, 'VSA')")
    vsa.add_argument("--vsa-sparsity", type=float, metavar="S",
                     help="share of video key tiles each video query tile skips, 0 <= s < 1 (default: what the "
                          "checkpoint or --distilled file was distilled at, else 0.9, FastH3 v1's; 0: dense attention, "
                          "the coarse branch kept). Recorded in the manifest; a request may state its own")
    vsa.add_argument("--vsa-dense-first-steps", type=int, metavar="N",
                     help="the first N denoise steps run dense (default 0)")
    vsa.add_argument("--vsa-dense-layers", type=int, nargs="+", metavar="I",
                     help="main blocks that run dense in every step (default: none)")


def _schedule_arguments(p) -> None:
    """build's schedules: the AdaLN tables are baked for each (README, 'Few-step LoRAs and step caching')."""
    from ..models.sampler import DEFAULT_STEPS, MAX_STEPS, MIN_STEPS

    schedules = p.add_argument_group("schedules (the AdaLN tables are baked for each; --keep-adaln serves any)")
    schedules.add_argument("--steps", type=steps_list, default=None, metavar="N[,N...]",
                           help=f"sigma grid points of each schedule, {MIN_STEPS} to {MAX_STEPS} (default "
                                f"{DEFAULT_STEPS}): a comma list bakes "
                                "several (50,8: H3's and a Turbo LoRA's), any of them served, the first a request's "
                                "default")
    schedules.add_argument("--video-shift", type=shift_list, metavar="S[,S...]",
                           help="video sigma shift: one for every schedule, or one per --steps value (default: the "
                                "checkpoint's)")
    schedules.add_argument("--audio-shift", type=shift_list, metavar="S[,S...]",
                           help="audio sigma shift, as --video-shift (default: the checkpoint's)")


def _bundle_parsers(sub) -> None:
    """eval, inspect, verify, keygen: commands over bundles and keys."""
    from ..request.fields import PROFILE_NAMES

    e = sub.add_parser("eval", help="compare an engine bundle with a reference, or a speed profile with the lossless "
                                    "run, on the same requests and seeds")
    e.add_argument("--engine", required=True, type=Path,
                   help="the bundle under test (e.g. an fp8 build); with --profile and no --reference, any model: a "
                        "bundle, a checkpoint folder or 'tiny'")
    e.add_argument("--reference", help="a bundle, a checkpoint folder, or 'tiny' (eager); required unless --profile")
    e.add_argument("--profile", choices=PROFILE_NAMES,
                   help="run the engine side with this speed profile and the reference side (default: the engine "
                        "itself) lossless: SSIM/PSNR in YUV420, audio distance and denoise time of the profile")
    e.add_argument("--requests", required=True, type=Path,
                   help="JSON lines, the schema of `run --requests` (id and task optional): {\"prompt\": ..., "
                        "\"seed\": ...} (resolution or width/height, duration, steps default to the engine's)")
    e.add_argument("--json", type=Path, help="write the per-request and mean metrics here")
    e.add_argument("--distilled", metavar="FILE[@key=value,...]",
                   help="with a distilled --engine and an eager --reference (a checkpoint or 'tiny'): the same file, "
                        "fused into the reference (its sha256 must be the bundle's), so the eager merged model is "
                        "compared with the bundle")
    e.add_argument("--device", default=None, type=device,
                   help="cpu or cuda (default: where the engine bundle was built)")
    sub.add_parser("inspect", help="print a bundle's manifest").add_argument("bundle", type=Path)
    q = sub.add_parser("verify", help="re-hash every file of a bundle; with --trust, check who signed it")
    q.add_argument("bundle", type=Path)
    q.add_argument("--trust", type=Path, metavar="KEY.pub", help="the Ed25519 public key the bundle must be signed "
                                                                 "with")
    k = sub.add_parser("keygen", help="make an Ed25519 key pair for signing bundles (KEY and KEY.pub)")
    k.add_argument("key", type=Path, help="private key path (mode 0600); the public key goes to KEY.pub")
