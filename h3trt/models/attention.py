"""Attention kernels: the custom op `h3trt::attention` over [B, S, N, D] q/k/v, and the one table of what every
attention kernel (this op's and FP8 attention's, h3trt/calibration/fp8_attention.py) needs from a machine.

A bundle's kernels are chosen at build time (`h3trt build --attention`, h3trt/build/attention_choice.py), recorded
in the manifest's `attention`, and checked again when the bundle loads: a machine that cannot run the recorded kernel
is refused with the fix, never served by another kernel. The op is opaque to torch.export and Inductor (a fake
implementation gives its output's shape), so a compiled segment calls it by name: whoever loads a bundle imports this
module first.

Kernels of this op (q/k/v in the block dtype):
  cudnn   cuDNN's fused flash attention through torch's SDPA, pinned to its cuDNN backend (bf16; sm_80 and newer;
          the cuDNN torch ships). What bf16 bundles ran before kernels were selectable.
  fa3     FlashAttention-3's forward (the `fa3-fwd` wheel: sm_90a cubins behind the torch stable ABI; README,
          "FlashAttention-3"). bf16, Hopper (sm_90) only.
  sdpa    torch's SDPA with PyTorch's own backend choice, in any dtype on any device: what a CPU build bakes, what an
          fp32 bundle runs, and the reference the others are tested against.
FP8 attention's kernels (`cudnn`, `fa3`, `emulated`) share the table below under precision fp8.

Shape legend: B batch, S rows, N heads, D head dim.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UserError
from .precision import Precision

FA3_FIX = "pip install 'h3trt[fa3]' (fa3-fwd, FlashAttention-3's forward for Hopper)"
CUDNN_FRONTEND_FIX = "pip install 'h3trt[fp8-attention]' (nvidia-cudnn-frontend, cuDNN's Python graph API)"
FA3_MODULE = "fa3_fwd_interface"  # the fa3-fwd wheel's Python interface (it loads fa3_fwd._C, the kernels)
# What `--attention` accepts; "auto" measures the candidates on the build GPU.
ATTENTION_REQUESTS = ("auto", "cudnn", "fa3")


@dataclass(frozen=True)
class KernelNeeds:
    """What one kernel at one precision needs from the machine that builds or serves it."""

    cuda: bool  # a CUDA device (False: runs anywhere)
    min_sm: int = 0  # lowest compute capability, major * 10 + minor
    max_sm: int = 0  # highest (0: none): FA3's cubins are sm_90a, which no other GPU runs
    module: str = ""  # a Python module the kernel imports ("" : part of torch)
    fix: str = ""  # how to install `module`
    also: tuple[str, ...] = ()  # further modules it imports, installed by the same fix

    def problem(self, what: str, device, elsewhere: str, outside: str) -> str | None:
        """Why `device` cannot run the kernel `what` names ("the fa4 sparse attention kernel"), with the fix; None
        when it can. `elsewhere`: the fix on a device that is no CUDA GPU; `outside`: on a GPU outside the kernel's
        compute capabilities. Imports the kernel's modules (a wheel that installs but cannot load, e.g. built for
        another CUDA, is a problem too)."""
        if not self.cuda:
            return None
        device = torch.device(device)
        if device.type != "cuda":
            return f"{what} needs a CUDA GPU; this device is {device}. {elsewhere}"
        major, minor = torch.cuda.get_device_capability(device)
        sm = major * 10 + minor
        if sm < self.min_sm or (self.max_sm and sm > self.max_sm):
            span = f"sm_{self.min_sm}" + (" only" if self.max_sm == self.min_sm else " and newer")
            return f"{what} runs on {span}; this GPU is sm_{sm}. {outside}"
        for module in filter(None, (self.module, *self.also)):
            try:
                importlib.import_module(module)
            except (ImportError, OSError) as e:
                return (f"{what} needs the Python module {module!r}, which does not load here ({type(e).__name__}: "
                        f"{e}): {self.fix}.")
        return None


# (kernel, precision) -> needs, the precision one of ATTENTION_PRECISIONS (what the kernel reads q/k/v in). A pair
# that is not here does not exist (e.g. cuDNN or FA3 on fp32 q/k/v). A precision's CUDA kernels are what `--attention
# auto` measures on a GPU, in this order (ties: the first); its one kernel that runs anywhere is what a CPU build bakes.
KERNELS: dict[tuple[str, Precision], KernelNeeds] = {
    ("cudnn", Precision.BF16): KernelNeeds(cuda=True, min_sm=80),
    ("fa3", Precision.BF16): KernelNeeds(cuda=True, min_sm=90, max_sm=90, module=FA3_MODULE, fix=FA3_FIX),
    ("sdpa", Precision.BF16): KernelNeeds(cuda=False),
    ("sdpa", Precision.FP32): KernelNeeds(cuda=False),
    ("cudnn", Precision.FP8): KernelNeeds(cuda=True, min_sm=90, module="cudnn", fix=CUDNN_FRONTEND_FIX),
    ("fa3", Precision.FP8): KernelNeeds(cuda=True, min_sm=90, max_sm=90, module=FA3_MODULE, fix=FA3_FIX),
    ("emulated", Precision.FP8): KernelNeeds(cuda=False),
}


def kernels_for(precision: Precision) -> tuple[str, ...]:
    return tuple(k for k, p in KERNELS if p == precision)


def cpu_kernel(precision: Precision) -> str:
    """The one kernel at `precision` that runs on any device: what a CPU build bakes."""
    (kernel,) = (k for k in kernels_for(precision) if not KERNELS[k, precision].cuda)
    return kernel


def gpu_candidates(precision: Precision) -> tuple[str, ...]:
    """What `--attention auto` measures on a GPU: the CUDA kernels at `precision`, else (fp32) the one that runs
    anywhere."""
    return tuple(k for k in kernels_for(precision) if KERNELS[k, precision].cuda) or (cpu_kernel(precision),)


def kernel_problem(kernel: str, precision: Precision, device: torch.device) -> str | None:
    """Why `device` cannot run `kernel` at `precision`, with the fix; None when it can. Imports the kernel's package
    (a wheel that installs but cannot load, e.g. built for another CUDA, is a problem too)."""
    needs = KERNELS.get((kernel, precision))
    if needs is None:
        raise ValueError(f"{precision} attention kernels are {kernels_for(precision)}, got {kernel!r}.")
    return needs.problem(f"the {kernel} {precision} attention kernel", device,
                         f"Serve the bundle on the GPU it was built for, or rebuild it on this machine (a CPU build "
                         f"bakes {cpu_kernel(precision)!r}).",
                         "Rebuild the bundle on this GPU with --attention auto (or another --attention kernel).")


def check_kernel(kernel: str, precision: Precision, device: torch.device) -> None:
    """Raise, with the fix, where `device` cannot run `kernel` (at build and at load: never a silent substitute). The
    user's to fix (another device, the kernel's package, another --attention): a UserError."""
    problem = kernel_problem(kernel, precision, device)
    if problem is not None:
        raise UserError(problem)


def check_attention_record(record: dict, device: torch.device) -> None:
    """Raise, with the fix, where `device` cannot run a manifest's `attention` record ({precision: {kernel, ...}})."""
    for precision, choice in record.items():
        check_kernel(choice["kernel"], precision, device)


