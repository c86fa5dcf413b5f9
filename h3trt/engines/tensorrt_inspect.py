"""A bundle's ONNX graphs and TensorRT plans as polygraphy reads them: what `h3trt inspect` adds for tensorrt bundles.

polygraphy's `inspect model` through its Python API, as JSON:
  - an ONNX graph: opset, inputs and outputs (dtype, shape with the dynamic dimensions named), node and initializer
    counts. Only the structure is read; the weights (the external data file) stay on disk;
  - a plan: inputs and outputs (dtype, shape, -1 where dynamic), layers and optimization profiles. A plan deserializes
    only on a GPU it was built for, under the TensorRT version that built it (tensorrt_runtime.py); elsewhere the view
    says plainly that polygraphy could not load it, with TensorRT's reason and the bundle's plan targets.

The builder keeps no ONNX graph today (the plans embed the weights); graphs are shown when the bundle lists any.
polygraphy is optional here (the test extra pins it): without it the view says how to install it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
from pathlib import Path

import torch

from .manifest import BundleError, Manifest
from .tensorrt_runtime import check_plan_device

POLYGRAPHY_VERSION = "0.53.6"  # setup.py's test extra pins the same


def inspect_trt_bundle(root: Path, manifest: Manifest) -> dict | str | None:
    """{"version": polygraphy's, "onnx": {file: view}, "plans": {file: view} or one sentence} for the bundle's ONNX
    graphs and TensorRT plans; a sentence saying how to install polygraphy where it is missing; None when the bundle
    has neither (every bundle but a tensorrt one). JSON-able: `h3trt inspect` prints it under "polygraphy"."""
    graphs = sorted(rel for rel in manifest.files if rel.endswith(".onnx"))
    plans = [f"segments/{e['artifact']}" for e in manifest.segments.values()] if manifest.backend == "tensorrt" else []
    if not graphs and not plans:
        return None
    try:
        import polygraphy
    except ImportError:
        return (f"not installed: `pip install polygraphy=={POLYGRAPHY_VERSION}` shows this bundle's {len(graphs)} "
                f"ONNX graph(s) and {len(plans)} plan(s)")
    view = {"version": polygraphy.__version__}
    if plans:  # first: polygraphy binds its TensorRT module when its modules are first imported (bind_polygraphy)
        view["plans"] = plan_views(root, plans, manifest.tensorrt)
    if graphs:
        view["onnx"] = {rel: _or_error(onnx_view, root / rel) for rel in graphs}
    return view


def onnx_view(path: Path) -> dict:
    """polygraphy's view of one ONNX graph (its structure; the external data is not read)."""
    from polygraphy.backend.onnx import onnx_from_path
    from polygraphy.backend.onnx import util as onnx_util

    with _polygraphy_log():
        model = onnx_from_path(str(path), ignore_external_data=True)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    return {"opset": opset, "inputs": _tensors(onnx_util.get_input_metadata(model.graph)),
            "outputs": _tensors(onnx_util.get_output_metadata(model.graph)), "nodes": onnx_util.get_num_nodes(model),
            "initializers": len(model.graph.initializer)}


def plan_views(root: Path, plans: list[str], trt_info: dict) -> dict | str:
    """{plan: polygraphy's view} for every plan, or one sentence saying why polygraphy could not load the first (the
    others would fail alike: same flavour, version and targets)."""
    flavour, version = trt_info["flavour"], trt_info["version"]
    views = {}
    for rel in plans:
        try:
            views[rel] = plan_view(root / rel, flavour)
        except Exception as err:  # noqa: BLE001 -- reported, not hidden: the view is the message
            if views:
                views[rel] = f"polygraphy could not load it: {err}"
                continue
            try:
                check_plan_device(trt_info, torch.device("cuda"))
                where = ""
            except BundleError as why:
                where = f" {why}"
            return (f"polygraphy could not load {rel} with {flavour} {version}, so none of the {len(plans)} plans is "
                    f"shown: {str(err).rstrip('.')}.{where}")
    return views


def plan_view(path: Path, flavour: str) -> dict:
    """polygraphy's view of one plan, deserialized with the flavour that built it (raises where it cannot be)."""
    bind_polygraphy(flavour)
    trt = importlib.import_module(flavour)
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.trt import loader
    from polygraphy.backend.trt import util as trt_util

    with _polygraphy_log() as log:
        try:
            engine = loader.EngineFromBytes(BytesFromPath(str(path)))()
            # polygraphy reads each tensor's format through a context, as `polygraphy inspect model` does.
            context = engine.create_execution_context()
        except Exception as err:
            # polygraphy's own message says "see log for details": the log is TensorRT's first error.
            errors = [line.removeprefix("[E] ").strip() for line in log.getvalue().splitlines()
                      if line.startswith("[E]")]
            if not errors:
                raise
            raise RuntimeError(f"{str(err).split('.')[0]} ({errors[0]})") from err
        inputs = trt_util.get_metadata_from_engine(engine, context, trt.TensorIOMode.INPUT)
        outputs = trt_util.get_metadata_from_engine(engine, context, trt.TensorIOMode.OUTPUT)
    return {"inputs": _tensors(inputs), "outputs": _tensors(outputs), "layers": engine.num_layers,
            "profiles": engine.num_optimization_profiles}


def bind_polygraphy(flavour: str) -> None:
    """Makes polygraphy read plans with `flavour`. Each polygraphy module that touches TensorRT (its loaders, its
    dtype table) picks tensorrt or tensorrt_rtx from polygraphy's config flag when it is first imported, and keeps
    it: so the flag is set before any is, and a process that loaded polygraphy for the other flavour is refused."""
    from polygraphy import config

    rtx = flavour == "tensorrt_rtx"
    loaded = sorted(m for m in sys.modules if m.startswith("polygraphy.") and m != "polygraphy.config")
    if loaded and config.USE_TENSORRT_RTX != rtx:
        raise RuntimeError(f"polygraphy was loaded for {'tensorrt_rtx' if config.USE_TENSORRT_RTX else 'tensorrt'} "
                           f"earlier in this process ({loaded[0]}); it cannot read {flavour} plans here: run "
                           "`h3trt inspect` in a fresh process")
    config.USE_TENSORRT_RTX = rtx


@contextlib.contextmanager
def _polygraphy_log():
    """polygraphy logs to stdout, which `h3trt inspect` keeps for its JSON, and TensorRT's messages come through
    it: kept aside, for the error lines a failure reports."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        yield buffer


def _tensors(metadata) -> dict[str, str]:
    """polygraphy's TensorMetadata as {name: "dtype (shape)"}, its own notation."""
    return {name: f"{meta.dtype} {tuple(meta.shape)}" for name, meta in metadata.items()}


def _or_error(view, path: Path) -> dict | str:
    try:
        return view(path)
    except Exception as err:  # noqa: BLE001 -- reported, not hidden: the view is the message
        return f"polygraphy could not read it: {err}"
