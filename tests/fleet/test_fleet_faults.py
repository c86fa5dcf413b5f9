"""The fleet's faults without Ray (issue 35 items 10-12): its job store, a throwaway PostgreSQL server of this module's
own (tests/postgres.py), stopped and started again under the API (server/app.py over server/service.py) and under a
worker's queue (server/queue.py `StoreQueue`), as a fleet's ingress and worker replicas use them."""

import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from h3trt.jobs.job import Event
from h3trt.pipeline.records import ClipRecord
from h3trt.jobs.supervisor import GroupState, GroupStatus
from h3trt.server.metrics import Metrics
from h3trt.server.options import ServeOptions
from h3trt.server.queue import StoreQueue
from h3trt.server.storage import Storage
from h3trt.server.store import JobStore

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def own_postgres():
    """A server this module alone stops and starts (the session's `postgres` is shared)."""
    from postgres import Postgres

    server = Postgres()
    yield server
    server.stop()


@pytest.fixture
def outage(own_postgres):
    """The store's URL and its server's switch: `outage.down()` stops it (the tests start it again, in `finally`)."""
    return SimpleNamespace(url=own_postgres.database(), down=own_postgres.halt, up=own_postgres.start)


class OneGroup:
    """A fleet's worker replicas as /ready sees them: one serving."""

    def status(self):
        return [GroupStatus(0, GroupState.SERVING)]

    def serving(self):
        return 1


def test_a_store_outage_is_a_503_envelope_and_not_ready_then_the_api_recovers(outage, tmp_path):
    from fastapi.testclient import TestClient

    from h3trt.server.app import create_app
    from h3trt.server.service import VideoService

    store = JobStore(outage.url)
    store.create("video_" + "a" * 32, {"schema": {"prompt": "x"}, "openai": {}, "geometry": [64, 32]})
    # what reading jobs needs of the model
    entry = SimpleNamespace(model=SimpleNamespace(tiny=True, manifest=None, default_steps=4))
    service = VideoService(entry, ServeOptions(data_dir=tmp_path), store,
                           Storage(tmp_path / "storage"), OneGroup(), Metrics(), log=lambda *a, **k: None)
    with TestClient(create_app(service), raise_server_exceptions=False) as client:
        assert client.get("/v1/videos").status_code == 200 and client.get("/ready").json()["ready"] is True
        outage.down()
        try:
            for path in ("/v1/videos", f"/v1/videos/video_{'a' * 32}"):
                answer = client.get(path)
                assert answer.status_code == 503, (path, answer.text)
                error = answer.json()["error"]
                assert error["code"] == "store_unreachable" and error["type"] == "server_error", error
                assert answer.headers["retry-after"] == "5"
            ready = client.get("/ready")
            assert ready.status_code == 503 and ready.json()["ready"] is False
            assert ready.json()["store_reachable"] is False
        finally:
            outage.up()
        assert client.get("/v1/videos").status_code == 200  # the pool reconnects by itself
        assert client.get("/ready").json() | {"groups": None} == {
            "ready": True, "draining": False, "store_reachable": True, "groups_serving": 1, "groups": None,
            "model": service.model_id}
    store.close()


def test_a_worker_keeps_its_job_through_a_store_outage_and_it_completes_once(outage, tmp_path):
    """The store goes down while a worker runs a job and asks for the next: the claim finds nothing (the replica
    stays), the running job's reports wait for the store, and once it is back the job completes on its first
    attempt, not queued again nor failed."""
    store = JobStore(outage.url)
    logged = []
    queue = StoreQueue(store, Storage(tmp_path / "storage"), 60, None, Metrics(),
                       lambda event, **fields: logged.append(event), name=lambda g: f"host:1/group{g}")
    store.create("video_run", {"schema": {"prompt": "x"}})
    store.create("video_next", {"schema": {"prompt": "y"}})
    assert store.claim(queue.name(0)).id == "video_run"
    outage.down()
    reported = threading.Event()
    try:
        assert queue.take(1, 1) == []  # a claim during the outage: nothing taken, no exception to stop the replica
        assert queue.cancels() == []
        reporter = threading.Thread(target=lambda: (queue.report(Event("video_run", "progress", "denoise", progress=50,
                                                                       evaluations=(1, 2), group=0)), reported.set()))
        reporter.start()
        time.sleep(2)
        assert not reported.is_set()  # it waits for the store
    finally:
        outage.up()
    reporter.join(30)
    assert reported.is_set() and "store_unreachable" in logged
    assert store.get("video_run").progress == 50
    queue.report(Event("video_run", "done", "done", record=ClipRecord(seed=1), group=0))
    row = store.get("video_run")
    assert (row.status, row.attempts, row.worker) == ("completed", 1, "host:1/group0")
    assert store.get("video_next").status == "queued"  # the claim during the outage took nothing
    store.close()


