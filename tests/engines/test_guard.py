"""The no-compile guard (h3trt/engines/guard.py) a bundle serves under: every compiler entry raises, and the message
says what compiled and from where, and that it is a bug to report (a bundle's load warms all it serves), not that
the bundle needs rebuilding. The H100 smoke's sparse bundle was refused with "Rebuild the bundle on this image" a
minute after it was built on that image."""

import pytest
import torch

from h3trt.engines.guard import CompilerInvoked, no_compile


def message_of(error: BaseException) -> str:
    """The CompilerInvoked text, whether raised as is or wrapped by Dynamo (BackendCompilerFailed)."""
    while error is not None and not isinstance(error, CompilerInvoked):
        error = error.__cause__ or error.__context__
    assert error is not None, "no CompilerInvoked in the chain"
    return str(error)


def test_an_inductor_compile_names_the_graph_and_the_h3trt_caller_and_asks_for_a_report():
    from h3trt.models.sparse.kernels import flex_sparse_attention

    q = k = v = torch.randn(1, 256, 2, 16)
    index = torch.zeros(1, 2, 2, 1, dtype=torch.int32)
    with no_compile(), pytest.raises(Exception) as info:
        flex_sparse_attention(q, k, v, index, torch.ones(2, dtype=torch.bool), 128, compiled=True)
    text = message_of(info.value)
    assert text.startswith("Inductor compile_fx") and "flex_attention" in text, text
    assert "h3trt/models/sparse/kernels.py:" in text and "flex_sparse_attention" in text, text
    assert "a bug in h3trt" in text and "please report it" in text and "Rebuild the bundle" not in text


def test_a_triton_jit_compile_after_the_warm_up_names_the_kernel():
    """A JITFunction binds triton's compile at its first run, so the guard patches its cache-miss path."""
    triton = pytest.importorskip("triton")

    @triton.jit
    def _unwarmed(x_ptr):
        pass

    with no_compile(), pytest.raises(CompilerInvoked, match=r"Triton's JIT compile .* the Triton kernel _unwarmed"):
        _unwarmed._do_compile(None, None, None, None, None, None, False)
