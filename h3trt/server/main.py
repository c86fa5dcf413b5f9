"""`h3trt serve`: one node's video job server.

  1. check: the [serve] extra, the model (Entry, resolved by the CLI), the mesh, the options, the data folder (one
     server per folder: a lock naming its holder)
  2. recover the store: jobs a stopped server was running are queued again (once), files without a job removed
  3. start the replica groups (jobs/supervisor.py, on a thread of this process; their ranks in processes of their
     own, loading the model once each), the expiry loop, and the HTTP server (uvicorn, this thread); the parts are
     wired in server/parts.py, as a fleet's are
  4. SIGTERM or Ctrl-C: drain (new jobs 503, running jobs finish within --drain-timeout, queued jobs stay in the
     store), then exit 0; a second signal stops at once (running jobs are queued again for the next start)
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

from ..errors import UserError
from ..jobs.model_source import Entry
from ..jobs.supervisor import launch_gpus
from ..media.output_files import hold_folder
from .log import SERVER_LOG
from .options import LOOPBACK, ServeOptions

EXTRA_MODULES = ("fastapi", "uvicorn", "prometheus_client", "sqlalchemy", "alembic", "multipart")


def serve(entry: Entry, options: ServeOptions) -> int:
    missing = [m for m in EXTRA_MODULES if not _importable(m)]
    if missing:
        raise UserError(f"h3trt serve needs {', '.join(missing)}: pip install 'h3trt[serve]'.")
    if entry.launch.torchrun is not None:
        raise UserError("h3trt serve launches its own ranks (--gpus N); run it as one process, not under torchrun. "
                        "Several nodes serve as a fleet: h3trt serve --ray ADDRESS (README, 'A fleet').")
    mesh = entry.mesh(entry.model.task)
    spec = entry.worker_spec(entry.model.task, mesh, crf=options.crf, max_batch=options.max_batch)
    gpus = launch_gpus(entry.launch.device_type, mesh.world_size)
    listener = _listen(options.host, options.port)  # first: a port in use creates nothing (no data folder, no lock)
    try:
        _make_data_dir(options.data_dir)
        with _data_dir_lock(options.data_dir):
            return _serve_locked(entry, options, spec, gpus, listener)
    finally:
        listener.close()


def _make_data_dir(data_dir: Path) -> None:
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--data-dir {data_dir}: cannot create it ({e.strerror or e}); create it yourself, or pass a "
                        "--data-dir on a writable filesystem.") from None


@contextlib.contextmanager
def _data_dir_lock(data_dir: Path):
    """One server per data folder: the lock file names its holder (pid, host, start time, command: its --port)."""
    lock = hold_folder(
        data_dir,
        busy=lambda holder: UserError(f"--data-dir {data_dir} is in use by another h3trt process ({holder}); stop "
                                      "it, or pass another --data-dir."),
        refused=lambda e: UserError(f"--data-dir {data_dir}: cannot lock it ({e.strerror or e}); pass a --data-dir "
                                    "on a writable filesystem."))
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


class Node:
    """One node's server: the API side and the worker side over one SQLite store and one data folder."""

    def __init__(self, entry: Entry, options: ServeOptions, spec, gpus):
        from ..adapters.catalog import STATE_FILE
        from .parts import Parts

        # The adapters at start (--adapter, --lora-dir, and what the admin calls changed before the last stop: kept
        # in the data folder), read and checked before anything else starts; the ranks start with that set, in
        # slots of the catalog's shape.
        adapters = entry.adapter_catalog(options.data_dir / STATE_FILE, SERVER_LOG)
        if adapters is not None:
            spec = replace(spec, adapters=adapters.specs(), lora_slots=adapters.shape)
        self.parts = Parts.node(options.data_dir)
        self.queue = self.parts.queue(entry, options.retention_s)
        self.workers = self.parts.workers(spec, self.queue, gpus, load_failures_fatal=False)
        self.service = self.parts.service(entry, options, self.workers, spec.mesh.cfg, adapters=adapters)

    def drain(self, timeout_s: float) -> bool:
        """SIGTERM: refuse new jobs, let the running ones finish (at most `timeout_s`); queued jobs stay queued.
        True when every running job ended within the bound."""
        store = self.service.store
        self.service.draining.set()
        self.workers.drain()
        deadline = time.monotonic() + timeout_s
        while store.counts()["in_progress"] and time.monotonic() < deadline:
            time.sleep(0.2)
        clean = not store.counts()["in_progress"]
        if not clean:
            SERVER_LOG("drain_timeout", message=f"running jobs did not finish within {timeout_s:g} s; they are queued "
                                                "again for the next start")
        self.workers.stop()
        return clean


