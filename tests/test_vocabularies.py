"""h3trt's vocabularies are str enums with their facts (h3trt/str_enum.py): a member is its string wherever it leaves
the program, so records, rows, messages and pipes keep their bytes."""

import json
import pickle

import pytest

from h3trt.runtime.jobs import ENDS, EVENT_KINDS, STAGES, Event, EventKind, Stage

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
