"""Self-launched local ranks that never hang: if one rank raises or dies, every rank is ended and the parent raises
one error naming the rank and its reason.

Bounds: a rank's death is seen within POLL_S; the others get SIGTERM, then SIGKILL after GRACE_S. A rank stuck in a
collective whose peer died fails by itself when the process-group timeout (COLLECTIVE_TIMEOUT_S) expires.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..paths import use_bytecode_cache
from .leftovers import LAUNCH_PREFIX, owned_temp_dir
from .devices import VISIBLE, own_first

POLL_S = 0.2
GRACE_S = 5.0
COLLECTIVE_TIMEOUT_S = 60


class RankFailed(RuntimeError):
    """A local rank raised or died; every other rank was ended."""


def init_rank(rank: int, world: int, store: str, device_type: str) -> None:
    """Join the process group: gloo on the CPU, NCCL on GPUs (one per rank: the rank's own GPU is its cuda:0, see
    h3trt/parallel/devices.py), with a bounded collective timeout."""
    if device_type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun (or any launcher setting its environment) started this process."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])


def init_torchrun_rank(device_type: str) -> tuple[int, int, int]:
    """Join the process group torchrun describes (any number of nodes), with the same bounded collective timeout.
    A rank that raises exits non-zero and torchrun stops the others; a rank stuck on a dead peer times out."""
    rank, world, local_rank = torchrun_rank()
    if device_type == "cuda":
        # cli.main made GPU #local_rank this process's cuda:0 before CUDA started (h3trt/parallel/devices.py).
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method="env://", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return rank, world, local_rank


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this process (SIGKILL) when the thread that started it exits, so a launcher killed
    outright (SIGKILL, OOM) leaves no rank running on its own. Elsewhere a no-op. A parent already gone by now (the
    race before prctl) ends this process at once."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


GROUP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def leave_launchers_group() -> None:
    """A rank's lifetime is its launcher's: SIGTERM or Ctrl-C sent to the launcher's whole process group must not
    kill a rank on its own (a server then drains: its running job finishes; `run` stops every rank and removes what
    they wrote). The rank started with those signals blocked (RankGroup); it moves to a process group of its own,
    drops what reached it meanwhile (all of it meant for the group), ignores SIGINT and unblocks SIGTERM, which from
    now on only its launcher sends (stop). It still dies with its launcher (die_with_parent)."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while signal.sigtimedwait(GROUP_SIGNALS, 0) is not None:
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)


def _entry(fn: Callable, rank: int, world: int, store: str, error_dir: str, args: tuple, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    leave_launchers_group()
    use_bytecode_cache()  # a rank's imports from here on (the model, Inductor) are kept for the next start
    try:
        fn(rank, world, store, *args)
        if dist.is_initialized():
            # Leave together: a process exiting with live gloo/NCCL threads aborts (SIGABRT) at shutdown.
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as e:  # record why, then die non-zero so the parent ends the others
        Path(error_dir, f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        os._exit(1)


@dataclass(frozen=True)
class Failure:
    """Why a group of ranks stopped: the first rank that failed, in its own words when it left any."""

    rank: int
    world: int
    reason: str  # the rank's error line, or how it died
    died: bool  # killed or exited without a word (a signal, the OOM killer): not an error of the work it held
    others: tuple[int, ...] = ()  # ranks that failed after it (their peer was gone)
    details: str = ""  # the rank's traceback, when it raised

    def message(self) -> str:
        also = (f" (then rank{'s' if len(self.others) > 1 else ''} {list(self.others)} failed with it)"
                if self.others else "")
        return f"rank {self.rank} of {self.world} failed: {self.reason}{also}"


class RankGroup:
    """`world` spawned processes of one process group, started together, watched without blocking, and stopped
    together. Rank r runs fn(rank, world, store, *args_of(r)).

    gpus: the node's visible GPUs (parallel.devices.node_gpus) when the ranks serve on CUDA; rank r takes GPU
    #(first_gpu + r), put first in its CUDA_VISIBLE_DEVICES so it is the rank's cuda:0 while the peers stay visible to
    NCCL. Started from a thread that outlives the group: a rank dies with the thread that spawned it
    (die_with_parent)."""

    def __init__(self, fn: Callable, world: int, args_of: Callable[[int], tuple] = lambda rank: (),
                 gpus: list[str] | None = None, first_gpu: int = 0):
        ctx = mp.get_context("spawn")
        self.world = world
        self.work = str(owned_temp_dir(LAUNCH_PREFIX))  # named by host and pid: swept once this process is gone
        store = os.path.join(self.work, "store")
        self.procs = [ctx.Process(target=_entry, args=(fn, r, world, store, self.work, args_of(r), os.getpid()))
                      for r in range(world)]
        parent_visible = os.environ.get(VISIBLE)
        # A signal to the launcher's process group (systemd's KillMode=control-group, a terminal's Ctrl-C) is the
        # launcher's to handle: a rank starts with SIGTERM and SIGINT blocked (the mask survives exec) and leaves the
        # group before it unblocks them (_entry), so none dies of a signal meant for its launcher.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
        try:
            for r, p in enumerate(self.procs):
                if gpus is not None:
                    # A spawned child copies the parent's environment when it starts, before it imports torch.
                    os.environ[VISIBLE] = ",".join(own_first(gpus, first_gpu + r))
                p.start()
        except BaseException:
            self.stop()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            if parent_visible is None:
                os.environ.pop(VISIBLE, None)
            else:
                os.environ[VISIBLE] = parent_visible

    @property
    def sentinels(self) -> list:
        """Waitable handles (multiprocessing.connection.wait) that become ready when a rank exits."""
        return [p.sentinel for p in self.procs]

    def failure(self) -> Failure | None:
        """The first rank that failed, if one has: the root cause first (a rank that died without a word, else the
        earliest recorded error); peers of a failed rank fail too (connection reset) and are named as consequences."""
        failed = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode not in (None, 0)]
        if not failed:
            return None

        def when(item):
            f = Path(self.work, f"rank{item[0]}.err")
            return f.stat().st_mtime if f.exists() else float("-inf")

        failed.sort(key=when)
        rank, code = failed[0]
        note = Path(self.work, f"rank{rank}.err")
        text = note.read_text() if note.exists() else ""
        reason = (text.split("\n", 1)[0] if text else f"it died (signal {-code})" if code < 0
                  else f"it exited with status {code}")
        return Failure(rank, self.world, reason, not text, tuple(r for r, _ in failed[1:]), text)

    def finished(self) -> bool:
        """Every rank exited 0."""
        return all(p.exitcode == 0 for p in self.procs)

    def stop(self) -> None:
        """End every rank still running (SIGTERM, then SIGKILL after GRACE_S) and remove the rendezvous files."""
        _stop(self.procs)
        shutil.rmtree(self.work, ignore_errors=True)  # the rendezvous store and the ranks' error notes


def launch(fn: Callable, world: int, args: tuple = (), gpus: list[str] | None = None) -> None:
    """Run fn(rank, world, store, *args) in `world` spawned processes; return when all succeed, raise RankFailed
    (every rank stopped) when one raises or dies."""
    group = RankGroup(fn, world, lambda rank: args, gpus)
    try:
        while True:
            failure = group.failure()
            if failure is not None:
                raise RankFailed(f"{failure.message()}. Every rank was stopped; no output was written.")
            if group.finished():
                return
            time.sleep(POLL_S)
    finally:
        group.stop()


def _stop(procs) -> None:
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
