"""Proof that serving compiles nothing: while `no_compile()` is active, any entry into Inductor's compiler, the C++
builder or Triton's compiler raises `CompilerInvoked`. `h3trt run --engine` runs every request under it."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from unittest import mock


class CompilerInvoked(RuntimeError):
    """A compiler ran while serving from a bundle: the bundle is missing compiled code it should carry."""


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise CompilerInvoked(f"{what} was invoked while serving from a bundle; everything must be compiled by "
                              "`h3trt build`. Rebuild the bundle on this image.")
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

        targets += [("triton.compile", "Triton compile"), ("triton.compiler.compile", "Triton compile")]
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