def _serve_locked(entry: Entry, options: ServeOptions, spec, gpus, listener: socket.socket) -> int:
    import uvicorn

    from .app import create_app
    from .parts import start_expiry

    node = Node(entry, options, spec, gpus)
    service = node.service
    node.queue.recover()
    if options.api_key is None:
        SERVER_LOG("no_auth", message=f"no --api-key: serving on {LOOPBACK} only, without authentication")
    entry.model.note()
    workers = threading.Thread(target=_run_workers, args=(node.workers,), name="h3trt-workers")
    workers.start()
    stop_expiry = start_expiry(service)
    server = _Server(uvicorn.Config(create_app(service), host=options.host, port=options.port, log_level="warning",
                                   access_log=False, lifespan="off", timeout_graceful_shutdown=5), node)
    try:
        server.run([listener])
    finally:
        if not service.draining.is_set():  # the server stopped without a signal (a bind error, say)
            service.draining.set()
        node.workers.stop()
        workers.join(timeout=60)
        stop_expiry.set()
        node.parts.close()
    if server.bind_failed:
        raise UserError(f"could not listen on {options.host}:{options.port} (in use, or not an address of this "
                        "host); pass another --port.")
    SERVER_LOG("stopped", message="queued jobs stay in the store for the next start")
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the workers start: a rank's gloo connections bind ephemeral ports, and one
    could otherwise take --port (chosen free a moment earlier) before uvicorn binds it. A port in use is refused here,
    before any model loads."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"could not listen on {host}:{port} ({e.strerror or e}); pass a free --port, and a --host "
                        "that is an address of this machine.") from None
    return sock


def _run_workers(workers) -> None:
    try:
        workers.run()
    except BaseException as e:  # noqa: BLE001 -- the server stays up; /ready says no group serves
        SERVER_LOG("workers_stopped", error=f"{type(e).__name__}: {e}")


class _Server:
    """uvicorn's server with h3trt's signals: the first SIGTERM/SIGINT drains, a second one stops at once."""

    def __init__(self, config, node: Node):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(inner):
                old = {sig: signal.signal(sig, self._signal) for sig in (signal.SIGTERM, signal.SIGINT)}
                try:
                    yield
                finally:
                    for sig, handler in old.items():
                        signal.signal(sig, handler)

            async def startup(inner, sockets=None):
                await super().startup(sockets)
                if inner.started:
                    self._started(inner)
                else:
                    self.bind_failed = True

        self.server, self.node, self.service = Server(config), node, node.service
        self.bind_failed, self._signals = False, 0

    def run(self, sockets) -> None:
        self.server.run(sockets)
        if not self.server.started:
            self.bind_failed = True

    def _started(self, server) -> None:
        sockets = [s for srv in server.servers for s in srv.sockets]
        host, port = sockets[0].getsockname()[:2] if sockets else (self.service.options.host, 0)
        SERVER_LOG("listening", url=f"http://{host}:{port}")
        SERVER_LOG.say(f"h3trt serve: listening on http://{host}:{port} (the model loads in the workers; GET /ready)")
        threading.Thread(target=self._announce_ready, args=(f"http://{host}:{port}",), daemon=True).start()

    def _announce_ready(self, url: str) -> None:
        while not self.service.draining.is_set():
            serving = self.node.workers.serving()
            if serving:
                total = len(self.node.workers.groups)
                SERVER_LOG("ready", url=url, groups_serving=serving, groups=total)
                SERVER_LOG.say(f"h3trt serve: ready at {url}: {serving} of {total} replica group(s) serving "
                               f"{self.service.model_id}")
                return
            time.sleep(0.2)

    def _signal(self, signum, frame) -> None:
        self._signals += 1
        if self._signals > 1:
            SERVER_LOG("stopping", message="second signal: stopping now; running jobs are queued again")
            self.service.draining.set()
            self.node.workers.stop()
            self.server.should_exit = True
            return
        SERVER_LOG("draining", signal=signal.Signals(signum).name, timeout_s=self.service.options.drain_timeout_s)
        SERVER_LOG.say("h3trt serve: draining (new jobs get 503; running jobs may take "
                       f"{self.service.options.drain_timeout_s:g} s; a second signal stops now)")

        def drain():
            self.node.drain(self.service.options.drain_timeout_s)
            self.server.should_exit = True

        threading.Thread(target=drain, name="h3trt-drain", daemon=True).start()


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
