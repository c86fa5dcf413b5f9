"""Storage (h3trt/server/storage.py): a folder and object storage answer the same calls, and retention removes a job's
files and its record together on either. Object storage is S3 through s3fs against moto's server mode (a local
S3-compatible stand-in: tests/conftest.py `s3`); the records live in SQLite here (the store's own suite covers
PostgreSQL)."""

import hashlib
import json
import time
import types
from pathlib import Path

import pytest

from h3trt.jobs.supervisor import GroupState, GroupStatus
from h3trt.server.storage import Storage, clip_key, job_keys, record_key, thumbnail_key, uploads_key

pytestmark = pytest.mark.unit


@pytest.fixture(params=["folder", "s3"])
def storage(request, tmp_path):
    if request.param == "folder":
        s = Storage(tmp_path / "storage")
    else:
        bucket, _ = request.getfixturevalue("s3")
        s = Storage(f"s3://{bucket}/{tmp_path.name}", scratch=tmp_path / "scratch")
    yield s
    s.close()


def test_written_published_fetched_listed_streamed_removed(storage, tmp_path):
    job = "video_" + "a" * 32
    storage.work_path(clip_key(job)).write_bytes(b"\x00mp4" * 1000)
    storage.work_path(record_key(job)).write_text(json.dumps({"job": job}))
    upload = storage.work_path(f"{uploads_key(job)}/00-input_reference.png")
    upload.write_bytes(b"png")
    storage.publish(uploads_key(job), clip_key(job), record_key(job))
    if storage.local is None:  # published: the scratch copies are gone, the objects are there
        assert not (storage.scratch / clip_key(job)).exists() and storage.path(clip_key(job)).startswith("s3://")
    assert storage.exists(clip_key(job)) and not storage.exists(thumbnail_key(job))
    assert b"".join(storage.chunks(clip_key(job))) == b"\x00mp4" * 1000
    assert json.loads(storage.read_text(record_key(job))) == {"job": job}
    assert storage.names("clips") == [f"{job}.json", f"{job}.mp4"] and storage.names("uploads") == [job]
    assert (storage.fetch(uploads_key(job)) / "00-input_reference.png").read_bytes() == b"png"
    storage.remove(*job_keys(job))
    assert storage.names("clips") == [] and storage.names("uploads") == [] and not storage.exists(clip_key(job))
    storage.remove(*job_keys(job))  # removing what is gone is no error


def test_retention_removes_files_and_record_together(storage, tmp_path):
    from h3trt.jobs.model_source import Entry
    from h3trt.server.metrics import Metrics
    from h3trt.server.options import ServeOptions
    from h3trt.server.service import VideoService
    from h3trt.server.store import JobStore, sqlite_url

    class NoGroups:
        def status(self):
            return []

        def serving(self):
            return 0

    store = JobStore(sqlite_url(tmp_path))
    service = VideoService(Entry.local(device="cpu"), ServeOptions(tmp_path), store, storage, NoGroups(), Metrics())
    now = time.time()
    for job, ended_at in (("video_old", now - 100), ("video_new", now)):
        store.create(job, {"schema": {"prompt": job}})
        store.claim("group0")
        for key in (clip_key(job), thumbnail_key(job), record_key(job)):
            storage.work_path(key).write_text(job)
        storage.publish(clip_key(job), thumbnail_key(job), record_key(job))
        store.end(job, "completed", retention_s=10, now=ended_at, record={}, output=storage.path(clip_key(job)))
    assert service.expire() == ["video_old"]
    assert store.get("video_old") is None and store.get("video_new").status == "completed"
    assert storage.names("clips") == ["video_new.json", "video_new.mp4", "video_new.webp"]
    store.close()


class _Stalls:
    """A worker's store whose next read of `job` first runs `meanwhile` (the process stalls there: its lease runs out
    and another worker runs the job again), then answers what the store held before the stall."""

    def __init__(self, store, job: str, meanwhile):
        self.store, self.job, self.meanwhile = store, job, meanwhile

    def get(self, job_id):
        row = self.store.get(job_id)
        if job_id == self.job and self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()
        return row

    def __getattr__(self, name):
        return getattr(self.store, name)


