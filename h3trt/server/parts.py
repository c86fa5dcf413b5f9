"""A server's parts, wired in one place for every server: `h3trt serve` (server/main.py, one node), a fleet's ingress
and worker replicas (fleet/deploy.py) and the fleet's CPU simulation (scripts/sim_fleet.py).

    Parts           the job store, the storage, the metrics and the log of one process
      .service      the API side over them (server/service.py), its /metrics watching the store and the groups
      .queue        the worker side over them (server/queue.py), claiming as `name(group)`
      .workers      the replica groups that serve the queue (jobs/supervisor.py), logging through the same log
    start_expiry    the one expiry loop: ended jobs' files and rows removed together, in the background

One node keeps its store (SQLite) and storage in its data folder; a fleet's processes share a store and a storage
named by URL (PostgreSQL; a folder or an object store).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..adapters.catalog import AdapterCatalog
from ..jobs.model_source import Entry
from ..jobs.rank import WorkerSpec
from ..jobs.supervisor import Workers
from .log import SERVER_LOG
from .metrics import Groups, Metrics
from .options import ServeOptions
from .queue import StoreQueue
from .service import VideoService, request_defaults
from .storage import Storage
from .store import JobStore, sqlite_url

EXPIRY_PERIOD_S = 30.0  # the expiry loop's longest period (a short retention is swept at a tenth of it)
DATA_FOLDERS = ("clips", "uploads")  # one node's data folder (README, "What survives a restart")


@dataclass
class Parts:
    """What one server process works over (module doc)."""

    store: JobStore
    storage: Storage
    metrics: Metrics = field(default_factory=Metrics)
    log: Callable[..., None] = SERVER_LOG  # log(event, **fields): one JSON line (server/log.py)
    fleet: bool = False  # a fleet's process (shared store and storage), else one node's

    @classmethod
    def node(cls, data_dir: Path, log: Callable[..., None] = SERVER_LOG) -> Parts:
        """One node's: the SQLite store and the storage of its data folder (its clips/ and uploads/ made)."""
        for folder in DATA_FOLDERS:
            (data_dir / folder).mkdir(parents=True, exist_ok=True)
        return cls(JobStore(sqlite_url(data_dir)), Storage(data_dir.resolve()), log=log)

    @classmethod
    def shared(cls, store_url: str, storage_url: str | Path, log: Callable[..., None] = SERVER_LOG) -> Parts:
        """A fleet process's: the store and the storage every process of the fleet shares."""
        return cls(JobStore(store_url), Storage(storage_url), log=log, fleet=True)

    def service(self, entry: Entry, options: ServeOptions, groups: Groups, guidance_branches: int = 1,
                adapters: AdapterCatalog | None = None) -> VideoService:
        """The API side, describing `groups` (/ready; /metrics reads them and the store at every scrape), over
        `adapters` (None: the entry's, fixed: a fleet's ingress)."""
        self.metrics.watch(self.store, groups)
        adapters = adapters if adapters is not None else entry.adapter_catalog(log=self.log)
        return VideoService(entry, options, self.store, self.storage, groups, self.metrics, guidance_branches,
                            log=self.log, adapters=adapters, fleet=self.fleet)

    def queue(self, entry: Entry, retention_s: float, name: Callable[[int], str] = lambda g: f"group{g}"
              ) -> StoreQueue:
        """The worker side: group `g` claims jobs as `name(g)` (unique across a fleet: host, process, group)."""
        return StoreQueue(self.store, self.storage, retention_s, request_defaults(entry), self.metrics, self.log,
                          name=name)

    def workers(self, spec: WorkerSpec, queue: StoreQueue, gpus: list[str] | None, load_failures_fatal: bool,
                **context) -> Workers:
        """The replica groups serving `queue`; what they say is logged as `worker` events, with `context`."""
        return Workers(spec, queue, gpus, load_failures_fatal=load_failures_fatal,
                       log=lambda message: self.log("worker", **context, message=message))

    def close(self) -> None:
        self.storage.close()
        self.store.close()


def start_expiry(service: VideoService) -> threading.Event:
    """Expire ended jobs (files and rows together, `VideoService.expire`) on a thread of its own, at a tenth of the
    retention and at most every EXPIRY_PERIOD_S, until the returned event is set. A failed pass (the store unreachable
    for a moment) is logged and tried again at the next."""
    stop = threading.Event()
    period = min(EXPIRY_PERIOD_S, max(0.5, service.options.retention_s / 10))

    def expire() -> None:
        while not stop.wait(period):
            try:
                service.expire()
            except Exception as e:  # noqa: BLE001 -- the server stays up; the next pass tries again
                service.log("expiry_error", error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")

    threading.Thread(target=expire, name="h3trt-expiry", daemon=True).start()
    return stop
