"""Self-launched ranks never hang: a rank that raises or dies ends every rank, within a bound, with its reason."""

import os
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from h3trt.parallel.launch import RankFailed, init_rank, launch

pytestmark = pytest.mark.multiproc

BOUND_S = 60  # the bound; the measured times are far below it


def _raises_on_rank_1(rank, world, store):
    init_rank(rank, world, store, "cpu")
    if rank == 1:
        raise ValueError("rank one cannot continue")
    dist.barrier()  # rank 0 would wait here forever without the launcher


def _dies_mid_step(rank, world, store):
    init_rank(rank, world, store, "cpu")
    x = torch.ones(4)
    dist.all_reduce(x)  # one healthy step
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(1000):  # the survivors keep stepping into collectives with a dead peer
        dist.all_reduce(x)


def _succeeds(rank, world, store, out):
    init_rank(rank, world, store, "cpu")
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    (out / f"{rank}.txt").write_text(str(x.item()))


def test_a_raising_rank_ends_the_job_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the launcher keeps its rendezvous store
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed: ValueError: rank one cannot continue"):
        launch(_raises_on_rank_1, 2)
    assert time.monotonic() - start < BOUND_S
    assert list(tmp_path.iterdir()) == []  # the temporary store is gone


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_killed_mid_step_ends_the_job(world):
    start = time.monotonic()
    with pytest.raises(RankFailed, match=rf"rank {world - 1} of {world} failed: it died \(signal 9\)"):
        launch(_dies_mid_step, world)
    assert time.monotonic() - start < BOUND_S


def test_all_ranks_succeed(tmp_path, monkeypatch):
    store = tmp_path / "tmp"
    store.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(store))
    launch(_succeeds, 3, (tmp_path,))
    assert [float((tmp_path / f"{r}.txt").read_text()) for r in range(3)] == [3.0, 3.0, 3.0]
    assert list(store.iterdir()) == []  # --gpus leaves no h3trt-launch-* folder behind
