"""`h3trt serve` as operators meet it, each against real server processes (the tiny model on the CPU): a kill -9
restart that loses and repeats nothing, a SIGTERM drain, the queue bound, retention, a 2-rank gloo group behind the
API, and a rank killed mid-job."""

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

import serving
from serving import Server

pytestmark = pytest.mark.serve


@pytest.fixture(autouse=True)
def _no_server_outlives_its_test():
    since = len(serving.STARTED)
    yield
    serving.stop_started(since)


def _rows(data_dir) -> dict:
    with sqlite3.connect(data_dir / "jobs.sqlite3") as db:
        db.row_factory = sqlite3.Row
        return {r["id"]: dict(r) for r in db.execute("SELECT * FROM jobs")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout} s")


def test_kill_9_restart_ends_every_job_exactly_once_and_leaves_no_orphans(tmp_path, tiny_cache):
    data = tmp_path / "data"
    srv = Server(data)
    srv.wait("/ready")
    running = srv.create(prompt="running when killed", size="160x96", steps=30)
    queued = [srv.create(prompt=f"queued {i}", seed=i) for i in range(2)]
    _wait_for(lambda: srv.job(running["id"])["evaluations"]["done"] >= 1, 120, "the first job denoising")
    with httpx.Client(base_url=srv.url) as c:
        pids = c.get("/ready").json()["groups"][0]["pids"]
    assert pids and all(_alive(p) for p in pids)
    srv.kill()  # kill -9: no drain, no goodbye
    _wait_for(lambda: not any(_alive(p) for p in pids), 30, "the worker ranks dying with their server")
    rows = _rows(data)
    assert rows[running["id"]]["status"] == "in_progress" and {rows[q["id"]]["status"] for q in queued} == {"queued"}

    srv.start()  # the same data folder, the same port
    srv.wait("/ready")
    ended = {j["id"]: srv.wait_job(j["id"]) for j in [running, *queued]}
    assert {j["status"] for j in ended.values()} == {"completed"}, ended
    assert ended[running["id"]]["attempts"] == 2  # interrupted once, run again once
    assert [ended[q["id"]]["attempts"] for q in queued] == [1, 1]  # never started before: run once
    clips = sorted(p.name for p in (data / "clips").iterdir())
    # The files of the claim that completed each job (the interrupted one's second), no partial MP4
    assert clips == sorted(f"{j}.attempt{e['attempts']}.{ext}" for j, e in ended.items()
                           for ext in ("json", "mp4", "webp")), clips
    assert list((data / "uploads").iterdir()) == []
    for job_id, job in ended.items():
        record = json.loads((data / "clips" / f"{job_id}.attempt{job['attempts']}.json").read_text())
        assert record["job"] == job_id and record["status"] == "done"
    assert srv.stop() == 0


def test_sigterm_drains_running_jobs_keeps_queued_ones_and_exits_0(tmp_path, tiny_cache):
    data = tmp_path / "data"
    srv = Server(data, "--drain-timeout", "120")
    srv.wait("/ready")
    running = srv.create(prompt="finishes during the drain", size="160x96", steps=10)
    waiting = srv.create(prompt="stays queued")
    _wait_for(lambda: srv.job(running["id"])["status"] == "in_progress", 120, "the first job running")
    srv.signal(signal.SIGTERM)
    refused = _wait_for(lambda: _post(srv).status_code == 503 and _post(srv), 30, "503 while draining")
    assert refused.json()["error"]["type"] == "server_error" and refused.headers["retry-after"]
    assert srv.proc.wait(180) == 0, srv.log()[-3000:]
    rows = _rows(data)
    assert rows[running["id"]]["status"] == "completed"  # the running job finished
    assert rows[waiting["id"]]["status"] == "queued"  # the queued one waits in the store

    srv.start()
    srv.wait("/ready")
    assert srv.wait_job(waiting["id"])["status"] == "completed"
    assert srv.stop() == 0


