"""Backends that compile a segment ahead of time, and the loaders that run what they stored.

- inductor: `torch.export` captures the segment with its varying dimensions symbolic; `standalone_compile` compiles
  the exported graph (placeholders = the segment inputs, in order) and `CompiledArtifact.save` stores it. The
  build's Inductor cache (compiled C++ / Triton binaries) ships in the bundle, so loading compiles nothing.
- aoti: `torch.export` with named dynamic dimensions, then `aoti_compile_and_package` into a `.pt2` whose inputs are
  the segment's inputs in order.

A loaded segment is a callable taking the segment's inputs in `SegmentSpec.all_inputs` order, returning a tuple.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from ..engines.manifest import BACKENDS as MANIFEST_BACKENDS
from .segments import SegmentSpec

BACKENDS = MANIFEST_BACKENDS  # tensorrt: ONNX + plans, built by tensorrt.py, served by
# engines/tensorrt_runtime.py (not through compile_segment / load_segment)


@contextmanager
def no_duck_shapes():
    """Two dimensions that happen to be equal in the example (say V == L) must not become one symbol."""
    # torch's compiler stack (fx, Inductor) takes seconds to import: imported by the functions that compile.
    import torch.fx.experimental._config as fx_config

    old = fx_config.use_duck_shape
    fx_config.use_duck_shape = False
    try:
        yield
    finally:
        fx_config.use_duck_shape = old


# Inductor options of every build. One compile thread: a worker pool started earlier in the process would write its
# binaries to the cache folder it started with, not the bundle's. Coordinate-descent tuning stays off: it gained
# 0.6-1.1% per full-width block on the H200, but its kernels re-tune (compile Triton) when a bundle is loaded, which
# the no-compile guard refused (bench/results/dit_blocks_variants*_h200.json). Dynamic RBLOCK scaling stays off for
# the same reason: when a loaded reduction kernel uses more registers than full occupancy allows and the launch has
# more blocks than the GPU holds at once (full-size shapes only: 37,838 rows), Inductor compiles a config with half
# the RBLOCK the first time the kernel loads (`CachingAutotuner._dynamic_scale_rblock`, which its own comment says it
# cannot do ahead in a worker). The build saves its autotuners before that step, so the child's fresh-process check
# compiled Triton and was refused: both full-size builds failed so (bench/results/e2e_h200_call*). The flag is baked
# into each kernel's inductor_meta, so a load never rescales.
INDUCTOR_OPTIONS = {"compile_threads": 1, "dynamic_scale_rblock": False}


def compile_inductor(spec: SegmentSpec, example: list[torch.Tensor], path: Path, options: dict | None = None) -> dict:
    """`options` (benchmarks only: scripts/bench_vae*.py) patch Inductor's config over INDUCTOR_OPTIONS."""
    import torch._inductor.config as inductor_config  # heavy: see no_duck_shapes

    graph = export_segment(spec, example).graph_module  # placeholders are the segment inputs, in order
    with torch.no_grad(), inductor_config.patch(**{**INDUCTOR_OPTIONS, **(options or {})}):
        artifact = torch._inductor.standalone_compile(graph, list(example), dynamic_shapes="from_graph")
    # "binary" loads into the current Inductor cache (the bundle's shipped binaries); "unpacked" would make the
    # artifact folder itself the cache, where the compiled C++ is absent, and recompile at load.
    artifact.save(path=str(path), format="binary")
    return {"artifact": path.name}


class _Flat(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


def export_segment(spec: SegmentSpec, example: list[torch.Tensor]):
    """torch.export with the segment's named dynamic dimensions (one Dim per name, shared across inputs)."""
    dims, shapes = {}, []
    for name in spec.all_inputs:
        named = spec.dynamic.get(name)
        shapes.append({d: dims.setdefault(n, torch.export.Dim(n, min=2, max=1 << 22)) for d, n in named.items()}
                      if named else None)
    with torch.no_grad(), no_duck_shapes():
        return torch.export.export(_Flat(spec.fn), tuple(example), dynamic_shapes=(tuple(shapes),), strict=False)


def compile_aoti(spec: SegmentSpec, example: list[torch.Tensor], path: Path) -> dict:
    ep = export_segment(spec, example)
    with torch.no_grad():
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    return {"artifact": path.name}


def compile_segment(backend: str, spec: SegmentSpec, example: list[torch.Tensor], out_dir: Path,
                    options: dict | None = None) -> dict:
    if backend == "inductor":
        return compile_inductor(spec, example, out_dir / f"{spec.name}.inductor.bin", options)
    if backend == "aoti":
        return compile_aoti(spec, example, out_dir / f"{spec.name}.pt2")  # AOTI: its own defaults; no options
    raise ValueError(f"Unknown backend {backend!r}; choose one of {BACKENDS}.")
