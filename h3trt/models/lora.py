"""LoRA files merged into the H3 DiT's native weights: every layout diffusers 0.42.1's `MiniMaxH3LoraLoaderMixin`
reads, with its alpha rules and partition routing.

  1. read the tensors and the safetensors `__metadata__`
  2. normalise to diffusers module names, the reference's own canonical form (`lora_state_dict`):
     - original-name files (ai-toolkit `diffusion_model.`, bare `blocks.`/`token_refiner.`/`final_layer.` as written by
       the reference trainer and ComfyUI, musubi-tuner's flattened `lora_unet_`, kohya `lora_down`/`lora_up` with
       `.alpha`, DiffSynth-Studio's peft `.default.` infix over per-head interleaved QKV) converted as
       `_convert_non_diffusers_minimax_h3_lora_to_diffusers` does
     - peft dumps (diffusers names with `.default.`, no component prefix) -> `transformer.`
     - diffusers files (`transformer.` / `transformer_ref.` prefixed) as they are
  3. the per-module scaling peft would build: alpha == rank (1.0) for alpha-less files, `alpha / rank` for a
     `__metadata__` network alpha (one that is not a number: ignored with a warning, alpha == rank, as diffusers
     loads it), folded `.alpha` tensors, or diffusers' own `lora_adapter_metadata` (LoraConfig)
  4. route to the one partition this model serves (FL2VA = `transformer`, Ref2VA = `transformer_ref`)
  5. merge W += scale * scaling * B @ A in fp32, rounded once to the weight's dtype, mapped back to native names
     (to_q / to_k / to_v -> rows of qkv_proj, ff.net.0.proj -> mlp.fc1 with its halves swapped)

Merging bakes the LoRA into every downstream artifact (AdaLN tables, FP8 scales, compiled segments' weights), which
is why a bundle takes its LoRAs at build time. Shapes: A (down) [r, in], B (up) [out, r].
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from .checkpoint import native_name
from .config import H3Config

# The two partitions' component names in diffusers (and in a LoRA file that says which it was trained against).
FL2VA_COMPONENT = "transformer"
REF2VA_COMPONENT = "transformer_ref"
TASK_COMPONENTS = {"t2va": FL2VA_COMPONENT, "fl2va": FL2VA_COMPONENT, "ref2va": REF2VA_COMPONENT}
ORIGINAL_PREFIXES = ("diffusion_model.", "blocks.", "token_refiner.blocks.", "final_layer.", "lora_unet_")
# Tensors only a pruned checkpoint has (its time MLP replaced by an interpolated table; h3_reference.md 3.3).
PRUNED_MARKERS = ("adaln_t_table", "adaln_basis", "adaln_mean", "time_embedder.table")
ADAPTER_METADATA_KEY = "lora_adapter_metadata"  # diffusers' own LoraConfig record in a file it wrote

# musubi-tuner's flattened module names -> dotted original names (the reference's vocabulary, in its order).
_FLATTENED = [
    (r"blocks_(\d+)_attn_(qkv|out)_proj", r"blocks.\1.attn.\2_proj"),
    (r"blocks_(\d+)_mlp_fc([12])", r"blocks.\1.mlp.fc\2"),
    (r"blocks_(\d+)_adaln_proj_linear", r"blocks.\1.adaln_proj.linear"),
    (r"token_refiner_blocks_(\d+)_attn_(qkv|out)_proj", r"token_refiner.blocks.\1.attn.\2_proj"),
    (r"token_refiner_blocks_(\d+)_mlp_fc([12])", r"token_refiner.blocks.\1.mlp.fc\2"),
    (r"(video|audio)_patch_proj", r"\1_patch_proj"),
    (r"condition_proj", "condition_proj"),
    (r"time_embedder_proj_(in|out)", r"time_embedder.proj_\1"),
    (r"final_layer_adaln_proj_linear", "final_layer.adaln_proj.linear"),
    (r"final_layer_(video|audio)_out", r"final_layer.\1_out"),
]
# Original module names outside the block stacks -> diffusers names.
_STANDALONE = {
    "video_patch_proj": "proj_in",
    "audio_patch_proj": "audio_proj_in",
    "condition_proj": "context_embedder",
    "time_embedder.proj_in": "time_embedder.linear_1",
    "time_embedder.proj_out": "time_embedder.linear_2",
    "final_layer.adaln_proj.linear": "norm_out.linear",
    "final_layer.video_out": "proj_out",
    "final_layer.audio_out": "audio_proj_out",
}


class LoraError(UserError):
    """A LoRA file that cannot be merged into this model; the message says why and what to use instead."""


class LoraScaleError(LoraError, argparse.ArgumentTypeError):
    """A scale that is not finite. An ArgumentTypeError too: `LoraSpec.parse` is argparse's type for --lora, and
    argparse shows only that class's message (a ValueError becomes "invalid parse value")."""