def dense_kernel(record: dict) -> str:
    """The kernel of a manifest's attention that is not FP8 (what the Ulysses exchange runs without FP8 attention)."""
    dense = [choice["kernel"] for precision, choice in record.items() if precision != Precision.FP8]
    if len(dense) != 1:
        raise ValueError(f"a bundle's attention record holds one non-FP8 precision, got {sorted(record)}.")
    return dense[0]


@torch.library.custom_op("h3trt::attention", mutates_args=())
def attention(q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor, kernel: str) -> torch.Tensor:
    """Full non-causal attention, scale D^-1/2, with `kernel`. Returns a contiguous [B, S, N, D] in q's dtype."""
    if kernel == "sdpa":
        return _sdpa(q_BSND, k_BSND, v_BSND)
    if kernel == "cudnn":
        return _cudnn(q_BSND, k_BSND, v_BSND)
    if kernel == "fa3":
        return _fa3(q_BSND, k_BSND, v_BSND)
    raise ValueError(f"h3trt::attention kernels are {kernels_for(Precision.BF16)}, got {kernel!r}.")


@attention.register_fake
def _(q_BSND, k_BSND, v_BSND, kernel):
    return torch.empty_like(q_BSND, memory_format=torch.contiguous_format)


def bound_attention(kernel: str):
    """The block's attention core (AttentionFn) running `kernel`: q, k, v [B, S, N, D] -> [B, S, N, D]."""
    return lambda q, k, v: attention(q, k, v, kernel)


def _sdpa(q, k, v) -> torch.Tensor:
    out_BNSD = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out_BNSD.transpose(1, 2).contiguous()


def _cudnn(q, k, v) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not q.is_cuda:
        raise ValueError(f"the cudnn attention kernel runs on CUDA tensors, got {q.device}; a CPU build bakes 'sdpa'.")
    # Only the cuDNN backend is enabled: SDPA raises rather than picking another kernel for inputs cuDNN refuses.
    # The [B, N, S, D] views of [B, S, N, D] tensors are what cuDNN reads without copies; it writes its output in q's
    # layout, so the transpose back is free.
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return _sdpa(q, k, v)


def fa3_interface():
    try:
        return importlib.import_module(FA3_MODULE)
    except (ImportError, OSError) as e:
        raise UserError(f"the fa3 attention kernel needs {FA3_MODULE!r}, which does not load here "
                        f"({type(e).__name__}: {e}): {FA3_FIX}.") from e


def _fa3(q, k, v) -> torch.Tensor:
    if not q.is_cuda:
        raise ValueError(f"the fa3 attention kernel runs on CUDA tensors, got {q.device}; a CPU build bakes 'sdpa'.")
    return fa3_bf16(q, k, v)


def fa3_bf16(q, k, v) -> torch.Tensor:
    """FA3's bf16 forward on [B, S, N, D] tensors (last dim contiguous), scale D^-1/2."""
    out = fa3_interface().flash_attn_func(q, k, v, causal=False)  # [B, S, N, D] in, [B, S, N, D] out
    out = out[0] if isinstance(out, tuple) else out
    return out.contiguous()
