"""LoRA adapters beside the weights, not merged: slot buffers on the main blocks' linears, filled from LoRA files.

Each targeted linear of the block stack computes

    y = base(x) + sum_k scale_k * (x @ A_k^T) @ B_k^T        (A: down [r, in], B: up [out, r], k: this evaluation's
                                                              adapters, each in its slot)

when the evaluation carries adapters, and exactly `base(x)` (the same ops, no side branch traced or run) when it
carries none: `H3DiT.forward(..., lora=None)`. The base weights are untouched (bf16, or FP8 / NVFP4 with their scales:
the side branch only calls the base module); the side branch runs in the slots' dtype (bf16 on the GPU, fp32 in the
CPU tests).

The factors are DATA, never code. Every targeted linear owns a bank of fixed shape, N slots of max rank R:
    down [N, P, R, in], up [N, P, O, R]   (P parts of O rows each: the fused QKV is P = 3, one part per q / k / v
                                           LoRA module, as `lora.native_target` slices its rows; every other P = 1)
An adapter of rank r <= R fills rows [:r] of its slot and leaves the rest zero, which adds exact zeros; peft's
per-module scaling (alpha / rank, `lora.read_lora`) is folded into up at load, and fc1's [value; gate] halves are
swapped to the native [gate; value] there. Loading is copying into those tensors; the evaluation's choice is two
small tensors, slots [K] (int64) and scales [K] (fp32), so neither loading nor switching adapters recompiles.

Compiled segments: a bundle's block with adapters is a second segment beside the plain one,
    block_lora(x, mod, adaln_index, cos, sin, lora_slots, lora_scales, *W, *LoRA) -> x
whose function builds `BlockLora.from_inputs(LoRA names -> tensors, lora_slots, lora_scales)` and calls the block with
it; `LoraSlots.block_inputs(i)` names layer i's bank tensors. The runner picks in Python, before the compiled call:
the plain `block` segment for an evaluation without adapters (bit for bit the bundle built without slots), `block_lora`
otherwise. K, the number of adapters per evaluation, is a shape of that segment (compile it for K = 1, or pad with
scale 0). tests/test_lora_slots.py::test_a_compiled_block_does_not_recompile_when_the_adapter_changes shows it.

Mixed batches: NOT carried. One evaluation holds one adapter set for all its batch rows (slots and scales have no
batch dimension, and neither has the modulation table that adaln_proj's adapters change); the caller splits batches by
adapter set (and strength).

Loading into a slot that a queued evaluation has selected changes what that evaluation computes: the caller loads into
a free slot and unloads one that no queued evaluation names.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import H3Config
from .lora import native_target, route
from .lora_file import LoraError, LoraFile, LoraModule, pruned_message, read_lora

# The main block's linears a slot may adapt, named from the block (as `dit.project` names them).
BLOCK_TARGETS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2", "adaln_proj.linear")
# A bundle serves the AdaLN projection outside its compiled block (baked tables or the kept weights: engines/adaln.py),
# so that target's side branch is added to the modulation table by the runner, and the block segment never takes it.
ADALN_TARGET = "adaln_proj.linear"
_BLOCK_WEIGHT = re.compile(r"blocks\.(\d+)\.(.+)\.weight")


def target_shape(cfg: H3Config, local: str) -> tuple[int, int, int]:
    """(in features, out features, parts) of a main block's linear: the fused QKV has 3 parts (q, k, v rows)."""
    shapes = {
        "attn.qkv_proj": (cfg.hidden_size, 3 * cfg.inner_dim, 3),
        "attn.out_proj": (cfg.inner_dim, cfg.hidden_size, 1),
        "mlp.fc1": (cfg.hidden_size, 2 * cfg.ffn_dim, 1),
        "mlp.fc2": (cfg.ffn_dim, cfg.hidden_size, 1),
        "adaln_proj.linear": (cfg.time_embed_dim, cfg.modulation_dim, 1),
    }
    if local not in shapes:
        raise ValueError(f"{local!r} is not a main block linear; slots adapt {list(shapes)}.")
    return shapes[local]


def lora_delta(x: torch.Tensor, down_NPRI: torch.Tensor, up_NPOR: torch.Tensor, slots_K: torch.Tensor,
               scales_K: torch.Tensor) -> torch.Tensor:
    """The side branch sum_k scale_k * (x @ A_k^T) @ B_k^T for x [..., I] over the K selected slots: [..., P * O]
    in the banks' dtype. Every factor is a tensor input: its values change, its code does not."""
    down_KPRI = down_NPRI.index_select(0, slots_K)
    up_KPOR = up_NPOR.index_select(0, slots_K)
    h = torch.einsum("...i,kpri->...kpr", x.to(down_KPRI.dtype), down_KPRI)
    h = h * scales_K.to(h.dtype)[:, None, None]  # the strength on the rank-r activations, the smallest tensor
    return torch.einsum("...kpr,kpor->...po", h, up_KPOR).flatten(-2)


