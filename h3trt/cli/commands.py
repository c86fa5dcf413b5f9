"""What each `h3trt` command calls, given its parsed arguments: a few lines each, the work below (run/commands.py,
server/, fleet/, build/, eval.py, engines/). Imports stay inside the functions: a command loads only what it uses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import UserError


def entry_from_args(args):
    """The one Entry of an `h3trt run` or `serve` (one clip, --requests or HTTP; one process or a mesh): its three
    parts, each from its own flags."""
    from ..jobs.model_source import AdapterConfig, Entry, Launch, ModelSource

    model = ModelSource.resolve(args.engine, args.model, args.trust, args.vae_precision, tuple(args.lora),
                                distilled_spec(args))
    adapters = AdapterConfig.resolve(model, tuple(getattr(args, "adapter", ())), getattr(args, "lora_dir", None),
                                     getattr(args, "lora_slots", None), getattr(args, "lora_max_rank", None))
    return Entry(model, Launch.resolve(model, args.device, args.gpus, args.cfg, args.sp, args.replicas), adapters)


def distilled_spec(args):
    """--distilled FILE[@key=value,...], parsed (None: not given)."""
    from ..models.distilled.families import DistilledSpec

    text = getattr(args, "distilled", None)
    return DistilledSpec.parse(text) if text is not None else None


def cmd_run(args) -> int:
    from ..request.parse import with_bundle_sparse
    from ..run.commands import run_clip, run_requests
    from .args import profile_fields_from_args

    if args.requests is not None:
        if args.profile_step is not None:
            raise UserError("--profile-step measures one request's step; run that request alone (without "
                            "--requests).")
        check_batch_args(args)
        return run_requests(entry_from_args(args), args.requests, args.out_dir, args.max_batch, args.fail_fast,
                            args.crf, args.quiet, args.overwrite)
    if args.prompt is None or args.output is None:
        raise UserError("h3trt run needs --prompt and --output (or --requests FILE --out-dir DIR for a batch).")
    from ..models.sampler import ScheduleValues
    from ..models.vsa.plan import vsa_settings
    from ..request.fields import flag_values
    from ..request.request import Request, ScheduleChoice

    if args.vsa_sparsity is not None:
        vsa_settings(args.vsa_sparsity)  # its bounds, before anything loads
    entry = entry_from_args(args)  # the --adapter files checked first (a rank over a bundle's slots is that error)
    if args.adapter:  # it ran a plain clip, the adapter loaded and unused
        raise UserError(f"--adapter {args.adapter[0].name}=...: resident adapters run only for the requests that name "
                        "them (the `lora` key of a --requests line, or of a job sent to h3trt serve), and one --prompt "
                        "names none; pass --lora FILE[:SCALE] to apply a LoRA to this clip.")
    given = flag_values(args)  # the request's fields as its flags state them (the field table's flag column)
    # One clip names no adapter (its --lora, if any, is on every request): its flags, else the model's defaults
    schedule = ScheduleChoice.resolve(ScheduleValues(given["steps"], given["video_shift"], given["audio_shift"]), (),
                                      {}, entry.model.default_steps)
    # a flag > the bundle's default
    speed = with_bundle_sparse(profile_fields_from_args(args), entry.model.default_sparse)
    request = Request.of(given["prompt"], given["image"], given["last_image"], tuple(given["refs"]), given["seed"],
                         schedule.steps, given["width"], given["height"], given["duration"], schedule.video_shift,
                         schedule.audio_shift, given["guidance"], given["negative_prompt"], **speed,
                         vsa_sparsity=given["vsa_sparsity"], schedule_from=schedule.origin)
    return run_clip(entry, request, args.output, args.crf, args.overwrite, args.quiet, args.profile_step)


def cmd_serve(args) -> int:
    from ..server.main import serve
    from ..server.options import ServeOptions

    if args.ray is not None:
        from ..fleet.deploy import deploy
        from ..fleet.options import FleetOptions

        if args.max_replicas is None:
            args.max_replicas = args.min_replicas
        if args.lora_dir is not None:
            raise UserError("--lora-dir loads adapters while one node serves (POST /v1/loras); a fleet (--ray) serves "
                            "the adapters it was deployed with: pass them as --adapter NAME=FILE[:SCALE].")
        return deploy(entry_from_args(args), ServeOptions.from_args(args), FleetOptions.from_args(args))
    given = [flag for flag, value in (("--store", args.store), ("--storage", args.storage),
                                      ("--max-replicas", args.max_replicas)) if value is not None]
    if given:
        raise UserError(f"{' '.join(given)} {'are' if len(given) > 1 else 'is'} for a fleet; add --ray ADDRESS (README, 'A fleet'). One node keeps "
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
    per_request = [flag for flag, value in (("--profile", args.profile), ("--cache", args.cache),
                                            ("--cache-threshold", args.cache_threshold),
                                            ("--cache-warmup", args.cache_warmup),
                                            ("--cache-max-skip", args.cache_max_skip),
                                            ("--cache-retention", args.cache_retention),
                                            ("--mag-ratios", args.mag_ratios), ("--mag-calibrate", args.mag_calibrate),
                                            ("--sparse-attention", args.sparse_attention),
                                            ("--sparse-dense-steps", args.sparse_dense_steps),
                                            ("--sparse-min-seq", args.sparse_min_seq),
                                            ("--vsa-sparsity", args.vsa_sparsity))
                   if value is not None and value is not False]  # --cache-warmup 0 is stated too
    if per_request:
        raise UserError(f"{' '.join(per_request)} set one clip's speed profile; in a --requests file each line states "
                        "its own (\"profile\", \"cache\", \"cache_threshold\", \"cache_warmup\", "
                        "\"cache_max_skip\", \"sparse_attention\", ...), or run the clip alone "
                        "(h3trt run --prompt ...).")


def cmd_build(args) -> int:
    import torch

    from ..build.builder import build
    from ..build.config import BuildConfig, Profile
    from ..engines.signing import key_fingerprint, load_private_key, sign_bundle
    from ..models.tiny import TINY_HEIGHT, TINY_WIDTH, ensure_tiny_checkpoint

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
                         loras=tuple(args.lora), calib_algo=args.calib_algo, fp8_accum=args.fp8_accum,
                         sparse_attention=args.sparse_attention, sparse_dense_steps=args.sparse_dense_steps,
                         sparse_min_seq=args.sparse_min_seq, sparse_kernel=args.sparse_kernel,
                         lora_slots=args.lora_slots, lora_max_rank=args.lora_max_rank,
                         vsa_sparsity=args.vsa_sparsity, vsa_dense_first_steps=args.vsa_dense_first_steps,
                         vsa_dense_layers=tuple(args.vsa_dense_layers) if args.vsa_dense_layers else None,
                         distilled=distilled_spec(args), memory_budget=args.memory_budget)
    key = load_private_key(args.sign) if args.sign is not None else None  # a bad key fails before the build
    manifest = build(config, log=lambda m: print(f"h3trt build: {m}", file=sys.stderr),
                     sign=(lambda root: sign_bundle(root, key)) if key is not None else None)
    signed = f"signed by key {key_fingerprint(key.public_key())[:16]}" if key is not None else "unsigned"
    print(f"wrote {args.output}: {manifest.backend} {manifest.precision} bundle for {manifest.arch}, "
          f"{len(manifest.files)} files, {manifest.total_bytes / 1e6:.1f} MB; AdaLN "
          f"{'baked' if manifest.adaln.baked else 'kept'}; video decoder {manifest.vae_precision}; "
          + (f"sparse attention {manifest.sparse.kernel}"
             + (f" tile {manifest.sparse.tile}" if manifest.sparse.tile else "")
             + f" (default sparsity {manifest.sparse.sparsity:g}); "
             if manifest.sparse is not None else "")
          + (f"{manifest.lora_slots.slots} LoRA slot(s) of rank <= {manifest.lora_slots.max_rank}; "
             if manifest.lora_slots is not None else "")
          + f"manifest_sha256 {manifest.manifest_sha256}, {signed}")
    return 0


def cmd_eval(args) -> int:
    from ..eval import evaluate, reference_entry, table
    from ..jobs.model_source import Entry, ModelSource
    from ..media.output_files import write_json_atomic
    from ..request.parse import read_eval_requests

    if args.json is not None and args.json.exists():
        raise UserError(f"{args.json} already exists; choose another --json path.")
    if args.reference is None and args.profile is None:
        raise UserError("h3trt eval needs --reference (a bundle, a checkpoint or 'tiny') or --profile NAME (the "
                        "engine's clip with that profile against its own lossless clip).")
    # With --profile and no --reference the engine runs both sides: any model source serves (a bundle, a checkpoint
    # or 'tiny'); an engine compared with a reference is a bundle (evaluate says so).
    if args.reference is None:
        engine = reference_entry(str(args.engine), args.device)
    else:
        engine = Entry.local(ModelSource.resolve(engine=args.engine), args.device)
    requests = read_eval_requests(args.requests, engine.model.manifest)  # every line checked before any model loads
    reference = (reference_entry(args.reference, engine.launch.device, distilled_spec(args))
                 if args.reference is not None else None)
    result = evaluate(engine, reference, requests, log=lambda m: print(f"h3trt eval: {m}", file=sys.stderr),
                      profile=args.profile)
    print(table(result))
    if args.json is not None:
        write_json_atomic(args.json, result)
    return 0


def cmd_inspect(args) -> int:
    from ..engines.manifest import read_manifest
    from ..engines.signing import read_signature
    from ..engines.tensorrt_inspect import inspect_trt_bundle

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
    from ..engines.bundle_files import verify_files
    from ..engines.manifest import read_manifest
    from ..engines.signing import key_fingerprint, load_public_key, read_signature, read_trusted_manifest

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
    from ..engines.signing import generate_key, key_fingerprint, load_public_key

    private, public = generate_key(args.key)
    print(f"wrote {private} (private: keep it; h3trt build --sign {private}) and {public} (public: h3trt run/verify "
          f"--trust {public}); key {key_fingerprint(load_public_key(public))[:16]}")
    return 0


def choose_gpu(args) -> None:
    """Make the process's GPU its cuda:0 before anything starts CUDA (why: h3trt/parallel/devices.py): a torchrun rank
    takes GPU #LOCAL_RANK of the node, `--device cuda:N` takes GPU #N; `--device` then reads `cuda`."""
    from ..parallel.devices import cuda_index, pin_own_gpu, torchrun_local_rank

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
