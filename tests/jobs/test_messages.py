"""The messages between a replica group's ranks and their launcher (h3trt/jobs/messages.py): each pickles whole
across a multiprocessing pipe and torch.distributed's broadcast_object_list, and each side dispatches on its type."""

import pickle
import tempfile
from multiprocessing import Pipe
from pathlib import Path

import pytest
import torch.distributed as dist

from h3trt.parallel.launch import init_rank, launch
from h3trt.parallel.mesh import MeshConfig
from h3trt.jobs.job import Event, EventKind, Job, Stage
from h3trt.jobs.messages import Cancel, Idle, Ready, Report, Stop, Work
from h3trt.pipeline.records import ClipRecord
from h3trt.jobs.rank import BroadcastChannel, PipeChannel, WorkerSpec
from h3trt.request.request import BatchKey, Request
from h3trt.jobs.supervisor import Workers

JOBS = [Job("a", Request.of("a fox", refs=(Path("ref.png"),), seed=3), Path("out/a.mp4"), record={"line": 1},
            key=BatchKey("t2va", 96, 160, 124, 4, None, None)),
        Job("b", Request.of("a cat"), Path("out/b.mp4"), attempt=2)]
EVENT = Event("a", "progress", "denoise", 40, (4, 10), group=1, attempt=2)
MESSAGES = [Work(JOBS), Cancel("a"), Stop(), Ready(1), Report(EVENT), Idle()]


@pytest.mark.unit
@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_pickles_whole_and_is_frozen(message):
    again = pickle.loads(pickle.dumps(message))
    assert again == message and type(again) is type(message)
    with pytest.raises(AttributeError):
        message.x = 1  # frozen (and slotted or not, no new attribute either)
    assert Work(JOBS).jobs == tuple(JOBS)  # a list of jobs is held as a tuple: the message cannot change after sending
    assert pickle.loads(pickle.dumps(Report(EVENT))).event.kind is EventKind.PROGRESS
    assert pickle.loads(pickle.dumps(Report(EVENT))).event.stage is Stage.DENOISE


@pytest.mark.unit
def test_a_rank_takes_work_and_cancels_from_its_pipe_and_sends_typed_messages_back():
    launcher, rank = Pipe()
    channel = PipeChannel(rank, writes=True)
    launcher.send(Cancel("old"))  # for a job that already ended on this rank: skipped
    launcher.send(Work(JOBS))
    assert channel.next_work() == JOBS
    launcher.send(Cancel("b"))
    assert channel.cancelled("b") and not channel.cancelled("a")
    channel.report(EVENT)
    channel.idle()
    assert launcher.recv() == Report(EVENT) and launcher.recv() == Idle()
    launcher.send(Stop())
    assert channel.next_work() is None

    launcher.send(Work(JOBS[:1]))  # a rank that is running a job takes only cancels meanwhile
    assert channel.next_work() == JOBS[:1] and not channel.cancelled("b")  # new work forgets the old cancels
    launcher.send(Stop())
    with pytest.raises(RuntimeError, match="sent Stop while a job was running"):
        channel.cancelled("a")
    launcher.send(("work", JOBS))  # the old tuple form is no message
    with pytest.raises(RuntimeError, match=r"sent \('work'"):
        channel.next_work()

    quiet = PipeChannel(rank, writes=False)  # a rank that does not write reports nothing
    quiet.report(EVENT)
    quiet.idle()
    assert not launcher.poll()


class _Queue:
    def __init__(self):
        self.reported = []

    def report(self, event):
        self.reported.append(event)


@pytest.mark.unit
def test_the_launcher_dispatches_what_its_ranks_send_by_type():
    spec = WorkerSpec("tiny", False, "t2va", "cpu", MeshConfig(1, 1, 2), 4)
    queue = _Queue()
    workers = Workers(spec, queue, None, log=lambda m: None)
    g = workers.groups[0]
    g.ranks, g.conns = object(), [None, None]  # two ranks, not yet loaded
    workers._handle(g, Ready(0))
    assert not g.up
    workers._handle(g, Ready(1))
    assert g.up
    g.busy, g.holding = True, {job.id: job for job in JOBS}
    workers._handle(g, Report(EVENT))  # progress goes to the queue at once
    assert queue.reported == [EVENT]
    done = Event("a", "done", "done", 100, record=ClipRecord(seed=3))
    workers._handle(g, Report(done))  # an end waits until the group has its next work
    assert list(g.holding) == ["b"] and workers._ended == [(g, done)] and queue.reported == [EVENT]
    workers._handle(g, Idle())
    assert not g.busy and g.holding == {}
    with pytest.raises(RuntimeError, match=r"replica group 0 sent \('idle',\)"):
        workers._handle(g, ("idle",))


class _FirstRankQueue:
    def __init__(self):
        self.work = [JOBS, None]

    def take(self, group, limit):
        return self.work.pop(0)


def _broadcast(rank, world, store, out):
    init_rank(rank, world, store, "cpu")
    group = dist.new_group(list(range(world)))
    channel = BroadcastChannel(_FirstRankQueue() if rank == 0 else None, 2, group, rank == 0, 0)
    got = [channel.next_work(), channel.next_work()]
    (out / f"{rank}.pkl").write_bytes(pickle.dumps(got))


@pytest.mark.multiproc
def test_torchruns_first_rank_broadcasts_work_then_stop_to_its_group(tmp_path, monkeypatch):
    store = tmp_path / "tmp"
    store.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(store))
    launch(_broadcast, 2, (tmp_path,))
    for rank in range(2):
        assert pickle.loads((tmp_path / f"{rank}.pkl").read_bytes()) == [JOBS, None]
