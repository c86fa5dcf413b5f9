"""The worker side of the job store (server/queue.py `StoreQueue`), in this process over SQLite in a temporary folder:
what each call does to a job's row and files. take claims; report turns a claim's events into its row (progress, the
end, the clip published before the row says completed); the lease fences a claim that lost its job; cancels and lost
groups end jobs as the API and the supervisor ask."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import Logged

from h3trt.jobs.job import Event
from h3trt.pipeline.records import ClipRecord, Failure
from h3trt.request.parse import RequestDefaults
from h3trt.server.metrics import Metrics
from h3trt.server.queue import StoreQueue
from h3trt.server.storage import Storage, claim_keys, clip_key, record_key, uploads_key
from h3trt.server.store import MAX_ATTEMPTS, JobStore, sqlite_url

pytestmark = pytest.mark.unit


@pytest.fixture
def queue(tmp_path):
    for folder in ("clips", "uploads"):
        (tmp_path / folder).mkdir()
    store = JobStore(sqlite_url(tmp_path))
    q = StoreQueue(store, Storage(tmp_path), 60.0, RequestDefaults(steps=2), Metrics(), Logged(),
                   name=lambda g: f"host:1/group{g}")
    yield q
    store.close()


def queued(queue: StoreQueue, *names: str) -> list[str]:
    ids = []
    for name in names:
        job = f"video_{name:0>32}"
        queue.store.create(job, {"schema": {"prompt": f"clip {name}", "seed": 3}, "openai": {}, "geometry": [64, 32]})
        (queue.storage.local / uploads_key(job)).mkdir()
        ids.append(job)
    return ids


def committed(queue: StoreQueue, job) -> ClipRecord:
    """What a rank leaves for a claim: its MP4 and record under the claim's names."""
    queue.storage.work_path(clip_key(job.id, job.attempt)).write_bytes(b"mp4")
    queue.storage.work_path(record_key(job.id, job.attempt)).write_text("{}")
    return ClipRecord(status="done", id=job.id)


def test_take_claims_the_oldest_queued_job_once_under_the_groups_name(queue):
    assert queue.take(0, 1) == []  # none waiting now (a server's queue never says None)
    first, second = queued(queue, "a", "b")
    [job] = queue.take(1, 4)
    assert (job.id, job.attempt, job.request.inputs.prompt, job.request.inputs.seed, job.request.schedule.steps) == (first, 1, "clip a", 3, 2)
    assert job.output == queue.storage.work_path(clip_key(first, 1)) and job.overwrite
    row = queue.store.get(first)
    assert (row.status, row.worker, row.attempts) == ("in_progress", "host:1/group1", 1)
    assert [j.id for j in queue.take(0, 1)] == [second] and queue.take(0, 1) == []


def test_a_claims_progress_and_its_done_become_the_row_and_its_clip_is_published_first(queue):
    [job_id] = queued(queue, "a")
    [job] = queue.take(0, 1)
    queue.report(Event(job_id, "progress", "denoise", 40, evaluations=(2, 5), attempt=job.attempt))
    row = queue.store.get(job_id)
    assert (row.progress, row.stage, row.evaluations_done, row.evaluations_total) == (40, "denoise", 2, 5)
    queue.report(Event(job_id, "done", "done", 100, record=committed(queue, job), attempt=job.attempt))
    row = queue.store.get(job_id)
    assert (row.status, row.clip_attempt, row.record["id"], row.progress) == ("completed", 1, job_id, 100)
    assert row.output == queue.storage.path(clip_key(job_id, 1)) and row.expires_at > time.time() + 50
    assert not (queue.storage.local / uploads_key(job_id)).exists()  # its inputs go once it has its clip
    assert [f["job"] for f in queue.log.events("completed")] == [job_id]


def test_a_failed_claim_fails_its_job_with_the_code_of_its_error_and_leaves_no_files(queue):
    [job_id] = queued(queue, "a")
    [job] = queue.take(0, 1)
    committed(queue, job)
    queue.report(Event(job_id, "failed", "denoise", error="denoise: OutOfMemoryError: CUDA out of memory",
                       record=Failure("OutOfMemoryError"), attempt=job.attempt))
    row = queue.store.get(job_id)
    assert (row.status, row.error_code, row.error_message) == ("failed", "out_of_memory",
                                                               "denoise: OutOfMemoryError: CUDA out of memory")
    assert list((queue.storage.local / "clips").iterdir()) == []


