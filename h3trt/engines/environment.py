"""What compiled code is specific to, recorded in a manifest at build and checked at every load
(load_checks.py): the device's architecture and the versions of torch, CUDA, Triton and Python."""

from __future__ import annotations

import platform

import torch


def device_arch(device: torch.device) -> str:
    """What compiled code is specific to: the CUDA compute capability, or the CPU architecture."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor}"
    return f"cpu-{platform.machine()}"


def runtime_versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "python": platform.python_version()}
