"""`h3trt build --attention auto|cudnn|fa3`: which attention kernel a bundle bakes in, per precision.

`auto` (the default) times every candidate kernel the build GPU can run (h3trt/models/attention.py, gpu_candidates)
on random q/k/v of the bundle's own attention shape: all rows of its longest profile, the heads ONE rank attends
over (N / sp under Ulysses: the exchange hands each rank every row of its head group), head dim 128; the fastest
wins. A kernel the GPU cannot run (package missing, wrong arch) is left out of the race, and the manifest records
why, beside every time measured. On a CPU there is one kernel per precision (sdpa, or the FP8 emulation), so
nothing is timed. A named kernel is checked, not timed: a GPU that cannot run it refuses the build (a UserError: the
user picks another kernel, device or package).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..errors import UserError
from ..models.attention import ATTENTION_REQUESTS, attention, cpu_kernel, gpu_candidates, kernel_problem
from ..models.precision import ATTENTION_PRECISIONS, Precision
from ..calibration.formats import fp8_scale, quantize_fp8
from ..calibration.fp8_attention import fp8_sdpa

BENCH_WARMUP, BENCH_ITERS = 2, 5  # about 0.5 s a kernel at 37,838 rows x 56 heads


@dataclass(frozen=True)
class AttentionShape:
    """The attention a bundle runs, as one rank sees it: [batch, rows, heads, head_dim] q/k/v."""

    rows: int
    heads: int
    head_dim: int
    batch: int = 1

    def __post_init__(self):
        if min(self.rows, self.heads, self.head_dim, self.batch) < 1:
            raise ValueError(f"attention shape must be positive, got {self}.")


@dataclass(frozen=True)
class AttentionChoice:
    """One precision's kernel, and how it was chosen: the manifest's `attention.<precision>` record."""

    precision: Precision  # one of ATTENTION_PRECISIONS (a string is parsed): the dtype the kernel reads q/k/v in
    kernel: str  # the kernel the compiled code calls (h3trt/models/attention.py, KERNELS)
    requested: str  # what --attention asked for: auto, or a kernel
    shape: AttentionShape
    measured_ms: dict[str, float] = field(default_factory=dict)  # auto on a GPU: every candidate timed
    unavailable: dict[str, str] = field(default_factory=dict)  # auto on a GPU: candidates left out, and why

    def __post_init__(self):
        object.__setattr__(self, "precision", Precision.parse(self.precision, ATTENTION_PRECISIONS,
                                                              "attention precision"))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "AttentionChoice":
        return cls(**{**data, "shape": AttentionShape(**data["shape"])})


Measure = Callable[[str, Precision, AttentionShape, torch.device], float]


def resolve_attention(requested: str, precision: Precision, device: torch.device, shape: AttentionShape,
                      measure: Measure | None = None,
                      problem: Callable[[str, Precision, torch.device], str | None] = kernel_problem
                      ) -> AttentionChoice:
    """The kernel a build bakes for `precision` on `device`. `measure(kernel, precision, shape, device)` -> ms and
    `problem` (why a kernel cannot run here, or None) are parameters so the choice is testable without a GPU."""
    if requested not in ATTENTION_REQUESTS:
        raise UserError(f"--attention must be one of {ATTENTION_REQUESTS}, got {requested!r}.")
    device = torch.device(device)
    measure = measure or measure_kernel_ms
    if requested != "auto":
        if precision == Precision.FP32:
            raise UserError(f"--attention {requested} runs bf16 (or FP8) q/k/v; an fp32 bundle's attention is torch "
                             "SDPA. Use --attention auto with --precision fp32.")
        reason = problem(requested, precision, device)
        if reason is not None:
            raise UserError(f"--attention {requested}: {reason}")
        return AttentionChoice(precision, requested, requested, shape)
    if device.type != "cuda":
        return AttentionChoice(precision, cpu_kernel(precision), requested, shape)
    candidates = gpu_candidates(precision)
    unavailable = {k: r for k in candidates if (r := problem(k, precision, device)) is not None}
    runnable = [k for k in candidates if k not in unavailable]
    if not runnable:
        listed = "; ".join(f"{k}: {r}" for k, r in unavailable.items())
        raise UserError(f"no {precision} attention kernel runs on this GPU ({listed}); apply one of those fixes, or "
                        "build on a GPU that runs one.")
    measured = {k: round(float(measure(k, precision, shape, device)), 3) for k in runnable}
    fastest = min(runnable, key=lambda k: (measured[k], runnable.index(k)))  # ties: the table's order
    return AttentionChoice(precision, fastest, requested, shape, measured, unavailable)


def measure_kernel_ms(kernel: str, precision: Precision, shape: AttentionShape, device: torch.device) -> float:
    """Median ms of the kernel's op alone (`h3trt::attention`, or `h3trt::fp8_sdpa` on e4m3 q/k/v quantized with
    their own max), CUDA events, after warm-up: exactly the call the compiled code makes, at the bundle's shape."""
    g = torch.Generator(device).manual_seed(0)
    dtype = precision.spec.dtype  # fp8: bf16, quantized below
    q, k, v = (torch.randn(shape.batch, shape.rows, shape.heads, shape.head_dim, device=device, dtype=dtype,
                           generator=g) for _ in range(3))
    if precision.spec.quantized:
        scales = [fp8_scale(t.abs().amax()) for t in (q, k, v)]
        q8, k8, v8 = (quantize_fp8(t, s).contiguous() for t, s in zip((q, k, v), scales))
        del q, k, v

        def run():
            return fp8_sdpa(q8, k8, v8, *scales, kernel)
    else:
        def run():
            return attention(q, k, v, kernel)
    with torch.no_grad():
        return median_cuda_ms(run, BENCH_ITERS, BENCH_WARMUP, device)


def median_cuda_ms(fn, iters: int, warmup: int, device=None) -> float:
    """Median of `iters` CUDA-event timings of fn() after `warmup` calls, in ms (the benches use it too)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