def test_a_cancel_asked_for_reaches_the_worker_and_its_end_cancels_the_job(queue):
    first, second = queued(queue, "a", "b")
    [a] = queue.take(0, 1)
    [b] = queue.take(1, 1)
    assert queue.cancels() == []
    queue.store.request_cancel(first)
    queue.store.request_cancel(second)
    assert sorted(queue.cancels()) == [first, second]
    queue.report(Event(first, "cancelled", error="cancelled at step 2", attempt=a.attempt))
    # a job that finished anyway after its cancel was asked for: cancelled, its clip gone
    queue.report(Event(second, "done", record=committed(queue, b), attempt=b.attempt, group=1))
    assert [(queue.store.get(j).status, queue.store.get(j).error_code) for j in (first, second)] == [
        ("cancelled", "cancelled"), ("cancelled", "cancelled")]
    assert list((queue.storage.local / "clips").iterdir()) == [] and queue.cancels() == []


def test_a_claim_whose_lease_ran_out_is_fenced_and_the_job_runs_again_under_a_new_claim(queue):
    [job_id] = queued(queue, "a")
    [stalled] = queue.take(0, 1)
    assert queue.heartbeat(1) == 1 and queue.reclaim(60.0) == ([], [])  # a renewed lease holds
    time.sleep(0.01)
    assert queue.reclaim(0.0) == ([job_id], [])  # the lease ran out: queued again
    [rerun] = queue.take(0, 1)
    assert (rerun.id, rerun.attempt) == (job_id, 2)
    late = committed(queue, stalled)  # the stalled claim wakes up, writes its own files and reports them
    queue.report(Event(job_id, "done", record=late, attempt=stalled.attempt))
    row = queue.store.get(job_id)
    assert (row.status, row.attempts) == ("in_progress", 2)
    assert [f["attempt"] for f in queue.log.events("late_report_ignored")] == [1]
    assert not queue.storage.work_path(clip_key(job_id, 1)).exists()  # only that claim's files went
    queue.report(Event(job_id, "done", record=committed(queue, rerun), attempt=rerun.attempt))
    assert (queue.store.get(job_id).status, queue.store.get(job_id).clip_attempt) == ("completed", 2)


def test_a_claim_killed_mid_commit_leaves_nothing_once_its_job_runs_again(queue):
    """A worker SIGKILLed between its record's rename and its MP4's (scripts/sim_fleet.py met it under load): the
    record sits under its final name, the MP4 under a dead process's temporary name. The lease's reclaim sweeps the
    dead process's file, and the re-run's completion the lost claim's record: storage holds the row's clip only."""
    import subprocess
    import sys

    [job_id] = queued(queue, "a")
    [killed] = queue.take(0, 1)
    mp4 = queue.storage.work_path(clip_key(job_id, killed.attempt))
    queue.storage.work_path(record_key(job_id, killed.attempt)).write_text("{}")
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                    "from h3trt.engines.atomic import temp_path; temp_path(Path(sys.argv[1])).write_bytes(b'mp4')",
                    str(mp4)], check=True)  # a temporary MP4 whose process is gone
    time.sleep(0.01)
    assert queue.reclaim(0.0) == ([job_id], [])
    [rerun] = queue.take(0, 1)
    queue.report(Event(job_id, "done", record=committed(queue, rerun), attempt=rerun.attempt))
    row = queue.store.get(job_id)
    assert (row.status, row.clip_attempt) == ("completed", 2)
    assert sorted(p.name for p in (queue.storage.local / "clips").iterdir()) == sorted(
        Path(k).name for k in claim_keys(job_id, 2) if queue.storage.exists(k))
    assert {Path(clip_key(job_id, 2)).name, Path(record_key(job_id, 2)).name} <= {
        p.name for p in (queue.storage.local / "clips").iterdir()}


