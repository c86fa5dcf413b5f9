"""The pipeline returns a clip and commits nothing; the job layer commits it (issue 37 step 6).

`H3Pipeline.generate` leaves the finished MP4 under its temporary name and returns it with its record (`Clip`);
`work.commit_job_clip` completes the record and puts the pair in place together, or neither. On the tiny model (CPU):
the cheapest clip H3 allows, one DiT evaluation.
"""

import dataclasses
import json
import os

import pytest

from h3trt.engines.atomic import sha256_file
from h3trt.models.tiny import TINY_HEIGHT, TINY_REFERENCE_SHORT_EDGE, TINY_WIDTH
from h3trt.jobs import work
from h3trt.jobs.job import EventKind, Job
from h3trt.pipeline.h3_pipeline import H3Pipeline, Target
from h3trt.pipeline.records import Clip, ClipRecord, record_path
from h3trt.request.request import CanvasDefaults, Request
from h3trt.pipeline.prepare import prepare
from h3trt.jobs.work import Place, Reporter, commit_job_clip, run_work

TINY_CANVAS = CanvasDefaults(short_edge=TINY_HEIGHT, max_pixels=TINY_WIDTH * TINY_HEIGHT,
                             reference_short_edge=TINY_REFERENCE_SHORT_EDGE)
REQUEST = Request.of("a red fox runs", seed=1, steps=2, width=128, height=32)


@pytest.fixture(scope="module")
def pipeline(tiny_root):
    return H3Pipeline.load(tiny_root, "t2va", "cpu", TINY_CANVAS)


def test_generate_returns_a_clip_and_leaves_nothing_at_the_output_path(pipeline, tmp_path):
    output = tmp_path / "clip.mp4"
    clip = pipeline.generate(prepare(REQUEST, TINY_CANVAS), Target(output))
    assert isinstance(clip, Clip) and isinstance(clip.record, ClipRecord)
    with pytest.raises(dataclasses.FrozenInstanceError):
        clip.record = None
    # Only the MP4 under its temporary name (hidden, not .mp4: nothing that looks done), no record.
    assert os.listdir(tmp_path) == [clip.mp4_temp.name] and clip.mp4_temp.parent == tmp_path
    assert clip.mp4_temp.name.startswith(".clip.mp4.") and clip.mp4_temp.name.endswith(".partial")
    record = clip.record
    assert record.output == str(output) and record.frames > 0 and record.wall_s > 0
    assert record.mp4_sha256 is None and record.status is None  # the commit's and the job layer's fields

    job = Job("j", REQUEST, output, record={"line": 3})
    done = commit_job_clip(clip, job, Place(model="tiny", record_extra={"mesh": {}}), pipeline.device,
                           {"size": 1, "index": 0, "members": ["j"]})
    assert sorted(os.listdir(tmp_path)) == ["clip.json", "clip.mp4"]
    assert done.mp4_sha256 == sha256_file(output) and done.mp4_bytes == output.stat().st_size
    assert (done.status, done.id, done.model, done.extra) == ("done", "j", "tiny", {"mesh": {}, "line": 3})
    assert json.loads(record_path(output).read_text()) == done.to_json()


def test_a_rank_that_neither_writes_nor_decodes_gets_no_clip_and_writes_nothing(pipeline, tmp_path):
    assert pipeline.generate(prepare(REQUEST, TINY_CANVAS), Target(tmp_path / "clip.mp4", writes=False)) is None
    assert os.listdir(tmp_path) == []
    assert commit_job_clip(None, Job("j", REQUEST, tmp_path / "clip.mp4"), Place(), pipeline.device, {}) is None


def _run(pipeline, job: Job) -> list:
    events = []
    run_work(pipeline, [job], Place(model="tiny"), Reporter(Place(), events.append, lambda _: False, pipeline.device))
    return events


def test_run_work_commits_the_clip_and_then_reports_it_done(pipeline, tmp_path):
    output = tmp_path / "clip.mp4"
    events = _run(pipeline, Job("j", REQUEST, output))
    kinds = [e.kind for e in events]
    assert kinds[0] == EventKind.STARTED and kinds[-1] == EventKind.DONE
    assert set(kinds[1:-1]) == {EventKind.PROGRESS}
    assert sorted(os.listdir(tmp_path)) == ["clip.json", "clip.mp4"]
    assert json.loads(record_path(output).read_text()) == events[-1].record.to_json()


@pytest.mark.parametrize("where", ["making the record", "completing the record", "hashing the MP4"])
def test_a_failure_between_encode_and_commit_leaves_nothing_at_the_output_path(pipeline, tmp_path, monkeypatch,
                                                                             where):
    """The MP4 is encoded; then the pipeline's record or the job layer's commit fails before the rename: the job
    fails, and neither the clip, its record nor the temporary MP4 is left."""
    def boom(*args, **kwargs):
        raise RuntimeError("the commit's step broke")

    if where == "making the record":
        monkeypatch.setattr("h3trt.pipeline.h3_pipeline.clip_record", boom)
    elif where == "completing the record":
        monkeypatch.setattr(work, "peak_memory", boom)
    else:
        monkeypatch.setattr("h3trt.pipeline.records.sha256_file", boom)
    events = _run(pipeline, Job("j", REQUEST, tmp_path / "clip.mp4"))
    assert events[-1].kind == EventKind.FAILED and "the commit's step broke" in events[-1].error
    assert events[-1].stage == "decode"  # where a failed commit was reported before the commit moved
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("jobs", [1, 2], ids=["alone", "batched"])
def test_the_rank_reads_only_the_media_of_an_admitted_request(pipeline, tmp_path, monkeypatch, jobs):
    """Admission checked what the request states (pipeline/prepare.py check_request); the rank that runs the job
    re-reads its media and checks nothing again (issue 48 step 2): a check made to fail on the rank fails no job."""
    def checked_again(*args, **kwargs):
        raise AssertionError("the rank checked an admitted request again")

    monkeypatch.setattr("h3trt.pipeline.prepare.check_request", checked_again)
    request = Request.of("a red fox runs", seed=1, steps=2, width=128, height=32, guidance=1.0)
    batch = [Job(f"j{i}", request, tmp_path / f"clip{i}.mp4") for i in range(jobs)]
    events = []
    run_work(pipeline, batch, Place(model="tiny"), Reporter(Place(), events.append, lambda _: False, pipeline.device))
    ends = {e.job: e for e in events if e.ends}
    assert sorted(ends) == [j.id for j in batch]
    assert all(e.kind == EventKind.DONE for e in ends.values()), [e.error for e in ends.values()]
    assert sorted(os.listdir(tmp_path)) == sorted(f"clip{i}.{x}" for i in range(jobs) for x in ("json", "mp4"))
