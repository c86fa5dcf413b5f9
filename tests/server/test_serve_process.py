"""`h3trt serve` as a process on its host: what it creates before it may serve, the one server per data folder, its
log (one JSON event per line, whoever writes), signals to its whole process group, a full data disk."""

import errno
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import serving
from serving import Server


@pytest.fixture(autouse=True)
def _no_server_outlives_its_test():
    since = len(serving.STARTED)
    yield
    serving.stop_started(since)


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3trt.cli", "serve", "--device", "cpu", *args], capture_output=True,
                          text=True, timeout=300)


def test_a_port_in_use_creates_no_data_folder_and_no_lock(tmp_path, tiny_cache):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        proc = _serve("--data-dir", str(tmp_path / "data"), "--port", str(held.getsockname()[1]))
    assert proc.returncode == 2, proc.stderr
    assert "could not listen" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no data folder, no lock file


def test_a_data_dir_on_a_read_only_filesystem_is_one_line_and_exit_2(tmp_path, tiny_cache, monkeypatch, capsys):
    """Fault injection at the one call that creates it (a real read-only mount needs root): EROFS."""
    from h3trt import cli

    target = tmp_path / "ro" / "data"
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self == target or target.is_relative_to(self) and self != tmp_path and tmp_path in self.parents:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    code = cli.main(["serve", "--device", "cpu", "--data-dir", str(target), "--port", str(serving.free_port())])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        f"h3trt: error: --data-dir {target}: cannot create it (Read-only file system); create it yourself, or pass a "
        "--data-dir on a writable filesystem."], err


def test_a_second_server_on_one_data_folder_names_the_data_dir_and_the_first_server(tmp_path, tiny_cache):
    data = tmp_path / "data"
    first = Server(data, "--device", "cpu")
    first.wait("/health")
    proc = _serve("--data-dir", str(data), "--port", str(serving.free_port()))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"h3trt: error: --data-dir {data} is in use by another h3trt process (pid "
                               f"{first.proc.pid} "), lines
    assert f"--port {first.port}" in lines[0] and "--out-dir" not in lines[0] and "batch" not in lines[0], lines
    assert first.stop() == 0


class _SlowStream(io.TextIOBase):
    """A stream whose every write yields the CPU, as a pipe to a log shipper under load does: writes of different
    threads interleave wherever a line is written in more than one call."""

    def __init__(self):
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        time.sleep(0.0005)
        self.parts.append(text)
        return len(text)


def test_concurrent_log_events_are_one_json_line_each(monkeypatch):
    from h3trt.server.log import SERVER_LOG as _log

    stream = _SlowStream()
    monkeypatch.setattr(sys, "stderr", stream)
    threads, per_thread = 8, 40

    def emit(t):
        for i in range(per_thread):
            _log("http", thread=t, i=i, path="/v1/videos")

    workers = [threading.Thread(target=emit, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    monkeypatch.undo()
    lines = "".join(stream.parts).split("\n")
    assert lines[-1] == ""
    events = [json.loads(line) for line in lines[:-1]]  # a glued line fails here
    assert sorted((e["thread"], e["i"]) for e in events) == [(t, i) for t in range(threads) for i in range(per_thread)]


class _SessionServer(Server):
    """A server started in a session of its own: a signal to its process group reaches it and its ranks, as
    systemd's KillMode=control-group and a terminal's Ctrl-C deliver it."""

    def start(self) -> "Server":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "h3trt.cli", "serve", *self.args], stdout=log,
                                     stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     start_new_session=True)
        log.close()
        return self