def test_a_groups_lost_jobs_run_again_once_if_it_died_and_fail_if_it_raised(queue):
    killed, raised = queued(queue, "a", "b")
    jobs = queue.take(0, 1) + queue.take(1, 1)
    queue.lost(0, [jobs[0]], "it died (signal 9)", died=True)
    queue.lost(1, [jobs[1]], "OutOfMemoryError: CUDA out of memory", died=False)
    assert queue.store.get(killed).status == "queued" and queue.log.events("requeued")[0]["job"] == killed
    assert (queue.store.get(raised).status, queue.store.get(raised).error_code) == ("failed", "out_of_memory")
    for attempt in range(2, MAX_ATTEMPTS + 1):  # killed again each time: the last claim fails it
        [job] = queue.take(0, 1)
        assert job.attempt == attempt
        queue.lost(0, [job], "it died (signal 9)", died=True)
    row = queue.store.get(killed)
    assert (row.status, row.error_code) == ("failed", "worker_lost")


def test_a_one_node_start_sweeps_the_folders_a_killed_server_left(queue, tmp_path, monkeypatch):
    """`kill -9` of a one-node `h3trt serve` left its ranks' rendezvous folder in $TMPDIR: the next start (recover,
    before its workers start) removes it, as a fleet replica's start does; a live process's folder stays."""
    import subprocess
    import sys
    import tempfile

    from h3trt.parallel.leftovers import HOST, owned_temp_dir

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = tmp / f"h3trt-launch-{HOST}-{child.pid}-k9l0"
    (dead / "store").mkdir(parents=True)
    live = owned_temp_dir("h3trt-launch-")
    queue.recover()
    assert not dead.exists() and live.exists()
    assert queue.log.events("swept") == [{"partial_files": 0, "scratch_folders": 0, "launch_folders": 1}]


def test_a_worker_runs_the_admitted_request_its_row_stores(queue, tmp_path):
    """A row stores the request as admission resolved it (server/service.py row_request): the worker reads it back, nothing parsed
    again (its fields as sent say other steps and its defaults others: neither is read), its upload found in the
    worker's own folder."""
    from h3trt.adapters.use import AdapterUse
    from h3trt.models.packing import Geometry
    from h3trt.request.request import ScheduleFrom
    from h3trt.request.request import Admitted, Request
    from h3trt.server.service import row_request, shown

    job = f"video_{'c':0>32}"
    scratch = tmp_path / "scratch" / "upload"
    use = AdapterUse("style", 0.5, "/loras/a.safetensors", "ab" * 32)
    request = Request.of("a fox", image=scratch / "first.png", seed=5, steps=7, video_shift=5.0, lora=(use,),
                         schedule_from=ScheduleFrom("request", "adapter style", "default"))
    row = row_request(Admitted(request, Geometry(32, 64, 124)), {"prompt": "a fox", "steps": 9}, {}, scratch)
    assert row["admitted"]["request"]["inputs"]["image"] == "first.png"  # relative: the worker's folder is another
    queue.store.create(job, row)
    (queue.storage.local / uploads_key(job)).mkdir()
    [taken] = queue.take(0, 1)
    assert taken.request == Request.of("a fox", image=queue.storage.fetch(uploads_key(job)) / "first.png", seed=5,
                                       steps=7, video_shift=5.0, lora=(use,),
                                       schedule_from=ScheduleFrom("request", "adapter style", "default"))
    assert shown(queue.store.get(job).request, 50) == (64, 32, 7, [use])


