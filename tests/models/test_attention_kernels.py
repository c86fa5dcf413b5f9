"""Attention kernels on the CPU: `--attention auto` resolution with a mocked benchmark and mocked machines, the
requirement table's refusals (no GPU, wrong arch, package missing: each naming its fix), the `h3trt::attention` op
staying one opaque call in a compiled block, and the CPU kernels' numerics against an fp32 reference.

The GPU kernels (cudnn, fa3) themselves need an H200: scripts/bench_attention.py measures them there. Their argument
plumbing is checked here against a stand-in module (FA3's descale shapes, its tuple or tensor return).

Tolerances: the sdpa kernel is torch SDPA (bitwise); bf16 attention against an fp32 reference is within 1e-2 (bf16
rounding of q/k/v and the output); the emulated FP8 kernel within 8% (tests/calibration/test_fp8_attention.py says why).
"""

import types

import pytest
import torch
import torch.nn.functional as F

from h3trt.build.attention_choice import AttentionChoice, AttentionShape, resolve_attention
from h3trt.models import attention as attn
from h3trt.models.attention import attention, check_attention_record, dense_kernel, kernel_problem
from h3trt.calibration.formats import fp8_scale, quantize_fp8
from h3trt.calibration.modules import fp8_attention
from h3trt.errors import UserError

SHAPE = AttentionShape(rows=37_838, heads=28, head_dim=128)
CUDA = torch.device("cuda")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference_fp32(q, k, v):
    """Exact attention in fp32 by explicit softmax: [B, S, N, D]."""
    s = torch.einsum("bqnd,bknd->bnqk", q.float(), k.float()) / q.shape[-1] ** 0.5
    return torch.einsum("bnqk,bknd->bqnd", s.softmax(-1), v.float())


class Timer:
    """A benchmark stand-in: fixed ms per kernel, and a record of what was timed at which shape."""

    def __init__(self, ms):
        self.ms, self.calls = ms, []

    def __call__(self, kernel, precision, shape, device):
        self.calls.append((kernel, precision, shape.heads))
        return self.ms[kernel]


def runs_everything(kernel, precision, device):
    return None


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_auto_on_a_gpu_times_every_candidate_and_keeps_the_fastest(precision):
    timer = Timer({"cudnn": 72.5, "fa3": 59.0})
    choice = resolve_attention("auto", precision, CUDA, SHAPE, measure=timer, problem=runs_everything)
    assert choice.kernel == "fa3" and choice.measured_ms == {"cudnn": 72.5, "fa3": 59.0} and not choice.unavailable
    assert timer.calls == [("cudnn", precision, 28), ("fa3", precision, 28)]  # at the per-rank head count
    timer = Timer({"cudnn": 41.0, "fa3": 44.5})
    assert resolve_attention("auto", precision, CUDA, SHAPE, measure=timer, problem=runs_everything).kernel == "cudnn"
    tie = resolve_attention("auto", precision, CUDA, SHAPE, measure=Timer({"cudnn": 5.0, "fa3": 5.0}),
                            problem=runs_everything)
    assert tie.kernel == "cudnn"  # a tie keeps the table's order


def test_auto_leaves_out_and_records_kernels_the_gpu_cannot_run():
    def no_fa3(kernel, precision, device):
        return "fa3-fwd is not installed: pip install 'h3trt[fa3]'" if kernel == "fa3" else None

    timer = Timer({"cudnn": 72.5, "fa3": 1.0})
    choice = resolve_attention("auto", "bf16", CUDA, SHAPE, measure=timer, problem=no_fa3)
    assert choice.kernel == "cudnn" and list(choice.measured_ms) == ["cudnn"]
    assert "h3trt[fa3]" in choice.unavailable["fa3"]
    with pytest.raises(UserError, match="no fp8 attention kernel runs on this GPU.*cudnn: x.*fa3: x"):
        resolve_attention("auto", "fp8", CUDA, SHAPE, measure=timer, problem=lambda k, p, d: "x")


