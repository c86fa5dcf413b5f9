"""Reading the distilled families' files into one form, `Fusion`: what each native parameter of the H3 DiT receives
(low-rank products and full-rank deltas, added in fp32; assigned tensors), and PDD's head bank. distilled/families.py
detects the family and fuses; nothing here touches a model.

  fasth3  FastVideo's `fastvideo-lora-v2` (scripts/lora_extraction/extract_minimax_h3_lora.py writes it): diffusers
          module names, `X.lora_A.weight` [r, in] / `X.lora_B.weight` [out, r] at scale exactly 1 (no alpha), `X.diff`
          added to `X.weight`, `X.diff_b` to `X.bias`, `X.set_weight` assigned (the VSA gates,
          `transformer_blocks.i.attn.to_gate_compress`, 50 x [7168, 5376]); the header's `low_rank_tensors`,
          `diff_tensors` (.diff and .diff_b) and `set_weight_tensors` counted against the file. The header states the
          rule: "W = W_base + lora_B @ lora_A; then .diff/.diff_b added and .set_weight assigned".
  pdd     alibaba-pai's Acc LoRA (VideoX-Fun `pdd_state_dict`): bare `X.lora_down` [r, in] / `X.lora_up` [out, r] at
          lora_alpha / lora_rank from the header (64 / 64), `adaln_proj.linear` included; the head bank
          `proj_out.{weight,bias}` [N, 96, H] / [N, 96] and `audio_proj_out.{weight,bias}` [N, 32, H] / [N, 32], one
          full head per interval (VideoX-Fun repeats the pretrained head, then distils each).
  turbo   LightX2V's PEFT files, through lora_format.read_lora (every layout it reads); alpha from the header, else the
          family default distilled/families.py passes.

Names: diffusers `ff.net.0.proj` is [value; gate], native `mlp.fc1` [gate; value]: every fc1 payload (B's rows, a
diff's rows) is swapped; to_q / to_k / to_v land in their rows of the de-interleaved `attn.qkv_proj` [q; k; v].
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...errors import UserError
from ..checkpoint.names import native_name
from ..checkpoint.reader import VSA_GATE_KEY
from ..config import H3Config
from ..lora_format import sha256_of
from ..lora_targets import native_target

FASTH3_FORMAT = "fastvideo-lora-v2"
FASTH3_BASE = "MiniMaxAI/MiniMax-H3"
FASTH3_COUNTS = ("low_rank_tensors", "diff_tensors", "set_weight_tensors")
# FastH3 suffixes, longest first (".diff_b" before ".diff"). `.diff_m` is named by TeleFuser's count of the dense
# file but by no writer or loader (FastVideo's extractor never emits it; vLLM-Omni's loader rejects it): refused.
FASTH3_SUFFIXES = ((".lora_A.weight", "lora_A"), (".lora_B.weight", "lora_B"), (".set_weight", "set"),
                   (".diff_b", "diff_b"), (".diff_m", "diff_m"), (".diff", "diff"))
PDD_HEADS = {"proj_out": "video_out", "audio_proj_out": "audio_out"}  # the bank's names -> FinalLayer's heads
PDD_HEADER = ("lora_rank", "lora_alpha", "pdd_num_steps", "pdd_block_size")
GATE_SUFFIX = VSA_GATE_KEY  # the VSA gate's native name (H3Config.vsa_gate's parameter)
GATE_FILE_SUFFIX = ".attn.to_gate_compress.set_weight"  # a FastH3-VSA file's gate: assigned whole


class DistilledError(UserError):
    """A distilled file that cannot be fused into this model; the message names the file and the fix."""


@dataclass
class Patch:
    """What one file gives one native parameter: W + sum(scale * up @ down) + sum(diffs), or an assigned tensor. Each
    term may land on a row slice (to_q in qkv_proj) and have its two row halves swapped first (fc1)."""

    low_rank: list[tuple[torch.Tensor, torch.Tensor, float, slice | None, bool]] = field(default_factory=list)
    diffs: list[tuple[torch.Tensor, slice | None, bool]] = field(default_factory=list)
    assign: torch.Tensor | None = None


@dataclass
class Fusion:
    """A distilled file read into native parameter names (`patches`), with PDD's head bank (`heads`: "video_out" /
    "audio_out" -> (weight [N, out, in], bias [N, out])) and what the record says about it."""

    path: Path
    sha256: str
    layout: str
    scale_rule: str
    header: dict[str, str]
    patches: dict[str, Patch] = field(default_factory=dict)
    heads: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def assigned(self) -> dict[str, torch.Tensor]:
        """The parameters the file assigns whole (FastH3's `.set_weight`: the VSA gates), by native name: what a
        base checkpoint without them takes from the file to build a FastH3-VSA model (checkpoint.reader.load_dit)."""
        return {name: p.assign for name, p in self.patches.items() if p.assign is not None}

    def record(self) -> dict:
        """What a manifest or a clip record keeps about the file."""
        return {"file": self.path.name, "path": str(self.path), "sha256": self.sha256, "layout": self.layout,
                "scale": self.scale_rule, "parameters": len(self.patches), **self.counts}


def read_header(path: Path) -> tuple[dict[str, str], list[str]]:
    """A safetensors file's `__metadata__` and tensor names, no tensor read."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise DistilledError(f"--distilled {path} does not exist; pass a distilled checkpoint's .safetensors file.")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return dict(f.metadata() or {}), list(f.keys())
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise DistilledError(f"--distilled {path} is not a readable safetensors file ({e}).") from None


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


def _target(module: str, kind: str, cfg: H3Config, path: Path) -> tuple[str, slice | None, bool]:
    """(native parameter, its rows or None, whether the payload's halves swap) of a diffusers module's payload:
    `kind` "weight" or "bias"."""
    if kind == "weight":
        return native_target(module, cfg)
    name = native_name(f"{module}.bias")
    if re.search(r"\.attn\.to_[qkv]$", module) or name.endswith(".mlp.fc1.bias"):
        raise DistilledError(f"--distilled {path}: {module} gets a bias delta, but H3's fused qkv_proj and fc1 have "
                             "no bias; this file is not for MiniMax-H3.")
    return name, None, False


def _patch(patches: dict[str, Patch], name: str) -> Patch:
    return patches.setdefault(name, Patch())


def read_fasth3(path: Path, cfg: H3Config, header: dict[str, str]) -> Fusion:
    """A `fastvideo-lora-v2` file (module doc), its header checked: the format, the base model, the counts."""
    path = Path(path)
    if header.get("format") != FASTH3_FORMAT:
        raise DistilledError(f"--distilled {path}: its header says format {header.get('format')!r}, not "
                             f"{FASTH3_FORMAT!r}: not a FastH3 file (name the family if it is another one).")
    base = header.get("base_model")
    if base is not None and base.casefold() != FASTH3_BASE.casefold():
        raise DistilledError(f"--distilled {path} was distilled from {base!r}, not {FASTH3_BASE}: it is a file for "
                             "another base model.")
    state = _tensors(path)
    roles: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in state.items():
        role = next(((key[: -len(suffix)], r) for suffix, r in FASTH3_SUFFIXES if key.endswith(suffix)), None)
        if role is None:
            unknown.append(key)
            continue
        roles.setdefault(role[0], {})[role[1]] = tensor
    if unknown:
        raise DistilledError(f"--distilled {path}: {len(unknown)} tensor(s) are none of .lora_A/.lora_B/.diff/.diff_b/"
                             f".set_weight, e.g. {sorted(unknown)[:3]}.")
    diff_m = sorted(m for m, r in roles.items() if "diff_m" in r)
    if diff_m:
        raise DistilledError(f"--distilled {path}: {diff_m[0]}.diff_m (and {len(diff_m) - 1} more): h3trt does not know "
                             "what a .diff_m payload means (FastVideo's fastvideo-lora-v2 writer emits only .diff, "
                             ".diff_b and .set_weight, and vLLM-Omni's loader refuses it too), so it will not guess.")
    fusion = Fusion(path, sha256_of(path), FASTH3_FORMAT, "lora_B @ lora_A at scale 1 (no alpha), then .diff/.diff_b "
                    "added and .set_weight assigned", header)
    seen = {"low_rank_tensors": 0, "diff_tensors": 0, "set_weight_tensors": 0}
    for module, parts in sorted(roles.items()):
        _fasth3_module(fusion, module, parts, cfg, seen)
    _check_counts(path, header, seen)
    gates = sum(name.endswith(GATE_SUFFIX) and p.assign is not None for name, p in fusion.patches.items())
    if gates not in (0, cfg.num_layers):
        raise DistilledError(f"--distilled {path} sets the VSA gate (attn.to_gate_compress.set_weight) of {gates} of "
                             f"the {cfg.num_layers} main blocks; a FastH3-VSA file sets every block's (a partial "
                             "export?): download it again, or use the dense variant.")
    fusion.counts = seen
    return fusion


def _fasth3_module(fusion: Fusion, module: str, parts: dict[str, torch.Tensor], cfg: H3Config,
                   seen: dict[str, int]) -> None:
    path = fusion.path
    if ("lora_A" in parts) != ("lora_B" in parts):
        raise DistilledError(f"--distilled {path}: {module} has only {sorted(k for k in parts if 'lora' in k)}; a "
                             "low-rank pair needs both lora_A and lora_B.")
    if "lora_A" in parts:
        down, up = parts["lora_A"], parts["lora_B"]
        _check_pair(path, module, down, up)
        name, rows, swap = _target(module, "weight", cfg, path)
        _patch(fusion.patches, name).low_rank.append((down, up, 1.0, rows, swap))
        seen["low_rank_tensors"] += 2
    for role, kind in (("diff", "weight"), ("diff_b", "bias")):
        if role in parts:
            name, rows, swap = _target(module, kind, cfg, path)
            _patch(fusion.patches, name).diffs.append((parts[role], rows, swap))
            seen["diff_tensors"] += 1
    if "set" in parts:
        name, rows, _ = _target(module, "weight", cfg, path)
        if rows is not None:
            raise DistilledError(f"--distilled {path}: {module}.set_weight would replace a third of the fused "
                                 "qkv_proj; h3trt assigns whole parameters only.")
        _patch(fusion.patches, name).assign = parts["set"]
        seen["set_weight_tensors"] += 1


def _check_pair(path: Path, module: str, down: torch.Tensor, up: torch.Tensor) -> None:
    if down.ndim != 2 or up.ndim != 2 or down.shape[0] != up.shape[1]:
        raise DistilledError(f"--distilled {path}: {module} has down {tuple(down.shape)} and up {tuple(up.shape)}; a "
                             "low-rank pair is [r, in] and [out, r].")


def _check_counts(path: Path, header: dict[str, str], seen: dict[str, int]) -> None:
    """The writer records how many tensors of each kind it emitted: the file's one statement of its completeness."""
    for key in FASTH3_COUNTS:
        declared = header.get(key)
        if declared is None:
            raise DistilledError(f"--distilled {path}: its header omits {key}; a fastvideo-lora-v2 file states how many "
                                 "tensors of each kind it holds, so a truncated one can be told from a small one.")
        if not declared.isdigit() or int(declared) != seen[key]:
            raise DistilledError(f"--distilled {path}: its header declares {key}={declared} but the file holds "
                                 f"{seen[key]}: it is incomplete (a truncated or partial export); download it again.")


def read_pdd(path: Path, cfg: H3Config, header: dict[str, str]) -> Fusion:
    """alibaba-pai's PDD Acc LoRA (module doc): the trunk's pairs at lora_alpha / lora_rank and the head bank."""
    path = Path(path)
    values = {}
    for key in PDD_HEADER:
        try:
            values[key] = float(header[key])
        except (KeyError, ValueError):
            raise DistilledError(f"--distilled {path}: its header needs a numeric {key} (a PDD file states "
                                 f"{', '.join(PDD_HEADER)}); got {header.get(key)!r}.") from None
    rank, alpha = int(values["lora_rank"]), values["lora_alpha"]
    state = _tensors(path)
    heads = {}
    for prefix, head in PDD_HEADS.items():
        weight, bias = state.pop(f"{prefix}.weight", None), state.pop(f"{prefix}.bias", None)
        if weight is None or bias is None:
            raise DistilledError(f"--distilled {path}: no {prefix}.weight/.bias head bank; a PDD file holds one "
                                 "final projection per interval for the video and the audio rows.")
        heads[head] = (weight, bias)
    fusion = Fusion(path, sha256_of(path), "pdd (alibaba-pai Acc LoRA)",
                    f"lora_up @ lora_down x lora_alpha / lora_rank = {alpha:g} / {rank}", header, heads=heads)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = re.fullmatch(r"(.+)\.(lora_down|lora_up)", key)
        if m is None:
            raise DistilledError(f"--distilled {path}: {key} is neither a trunk lora_down/lora_up nor a head of the "
                                 "bank; not a PDD file h3trt reads.")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"lora_down", "lora_up"}:
            raise DistilledError(f"--distilled {path}: {module} has only {sorted(pair)}.")
        _check_pair(path, module, pair["lora_down"], pair["lora_up"])
        if pair["lora_down"].shape[0] != rank:
            raise DistilledError(f"--distilled {path}: {module} has rank {pair['lora_down'].shape[0]}, its header "
                                 f"lora_rank {rank}.")
        name, rows, swap = _target(module, "weight", cfg, path)
        _patch(fusion.patches, name).low_rank.append((pair["lora_down"], pair["lora_up"], alpha / rank, rows, swap))
    fusion.counts = {"trunk_modules": len(pairs), "intervals": int(values["pdd_num_steps"]),
                     "block_size": int(values["pdd_block_size"])}
    return fusion


def lora_fusion(lora, modules: dict, cfg: H3Config, scale_rule: str) -> Fusion:
    """A LoraFile's routed modules (lora_targets.route) as a Fusion, each at its scaling (a family's alpha already applied:
    families.turbo_alpha)."""
    fusion = Fusion(Path(lora.path), lora.sha256, lora.layout, scale_rule, {})
    for module, factors in sorted(modules.items()):
        name, rows, swap = native_target(module, cfg)
        _patch(fusion.patches, name).low_rank.append((factors.down, factors.up, factors.scaling, rows, swap))
    fusion.counts = {"modules": len(modules)}
    return fusion
