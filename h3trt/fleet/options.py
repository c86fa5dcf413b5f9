"""A fleet's settings (`h3trt serve --ray ADDRESS ...`): one frozen record, validated once, before Ray is touched."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UserError
from ..server.options import parse_duration

APP_NAME = "h3trt"
DEFAULT_LEASE = "30s"
DEFAULT_JOBS_PER_REPLICA = 1.0


@dataclass(frozen=True)
class FleetOptions:
    """Where the fleet runs, keeps its jobs and its clips, and how many worker replicas it runs."""

    address: str  # the Ray cluster (ray.init's address: auto, or the head's host:port)
    store_url: str  # the shared job store, a SQLAlchemy URL (postgresql+psycopg://user@host/db)
    storage_url: str  # clips and uploads: a path every node mounts, or an fsspec URL (s3://bucket/prefix)
    min_replicas: int = 1  # worker replicas (one replica group each) the autoscaler keeps at least
    max_replicas: int = 1  # ... and at most
    jobs_per_replica: float = DEFAULT_JOBS_PER_REPLICA  # the queue depth (queued + running) one replica should hold
    lease_s: float = 30.0  # a running job whose worker has not renewed its lease for this long is recovered
    app_name: str = APP_NAME  # the Serve application's name

    def __post_init__(self):
        if self.store_url.startswith("sqlite"):
            raise UserError("A fleet's replicas (on several nodes) share one job store: pass --store "
                            "postgresql+psycopg://USER@HOST/DB (SQLite is the one-node store of h3trt serve).")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise UserError(f"--min-replicas {self.min_replicas} and --max-replicas {self.max_replicas} must satisfy "
                            "1 <= min <= max (a worker replica reads the queue depth that scales the fleet, so at "
                            "least one runs).")
        if not (self.jobs_per_replica > 0 and math.isfinite(self.jobs_per_replica)):
            raise UserError(f"--jobs-per-replica must be a positive number, got {self.jobs_per_replica}.")
        if not self.lease_s >= 2:
            raise UserError(f"--lease must be at least 2 s (workers renew it every lease / 4), got {self.lease_s:g} s.")

    @classmethod
    def from_args(cls, args) -> "FleetOptions":
        if args.store is None:
            raise UserError("--ray needs --store: the PostgreSQL job store every replica shares, e.g. "
                            "postgresql+psycopg://h3trt@db-host/h3trt.")
        if args.storage is None:
            raise UserError("--ray needs --storage: where clips and uploads live for every replica and the ingress, a "
                            "shared path (/mnt/h3trt) or an fsspec URL (s3://bucket/h3trt).")
        return cls(args.ray, args.store, args.storage, args.min_replicas, args.max_replicas, args.jobs_per_replica,
                   parse_duration(args.lease, "--lease"))