@dataclass(frozen=True)
class LoraSpec:
    """One `--lora FILE[:SCALE]`: the file and the strength it is merged at (1.0: as trained)."""

    path: Path
    scale: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "LoraSpec":
        """FILE or FILE:SCALE; a path that itself contains ':' keeps it unless the last part parses as a float (then
        it is the scale, and must be finite: `f.safetensors:nan` is refused, not read as a file of that name)."""
        head, sep, tail = str(text).rpartition(":")
        try:
            scale = float(tail) if sep else None
        except ValueError:
            scale = None
        return cls(Path(text)) if scale is None else cls(Path(head), scale)

    def __post_init__(self):
        if not math.isfinite(self.scale):
            raise LoraScaleError(f"--lora {self.path}:{self.scale}: the scale must be a finite number (1.0: as "
                                 f"trained), got {self.scale}; pass {self.path}:SCALE, or {self.path} alone for 1.0.")


@dataclass
class LoraModule:
    """One adapted Linear under its diffusers module name: down [r, in], up [out, r], and peft's scaling."""

    down: torch.Tensor
    up: torch.Tensor
    scaling: float


@dataclass
class LoraFile:
    """A LoRA file normalised to diffusers module names, per component prefix."""

    path: Path
    sha256: str
    layout: str  # which producer's layout it was read as
    alpha_rule: str  # how its scaling was decided
    components: dict[str, dict[str, LoraModule]] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------------
