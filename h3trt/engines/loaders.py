"""Loading a bundle's pieces: the compiled segments (each behind one callable interface, whichever backend compiled
it), the bundle's shipped compiled-code cache, and its safetensors weight files. Used to serve a bundle and by the
builder's fresh-process check of one in the making (h3trt/build/verify.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

# Registers h3trt::fp8_sdpa, which the compiled blocks of an --fp8-attention bundle call by name: every process
# that loads segments (serving, the build's fresh-process check) must have it.
from ..calibration import fp8_attention  # noqa: F401
from ..errors import UserError
from .guard import no_compile
from .private_cache import make_private_cache, remove_leftover_caches


class LoadedSegment:
    """A compiled segment behind the one interface: call with the segment's inputs in order."""

    def __init__(self, name: str, runner):
        self.name, self.runner = name, runner

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.runner(*inputs)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)


def load_segment(backend: str, entry: dict, bundle_dir: Path, device: torch.device) -> LoadedSegment:
    path = bundle_dir / "segments" / entry["artifact"]
    if backend == "inductor":
        artifact = torch._inductor.CompiledArtifact.load(path=str(path), format="binary")
        return LoadedSegment(entry["name"], artifact)
    if backend == "aoti":
        index = device.index if device.type == "cuda" else None
        runner = torch._inductor.aoti_load_package(str(path), device_index=index if index is not None else -1)
        return LoadedSegment(entry["name"], runner)
    raise ValueError(f"Unknown backend {backend!r} in the bundle manifest.")


_ACTIVE_CACHE: dict[str, str] = {}


def activate_compiled_cache(root: Path) -> None:
    """Point Inductor at a private copy of the bundle's compiled binaries (a process-wide setting: one bundle's cache
    per process), and skip the precompiled-header step, which would run the C++ preprocessor on a cache hit. Every
    bundle load first removes the private copies that killed processes left (engines/private_cache.py)."""
    remove_leftover_caches()
    src = Path(root) / "inductor_cache"
    if not src.is_dir():
        return
    if _ACTIVE_CACHE.get("root") == str(root):
        return
    # Inductor's modules take seconds to import; only a bundle with compiled code needs them.
    import torch._inductor.codecache as codecache
    from torch._inductor.utils import clear_caches

    tmp = make_private_cache()  # removed at exit and on SIGTERM; a SIGKILLed process's by the next load
    shutil.copytree(src, tmp, dirs_exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp)
    # The C++ kernels ship compiled; Inductor would still run the preprocessor over its precompiled header on every
    # first load to checksum it. The header only matters for compiling, which a served bundle never does.
    codecache._precompile_header = _no_precompiled_header
    clear_caches()
    _ACTIVE_CACHE["root"] = str(root)


def bundle_activated() -> str | None:
    """The bundle whose compiled-code cache this process serves from, if any."""
    return _ACTIVE_CACHE.get("root")


def _no_precompiled_header(*args, **kwargs) -> str:
    return ""


def load_segments(root: Path, backend: str, entries: dict, device: torch.device) -> dict[str, LoadedSegment]:
    activate_compiled_cache(root)
    import torch._inductor.config as inductor_config

    with no_compile(), inductor_config.patch(compile_threads=load_compile_threads()):
        return {name: load_segment(backend, entry, Path(root), device) for name, entry in entries.items()}


def load_compile_threads() -> int:
    """Inductor's compile threads while segments load: TORCHINDUCTOR_COMPILE_THREADS when set, else 1. With more than
    one, Inductor starts its pool of compile workers (a process per thread, each importing torch) and hands them the
    bundle's Triton kernels that are not statically launchable; with one they load in this process."""
    value = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    try:
        return max(1, int(value)) if value else 1
    except ValueError:
        raise UserError(f"TORCHINDUCTOR_COMPILE_THREADS={value!r} is not a whole number; unset it or give the "
                        "number of Inductor compile workers.") from None


def load_weights(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in load_file(str(path)).items()}