def _post(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        return c.post("/v1/videos", json={"prompt": "late", "size": "128x32", "steps": 2})


def test_a_full_queue_answers_429_and_results_expire_with_their_files(tmp_path, tiny_cache):
    data = tmp_path / "data"
    srv = Server(data, "--max-queue", "1", "--retention", "3s")
    srv.wait("/health")  # listening; the worker may still be loading, so posted jobs wait in the queue
    responses = [_post(srv) for _ in range(4)]
    codes = [r.status_code for r in responses]
    assert 429 in codes and codes[0] == 200, codes
    full = responses[codes.index(429)]
    assert int(full.headers["retry-after"]) >= 1
    assert full.json()["error"]["type"] == "rate_limit_exceeded" and "--max-queue 1" in full.json()["error"]["message"]

    srv.wait("/ready")
    done = srv.wait_job(responses[0].json()["id"])
    assert done["status"] == "completed" and done["expires_at"] - done["completed_at"] in (2, 3, 4)
    files = list((data / "clips").glob(f"{done['id']}.*"))
    assert len(files) == 3
    _wait_for(lambda: not any(f.exists() for f in files), 30, "the expired job's files removed")
    with httpx.Client(base_url=srv.url) as c:
        assert c.get(f"/v1/videos/{done['id']}").status_code == 404
    assert done["id"] not in _rows(data)  # the row went with its files
    assert srv.stop() == 0


def test_a_two_rank_gloo_group_serves_and_a_killed_rank_restarts_its_group(tmp_path, tiny_cache):
    data = tmp_path / "data"
    srv = Server(data, "--gpus", "2", "--sp", "2", "--device", "cpu")
    srv.wait("/ready")
    with httpx.Client(base_url=srv.url) as c:
        group = c.get("/ready").json()["groups"][0]
    assert len(group["pids"]) == 2
    first = srv.wait_job(srv.create(prompt="sharded over two ranks", seed=9)["id"])
    assert first["status"] == "completed", first
    record = json.loads((data / "clips" / f"{first['id']}.attempt1.json").read_text())
    assert record["mesh"] == {"replica": 1, "cfg": 1, "sp": 2, "replica_index": 0}

    long = srv.create(prompt="its rank dies", size="160x96", steps=30)
    _wait_for(lambda: srv.job(long["id"])["evaluations"]["done"] >= 1, 120, "the job denoising")
    os.kill(group["pids"][1], signal.SIGKILL)  # rank 1 of the group, mid-job
    ended = srv.wait_job(long["id"], timeout=300)
    assert ended["status"] == "completed" and ended["attempts"] == 2, ended  # re-queued once, then done
    with httpx.Client(base_url=srv.url) as c:
        ready = c.get("/ready").json()
        metrics = c.get("/metrics").text
    assert ready["ready"] and ready["groups"][0]["restarts"] == 1 and ready["groups_serving"] == 1, ready
    assert "h3trt_replica_group_restarts_total 1.0" in metrics
    assert "rank 1 of 2 failed: it died (signal 9)" in ready["groups"][0]["last_failure"]
    assert srv.stop() == 0


def test_a_port_in_use_is_refused_before_any_rank_starts(tmp_path, tiny_cache):
    """The server binds --port before its workers start (a rank's gloo sockets take ephemeral ports, and one took a
    test's freshly chosen port once): a port another process listens on is one line and exit 2, and no rank or
    model was started for it."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "h3trt.cli", "serve", "--data-dir", str(tmp_path / "data"),
                               "--port", str(port), "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [  # nothing before it: no store recovered, no model announced
        f"h3trt: error: could not listen on 127.0.0.1:{port} (Address already in use); pass a free --port, and a "
        "--host that is an address of this machine."], proc.stderr


def test_serve_max_batch_runs_queued_jobs_of_one_key_as_one_batched_denoise(tmp_path, tiny_cache):
    """`h3trt serve --max-batch 4` over a data folder holding three queued jobs (admitted as POST admits them, before
    the server started: two of one batch key, one of other steps): its group's first claim takes the two together and
    denoises them as one batch (each record's `batch` names both), then the third alone; each job gets its own clip."""
    from types import SimpleNamespace

    from h3trt.jobs.model_source import Entry
    from h3trt.server.options import ServeOptions
    from h3trt.server.parts import Parts

    data = tmp_path / "data"
    parts = Parts.node(data, log=lambda *a, **k: None)
    service = parts.service(Entry.local(device="cpu"), ServeOptions(data), SimpleNamespace(status=list,
                                                                                            serving=lambda: 1))
    sent = [{"prompt": "a red fox runs through snow", "size": "128x32", "seconds": "5", "seed": seed, "steps": steps}
            for seed, steps in ((1, 2), (2, 3), (3, 2))]
    a, other, c = [service.create(fields, [], False).id for fields in sent]
    parts.close()
    srv = Server(data, "--max-batch", "4")
    srv.wait("/health")
    for job in (a, other, c):
        assert srv.wait_job(job)["status"] == "completed"
    assert srv.stop() == 0, srv.log()[-3000:]
    rows = _rows(data)
    batches = {job: json.loads(rows[job]["record"])["batch"] for job in (a, other, c)}
    assert batches[a]["members"] == batches[c]["members"] == [a, c] and batches[a]["size"] == 2
    assert batches[other]["members"] == [other]
