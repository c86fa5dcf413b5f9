"""`h3trt serve --ray ADDRESS`: the same video API on a Ray Serve fleet, two deployments in one Serve application:

  Ingress        the FastAPI app of `h3trt serve` (server/app.py `create_app`) over the API side (server/service.py):
                 admission, reads, content, cancels, expiry; one replica, a fraction of a CPU, no GPU
  WorkerReplica  one replica group of the mesh (cfg x sp ranks) per Serve replica: its GPUs reserved on one node by a
                 placement group (a bundle per rank, STRICT_PACK: Ray's recipe for tensor-parallel inference), its
                 ranks spawned inside the replica by h3trt's own launcher (jobs/supervisor.py `Workers`, one group;
                 Ray's placement context does not reach plain subprocesses, vllm-project/vllm #30016, so the replica
                 asks each bundle which GPU it holds and hands them to its ranks), running the same job loop as
                 `h3trt serve`; autoscaled on queue depth (fleet/autoscale.py)

Jobs flow through the shared store, not through Serve: the ingress inserts them queued (PostgreSQL), every worker
replica claims the oldest queued job (FOR UPDATE SKIP LOCKED: two replicas never take the same one), reports progress
and the end into its row, and publishes the clip to the shared storage before the row says completed. A worker
replica renews the lease of the job it runs every lease / 4; when a replica dies (its process killed, its node gone),
its ranks die with it and its lease runs out, and any live worker replica queues the job again, once (then fails it:
worker_lost), so it finishes on another replica. Serve replaces the dead replica.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import socket
import sys
import threading
import time

from ..errors import UserError
from ..jobs.model_source import Entry
from ..jobs.rank import WorkerSpec
from ..jobs.supervisor import GroupState, GroupStatus
from ..paths import use_bytecode_cache
from ..server.app import create_app
from ..server.log import SERVER_LOG
from ..server.options import ServeOptions
from ..server.parts import Parts, start_expiry
from ..server.queue import keep_leases
from ..server.store import JobStore, store_unreachable
from .autoscale import QUEUED, RUNNING, QueueDepthPolicy
from .options import FleetOptions
from .preflight import preflight

EXTRA_MODULES = ("ray", "psycopg", "fsspec")  # and [serve]'s (server/main.py EXTRA_MODULES)
WORKER_DEPLOYMENT, INGRESS_DEPLOYMENT = "WorkerReplica", "Ingress"
STATUS_CACHE_S = 2.0  # how long the ingress reuses Serve's view of the worker replicas (/ready, /metrics)


class WorkerReplica:
    """One replica group in a Serve replica (module doc). Its constructor returns once the group has loaded the model
    and serves: Serve counts the replica RUNNING from then on (replica start to ready)."""

    def __init__(self, entry: Entry, options: ServeOptions, fleet: FleetOptions, spec: WorkerSpec):
        use_bytecode_cache()  # a replica is an entry point: it and the ranks it spawns keep their bytecode
        self.fleet, self.options = fleet, options
        self.id = f"{socket.gethostname()}:{os.getpid()}"
        self.parts = Parts.shared(fleet.store_url, fleet.storage_url)
        self.store, self.storage = self.parts.store, self.parts.storage
        # What replicas killed on this host left (partial clips, scratch and rank-group folders), before this one
        # writes its own; a live process's are left alone.
        SERVER_LOG("swept", replica=self.id, **self.storage.sweep())
        self.queue = self.parts.queue(entry, options.retention_s, name=lambda group: f"{self.id}/group{group}")
        self.workers = self.parts.workers(spec, self.queue, bundle_gpus(spec), load_failures_fatal=True,
                                          replica=self.id)
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="h3trt-workers", daemon=True)
        self._thread.start()
        threading.Thread(target=self._leases, name="h3trt-leases", daemon=True).start()
        while not self.workers.serving():
            if self.failure is not None:
                raise RuntimeError(f"worker replica {self.id} could not start its replica group: {self.failure}")
            time.sleep(0.1)
        SERVER_LOG("replica_ready", replica=self.id, groups=[g.to_json() for g in self.workers.status()])

    def _run(self) -> None:
        try:
            self.workers.run()
        except BaseException as e:  # noqa: BLE001 -- check_health reports it; Serve replaces this replica
            self.failure = f"{type(e).__name__}: {e}"
            SERVER_LOG("workers_stopped", replica=self.id, error=self.failure)

    def _leases(self) -> None:
        keep_leases(self.queue, self.fleet.lease_s, self._stop, SERVER_LOG, self.id)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (fleet/autoscale.py): the fleet's queue depth, from the store."""
        counts = self.store.counts()
        return {QUEUED: float(counts["queued"]), RUNNING: float(counts["in_progress"])}

    def check_health(self) -> None:
        if self.failure is not None or not self._thread.is_alive():
            raise RuntimeError(f"worker replica {self.id}: its replica group stopped ({self.failure})")

    def status(self) -> list[GroupStatus]:
        return [dataclasses.replace(g, replica=self.id) for g in self.workers.status()]

    def __del__(self) -> None:
        """Serve stops this replica (scale down, redeploy): take no new job, let the running one finish within the
        drain timeout, then stop (what it still runs is queued again)."""
        if not hasattr(self, "_thread"):
            return
        self.workers.drain()
        self._thread.join(self.options.drain_timeout_s)
        self.workers.stop()
        self._thread.join(30)
        self._stop.set()
        self.parts.close()