# Reading


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def read_lora(path: str | Path, head_dim: int = 128) -> LoraFile:
    """Read and normalise one LoRA file. `head_dim` de-interleaves DiffSynth QKV (every released partition: 128)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise LoraError(f"--lora {path} does not exist; pass a LoRA .safetensors file.")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
            file_meta = dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise LoraError(f"--lora {path} is not a readable safetensors file ({e}). h3trt reads LoRAs from "
                        ".safetensors only (no pickle).") from None
    file_meta.pop("format", None)
    if not state:
        raise LoraError(f"--lora {path} holds no tensors.")
    pruned = sorted(k for k in state if any(m in k for m in PRUNED_MARKERS))
    if pruned:
        raise LoraError(_pruned_message(path, f"it adapts {pruned[0]}, a tensor only pruned checkpoints have"))
    if any("dora_scale" in k or "lora_magnitude_vector" in k for k in state):
        raise LoraError(f"--lora {path} is a DoRA adapter (it has magnitude vectors); DoRA cannot be merged as B @ A. "
                        "Use a plain LoRA.")
    try:
        adapter_meta = json.loads(file_meta[ADAPTER_METADATA_KEY]) if ADAPTER_METADATA_KEY in file_meta else None
    except json.JSONDecodeError as e:
        raise LoraError(f"--lora {path}: its `{ADAPTER_METADATA_KEY}` metadata is not valid JSON ({e}).") from None
    has_alpha_tensors = any(k.endswith(".alpha") for k in state)  # read before the fold drops them

    is_original = any(k.startswith(ORIGINAL_PREFIXES) for k in state)
    is_peft_dump = any(".default.weight" in k for k in state) and not any(
        k.startswith((f"{FL2VA_COMPONENT}.", f"{REF2VA_COMPONENT}.")) for k in state)
    if is_original:
        layout, state = convert_original(state, head_dim, path)
    elif is_peft_dump:
        layout = "peft (diffusers names, no component prefix)"
        state = {f"{FL2VA_COMPONENT}.{k.replace('.default.', '.')}": v for k, v in state.items()}
    else:
        layout = "diffusers"
    bad = sorted(k for k in state if "lora" not in k)
    if bad:  # the reference's own format check
        raise LoraError(f"--lora {path} is not a LoRA file: {bad[0]} (and {len(bad) - 1} more) carry no 'lora' in "
                        "their names.")

    components: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    unknown = []
    for key, value in state.items():
        m = re.fullmatch(rf"({FL2VA_COMPONENT}|{REF2VA_COMPONENT})\.(.+)\.(lora_[AB])\.weight", key)
        if m is None:
            unknown.append(key)
            continue
        components.setdefault(m.group(1), {}).setdefault(m.group(2), {})[m.group(3)] = value
    if unknown:
        raise LoraError(f"--lora {path}: unrecognised MiniMax-H3 LoRA layout; {len(unknown)} key(s) are neither "
                        f"original-name nor diffusers LoRA factors, e.g. {sorted(unknown)[:3]} (lora_B biases and "
                        "other adapter types cannot be merged).")

    network_alpha, ignored_alpha = None, None
    if adapter_meta is None and "alpha" in file_meta and not has_alpha_tensors:
        network_alpha, ignored_alpha = _metadata_alpha(file_meta["alpha"], path)
    if adapter_meta is not None:
        alpha_rule = "lora_adapter_metadata (peft LoraConfig: alpha / rank per module)"
    elif network_alpha is not None:
        alpha_rule = f"__metadata__ alpha {network_alpha:g} (alpha / rank per module)"
    elif has_alpha_tensors:
        alpha_rule = "per-module .alpha tensors folded (alpha / rank)"
    elif ignored_alpha is not None:
        alpha_rule = (f"__metadata__ alpha {ignored_alpha!r} is not a number and was ignored, as diffusers ignores "
                      "it: alpha == rank (scale 1.0)")
    else:
        alpha_rule = "alpha-less: alpha == rank (scale 1.0)"

    out: dict[str, dict[str, LoraModule]] = {}
    for prefix, modules in components.items():
        config = _adapter_config(adapter_meta, prefix) if adapter_meta is not None else None
        out[prefix] = {}
        for module, pair in sorted(modules.items()):
            if set(pair) != {"lora_A", "lora_B"}:
                raise LoraError(f"--lora {path}: {prefix}.{module} has only {sorted(pair)}; a LoRA module needs both "
                                "lora_A and lora_B.")
            down, up = pair["lora_A"], pair["lora_B"]
            if down.ndim != 2 or up.ndim != 2 or down.shape[0] != up.shape[1]:
                raise LoraError(f"--lora {path}: {prefix}.{module} has lora_A {tuple(down.shape)} and lora_B "
                                f"{tuple(up.shape)}; they must be [r, in] and [out, r].")
            rank = up.shape[1]
            if config is not None:
                scaling = _peft_scaling(config, module, rank, path, prefix)
            elif network_alpha is not None:
                scaling = network_alpha / rank
            else:
                scaling = 1.0
            out[prefix][module] = LoraModule(down, up, scaling)
    return LoraFile(path, _sha256(path), layout, alpha_rule, out)


def _metadata_alpha(text: str, path: Path) -> tuple[float | None, str | None]:
    """(network alpha, None), or (None, the entry) for one that is not a number, which diffusers warns about and
    ignores (alpha == rank). NaN or inf parses as a float, which diffusers would scale by; h3trt refuses it."""
    try:
        alpha = float(text)
    except ValueError:
        print(f"h3trt: warning: --lora {path} records alpha = {text!r} in its __metadata__, which is not a number; "
              "it is ignored (as diffusers ignores it) and every module is merged with alpha == rank (scale 1.0).",
              file=sys.stderr)
        return None, text
    if not math.isfinite(alpha):
        raise LoraError(f"--lora {path} records alpha = {text!r} in its __metadata__: every module would be scaled "
                        "by a non-finite alpha / rank. Fix or remove that entry.")
    return alpha, None


def _adapter_config(meta: dict, prefix: str) -> dict:
    """The LoraConfig kwargs diffusers recorded for one component (keys `<prefix>.r`, `<prefix>.lora_alpha`, ...)."""
    config = {k.removeprefix(f"{prefix}."): v for k, v in meta.items() if k.startswith(f"{prefix}.")}
    return config


def _pattern_value(patterns: dict, module: str, default):
    """peft's `get_pattern_key`: the first pattern that matches the module name as a whole or as a dotted suffix."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _peft_scaling(config: dict, module: str, rank: int, path: Path, prefix: str) -> float:
    """lora_alpha / r (or / sqrt(r) with rsLoRA) with peft's rank and alpha patterns, checked against the tensors."""
    if config.get("use_dora"):
        raise LoraError(f"--lora {path}: its LoraConfig says use_dora; DoRA cannot be merged as B @ A.")
    r = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", 8))
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
    if r != rank:
        raise LoraError(f"--lora {path}: {prefix}.{module} has rank {rank} but its lora_adapter_metadata says "
                        f"r = {r}; the file is inconsistent (diffusers would fail with a size mismatch).")
    return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)