@pytest.mark.parametrize("stalls", ["before_its_commit", "inside_its_report"])
def test_a_late_writer_whose_lease_ran_out_never_replaces_the_clip_of_the_rerun(storage, tmp_path, stalls):
    """Worker 1 takes a job and stalls past its lease; worker 2 takes the job again and completes it; worker 1 wakes
    up, writes its clip and reports it. Its report is fenced, and the clip served is worker 2's, byte for byte, with
    the record its row holds; worker 1's files are gone. It stalls where each storage was open to a late write: before
    it commits its MP4 (a folder: the commit replaced the re-run's file in place), or between reading its row, which
    still said it held the job, and publishing its files (object storage: the same key)."""
    from fastapi.testclient import TestClient

    from h3trt.engines.atomic import temp_path
    from h3trt.engines.atomic import sha256_file
    from h3trt.jobs.model_source import Entry
    from h3trt.jobs.job import Event
    from h3trt.pipeline.records import ClipRecord, commit_clip
    from h3trt.server.app import create_app
    from h3trt.server.metrics import Metrics
    from h3trt.server.options import ServeOptions
    from h3trt.server.queue import StoreQueue
    from h3trt.server.service import VideoService, request_defaults
    from h3trt.server.store import JobStore, sqlite_url

    if stalls == "inside_its_report" and storage.local is not None:
        pytest.skip("a folder's commit is in place, so the lease's recovery finds it committed and completes the job "
                    "with it: test_a_clip_committed_before_its_lease_ran_out_completes_the_job_and_stays")

    class OneGroup:
        def status(self):
            return [GroupStatus(0, GroupState.SERVING)]

        def serving(self):
            return 1

    entry = Entry.local(device="cpu")
    store = JobStore(sqlite_url(tmp_path))
    # Each worker its own process's view of the storage (object storage: its own scratch folder).
    second_storage = storage if storage.local is not None else Storage(storage.url, scratch=tmp_path / "scratch2")

    def worker(name: str, worker_storage, worker_store=store) -> StoreQueue:
        return StoreQueue(worker_store, worker_storage, 3600, request_defaults(entry), Metrics(),
                          lambda *a, **k: None, name=lambda g: f"{name}/group{g}")

    def write(queue: StoreQueue, job, data: bytes) -> None:
        """What a rank does at the end of a job: its MP4 and record committed under the job's output, then reported."""
        mp4 = temp_path(job.output)
        mp4.write_bytes(data)
        made = ClipRecord(status="done", id=job.id, extra={"made_by": data.decode()})
        record = commit_clip(made, mp4, job.output, overwrite=job.overwrite)
        queue.report(Event(job.id, "done", "done", 100, record=record, group=0, attempt=job.attempt))

    def rerun() -> None:
        """Worker 1's lease runs out (a recovery by a live worker), worker 2 takes the job again and completes it."""
        assert second.reclaim(lease_s=0.0)[0] == [late_job.id]
        [job] = second.take(0, 1)
        assert (job.id, job.attempt) == (late_job.id, 2)
        write(second, job, b"the re-run")
        assert store.get(job.id).status == "completed"

    service = VideoService(entry, ServeOptions(tmp_path), store, storage, OneGroup(), Metrics(),
                           log=lambda *a, **k: None)
    client = TestClient(create_app(service), raise_server_exceptions=False)
    posted = client.post("/v1/videos", json={"prompt": "a fox", "size": "128x32", "steps": 2})
    assert posted.status_code == 200, posted.text
    second = worker("host:2", second_storage)
    stalled_store = _Stalls(store, posted.json()["id"], rerun if stalls == "inside_its_report" else None)
    late = worker("host:1", storage, stalled_store)
    [late_job] = late.take(0, 1)
    assert late_job.attempt == 1
    if stalls == "before_its_commit":
        rerun()
    write(late, late_job, b"the late writer")  # its report reads the row (inside_its_report: and stalls there)

    row = store.get(late_job.id)
    assert (row.status, row.attempts, row.worker, row.record["made_by"]) == ("completed", 2, "host:2/group0",
                                                                             "the re-run")
    served = client.get(f"/v1/videos/{late_job.id}/content")
    assert served.status_code == 200 and served.content == b"the re-run", served.content
    assert row.record["mp4_sha256"] == hashlib.sha256(served.content).hexdigest()
    if storage.local is not None:
        assert sha256_file(storage.local / clip_key(late_job.id, row.clip_attempt)) == row.record["mp4_sha256"]
    # Nothing of the late writer is left in storage: only the accepted claim's clip and record.
    assert storage.names("clips") == [f"{late_job.id}.attempt2.json", f"{late_job.id}.attempt2.mp4"]
    store.close()


