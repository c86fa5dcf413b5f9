"""Which GPU each rank serves on (h3trt/parallel/devices.py): its own GPU is its cuda:0, the peers stay visible.

No GPU is needed: the rule is a function of CUDA_VISIBLE_DEVICES, LOCAL_RANK and the launcher, and the tests read
what each process would hand CUDA (self-launched: real spawned ranks; torchrun: a real `h3trt run` process whose
first CUDA query is intercepted)."""

import json
import os
import subprocess
import sys

import pytest

from h3trt.parallel.devices import (DeviceMappingError, cuda_index, node_gpus, own_first, parse_visible, pin_own_gpu,
                                    torchrun_local_rank)
from h3trt.parallel.launch import launch


@pytest.mark.parametrize("value, entries", [
    (None, None), ("", []), ("0,1", ["0", "1"]), (" 4, 5 ,6", ["4", "5", "6"]),
    ("GPU-1f2e,GPU-9a8b", ["GPU-1f2e", "GPU-9a8b"]), ("0,,1", ["0"]),  # CUDA stops at the first invalid entry
])
def test_visible_list_is_read_as_cuda_reads_it(value, entries):
    assert parse_visible(value) == entries


@pytest.mark.parametrize("visible", [["0", "1"], ["0", "1", "2", "3", "4", "5", "6", "7"], ["4", "5", "6", "7"],
                                     ["GPU-a", "GPU-b", "GPU-c"]])
def test_every_rank_gets_its_own_gpu_first_and_keeps_every_peer(visible):
    seen_first = []
    for rank in range(len(visible)):
        order = own_first(visible, rank)
        assert order[0] == visible[rank]  # the rank's cuda:0
        assert sorted(order) == sorted(visible)  # every peer still visible (NCCL keeps P2P/NVLink)
        assert order[1:] == [g for g in visible if g != visible[rank]]  # peers in their order
        seen_first.append(order[0])
    assert seen_first == visible  # one GPU per rank, none shared


def test_a_user_restricted_node_maps_inside_the_users_list():
    # CUDA_VISIBLE_DEVICES=4,5,6,7 and 4 ranks: rank 1 runs on physical GPU 5.
    assert [own_first(["4", "5", "6", "7"], r) for r in range(4)] == [
        ["4", "5", "6", "7"], ["5", "4", "6", "7"], ["6", "4", "5", "7"], ["7", "4", "5", "6"]]


def test_a_launcher_that_isolates_gpus_is_respected():
    # SLURM-style: each process already sees exactly its GPU, whatever LOCAL_RANK says.
    assert own_first(["3"], 5) == ["3"]


def test_more_ranks_than_gpus_is_refused_with_the_count():
    with pytest.raises(DeviceMappingError, match=r"local rank 2 needs GPU #2, but 2 GPU\(s\) are visible "
                                                 r"\(CUDA_VISIBLE_DEVICES=4,5\)"):
        own_first(["4", "5"], 2)


def test_pin_rewrites_the_environment_it_is_given(monkeypatch):
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert pin_own_gpu(2, env) == "6,4,5,7" and env["CUDA_VISIBLE_DEVICES"] == "6,4,5,7"
    import torch

    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 8)  # unset: every GPU NVML counts
    env = {}
    assert pin_own_gpu(3, env) == "3,0,1,2,4,5,6,7"
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)  # a CPU machine: nothing to choose
    env = {}
    assert pin_own_gpu(1, env) is None and env == {}
    assert node_gpus({}) is None
    with pytest.raises(DeviceMappingError, match="is empty"):
        pin_own_gpu(0, {"CUDA_VISIBLE_DEVICES": ""})


def test_torchrun_and_device_strings():
    base = {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
    assert torchrun_local_rank({**base, "LOCAL_RANK": "1"}) == 1
    assert torchrun_local_rank(base) is None
    assert cuda_index("cuda:3") == 3 and cuda_index("cuda") is None and cuda_index("cpu") is None
    with pytest.raises(DeviceMappingError, match="expected cuda, cuda:N"):
        cuda_index("cuda:x")


def _record_visible(rank, world, store, out):
    (out / f"{rank}.txt").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))


@pytest.mark.multiproc
@pytest.mark.parametrize("world, visible", [(2, ["0", "1"]), (4, ["4", "5", "6", "7"])])
def test_self_launched_ranks_start_with_their_own_gpu_first(tmp_path, world, visible):
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    launch(_record_visible, world, (tmp_path,), gpus=visible)
    seen = [(tmp_path / f"{r}.txt").read_text() for r in range(world)]
    assert seen == [",".join(own_first(visible, r)) for r in range(world)]
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before  # the parent's own view is untouched


# A real `h3trt run` process whose first CUDA query prints what CUDA would see and stops it: the GPU must be chosen
# before that query (CUDA reads CUDA_VISIBLE_DEVICES once, when it initialises).
_PROBE = """
import json, os, sys, torch
def first_cuda_query(*a, **k):
    print(json.dumps({"visible": os.environ.get("CUDA_VISIBLE_DEVICES")}))
    sys.stdout.flush()
    os._exit(0)
torch.cuda.is_available = torch.cuda.device_count = torch.cuda._lazy_init = first_cuda_query
torch.cuda._device_count_nvml = lambda: 8
from h3trt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _first_cuda_view(tmp_path, env_extra: dict, *args: str):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", _PROBE, "run", "--prompt", "p", "--output",
                          str(tmp_path / "c.mp4"), *args], env=env, capture_output=True, text=True, timeout=120)
    return out


TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


@pytest.mark.parametrize("visible, local_rank, expected", [
    (None, "1", "1,0,2,3,4,5,6,7"),  # all 8 GPUs visible (NVML count), LOCAL_RANK 1
    ("4,5,6,7", "3", "7,4,5,6"),  # the user restricted the node
    ("2", "1", "2"),  # a launcher that gives each process one GPU
])
def test_a_torchrun_rank_chooses_its_gpu_before_cuda_starts(tmp_path, tiny_cache, visible, local_rank, expected):
    env = {**TORCHRUN, "LOCAL_RANK": local_rank, "XDG_CACHE_HOME": str(tiny_cache)}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    out = _first_cuda_view(tmp_path, env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"visible": expected}


def test_device_cuda_n_makes_that_gpu_the_process_cuda0(tmp_path, tiny_cache):
    out = _first_cuda_view(tmp_path, {"CUDA_VISIBLE_DEVICES": "4,5,6", "XDG_CACHE_HOME": str(tiny_cache)},
                           "--device", "cuda:2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"visible": "6,4,5"}


def test_one_gpu_named_on_a_mesh_is_refused(tmp_path, tiny_cache):
    out = _first_cuda_view(tmp_path, {"XDG_CACHE_HOME": str(tiny_cache)}, "--gpus", "2", "--device", "cuda:1")
    assert out.returncode == 2
    assert "names one GPU, but on a mesh each rank takes its own" in out.stderr


def test_a_bundle_refuses_a_device_other_than_cuda0():
    import torch

    from h3trt.engines.load_checks import check_process_gpu
    from h3trt.engines.manifest import BundleError

    check_process_gpu(torch.device("cpu"))
    check_process_gpu(torch.device("cuda", 0))
    with pytest.raises(BundleError, match="serves on its process's cuda:0, not cuda:1"):
        check_process_gpu(torch.device("cuda", 1))