def test_a_named_kernel_is_checked_not_timed():
    timer = Timer({})
    choice = resolve_attention("fa3", "fp8", CUDA, SHAPE, measure=timer, problem=runs_everything)
    assert (choice.kernel, choice.requested, choice.measured_ms, timer.calls) == ("fa3", "fa3", {}, [])
    with pytest.raises(UserError, match=r"--attention fa3: .*pip install 'h3trt\[fa3\]'"):
        resolve_attention("fa3", "bf16", CUDA, SHAPE, measure=timer,
                          problem=lambda k, p, d: "needs fa3_fwd_interface: pip install 'h3trt[fa3]'")
    with pytest.raises(ValueError, match="fp32 bundle's attention is torch SDPA"):
        resolve_attention("cudnn", "fp32", CUDA, SHAPE, measure=timer, problem=runs_everything)
    with pytest.raises(ValueError, match="--attention must be one of"):
        resolve_attention("flash", "bf16", CUDA, SHAPE, measure=timer, problem=runs_everything)


def test_a_cpu_build_bakes_its_one_kernel_and_refuses_gpu_kernels():
    cpu = torch.device("cpu")
    timer = Timer({})
    assert [resolve_attention("auto", p, cpu, SHAPE, measure=timer).kernel for p in ("bf16", "fp32", "fp8")] == [
        "sdpa", "sdpa", "emulated"]
    assert timer.calls == []
    for kernel in ("cudnn", "fa3"):
        with pytest.raises(UserError, match="needs a CUDA GPU"):
            resolve_attention(kernel, "bf16", cpu, SHAPE, measure=timer)


def test_the_choice_round_trips_through_the_manifest_record():
    choice = resolve_attention("auto", "fp8", CUDA, SHAPE, measure=Timer({"cudnn": 50.2, "fa3": 44.5}),
                               problem=runs_everything)
    record = choice.to_dict()
    assert record["shape"] == {"rows": 37_838, "heads": 28, "head_dim": 128, "batch": 1}
    assert AttentionChoice.from_dict(record) == choice
    assert dense_kernel({"bf16": {"kernel": "cudnn"}, "fp8": record}) == "cudnn"
    with pytest.raises(ValueError, match="one non-FP8 precision"):
        dense_kernel({"fp8": record})


@pytest.fixture
def gpu(monkeypatch):
    """Pretend to be a CUDA machine of a given compute capability (kernel_problem only asks for these)."""
    def set_sm(major, minor):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
    return set_sm


def test_requirements_refuse_the_wrong_gpu_and_a_missing_package_naming_the_fix(gpu, monkeypatch):
    gpu(10, 0)  # Blackwell: FA3's cubins are sm_90a only
    assert "sm_90 only; this GPU is sm_100" in kernel_problem("fa3", "bf16", CUDA)
    assert kernel_problem("cudnn", "bf16", CUDA) is None
    gpu(8, 9)
    assert "sm_90 and newer; this GPU is sm_89" in kernel_problem("cudnn", "fp8", CUDA)
    gpu(9, 0)
    real_import = attn.importlib.import_module

    def without_fa3(name):
        if name == attn.FA3_MODULE:
            raise ImportError(f"No module named {name!r}")
        return real_import(name)

    monkeypatch.setattr(attn.importlib, "import_module", without_fa3)
    problem = kernel_problem("fa3", "fp8", CUDA)
    assert "fa3_fwd_interface" in problem and "pip install 'h3trt[fa3]'" in problem
    with pytest.raises(UserError, match=r"pip install 'h3trt\[fa3\]'"):
        check_attention_record({"bf16": {"kernel": "cudnn"}, "fp8": {"kernel": "fa3"}}, CUDA)
    check_attention_record({"bf16": {"kernel": "cudnn"}}, CUDA)
    with pytest.raises(ValueError, match="bf16 attention kernels are"):
        kernel_problem("emulated", "bf16", CUDA)


