"""Serving on a mesh: the one function every rank runs, whether `h3trt run --gpus N` spawned it or torchrun did.

  1. join the mesh: (replica, cfg, sp), validated with the arithmetic before the first collective
  2. load the pipeline for this rank: a bundle is checked against the launched mesh; the eager DiT is wrapped for sp
  3. each replica group takes its share of the requests (request i goes to group i mod replicas)
  4. every rank of a group denoises and decodes its share of the video tiles; only the group's first rank writes the
     MP4 and its record
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..parallel.devices import node_gpus
from ..parallel.launch import init_rank
from ..parallel.mesh import MeshConfig, Parallel, build_mesh
from ..parallel.ulysses import UlyssesDiT
from .pipeline import H3Pipeline, record_path, request_dict, write_json_atomic


@dataclass(frozen=True)
class Job:
    """What every rank needs to serve: picklable, so a spawned rank gets it whole."""

    model_root: str  # checkpoint folder or bundle
    engine: bool  # model_root is a bundle
    task: str  # the partition to load (t2va and fl2va share one)
    device_type: str  # cuda or cpu
    mesh: MeshConfig
    items: list = field(default_factory=list)  # [(Prepared, output path)] in request order
    canvas: object = None  # CanvasDefaults
    crf: int = 18
    quiet: bool = False
    model_name: str = ""  # what the record says served it
    record_extra: dict = field(default_factory=dict)  # added to every record (e.g. the bundle's identity)
    vae_precision: str | None = None  # --vae-precision (None: a bundle's, else bf16 on CUDA / fp32 on the CPU)
    loras: tuple = ()  # LoraSpecs merged into an eager DiT on every rank (a bundle has its own)


def rank_device(device_type: str) -> torch.device:
    """A rank's device: on GPUs always cuda:0, since every rank's own GPU is its cuda:0 (h3trt/parallel/devices.py);
    that is what lets one compiled bundle serve on every GPU of a node."""
    return torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")


def load_rank_pipeline(job: Job, par: Parallel, device: torch.device):
    """This rank's pipeline: a bundle checked against the launched mesh, or the eager model with Ulysses blocks."""
    if job.engine:
        return H3Pipeline.load_engine(Path(job.model_root), device, job.canvas, mesh=par.config,
                                      sp_group=par.sp_group, cfg_group=par.cfg_group, vae_precision=job.vae_precision)
    pipeline = H3Pipeline.load(Path(job.model_root), job.task, device, job.canvas, job.vae_precision,
                               loras=job.loras)
    if par.sp_group is not None:
        pipeline.dit = UlyssesDiT(pipeline.dit.model, par.sp_group)
    pipeline.cfg_group = par.cfg_group
    return pipeline


def launch_gpus(device_type: str, world: int) -> list[str] | None:
    """The node's GPUs that `world` self-launched ranks take one each (rank r: GPU #r), checked before any rank
    starts; None on the CPU."""
    if device_type != "cuda":
        return None
    gpus = node_gpus()
    if gpus is None or len(gpus) < world:
        raise ValueError(f"--gpus {world} but only {len(gpus or [])} CUDA devices are visible"
                         f"{' (CUDA_VISIBLE_DEVICES=' + ','.join(gpus) + ')' if gpus else ''}.")
    return gpus


def serve_rank(rank: int, world: int, local_rank: int, job: Job, num_heads: int) -> list[dict]:
    """Steps 1-4 on one rank (its process group already initialised); returns the records this rank wrote."""
    par = build_mesh(job.mesh, job.device_type, world, num_heads)
    pipeline = load_rank_pipeline(job, par, rank_device(job.device_type))
    records = []
    mine = job.items[par.replica_index::job.mesh.replica]
    for prepared, output in mine:
        bar = None
        if par.writes and not job.quiet:
            bar = tqdm(total=pipeline.schedule(prepared.request).num_evaluations, unit="step", file=sys.stderr,
                       desc=f"denoise {Path(output).name} (replica {par.replica_index}, {_mesh_text(job.mesh)})")
        try:
            record = pipeline.generate(prepared, Path(output), crf=job.crf, write=par.writes,
                                       on_step=(lambda i, n: bar.update(1)) if bar else None,
                                       decode_group=par.decode_group)
        finally:
            if bar is not None:
                bar.close()
        if par.writes:
            record.update(job.record_extra)
            record["mesh"] = {"replica": job.mesh.replica, "cfg": job.mesh.cfg, "sp": job.mesh.sp,
                              "replica_index": par.replica_index}
            finish_record(record, prepared.request, job.model_name, Path(output))
            records.append(record)
    return records


def _mesh_text(mesh: MeshConfig) -> str:
    return f"cfg={mesh.cfg} x sp={mesh.sp}"


def serve_launched(rank: int, world: int, store: str, job: Job, num_heads: int) -> None:
    """Entry of a rank spawned by `h3trt.parallel.launch.launch` (one host: local rank = rank)."""
    init_rank(rank, world, store, job.device_type)
    serve_rank(rank, world, rank, job, num_heads)


def finish_record(record: dict, request, model: str, output: Path) -> None:
    """Write the record beside the MP4 (atomically) and print the summary."""
    record["request"] = request_dict(request)
    record["model"] = model
    write_json_atomic(record_path(output), record)
    print(f"wrote {output}: {record['frames']} frames {record['width']}x{record['height']} @ {record['fps']} fps, "
          f"{record['audio_samples'] / record['audio_sample_rate']:.3f} s stereo audio ({record['task']}, "
          f"seed {record['seed']})")
    for stage, seconds in record["timings_s"].items():
        print(f"  {stage:<17}{seconds:8.2f} s")
    # Stages overlap (video decode, audio decode and encoding run concurrently): the total is wall time, not a sum.
    print(f"  {'wall':<17}{record['wall_s']:8.2f} s   (timings: {record_path(output)})")
