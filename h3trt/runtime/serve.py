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
from .files import DEFAULT_CRF
from .pipeline import H3Pipeline
from .records import record_path
from .request import request_dict


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
    crf: int = DEFAULT_CRF
    quiet: bool = False
    model_name: str = ""  # what the record says served it
    record_extra: dict = field(default_factory=dict)  # added to every record (e.g. the bundle's identity)
    vae_precision: str | None = None  # --vae-precision (None: a bundle's, else bf16 on CUDA / fp32 on the CPU)
    loras: tuple = ()  # LoraSpecs merged into an eager DiT on every rank (a bundle has its own)
    overwrite: bool = False  # --overwrite: replace an existing clip and record (the preflight refused them otherwise)
    trust: str | None = None  # --trust: the public key a bundle must be signed with
    profile_step: int | None = None  # --profile-step: the evaluation whose host overhead is measured


class StepBar:
    """The denoise progress bar of one request, an `on_step` callback: one bar, open from the first step to the last,
    so neither the text encode before it nor the decode after it is counted in its rate."""

    def __init__(self, desc: str = "denoise"):
        self.desc, self.bar = desc, None

    def __call__(self, i: int, n: int) -> None:
        if self.bar is None:
            self.bar = tqdm(total=n, initial=i - 1, desc=self.desc, unit="step", file=sys.stderr)
        self.bar.update(1)
        if i == n:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def rank_device(device_type: str) -> torch.device:
    """A rank's device: on GPUs always cuda:0, since every rank's own GPU is its cuda:0 (h3trt/parallel/devices.py);
    that is what lets one compiled bundle serve on every GPU of a node."""
    return torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")


def load_rank_pipeline(job: Job, par: Parallel, device: torch.device):
    """This rank's pipeline: a bundle checked against the launched mesh, or the eager model with Ulysses blocks."""
    if job.engine:
        return H3Pipeline.load_engine(Path(job.model_root), device, job.canvas, mesh=par.config,
                                      sp_group=par.sp_group, cfg_group=par.cfg_group, vae_precision=job.vae_precision,
                                      trust=job.trust)
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
            bar = StepBar(f"denoise {Path(output).name} (replica {par.replica_index}, {_mesh_text(job.mesh)})")
        try:
            mesh = {"replica": job.mesh.replica, "cfg": job.mesh.cfg, "sp": job.mesh.sp,
                    "replica_index": par.replica_index}
            record = pipeline.generate(prepared, Path(output), crf=job.crf, write=par.writes,
                                       on_step=bar, decode_group=par.decode_group, overwrite=job.overwrite,
                                       profile_step=job.profile_step,
                                       finish=record_completer(prepared.request, job.model_name,
                                                               {**job.record_extra, "mesh": mesh}))
        finally:
            if bar is not None:
                bar.close()
        if par.writes:
            report_record(record, Path(output))
            records.append(record)
    return records


def _mesh_text(mesh: MeshConfig) -> str:
    return f"cfg={mesh.cfg} x sp={mesh.sp}"


def serve_launched(rank: int, world: int, store: str, job: Job, num_heads: int) -> None:
    """Entry of a rank spawned by `h3trt.parallel.launch.launch` (one host: local rank = rank)."""
    init_rank(rank, world, store, job.device_type)
    serve_rank(rank, world, rank, job, num_heads)


def record_completer(request, model: str, extra: dict | None = None):
    """`finish` for H3Pipeline.generate: the request, what served it and `extra` (a bundle's identity, the mesh) go
    into the record before it is committed with the MP4."""
    def finish(record: dict) -> None:
        record.update(extra or {})
        record["request"] = request_dict(request)
        record["model"] = model

    return finish


def report_record(record: dict, output: Path) -> None:
    """Print the summary of a written clip."""
    print(f"wrote {output}: {record['frames']} frames {record['width']}x{record['height']} @ {record['fps']} fps, "
          f"{record['audio_samples'] / record['audio_sample_rate']:.3f} s stereo audio ({record['task']}, "
          f"seed {record['seed']})")
    for stage, seconds in record["timings_s"].items():
        print(f"  {stage:<17}{seconds:8.2f} s")
    # Stages overlap (video decode, audio decode and encoding run concurrently): the total is wall time, not a sum.
    print(f"  {'wall':<17}{record['wall_s']:8.2f} s   (timings: {record_path(output)})")