def test_cpu_kernels_match_an_fp32_reference():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 130, 3, 32, generator=g) for _ in range(3))
    want = reference_fp32(q, k, v)
    assert rel(attention(q, k, v, "sdpa"), want) < 1e-5  # fp32 q/k/v: an fp32 bundle's attention
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    got = attention(qb, kb, vb, "sdpa")
    assert got.dtype == torch.bfloat16 and got.is_contiguous() and got.shape == q.shape
    assert torch.equal(got, F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qb, kb, vb))).transpose(1, 2))
    assert rel(got, want) < 1e-2
    vb = vb + 2.0  # a mean over the rows: FP8 attention centers it away
    scales = [fp8_scale(t.abs().amax()) for t in (qb, kb, vb - vb.float().mean(1, keepdim=True))]
    assert 0 < rel(fp8_attention(qb, kb, vb, *scales, "emulated"), reference_fp32(q, k, v + 2.0)) < 0.08
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        attention(qb, kb, vb, "cudnn")


def test_fa3_calls_pass_bsnd_tensors_and_per_head_descales(monkeypatch):
    """FA3's interface takes [B, S, N, D] and (FP8) descales of shape [B, N]; a stand-in checks what h3trt passes."""
    from h3trt.calibration.fp8_attention import fa3_fp8_attention

    seen = {}

    def flash_attn_func(q, k, v, causal=False, q_descale=None, k_descale=None, v_descale=None):
        seen.update(shape=tuple(q.shape), causal=causal, descales=[None if d is None else tuple(d.shape)
                                                                   for d in (q_descale, k_descale, v_descale)])
        d = [1.0 if s is None else s[0, 0] for s in (q_descale, k_descale, v_descale)]
        out = reference_fp32(q.float() * d[0], k.float() * d[1], v.float() * d[2]).bfloat16()
        return out, None  # some builds return (out, lse)

    monkeypatch.setattr(attn, "fa3_interface", lambda: types.SimpleNamespace(flash_attn_func=flash_attn_func))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 40, 3, 16, generator=g).bfloat16() for _ in range(3))
    out = attn.fa3_bf16(q, k, v)
    assert seen == {"shape": (2, 40, 3, 16), "causal": False, "descales": [None] * 3} and out.is_contiguous()
    scales = [fp8_scale(t.abs().amax()) for t in (q, k, v)]
    q8, k8, v8 = (quantize_fp8(t, s) for t, s in zip((q, k, v), scales))
    out = fa3_fp8_attention(q8, k8, v8, *scales)
    assert seen["descales"] == [(2, 3)] * 3 and out.dtype == torch.bfloat16
    assert rel(out, reference_fp32(q, k, v)) < 0.08


@pytest.mark.build
def test_an_exported_block_calls_the_op_once_and_matches_eager():
    """What Inductor compiles: the block's export, with attention one opaque call (the compiled bundles' parity with
    the eager DiT is tests/engines/test_engine.py's)."""
    from h3trt.build.backends import export_segment
    from h3trt.build.segments import block_segment
    from h3trt.models.config import H3Config
    from h3trt.models.dit import Block, rope_inv_freq, rope_tables

    cfg = H3Config.tiny()
    torch.manual_seed(0)
    block = Block(cfg).eval().requires_grad_(False)
    rows = 24
    x = torch.randn(1, rows, cfg.hidden_size)
    mod = block.modulation(torch.randn(2, cfg.time_embed_dim)).contiguous()
    idx = torch.randint(0, 6, (rows,))
    cos, sin = rope_tables(torch.rand(rows, 3) * 10, rope_inv_freq(cfg))
    spec = block_segment(cfg, torch.float32, attention="sdpa")
    tensors = dict(block.named_parameters())
    example = [x, mod, idx, cos, sin, *[tensors[n] for n in spec.weights]]
    exported = export_segment(spec, example)
    graph = exported.graph_module
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and "h3trt.attention" in str(n.target)]
    assert len(calls) == 1 and calls[0].args[-1] == "sdpa"
    assert not [n for n in graph.graph.nodes if "scaled_dot_product" in str(n.target)]  # SDPA is inside the op only
    got = exported.module()(*example)
    got = got[0] if isinstance(got, (tuple, list)) else got
    with torch.no_grad():
        want = block(x, mod, idx, (cos, sin))
    assert rel(got, want) < 1e-5