def convert_original(state: dict[str, torch.Tensor], head_dim: int, path: Path) -> tuple[str, dict]:
    """Original-name LoRA factors -> `transformer.`-prefixed diffusers names, as the reference converts them."""
    state = {k.removeprefix("diffusion_model."): v for k, v in state.items()}
    layout = []
    # DiffSynth-Studio trains on the raw checkpoint's per-head-interleaved QKV; what identifies it is peft's infix.
    diffsynth = any(".lora_A.default.weight" in k or ".lora_B.default.weight" in k for k in state)
    if diffsynth:
        layout.append("DiffSynth-Studio")
        state = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
                 for k, v in state.items()}
    if any(k.startswith("lora_unet_") for k in state):
        layout.append("musubi-tuner")
        unflattened = {}
        for key, value in state.items():
            module, _, suffix = key.removeprefix("lora_unet_").partition(".")
            dotted = next((re.sub(p, r, module) for p, r in _FLATTENED if re.fullmatch(p, module)), None)
            if dotted is None:
                raise LoraError(f"--lora {path}: {key} does not name a MiniMax-H3 module in musubi-tuner's flattened "
                                "lora_unet_ layout.")
            unflattened[f"{dotted}.{suffix}"] = value
        state = unflattened
    kohya = any(".lora_down.weight" in k for k in state)
    if kohya:
        layout.append("kohya down/up")
    down_suffix, up_suffix = (".lora_down.weight", ".lora_up.weight") if kohya else (".lora_A.weight", ".lora_B.weight")

    def pull(base: str):
        """(down, up) of one module with any `.alpha` folded in (alpha / rank), or None if absent."""
        if base + down_suffix not in state:
            return None
        down = state.pop(base + down_suffix)
        if base + up_suffix not in state:
            raise LoraError(f"--lora {path}: {base} has {down_suffix.strip('.')} but no {up_suffix.strip('.')}.")
        up = state.pop(base + up_suffix)
        alpha = state.pop(base + ".alpha", None)
        if alpha is not None:
            down = down.float() * (float(alpha) / down.shape[0])
        return down, up

    out = {}

    def put(target: str, down, up):
        out[f"{FL2VA_COMPONENT}.{target}.lora_A.weight"] = down
        out[f"{FL2VA_COMPONENT}.{target}.lora_B.weight"] = up

    for source, target in _STANDALONE.items():
        pair = pull(source)
        if pair is not None:
            put(target, *pair)
    def pull_fused(source: str, parts: int, not_what: str):
        """pull() of a fused projection whose up rows split into `parts` equal parts (QKV: 3, SwiGLU fc1: 2)."""
        pair = pull(source)
        if pair is not None and pair[1].shape[0] % parts:
            raise LoraError(f"--lora {path}: {source} has {pair[1].shape[0]} output rows, not {not_what}.")
        return pair

    for pattern, source_prefix, target_prefix in ((r"blocks\.(\d+)\.", "blocks", "transformer_blocks"),
                                                  (r"token_refiner\.blocks\.(\d+)\.", "token_refiner.blocks",
                                                   "token_refiner.refiner_blocks")):
        layers = 1 + max((int(m.group(1)) for m in map(lambda k: re.match(pattern, k), state) if m), default=-1)
        for i in range(layers):
            source, target = f"{source_prefix}.{i}", f"{target_prefix}.{i}"
            qkv = pull_fused(f"{source}.attn.qkv_proj", 3, "a multiple of 3: not a fused MiniMax-H3 QKV projection")
            if qkv is not None:
                down, up = qkv
                if diffsynth:
                    if up.shape[0] % (3 * head_dim):
                        raise LoraError(f"--lora {path}: {source}.attn.qkv_proj has {up.shape[0]} output rows, not a "
                                        f"multiple of 3 x {head_dim}: not a per-head interleaved MiniMax-H3 QKV.")
                    heads = up.shape[0] // (3 * head_dim)
                    # [h0: q k v, h1: q k v, ...] -> [q_all; k_all; v_all]
                    up = up.reshape(heads, 3, head_dim, up.shape[1]).transpose(0, 1).reshape(up.shape)
                for name, part in zip(("to_q", "to_k", "to_v"), up.chunk(3, dim=0)):
                    put(f"{target}.attn.{name}", down, part.contiguous())
            fc1 = pull_fused(f"{source}.mlp.fc1", 2, "even: not a fused MiniMax-H3 SwiGLU projection")
            if fc1 is not None:
                down, up = fc1
                gate, value = up.chunk(2, dim=0)
                put(f"{target}.ff.net.0.proj", down, torch.cat([value, gate]))  # diffusers fuses [value; gate]
            for src, dst in (("attn.out_proj", "attn.to_out.0"), ("mlp.fc2", "ff.net.2"),
                             ("adaln_proj.linear", "adaln_proj.linear")):
                pair = pull(f"{source}.{src}")
                if pair is not None:
                    put(f"{target}.{dst}", *pair)
    if state:
        raise LoraError(f"--lora {path}: unsupported MiniMax-H3 LoRA layout; {len(state)} key(s) name no H3 module, "
                        f"e.g. {sorted(state)[:3]}.")
    return " + ".join(layout) or "original names", out