# --- a deploy's preflight (issue 35 #11) ------------------------------------------------------------------------------

def _refusal(call, *args) -> tuple[str, float]:
    from h3trt.errors import UserError

    started = time.monotonic()
    with pytest.raises(UserError) as refused:
        call(*args)
    return str(refused.value), time.monotonic() - started


def test_each_wrong_store_url_is_one_line_at_once(outage):
    from h3trt.fleet.preflight import check_store
    from serving import free_port

    server = outage.url.rsplit("/", 1)[0]
    cases = {
        "mysql+pymysql://root@127.0.0.1/db": "is PostgreSQL",
        "not a url": "not a database URL",
        "postgresql+psycopg://postgres@nohost.invalid/db": "does not resolve",
        f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/db": "check the port",
        server.replace("postgres@", "nobody_here:secret@") + "/postgres": "user or password",
        f"{server}/no_such_db": "database does not exist",
    }
    for url, says in cases.items():
        message, seconds = _refusal(check_store, url)
        assert says in message and "\n" not in message and seconds < 10, (url, message, seconds)
        assert "secret" not in message  # the password is not printed
    from sqlalchemy import create_engine, text

    engine = create_engine(outage.url)  # a store written by a newer h3trt: its schema is refused, not migrated
    with engine.begin() as c:
        c.execute(text("CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)"))
        c.execute(text("INSERT INTO alembic_version VALUES ('9999_from_the_future')"))
    engine.dispose()
    message, _ = _refusal(check_store, outage.url)
    assert "9999_from_the_future" in message and "does not know" in message


def test_a_storage_that_cannot_be_created_or_written_is_one_line(tmp_path):
    from h3trt.fleet.preflight import check_storage

    for url, says in (("/proc/h3trt-storage", "cannot create it"), ("/sys", "cannot write there")):
        message, seconds = _refusal(check_storage, url)
        assert says in message and url in message and "\n" not in message and seconds < 5, message
    check_storage(str(tmp_path / "clips-here"))  # a writable one passes and keeps nothing of the probe
    assert list((tmp_path / "clips-here").iterdir()) == []


def test_a_deploy_checks_store_and_storage_before_it_touches_ray(outage, monkeypatch):
    """A read-only --storage over a running fleet: refused before ray.init, so the working fleet stays."""
    import ray

    from h3trt.errors import UserError
    from h3trt.fleet.deploy import deploy
    from h3trt.fleet.options import FleetOptions

    touched = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: touched.append("ray.init"))
    fleet = FleetOptions(address="127.0.0.1:6379", store_url=outage.url, storage_url="/sys")
    with pytest.raises(UserError, match="cannot write there"):
        deploy(SimpleNamespace(manifest=None), ServeOptions(data_dir=Path("/nonexistent")), fleet)
    assert touched == []


# --- what killed replicas leave, and what /ready shows (issue 35 #12) -------------------------------------------------

def _dead_pid() -> int:
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_replica_start_sweeps_what_killed_processes_left_and_nothing_live(tmp_path, monkeypatch):
    import subprocess
    import tempfile

    from h3trt.engines.atomic import _HOST
    from h3trt.parallel.leftovers import UNNAMED_AGE_S, owned_temp_dir
    from h3trt.server.storage import Storage

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    dead = _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        clips = tmp_path / "storage" / "clips"
        clips.mkdir(parents=True)
        partial = {who: clips / f".video_{who}.mp4.{host}-{pid}-0123abcd.partial" for who, host, pid in (
            ("dead", _HOST, dead), ("live", _HOST, live.pid), ("elsewhere", "otherhost", dead))}
        for path in partial.values():
            path.write_bytes(b"half a clip")
        (clips / "video_done.mp4").write_bytes(b"a clip")
        launch = {who: tmp / f"h3trt-launch-{host}-{pid}-x1y2" for who, host, pid in (
            ("dead", _HOST, dead), ("live", _HOST, live.pid), ("elsewhere", "otherhost", dead))}
        launch |= {"old_empty": tmp / "h3trt-launch-a1b2c3", "old_full": tmp / "h3trt-launch-d4e5f6",
                   "new_empty": tmp / "h3trt-launch-g7h8i9", "scratch_dead": tmp / f"h3trt-scratch-{_HOST}-{dead}-q"}
        for path in launch.values():
            path.mkdir()
        (launch["old_full"] / "store").write_text("x")
        (launch["scratch_dead"] / "clips").mkdir()
        old = time.time() - UNNAMED_AGE_S - 60
        for who in ("old_empty", "old_full"):
            os.utime(launch[who], (old, old))
        mine = owned_temp_dir("h3trt-launch-")  # this process's: live
        swept = Storage(tmp_path / "storage").sweep()
        assert swept == {"partial_files": 1, "scratch_folders": 1, "launch_folders": 2}
        assert not partial["dead"].exists() and partial["live"].exists() and partial["elsewhere"].exists()
        assert (clips / "video_done.mp4").exists()
        gone = {who for who, path in launch.items() if not path.exists()}
        assert gone == {"dead", "old_empty", "scratch_dead"} and mine.exists()
        assert mine.name.startswith(f"h3trt-launch-{_HOST}-{os.getpid()}-")
    finally:
        live.kill()
        live.wait()