def bundle_gpus(spec: WorkerSpec) -> list[str] | None:
    """The GPUs of this replica's placement group, bundle by bundle (rank r takes bundle r's): a zero-CPU task in
    each bundle reports the GPU Ray gave it, since the ranks are our own processes and inherit no placement. None on
    the CPU."""
    if spec.device_type != "cuda":
        return None
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.get_current_placement_group()
    if group is None:
        raise RuntimeError("a GPU worker replica runs in its placement group (placement_group_bundles); none found")

    @ray.remote(num_cpus=0, num_gpus=1)
    def gpu_of_bundle() -> str:
        return str(ray.get_gpu_ids()[0])

    return ray.get([gpu_of_bundle.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=rank)).remote() for rank in range(spec.group_size)])


class FleetGroups:
    """The worker replicas as the ingress's /ready and /metrics describe them (server/metrics.py `Groups`): one group
    per replica, its state from Serve's status of the worker deployment (RUNNING: serving; STARTING: loading), and
    what it runs from the store: a running job's row names its replica (host:pid/group), so a replica that holds one
    is busy, with its jobs and its process id (its ranks are that process's children)."""

    STATES = {"RUNNING": GroupState.SERVING, "STARTING": GroupState.LOADING, "PENDING_MIGRATION": GroupState.SERVING}

    def __init__(self, app_name: str, store: JobStore):
        self.app_name, self.store = app_name, store
        self._lock = threading.Lock()
        self._cached: tuple[float, list[GroupStatus]] = (0.0, [])

    def replica_states(self) -> dict[str, int]:
        """Serve's count of the worker deployment's replicas by state."""
        from ray import serve

        try:
            app = serve.status().applications[self.app_name]
            states = app.deployments[WORKER_DEPLOYMENT].replica_states
        except (KeyError, AttributeError):
            return {}
        return {str(getattr(state, "value", state)): n for state, n in states.items()}

    def status(self) -> list[GroupStatus]:
        with self._lock:
            at, groups = self._cached
            if time.monotonic() - at < STATUS_CACHE_S:
                return groups
            names = sorted(name for name, n in self.replica_states().items() for _ in range(n))
            running: dict[str, list[str]] = {}
            try:
                for row in self.store.rows(status="in_progress"):
                    running.setdefault((row.worker or "").split("/", 1)[0], []).append(row.id)
            except Exception as e:
                if not store_unreachable(e):
                    raise
                # The replicas as Serve sees them, what they run unknown until the store answers (/ready says so).
            busy = iter(sorted(running.items()))
            groups = []
            for i, name in enumerate(names):
                group = GroupStatus(i, self.STATES.get(name, GroupState.RESTARTING), replica_state=name)
                if group.state is GroupState.SERVING and (held := next(busy, None)) is not None:
                    replica, job_ids = held
                    pid = replica.rsplit(":", 1)[-1]
                    group = dataclasses.replace(group, state=GroupState.BUSY, replica=replica, jobs=job_ids,
                                                pids=[int(pid)] if pid.isdigit() else [])
                groups.append(group)
            self._cached = (time.monotonic(), groups)
            return groups

    def serving(self) -> int:
        return sum(1 for g in self.status() if g.state.serves)


class Ingress:
    """The API side of `h3trt serve` over the fleet's store and storage; Serve builds its FastAPI app after the
    constructor (`__serve_build_asgi_app__`)."""

    def __init__(self, workers, entry: Entry, options: ServeOptions, fleet: FleetOptions, guidance_branches: int):
        use_bytecode_cache()  # a replica is an entry point (paths.py)
        self.workers = workers  # the worker deployment's handle: it binds the two into one application
        parts = Parts.shared(fleet.store_url, fleet.storage_url)
        self.service = parts.service(entry, options, FleetGroups(fleet.app_name, parts.store), guidance_branches)
        self._stop = start_expiry(self.service)

    def __serve_build_asgi_app__(self):
        return create_app(self.service)

    def __del__(self) -> None:
        if hasattr(self, "service"):
            self.service.draining.set()
            self._stop.set()


