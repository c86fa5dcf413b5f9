"""Precision names -> the dtype a component computes in: the one table every layer reads.

A quantized precision (fp8, nvfp4) keeps what it does not quantize, and every activation, in bf16: its dtype here is
bf16, and the quantized GEMMs are the calibration's modules (h3trt/calibration/). The video VAE takes a subset of the
names (h3trt/models/vae_precision.py says where its tensors go).
"""

from __future__ import annotations

import torch

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.bfloat16, "nvfp4": torch.bfloat16}
DIT_PRECISIONS = ("bf16", "fp32", "fp8", "nvfp4")  # h3trt build --precision (bf16 the default)
VAE_PRECISIONS = ("fp32", "bf16", "fp8")  # --vae-precision


def precision_dtype(name: str, choices: tuple[str, ...] = DIT_PRECISIONS, flag: str = "--precision") -> torch.dtype:
    """The compute dtype of precision `name`, refusing a name outside `choices` (the flag's)."""
    if name not in choices:
        raise ValueError(f"{flag} must be one of {list(choices)}, got {name!r}.")
    return PRECISION_DTYPES[name]


def eager_dtype(device: str | torch.device) -> torch.dtype:
    """What an eager (checkpoint) run computes in: bf16 on CUDA, fp32 on the CPU (where bf16 matmuls are slow and the
    bitwise parity tests run)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
