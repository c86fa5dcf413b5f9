"""The safetensors format's constants, in one leaf module: the dtype names its headers use and the header-length
limit. A bundle's weight files (engines/weights_io.py), a checkpoint's tensors read a few at a time
(checkpoint/stream.py) and a LoRA file streamed onto its slots (adapters/stream.py) read and write by them."""

from __future__ import annotations

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
