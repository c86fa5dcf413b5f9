"""Block-sparse attention kernels on the CPU (h3trt/models/sparse/kernels.py): the reference kernel against dense
SDPA over exactly the kept key rows (the rows gathered by hand, no mask), dense query blocks against dense SDPA,
ragged last blocks, FlexAttention's unfused implementation (it runs eagerly on the CPU in torch 2.13) against the
reference, the op staying one opaque call under torch.export and torch.compile, kept_fraction's arithmetic, the
requirement table's refusals, and FA4's call plumbing against a stand-in module (FA4 itself needs an sm_90 GPU:
scripts/bench_sparse.py runs it there).

Tolerances: fp32 inputs; the reference and the gathered SDPA differ only by summation order (1e-5).
"""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from h3trt.errors import UserError
from h3trt.models.sparse import kernels as sparse_kernels
from h3trt.models.sparse import reference as sparse_reference
from h3trt.models.sparse.attention import subblock_route
from h3trt.models.sparse.kernels import (SPARSE_KERNELS, check_sparse_kernel, default_sparse_kernel,
                                         flex_sparse_attention, kept_fraction, sparse_attention,
                                         sparse_kernel_problem, warm_sparse_kernel)

CPU = torch.device("cpu")


def problem(B, S, N, D, block, topk, seed=0, key_rows=None):
    g = torch.Generator().manual_seed(seed)
    Sk = key_rows or S
    q = torch.randn(B, S, N, D, generator=g)
    k, v = torch.randn(B, Sk, N, D, generator=g), torch.randn(B, Sk, N, D, generator=g)
    G, K = -(-S // block), -(-Sk // block)
    index = torch.rand(B, N, G, K, generator=g).topk(topk, -1).indices.sort(-1).values.to(torch.int32)
    sparse_G = torch.rand(G, generator=g) < 0.6
    return q, k, v, index.contiguous(), sparse_G


def gathered_attention(q, k, v, index, sparse_G, block):
    """Each (batch, head, query block) by itself: SDPA over the key rows of its kept blocks, gathered (every key row
    for a dense block)."""
    B, S, N, D = q.shape
    Sk = k.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        for n in range(N):
            for g in range(-(-S // block)):
                rows = slice(g * block, min(S, (g + 1) * block))
                if sparse_G[g]:
                    keys = torch.cat([torch.arange(j * block, min(Sk, (j + 1) * block))
                                      for j in index[b, n, g].tolist()])
                else:
                    keys = torch.arange(Sk)
                out[b, rows, n] = F.scaled_dot_product_attention(q[b, rows, n][None], k[b, keys, n][None],
                                                                 v[b, keys, n][None])[0]
    return out


@pytest.mark.parametrize("S,block,topk", [(64 * 6, 64, 2), (64 * 5 + 23, 64, 3), (128 * 3 + 1, 128, 2)])
def test_reference_equals_sdpa_over_exactly_the_kept_keys(S, block, topk):
    q, k, v, index, sparse_G = problem(2, S, 3, 16, block, topk, seed=S)
    sparse_G[-1] = True  # the ragged last query block sparse, and among the kept key blocks somewhere
    index[0, 0, 0, -1] = -(-S // block) - 1
    index = index.sort(-1).values
    got = sparse_attention(q, k, v, index, sparse_G, block, "reference")
    assert got.shape == q.shape and got.dtype == q.dtype and got.is_contiguous()
    torch.testing.assert_close(got, gathered_attention(q, k, v, index, sparse_G, block), rtol=1e-5, atol=1e-5)


def test_dense_query_blocks_equal_dense_sdpa():
    q, k, v, index, _ = problem(1, 64 * 4 + 10, 2, 8, 64, 1)
    dense = torch.zeros(5, dtype=torch.bool)
    got = sparse_attention(q, k, v, index, dense, 64, "reference")
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and a sparse query block differs from dense (it drops keys)
    dense[1] = True
    assert not torch.allclose(sparse_attention(q, k, v, index, dense, 64, "reference")[:, 64:128], want[:, 64:128])


def test_reference_chunks_its_mask_without_changing_the_output(monkeypatch):
    q, k, v, index, sparse_G = problem(1, 64 * 7 + 3, 2, 8, 64, 3, seed=5)
    whole = sparse_attention(q, k, v, index, sparse_G, 64, "reference")
    monkeypatch.setattr(sparse_reference, "REFERENCE_MASK_BYTES", 1)  # one query block at a time
    torch.testing.assert_close(sparse_attention(q, k, v, index, sparse_G, 64, "reference"), whole, rtol=0, atol=1e-6)


def test_unequal_query_and_key_rows():
    q, k, v, index, sparse_G = problem(1, 64 * 3 + 5, 2, 8, 64, 2, key_rows=64 * 5 + 40)
    got = sparse_attention(q, k, v, index, sparse_G, 64, "reference")
    torch.testing.assert_close(got, gathered_attention(q, k, v, index, sparse_G, 64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("S,block", [(128 * 3 + 17, 128), (64 * 4, 64), (64 * 5 + 63, 64)])
def test_flex_unfused_matches_the_reference(S, block):
    """torch 2.13 runs flex_attention eagerly on the CPU (its unfused implementation, which evaluates mask_mod on
    every position): the block mask's mask_mod must encode exactly the kept blocks."""
    q, k, v, index, sparse_G = problem(1, S, 2, 16, block, 2, seed=block)
    want = sparse_attention(q, k, v, index, sparse_G, block, "reference")
    got = flex_sparse_attention(q, k, v, index, sparse_G, block, compiled=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_block_mask_lists_the_computed_blocks_as_full_blocks():
    q, k, v, index, sparse_G = problem(1, 128 * 4, 2, 8, 128, 2, seed=1)
    mask = sparse_kernels.flex_block_mask(index, sparse_G, 128, 512, 512)
    assert torch.equal(mask.kv_num_blocks, torch.zeros(1, 2, 4, dtype=torch.int32))
    assert torch.equal(mask.full_kv_num_blocks[0, 0], torch.where(sparse_G, 2, 4).to(torch.int32))
    for g in range(4):
        n = int(mask.full_kv_num_blocks[0, 1, g])
        want = index[0, 1, g] if sparse_G[g] else torch.arange(4, dtype=torch.int32)
        assert torch.equal(mask.full_kv_indices[0, 1, g, :n], want)


def test_route_then_attend_end_to_end():
    """The router's index feeds the op directly; sparsity 0 (every block kept) gives dense attention."""
    q, k, v, _, _ = problem(1, 64 * 6 + 7, 2, 16, 64, 1)
    sparse_G = torch.ones(7, dtype=torch.bool)
    dense = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    index, topk = subblock_route(q, k, 0.0, 0.25)
    torch.testing.assert_close(sparse_attention(q, k, v, index, sparse_G, 64, "reference"), dense, rtol=1e-5,
                               atol=1e-5)
    q, k, v, _, _ = problem(1, 64 * 20, 2, 16, 64, 1)
    index, topk = subblock_route(q, k, 0.75, 0.25)
    assert topk == 8
    got = sparse_attention(q, k, v, index, torch.ones(20, dtype=torch.bool), 64, "reference")
    torch.testing.assert_close(got, gathered_attention(q, k, v, index, torch.ones(20, dtype=torch.bool), 64),
                               rtol=1e-5, atol=1e-5)


class Block(torch.nn.Module):
    def forward(self, q, k, v, index, sparse_G):
        return sparse_attention(q * 2, k, v, index, sparse_G, 64, "reference") + 1


def test_op_is_one_opaque_call_under_export_and_compile():
    q, k, v, index, sparse_G = problem(1, 64 * 3, 2, 8, 64, 2)
    program = torch.export.export(Block(), (q, k, v, index, sparse_G))
    calls = [n for n in program.graph.nodes if n.op == "call_function"
             and n.target is torch.ops.h3trt.sparse_attention.default]
    assert len(calls) == 1
    compiled = torch.compile(Block(), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, index, sparse_G), Block()(q, k, v, index, sparse_G))


def test_kept_fraction_counts_computed_block_pairs():
    index = torch.zeros(2, 3, 5, 4, dtype=torch.int32)
    sparse_G = torch.tensor([True, True, False, True, False])
    assert kept_fraction(index, sparse_G, 10) == pytest.approx((3 * 4 + 2 * 10) / (5 * 10))
    assert kept_fraction(index, torch.zeros(5, dtype=torch.bool), 10) == 1.0
    assert kept_fraction(index, torch.ones(5, dtype=torch.bool), 10) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="sparse_G of shape"):
        kept_fraction(index, torch.ones(4, dtype=torch.bool), 10)
    with pytest.raises(ValueError, match="T <= num_key_blocks"):
        kept_fraction(index, sparse_G, 3)


@pytest.mark.parametrize("change,match", [
    (dict(kernel="fa5"), "kernels are"),
    (dict(index_dtype=torch.int64), "int32"),
    (dict(index_blocks=4), r"int32 \[B, N, G, T\]"),
    (dict(sparse_G=torch.ones(3, dtype=torch.bool)), "sparse_G must be a bool"),
    (dict(sparse_G=torch.ones(2, dtype=torch.int32)), "sparse_G must be a bool"),
])
def test_op_refuses_bad_arguments(change, match):
    q, k, v, index, sparse_G = problem(1, 128, 2, 8, 64, 1)
    index = index.to(change.get("index_dtype", torch.int32))
    if "index_blocks" in change:
        index = torch.zeros(1, 2, 2, change["index_blocks"], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        sparse_attention(q, k, v, index, change.get("sparse_G", sparse_G), 64, change.get("kernel", "reference"))


@pytest.mark.parametrize("kernel", ["flex", "fa4"])
def test_gpu_kernels_refuse_cpu_tensors(kernel):
    q, k, v, index, sparse_G = problem(1, 256, 2, 8, 128, 1)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        sparse_attention(q, k, v, index, sparse_G, 128, kernel)


def test_requirement_table_on_the_cpu():
    assert sparse_kernel_problem("reference", CPU) is None
    for kernel in ("flex", "fa4"):
        assert "needs a CUDA GPU" in sparse_kernel_problem(kernel, CPU)
        with pytest.raises(UserError, match="needs a CUDA GPU"):
            check_sparse_kernel(kernel, CPU)
    assert default_sparse_kernel(CPU) == "reference"
    with pytest.raises(ValueError, match="sparse attention kernels are"):
        sparse_kernel_problem("cudnn", CPU)
    assert set(SPARSE_KERNELS) == set(sparse_kernels.SPARSE_KERNEL_NEEDS)


def fake_gpu(monkeypatch, sm):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: divmod(sm, 10))


def test_fa4_needs_sm90_and_its_module_naming_the_extra(monkeypatch):
    gpu = torch.device("cuda")
    fake_gpu(monkeypatch, 86)
    assert "sm_90 and newer; this GPU is sm_86" in sparse_kernel_problem("fa4", gpu)
    assert sparse_kernel_problem("flex", gpu) is None
    assert default_sparse_kernel(gpu) == "flex"
    fake_gpu(monkeypatch, 90)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)  # not installed
    msg = sparse_kernel_problem("fa4", gpu)
    assert "flash_attn.cute.interface" in msg and "pip install 'h3trt[fa4]'" in msg
    assert default_sparse_kernel(gpu) == "flex"
    fake_fa4(monkeypatch)
    assert sparse_kernel_problem("fa4", gpu) is None and default_sparse_kernel(gpu) == "fa4"


def fake_fa4(monkeypatch):
    """A stand-in for flash-attn-4's interface: records each call and answers with the reference over the blocks it
    was given (full blocks only; mask blocks must be empty), so the plumbing is checked end to end."""
    calls = []

    class BlockSparseTensorsTorch:
        def __init__(self, mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx, block_size):
            self.__dict__.update(locals())

    def run(q, k, v, block_sparse_tensors, **kw):
        t = block_sparse_tensors
        assert not t.mask_block_cnt.any() and t.block_size[0] == t.block_size[1]
        bs = t.block_size[0]
        cnt, idx = t.full_block_cnt, t.full_block_idx
        K = -(-k.shape[1] // bs)
        kept = torch.zeros(*cnt.shape, K, dtype=torch.bool)
        for b, n, g in torch.cartesian_prod(*(torch.arange(s) for s in cnt.shape)).tolist():
            blocks = idx[b, n, g, :cnt[b, n, g]]
            assert bool((blocks[1:] > blocks[:-1]).all())  # ascending
            kept[b, n, g, blocks.long()] = True
        mask = kept.repeat_interleave(bs, 2).repeat_interleave(bs, 3)[:, :, :q.shape[1], :k.shape[1]]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask).transpose(1, 2)
        return out, None

    def flash_attn_func(q, k, v, block_sparse_tensors=None):
        calls.append(("flash_attn_func", None))
        return run(q, k, v, block_sparse_tensors)

    def _flash_attn_fwd(q, k, v, tile_mn=None, block_sparse_tensors=None):
        calls.append(("_flash_attn_fwd", tile_mn))
        return run(q, k, v, block_sparse_tensors)

    interface = types.ModuleType("flash_attn.cute.interface")
    interface.flash_attn_func, interface._flash_attn_fwd = flash_attn_func, _flash_attn_fwd
    sparsity = types.ModuleType("flash_attn.cute.block_sparsity")
    sparsity.BlockSparseTensorsTorch = BlockSparseTensorsTorch
    for name, mod in (("flash_attn", types.ModuleType("flash_attn")), ("flash_attn.cute", types.ModuleType("c")),
                      ("flash_attn.cute.interface", interface), ("flash_attn.cute.block_sparsity", sparsity)):
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


@pytest.mark.parametrize("block,entry", [(128, ("flash_attn_func", None)), (64, ("_flash_attn_fwd", (64, 64)))])
def test_fa4_call_passes_computed_blocks_as_full_blocks(monkeypatch, block, entry):
    calls = fake_fa4(monkeypatch)
    q, k, v, index, sparse_G = problem(1, block * 5 + 9, 2, 8, block, 2, seed=block)
    got = sparse_kernels.fa4_sparse_attention(q, k, v, index, sparse_G, block)
    assert calls == [entry]
    torch.testing.assert_close(got, gathered_attention(q, k, v, index, sparse_G, block), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"\(64, 128\)-row blocks"):
        sparse_kernels.fa4_sparse_attention(q, k, v, index, sparse_G, 256)


def test_fa4_missing_is_a_user_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)
    with pytest.raises(UserError, match=r"pip install 'h3trt\[fa4\]'"):
        sparse_kernels.fa4_modules()


def test_warm_refuses_what_the_device_cannot_run_and_runs_the_reference():
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        warm_sparse_kernel("fa4", CPU, 2, 8, torch.float32, 64)
    warm_sparse_kernel("reference", CPU, 2, 8, torch.float32, 64)


def test_warm_refuses_block_sizes_the_kernel_does_not_take(monkeypatch):
    monkeypatch.setattr(sparse_kernels, "check_sparse_kernel", lambda kernel, device: None)
    with pytest.raises(UserError, match="multiple of 128"):
        warm_sparse_kernel("flex", torch.device("cuda"), 2, 8, torch.bfloat16, 64)
    with pytest.raises(UserError, match=r"\(64, 128\)-row blocks"):
        warm_sparse_kernel("fa4", torch.device("cuda"), 2, 8, torch.bfloat16, 96)


def test_warm_runs_the_kernel_under_no_grad_as_the_pipeline_serves(monkeypatch):
    """Dynamo guards on the grad mode: a flex kernel warmed with grad enabled compiled again at the first request
    (the pipeline denoises under no_grad), which a bundle's no-compile guard refused on the GPU."""
    modes = []
    real = sparse_kernels.sparse_attention

    def recording(*args):
        modes.append(torch.is_grad_enabled())
        return real(*args)

    monkeypatch.setattr(sparse_kernels, "sparse_attention", recording)
    assert torch.is_grad_enabled()
    warm_sparse_kernel("reference", CPU, 2, 8, torch.float32, 64)
    assert modes and not any(modes), modes
    assert torch.is_grad_enabled()


def test_warm_runs_the_kernel_on_the_layout_the_exchange_serves(monkeypatch):
    """Dynamo specialises a zero storage offset: a kernel warmed only on q, k, v of their own compiled again at a
    bundle's first sparse request on the H200, whose q, k, v are slices of one exchange buffer (k and v past offset
    0). The warm-up must call the kernel on that layout too: the layout one_rank_exchange hands over."""
    from h3trt.engines.bundle import one_rank_exchange

    def layout(q, k, v):
        return tuple((t.stride(), t.storage_offset() == 0) for t in (q, k, v))

    seen = set()
    real = sparse_kernels.sparse_attention

    def recording(q, k, v, *rest):
        seen.add(layout(q, k, v))
        return real(q, k, v, *rest)

    monkeypatch.setattr(sparse_kernels, "sparse_attention", recording)
    warm_sparse_kernel("reference", CPU, 2, 8, torch.float32, 64)
    served = []
    qkv_send = torch.randn(1, 3, 1, 4 * 64, 2, 8)  # [sp, 3, B, S, N, D], sp = 1
    one_rank_exchange(qkv_send, lambda q, k, v: served.append(layout(q, k, v)) or q)
    assert served[0] in seen, (served[0], seen)
    assert any(not all(zero for _, zero in s) for s in seen)  # some warm call had k, v past offset 0