def test_a_clip_committed_before_its_lease_ran_out_completes_the_job_and_stays(tmp_path):
    """A worker commits its clip in place and stalls before reporting it; the lease's recovery finds the claim's
    files committed and completes the job with them (not run again). The worker's late report is ignored, and the
    files it would drop as a fenced-out claim's are the accepted clip: they stay."""
    from h3trt.engines.atomic import temp_path
    from h3trt.jobs.job import Event
    from h3trt.pipeline.records import ClipRecord, commit_clip
    from h3trt.request.parse import RequestDefaults
    from h3trt.server.metrics import Metrics
    from h3trt.server.queue import StoreQueue
    from h3trt.server.store import JobStore, sqlite_url

    store, storage = JobStore(sqlite_url(tmp_path)), Storage(tmp_path / "storage")
    queues = [StoreQueue(store, storage, 3600, RequestDefaults(), Metrics(), lambda *a, **k: None,
                         name=lambda g, i=i: f"host:{i}/group{g}") for i in (1, 2)]
    job_id = "video_" + "c" * 32
    store.create(job_id, {"schema": {"prompt": "x"}})
    job = queues[0].job_of(store.claim(queues[0].name(0)))
    mp4 = temp_path(job.output)
    mp4.write_bytes(b"committed, then stalled")
    record = commit_clip(ClipRecord(status="done", id=job_id), mp4, job.output, overwrite=job.overwrite)
    assert queues[1].reclaim(lease_s=0.0) == ([], [])  # completed from its committed files, not queued again
    queues[0].report(Event(job_id, "done", "done", 100, record=record, group=0, attempt=job.attempt))
    row = store.get(job_id)
    assert (row.status, row.clip_attempt, row.record["mp4_sha256"]) == ("completed", 1, record.mp4_sha256)
    assert (storage.local / clip_key(job_id, 1)).read_bytes() == b"committed, then stalled"
    store.close()


def test_a_row_completed_before_per_claim_names_still_serves_its_clip(tmp_path):
    """A store and folder from before each claim wrote files of its own names: the row (migrated, clip_attempt NULL)
    serves clips/<id>.mp4, and its expiry removes it."""
    from alembic import command
    from alembic.config import Config
    from fastapi.testclient import TestClient
    from sqlalchemy import create_engine

    from h3trt.server.app import create_app
    from h3trt.server.metrics import Metrics
    from h3trt.server.options import ServeOptions
    from h3trt.server.service import VideoService
    from h3trt.server.store import JobStore, sqlite_url

    url, job = sqlite_url(tmp_path), "video_" + "b" * 32
    engine = create_engine(url)
    with engine.begin() as connection:  # the schema of revision 0002, and a row as that h3trt completed it
        config = Config()
        config.set_main_option("script_location", _migrations())
        config.attributes["connection"] = connection
        command.upgrade(config, "0002")
        connection.exec_driver_sql(
            "INSERT INTO jobs (id, status, created_at, completed_at, expires_at, progress, stage, evaluations_done, "
            "evaluations_total, attempts, cancel_requested, deleted, request, record, output, worker) VALUES "
            f"('{job}', 'completed', 1.0, 2.0, {time.time() + 3600}, 100, 'done', 2, 2, 1, 0, 0, "
            "'{\"schema\": {\"prompt\": \"x\"}, \"openai\": {}, \"geometry\": [128, 32]}', '{}', 'x', 'group0')")
    engine.dispose()
    storage = Storage(tmp_path / "storage")
    storage.work_path(clip_key(job)).write_bytes(b"an old clip")
    storage.work_path(record_key(job)).write_text("{}")
    store = JobStore(url)
    assert store.get(job).clip_attempt is None
    # what reading jobs needs of the model
    entry = types.SimpleNamespace(model=types.SimpleNamespace(tiny=True, manifest=None, default_steps=4))
    service = VideoService(entry, ServeOptions(tmp_path), store, storage, None, Metrics(), log=lambda *a, **k: None)
    client = TestClient(create_app(service), raise_server_exceptions=False)
    served = client.get(f"/v1/videos/{job}/content")
    assert served.status_code == 200 and served.content == b"an old clip"
    assert service.expire(now=time.time() + 7200) == [job] and storage.names("clips") == []
    store.close()


def _migrations() -> str:
    from h3trt.server import store

    return str(Path(store.__file__).with_name("migrations"))
