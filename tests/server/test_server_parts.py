"""A server's parts wired once (server/parts.py): one node's and a fleet process's store, storage, metrics, log,
service, queue and workers, in this process over SQLite in a temporary folder; the one expiry loop; the one JSON-line
log (server/log.py)."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
from helpers import Logged

from h3trt.jobs.supervisor import GroupState, GroupStatus
from h3trt.server.log import SERVER_LOG, JsonLog
from h3trt.server.options import ServeOptions
from h3trt.server.parts import Parts, start_expiry
from h3trt.server.store import sqlite_url

pytestmark = pytest.mark.unit


class TwoGroups:
    def status(self):
        return [GroupStatus(0, GroupState.SERVING), GroupStatus(1, GroupState.BUSY, restarts=2, jobs=["video_a"])]

    def serving(self):
        return 2


@pytest.fixture
def entry(tiny_cache):
    from h3trt.jobs.model_source import Entry

    return Entry.local(device="cpu")


def test_a_nodes_parts_share_one_store_storage_metrics_and_log(tmp_path, entry):
    log = Logged()
    parts = Parts.node(tmp_path / "data", log=log)
    assert (tmp_path / "data" / "clips").is_dir() and (tmp_path / "data" / "uploads").is_dir()
    assert parts.store.url == sqlite_url(tmp_path / "data")
    service = parts.service(entry, ServeOptions(tmp_path / "data"), TwoGroups(), guidance_branches=2)
    queue = parts.queue(entry, 60.0, name=lambda g: f"host:1/group{g}")
    assert (service.store, service.storage, service.metrics) == (parts.store, parts.storage, parts.metrics)
    assert (queue.store, queue.storage, queue.metrics, queue.retention_s) == (parts.store, parts.storage,
                                                                              parts.metrics, 60.0)
    assert service.guidance_branches == 2 and service.log is log and queue.log is log
    # /metrics reads the store and the groups at every scrape
    metrics = service.metrics.exposition().decode()
    assert 'h3trt_replica_groups{state="serving"} 1.0' in metrics and 'h3trt_replica_groups{state="busy"} 1.0' in metrics
    assert "h3trt_replica_group_restarts_total 2.0" in metrics
    # what the API stores, the queue claims under its name
    parts.store.create("video_" + "a" * 32, {"schema": {"prompt": "x"}, "openai": {}, "geometry": [64, 32]})
    [job] = queue.take(0, 1)
    assert job.id == "video_" + "a" * 32 and parts.store.get(job.id).worker == "host:1/group0"
    service.log("probe")
    assert log.events("probe") == [{}]
    parts.close()


def test_the_workers_log_through_the_parts_log_with_their_context(tmp_path, entry):
    log = Logged()
    parts = Parts.shared(sqlite_url(tmp_path), tmp_path, log=log)
    spec = SimpleNamespace(mesh=SimpleNamespace(replica=2))
    workers = parts.workers(spec, parts.queue(entry, 60.0), None, load_failures_fatal=True, replica="host:7")
    assert workers.fatal and len(workers.groups) == 2
    workers.log("replica group 0 serves again")
    assert log.lines == [("worker", {"replica": "host:7", "message": "replica group 0 serves again"})]
    parts.close()


def test_the_expiry_loop_removes_ended_jobs_with_their_files_and_survives_a_failed_pass(tmp_path, entry):
    log = Logged()
    parts = Parts.node(tmp_path, log=log)
    service = parts.service(entry, ServeOptions(tmp_path, retention_s=1.0), TwoGroups())  # a pass every 0.5 s
    job = "video_" + "b" * 32
    parts.store.create(job, {"schema": {"prompt": "x"}})
    parts.store.claim("group0")
    parts.store.end(job, "completed", 0.0, record={}, output="x", worker="group0", clip_attempt=1)
    (tmp_path / "clips" / f"{job}.mp4").write_bytes(b"clip")
    rows, failed = parts.store.rows, []

    def flaky(**kwargs):  # the store unreachable for the first pass
        if not failed:
            failed.append(True)
            raise ConnectionError("the store is down")
        return rows(**kwargs)

    parts.store.rows = flaky
    stop = start_expiry(service)
    deadline = time.monotonic() + 10
    while parts.store.get(job) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    assert parts.store.get(job) is None and not (tmp_path / "clips" / f"{job}.mp4").exists()
    assert log.events("expiry_error") == [{"error": "ConnectionError: the store is down"}]
    assert log.events("expired") == [{"jobs": [job]}]
    assert [t.name for t in threading.enumerate()].count("h3trt-expiry") <= 1
    parts.close()


def test_a_file_log_writes_whole_json_lines_from_many_threads(tmp_path):
    log = JsonLog(tmp_path / "events.jsonl")

    def emit(t):
        for i in range(50):
            log("http", thread=t, i=i, path=tmp_path)  # a Path: written as its text

    threads = [threading.Thread(target=emit, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.say("a plain line")
    log.close()
    *events, plain = (tmp_path / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in events]
    assert plain == "a plain line"
    assert sorted((e["thread"], e["i"]) for e in events) == [(t, i) for t in range(4) for i in range(50)]
    assert all(list(e)[:2] == ["ts", "event"] and e["path"] == str(tmp_path) for e in events)


def test_the_server_log_writes_to_stderr_as_it_is_at_each_write(capsys):
    SERVER_LOG("ready", url="http://h:1", groups=2)
    SERVER_LOG.say("h3trt serve: ready")
    err = capsys.readouterr().err.splitlines()
    assert json.loads(err[0])["event"] == "ready" and err[1] == "h3trt serve: ready"