def _pruned_message(path: Path, why: str) -> str:
    return (f"--lora {path} was trained against a pruned MiniMax-H3 checkpoint ({why}). h3trt, like diffusers, serves "
            "the unpruned MiniMaxAI/MiniMax-H3 weights only; use a LoRA trained against those.")


# ----------------------------------------------------------------------------------------------------------------------
# Routing and merging


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


@torch.no_grad()
def merge_loras(model: torch.nn.Module, specs: list[LoraSpec] | tuple[LoraSpec, ...], task: str) -> list[dict]:
    """Merge every LoRA into `model` (an H3DiT) in place, in order; returns one record per file for the manifest or
    the clip record. Each delta, up [out, r] @ down [r, in] * scaling * scale onto a weight (or its rows) [out, in],
    is computed in fp32 and the weight rounded once, after all LoRAs are added."""
    cfg: H3Config = model.cfg
    params = dict(model.named_parameters())
    deltas: dict[str, torch.Tensor] = {}
    records = []
    for spec in specs:
        lora = read_lora(spec.path, cfg.head_dim)
        prefix, modules = route(lora, task)
        for module, factors in modules.items():
            name, rows, swap = native_target(module, cfg)
            if name not in params:
                raise LoraError(f"--lora {spec.path}: {prefix}.{module} names no Linear of the H3 DiT (it would be "
                                f"{name}); is this a LoRA for another model?")
            target = params[name] if rows is None else params[name][rows]
            shape = (factors.up.shape[0], factors.down.shape[1])
            if shape != tuple(target.shape):
                if ".adaln_proj." in name and factors.down.shape[1] != cfg.time_embed_dim:
                    raise LoraError(_pruned_message(spec.path, f"its {name.removesuffix('.weight')} LoRA takes "
                                                    f"{factors.down.shape[1]} inputs; the unpruned adaln_proj takes "
                                                    f"{cfg.time_embed_dim}"))
                raise LoraError(f"--lora {spec.path}: {prefix}.{module} is [{shape[0]}, {shape[1]}] but the model's "
                                f"{name}{'' if rows is None else ' rows'} are {list(target.shape)}; this LoRA is for "
                                "another model size.")
            delta = (factors.up.float() @ factors.down.float()) * (factors.scaling * spec.scale)
            if swap:
                delta = torch.cat(delta.chunk(2, dim=0)[::-1])
            full = deltas.setdefault(name, torch.zeros(params[name].shape, dtype=torch.float32))
            if rows is None:
                full += delta
            else:
                full[rows] += delta
        records.append({"file": spec.path.name, "path": str(spec.path), "sha256": lora.sha256, "scale": spec.scale,
                        "layout": lora.layout, "alpha": lora.alpha_rule, "component": prefix,
                        "partition": "Ref2VA" if TASK_COMPONENTS[task] == REF2VA_COMPONENT else "FL2VA",
                        "modules": len(modules)})
    for name, delta in deltas.items():
        param = params[name]
        param.data = (param.data.float() + delta.to(param.device)).to(param.dtype)
    return records
