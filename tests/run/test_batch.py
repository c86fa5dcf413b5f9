"""Batch generation: a requests file validated before any work, batched denoise equal to one-at-a-time, failures
recorded while the others complete, and an interrupted run resumed without redoing finished clips."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from h3trt.cli import main
from h3trt.models.tiny import TINY_HEIGHT, TINY_REFERENCE_SHORT_EDGE, TINY_WIDTH
from h3trt.run.batch import BatchConfig, run_batch
from h3trt.jobs.model_source import check_bundle_batch
from h3trt.run.batch_file import parse_requests
from h3trt.run.batch_outputs import finished
from h3trt.media.inputs import probe
from h3trt.pipeline.h3_pipeline import H3Pipeline
from h3trt.request.request import CanvasDefaults, Request
from h3trt.pipeline.prepare import prepare
from h3trt.request.parse import RequestsFileError
from h3trt.run.timeline import draw_timeline, legend_stages

TINY_CANVAS = CanvasDefaults(short_edge=TINY_HEIGHT, max_pixels=TINY_WIDTH * TINY_HEIGHT,
                             reference_short_edge=TINY_REFERENCE_SHORT_EDGE)
SMALL = {"resolution": "128x32", "steps": 2}  # the cheapest clip H3 allows: 5 s, one DiT evaluation
# Batched and one-at-a-time runs differ only by the summation order of batched float32 matmuls (measured 1.2e-6 on
# latents of magnitude ~6 after 5 steps); 1e-4 absolute leaves room across CPUs without hiding a wrong seed or row.
BATCH_ATOL = 1e-4


def _png(path: Path, seed: int, size=(128, 32)) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def _write(path: Path, lines: list) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


@pytest.fixture(scope="module")
def pipeline(tiny_root):
    return H3Pipeline.load(tiny_root, "t2va", "cpu", TINY_CANVAS)


def test_every_bad_line_is_reported_with_its_number(tmp_path):
    _png(tmp_path / "first.png", 0)
    path = _write(tmp_path / "batch.jsonl", [
        {"id": "ok", "task": "t2va", "prompt": "a fox"},
        "{not json",
        {"id": "k", "task": "t2va", "prompt": "a fox", "sed": 3},
        {"id": "ok", "task": "t2va", "prompt": "again"},
        "",
        {"id": "m", "task": "t2va", "prompt": "a fox", "image": "first.png"},
        {"id": "r", "task": "t2va", "prompt": "a fox", "resolution": "100x50"},
        {"id": "f", "task": "fl2va", "prompt": "a fox", "image": "missing.png"},
        {"id": "../x", "task": "t2va", "prompt": "a fox"},
        {"id": "s", "task": "t2va", "prompt": "a fox", "seed": "7"},
        {"id": "fine", "task": "fl2va", "prompt": "a fox", "image": "first.png", "duration": 6},
    ])
    with pytest.raises(RequestsFileError) as err:
        parse_requests(path, TINY_CANVAS)
    message = str(err.value)
    assert "8 bad line(s), nothing was run" in message
    for line, words in ((2, "not valid JSON"), (3, "unknown key(s) ['sed']"), (4, "duplicate id 'ok' (first on line 1)"),
                        (6, "task 't2va' takes no image"), (7, "Unsupported resolution 100x50"),
                        (8, "missing.png"), (9, "id '../x'"), (10, 'seed must be an integer, got "7"')):
        entry = next(e for e in message.split("; ") if f"batch.jsonl:{line}: " in e)
        assert words in entry, (line, entry)
    assert "batch.jsonl:1:" not in message and "batch.jsonl:11:" not in message


def test_a_bad_line_stops_the_batch_before_any_work(tmp_path, capsys):
    lines = [{"id": f"r{i}", "task": "t2va", "prompt": "a red fox runs", "seed": i, **SMALL} for i in range(6)]
    lines[4]["duration"] = 30  # H3 generates at most 15 s
    out = tmp_path / "out"
    status = main(["run", "--requests", str(_write(tmp_path / "batch.jsonl", lines)), "--out-dir", str(out)])
    assert status == 2
    err = capsys.readouterr().err
    assert "batch.jsonl:5: duration: Unsupported duration 30 s" in err and "nothing was run" in err
    assert not out.exists()  # nothing written, no model loaded


def test_static_batch_bundle_refuses_max_batch():
    segments = {"embed": {"inputs": ["video"], "dynamic": {"video": {"1": "V"}}},
                "block": {"inputs": ["x"], "dynamic": {"x": {"1": "S"}}},
                "video_decoder_2x4x4": {"inputs": ["z"], "dynamic": {}}}
    check_bundle_batch(segments, 1)
    with pytest.raises(ValueError, match=r"\['block', 'embed'\] are compiled for batch 1.*--max-batch 1"):
        check_bundle_batch(segments, 2)
    segments["embed"]["dynamic"]["video"]["0"] = "B"
    segments["block"]["dynamic"]["x"]["0"] = "B"
    check_bundle_batch(segments, 4)


def test_batched_denoise_gives_each_request_what_it_gets_alone(pipeline, tmp_path):
    """Seeds and keyframe conditions stay per request: a batch of 3 equals the 3 requests run one at a time."""
    requests = [Request.of("a red fox runs", seed=s, steps=3, width=128, height=32) for s in (1, 2)]
    requests.append(Request.of("a red fox runs", image=_png(tmp_path / "k.png", 5), seed=3, steps=3, width=128,
                            height=32))
    requests.append(Request.of("a red fox runs", image=_png(tmp_path / "l.png", 6), seed=4, steps=3, width=128,
                            height=32))
    encoded = [pipeline.encode_request(prepare(r, TINY_CANVAS)) for r in requests]
    t2va, fl2va = encoded[:2], encoded[2:]
    for group in (t2va, fl2va):
        batched = pipeline.denoise_batch(group)
        for e, got in zip(group, batched):
            alone = pipeline.denoise_batch([e])[0]
            _, _, reference = pipeline.denoise_request(e.prepared)  # the one-request path `generate` takes
            assert torch.equal(alone.video, reference.video) and torch.equal(alone.audio, reference.audio)
            torch.testing.assert_close(got.video, alone.video, rtol=0, atol=BATCH_ATOL)
            torch.testing.assert_close(got.audio, alone.audio, rtol=0, atol=BATCH_ATOL)
        assert not torch.allclose(batched[0].video, batched[1].video)  # different seeds, different clips
    with pytest.raises(ValueError, match="one packed layout"):
        pipeline.denoise_batch([t2va[0], fl2va[0]])  # keyframe rows: another layout


def test_failure_recorded_interrupt_and_resume(pipeline, tmp_path, capsys):
    """Five requests (one per line, the sixth line of the CLI test is the bad one): c loses its image after
    validation and fails at run time; the first run is interrupted after a; the rerun skips a and finishes the rest."""
    base = {"task": "t2va", "prompt": "a red fox runs", **SMALL}
    image = _png(tmp_path / "c.png", 1)
    path = _write(tmp_path / "batch.jsonl", [
        {**base, "id": "a", "seed": 1}, {**base, "id": "b", "seed": 2},
        {**base, "id": "c", "task": "fl2va", "image": "c.png", "seed": 3},
        {**base, "id": "d", "seed": 4}, {**base, "id": "e", "seed": 5},
    ])
    items = parse_requests(path, TINY_CANVAS)
    image.unlink()  # validated, then gone: a run-time failure
    out = tmp_path / "out"
    config = BatchConfig(out, max_batch=2, quiet=True)

    def interrupt(event):
        if event.kind == "done" and event.job == "a":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_batch(pipeline, items, config, "tiny", on_event=interrupt)
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "a.mp4", "timeline.json", "timeline.png"]
    a_mtime = (out / "a.mp4").stat().st_mtime_ns

    summary = run_batch(pipeline, items, config, "tiny")
    assert summary.skipped == ["a"] and summary.failed == ["c"] and summary.done == ["b", "d", "e"]
    assert (out / "a.mp4").stat().st_mtime_ns == a_mtime  # not redone
    assert not (out / "c.mp4").exists()
    failed = json.loads((out / "c.json").read_text())
    assert failed["status"] == "failed" and failed["stage"] == "encode" and "c.png" in failed["error"]
    assert failed["line"] == 3
    records = {rid: json.loads((out / f"{rid}.json").read_text()) for rid in "abde"}
    assert records["a"]["batch"]["members"] == ["a", "b"]  # b was denoised with a, then interrupted before decode
    assert records["b"]["batch"]["members"] == ["b", "d"] and records["e"]["batch"]["size"] == 1
    for rid, record in records.items():
        assert record["status"] == "done" and record["seed"] == "abcde".index(rid) + 1
        assert record["request"]["seed"] == record["seed"] and record["peak_memory"]["bytes"] > 0
        assert set(record["timings_s"]) >= {"text_encode", "denoise", "video_decode", "audio_decode", "mux"}
        info = probe(out / f"{rid}.mp4")
        assert (info["width"], info["height"], info["frames"]) == (128, 32, 124)
    timeline = json.loads((out / "timeline.json").read_text())
    assert timeline["summary"]["done"] == 3 and timeline["summary"]["clips_per_hour"] > 0  # the latest run
    assert [r["summary"]["done"] for r in timeline["runs"]] == [1, 3]  # the interrupted run is kept
    assert [(row["id"], row["run"]) for row in timeline["requests"] if row["status"] == "done"] == [
        ("a", 0), ("b", 1), ("d", 1), ("e", 1)]
    stages = {s for row in timeline["requests"] for s, _, _ in row["intervals"]}
    assert stages >= {"text_encode", "wait_batch", "denoise", "wait_decode"}
    assert "decode_mux" in stages or stages >= {"video_decode", "audio_decode", "mux"}  # overlapped or sequential
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no partial files

    # A damaged clip no longer verifies (its hash is in the record), so a rerun would make it again.
    good = (out / "d.mp4").read_bytes()
    (out / "d.mp4").write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert not finished(out, items[3]) and finished(out, items[4])
    (out / "d.mp4").write_bytes(good)

    # The CLI on the same folder, with c dropped from the file: every request verifies, nothing is redone.
    lines = [line for line in path.read_text().splitlines() if '"c"' not in line]
    status = main(["run", "--requests", str(_write(tmp_path / "again.jsonl", lines)), "--out-dir", str(out),
                   "--max-batch", "2", "--quiet"])
    assert status == 0
    assert "0 done, 0 failed, 4 skipped" in capsys.readouterr().out
    assert (out / "a.mp4").stat().st_mtime_ns == a_mtime
    # A rerun that had nothing to do keeps the chart: every earlier row, plus this run in `runs`.
    again = json.loads((out / "timeline.json").read_text())
    assert again["requests"] == timeline["requests"] and len(again["runs"]) == 3

    # Under torchrun, replica group 1 of 2 serves every second request (b and e of a, b, d, e) and names its
    # timeline by group.
    again = parse_requests(tmp_path / "again.jsonl", TINY_CANVAS)
    summary = run_batch(pipeline, again, BatchConfig(out, shard=(1, 2), quiet=True, timeline_png=False), "tiny")
    assert summary.skipped == ["b", "e"] and not summary.done
    assert json.loads((out / "timeline-group1.json").read_text())["summary"]["skipped"] == 2


def test_a_file_that_appears_in_out_dir_during_a_batch_is_kept(pipeline, tmp_path):
    """The plan found OUT empty, so no job may replace anything: an a.mp4 that the user drops in while a runs is
    kept, and a fails naming it (a rerun is refused until the file is moved, or --overwrite)."""
    items = parse_requests(_write(tmp_path / "b.jsonl", [{"id": "a", "task": "t2va", "prompt": "a fox", **SMALL}]),
                           TINY_CANVAS)
    out = tmp_path / "out"

    def drop(event):
        if event.kind == "started":
            (out / "a.mp4").write_bytes(b"the user's own clip")

    summary = run_batch(pipeline, items, BatchConfig(out, quiet=True, timeline_png=False), "tiny", on_event=drop)
    assert summary.failed == ["a"] and not summary.done
    assert (out / "a.mp4").read_bytes() == b"the user's own clip"
    record = json.loads((out / "a.json").read_text())
    assert record["status"] == "failed" and "a.mp4 appeared while this run was writing it" in record["error"]


def test_timeline_legend_names_the_stages_drawn(tmp_path):
    """The legend lists exactly the stages that have bars, in the colour table's order (an overlapped decode draws
    decode_mux, a sequential one video_decode / audio_decode / mux, never both in one legend unless both occur)."""
    rows = [{"id": "a", "status": "done", "intervals": [["denoise", 1.0, 2.0], ["text_encode", 0.0, 1.0],
                                                       ["decode_mux", 2.0, 3.0]]},
            {"id": "b", "status": "failed", "intervals": [["text_encode", 0.0, 0.5]]}]
    assert legend_stages(rows) == ["text_encode", "denoise", "decode_mux"]
    draw_timeline(rows, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG" and [p.name for p in tmp_path.iterdir()] == ["t.png"]
