"""Output files under concurrency and interruption, with real processes: unique temporary names, the no-clobber
commit of a clip's MP4 and record, the batch out-dir lock, and the leftovers of killed runs."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from h3trt.media import output_files as files
from h3trt.media.output_files import BatchLock, OutputBusy, OutputExists, commit, remove_leftovers, temp_path

from helpers import REPO

ENV = dict(os.environ, PYTHONPATH=str(REPO))

# One writer: its clip bytes and its record name it; both are committed as a pair once every writer is ready.
WRITER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from h3trt.media.output_files import OutputExists, commit, temp_path, write_json_file
    folder, me, writers, overwrite = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    mp4, record = folder / "clip.mp4", folder / "clip.json"
    tmp = temp_path(mp4)
    tmp.write_bytes(me.encode() * 1000)
    rec = write_json_file(record, {"writer": me})
    (folder / f"ready-{me}").touch()
    while len(list(folder.glob("ready-*"))) < writers:  # a barrier: every writer commits at the same moment
        time.sleep(0.001)
    try:
        commit([(rec, record), (tmp, mp4)], overwrite=overwrite)
    except OutputExists as e:
        print(e, file=sys.stderr)
        sys.exit(3)
""")


def _race(folder: Path, writers: int, overwrite: bool) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(folder), f"w{i}", str(writers), str(int(overwrite))],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(writers)]
    return [subprocess.CompletedProcess(p.args, p.wait(60), *p.communicate()) for p in procs]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".partial"))


@pytest.mark.multiproc
@pytest.mark.parametrize("overwrite", [False, True])
def test_two_processes_writing_one_clip_never_mix_or_lose_it(tmp_path, overwrite):
    """Two processes commit the same clip.mp4 + clip.json at the same moment, three rounds. Without --overwrite one
    wins and the other is told the target appeared; with it, the last one wins whole. Never a mixed pair, never a
    temporary file left."""
    for round_ in range(3):
        folder = tmp_path / f"round{round_}"
        folder.mkdir()
        results = _race(folder, 2, overwrite)
        codes = sorted(r.returncode for r in results)
        assert codes == ([0, 0] if overwrite else [0, 3]), [r.stderr for r in results]
        if not overwrite:
            loser = next(r for r in results if r.returncode == 3)
            assert "appeared while this run was writing it" in loser.stderr
        writer = json.loads((folder / "clip.json").read_text())["writer"]
        assert (folder / "clip.mp4").read_bytes() == writer.encode() * 1000  # the record describes the MP4 beside it
        assert _leftovers(folder) == []


def test_a_commit_takes_back_its_record_when_the_mp4_appeared(tmp_path):
    mp4, record = tmp_path / "c.mp4", tmp_path / "c.json"
    tmp_mp4, tmp_rec = temp_path(mp4), temp_path(record)
    tmp_mp4.write_bytes(b"mine"), tmp_rec.write_text("{}")
    mp4.write_bytes(b"theirs")  # another run finished first
    with pytest.raises(OutputExists, match="c.mp4 appeared"):
        commit([(tmp_rec, record), (tmp_mp4, mp4)])
    assert mp4.read_bytes() == b"theirs" and not record.exists() and _leftovers(tmp_path) == []


@pytest.mark.multiproc
def test_leftovers_of_killed_runs_are_removed_and_live_ones_kept(tmp_path):
    """A process that dies (SIGKILL) mid-write leaves its temporary file; the next run removes it, but never the file
    of a process that is still running."""
    script = ("import sys, time; from pathlib import Path; from h3trt.media.output_files import temp_path; "
              "p = temp_path(Path(sys.argv[1]) / 'clip.mp4'); p.write_bytes(b'x'); print(p, flush=True); "
              "time.sleep(60)")
    live = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], env=ENV, stdout=subprocess.PIPE, text=True)
    killed = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], env=ENV, stdout=subprocess.PIPE,
                              text=True)
    live_file, killed_file = Path(live.stdout.readline().strip()), Path(killed.stdout.readline().strip())
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    (tmp_path / ".notes.partial").write_text("not ours")  # not named like an h3trt temporary file: kept
    try:
        assert remove_leftovers(tmp_path) == [killed_file]
        assert live_file.exists() and not killed_file.exists() and (tmp_path / ".notes.partial").exists()
    finally:
        live.kill()
        live.wait()
    assert remove_leftovers(tmp_path) == [live_file]


@pytest.mark.multiproc
def test_a_second_batch_on_one_out_dir_is_refused_naming_the_first(tmp_path, capsys, tiny_root, no_model_load):
    """A real second process holds the out-dir; the CLI's batch gets one line naming it, before any model loads."""
    from h3trt.cli import main

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from h3trt.media.output_files import BatchLock\n"
                               "with BatchLock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)",
                               str(out)], env=ENV, stdout=subprocess.PIPE, text=True)
    out.mkdir()
    try:
        assert holder.stdout.readline().strip() == "held"
        requests = tmp_path / "b.jsonl"
        requests.write_text(json.dumps({"id": "a", "task": "t2va", "prompt": "x", "resolution": "128x32",
                                        "steps": 2}) + "\n")
        assert main(["run", "--requests", str(requests), "--out-dir", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is in use by another h3trt batch" in err[0] and f"pid {holder.pid}" in err[0], err
        with pytest.raises(OutputBusy):
            BatchLock(out).__enter__()
    finally:
        holder.kill()
        holder.wait()
    with BatchLock(out):  # the lock died with its holder
        pass


def test_interrupts_are_held_back_during_a_commit(tmp_path):
    """Ctrl-C in the middle of a commit is delivered after it, and says that the files were written."""
    target = tmp_path / "c.json"
    tmp = temp_path(target)
    tmp.write_text("{}")
    original = files.rename_noreplace

    def slow(src, dst):
        os.kill(os.getpid(), signal.SIGINT)  # arrives while the commit runs
        original(src, dst)

    files.rename_noreplace = slow
    try:
        with pytest.raises(files.InterruptedAfterCommit) as e:
            commit([(tmp, target)])
    finally:
        files.rename_noreplace = original
    assert e.value.targets == [target] and target.exists() and _leftovers(tmp_path) == []