@dataclass
class BlockLora:
    """One main block's side branches in one evaluation (dit.BlockAdapters): its banks by local linear name, and the
    evaluation's slots [K] and scales [K]. A plain container of tensors, so a compiled segment builds it from inputs."""

    banks: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "attn.qkv_proj" -> (down [N, P, R, I], up [N, P, O, R])
    slots_K: torch.Tensor
    scales_K: torch.Tensor

    @classmethod
    def from_inputs(cls, inputs: dict[str, torch.Tensor], slots_K: torch.Tensor, scales_K: torch.Tensor) -> "BlockLora":
        """From `LoraSlots.block_inputs` names ("attn.qkv_proj.lora_down", "...lora_up") -> tensors."""
        locals_ = sorted({n.rsplit(".", 1)[0] for n in inputs})
        return cls({n: (inputs[f"{n}.lora_down"], inputs[f"{n}.lora_up"]) for n in locals_}, slots_K, scales_K)

    def __call__(self, name: str, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = linear(x)
        if name not in self.banks:
            return y
        down, up = self.banks[name]
        return y + lora_delta(x, down, up, self.slots_K, self.scales_K).to(y.dtype)


@dataclass
class LoraRun:
    """The adapters one DiT evaluation carries (dit.DiTAdapters), from `LoraSlots.select`."""

    blocks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]  # per layer: "mlp.fc1" -> (down, up)
    slots_K: torch.Tensor
    scales_K: torch.Tensor

    def block(self, i: int) -> BlockLora:
        return BlockLora(self.blocks[i], self.slots_K, self.scales_K)


@dataclass(frozen=True)
class SlotRecord:
    """What a slot holds: the file (and its hash, for records), how it was read, its rank and the linears it adapts."""

    file: str
    path: str
    sha256: str
    layout: str
    alpha: str
    component: str
    rank: int  # the largest rank of its modules
    targets: tuple[str, ...]  # native linear names, "blocks.0.attn.qkv_proj", ... (a fused QKV once)
    nbytes: int  # the factors' size in the file's dtypes


@dataclass
class _Write:
    """One LoRA module's factors, checked and shaped for its bank part (up scaled by peft's scaling, fc1 swapped)."""

    bank: str
    part: int
    down: torch.Tensor
    up: torch.Tensor


