"""The package's layers import downward only (docs/architecture.md, "The layers"):

    errors, paths, str_enum <- models <- adapters <- parallel <- calibration <- engines <- build
    engines <- request, media <- pipeline <- jobs <- run
                                            jobs <- server <- fleet <- cli
                                            jobs <- eval <- cli
                                      build, run <- cli

build never imports a floor above engines (request, media, pipeline, jobs, run), nor one of them build; request and
media, side by side under pipeline, never import each other; models imports none of the others but the base: errors
(the one user-error class, which every layer may raise), paths (where h3trt keeps its caches) and str_enum (the
vocabularies' base). Every import counts, the ones inside functions included, and no two h3trt modules may import
each other, directly or around a cycle. The checker is pure `ast` over the source files (nothing is imported), so it
runs in well under a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit

PACKAGE = REPO / "h3trt"

# layer -> the layers it may import (besides itself). `h3trt` is the package's own __init__. Every layer may import
# the base, which imports nothing: errors (the one user-error class), paths (where h3trt keeps its caches) and
# str_enum (the base of the vocabularies).
BASE = {"errors", "paths", "str_enum"}
ENGINES = BASE | {"models", "adapters", "parallel", "calibration", "engines"}  # engines and what it stands on
RUNTIME = ENGINES | {"request", "media", "pipeline", "jobs"}  # what the front doors stand on
ALLOWED = {
    "errors": set(),
    "paths": set(),
    "str_enum": set(),
    "models": BASE,
    "adapters": BASE | {"models"},
    "parallel": BASE | {"models", "adapters"},
    "calibration": BASE | {"models", "adapters", "parallel"},
    "engines": BASE | {"models", "adapters", "parallel", "calibration"},
    "build": ENGINES,
    "request": ENGINES,
    "media": ENGINES,
    "pipeline": ENGINES | {"request", "media"},
    "jobs": ENGINES | {"request", "media", "pipeline"},
    "run": RUNTIME,
    "server": RUNTIME,
    "fleet": RUNTIME | {"server"},
    "eval": RUNTIME,
    "cli": RUNTIME | {"build", "run", "server", "fleet", "eval"},
    "h3trt": set(),
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, module: str, known: set[str]) -> list[tuple[str, int]]:
    """(imported h3trt module, line) for every import statement in the file, at any depth. `from .x import y`
    resolves to the module `x.y` when that is a module, else to `x`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
        else:
            continue
        found += [(t, node.lineno) for t in targets if t == "h3trt" or t.startswith("h3trt.")]
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """{module: {imported module: first line}} over every .py file under `root`."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    graph = {}
    for module, path in files.items():
        edges: dict[str, int] = {}
        for target, line in imports_of(path, module, known):
            while target not in known and "." in target:  # `from h3trt.models.dit import X` -> h3trt.models.dit
                target = target.rpartition(".")[0]
            if target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "h3trt"


def direction_errors(graph: dict[str, dict[str, int]]) -> list[str]:
    errors = []
    for module, edges in graph.items():
        src = layer(module)
        if src not in ALLOWED:
            errors.append(f"{module}: layer {src!r} is not in the layer map; add it to ALLOWED "
                          "(and docs/architecture.md)")
            continue
        for target, line in edges.items():
            dst = layer(target)
            if dst != src and dst not in ALLOWED[src]:
                errors.append(f"{module}:{line} imports {target}: {src} may not import {dst} "
                              f"(allowed: {sorted(ALLOWED[src]) or 'none'})")
    return errors


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_layers_import_downward_only():
    graph = import_graph()
    assert len(graph) > 40 and "h3trt.parallel.ulysses" in graph and "h3trt.calibration.calibrate" in graph
    assert "h3trt.request.request" in graph and "h3trt.adapters.use" in graph  # the floors of issue 48
    assert direction_errors(graph) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_checker_catches_a_bad_import_and_a_cycle(tmp_path):
    """The same checker over a synthetic package: a models -> pipeline import, a pipeline <-> build pair, a
    function-level import and a cycle inside one layer are all reported, and a sub-package of a floor (models/sparse/)
    is that floor: its relative imports resolve from one level deeper."""
    pkg = tmp_path / "h3trt"
    for sub in ("models", "pipeline", "build", "engines"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "dit.py").write_text("from ..pipeline.h3_pipeline import H3Pipeline\n")
    (pkg / "models" / "sparse").mkdir()
    (pkg / "models" / "sparse" / "__init__.py").write_text("")
    (pkg / "models" / "sparse" / "run.py").write_text("from ..dit import Block\nfrom ...build import builder\n")
    (pkg / "pipeline" / "h3_pipeline.py").write_text("from ..models import dit\nfrom ..engines.bundle import Engine\n")
    (pkg / "build" / "builder.py").write_text("def f():\n    from h3trt.pipeline import h3_pipeline\n")
    (pkg / "engines" / "bundle.py").write_text("from . import loaders\n")
    (pkg / "engines" / "loaders.py").write_text("def g():\n    from .bundle import Engine\n")
    graph = import_graph(pkg)
    assert graph["h3trt.pipeline.h3_pipeline"] == {"h3trt.models.dit": 1, "h3trt.engines.bundle": 2}
    errors = direction_errors(graph)
    assert any("h3trt.models.dit:1 imports h3trt.pipeline.h3_pipeline: models may not import pipeline" in e
               for e in errors)
    assert any("h3trt.build.builder:2 imports h3trt.pipeline.h3_pipeline: build may not import pipeline" in e
               for e in errors)
    assert graph["h3trt.models.sparse.run"] == {"h3trt.models.dit": 1, "h3trt.build.builder": 2}
    assert any("h3trt.models.sparse.run:2 imports h3trt.build.builder: models may not import build" in e
               for e in errors)
    assert len(errors) == 3
    assert sorted(cycles(graph)) == [["h3trt.engines.bundle", "h3trt.engines.loaders"],
                                     ["h3trt.models.dit", "h3trt.pipeline.h3_pipeline"]]
