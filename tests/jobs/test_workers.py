"""The supervisor of replica groups (jobs/supervisor.py `Workers`), in this process: a fake rank group whose ranks are
threads at the other end of the launcher's pipes, speaking the pipe messages of jobs/messages.py, so the
supervisor's state changes (hand out work, forward events and cancels, drain, restart a group whose rank died, give
back what it held) are checked without spawning a process. The group's status record (`GroupStatus`) and its JSON
are checked here too."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace

import pytest

from h3trt.parallel.launch import Failure, RankFailed
from h3trt.jobs.job import Event, Job
from h3trt.jobs.messages import Cancel, Idle, Ready, Report, Stop, Work
from h3trt.pipeline.records import ClipRecord
from h3trt.jobs.supervisor import GroupState, GroupStatus, Workers

pytestmark = pytest.mark.unit


# --- the group's status record -----------------------------------------------------------------------------------------

def test_a_groups_status_is_the_json_the_api_served_before_it_was_a_type():
    """/ready's groups keep their bytes: a node's group (last_failure only when set) and a fleet's replica (Serve's
    state, then the replica once busy), keys in the order the dicts had."""
    node = GroupStatus(1, "busy", restarts=2, jobs=["video_a"], pids=[11, 12], last_failure="rank 1 of 2 failed")
    assert json.dumps(node.to_json()) == json.dumps({"group": 1, "state": "busy", "restarts": 2, "jobs": ["video_a"],
                                                     "pids": [11, 12], "last_failure": "rank 1 of 2 failed"})
    assert json.dumps(GroupStatus(0, GroupState.LOADING).to_json()) == \
        '{"group": 0, "state": "loading", "restarts": 0, "jobs": [], "pids": []}'
    fleet = GroupStatus(0, GroupState.BUSY, jobs=["video_b"], pids=[22], replica_state="RUNNING", replica="h:22")
    assert list(fleet.to_json()) == ["group", "state", "restarts", "jobs", "pids", "replica_state", "replica"]
    replica = GroupStatus(0, "serving", last_failure="x", replica="h:22")  # a worker replica's own groups
    assert list(replica.to_json()) == ["group", "state", "restarts", "jobs", "pids", "last_failure", "replica"]
    for status in (node, fleet, replica, GroupStatus(3, "stopped")):
        assert GroupStatus.from_json(json.loads(json.dumps(status.to_json()))) == status


def test_a_groups_state_is_its_member_and_knows_whether_it_serves():
    status = GroupStatus(0, "restarting")
    assert status.state is GroupState.RESTARTING and status.state == "restarting"
    assert [s.value for s in GroupState if s.serves] == ["serving", "busy"]
    with pytest.raises(ValueError):
        GroupStatus(0, "asleep")


# --- the supervisor, over a fake rank group ----------------------------------------------------------------------------

class Script:
    """What the fake ranks do, shared by every group a test starts: `die` (job id -> the rank that is killed while it
    runs that job, once), `die_loading` (ranks killed before they load), and what they received."""

    def __init__(self, die=None, die_loading=()):
        self.die, self.die_loading = dict(die or {}), set(die_loading)
        self.received: list[tuple[int, int, object]] = []  # (group, rank, message)
        self.lock = threading.Lock()


class ThreadRanks:
    """A RankGroup of threads (Workers' `rank_group`): each rank's thread keeps a duplicate of its end of the pipe (the
    launcher closes its copy of the children's ends once they started, as after spawning), says Ready, and answers as
    jobs/rank.py's loop does: the group's first rank reports each job started then done, then Idle; Stop ends it.
    The ranks meet at a barrier per job, as at a collective: a rank the script kills closes its pipe and counts as
    died (signal 9), as a killed process would, and its peers fail at the barrier (connection reset)."""

    pids = iter(range(5000, 10**6))

    def __init__(self, fn, world, args_of, gpus=None, first_gpu=0):
        self.world, self.exitcodes, self._stop = world, [None] * world, threading.Event()
        self._collective = threading.Barrier(world)
        self.procs = [SimpleNamespace(pid=next(self.pids)) for _ in range(world)]
        self.sentinels = []  # the launcher polls (POLL_S) instead
        for rank in range(world):
            conn, _, group = args_of(rank)
            mine = Connection(os.dup(conn.fileno()))
            threading.Thread(target=self._rank, args=(rank, group, mine), daemon=True).start()

    def _rank(self, rank: int, group: int, conn: Connection) -> None:
        script = SCRIPT
        try:
            if rank in script.die_loading:
                return self._died(rank)
            conn.send(Ready(rank))
            while not self._stop.is_set():
                if not conn.poll(0.02):
                    continue
                message = conn.recv()
                with script.lock:
                    script.received.append((group, rank, message))
                if isinstance(message, Stop):
                    self.exitcodes[rank] = 0
                    return
                if isinstance(message, Work):
                    for job in message.jobs:
                        if rank == 0:
                            conn.send(Report(Event(job.id, "started", group=group, attempt=job.attempt)))
                        with script.lock:
                            killed = script.die.get(job.id) == rank and script.die.pop(job.id) is not None
                        if killed:
                            self._collective.abort()
                            return self._died(rank)
                        try:
                            self._collective.wait(5)
                        except threading.BrokenBarrierError:
                            self.exitcodes[rank] = 1
                            return
                        if rank == 0:
                            conn.send(Report(Event(job.id, "done", "done", 100, record=ClipRecord(id=job.id),
                                                   group=group, attempt=job.attempt)))
                    if rank == 0:
                        conn.send(Idle())
        except (OSError, EOFError):  # the launcher stopped the group and closed its ends
            pass
        finally:
            conn.close()

    def _died(self, rank: int) -> None:
        self.exitcodes[rank] = -9

    def failure(self):
        dead = sorted((code != -9, r) for r, code in enumerate(self.exitcodes) if code not in (None, 0))
        if not dead:
            return None
        return Failure(dead[0][1], self.world, "it died (signal 9)", True, tuple(r for _, r in dead[1:]))

    def finished(self) -> bool:
        return all(code == 0 for code in self.exitcodes)

    def stop(self) -> None:
        self._stop.set()


SCRIPT = Script()


class MemoryQueue:
    """A JobQueue in memory: the jobs in order, then None (no more work); a lost job that died runs again."""

    def __init__(self, n: int):
        self.waiting = deque(Job(f"job{i}", None, Path(f"job{i}.mp4"), attempt=1) for i in range(n))
        self.events: list[Event] = []
        self.lost_calls: list[tuple[int, list[str], str, bool]] = []
        self.cancel: set[str] = set()

    def take(self, group, limit):
        return [self.waiting.popleft()] if self.waiting else None if not self.running() else []

    def running(self) -> set[str]:
        started = {e.job for e in self.events if e.kind == "started"}
        return started - {e.job for e in self.events if e.ends} - {j for _, jobs, _, _ in self.lost_calls for j in jobs}

    def report(self, event):
        self.events.append(event)

    def lost(self, group, jobs, reason, died):
        self.lost_calls.append((group, [j.id for j in jobs], reason, died))
        self.waiting.extend(jobs)

    def cancels(self):
        return sorted(self.cancel)


def supervise(queue, groups=2, size=2, script=None, fatal=False, logged=None):
    global SCRIPT
    SCRIPT = script or Script()
    spec = SimpleNamespace(mesh=SimpleNamespace(replica=groups), group_size=size, max_batch=1)
    return Workers(spec, queue, None, load_failures_fatal=fatal, rank_group=ThreadRanks,
                   log=(logged.append if logged is not None else lambda m: None))


def run_in_thread(workers: Workers, timeout: float = 20) -> None:
    thread = threading.Thread(target=workers.run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "Workers.run did not return"


def test_the_groups_serve_every_job_once_and_stop_when_the_queue_has_no_more():
    queue = MemoryQueue(5)
    workers = supervise(queue)
    run_in_thread(workers)
    done = [e.job for e in queue.events if e.kind == "done"]
    assert sorted(done) == [f"job{i}" for i in range(5)] and len(done) == 5
    assert {e.group for e in queue.events} == {0, 1}  # both groups took work
    assert [s.state for s in workers.status()] == ["stopped", "stopped"] and queue.lost_calls == []
    # every rank of a group received the same work, and a Stop at the end
    work = [(g, r, tuple(j.id for j in m.jobs)) for g, r, m in SCRIPT.received if isinstance(m, Work)]
    assert sorted(x for g, r, x in work if r == 0) == sorted(x for g, r, x in work if r == 1)
    assert sum(isinstance(m, Stop) for _, _, m in SCRIPT.received) == 4


def test_a_group_whose_rank_dies_mid_job_gives_it_back_and_serves_again_after_a_restart():
    queue, logged = MemoryQueue(3), []
    workers = supervise(queue, groups=1, script=Script(die={"job1": 1}), logged=logged)
    run_in_thread(workers)
    assert queue.lost_calls == [(0, ["job1"], "it died (signal 9)", True)]
    assert sorted(e.job for e in queue.events if e.kind == "done") == ["job0", "job1", "job2"]
    [status] = workers.status()
    assert (status.state, status.restarts) == ("stopped", 1)
    assert status.last_failure.startswith("replica group 0: rank 1 of 2 failed: it died (signal 9)")  # its peer next
    assert any("restarting the group (it held job1)" in m for m in logged)
    assert any("serves again (restart 1)" in m for m in logged)


def test_a_group_that_cannot_load_is_fatal_to_a_run_front_door():
    workers = supervise(MemoryQueue(1), groups=1, script=Script(die_loading={1}), fatal=True)
    with pytest.raises(RankFailed, match="rank 1 of 2 failed: it died"):
        workers.run()


def up(workers: Workers, g) -> None:
    """Read group `g`'s Ready messages until it is up (its ranks started)."""
    deadline = time.monotonic() + 5
    while not g.up and time.monotonic() < deadline:
        workers._read_messages()
        time.sleep(0.01)
    assert g.up


def test_a_cancel_reaches_every_rank_of_the_group_that_holds_the_job_once():
    queue = MemoryQueue(0)
    workers = supervise(queue, groups=2)
    group = workers.groups[0]
    workers._start(group)
    up(workers, group)
    group.holding = {"slow": Job("slow", None, Path("slow.mp4"))}  # as if group 0 ran it
    queue.cancel = {"slow", "elsewhere"}
    workers._forward_cancels()
    workers._forward_cancels()  # asked again on the next pass: sent once
    deadline = time.monotonic() + 5
    while len(SCRIPT.received) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert sorted((g, r, m) for g, r, m in SCRIPT.received) == [(0, 0, Cancel("slow")), (0, 1, Cancel("slow"))]
    workers._kill(group)


def test_status_follows_a_group_from_loading_to_serving_to_busy():
    queue = MemoryQueue(0)
    workers = supervise(queue, groups=1)
    [g] = workers.groups
    assert workers.status()[0].state == "restarting"  # not started yet: no ranks
    workers._start(g)
    assert workers.status()[0].state == "loading" and len(workers.status()[0].pids) == 2
    up(workers, g)
    assert workers.status()[0].state == "serving" and workers.serving() == 1
    queue.waiting.append(Job("j", None, Path("j.mp4")))
    workers._hand_out_work()
    assert workers.status()[0].state == "busy" and workers.status()[0].jobs == ("j",)
    workers._kill(g)