def application(entry: Entry, options: ServeOptions, fleet: FleetOptions, spec: WorkerSpec):
    """The Serve application: the ingress bound to the autoscaled worker deployment."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    gpu = spec.device_type == "cuda"
    bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
    worker = serve.deployment(
        WorkerReplica, name=WORKER_DEPLOYMENT,
        # A bundle per rank of the group, all on one node; the replica's actor sits in the first, without a GPU of
        # its own (its ranks take the bundles' GPUs).
        ray_actor_options={"num_cpus": 1, "num_gpus": 0},
        placement_group_bundles=[bundle] * spec.group_size, placement_group_strategy="STRICT_PACK",
        autoscaling_config=AutoscalingConfig(
            min_replicas=fleet.min_replicas, max_replicas=fleet.max_replicas, initial_replicas=fleet.min_replicas,
            policy=AutoscalingPolicy(policy_function=QueueDepthPolicy,
                                     policy_kwargs={"jobs_per_replica": fleet.jobs_per_replica})),
        graceful_shutdown_timeout_s=options.drain_timeout_s + 30, health_check_period_s=5,
        max_ongoing_requests=4)
    ingress = serve.deployment(serve.ingress()(Ingress), name=INGRESS_DEPLOYMENT, num_replicas=1,
                               ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=256)
    return ingress.bind(worker.bind(entry, options, fleet, spec), entry, options, fleet, spec.mesh.cfg)


def deploy(entry: Entry, options: ServeOptions, fleet: FleetOptions) -> int:
    """Connect to the Ray cluster at `fleet.address`, start Serve's HTTP proxy on --host/--port, deploy (or update)
    the application, and return once every worker replica serves; the fleet runs on in the cluster."""
    from ..server.main import EXTRA_MODULES as SERVE_MODULES

    missing = [m for m in (*SERVE_MODULES, *EXTRA_MODULES) if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"h3trt serve --ray needs {', '.join(missing)}: pip install 'h3trt[fleet]'.")
    # The store reachable with a known schema (migrated), the storage writable: before anything is replaced.
    preflight(fleet.store_url, fleet.storage_url)
    task = entry.model.task
    mesh = entry.mesh(task)
    if mesh.replica != 1:
        raise UserError(f"With --ray the mesh flags describe one replica group ({mesh.cfg * mesh.sp} ranks) and Serve "
                        f"runs the replicas: drop --replicas {mesh.replica}, use --min-replicas/--max-replicas.")
    spec = entry.worker_spec(task, mesh, crf=options.crf, max_batch=options.max_batch)
    connect(fleet.address)
    from ray import serve

    started = time.time()
    serve.start(http_options={"host": options.host, "port": options.port})
    serve.run(application(entry, options, fleet, spec), name=fleet.app_name, route_prefix="/")
    url = f"http://{options.host}:{options.port}"
    SERVER_LOG("fleet_ready", url=url, seconds=round(time.time() - started, 3), replicas=fleet.min_replicas,
         store=_redacted(fleet.store_url), storage=fleet.storage_url)
    print(f"h3trt serve: the fleet serves at {url} ({fleet.min_replicas}..{fleet.max_replicas} worker replicas of "
          f"{spec.group_size} rank(s); `serve status`, `serve shutdown` manage it)", file=sys.stderr, flush=True)
    return 0


def connect(address: str) -> None:
    """Connect this process to the Ray cluster at `address` (host:port, or auto: the cluster `ray start` began on
    this node) as its driver, with Ray's token authentication settled first.

    `ray start --head` turns token authentication on when it finds a token (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH,
    RAY_AUTH_TOKEN), even one another Ray user left; `ray.init` with an explicit address never loads one, so the
    README's recipe died after 20 s of retries with Ray's traceback. Here a token this machine holds is always
    sent (the same rule as `ray start`'s; a cluster without token authentication ignores it), RAY_AUTH_MODE set
    explicitly is respected, and a cluster that refuses the token (or needs one this machine lacks) is one line
    naming the token's file and the fix, within a second."""
    import ray
    from ray._private import services
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
    from ray._raylet import AuthenticationTokenLoader, GcsClient
    from ray.exceptions import AuthenticationError

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    try:
        gcs = services.canonicalize_bootstrap_address_or_die(address)
    except ConnectionError as e:
        raise UserError(f"--ray {address}: {e}") from None
    try:
        GcsClient(address=gcs).cluster_id  # one authenticated call: Ray's own connect retries for 20 s
    except AuthenticationError:
        source = _token_source()
        fix = "put the head node's token there (`ray get-auth-token` on the head prints it) and deploy again"
        if AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
            raise UserError(f"The Ray cluster at {gcs} refused the token in {source} (it is not this cluster's, "
                            f"perhaps left by another Ray user): {fix}.") from None
        raise UserError(f"The Ray cluster at {gcs} requires token authentication and this machine has no token "
                        f"({source} does not exist): {fix}.") from None
    ray.init(address=gcs, log_to_driver=False)


def _token_source() -> str:
    """Where Ray reads this process's authentication token from, in Ray's order."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "the RAY_AUTH_TOKEN environment variable"
    return os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")


def _redacted(url: str) -> str:
    """A database URL without its password (for logs)."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
