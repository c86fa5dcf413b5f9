"""A batch replaces only files it made (issue 35, items 13-15): `h3trt run --requests` in a subprocess, as a user runs
it, on the tiny default model. The user's own files in --out-dir, a finished clip whose request line changed, and a
clip that no longer matches its record are kept byte for byte: the run is refused with one line (exit 2) naming them
and the way out, before any model loads."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

LINES = [{"id": "a", "task": "t2va", "prompt": "a red fox runs", "seed": 1, "resolution": "128x32", "steps": 2},
         {"id": "b", "task": "t2va", "prompt": "a blue bird sings", "seed": 2, "resolution": "128x32", "steps": 2}]


def _requests(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _cli(cache: Path, requests: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "h3trt.cli", "run", "--requests", str(requests), "--out-dir",
                           str(out), "--quiet", *extra], env=env, capture_output=True, text=True, timeout=600)


def _contents(folder: Path) -> dict[str, bytes]:
    """Every visible file's bytes (the hidden out-dir lock file aside)."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if not p.name.startswith(".")}


def _error(proc: subprocess.CompletedProcess) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("h3trt: error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.fixture(scope="module")
def finished_out(tmp_path_factory, tiny_cache, tiny_root) -> Path:
    """One real batch of a and b, made once for the tests that rerun it (each on its own copy)."""
    folder = tmp_path_factory.mktemp("finished")
    proc = _cli(tiny_cache, _requests(folder / "b.jsonl", LINES), folder / "out")
    assert proc.returncode == 0, proc.stderr
    assert "2 done, 0 failed, 0 skipped" in proc.stdout
    return folder / "out"


def _copy(finished_out: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(finished_out, out)
    return out


def test_the_users_own_files_in_out_dir_are_never_replaced(tmp_path, tiny_cache, tiny_root):
    """Item 13: OUT holds the user's a.json, b.mp4 and timeline.json; a batch of ids a and b is refused (exit 2) with
    one line naming the three files, another --out-dir and --overwrite; nothing in OUT changed, no model loaded."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.json").write_text('{"my": "notes on a"}\n')
    (out / "b.mp4").write_bytes(b"my own holiday video" * 100)
    (out / "timeline.json").write_text('{"my": "project timeline"}\n')
    before = _contents(out)
    proc = _cli(tiny_cache, _requests(tmp_path / "b.jsonl", LINES), out)
    assert proc.returncode == 2, proc.stderr
    error = _error(proc)
    for name in ("a.json", "b.mp4", "timeline.json"):
        assert str(out / name) in error, error
    assert "--out-dir" in error and "--overwrite" in error and "Nothing was run" in error, error
    assert "random weights" not in proc.stderr  # refused before the model was resolved and loaded
    assert _contents(out) == before



def test_a_finished_clip_whose_request_changed_is_kept(tmp_path, finished_out, tiny_cache):
    """Item 14: a's prompt changed in the file after a and b were made. The rerun is refused (exit 2) with one line
    naming a, its line and --overwrite; a's clip and record are byte for byte as they were. Then the way out:
    --overwrite makes a again for the new prompt and says so, b is still skipped, and a foreign timeline.png put there
    meanwhile is replaced and named too."""
    out = _copy(finished_out, tmp_path)
    before = _contents(out)
    requests = _requests(tmp_path / "b.jsonl", [dict(LINES[0], prompt="a grey wolf howls"), LINES[1]])
    proc = _cli(tiny_cache, requests, out)
    assert proc.returncode == 2, proc.stderr
    error = _error(proc)
    assert "finished clip of a (line 1)" in error and "request line changed" in error, error
    assert "--overwrite" in error and "Nothing was run" in error and "b (line 2)" not in error, error
    assert _contents(out) == before

    (out / "timeline.png").write_bytes(b"\x89PNG the user's own chart")
    proc = _cli(tiny_cache, requests, out, "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert "1 done, 0 failed, 1 skipped" in proc.stdout
    assert "--overwrite: making a (line 1) again for the changed request" in proc.stderr
    assert f"--overwrite: replacing {out / 'timeline.png'}" in proc.stderr
    assert json.loads((out / "a.json").read_text())["prompt"] == "a grey wolf howls"
    after = _contents(out)
    assert after["a.mp4"] != before["a.mp4"] and all(after[n] == before[n] for n in ("b.mp4", "b.json"))
    timeline = json.loads(after["timeline.json"])
    assert [r["summary"]["done"] for r in timeline["runs"]] == [2, 1]  # our own timeline: the first run is kept
    assert timeline["png"]["bytes"] == len(after["timeline.png"]) and after["timeline.png"][:4] == b"\x89PNG"


def test_a_clip_that_no_longer_matches_its_record_is_kept(tmp_path, finished_out, tiny_cache):
    """Item 15: b.mp4 truncated after the batch made it. The rerun is refused (exit 2) with one line naming b, the
    sizes and the way out; the truncated file is byte for byte as it was, and a is untouched."""
    out = _copy(finished_out, tmp_path)
    clip = out / "b.mp4"
    whole = clip.stat().st_size
    clip.write_bytes(clip.read_bytes()[:whole // 2])
    before = _contents(out)
    proc = _cli(tiny_cache, _requests(tmp_path / "b.jsonl", LINES), out)
    assert proc.returncode == 2, proc.stderr
    error = _error(proc)
    assert f"b ({clip} is {whole // 2} bytes, its record says {whole})" in error, error
    assert "no longer matches its record" in error and "--overwrite" in error and "Nothing was run" in error, error
    assert "a (" not in error, error
    assert _contents(out) == before

def _item(id_: str, line: int = 1):
    from h3trt.models.packing import Geometry
    from h3trt.request.request import Admitted, Request
    from h3trt.run.batch_file import BatchItem

    request = Request.of("a red fox runs", seed=line, steps=2, width=128, height=32)
    return BatchItem(id_, line, Admitted(request, Geometry(32, 128, 124)))


def _failure_record(out: Path, id_: str) -> Path:
    """What a batch writes for a failed request (batch.FileQueue._failed), reduced to what marks it ours."""
    from h3trt.run.batch_outputs import MADE_BY

    path = out / f"{id_}.json"
    path.write_text(json.dumps({"made_by": MADE_BY, "id": id_, "status": "failed", "error": "encode: gone"}))
    return path


def test_only_records_that_mark_a_file_ours_let_a_batch_replace_it(tmp_path):
    """The plan, file by file: our failure record is retried (and may be replaced); a clip beside a failure record,
    a record of another id, a record without the marker, a PNG beside no timeline of ours are not ours."""
    from h3trt.run.batch_outputs import plan_out_dir
    from h3trt.media.output_files import OutputRefused

    out = tmp_path / "out"
    out.mkdir()
    items = [_item(i, n) for n, i in enumerate("abcde", 1)]
    _failure_record(out, "a")
    _failure_record(out, "b")
    (out / "b.mp4").write_bytes(b"not the failed request's")
    (out / "c.json").write_text(_failure_record(out, "x").read_text())  # ours, but of request x
    (out / "d.json").write_text('{"status": "failed", "id": "d"}')  # an h3trt-like record without the marker
    (out / "timeline.png").write_bytes(b"\x89PNG my chart")
    plan = plan_out_dir(out, items[:1], ["timeline"], png=False, overwrite=False)
    assert plan.replace == {"a"} and not plan.finished and plan.timelines == {"timeline": False} and not plan.notes
    with pytest.raises(OutputRefused) as refused:
        plan_out_dir(out, items, ["timeline"], png=True, overwrite=False)
    message = str(refused.value)
    for name in ("b.mp4", "c.json", "d.json", "timeline.png"):
        assert str(out / name) in message, message
    assert str(out / "a.json") not in message and "b.json" not in message and "--overwrite" in message
    plan = plan_out_dir(out, items, ["timeline"], png=True, overwrite=True)
    assert plan.replace == {"a", "b", "c", "d"} and plan.timelines == {"timeline": True}
    assert len(plan.notes) == 1 and "--overwrite: replacing" in plan.notes[0] and "d.json" in plan.notes[0]



def _done_record(out: Path, item, clip: bytes) -> None:
    """A clip and the done record a batch writes beside it, reduced to what the plan reads."""
    import hashlib

    from h3trt.run.batch_outputs import MADE_BY


    (out / f"{item.id}.mp4").write_bytes(clip)
    (out / f"{item.id}.json").write_text(json.dumps({
        "made_by": MADE_BY, "id": item.id, "status": "done", "request": item.request.flat(),
        "mp4_sha256": hashlib.sha256(clip).hexdigest(), "mp4_bytes": len(clip)}))


def test_a_missing_clip_is_made_again_with_a_word_and_an_edited_one_is_refused(tmp_path):
    """Our done record without its clip: made again, and the plan says so. A clip of the recorded size whose bytes
    changed (an edit in place): refused like a truncated one, naming the hash."""
    from h3trt.run.batch_outputs import plan_out_dir
    from h3trt.media.output_files import OutputRefused

    out = tmp_path / "out"
    out.mkdir()
    a, b, c = _item("a", 1), _item("b", 2), _item("c", 3)
    for item in (a, b, c):
        _done_record(out, item, f"clip {item.id}".encode())
    (out / "a.mp4").unlink()
    plan = plan_out_dir(out, [a, c], [], png=False, overwrite=False)
    assert plan.finished == {"c"} and plan.replace == {"a"}
    assert plan.notes == [f"a: {out / 'a.mp4'} is gone though its record says done; making it again"]
    (out / "b.mp4").write_bytes(b"clip B")  # same size, other bytes
    with pytest.raises(OutputRefused, match=rf"b \(the sha256 of {out / 'b.mp4'} is not the one its record holds\)"):
        plan_out_dir(out, [a, b, c], [], png=False, overwrite=False)
    plan = plan_out_dir(out, [a, b, c], [], png=False, overwrite=True)
    assert plan.replace == {"a", "b"} and plan.notes[-1].startswith("--overwrite: making b (the sha256 of")
