"""h3trt's vocabularies are str enums with their facts (h3trt/str_enum.py): a member is its string wherever it leaves
the program, so records, rows, messages and pipes keep their bytes."""

import json
import pickle

import pytest

from h3trt.jobs.job import ENDS, EVENT_KINDS, STAGES, Event, EventKind, Stage

pytestmark = pytest.mark.unit


def test_an_event_takes_its_kind_and_stage_as_members_and_writes_them_as_strings():
    event = Event("clip", "progress", "denoise", 40, evaluations=(2, 5))
    assert event.kind is EventKind.PROGRESS and event.stage is Stage.DENOISE and not event.ends
    assert json.dumps([event.kind, event.stage]) == '["progress", "denoise"]'
    assert f"{event.kind} {event.stage!r}" == "progress 'denoise'"
    assert pickle.loads(pickle.dumps(event)) == event  # what a rank sends up its pipe
    # A failed event's stage says where it failed, also outside the job's stages.
    failed = Event("clip", EventKind.FAILED, "worker", error="worker: gone")
    assert failed.ends and failed.stage == "worker" and type(failed.stage) is str
    with pytest.raises(ValueError, match=r"Event kind 'over' is not one of \('started', 'progress', 'done', "):
        Event("clip", "over")


def test_the_job_vocabularies_keep_their_order_and_facts():
    assert STAGES == ("queued", "text_encode", "condition_encode", "denoise", "decode", "done")
    assert EVENT_KINDS == ("started", "progress", "done", "failed", "cancelled")
    assert ENDS == ("done", "failed", "cancelled") and all(EventKind(k).ends for k in ENDS)


def _rows_as_stored(tmp_path, name: str, status, stage) -> list[tuple]:
    """A job's row after each write through the store with these spellings of a status and a stage, as SQLite holds
    it: each column's type and bytes."""
    import sqlite3

    from h3trt.server.store import JobStore

    path = tmp_path / f"{name}.sqlite"
    store = JobStore(f"sqlite:///{path}")
    snapshots = []

    def snapshot():
        with sqlite3.connect(path) as db:
            columns = [c[1] for c in db.execute("PRAGMA table_info(jobs)")]
            snapshots.append(db.execute("SELECT " + ", ".join(f"typeof({c}), hex({c})" for c in columns)
                                        + " FROM jobs").fetchall())

    store.create("video_1", {"schema": {"prompt": "a fox"}}, now=1.0)
    snapshot()
    store.claim("w", now=2.0)
    store.progress("video_1", 40, stage, (2, 5), "w")
    snapshot()
    store.end("video_1", status, 60.0, now=3.0, record={"stage": stage, "status": status}, output="o.mp4", worker="w")
    snapshot()
    store.close()
    return snapshots


def test_members_write_the_same_bytes_as_strings_to_json_and_to_the_store(tmp_path):
    from h3trt.server.store import JobStatus

    assert json.dumps({"status": JobStatus.COMPLETED, "stage": Stage.DECODE, "kind": EventKind.DONE}) == \
        json.dumps({"status": "completed", "stage": "decode", "kind": "done"})
    members = _rows_as_stored(tmp_path, "members", JobStatus.COMPLETED, Stage.DECODE)
    strings = _rows_as_stored(tmp_path, "strings", "completed", "decode")
    assert members == strings and len(members) == 3


def test_a_status_is_its_string_to_postgres_too():
    """psycopg dumps a plain Enum by its name; a str enum goes as its string (str precedes Enum in its MRO)."""
    pytest.importorskip("psycopg")
    from psycopg.adapt import PyFormat, Transformer

    from h3trt.server.store import JobStatus

    for member in (JobStatus.IN_PROGRESS, Stage.TEXT_ENCODE):
        assert bytes(Transformer().get_dumper(member, PyFormat.TEXT).dump(member)) == member.value.encode()


def test_a_row_reads_its_status_as_a_member_with_its_facts(tmp_path):
    from h3trt.server.store import ENDED, STATUSES, JobStatus, JobStore

    assert STATUSES == ("queued", "in_progress", "completed", "failed", "cancelled")
    assert ENDED == ("completed", "failed", "cancelled") and not JobStatus.QUEUED.ended
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.sqlite'}")
    row = store.create("video_1", {}, now=1.0)
    assert row.status is JobStatus.QUEUED and f"{row.status}" == "queued"
    store.close()


def test_a_model_source_and_a_launch_hold_their_kinds_as_members():
    from pathlib import Path

    from h3trt.jobs.model_source import SOURCES, Launch, ModelSource, SourceKind
    from h3trt.jobs.supervisor import HOW, LaunchKind

    assert SOURCES == ("bundle", "checkpoint", "tiny") and HOW == ("process", "spawn", "torchrun")
    tiny = ModelSource("tiny", None, None)
    assert tiny.kind is SourceKind.TINY and tiny.kind.embedded and not tiny.kind.compiled
    assert tiny.model_name == "embedded-tiny" and Launch("cpu").how is LaunchKind.PROCESS
    two = Launch("cpu", gpus=2)
    checkpoint = ModelSource(SourceKind.CHECKPOINT, Path("ckpt"), None)
    assert two.how is LaunchKind.SPAWN and two.how.spawns
    assert json.dumps([checkpoint.kind, two.how]) == '["checkpoint", "spawn"]'
    with pytest.raises(ValueError, match="a path unless it is tiny"):
        ModelSource(SourceKind.TINY, Path("x"), None)
    with pytest.raises(ValueError, match=r"kind must be one of \('bundle', 'checkpoint', 'tiny'\), got 'x'"):
        ModelSource("x", Path("x"), None)
