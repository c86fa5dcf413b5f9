"""Reading one LoRA file, in any layout diffusers 0.42.1's `MiniMaxH3LoraLoaderMixin` reads, normalised to diffusers
module names with peft's per-module scaling (lora_targets.py routes it; adapters/merge.py merges it, adapters/slots.py
holds it in slots):

  1. read the tensors and the safetensors `__metadata__`
  2. normalise to diffusers module names, the reference's own canonical form (`lora_state_dict`):
     - original-name files (ai-toolkit `diffusion_model.`, bare `blocks.`/`token_refiner.`/`final_layer.` as written by
       the reference trainer and ComfyUI, musubi-tuner's flattened `lora_unet_`, kohya `lora_down`/`lora_up` with
       `.alpha`, DiffSynth-Studio's peft `.default.` infix over per-head interleaved QKV) converted as
       `_convert_non_diffusers_minimax_h3_lora_to_diffusers` does
     - peft dumps (diffusers names with `.default.`, no component prefix; peft's own `base_model.model.` root, as
       LightX2V's Turbo files carry it, dropped) -> `transformer.`
     - diffusers files (`transformer.` / `transformer_ref.` prefixed) as they are
  3. the per-module scaling peft would build: alpha == rank (1.0) for alpha-less files, `alpha / rank` for a
     `__metadata__` network alpha (one that is not a number: ignored with a warning, alpha == rank, as diffusers
     loads it), folded `.alpha` tensors, or diffusers' own `lora_adapter_metadata` (LoraConfig)

Shapes: A (down) [r, in], B (up) [out, r].
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError

# The two partitions' component names in diffusers (and in a LoRA file that says which it was trained against).
FL2VA_COMPONENT = "transformer"
REF2VA_COMPONENT = "transformer_ref"
ORIGINAL_PREFIXES = ("diffusion_model.", "blocks.", "token_refiner.blocks.", "final_layer.", "lora_unet_")
# Tensors only a pruned checkpoint has (its time MLP replaced by an interpolated table; h3_reference.md 3.3).
PRUNED_MARKERS = ("adaln_t_table", "adaln_basis", "adaln_mean", "time_embedder.table")
ADAPTER_METADATA_KEY = "lora_adapter_metadata"  # diffusers' own LoraConfig record in a file it wrote
PEFT_ROOT = "base_model.model."  # peft's PeftModel root, which a dump of its state dict keeps (LightX2V's Turbo)
PEFT_DUMP_LAYOUT = "peft (diffusers names, no component prefix)"  # a peft state-dict dump: LightX2V's Turbo files

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
    # whether the file says its alpha (a __metadata__ alpha, .alpha tensors, diffusers' LoraConfig); without it the
    # modules are scaled 1.0 (alpha == rank), as diffusers loads them, unless a family knows the file's default
    alpha_given: bool = True


def sha256_of(path: Path) -> str:
    """A file's sha256, read 16 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def read_lora(path: str | Path, head_dim: int = 128) -> LoraFile:
    """Read and normalise one LoRA file. `head_dim` de-interleaves DiffSynth QKV (every released partition: 128)."""
    path = Path(path)
    state, file_meta = _read_tensors(path)
    return lora_from_tensors(path, state, file_meta, sha256_of(path), head_dim)


def lora_from_tensors(path: Path, state: dict[str, torch.Tensor], file_meta: dict[str, str], sha256: str,
                      head_dim: int = 128) -> LoraFile:
    """Steps 2-4 of `read_lora` over a file's tensors (on any device) and `__metadata__` read already, with its
    sha256 (adapters/stream.py reads, hashes and copies a file in one pass)."""
    adapter_meta = _refuse_unmergeable(state, file_meta, path)
    has_alpha_tensors = any(k.endswith(".alpha") for k in state)  # read before the fold drops them
    layout, state = _diffusers_names(state, head_dim, path)
    components = _factors_by_component(state, path)
    network_alpha, alpha_rule = _alpha_rule(file_meta, adapter_meta, has_alpha_tensors, path)
    out = {prefix: _scaled_modules(prefix, modules, adapter_meta, network_alpha, path)
           for prefix, modules in components.items()}
    given = adapter_meta is not None or network_alpha is not None or has_alpha_tensors
    return LoraFile(path, sha256, layout, alpha_rule, out, given)


