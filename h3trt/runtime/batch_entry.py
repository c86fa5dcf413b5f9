"""`h3trt run --requests FILE --out-dir DIR`: the flags checked, the whole file validated, the out-dir locked, and the
model loaded once, on this process (`run_batch`) or on a mesh (`--gpus N` or torchrun), where each replica group runs
`run_batch` over its share of the file (ranks set up as in h3trt/runtime/serve.py)."""

from __future__ import annotations

import sys
import tempfile
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..engines.guard import no_compile
from ..engines.manifest import bundle_identity, read_manifest
from ..engines.signing import key_fingerprint, load_public_key, read_trusted_manifest
from ..models.checkpoint import locate_transformer
from ..models.config import H3Config
from ..models.packing import FPS
from ..models.tiny import TINY_HEIGHT, TINY_REFERENCE_SHORT_EDGE, TINY_WIDTH, ensure_tiny_checkpoint
from ..parallel.launch import init_rank, init_torchrun_rank, launch, torchrun_rank
from ..parallel.mesh import build_mesh, resolve_mesh
from .batch import BatchAborted, BatchConfig, finished, run_batch, summary_line
from .batch_file import BatchFileError, check_bundle_batch, parse_requests
from .files import BatchLock, estimated_clip_bytes, preflight_out_dir, remove_leftovers, remove_own_temps
from .pipeline import H3Pipeline
from .request import CanvasDefaults, check_prompt_tokens
from .serve import Job, launch_gpus, load_rank_pipeline, rank_device


def run_batch_on_mesh(args, items, config, root, manifest, device, canvas, model: str, extra: dict) -> int:
    """`h3trt run --requests` on a mesh: each replica group runs `run_batch` over its share of the file."""
    torchrun = torchrun_rank()
    if torchrun is not None and args.gpus > 1:
        raise ValueError(f"Under torchrun the world is torchrun's ({torchrun[1]} ranks); leave out --gpus.")
    world = torchrun[1] if torchrun else args.gpus
    task = "ref2va" if items[0].key[0] == "ref2va" else "t2va"
    heads = (H3Config.from_dict(manifest["model_config"]) if manifest else locate_transformer(root, task).config).num_heads
    mesh = resolve_mesh(world, heads, manifest["mesh"] if manifest else None, args.cfg, args.sp, args.replicas)
    if mesh.cfg == 2:
        raise ValueError("--cfg 2 splits guidance branches, and batch files carry no guidance; use --cfg 1.")
    job = Job(str(root), manifest is not None, task, "cuda" if str(device).startswith("cuda") else "cpu", mesh,
              canvas=canvas, model_name=model, record_extra=extra, vae_precision=args.vae_precision,
              loras=tuple(args.lora), trust=str(args.trust) if args.trust is not None else None)
    if torchrun is not None:
        rank, world, local_rank = init_torchrun_rank(job.device_type)
        failed = serve_batch_rank(rank, world, local_rank, job, heads, items, config)
        dist.barrier()
        dist.destroy_process_group()
        return 1 if failed else 0
    with tempfile.TemporaryDirectory(prefix="h3trt-batch-") as tmp:
        try:
            launch(serve_batch_launched, world, (job, heads, items, config, tmp),
                   gpus=launch_gpus(job.device_type, world))
        except BaseException:  # Ctrl-C or a failed rank: every rank was stopped; remove what they were writing
            remove_leftovers(config.out_dir)
            raise
        failed = sum(int(f.read_text()) for f in Path(tmp).glob("failed-*"))
    print(f"{config.out_dir}: batch on replica({mesh.replica}) x cfg({mesh.cfg}) x sp({mesh.sp}): {failed} failed "
          f"(per-request records in {config.out_dir})")
    return 1 if failed else 0


def serve_batch_rank(rank: int, world: int, local_rank: int, job: Job, num_heads: int, items, config) -> int:
    """One rank of a mesh batch run; returns the failures its replica group recorded (0 on non-writing ranks)."""
    par = build_mesh(job.mesh, job.device_type, world, num_heads)
    pipeline = load_rank_pipeline(job, par, rank_device(job.device_type))
    mine = replace(config, shard=(par.replica_index, job.mesh.replica), write=par.writes,
                   decode_group=par.decode_group, quiet=config.quiet or not par.writes)
    summary = run_batch(pipeline, items, mine, job.model_name, job.record_extra)
    if par.writes:
        print(f"replica group {par.replica_index}: {summary_line(summary)}")
        return len(summary.failed)
    return 0


def serve_batch_launched(rank: int, world: int, store: str, job: Job, num_heads: int, items, config, tmp: str) -> None:
    init_rank(rank, world, store, job.device_type)
    Path(tmp, f"failed-{rank}").write_text(str(serve_batch_rank(rank, world, rank, job, num_heads, items, config)))


def engine_manifest(args) -> dict:
    """--engine's manifest, read before anything else: with --trust only if it carries that key's signature (every
    file is then checked against it when the bundle loads, before any of its code runs)."""
    if args.trust is not None:
        return read_trusted_manifest(args.engine, args.trust)
    return read_manifest(args.engine)


def served_identity(manifest: dict, args) -> dict:
    """What a record says about the bundle that served it, with the key that vouched for it under --trust."""
    identity = bundle_identity(manifest)
    if args.trust is not None:
        identity["signed_by"] = key_fingerprint(load_public_key(args.trust))
    return identity


