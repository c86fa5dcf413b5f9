"""Which GPU a process runs on: a rank's own GPU is always its cuda:0.

Why this way: Inductor's saved wrapper code names the device it was compiled on (`_DeviceGuard(0)`,
`get_raw_stream(0)` in torch 2.11's generated Python), so a bundle compiled on cuda:0 launches its kernels on device 0
of whichever process loads it; a rank serving on cuda:1 failed with "CUDA driver error: invalid argument". Two fixes
were possible:
  - rewrite the loaded code to be device-agnostic: that patches generated code of one torch version (PyTorch's own
    fix, pytorch/pytorch#187870, lands after the 2.11 our GPU image runs) and every backend would need its own patch;
  - make every rank's own GPU its cuda:0 by reordering CUDA_VISIBLE_DEVICES before CUDA initialises in that process.
We do the second: it holds for every backend and torch version. Only the ORDER changes, every peer stays visible, so
NCCL still sees all the node's GPUs and keeps its NVLink/P2P paths (it identifies peers by PCI bus id, not by index).

The same rule serves every launcher: `h3trt run --gpus N` (the parent sets each child's list before it starts),
torchrun (each process reorders its own list from LOCAL_RANK before its first CUDA call), a user who restricts the
GPUs (CUDA_VISIBLE_DEVICES=4,5,6,7: rank 1 sees 5,4,6,7) and a launcher that already gives each process one GPU
(a single visible GPU is used as it is, whatever LOCAL_RANK says).
"""

from __future__ import annotations

import os
from typing import MutableMapping

from ..errors import UserError

VISIBLE = "CUDA_VISIBLE_DEVICES"


class DeviceMappingError(UserError):
    """The rank's GPU cannot be chosen (too few visible GPUs, or CUDA already initialised)."""


def parse_visible(value: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of entries (indices, GPU-/MIG- UUIDs, kept verbatim); None when unset.
    CUDA stops at the first invalid entry, so nothing after one is kept either (an empty entry is invalid)."""
    if value is None:
        return None
    entries = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry:
            break
        entries.append(entry)
    return entries


def own_first(visible: list[str], local_rank: int) -> list[str]:
    """The visible list with the rank's own GPU moved to the front, the peers after it in their order.

    `visible` is the list every local rank shares; a single entry means the launcher already gave this process its
    own GPU, and it is kept as it is."""
    if len(visible) == 1:
        return list(visible)
    if not 0 <= local_rank < len(visible):
        raise DeviceMappingError(
            f"local rank {local_rank} needs GPU #{local_rank}, but {len(visible)} GPU(s) are visible "
            f"({VISIBLE}={','.join(visible) or '<empty>'}); launch at most {len(visible)} ranks per node or make more "
            "GPUs visible.")
    return [visible[local_rank]] + visible[:local_rank] + visible[local_rank + 1:]


def node_gpus(env: MutableMapping[str, str] | None = None) -> list[str] | None:
    """The GPUs this node shows a process, without initialising CUDA: the CUDA_VISIBLE_DEVICES entries, else every
    GPU NVML counts (0..n-1); None when there are no GPUs to choose from (a CPU machine)."""
    env = os.environ if env is None else env
    visible = parse_visible(env.get(VISIBLE))
    if visible is not None:
        return visible
    import torch

    count = torch.cuda._device_count_nvml()  # NVML: does not initialise CUDA (torch.cuda.device_count() would)
    return [str(i) for i in range(count)] if count > 0 else None


def pin_own_gpu(local_rank: int, env: MutableMapping[str, str] | None = None) -> str | None:
    """Make GPU #local_rank of this node the process's cuda:0 (peers stay visible after it). Must run before CUDA
    initialises in this process; returns the new CUDA_VISIBLE_DEVICES, or None on a machine without GPUs."""
    env = os.environ if env is None else env
    import torch

    if env is os.environ and torch.cuda.is_initialized():
        raise DeviceMappingError(
            "CUDA was initialised before this rank's GPU was chosen, so its GPU cannot become its cuda:0; choose the "
            "GPU (h3trt.parallel.devices.pin_own_gpu) before any CUDA call.")
    gpus = node_gpus(env)
    if gpus is None:
        return None
    if not gpus:
        raise DeviceMappingError(f"{VISIBLE} is empty: no GPU is visible to this process.")
    value = ",".join(own_first(gpus, local_rank))
    env[VISIBLE] = value
    return value


def torchrun_local_rank(env: MutableMapping[str, str] | None = None) -> int | None:
    """LOCAL_RANK when torchrun (or a launcher setting its variables) started this process, else None."""
    env = os.environ if env is None else env
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return int(env["LOCAL_RANK"])


def cuda_index(device: str | None) -> int | None:
    """N of a `cuda:N` device string, None for `cuda`, `cpu` or nothing."""
    if device is None or not str(device).startswith("cuda:"):
        return None
    text = str(device).split(":", 1)[1]
    if not text.isdigit():
        raise DeviceMappingError(f"--device {device}: expected cuda, cuda:N (N a GPU index) or cpu.")
    return int(text)
