"""Proof that serving compiles nothing: while `no_compile()` is active, any entry into Inductor's compiler, the C++
builder or Triton's compiler raises `CompilerInvoked`. `h3trt run --engine` runs every request under it.

A bundle carries its compiled segments, and its load compiles and warms every kernel it serves besides them (the
block-sparse kernels and the router, models/sparse/run.py warm_sparse), so a compile at a request is a bug in h3trt,
not in the bundle: the message says what compiled and from where, and asks for a report instead of a rebuild (which
would not help: the H100 smoke's sparse bundle had been built on that image a minute before)."""

from __future__ import annotations

import traceback
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

PACKAGE = Path(__file__).resolve().parents[1]  # h3trt/


class CompilerInvoked(RuntimeError):
    """A compiler ran while serving from a bundle: a kernel the load should have compiled and warmed was not."""


def compiled_subject(args) -> str:
    """What a compiler entry point was asked to compile, from its arguments: a Triton kernel's name, or the ops of
    the FX graph Inductor got (the first few, by name)."""
    for arg in args:
        fn = getattr(arg, "fn", None)  # a Triton JITFunction (the method's self) or an ASTSource
        if fn is not None and hasattr(fn, "__name__"):
            return f"the Triton kernel {fn.__name__}"
        graph = getattr(arg, "graph", None)
        if graph is not None and hasattr(graph, "nodes"):
            ops = []
            for node in graph.nodes:
                name = getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else None
                if name and name not in ops:
                    ops.append(name)
            return f"a graph of {', '.join(ops[:6]) or 'no ops'}{', ...' if len(ops) > 6 else ''}"
    return "an unnamed input"


def calling_frame() -> str:
    """The innermost h3trt frame outside this module that led to the compile (file:line function), or ''."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        if path.is_relative_to(PACKAGE) and path.name != "guard.py":
            return f"{path.relative_to(PACKAGE.parent)}:{frame.lineno} {frame.name}"
    return ""


def _refuse(what: str):
    def refuse(*args, **kwargs):
        where = calling_frame()
        raise CompilerInvoked(f"{what} was invoked while serving from a bundle, compiling {compiled_subject(args)}"
                              f"{f' (called from {where})' if where else ''}. A bundle's load compiles and warms "
                              "every kernel it serves, so this is a bug in h3trt, not in the bundle: please report it "
                              "with this message (rebuilding the bundle will not help).")
    return refuse


def _targets() -> list[tuple[str, str]]:
    targets = [
        ("torch._inductor.compile_fx.compile_fx", "Inductor compile_fx"),
        ("torch._inductor.compile_fx.compile_fx_inner", "Inductor compile_fx_inner"),
        ("torch._inductor.standalone_compile", "Inductor standalone_compile"),
        ("torch._inductor.cpp_builder.CppBuilder.build", "the C++ compiler (Inductor CppBuilder)"),
        ("torch._inductor.aoti_compile_and_package", "AOTInductor compile"),
    ]
    try:
        import triton  # noqa: F401

        # A JITFunction binds triton.compiler.compile when it first runs (at the load's warm-up), so patching that
        # name later misses it: its cache-miss path, _do_compile, is what a kernel not warmed goes through.
        targets += [("triton.compile", "Triton compile"), ("triton.compiler.compile", "Triton compile"),
                    ("triton.runtime.jit.JITFunction._do_compile", "Triton's JIT compile")]
    except ImportError:
        pass
    return targets


@contextmanager
def no_compile():
    # The patch targets, imported here rather than with this module: compile_fx pulls in most of Inductor, which an
    # eager run never needs.
    import torch._inductor.codecache  # noqa: F401  (import the targets before patching them)
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.cpp_builder  # noqa: F401

    with ExitStack() as stack:
        for target, what in _targets():
            stack.enter_context(mock.patch(target, _refuse(what)))
        yield
