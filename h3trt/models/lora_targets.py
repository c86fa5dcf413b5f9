"""Where a LoRA file's modules land in the H3 DiT (diffusers 0.42.1's `MiniMaxH3LoraLoaderMixin`'s partition
routing, and the native weight each diffusers module adapts): what a merged LoRA (adapters/merge.py), an adapter's
slots (adapters/slots.py) and the distilled families' LoRA files (models/distilled/families.py) share; a target whose
rows swap halves swaps them with weight_layout.py's `swap_halves`. The file itself is read by lora_format.py; shapes:
A (down) [r, in], B (up) [out, r].
"""

from __future__ import annotations

import re

from .checkpoint.names import native_name
from .config import H3Config
from .lora_format import FL2VA_COMPONENT, REF2VA_COMPONENT, LoraError, LoraFile, LoraModule

TASK_COMPONENTS = {"t2va": FL2VA_COMPONENT, "fl2va": FL2VA_COMPONENT, "ref2va": REF2VA_COMPONENT}


def route(lora: LoraFile, task: str) -> tuple[str, dict[str, LoraModule]]:
    """The modules for the partition serving `task`, as the reference routes a pipeline that holds only that one:
    `transformer_ref.` layers need the Ref2VA partition; `transformer.` layers go to whichever partition is loaded."""
    served = TASK_COMPONENTS[task]
    have = set(lora.components)
    if not have:
        raise LoraError(f"--lora {lora.path} adapts no module.")
    if REF2VA_COMPONENT in have and served == FL2VA_COMPONENT:
        raise LoraError(f"--lora {lora.path} was trained against the Ref2VA partition (its layers are prefixed "
                        f"{REF2VA_COMPONENT}.), but the {task} task runs FL2VA; use it with --task ref2va (or a "
                        "ref2va request).")
    if have == {FL2VA_COMPONENT, REF2VA_COMPONENT}:
        # The reference would load both into a lone transformer_ref; the transformer. half is FL2VA's by its own name.
        raise LoraError(f"--lora {lora.path} holds layers for both partitions ({FL2VA_COMPONENT}. and "
                        f"{REF2VA_COMPONENT}.); h3trt serves one partition per model, so split the file and pass the "
                        f"{REF2VA_COMPONENT}. part for ref2va.")
    (prefix,) = have
    return prefix, lora.components[prefix]


def native_target(module: str, cfg: H3Config) -> tuple[str, slice | None, bool]:
    """(native weight name, row slice of it or None, whether the delta's two row halves swap) for a diffusers module."""
    m = re.fullmatch(r"(.*)\.attn\.to_([qkv])", module)
    if m:
        i = "qkv".index(m.group(2))
        return native_name(m.group(1) + ".attn") + ".qkv_proj.weight", slice(i * cfg.inner_dim,
                                                                               (i + 1) * cfg.inner_dim), False
    name = native_name(module + ".weight")
    return name, None, name.endswith(".mlp.fc1.weight")  # diffusers [value; gate] -> native [gate; value]
