"""Storage (h3trt/server/storage.py): a folder and object storage answer the same calls, and retention removes a job's
files and its record together on either. Object storage is S3 through s3fs against moto's server mode (a local
S3-compatible stand-in: tests/conftest.py `s3`); the records live in SQLite here (the store's own suite covers
PostgreSQL)."""

import json
import time

import pytest

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
    from h3trt.runtime.entry import Entry
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
    service = VideoService(Entry.resolve(device="cpu"), ServeOptions(tmp_path), store, storage, NoGroups(), Metrics())
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