def test_a_server_restarted_on_an_old_jobs_database_runs_its_rows(tmp_path):
    """A row written before the admitted request was stored (its fields as sent, the adapters and the schedule
    admission resolved, the canvas's size) is read as then, by a queue over the database reopened: its fields parsed
    with the model's defaults, the stored adapters and schedule put back over them."""
    from h3trt.adapters.use import AdapterUse
    from h3trt.server.service import shown

    for folder in ("clips", "uploads"):
        (tmp_path / folder).mkdir()
    job = f"video_{'d':0>32}"
    use = {"name": "fast", "scale": 1.0, "file": "/loras/fast.safetensors", "sha256": "cd" * 32}
    old = {"schema": {"prompt": "a fox", "seed": 4, "lora": [{"name": "fast"}]}, "openai": {}, "adapters": [use],
           "schedule": {"steps": 4, "video_shift": 5.0, "audio_shift": None,
                        "from": {"steps": "adapter fast", "video_shift": "adapter fast", "audio_shift": "default"}},
           "geometry": [64, 32]}
    before = JobStore(sqlite_url(tmp_path))
    before.create(job, old)
    before.close()
    (tmp_path / uploads_key(job)).mkdir(parents=True)
    store = JobStore(sqlite_url(tmp_path))  # the restart: another process, the same database
    try:
        queue = StoreQueue(store, Storage(tmp_path), 60.0, RequestDefaults(steps=2), Metrics(), Logged(),
                           name=lambda g: f"host:2/group{g}")
        [taken] = queue.take(0, 1)
        r = taken.request
        assert (r.inputs.prompt, r.inputs.seed, r.adapters) == ("a fox", 4, (AdapterUse.from_json(use),))
        assert (r.schedule.steps, r.schedule.video_shift, r.schedule.origin.to_json()) == (4, 5.0, old["schedule"]["from"])
        assert shown(store.get(job).request, 50) == (64, 32, 4, [AdapterUse.from_json(use)])
    finally:
        store.close()


def admitted_rows(queue: StoreQueue, *admitted) -> list[str]:
    """Jobs queued as the API side stores them (service.create): the admitted request and its batch key's digest."""
    from h3trt.server.service import row_request

    ids = []
    for a in admitted:
        job = f"video_{'k' + str(len(queue.store.rows())):0>32}"
        key = a.batch_key
        folder = queue.storage.local / uploads_key(job)
        folder.mkdir()
        queue.store.create(job, row_request(a, {"prompt": a.request.inputs.prompt}, {}, folder),
                           batch_key=key.digest() if key is not None else None)
        ids.append(job)
    return ids


def small(prompt: str = "a fox", width: int = 64, **fields):
    from h3trt.models.packing import Geometry
    from h3trt.request.request import Admitted, Request

    return Admitted(Request.of(prompt, steps=2, width=width, height=32, **fields), Geometry(32, width, 22))


def test_a_claim_takes_the_oldest_job_with_the_queued_jobs_of_its_batch_key_and_others_alone(queue):
    """take(group, limit): the oldest queued job and, in the same claim, later queued jobs whose stored batch key is
    its own (up to `limit`, oldest first); a job of another key, one that shares no evaluation (guided: key None)
    and a row written before keys were stored (NULL) each run alone."""
    a, wide, c, guided, e = admitted_rows(queue, small("a"), small("b", width=128), small("c", seed=9),
                                          small("d", guidance=3.0, negative_prompt="blur"), small("e"))
    [old] = queued(queue, "f")
    assert small("a").batch_key == small("c", seed=9).batch_key != small("b", width=128).batch_key
    assert small("d", guidance=3.0, negative_prompt="blur").batch_key is None
    first = queue.take(0, 2)
    assert [j.id for j in first] == [a, c] and [j.attempt for j in first] == [1, 1]
    assert first[0].key == first[1].key == small("a").batch_key
    assert {queue.store.get(j).worker for j in (a, c)} == {"host:1/group0"}
    assert [j.id for j in queue.take(1, 4)] == [wide]
    assert [(j.id, j.key) for j in queue.take(0, 4)] == [(guided, None)]  # e waits behind it, of another key
    assert [j.id for j in queue.take(0, 4)] == [e]
    assert [(j.id, j.key) for j in queue.take(0, 4)] == [(old, None)]
    assert queue.take(0, 4) == []
    assert [queue.store.get(j).attempts for j in (a, wide, c, guided, e, old)] == [1] * 6


