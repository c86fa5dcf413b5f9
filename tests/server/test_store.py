"""The job store (h3trt/server/store.py): one suite, parametrized over the databases a store can live in (SQLite, one
node's default; PostgreSQL, a fleet's: a throwaway server from Debian's packages, tests/postgres.py), run against each
for real. Claims are exclusive, progress never goes back, an end is recorded once, a restart re-queues a running job
once, a lease that runs out re-queues its job and silences its old worker, pages follow creation order, expiry finds
exactly the ended jobs past their time, and the migrated schema is the one the code queries."""

import threading
import time

import pytest

from h3trt.errors import UserError
from h3trt.jobs.supervisor import GroupState, GroupStatus
from h3trt.server.store import MAX_ATTEMPTS, JobStore, metadata, sqlite_url

pytestmark = pytest.mark.unit


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return sqlite_url(tmp_path)
    return request.getfixturevalue("postgres").database()


@pytest.fixture
def store(store_url):
    s = JobStore(store_url)
    yield s
    s.close()


def test_claims_are_exclusive_and_in_creation_order(store):
    for i in range(30):
        store.create(f"video_{i:02d}", {"schema": {"prompt": str(i)}}, now=1000.0 + i)
    taken, lock = [], threading.Lock()

    def worker(name):
        while (row := store.claim(name)) is not None:
            with lock:
                taken.append((row.id, name))

    threads = [threading.Thread(target=worker, args=(f"g{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [job for job, _ in taken]
    assert sorted(ids) == [f"video_{i:02d}" for i in range(30)] and len(set(ids)) == 30  # each exactly once
    assert store.counts() == {"queued": 0, "in_progress": 30, "completed": 0, "failed": 0, "cancelled": 0}


def test_batch_claims_are_exclusive_and_take_the_oldest_jobs_key(store):
    """claim_batch: the oldest queued job with up to limit - 1 later ones of its batch key, in one transaction; four
    workers racing take every job exactly once, each claim's jobs of one key and in creation order; a job without a
    key (NULL) is claimed alone."""
    keys = {f"video_{i:02d}": (None if i % 7 == 0 else "k" * 63 + str(i % 3)) for i in range(42)}
    for i, (job, key) in enumerate(keys.items()):
        store.create(job, {"schema": {"prompt": job}}, now=1000.0 + i, batch_key=key)
    claims, lock = [], threading.Lock()

    def worker(name):
        while rows := store.claim_batch(name, 4):
            with lock:
                claims.append(rows)

    threads = [threading.Thread(target=worker, args=(f"g{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [row.id for rows in claims for row in rows]
    assert sorted(ids) == sorted(keys) and len(set(ids)) == len(keys)  # each exactly once
    for rows in claims:
        assert len(rows) <= 4 and len({row.batch_key for row in rows}) == 1 and len({row.worker for row in rows}) == 1
        assert [row.seq for row in rows] == sorted(row.seq for row in rows) and {row.attempts for row in rows} == {1}
        assert rows[0].batch_key is not None or len(rows) == 1
    assert any(len(rows) > 1 for rows in claims)
    store.create("video_x", {"schema": {"prompt": "x"}}, batch_key="a" * 64)
    store.create("video_y", {"schema": {"prompt": "y"}}, batch_key="b" * 64)
    store.create("video_z", {"schema": {"prompt": "z"}}, batch_key="a" * 64)
    assert [row.id for row in store.claim_batch("g0", 4)] == ["video_x", "video_z"]
    assert [row.id for row in store.claim_batch("g0", 4)] == ["video_y"] and store.claim_batch("g0", 4) == []
    row = store.get("video_00")
    assert row.status == "in_progress" and row.attempts == 1 and row.worker.startswith("g") and row.started_at


def test_progress_is_monotonic_and_an_end_is_recorded_once(store):
    store.create("video_a", {"schema": {"prompt": "x"}})
    store.claim("g0")
    store.progress("video_a", 40, "denoise", (2, 5))
    store.progress("video_a", 20, "denoise", (1, 5))  # a late, older report changes nothing
    store.progress("video_a", 96, "decode", (0, 0))  # decode progress keeps the evaluations
    row = store.get("video_a")
    assert (row.progress, row.stage, row.evaluations_done, row.evaluations_total) == (96, "decode", 2, 5)
    done = store.end("video_a", "completed", retention_s=60, now=2000.0, record={"seed": 1}, output="/x.mp4")
    assert done.status == "completed" and done.progress == 100 and done.expires_at == 2060.0 and done.record == {
        "seed": 1}
    assert store.end("video_a", "failed", retention_s=60, error=("x", "y")) is None  # already ended
    assert store.get("video_a").status == "completed"
    with pytest.raises(ValueError, match="end status"):
        store.end("video_a", "queued", 60)


def test_recover_requeues_a_running_job_once_then_fails_it(store):
    store.create("video_a", {"schema": {"prompt": "x"}})
    for attempt in range(1, MAX_ATTEMPTS + 1):
        assert store.claim("g0").attempts == attempt
        requeued, failed = store.recover(retention_s=60)
        if attempt < MAX_ATTEMPTS:
            assert requeued == ["video_a"] and store.get("video_a").status == "queued"
    assert failed == ["video_a"]
    row = store.get("video_a")
    assert row.status == "failed" and row.error_code == "worker_lost" and f"{MAX_ATTEMPTS} times" in row.error_message


def test_cancel_and_delete_flags(store):
    store.create("video_q", {"schema": {"prompt": "x"}})
    store.create("video_r", {"schema": {"prompt": "y"}})
    store.claim("g0")  # video_q running
    store.request_cancel("video_q", delete_after=True)
    assert store.cancels() == ["video_q"] and store.get("video_q").deleted
    assert [r.id for r in store.page(None, 10, "asc")[0]] == ["video_r"]  # a deleted job is not listed
    requeued, _ = store.recover(retention_s=60)
    assert requeued == [] and store.get("video_q").status == "cancelled"  # a cancelled job is not run again


def test_a_lease_that_runs_out_requeues_its_job_once_and_silences_its_old_worker(store):
    store.create("video_a", {"schema": {"prompt": "x"}})
    store.create("video_b", {"schema": {"prompt": "y"}})
    assert store.claim("host:1/group0", now=1000.0).id == "video_a"
    assert store.claim("host:2/group0", now=1000.0).id == "video_b"
    assert store.heartbeat(["host:1/group0"], now=1050.0) == 1  # worker 1 lives; worker 2 went silent at 1000
    requeued, failed = store.recover(retention_s=60, now=1061.0, stale_before=1061.0 - 30)
    assert requeued == ["video_b"] and failed == [] and store.get("video_a").status == "in_progress"
    assert store.claim("host:1/group1", now=1062.0).id == "video_b"  # another worker takes it: attempt 2
    store.progress("video_b", 50, "denoise", (1, 2), worker="host:2/group0")  # the old worker wakes up: ignored
    assert store.end("video_b", "completed", 60, record={}, output="x", worker="host:2/group0") is None
    row = store.get("video_b")
    assert (row.status, row.progress, row.attempts, row.worker) == ("in_progress", 0, 2, "host:1/group1")
    store.progress("video_b", 50, "denoise", (1, 2), worker="host:1/group1")
    assert store.end("video_b", "completed", 60, record={}, output="x", worker="host:1/group1").progress == 100
    # Worker 1 goes silent too: its job runs once more, and a second silence fails it (worker_lost), once, whoever
    # notices first.
    assert store.recover(retention_s=60, now=2000.0, stale_before=1999.0) == (["video_a"], [])
    assert store.claim("host:3/group0", now=2001.0).attempts == MAX_ATTEMPTS
    assert store.recover(retention_s=60, now=3000.0, stale_before=2999.0) == ([], ["video_a"])
    assert store.recover(retention_s=60, now=3000.0, stale_before=2999.0) == ([], [])
    assert store.get("video_a").error_code == "worker_lost"


def test_a_report_of_an_earlier_claim_is_fenced_even_from_the_same_worker(store):
    """The lease's fence is the claim (worker and attempt), not the worker's name alone: a worker whose lease ran out
    before it recorded a job's end, and which then took the same job again (requeued, it is the oldest in the queue),
    must not complete the new claim with the old claim's report."""
    store.create("video_a", {"schema": {"prompt": "x"}})
    assert store.claim("host:1/group0", now=1000.0).attempts == 1
    assert store.recover(retention_s=60, now=1100.0, stale_before=1070.0) == (["video_a"], [])  # its lease ran out
    assert store.claim("host:1/group0", now=1101.0).attempts == 2  # the same worker takes it again
    store.progress("video_a", 90, "decode", (0, 0), worker="host:1/group0", attempt=1)
    assert store.end("video_a", "completed", 60, record={"attempt": 1}, output="x", worker="host:1/group0",
                     attempt=1) is None
    assert store.requeue("video_a", worker="host:1/group0", attempt=1) is False
    row = store.get("video_a")
    assert (row.status, row.progress, row.attempts, row.record) == ("in_progress", 0, 2, None)
    ended = store.end("video_a", "completed", 60, record={"attempt": 2}, output="x", worker="host:1/group0", attempt=2)
    assert (ended.status, ended.record) == ("completed", {"attempt": 2})


def test_a_workers_late_end_of_an_earlier_claim_does_not_complete_its_new_claim(store, tmp_path):
    """The same through a worker's queue (server/queue.py), in the order jobs/supervisor.py reports: a group's job
    ends, the group takes its next work, then the end is recorded. If its lease ran out in between (the process
    stalled) and the next work is the same job again, the old end is the earlier claim's: ignored, and the job
    completes with the new claim's clip."""
    from h3trt.jobs.job import Event
    from h3trt.pipeline.records import ClipRecord
    from h3trt.request.parse import RequestDefaults
    from h3trt.server.metrics import Metrics
    from h3trt.server.queue import StoreQueue
    from h3trt.server.storage import Storage

    queue = StoreQueue(store, Storage(tmp_path / "storage"), 60, RequestDefaults(), Metrics(), lambda *a, **k: None,
                       name=lambda g: f"host:1/group{g}")
    store.create("video_a", {"schema": {"prompt": "x"}})
    first = queue.job_of(store.claim(queue.name(0)))
    assert first.attempt == 1
    assert store.recover(retention_s=60, stale_before=time.time() + 1) == (["video_a"], [])
    second = queue.job_of(store.claim(queue.name(0)))
    assert second.attempt == 2
    queue.report(Event("video_a", "done", "done", 100, record=ClipRecord(extra={"attempt": 1}), group=0,
                       attempt=first.attempt))
    assert (store.get("video_a").status, store.get("video_a").record) == ("in_progress", None)
    queue.lost(0, [first], "killed", died=True)  # nor is the earlier claim's loss the new claim's
    assert store.get("video_a").status == "in_progress"
    queue.report(Event("video_a", "done", "done", 100, record=ClipRecord(extra={"attempt": 2}), group=0,
                       attempt=second.attempt))
    assert (store.get("video_a").status, store.get("video_a").record) == ("completed", {"attempt": 2})


def test_admission_bounds_the_queue_by_the_waiting_jobs_alone_and_reads_no_other_rows(store, tmp_path):
    """--max-queue counts the queued jobs, not the running or ended ones (a fleet's table holds every job of the
    retention), and admitting a job reads only rows it finds through an index (the queued ones, its own): never
    every row of the table, so a POST costs the same with 10 ended jobs as with 100,000."""
    from sqlalchemy import event as sql_event

    from h3trt.jobs.model_source import Entry
    from h3trt.server.metrics import Metrics
    from h3trt.server.options import ServeOptions
    from h3trt.server.service import ApiError, VideoService
    from h3trt.server.storage import Storage

    class OneGroup:
        def status(self):
            return [GroupStatus(0, GroupState.SERVING)]

        def serving(self):
            return 1

    for i in range(6):  # ended and running jobs: none of them waits
        store.create(f"video_old{i}", {"schema": {"prompt": "x"}})
        store.claim("g0")
        if i < 4:
            store.end(f"video_old{i}", "completed", 60, record={}, output="x", worker="g0")
    assert store.queued() == 0 and store.counts()["completed"] == 4
    service = VideoService(Entry.local(device="cpu"), ServeOptions(tmp_path, max_queue=2), store,
                           Storage(tmp_path / "storage"), OneGroup(), Metrics(), log=lambda *a, **k: None)
    request = {"prompt": "a fox", "size": "128x32", "steps": 2}
    statements = []
    listener = lambda conn, cursor, statement, *rest: statements.append(" ".join(statement.split()))  # noqa: E731
    sql_event.listen(store.engine, "before_cursor_execute", listener)
    try:
        first = service.create(dict(request), [], False)
    finally:
        sql_event.remove(store.engine, "before_cursor_execute", listener)
    assert first.status == "queued" and store.queued() == 1
    reads = [s for s in statements if s.upper().startswith("SELECT") and " FROM jobs" in s]
    assert reads and all(" WHERE jobs.status = " in s or " WHERE jobs.id = " in s for s in reads), statements
    assert not any("GROUP BY" in s for s in statements), statements
    service.create(dict(request), [], False)
    with pytest.raises(ApiError) as full:
        service.create(dict(request), [], False)
    assert full.value.status == 429 and "2 jobs waiting, --max-queue 2" in str(full.value)
    store.claim("g1")  # one leaves the queue: there is room again
    assert service.create(dict(request), [], False).status == "queued" and store.queued() == 2


def test_pages_follow_creation_order_with_a_cursor(store):
    for i in range(7):
        store.create(f"video_{i}", {"schema": {"prompt": str(i)}})
    first, more = store.page(None, 3, "desc")
    assert [r.id for r in first] == ["video_6", "video_5", "video_4"] and more
    second, more = store.page(first[-1].id, 3, "desc")
    assert [r.id for r in second] == ["video_3", "video_2", "video_1"] and more
    last, more = store.page(second[-1].id, 3, "desc")
    assert [r.id for r in last] == ["video_0"] and not more
    assert [r.id for r in store.page("video_4", 10, "asc")[0]] == ["video_5", "video_6"]
    with pytest.raises(KeyError):
        store.page("video_nope", 3, "asc")


def test_expiry_finds_exactly_the_ended_jobs_past_their_time(store):
    now = time.time()
    for name in ("old", "new", "queued"):
        store.create(f"video_{name}", {"schema": {"prompt": name}})
    store.claim("g0")
    store.end("video_old", "completed", retention_s=10, now=now - 100, record={}, output="x")
    store.claim("g0")
    store.end("video_new", "failed", retention_s=10, now=now, error=("e", "m"))
    assert [r.id for r in store.rows(expired_before=now)] == ["video_old"]
    assert [r.id for r in store.rows(expired_before=now + 11)] == ["video_old", "video_new"]  # never a queued job


def test_the_migrated_schema_is_the_one_the_code_queries(store):
    """Alembic's comparison of the database its migrations made with the store's table: no difference."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    with store.engine.connect() as c:
        diff = compare_metadata(MigrationContext.configure(c), metadata)
    assert diff == []


def test_a_store_from_a_newer_h3trt_is_refused(store_url):
    store = JobStore(store_url)
    with store.engine.begin() as c:
        c.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    store.close()
    with pytest.raises(UserError, match="schema revision 9999, which this h3trt does not know"):
        JobStore(store_url)