class LoraSlots:
    """N adapter slots of max rank R on the main blocks' `targets` of a model `cfg` serving `task` (its partition,
    routed as `lora.route` routes a merge). Base weights are not held here: the DiT runs with `lora=slots.select(..)`.

    Memory: every bank holds N x R x (in + out) values per targeted linear of every block."""

    def __init__(self, cfg: H3Config, task: str, num_slots: int, max_rank: int, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", targets: tuple[str, ...] = BLOCK_TARGETS):
        if num_slots < 1 or max_rank < 1:
            raise LoraError(f"LoRA slots need at least one slot of rank >= 1; got {num_slots} slot(s) of max rank "
                            f"{max_rank}.")
        self.cfg, self.task, self.num_slots, self.max_rank = cfg, task, num_slots, max_rank
        self.targets = tuple(targets)
        self.banks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(cfg.num_layers):
            for local in self.targets:
                n_in, n_out, parts = target_shape(cfg, local)
                self.banks[f"blocks.{i}.{local}"] = (
                    torch.zeros(num_slots, parts, max_rank, n_in, dtype=dtype, device=device),
                    torch.zeros(num_slots, parts, n_out // parts, max_rank, dtype=dtype, device=device))
        self.by_block = [{local: self.banks[f"blocks.{i}.{local}"] for local in self.targets}
                         for i in range(cfg.num_layers)]
        self.records: dict[int, SlotRecord] = {}  # slot -> what it holds; a slot not here is empty (all zeros)

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.num_slots:
            raise LoraError(f"LoRA slot {slot!r} does not exist: there are {self.num_slots} slot(s), 0 to "
                            f"{self.num_slots - 1}; pick one of those, or create the slots with more of them.")

    def load(self, slot: int, path: str | Path | LoraFile) -> SlotRecord:
        """Read the LoRA file at `path` (every layout `lora.read_lora` reads, its alpha rules and refusals; or a file
        read already) into `slot`, replacing what it held. Everything is checked before the slot is written: a
        refused file leaves the slot as it was."""
        self._check_slot(slot)
        lora = path if isinstance(path, LoraFile) else read_lora(path, self.cfg.head_dim)
        path = lora.path
        prefix, modules = route(lora, self.task)
        writes = [self._plan(lora, prefix, module, factors) for module, factors in modules.items()]
        self._clear(slot)
        for w in writes:
            down, up = self.banks[w.bank]
            r = w.down.shape[0]
            down[slot, w.part, :r] = w.down.to(down.dtype)
            up[slot, w.part, :, :r] = w.up.to(up.dtype)
        record = SlotRecord(Path(path).name, str(path), lora.sha256, lora.layout, lora.alpha_rule, prefix,
                            max(w.down.shape[0] for w in writes), tuple(sorted({w.bank for w in writes})),
                            sum(f.down.nbytes + f.up.nbytes for f in modules.values()))
        self.records[slot] = record
        return record

    def unload(self, slot: int) -> None:
        """Empty `slot` (zeros); selecting it afterwards is refused."""
        self._check_slot(slot)
        self._clear(slot)
        self.records.pop(slot, None)

    def _clear(self, slot: int) -> None:
        for down, up in self.banks.values():
            down[slot].zero_()
            up[slot].zero_()

    def _plan(self, lora: LoraFile, prefix: str, module: str, factors: LoraModule) -> _Write:
        """Where one LoRA module goes (bank and part) and its factors as they will be written; every refusal here."""
        cfg, where = self.cfg, f"--lora {lora.path}: {prefix}.{module}"
        name, rows, swap = native_target(module, cfg)
        m = _BLOCK_WEIGHT.fullmatch(name)
        bank = name.removesuffix(".weight")
        if m is None or int(m.group(1)) >= cfg.num_layers or m.group(2) not in BLOCK_TARGETS:
            raise LoraError(f"{where} adapts {bank}, which is not a linear of the main blocks' attention, MLP or "
                            "AdaLN: LoRA slots hold only those. Merge this LoRA instead (h3trt run --model ... --lora, "
                            "or h3trt build --lora).")
        if bank not in self.banks:
            raise LoraError(f"{where} adapts {bank}, which these slots do not hold (they adapt {list(self.targets)} "
                            "of every block); create the slots with it among their targets, or merge this LoRA.")
        down, up = factors.down, factors.up
        n_in, n_out, parts = target_shape(cfg, m.group(2))
        part = 0 if rows is None else rows.start // (n_out // parts)
        if down.shape[1] != n_in:
            if m.group(2) == "adaln_proj.linear":
                raise LoraError(pruned_message(lora.path, f"its {bank} LoRA takes {down.shape[1]} inputs; the "
                                                f"unpruned adaln_proj takes {n_in}"))
            raise LoraError(f"{where} takes {down.shape[1]} inputs but the model's {bank} takes {n_in}; this LoRA is "
                            "for another model size.")
        if up.shape[0] != n_out // parts:
            raise LoraError(f"{where} has {up.shape[0]} output rows but the model's {bank}"
                            f"{' part' if parts > 1 else ''} has {n_out // parts}; this LoRA is for another model size.")
        rank = down.shape[0]
        if rank > self.max_rank:
            raise LoraError(f"{where} has rank {rank}, over the slots' max rank {self.max_rank}; create the slots with "
                            f"max rank >= {rank} (a model's: h3trt serve --lora-max-rank; a bundle's: h3trt build "
                            "--lora-max-rank), or merge this LoRA.")
        if not (torch.isfinite(down).all() and torch.isfinite(up).all()):
            raise LoraError(f"{where} holds non-finite values (NaN or inf); the file is damaged: retrain or re-export "
                            "it.")
        up = up.float() * factors.scaling
        if swap:  # diffusers [value; gate] -> native [gate; value]
            up = torch.cat(up.chunk(2, dim=0)[::-1])
        return _Write(bank, part, down.float(), up)

    def select(self, uses: list[tuple[int, float]] | tuple[tuple[int, float], ...]) -> LoraRun | None:
        """The adapters of one evaluation, (slot, scale) each, the same for every batch row; None for none, which
        runs the base model exactly (`H3DiT.forward(..., lora=None)`)."""
        if not uses:
            return None
        for slot, scale in uses:
            self._check_slot(slot)
            if slot not in self.records:
                raise LoraError(f"LoRA slot {slot} holds no adapter; load one into it first, or pick a loaded slot "
                                f"({sorted(self.records) or 'none is loaded'}).")
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
                raise LoraError(f"LoRA scale {scale!r} for slot {slot} is not a finite number; pass one (1.0: as "
                                "trained, 0: off).")
        device = next(iter(self.banks.values()))[0].device
        slots = torch.tensor([s for s, _ in uses], dtype=torch.int64, device=device)
        scales = torch.tensor([float(s) for _, s in uses], dtype=torch.float32, device=device)
        return LoraRun(self.by_block, slots, scales)

    def segment_inputs(self, i: int, names: list[str]) -> list[torch.Tensor]:
        """Layer i's bank tensors in the order a compiled segment lists them (`segment_lora_names`)."""
        inputs = self.block_inputs(i)
        return [inputs[n] for n in names]

    def block_inputs(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's bank tensors under the names a compiled `block_lora` segment takes them by (BlockLora.from_inputs):
        "attn.qkv_proj.lora_down", "attn.qkv_proj.lora_up", ..."""
        out = {}
        for local, (down, up) in self.by_block[i].items():
            out[f"{local}.lora_down"], out[f"{local}.lora_up"] = down, up
        return out


def segment_lora_names(targets: tuple[str, ...]) -> list[str]:
    """The bank inputs of a compiled block segment with adapters, in order: down and up of every target but AdaLN's."""
    return [f"{local}.lora_{part}" for local in targets if local != ADALN_TARGET for part in ("down", "up")]