def test_racing_claims_take_every_job_once_in_batches_of_one_key(tmp_path):
    """Two workers (each its own store over the one database, as two processes) claim at once from threads: every job
    is claimed exactly once, and every claim's jobs share one batch key."""
    import threading

    for folder in ("clips", "uploads"):
        (tmp_path / folder).mkdir()
    queues = [StoreQueue(JobStore(sqlite_url(tmp_path)), Storage(tmp_path), 60.0, RequestDefaults(steps=2), Metrics(),
                         Logged(), name=lambda g, w=w: f"host:{w}/group{g}") for w in range(2)]
    shapes = [small(str(i), width=64 * (1 + i % 3)) for i in range(36)]
    ids = admitted_rows(queues[0], *shapes)
    width = {job: s.geometry.width for job, s in zip(ids, shapes)}
    claims: list[list] = [[], []]

    def worker(w: int) -> None:
        while work := queues[w].take(0, 4):
            claims[w].append(work)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        taken = [job.id for claim in claims[0] + claims[1] for job in claim]
        assert sorted(taken) == sorted(ids)  # none lost, none twice
        assert all(len({width[j.id] for j in claim}) == 1 and len(claim) <= 4 for claim in claims[0] + claims[1])
        assert {queues[0].store.get(j).attempts for j in ids} == {1}
    finally:
        for q in queues:
            q.store.close()


def test_a_restart_queues_a_claimed_batch_again_and_it_is_claimed_together_once(tmp_path):
    """A server killed while a group ran a batch: the next start (recover) queues its jobs again, each once; they are
    claimed together again, under their second claim, and nothing is claimed twice."""
    for folder in ("clips", "uploads"):
        (tmp_path / folder).mkdir()

    def node(n: int) -> StoreQueue:
        return StoreQueue(JobStore(sqlite_url(tmp_path)), Storage(tmp_path), 60.0, RequestDefaults(steps=2),
                          Metrics(), Logged(), name=lambda g: f"host:{n}/group{g}")

    before = node(1)
    a, b, wide = admitted_rows(before, small("a"), small("b"), small("c", width=128))
    assert [j.id for j in before.take(0, 4)] == [a, b]
    before.store.close()  # killed: the rows say in_progress
    after = node(2)
    try:
        after.recover()
        assert sorted(after.log.events("recovered")[0]["requeued"]) == sorted([a, b])
        again = after.take(0, 4)
        assert [(j.id, j.attempt) for j in again] == [(a, 2), (b, 2)]
        assert [(j.id, j.attempt) for j in after.take(0, 4)] == [(wide, 1)] and after.take(0, 4) == []
    finally:
        after.store.close()


def test_queued_rows_of_a_database_from_before_batch_keys_are_migrated_and_each_run_alone(tmp_path):
    """A jobs database at schema revision 0003 (before the batch key's column) with two queued rows of the same
    request: opening it migrates it (the column added, NULL in those rows), and a claim of up to 4 takes each alone."""
    import json

    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    from h3trt.server import store as store_module
    from h3trt.server.service import row_request

    for folder in ("clips", "uploads"):
        (tmp_path / folder).mkdir()
    url, ids = sqlite_url(tmp_path), [f"video_{'o' + str(i):0>32}" for i in range(2)]
    engine = create_engine(url)
    with engine.begin() as connection:
        config = Config()
        config.set_main_option("script_location", str(Path(store_module.__file__).with_name("migrations")))
        config.attributes["connection"] = connection
        command.upgrade(config, "0003")
        for i, job in enumerate(ids):
            (tmp_path / uploads_key(job)).mkdir()
            request = json.dumps(row_request(small("a"), {"prompt": "a"}, {}, tmp_path / uploads_key(job)))
            connection.exec_driver_sql(
                "INSERT INTO jobs (id, status, created_at, progress, stage, evaluations_done, evaluations_total, "
                "attempts, cancel_requested, deleted, request) VALUES (?, 'queued', ?, 0, 'queued', 0, 0, 0, 0, 0, ?)",
                (job, 1.0 + i, request))
    engine.dispose()
    store = JobStore(url)
    try:
        queue = StoreQueue(store, Storage(tmp_path), 60.0, RequestDefaults(steps=2), Metrics(), Logged())
        assert [store.get(job).batch_key for job in ids] == [None, None]
        assert [[j.id for j in queue.take(0, 4)] for _ in ids] == [[ids[0]], [ids[1]]]
    finally:
        store.close()
