"""Host overhead per step (`h3trt run --profile-step`) and the timing fields of a run record.

The busy/idle arithmetic is a pure function, checked on hand-made intervals; on the CPU there is no GPU whose idle
time could be measured, so the run only proves the wiring: the flag's report and the record's spans, step marks and
VAE precision.
"""

import json

import pytest

from h3trt.cli import main
from h3trt.pipeline.evaluation import busy_and_idle


def test_busy_and_idle_merges_overlaps_and_counts_gaps():
    # [0, 10]: kernels 1-3 and 2-4 overlap (busy 3), 6-7 (busy 1), one kernel outside the window is ignored.
    got = busy_and_idle([(1, 3), (2, 4), (6, 7), (11, 12)], 0, 10)
    assert got["busy"] == 4 and got["idle"] == 6 and got["idle_fraction"] == pytest.approx(0.6)
    assert got["gaps"] == 3 and got["longest_gap"] == 3  # 0-1, 4-6, 7-10
    full = busy_and_idle([(0, 5), (5, 10)], 0, 10)
    assert full["idle"] == 0 and full["gaps"] == 0
    clipped = busy_and_idle([(-2, 1), (9, 15)], 0, 10)
    assert clipped["busy"] == 2 and clipped["gaps"] == 1


def test_profile_step_and_record_timings(tmp_path, tiny_cache):
    out = tmp_path / "clip.mp4"
    assert main(["run", "--prompt", "a fox", "--output", str(out), "--quiet", "--steps", "4",
                 "--profile-step", "2"]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["step_profile"]["step"] == 2 and record["step_profile"]["device"] == "cpu"
    assert len(record["step_marks_s"]) == 3 and record["step_marks_s"] == sorted(record["step_marks_s"])
    spans = record["spans_unix"]
    assert spans["denoise"][1] <= spans["decode_and_mux"][0] and spans["text_encode"][1] <= spans["denoise"][0]
    assert record["vae_precision"] == "fp32" and record["video_decoder"] == "eager"
    assert main(["run", "--prompt", "a fox", "--output", str(tmp_path / "b.mp4"), "--quiet", "--steps", "4",
                 "--profile-step", "4"]) == 2  # 3 evaluations: there is no 4th
