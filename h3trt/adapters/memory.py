"""What adapter slots (slots.py) take in memory, and whether they fit where they will live: `h3trt build
--lora-slots N --lora-max-rank R` and `h3trt serve`'s slots (its flags, or the shape fitted to the adapters at start)
are checked here before anything loads, in one line naming the largest value that fits. Without it, 100000 x 100000
slots were a 7.68 TB allocation: a build's traceback, a server's group failing and restarting for good.

Every adapted linear of every block holds N x parts x R x in values (the down factors) and N x R x out (the up
factors): the bytes grow as N x R. The slots alone must fit in the memory of the device that holds them (a GPU's, or
the host's on the CPU); the model's weights need room too, which this bound does not promise.
"""

from __future__ import annotations

import os

import torch

from ..errors import UserError
from ..models.config import H3Config
from .slots import BLOCK_TARGETS, target_shape


def unit_bytes(cfg: H3Config, targets: tuple[str, ...] = BLOCK_TARGETS, dtype: torch.dtype = torch.bfloat16) -> int:
    """The bytes of one slot of rank 1 over every block's `targets`: N slots of rank R take N x R times this."""
    per_block = 0
    for local in targets:
        n_in, n_out, parts = target_shape(cfg, local)
        per_block += parts * n_in + n_out
    return cfg.num_layers * per_block * dtype.itemsize


def memory_of(device: str | torch.device) -> tuple[int, str]:
    """(bytes, what) of the memory slots on `device` live in: the GPU's total, or the host's physical memory."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else 0
        props = torch.cuda.get_device_properties(index)
        return props.total_memory, f"cuda:{index} ({props.name})"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host"


def largest_rank(cfg: H3Config, num_slots: int, device: str | torch.device, dtype: torch.dtype = torch.bfloat16,
                 targets: tuple[str, ...] = BLOCK_TARGETS) -> int:
    """The largest max rank `num_slots` slots may have on `device` (0: not even rank 1)."""
    return memory_of(device)[0] // (num_slots * unit_bytes(cfg, targets, dtype))


def check_slots_fit(cfg: H3Config, num_slots: int, max_rank: int, device: str | torch.device,
                    dtype: torch.dtype = torch.bfloat16, targets: tuple[str, ...] = BLOCK_TARGETS,
                    what: str | None = None, memory: tuple[int, str] | None = None) -> None:
    """UserError unless `num_slots` slots of rank `max_rank` fit in `device`'s memory (`memory`: (bytes, what), for
    tests), naming the largest --lora-slots at this rank and the largest --lora-max-rank at this count. `what`: how
    the caller's user set them (default: the flags)."""
    unit = unit_bytes(cfg, targets, dtype)
    need = num_slots * max_rank * unit
    have, where = memory if memory is not None else memory_of(device)
    if need <= have:
        return
    what = what or f"--lora-slots {num_slots} --lora-max-rank {max_rank}"
    most_slots, most_rank = have // (max_rank * unit), have // (num_slots * unit)
    fits = [f"--lora-slots {most_slots} at --lora-max-rank {max_rank}" if most_slots else
            f"no slot of rank {max_rank}",
            f"--lora-max-rank {most_rank} at --lora-slots {num_slots}" if most_rank else
            f"no rank at --lora-slots {num_slots}"]
    dtype_name = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))
    raise UserError(f"{what}: the slots take {_size(need)} ({num_slots} x {max_rank} x {_size(unit)} in {dtype_name}), "
                    f"more than the {_size(have)} of {where}; the largest that fit: {fits[0]}, or {fits[1]}.")


def _size(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"
