"""LoRA adapters beside the weights, not merged: slot buffers on the main blocks' linears, filled from LoRA files.

Each targeted linear of the block stack computes

    y = base(x) + sum_k scale_k * (x @ A_k^T) @ B_k^T        (A: down [r, in], B: up [out, r], k: this evaluation's
                                                              adapters, each in its slot)

when the evaluation carries adapters, and exactly `base(x)` (the same ops, no side branch traced or run) when it
carries none: `H3DiT.forward(..., adapters=None)`. The base weights are untouched (bf16, or FP8 / NVFP4 with their scales);
the factors are held in the slots' dtype (bf16 on the GPU, fp32 in the CPU tests).

The factors are DATA, never code. Every targeted linear owns a bank of fixed shape, N slots of max rank R:
    down [N, P, R, in], up [N, P, R, O]   (P parts of O rows each: the fused QKV is P = 3, one part per q / k / v
                                           LoRA module, as `lora_targets.native_target` slices its rows; every other
                                           P = 1)
An adapter of rank r <= R fills rank rows [:r] of its slot; peft's per-module scaling (alpha / rank,
`lora_format.read_lora`) is folded into up at load, and fc1's [value; gate] halves are swapped to the native
[gate; value] there. Loading is copying into those tensors (`AdapterSlots.read` streams a file onto the banks' device:
stream.py).

An evaluation's choice is its RANK ROWS, two small tensors: rows [G, 16] (int64, e = slot * R + j: row j of a slot)
and their scales [G, 16] (fp32, the row's adapter strength). `select` lists, for each adapter at a nonzero scale, the
rows of its own rank (`SlotRecord.rank`) and nothing of the slot's padding; an adapter at scale 0 is left out (it adds
nothing), and an evaluation whose every adapter is at scale 0 carries none (`select` gives None: the base, bit for
bit). The list is padded to whole groups of ROW_GROUP rows, at least MIN_ROW_GROUPS of them, with its first row at
scale 0 (an exact zero, and the FP8 layout's ranges unchanged): the arithmetic depends on the adapters alone, never
on how many slots there are or their max rank, so every front door (`run --adapter`'s slots fitted to its files,
`serve --lora-dir`'s of rank 64) computes the same bytes. G varies with the adapter set; it is a dynamic dimension of
the compiled segment, so neither loading nor switching adapters recompiles.

How a linear adds its rows (`LAYOUTS`; `FUSED` is the default, `DELTA` the reference and the old arithmetic):
  - FUSED, a bf16 (or fp32) linear and NVFP4's dequantized weight: the rows merged into the weight for this call,
    W + sum_e s_e * B_e^T A_e (one batched GEMM over the weight, whose cost does not grow with the rows of x), then
    one GEMM; no [rows, out] side tensor is written and read back.
  - FUSED, an FP8 linear (calibration/formats.py fp8_adapter_linear): A's rows computed from the base's own e4m3
    input, then ONE FP8 GEMM over [x | h] and [W | B^T]: the up-projection rides in the base GEMM's reduction.
  - DELTA: base(x) + (x A^T * s) B^T, two GEMMs beside the base and an [rows, out] tensor added to its output.
The AdaLN projection's rows run as DELTA always: it sees T rows (distinct timesteps), not the sequence.

Compiled segments: a bundle's block with adapters is a second segment beside the plain one,
    block_lora(x, mod, adaln_index, cos, sin, lora_rows, lora_row_scales, *W, *LoRA) -> x
whose function builds `AdapterBlock.from_inputs(LoRA names -> tensors, lora_rows, lora_row_scales)` and calls the block
with it; `AdapterSlots.block_inputs(i)` names layer i's bank tensors. The runner picks in Python, before the compiled
call: the plain `block` segment for an evaluation without adapters (bit for bit the bundle built without slots),
`block_lora` otherwise. A bundle built with --sparse-attention too has the halves' twins as well (block_pre_lora,
block_post_lora: the same rank rows, each half's own banks), which a sparse evaluation with adapters runs around its
block-sparse attention.

Mixed batches: NOT carried. One evaluation holds one adapter set for all its batch rows (rows and scales have no
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
import torch.nn.functional as F

from ..models.config import H3Config
from ..models.lora_format import LoraError, LoraFile, LoraModule, pruned_message
from ..models.lora_targets import native_target, route
from ..models.weight_layout import swap_halves

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


ROW_GROUP = 16  # rank rows go in groups of 16: an FP8 GEMM's reduction (in + rows) must stay a multiple of 16
MIN_ROW_GROUPS = 2  # a compiled segment's dynamic dimensions start at 2 (build/backends.py export_segment)
FUSED, DELTA = "fused", "delta"
LAYOUTS = (FUSED, DELTA)


def row_groups(rows: list[int], scales: list[float], device: torch.device,
               groups: int = MIN_ROW_GROUPS) -> tuple[torch.Tensor, torch.Tensor]:
    """An evaluation's rank rows and their scales as [G, ROW_GROUP] tensors on `device`: padded to whole groups, at
    least `groups`, with the first row at scale 0 (an exact zero, on a row already listed)."""
    pad = max(groups * ROW_GROUP, -(-len(rows) // ROW_GROUP) * ROW_GROUP) - len(rows)
    rows_GR = torch.tensor(rows + rows[:1] * pad, dtype=torch.int64).view(-1, ROW_GROUP)
    scales_GR = torch.tensor(scales + [0.0] * pad, dtype=torch.float32).view(-1, ROW_GROUP)
    return rows_GR.to(device), scales_GR.to(device)


def gather_rows(bank_NPRC: torch.Tensor, rows_E: torch.Tensor) -> torch.Tensor:
    """The evaluation's rank rows of one bank (down [N, P, R, in] or up [N, P, R, out]): [P, E, C], row e of part p
    being bank[e // R, p, e % R]."""
    slots, parts, rank, width = bank_NPRC.shape
    part_P1 = torch.arange(parts, device=rows_E.device)[:, None]
    index_PE = ((rows_E // rank)[None, :] * parts + part_P1) * rank + (rows_E % rank)[None, :]
    return bank_NPRC.reshape(slots * parts * rank, width).index_select(0, index_PE.reshape(-1)).view(parts, -1, width)


def adapter_delta(x: torch.Tensor, down_PEI: torch.Tensor, up_PEO: torch.Tensor,
                  scales_E: torch.Tensor) -> torch.Tensor:
    """The side branch sum_e scale_e * (x @ A_e^T) B_e for x [..., I] over the rank rows: [..., P * O] in the
    factors' dtype (the DELTA layout, and the reference every layout is checked against)."""
    h = torch.einsum("...i,pei->...pe", x.to(down_PEI.dtype), down_PEI)
    h = h * scales_E.to(h.dtype)  # the strength on the rank-r activations, the smallest tensor
    return torch.einsum("...pe,peo->...po", h, up_PEO).flatten(-2)


def merged_weight(weight_OI: torch.Tensor, down_PEI: torch.Tensor, up_PEO: torch.Tensor,
                  scales_E: torch.Tensor) -> torch.Tensor:
    """W + sum_e scale_e * B_e^T A_e per part, in W's dtype, rounded once (the GEMM adds W in fp32): the weight a
    FUSED linear computes with for this call (the rows' strengths go on up, in fp32, before it is rounded)."""
    parts, _, n_in = down_PEI.shape
    up_PEO = (up_PEO.float() * scales_E[None, :, None]).to(weight_OI.dtype)
    merged = torch.baddbmm(weight_OI.reshape(parts, -1, n_in), up_PEO.transpose(1, 2), down_PEI.to(weight_OI.dtype))
    return merged.reshape(weight_OI.shape)


def adapted_linear(linear: torch.nn.Module, x: torch.Tensor, down_PEI: torch.Tensor, up_PEO: torch.Tensor,
                   scales_E: torch.Tensor) -> torch.Tensor:
    """`linear(x)` with the rank rows, FUSED: a plain nn.Linear computes with the merged weight; a quantized linear
    (calibration/modules.py) brings its own `with_adapters` (FP8: the rows in its GEMM; NVFP4: merged into its
    dequantized weight)."""
    if type(linear) is torch.nn.Linear:
        return F.linear(x, merged_weight(linear.weight, down_PEI, up_PEO, scales_E), linear.bias)
    with_adapters = getattr(linear, "with_adapters", None)
    if with_adapters is None:
        raise TypeError(f"{type(linear).__name__} has no fused LoRA arithmetic (with_adapters); adapt an nn.Linear or "
                        "one of calibration/modules.py's quantized linears.")
    return with_adapters(x, down_PEI, up_PEO, scales_E)


@dataclass
class AdapterBlock:
    """One main block's side branches in one evaluation (models/runner.py BlockAdapters): its banks by local linear
    name, the evaluation's rank rows [E] and their scales [E], and the layout that adds them. A plain container of
    tensors, so a compiled segment builds it from inputs."""

    banks: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "attn.qkv_proj" -> (down [N, P, R, I], up [N, P, R, O])
    rows_E: torch.Tensor
    scales_E: torch.Tensor
    layout: str = FUSED

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"LoRA layout {self.layout!r}: pick one of {LAYOUTS}.")

    @classmethod
    def from_inputs(cls, inputs: dict[str, torch.Tensor], rows: torch.Tensor, scales: torch.Tensor,
                    layout: str = FUSED) -> "AdapterBlock":
        """From `AdapterSlots.block_inputs` names ("attn.qkv_proj.lora_down", "...lora_up") -> tensors, and a segment's
        lora_rows / lora_row_scales [G, ROW_GROUP]."""
        locals_ = sorted({n.rsplit(".", 1)[0] for n in inputs})
        return cls({n: (inputs[f"{n}.lora_down"], inputs[f"{n}.lora_up"]) for n in locals_}, rows.reshape(-1),
                   scales.reshape(-1), layout)

    def __call__(self, name: str, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if name not in self.banks:
            return linear(x)
        down_PEI, up_PEO = (gather_rows(bank, self.rows_E) for bank in self.banks[name])
        if self.layout == DELTA or name == ADALN_TARGET:
            y = linear(x)
            return y + adapter_delta(x, down_PEI, up_PEO, self.scales_E).to(y.dtype)
        return adapted_linear(linear, x, down_PEI, up_PEO, self.scales_E)


@dataclass
class AdapterRun:
    """The adapters one DiT evaluation carries (models/runner.py DiTAdapters), from `AdapterSlots.select`."""

    blocks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]  # per layer: "mlp.fc1" -> (down, up)
    rows: torch.Tensor  # [G, ROW_GROUP] int64: the rank rows (module doc)
    row_scales: torch.Tensor  # [G, ROW_GROUP] fp32
    uses: tuple[tuple[int, float], ...]  # every (slot, scale) asked, those at scale 0 (not in the rows) included

    def block(self, i: int, layout: str = FUSED) -> AdapterBlock:
        return AdapterBlock(self.blocks[i], self.rows.reshape(-1), self.row_scales.reshape(-1), layout)

    def record_fields(self) -> dict:
        """Nothing of its own (models/runner.py RecordPart): the clip's `adapters` are the resident set's record of
        the request's adapters, which names those at scale 0 too, that no evaluation carries."""
        return {}


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
    where: str  # the module, as a refusal names it
    finite: torch.Tensor  # 0-d bool on the factors' device: checked for every module at once (one device sync)


class AdapterSlots:
    """N adapter slots of max rank R on the main blocks' `targets` of a model `cfg` serving `task` (its partition,
    routed as `lora_targets.route` routes a merge). Base weights are not held here: the DiT runs with
    `adapters=slots.select(..)`.

    Memory: every bank holds N x R x (in + out) values per targeted linear of every block."""

    _staging = None  # stream.Staging: the pinned buffers a file is streamed through (made at the first read)

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
                    torch.zeros(num_slots, parts, max_rank, n_out // parts, dtype=dtype, device=device))
        self.by_block = [{local: self.banks[f"blocks.{i}.{local}"] for local in self.targets}
                         for i in range(cfg.num_layers)]
        self.records: dict[int, SlotRecord] = {}  # slot -> what it holds; a slot not here is empty (all zeros)

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.num_slots:
            raise LoraError(f"LoRA slot {slot!r} does not exist: there are {self.num_slots} slot(s), 0 to "
                            f"{self.num_slots - 1}; pick one of those, or create the slots with more of them.")

    @property
    def device(self) -> torch.device:
        return next(iter(self.banks.values()))[0].device

    def read(self, path: str | Path) -> LoraFile:
        """The LoRA file at `path` read once, hashed as it is read, onto the banks' device (stream.py):
        every layout, alpha rule and refusal of `lora_format.read_lora`, without its second pass over the file."""
        from .stream import Staging, read_lora_to

        if self._staging is None:
            self._staging = Staging(self.device)
        return read_lora_to(path, self.device, self.cfg.head_dim, self._staging)

    def load(self, slot: int, path: str | Path | LoraFile) -> SlotRecord:
        """Read the LoRA file at `path` (`read`; or a file read already) into `slot`, replacing what it held.
        Everything is checked before the slot is written (finiteness on the factors' device, for every module at
        once): a refused file leaves the slot as it was."""
        self._check_slot(slot)
        lora = path if isinstance(path, LoraFile) else self.read(path)
        path = lora.path
        prefix, modules = route(lora, self.task)
        writes = [self._plan(lora, prefix, module, factors) for module, factors in modules.items()]
        finite = torch.stack([w.finite for w in writes]).tolist()  # on the factors' device: one sync
        if not all(finite):
            raise LoraError(f"{writes[finite.index(False)].where} holds non-finite values (NaN or inf); the file is "
                            "damaged: retrain or re-export it.")
        self._clear(slot)
        for w in writes:
            down, up = self.banks[w.bank]
            r = w.down.shape[0]
            down[slot, w.part, :r] = w.down
            up[slot, w.part, :r] = w.up.t()
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
        finite = torch.isfinite(down).all() & torch.isfinite(up).all()
        up = up.float() * factors.scaling
        if swap:  # diffusers [value; gate] -> native [gate; value]
            up = swap_halves(up)
        return _Write(bank, part, down, up, where, finite)

    def select(self, uses: list[tuple[int, float]] | tuple[tuple[int, float], ...]) -> AdapterRun | None:
        """The adapters of one evaluation, (slot, scale) each, the same for every batch row, as rank rows (module
        doc); None for none, or for adapters all at scale 0, which runs the base model exactly
        (`H3DiT.forward(..., adapters=None)`)."""
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
        rows, scales = [], []
        for slot, scale in uses:
            if scale != 0:  # an adapter at scale 0 adds nothing: its rows are not computed
                rank = self.records[slot].rank
                rows += range(slot * self.max_rank, slot * self.max_rank + rank)
                scales += [float(scale)] * rank
        if not rows:
            return None
        return AdapterRun(self.by_block, *row_groups(rows, scales, self.device),
                       tuple((slot, float(scale)) for slot, scale in uses))

    def segment_inputs(self, i: int, names: list[str]) -> list[torch.Tensor]:
        """Layer i's bank tensors in the order a compiled segment lists them (`segment_lora_names`)."""
        inputs = self.block_inputs(i)
        return [inputs[n] for n in names]

    def block_inputs(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's bank tensors under the names a compiled `block_lora` segment takes them by
        (AdapterBlock.from_inputs): "attn.qkv_proj.lora_down", "attn.qkv_proj.lora_up", ..."""
        out = {}
        for local, (down, up) in self.by_block[i].items():
            out[f"{local}.lora_down"], out[f"{local}.lora_up"] = down, up
        return out


# A compiled block_lora's inputs after its plain block's: the evaluation's rank rows and their scales [G, ROW_GROUP].
LORA_INPUTS = ("lora_rows", "lora_row_scales")


def segment_lora_names(targets: tuple[str, ...]) -> list[str]:
    """The bank inputs of a compiled block segment with adapters, in order: down and up of every target but AdaLN's."""
    return [f"{local}.lora_{part}" for local in targets if local != ADALN_TARGET for part in ("down", "up")]
