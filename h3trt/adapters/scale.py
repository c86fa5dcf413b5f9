"""The one bound on a LoRA's strength (its scale), for a merged LoRA (--lora FILE:SCALE) and an adapter (--adapter,
a request's `lora`, POST /v1/loras) alike."""

from __future__ import annotations

import math

# A LoRA's strength (its scale) is a finite number at most this far from 0, either sign: well past any strength in use
# (ComfyUI's LoRA loaders offer -20..20 to -100..100), and an adapter at 1e30 held a worker through a whole denoise to
# fail as numerical_error. One bound for --lora, --adapter, a request's `lora` and POST /v1/loras.
MAX_LORA_SCALE = 100.0
SCALE_RANGE = f"a finite number from {-MAX_LORA_SCALE:g} to {MAX_LORA_SCALE:g} (1.0: as trained)"


def scale_in_range(scale: int | float) -> bool:
    """Whether `scale` (a number; an integer past a float's range is not in it) lies in the bound."""
    try:
        value = float(scale)
    except OverflowError:
        return False
    return math.isfinite(value) and abs(value) <= MAX_LORA_SCALE
