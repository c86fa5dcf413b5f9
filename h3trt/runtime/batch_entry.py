"""`h3trt run --requests FILE --out-dir DIR`: the whole file validated, the out-dir locked, and the model (an Entry,
resolved once by the CLI) loaded once, on this process (`run_batch`) or on a mesh (`--gpus N` or torchrun), where
each replica group runs `run_batch` over its share of the file (ranks set up as in h3trt/runtime/serve.py)."""

from __future__ import annotations

import sys
import tempfile
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from ..models.packing import FPS
from ..parallel.launch import init_rank, init_torchrun_rank, launch
from ..parallel.mesh import build_mesh
from .batch import BatchAborted, BatchConfig, finished, run_batch, summary_line
from .batch_file import check_bundle_batch, parse_requests
from .entry import Entry
from .files import DEFAULT_CRF, BatchLock, estimated_clip_bytes, preflight_out_dir, remove_leftovers, remove_own_temps
from .request import check_prompt_tokens
from .requests import RequestsFileError
from .serve import Job, launch_gpus, load_rank_pipeline, rank_device


def run_requests(entry: Entry, requests: Path, out_dir: Path, max_batch: int = 1, fail_fast: bool = False,
                 crf: int = DEFAULT_CRF, quiet: bool = False) -> int:
    """The CLI's batch mode: validate the whole file, load the model once, run; 0 if every request is done."""
    if entry.manifest is not None:
        check_bundle_batch(entry.manifest.segments, max_batch)
    config = BatchConfig(out_dir, max_batch, fail_fast, crf, quiet=quiet)
    items = parse_requests(requests, entry.canvas, entry.default_steps)  # every line checked before any model loads
    tasks = {"ref2va" if i.key[0] == "ref2va" else "t2va" for i in items}
    if not entry.is_bundle and len(tasks) > 1:
        raise ValueError(f"{requests} mixes ref2va with t2va/fl2va requests, which use different checkpoint "
                         "partitions (Ref2VA/ and FL2VA/); split the file and run each part.")
    try:
        check_prompt_tokens(entry.component_root(items[0].key[0]),
                            [(f"{requests}:{i.line}: the prompt", i.request.prompt) for i in items])
    except ValueError as e:
        raise RequestsFileError(f"{e} Nothing was run.") from None
    # Before any model loads: the out-dir is a writable folder with room for its largest clip, and no other batch
    # writes it (under torchrun, rank 0 holds the lock for the job).
    preflight_out_dir(out_dir, max(estimated_clip_bytes(i.key[2], i.key[1], i.key[3], FPS, config.crf)
                                   for i in items))
    lock = BatchLock(out_dir) if entry.torchrun is None or entry.torchrun[0] == 0 else nullcontext()
    try:
        with lock:
            return _run_requests_locked(entry, items, config)
    except KeyboardInterrupt:
        remove_own_temps()
        done = [i.id for i in items if finished(config.out_dir, i)]
        listed = ", ".join(done[:10]) + (f" and {len(done) - 10} more" if len(done) > 10 else "")
        print(f"h3trt: interrupted: {len(done)} of {len(items)} requests are done in {out_dir}"
              f"{' (' + listed + ')' if done else ''}, each with its record; the others left no files. Rerun the "
              "same command to finish them.", file=sys.stderr)
        return 130


def _run_requests_locked(entry: Entry, items, config: BatchConfig) -> int:
    if entry.on_mesh:
        return run_batch_on_mesh(entry, items, config)
    entry.note()
    pipeline = entry.load(items[0].key[0])
    try:
        with entry.serving():
            summary = run_batch(pipeline, items, config, entry.model_name, entry.record_extra)
    except BatchAborted as e:
        print(f"h3trt: stopped: {e}", file=sys.stderr)
        return 1
    print(f"{config.out_dir}: {summary_line(summary)}")
    return 1 if summary.failed else 0


def run_batch_on_mesh(entry: Entry, items, config: BatchConfig) -> int:
    """`h3trt run --requests` on a mesh: each replica group runs `run_batch` over its share of the file."""
    task = "ref2va" if items[0].key[0] == "ref2va" else "t2va"
    mesh = entry.mesh(task)
    if mesh.cfg == 2:
        raise ValueError("--cfg 2 splits guidance branches, and batch files carry no guidance; use --cfg 1.")
    job = entry.job(task, mesh)
    heads = entry.num_heads(task)
    if entry.torchrun is not None:
        rank, world, local_rank = init_torchrun_rank(job.device_type)
        failed = serve_batch_rank(rank, world, local_rank, job, heads, items, config)
        dist.barrier()
        dist.destroy_process_group()
        return 1 if failed else 0
    with tempfile.TemporaryDirectory(prefix="h3trt-batch-") as tmp:
        try:
            launch(serve_batch_launched, entry.world, (job, heads, items, config, tmp),
                   gpus=launch_gpus(job.device_type, entry.world))
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
