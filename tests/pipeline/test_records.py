"""The clip record as a type (h3trt/pipeline/records.py `ClipRecord`): records written before it was one read and write
back byte for byte, the layers that fill it in turn write the same keys in the same order, and its readers take
attributes.

tests/data/records/ holds records written by h3trt before the types: a bundle's clip with its load split, identity and
mesh; a requests file's clip with its line and marker; a requests file's failure record (failure_batch.json)."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from h3trt.run.batch_outputs import clip_damage
from h3trt.pipeline.records import ClipRecord, ColdStart, Failure, FailureRecord, StageTimer, clip_record, commit_clip, record_path
from h3trt.request.request import Request
from h3trt.run.commands import report_record

from helpers import DATA

pytestmark = pytest.mark.unit

RECORDS = DATA / "records"
WRITTEN = sorted(RECORDS.glob("clip_*.json"))

# Every optional field set, in the dict form the pipeline, the commit and the job layer wrote before the type.
FULL = {
    "output": "out/a.mp4", "task": "ref2va", "prompt": "a fox", "seed": 3, "steps": 6, "evaluations": 5,
    "shifts": {"video": 12.0, "audio": 3.0},
    "schedule_from": {"steps": "adapter turbo", "video_shift": "request", "audio_shift": "default"},
    "width": 160, "height": 96, "frames": 22, "fps": 24,
    "audio_samples": 29333, "audio_sample_rate": 32000, "sequence_rows": 971, "device": "cuda:0",
    "vae_precision": "bf16", "torch": "2.13.0", "python": "3.11.7", "timings_s": {"denoise": 0.5, "mux": 0.1},
    "spans_unix": {"denoise": [1.0, 1.5]}, "step_marks_s": [0.1, 0.2], "video_decoder": "compiled",
    "step_profile": {"step": 2}, "load": {"total_s": 3.0}, "peak_memory_gib": {"allocated": 1.5, "reserved": 2.0},
    "loras": [{"name": "fewstep", "scale": 1.0}], "step_cache": {"skipped": 2}, "sparse_attention": {"sparsity": 0.5},
    "wall_s": 1.25, "mp4_sha256": "ab" * 32, "mp4_bytes": 1234, "status": "done", "id": "a", "request": {"seed": 3},
    "model": "bundle", "batch": {"size": 1, "index": 0, "members": ["a"]}, "peak_memory": {"bytes": 9, "what": "x"},
    "bundle": {"backend": "inductor"}, "mesh": {"replica": 1}, "job": "video_a", "line": 4, "made_by": "h3trt",
}


@pytest.mark.parametrize("path", WRITTEN, ids=lambda p: p.name)
def test_a_record_written_before_the_type_reads_and_writes_back_byte_for_byte(path):
    text = path.read_text()
    record = ClipRecord.from_json(json.loads(text))
    assert json.dumps(record.to_json(), indent=1) == text  # files.write_json_file's form
    assert record.status == "done" and record.frames == json.loads(text)["frames"]
    assert set(record.extra) <= {"bundle", "mesh", "line", "made_by"}


def test_every_field_and_the_extras_keep_their_order_and_a_store_rows_bytes():
    record = ClipRecord.from_json(FULL)
    assert json.dumps(record.to_json()) == json.dumps(FULL)  # a row's JSON column (store.end: json.dumps(record))
    assert list(record.extra) == ["bundle", "mesh", "job", "line", "made_by"]
    assert ClipRecord.from_json({}).to_json() == {}  # an older record's missing fields stay missing
    with pytest.raises(ValueError, match=r"extra fields \['seed'\] would replace"):
        ClipRecord(extra={"seed": 1})


def test_the_layers_that_fill_a_record_write_the_keys_of_a_record_written_before(tmp_path):
    """clip_record (the pipeline), then generate's additions, the commit and the job layer's finish: the keys come out
    in the order of the bundle record written before the type."""
    timer = StageTimer(torch.device("cpu"))
    timer.add("denoise", 1.0, 1.5)
    prepared = SimpleNamespace(request=Request.of("a fox"), geometry=SimpleNamespace(width=160, height=96))
    schedule = SimpleNamespace(num_evaluations=5, video_shift=12.0, audio_shift=3.0)
    vae = SimpleNamespace(precision="fp32", tile_decoders=None)
    record = clip_record(prepared, schedule, SimpleNamespace(seq_len=971), tmp_path / "a.mp4", 124, 165600, timer,
                         torch.device("cpu"), vae, load_report=ColdStart(total_s=1.0))
    record = replace(record, sparse_attention={"sparsity": 0.0}, wall_s=1.0)
    mp4 = tmp_path / "a.mp4.tmp"
    mp4.write_bytes(b"an mp4")

    def finish(r):
        return replace(r, status="done", id="a", request={}, model="m", batch={}, peak_memory={},
                       extra={"bundle": {}, "mesh": {}})

    done = commit_clip(finish(record), mp4, tmp_path / "a.mp4")
    written = json.loads(record_path(tmp_path / "a.mp4").read_text())
    assert list(written) == list(json.loads((RECORDS / "clip_bundle.json").read_text()))
    assert done.mp4_bytes == 6 == (tmp_path / "a.mp4").stat().st_size and written == done.to_json()


def test_readers_take_the_records_attributes(tmp_path, capsys):
    record = ClipRecord.from_json(json.loads((RECORDS / "clip_bundle.json").read_text()))
    report_record(record, tmp_path / "a.mp4")
    out = capsys.readouterr().out
    assert f"{record.frames} frames {record.width}x{record.height} @ 24 fps" in out and "5.175 s stereo audio" in out
    mp4 = tmp_path / "a.mp4"
    mp4.write_bytes(b"x" * 7)
    assert clip_damage(mp4, record) == f"{mp4} is 7 bytes, its record says {record.mp4_bytes}"


def test_a_failure_record_written_before_the_type_reads_and_writes_back_byte_for_byte():
    text = (RECORDS / "failure_batch.json").read_text()
    record = FailureRecord.from_json(json.loads(text))
    assert json.dumps(record.to_json(), indent=1) == text
    assert (record.id, record.line, record.stage) == ("c", 3, "encode") and record.extra == {}
    with_bundle = {**json.loads(text), "bundle": {"backend": "inductor"}}  # a bundle's identity comes last
    assert json.dumps(FailureRecord.from_json(with_bundle).to_json()) == json.dumps(with_bundle)
    with pytest.raises(ValueError, match="status is 'failed', not 'done'"):
        FailureRecord.from_json({**json.loads(text), "status": "done"})


def test_a_failure_pickles_with_its_event_and_defaults_to_nothing_known():
    import pickle

    from h3trt.jobs.job import Event

    event = Event("a", "failed", "encode", error="encode: OSError: x", record=Failure("OSError", False, ["tb"]))
    again = pickle.loads(pickle.dumps(event))
    assert again.record == Failure("OSError", False, ["tb"], {}) and not again.record.user_error
    assert Failure() == Failure("", False, [], {})


def test_a_decode_result_written_before_the_type_reads_and_writes_back_byte_for_byte():
    """A writing rank's decode_and_write result as the dict it was (json.dumps(result, indent=1)); its readers take
    attributes."""
    from pathlib import Path

    from h3trt.pipeline.parallel_decode import DecodeResult

    text = (RECORDS / "decode_result.json").read_text()
    result = DecodeResult.from_json(json.loads(text))
    assert json.dumps(result.to_json(), indent=1) + "\n" == text
    assert (result.frames, result.wrote, result.mp4_temp) == (17, True, None)
    assert list(result.tail_s) == ["to_encoder", "encode", "audio_flush", "video_flush", "close_faststart", "rename",
                                   "join"]
    uncommitted = DecodeResult(17, 3200, True, Path("/out/.a.mp4.h-1-x.partial"), {"video_decode": 1.0}, {})
    assert uncommitted.to_json()["mp4_temp"] == "/out/.a.mp4.h-1-x.partial"
    assert DecodeResult.from_json(json.loads(json.dumps(uncommitted.to_json()))) == uncommitted


def test_a_cold_start_split_written_before_the_type_reads_and_writes_back_byte_for_byte():
    text = (RECORDS / "clip_bundle.json").read_text()
    load = json.loads(text)["load"]
    split = ColdStart.from_json(load)
    assert json.dumps(split.to_json()) == json.dumps(load)
    assert split.total_s == 1.1334 and split.vae_load_s == 0.8405 and split.engine["files_hashed"] == 96
    record = ClipRecord.from_json(json.loads(text))  # a record's `load` is the type
    assert record.load == split and json.dumps(record.to_json(), indent=1) == json.dumps(json.loads(text), indent=1)
    # Off Linux the process start is unknown: written as null, as before. An older split lacks fields added since;
    # a newer one's unknown keys come last, as they were.
    for old in ({"process_to_load_s": None, "engine": {}, "engine_s": 1.0, "total_s": 2.0},
                {"engine": {}, "engine_s": 1.0, "text_encoder_wait_s": 0.1, "total_s": 2.0, "later_s": 3.0}):
        assert json.dumps(ColdStart.from_json(old).to_json()) == json.dumps(old)


def test_the_vaes_complete_a_cold_start_split_in_the_order_the_loader_wrote_it():
    load = json.loads((RECORDS / "clip_bundle.json").read_text())["load"]
    before = {k: v for k, v in load.items() if k not in ("vae_load_s", "all_files_checked_s", "components_read")}
    split = ColdStart.from_json(before).with_vaes(0.8405, {k: load[k] for k in ("all_files_checked_s",
                                                                               "components_read")})
    assert json.dumps(split.to_json()) == json.dumps(load)
    assert ColdStart(total_s=1.0).with_vaes(2.0, {}).to_json() == {"total_s": 1.0, "vae_load_s": 2.0}