def _read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Step 1: the file's tensors and its `__metadata__` (less safetensors' own `format` entry)."""
    with opened_safetensors(path) as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
        file_meta = file_metadata(f, path)
    return state, file_meta


@contextmanager
def opened_safetensors(path: Path):
    """safetensors' `safe_open` of a LoRA file (its header checked against the file's size), every failure one
    LoraError."""
    from safetensors import safe_open

    if not path.is_file():
        raise LoraError(f"--lora {path} does not exist; pass a LoRA .safetensors file.")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except LoraError:
        raise
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise LoraError(f"--lora {path} is not a readable safetensors file ({e}). h3trt reads LoRAs from "
                        ".safetensors only (no pickle).") from None


def file_metadata(f, path: Path) -> dict[str, str]:
    """An opened file's `__metadata__` (less safetensors' own `format` entry); refuses a file without tensors."""
    if not list(f.keys()):
        raise LoraError(f"--lora {path} holds no tensors.")
    file_meta = dict(f.metadata() or {})
    file_meta.pop("format", None)
    return file_meta


def _refuse_unmergeable(state: dict[str, torch.Tensor], file_meta: dict[str, str], path: Path) -> dict | None:
    """Refuse a LoRA for a pruned checkpoint and a DoRA adapter; returns diffusers' `lora_adapter_metadata`, if any."""
    pruned = sorted(k for k in state if any(m in k for m in PRUNED_MARKERS))
    if pruned:
        raise LoraError(pruned_message(path, f"it adapts {pruned[0]}, a tensor only pruned checkpoints have"))
    if any("dora_scale" in k or "lora_magnitude_vector" in k for k in state):
        raise LoraError(f"--lora {path} is a DoRA adapter (it has magnitude vectors); DoRA cannot be merged as B @ A. "
                        "Use a plain LoRA.")
    try:
        return json.loads(file_meta[ADAPTER_METADATA_KEY]) if ADAPTER_METADATA_KEY in file_meta else None
    except json.JSONDecodeError as e:
        raise LoraError(f"--lora {path}: its `{ADAPTER_METADATA_KEY}` metadata is not valid JSON ({e}).") from None


def _diffusers_names(state: dict[str, torch.Tensor], head_dim: int, path: Path) -> tuple[str, dict]:
    """Step 2: (the layout it was read as, the factors under component-prefixed diffusers names)."""
    is_original = any(k.startswith(ORIGINAL_PREFIXES) for k in state)
    is_peft_dump = any(".default.weight" in k for k in state) and not any(
        k.startswith((f"{FL2VA_COMPONENT}.", f"{REF2VA_COMPONENT}.")) for k in state)
    if is_original:
        layout, state = convert_original(state, head_dim, path)
    elif is_peft_dump:
        layout = PEFT_DUMP_LAYOUT
        state = {f"{FL2VA_COMPONENT}.{k.removeprefix(PEFT_ROOT).replace('.default.', '.')}": v
                 for k, v in state.items()}
    else:
        layout = "diffusers"
    bad = sorted(k for k in state if "lora" not in k)
    if bad:  # the reference's own format check
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise LoraError(f"--lora {path} is not a LoRA file: {bad[0]}{more} carr{'y' if more else 'ies'} no 'lora' in "
                        f"{'their names' if more else 'its name'}.")
    return layout, state


def _factors_by_component(state: dict[str, torch.Tensor], path: Path) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """{component prefix: {module: {"lora_A" | "lora_B": tensor}}}, refusing any key that is not such a factor."""
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
    return components


def _alpha_rule(file_meta: dict[str, str], adapter_meta: dict | None, has_alpha_tensors: bool,
                path: Path) -> tuple[float | None, str]:
    """Step 3's rule: (the `__metadata__` network alpha or None, how the file's scaling is decided)."""
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
    return network_alpha, alpha_rule


def _scaled_modules(prefix: str, modules: dict[str, dict[str, torch.Tensor]], adapter_meta: dict | None,
                    network_alpha: float | None, path: Path) -> dict[str, LoraModule]:
    """One component's modules, each checked as [r, in] / [out, r] factors, with the scaling peft would give it."""
    config = _adapter_config(adapter_meta, prefix) if adapter_meta is not None else None
    out: dict[str, LoraModule] = {}
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
        out[module] = LoraModule(down, up, scaling)
    return out


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
    layout, state, diffsynth = _original_names(state, path)
    factors = _OriginalFactors(state, path)
    if factors.kohya:
        layout.append("kohya down/up")
    out: dict[str, torch.Tensor] = {}
    for source, target in _STANDALONE.items():
        pair = factors.pull(source)
        if pair is not None:
            _put(out, target, *pair)
    for pattern, source_prefix, target_prefix in ((r"blocks\.(\d+)\.", "blocks", "transformer_blocks"),
                                                  (r"token_refiner\.blocks\.(\d+)\.", "token_refiner.blocks",
                                                   "token_refiner.refiner_blocks")):
        layers = 1 + max((int(m.group(1)) for m in map(lambda k: re.match(pattern, k), state) if m), default=-1)
        for i in range(layers):
            _convert_block(factors, out, f"{source_prefix}.{i}", f"{target_prefix}.{i}",
                           head_dim if diffsynth else None)
    if state:
        raise LoraError(f"--lora {path}: unsupported MiniMax-H3 LoRA layout; {len(state)} key(s) name no H3 module, "
                        f"e.g. {sorted(state)[:3]}.")
    return " + ".join(layout) or "original names", out