def _post(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        return c.post("/v1/videos", json={"prompt": "late", "size": "128x32", "steps": 2})


@pytest.mark.serve
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_whole_process_group_drains(tmp_path, tiny_cache, sig):
    data = tmp_path / "data"
    srv = _SessionServer(data, "--device", "cpu", "--drain-timeout", "120")
    srv.wait("/ready")
    running = srv.create(prompt="finishes during the drain", size="160x96", steps=10)
    deadline = time.monotonic() + 120
    while srv.job(running["id"])["evaluations"]["done"] < 1:
        assert time.monotonic() < deadline, srv.log()[-3000:]
        time.sleep(0.1)
    os.killpg(srv.proc.pid, sig)  # the server and every rank of its group
    refused = _post(srv)
    assert refused.status_code == 503, (refused.status_code, refused.text, srv.log()[-3000:])
    assert refused.json()["error"]["type"] == "server_error" and refused.headers["retry-after"]
    assert srv.proc.wait(180) == 0, srv.log()[-3000:]
    import sqlite3

    with sqlite3.connect(data / "jobs.sqlite3") as db:
        status, attempts = db.execute("SELECT status, attempts FROM jobs WHERE id = ?", (running["id"],)).fetchone()
    assert (status, attempts) == ("completed", 1), srv.log()[-3000:]  # finished by the drain, not queued again
    assert (data / "clips" / f"{running['id']}.attempt1.mp4").stat().st_size > 0


class _FullDisk:
    """Fault injection at the store's write boundary: while `on`, every write SQLite would make fails as it does on a
    full disk (sqlite3.OperationalError "database or disk is full", through SQLAlchemy)."""

    WRITES = ("create", "claim", "progress", "end", "requeue", "request_cancel", "remove")

    def __init__(self, store, monkeypatch):
        import sqlalchemy.exc
        import sqlite3

        self.on = False
        for name in self.WRITES:
            real = getattr(store, name)

            def write(*args, _real=real, **kwargs):
                if self.on:
                    raise sqlalchemy.exc.OperationalError("UPDATE jobs", {},
                                                          sqlite3.OperationalError("database or disk is full"))
                return _real(*args, **kwargs)

            monkeypatch.setattr(store, name, write)


def _node_parts(tmp_path):
    from h3trt.jobs.model_source import Entry
    from h3trt.jobs.supervisor import GroupState, GroupStatus
    from h3trt.server.metrics import Metrics
    from h3trt.server.options import ServeOptions
    from h3trt.server.queue import StoreQueue
    from h3trt.server.service import VideoService, request_defaults
    from h3trt.server.storage import Storage
    from h3trt.server.store import JobStore, sqlite_url

    class OneGroup:
        def status(self):
            return [GroupStatus(0, GroupState.SERVING)]

        def serving(self):
            return 1

    entry, logged = Entry.local(device="cpu"), []
    store, storage, metrics = JobStore(sqlite_url(tmp_path)), Storage(tmp_path), Metrics()
    queue = StoreQueue(store, storage, 3600, request_defaults(entry), metrics, lambda e, **f: logged.append((e, f)))
    service = VideoService(entry, ServeOptions(tmp_path), store, storage, OneGroup(), metrics, log=lambda *a, **k: None)
    return store, queue, service, logged


def test_a_full_disk_fails_the_job_that_met_it_keeps_workers_serving_and_recovers(tmp_path, tiny_cache, monkeypatch):
    from h3trt.jobs.job import Event
    from h3trt.pipeline.records import ClipRecord, Failure
    from h3trt.server.storage import clip_key

    store, queue, service, logged = _node_parts(tmp_path)
    disk = _FullDisk(store, monkeypatch)
    first = service.create({"prompt": "runs as the disk fills", **serving.SMALL}, [], False)
    second = service.create({"prompt": "waits for space", **serving.SMALL}, [], False)
    [job] = queue.take(0, 1)
    assert job.id == first.id
    disk.on = True
    queue.report(Event(first.id, "progress", "denoise", progress=40, group=0))  # dropped, not raised
    queue.storage.work_path(clip_key(first.id, job.attempt)).write_bytes(b"partial")
    queue.report(Event(first.id, "done", group=0, record=ClipRecord(id=first.id)))  # its end cannot be recorded now
    assert queue.take(0, 1) == []  # the worker keeps polling; no new job is claimed while the disk is full
    assert any(e == "disk_full" for e, _ in logged)
    disk.on = False  # space is back: the next poll records what ended, then serves the queue again
    [job] = queue.take(0, 1)
    assert job.id == second.id
    row = store.get(first.id)
    assert (row.status, row.error_code) == ("failed", "disk_full"), row
    assert not (tmp_path / clip_key(first.id, 1)).exists()  # the clip that could not be recorded is gone
    # A worker's own write that met ENOSPC (its MP4): that job fails as disk_full, the server goes on.
    queue.report(Event(second.id, "failed", "encode", group=0, error="encode: [Errno 28] No space left on device",
                       record=Failure("OSError")))
    assert (store.get(second.id).status, store.get(second.id).error_code) == ("failed", "disk_full")
    assert store.counts()["in_progress"] == 0
    store.close()


def test_a_full_disk_answers_507_in_the_envelope_and_admits_again_when_space_returns(tmp_path, tiny_cache,
                                                                                    monkeypatch):
    from fastapi.testclient import TestClient

    from h3trt.server.app import create_app

    store, queue, service, _ = _node_parts(tmp_path)
    disk = _FullDisk(store, monkeypatch)
    client = TestClient(create_app(service), raise_server_exceptions=False)
    disk.on = True
    r = client.post("/v1/videos", json={"prompt": "no room", **serving.SMALL})
    assert r.status_code == 507, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "disk_full" and "disk is full" in error["message"]
    assert r.headers["retry-after"]
    assert store.counts()["queued"] == 0 and list((tmp_path / "uploads").glob("*")) == []
    disk.on = False
    r = client.post("/v1/videos", json={"prompt": "room again", **serving.SMALL})
    assert r.status_code == 200, r.text
    store.close()


def test_a_draining_worker_records_the_ends_a_full_disk_held_back(tmp_path, tiny_cache, monkeypatch):
    """A drain claims nothing (no take), yet the drain waits for the running jobs' rows to end: the worker loop's
    every poll (cancels) records what the full disk held back, once space returns."""
    from h3trt.jobs.job import Event
    from h3trt.pipeline.records import Failure

    store, queue, service, _ = _node_parts(tmp_path)
    disk = _FullDisk(store, monkeypatch)
    row = service.create({"prompt": "ends as the disk fills", **serving.SMALL}, [], False)
    [job] = queue.take(0, 1)
    disk.on = True
    queue.report(Event(row.id, "failed", "encode", group=0, error="encode: [Errno 28] No space left on device",
                       record=Failure("OSError")))
    queue.cancels()
    assert store.get(row.id).status == "in_progress"
    disk.on = False
    queue.cancels()
    assert (store.get(row.id).status, store.get(row.id).error_code) == ("failed", "disk_full")
    assert store.counts()["in_progress"] == 0
    store.close()


def test_a_disk_full_jobs_message_keeps_the_servers_paths_to_the_log(tmp_path, tiny_cache):
    """The rank's error names the clip's temporary file on the server's disk: the job's message (what API clients
    read) says what happened in the API's words, and the log keeps the rank's error for the operator."""
    from h3trt.jobs.job import Event
    from h3trt.pipeline.records import Failure
    from h3trt.server.queue import DISK_FULL

    store, queue, service, logged = _node_parts(tmp_path)
    job = service.create({"prompt": "meets a full disk", **serving.SMALL}, [], False)
    [taken] = queue.take(0, 1)
    error = (f"encode: {tmp_path}/clips/.{job.id}.mp4.host-1-ab12.partial: writing the clip failed (No space left "
             "on device); its temporary file was removed")
    queue.report(Event(job.id, "failed", "encode", group=0, error=error, record=Failure("OutputError"),
                       attempt=taken.attempt))
    row = store.get(job.id)
    assert (row.status, row.error_code, row.error_message) == ("failed", "disk_full", DISK_FULL)
    assert str(tmp_path) not in row.error_message
    assert [fields["error"] for event, fields in logged if event == "failed"] == [error]
    store.close()