def test_the_fleets_ready_shows_the_jobs_and_process_of_each_busy_replica(tmp_path):
    from h3trt.fleet.deploy import FleetGroups
    from h3trt.server.store import sqlite_url

    class Serve(FleetGroups):
        def replica_states(self):
            return {"RUNNING": 3, "STARTING": 1}

    store = JobStore(sqlite_url(tmp_path))
    for name in ("a", "b", "c"):
        store.create(f"video_{name}", {"schema": {"prompt": name}})
    store.claim("hostB:22/group0")
    store.claim("hostA:11/group0")
    groups = Serve("h3trt", store)
    status = groups.status()
    assert [(g.state, list(g.jobs), list(g.pids), g.replica) for g in status] == [
        ("busy", ["video_b"], [11], "hostA:11"), ("busy", ["video_a"], [22], "hostB:22"), ("serving", [], [], None),
        ("loading", [], [], None)]
    assert groups.serving() == 3
    store.close()
    from sqlalchemy.exc import OperationalError

    class Down:
        def rows(self, **_):
            raise OperationalError("SELECT", {}, Exception("connection refused"))

    groups = Serve("h3trt", Down())  # a store that does not answer: Serve's view, what runs unknown
    assert [(g.state, g.jobs) for g in groups.status()] == [("serving", ())] * 3 + [("loading", ())]


def test_after_a_store_outage_a_replica_waits_a_lease_before_it_takes_others_jobs():
    """Every replica's leases look stale once the store is back; a replica that reclaimed at once would re-run the
    live jobs of replicas that had no chance to renew. It waits a whole lease of renewals first."""
    from h3trt.fleet.deploy import WorkerReplica
    from sqlalchemy.exc import OperationalError

    lease_s, down_until = 0.8, time.monotonic() + 0.5
    reclaims = []

    class Queue:
        def heartbeat(self, groups):
            if time.monotonic() < down_until:
                raise OperationalError("UPDATE jobs", {}, Exception("connection refused"))
            return 1

        def reclaim(self, lease):
            reclaims.append(time.monotonic())
            return [], []

    replica = WorkerReplica.__new__(WorkerReplica)
    replica.id, replica.queue, replica.fleet = "host:1", Queue(), SimpleNamespace(lease_s=lease_s)
    replica._stop = threading.Event()
    thread = threading.Thread(target=replica._leases)
    thread.start()
    time.sleep(down_until - time.monotonic() + lease_s + 0.5)
    replica._stop.set()
    thread.join(5)
    assert reclaims and min(reclaims) >= down_until + lease_s - lease_s / 4, (reclaims, down_until)


def test_h3trt_serve_ray_refuses_a_read_only_storage_in_one_line_before_ray(outage, tiny_cache):
    """The CLI path: exit 2, one line naming --storage, within seconds; the Ray address is never dialled (nothing
    listens at port 1, so reaching Ray would be another error, much later)."""
    import subprocess

    from serving import free_port

    refused_port = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/db"
    for store, storage, says in ((outage.url, "/sys", "--storage /sys: cannot write there"),
                                 (refused_port, "/tmp", "check the port")):
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "h3trt.cli", "serve", "--ray", "127.0.0.1:1", "--store", store,
                              "--storage", storage, "--device", "cpu", "--gpus", "2", "--sp", "2"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and says in out.stderr and out.stderr.count("\n") == 1, out.stderr
        assert time.monotonic() - started < 60