def _original_names(state: dict[str, torch.Tensor], path: Path) -> tuple[list[str], dict, bool]:
    """(the trainers recognised, the factors under dotted original names, whether QKV is per-head interleaved): the
    ai-toolkit prefix dropped, DiffSynth-Studio's peft infix removed, musubi-tuner's flattened names dotted."""
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
    return layout, state, diffsynth


class _OriginalFactors:
    """An original-name file's factors, taken out module by module (kohya's lora_down/lora_up or lora_A/lora_B):
    what is left in `state` at the end names no H3 module."""

    def __init__(self, state: dict[str, torch.Tensor], path: Path):
        self.state, self.path = state, path
        self.kohya = any(".lora_down.weight" in k for k in state)
        self.down_suffix, self.up_suffix = ((".lora_down.weight", ".lora_up.weight") if self.kohya
                                            else (".lora_A.weight", ".lora_B.weight"))

    def pull(self, base: str):
        """(down, up) of one module with any `.alpha` folded in (alpha / rank), or None if absent."""
        state, down_suffix, up_suffix = self.state, self.down_suffix, self.up_suffix
        if base + down_suffix not in state:
            return None
        down = state.pop(base + down_suffix)
        if base + up_suffix not in state:
            raise LoraError(f"--lora {self.path}: {base} has {down_suffix.strip('.')} but no {up_suffix.strip('.')}.")
        up = state.pop(base + up_suffix)
        alpha = state.pop(base + ".alpha", None)
        if alpha is not None:
            down = down.float() * (float(alpha) / down.shape[0])
        return down, up

    def pull_fused(self, source: str, parts: int, not_what: str):
        """pull() of a fused projection whose up rows split into `parts` equal parts (QKV: 3, SwiGLU fc1: 2)."""
        pair = self.pull(source)
        if pair is not None and pair[1].shape[0] % parts:
            raise LoraError(f"--lora {self.path}: {source} has {pair[1].shape[0]} output rows, not {not_what}.")
        return pair


def _put(out: dict[str, torch.Tensor], target: str, down, up) -> None:
    out[f"{FL2VA_COMPONENT}.{target}.lora_A.weight"] = down
    out[f"{FL2VA_COMPONENT}.{target}.lora_B.weight"] = up


def _convert_block(factors: _OriginalFactors, out: dict[str, torch.Tensor], source: str, target: str,
                   interleaved_head_dim: int | None) -> None:
    """One block's factors (`source`, an original block name) under the diffusers block `target`: the fused QKV split
    into to_q/to_k/to_v (de-interleaved first when `interleaved_head_dim` is given: DiffSynth-Studio's), the fused
    SwiGLU fc1 reordered to diffusers' [value; gate], the other projections renamed."""
    path = factors.path
    qkv = factors.pull_fused(f"{source}.attn.qkv_proj", 3, "a multiple of 3: not a fused MiniMax-H3 QKV projection")
    if qkv is not None:
        down, up = qkv
        if interleaved_head_dim is not None:
            head_dim = interleaved_head_dim
            if up.shape[0] % (3 * head_dim):
                raise LoraError(f"--lora {path}: {source}.attn.qkv_proj has {up.shape[0]} output rows, not a "
                                f"multiple of 3 x {head_dim}: not a per-head interleaved MiniMax-H3 QKV.")
            heads = up.shape[0] // (3 * head_dim)
            # [h0: q k v, h1: q k v, ...] -> [q_all; k_all; v_all]
            up = up.reshape(heads, 3, head_dim, up.shape[1]).transpose(0, 1).reshape(up.shape)
        for name, part in zip(("to_q", "to_k", "to_v"), up.chunk(3, dim=0)):
            _put(out, f"{target}.attn.{name}", down, part.contiguous())
    fc1 = factors.pull_fused(f"{source}.mlp.fc1", 2, "even: not a fused MiniMax-H3 SwiGLU projection")
    if fc1 is not None:
        down, up = fc1
        gate, value = up.chunk(2, dim=0)
        _put(out, f"{target}.ff.net.0.proj", down, torch.cat([value, gate]))  # diffusers fuses [value; gate]
    for src, dst in (("attn.out_proj", "attn.to_out.0"), ("mlp.fc2", "ff.net.2"),
                     ("adaln_proj.linear", "adaln_proj.linear")):
        pair = factors.pull(f"{source}.{src}")
        if pair is not None:
            _put(out, f"{target}.{dst}", *pair)


def pruned_message(path: Path, why: str) -> str:
    return (f"--lora {path} was trained against a pruned MiniMax-H3 checkpoint ({why}). h3trt, like diffusers, serves "
            "the unpruned MiniMaxAI/MiniMax-H3 weights only; use a LoRA trained against those.")