def run_requests(args) -> int:
    """The CLI's batch mode: validate the whole file, load the model once, run; 0 if every request is done."""
    single = [flag for flag, value in (("--prompt", args.prompt), ("--output", args.output), ("--image", args.image),
                                       ("--last-image", args.last_image), ("--ref", args.ref)) if value]
    if single:
        raise ValueError(f"--requests takes every request from its file; drop {' '.join(single)}.")
    if args.out_dir is None:
        raise ValueError("--requests needs --out-dir DIR (OUT/<id>.mp4 and OUT/<id>.json per request).")
    if args.cache is not None:
        raise ValueError("--cache decides per request, and a batch run shares one DiT evaluation per step across "
                         "requests; run cached requests one at a time (h3trt run --prompt ... --cache ...).")
    if args.lora and args.engine is not None:
        raise ValueError(f"--lora applies to --model runs; the bundle {args.engine} was compiled with the LoRAs its "
                         "manifest lists. Rebuild it with h3trt build --lora FILE[:SCALE].")
    if args.trust is not None and args.engine is None:
        raise ValueError("--trust checks a bundle's signature; pass it with --engine DIR.")
    manifest = None
    if args.engine is not None:
        manifest = engine_manifest(args)
        check_bundle_batch(manifest, args.max_batch)
    tiny = manifest["tiny"] if manifest else args.model is None
    canvas = (CanvasDefaults(short_edge=TINY_HEIGHT, max_pixels=TINY_WIDTH * TINY_HEIGHT,
                             reference_short_edge=TINY_REFERENCE_SHORT_EDGE) if tiny else CanvasDefaults())
    config = BatchConfig(args.out_dir, args.max_batch, args.fail_fast, args.crf, quiet=args.quiet)
    default_steps = manifest["schedule"]["steps"] if manifest else 50  # a bundle's baked schedule is its default
    items = parse_requests(args.requests, canvas, default_steps)  # every line checked before any model loads
    tasks = {"ref2va" if i.key[0] == "ref2va" else "t2va" for i in items}
    if manifest is None and len(tasks) > 1:
        raise ValueError(f"{args.requests} mixes ref2va with t2va/fl2va requests, which use different checkpoint "
                         "partitions (Ref2VA/ and FL2VA/); split the file and run each part.")
    device = args.device or (manifest["device"].split(":")[0] if manifest else
                             ("cuda" if torch.cuda.is_available() else "cpu"))
    root = args.engine if manifest else (ensure_tiny_checkpoint() if tiny else args.model)
    component_root = root if manifest else locate_transformer(root, items[0].key[0]).component_root
    try:
        check_prompt_tokens(component_root, [(f"{args.requests}:{i.line}: the prompt", i.request.prompt)
                                             for i in items])
    except ValueError as e:
        raise BatchFileError(f"{e} Nothing was run.") from None
    # Before any model loads: the out-dir is a writable folder with room for its largest clip, and no other batch
    # writes it (under torchrun, rank 0 holds the lock for the job).
    preflight_out_dir(args.out_dir, max(estimated_clip_bytes(i.key[2], i.key[1], i.key[3], FPS, args.crf)
                                        for i in items))
    torchrun = torchrun_rank()
    lock = BatchLock(args.out_dir) if torchrun is None or torchrun[0] == 0 else nullcontext()
    try:
        with lock:
            return _run_requests_locked(args, items, config, manifest, tiny, root, canvas, device, torchrun)
    except KeyboardInterrupt:
        remove_own_temps()
        done = [i.id for i in items if finished(config.out_dir, i)]
        listed = ", ".join(done[:10]) + (f" and {len(done) - 10} more" if len(done) > 10 else "")
        print(f"h3trt: interrupted: {len(done)} of {len(items)} requests are done in {args.out_dir}"
              f"{' (' + listed + ')' if done else ''}, each with its record; the others left no files. Rerun the "
              "same command to finish them.", file=sys.stderr)
        return 130


def _run_requests_locked(args, items, config, manifest, tiny, root, canvas, device, torchrun) -> int:
    if args.gpus > 1 or torchrun is not None:
        model = str(args.engine) if manifest else ("embedded-tiny" if tiny else str(root))
        extra = {"bundle": served_identity(manifest, args)} if manifest else {}
        return run_batch_on_mesh(args, items, config, root, manifest, device, canvas, model, extra)
    if manifest is not None:
        pipeline = H3Pipeline.load_engine(args.engine, device, canvas, vae_precision=args.vae_precision,
                                          trust=args.trust)
        extra = {"bundle": served_identity(manifest, args)}
        model, serving = str(args.engine), no_compile()
    else:
        if tiny:
            print("h3trt: using the embedded tiny default model (random weights): every clip is noise. Pass --model "
                  "PATH for real MiniMax-H3 weights.", file=sys.stderr)
        pipeline = H3Pipeline.load(root, items[0].key[0], device, canvas, args.vae_precision,
                                   loras=tuple(args.lora))
        extra, model, serving = {}, "embedded-tiny" if tiny else str(root), nullcontext()
    try:
        with serving:
            summary = run_batch(pipeline, items, config, model, extra)
    except BatchAborted as e:
        print(f"h3trt: stopped: {e}", file=sys.stderr)
        return 1
    print(f"{args.out_dir}: {summary_line(summary)}")
    return 1 if summary.failed else 0
