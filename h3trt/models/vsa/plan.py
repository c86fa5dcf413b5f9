"""Where VSA runs sparse in a FastH3-VSA model, and one request's VSA over its evaluations.

A model whose blocks carry `attn.to_gate_compress` (H3Config.vsa_gate) runs VSA's attention in every evaluation of
every main block (models/vsa/routing.py): the coarse branch is part of the block. What varies is the sparsity:
  - `sparsity` (FastH3 v1 was distilled at 0.9, V2 at 0.8) in the evaluations from `dense_first_steps` on (the
    steps count as FastVideo's `vsa_dense_first_n_steps`: the denoise step index, both guidance branches of a step
    being one evaluation), 0 before;
  - 0 in the main blocks listed in `dense_layers` (FastVideo's `vsa_dense_layers`);
  - sparsity 0 is dense attention with the coarse branch kept (not the base model's attention).
The token refiner has no gate and stays dense (FastVideo builds it without the VSA backend).

Shape legend: B batch, S rows, N heads, D head dim.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ...errors import UserError
from ..packing import PackedLayout
from .fp8 import ALL_VSA_KERNELS, VSA_FP8_KERNELS, vsa_attention_kernel, warm_fp8_vsa_kernel
from .kernels import VSA_KERNELS, warm_vsa_kernel
from .routing import vsa_attention
from .tiles import VSA_TILE_ROWS, layout_geometry

DEFAULT_VSA_SPARSITY = 0.9  # FastH3 4-step v1's (the VSA-DataFree export, trained and served at 0.9)


@dataclass(frozen=True)
class VsaSettings:
    """A FastH3-VSA model's sparse attention: the share of video key tiles skipped, the leading denoise steps kept
    dense, and the main blocks kept dense."""

    sparsity: float = DEFAULT_VSA_SPARSITY
    dense_first_steps: int = 0
    dense_layers: tuple[int, ...] = ()
    # Where the sparsity came from (served_vsa_settings: the file it was distilled at, a flag, a request): what the
    # records say, not what runs (two settings differing only here are equal)
    sparsity_from: str | None = dataclasses.field(default=None, compare=False)

    def to_dict(self) -> dict:
        return {"sparsity": self.sparsity, "dense_first_steps": self.dense_first_steps,
                "dense_layers": list(self.dense_layers),
                **({"sparsity_from": self.sparsity_from} if self.sparsity_from is not None else {})}


@dataclass(frozen=True)
class VsaServing:
    """What a FastH3-VSA engine serves: its settings and the kernel chosen for its device, compiled at load (a
    bundle's manifest records it as `vsa`)."""

    settings: VsaSettings
    kernel: str  # one of models/vsa/fp8.py ALL_VSA_KERNELS (bf16: vsa/kernels.py's; FP8: vsa/fp8.py's)
    # The faster kernels the choice left out on the build device, each with why (choose_vsa_kernel,
    # build/vsa_choice.py): recorded, so a bundle that serves flex or reference says why not fa4
    left_out: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)
    tile: str | None = None  # the fp8 kernel's tile configuration (models/sparse/fp8_triton.py), warmed at load
    # ms of each kernel timed at the bundle's VSA shape ("fa4", "fp8:<tile>"; build/vsa_choice.py): the race's record
    measured_ms: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        return {**self.settings.to_dict(), "kernel": self.kernel,
                **({"tile": self.tile} if self.tile is not None else {}),
                **({"measured_ms": self.measured_ms} if self.measured_ms else {}),
                **({"left_out": self.left_out} if self.left_out else {})}

    @classmethod
    def from_dict(cls, data: dict) -> "VsaServing":
        """From `to_dict`'s object; ValueError (UserError) names what is wrong."""
        if not isinstance(data, dict) or data.get("kernel") not in ALL_VSA_KERNELS:
            raise ValueError(f"a VSA record has a kernel, one of {list(ALL_VSA_KERNELS)}; got {data!r}.")
        tile = data.get("tile")
        if tile is not None and (data["kernel"] != "fp8" or not isinstance(tile, str)):
            raise ValueError(f"a VSA record's tile is the fp8 kernel's configuration name; got {data!r}.")
        settings = vsa_settings(data.get("sparsity"), data.get("dense_first_steps"), data.get("dense_layers"))
        return cls(dataclasses.replace(settings, sparsity_from=data.get("sparsity_from")), data["kernel"],
                   dict(data.get("left_out") or {}), tile, dict(data.get("measured_ms") or {}))


def vsa_settings(sparsity: float | None = None, dense_first_steps: int | None = None,
                 dense_layers: tuple[int, ...] | list[int] | None = None, num_layers: int | None = None) -> VsaSettings:
    """Checked settings from stated values (None: the default); UserError names the flag and what it takes."""
    sparsity = DEFAULT_VSA_SPARSITY if sparsity is None else sparsity
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not math.isfinite(sparsity) \
            or not 0.0 <= sparsity < 1.0:
        raise UserError(f"--vsa-sparsity takes the share of video key tiles skipped, 0 <= s < 1 (0: dense attention "
                        f"with the coarse branch; FastH3 v1 runs 0.9), got {sparsity!r}.")
    first = 0 if dense_first_steps is None else dense_first_steps
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise UserError(f"--vsa-dense-first-steps takes a whole number of denoise steps >= 0, got {first!r}.")
    layers = tuple(dense_layers or ())
    bad = [x for x in layers if isinstance(x, bool) or not isinstance(x, int) or x < 0
           or (num_layers is not None and x >= num_layers)]
    if bad or len(set(layers)) != len(layers):
        span = f"0..{num_layers - 1}" if num_layers is not None else ">= 0"
        raise UserError(f"--vsa-dense-layers takes distinct main-block indices in {span}, got {list(layers)}.")
    return VsaSettings(float(sparsity), first, tuple(sorted(layers)))


def trained_vsa(sparsity: float, source: str) -> dict:
    """What a FastH3-VSA file or export says it was distilled at (a distilled record's `vsa`): its sparsity (a
    default for the served one, not a bound: served_vsa_settings), its 64-token tiles, and where that was read."""
    return {"trained_sparsity": float(sparsity), "tile_size": VSA_TILE_ROWS, "from": source}


def served_vsa_settings(trained: dict | None, sparsity: float | None = None, dense_first_steps: int | None = None,
                        dense_layers=None, num_layers: int | None = None) -> VsaSettings:
    """The VSA a FastH3-VSA model serves: the stated values (build's --vsa-* flags) over the sparsity its file was
    distilled at (`trained`: the distilled record's `vsa`; None: FastH3 v1's 0.9), saying where the sparsity came
    from. The file's sparsity does not bind: FastVideo's fasth3-inference-contract "does not silently change ...
    sparsity" (its loader leaves it to the run), so a flag that differs wins, and the record says so."""
    base = trained["trained_sparsity"] if trained is not None else DEFAULT_VSA_SPARSITY
    if sparsity is None:
        source = trained["from"] if trained is not None else "FastH3 v1's default"
    else:
        source = "--vsa-sparsity" + (f" (the file was distilled at {base:g})" if sparsity != base else "")
    settings = vsa_settings(base if sparsity is None else sparsity, dense_first_steps, dense_layers, num_layers)
    return dataclasses.replace(settings, sparsity_from=source)


def choose_vsa_kernel(device, heads: int, head_dim: int, dtype: torch.dtype, log=None) -> tuple[str, dict[str, str]]:
    """The first of fa4, flex, reference (in that order: fastest first) that loads, compiles and matches the fp32
    definition on `device` for `heads` heads (warm_vsa_kernel), and each faster one left out with why: chosen once,
    then recorded (a bundle's manifest) and never swapped. `log` gets one line naming each kernel left out and why:
    a fallback is never silent."""
    left_out = {}
    for kernel in VSA_KERNELS[::-1]:
        try:
            return load_vsa_kernel(device, heads, head_dim, dtype, kernel), left_out
        except UserError as e:
            left_out[kernel] = str(e)
            if log is not None:
                log(f"VSA kernel {kernel} left out: {e}")
    raise AssertionError("the reference VSA kernel runs on every device")


def load_vsa_kernel(device, heads: int, head_dim: int, dtype: torch.dtype, kernel: str, tile: str | None = None) -> str:
    """`kernel` (at `tile`, the fp8 kernel's configuration), compiled now (warm_vsa_kernel, warm_fp8_vsa_kernel) so
    that no request compiles it. A FastH3-VSA model cannot run without its kernel: one that does not load or compile
    here is a UserError naming it and why, not a substitute."""
    if kernel not in ALL_VSA_KERNELS:
        raise UserError(f"VSA kernels are {ALL_VSA_KERNELS}, got {kernel!r}.")
    try:
        if kernel in VSA_FP8_KERNELS:
            warm_fp8_vsa_kernel(kernel, tile, device, heads, head_dim, dtype)
        else:
            warm_vsa_kernel(kernel, device, heads, head_dim, dtype)
    except Exception as e:  # noqa: BLE001 - the model runs VSA in every evaluation: no kernel, no model
        first = str(e).splitlines()[0] if str(e) else ""
        name = kernel + (f" (tile {tile})" if tile is not None else "")
        raise UserError(f"the {name} VSA kernel does not run on {device} ({type(e).__name__}: {first}); "
                        "FlashAttention-4 (pip install 'h3trt[fa4]') gives fa4 on sm_90+, FlexAttention flex on any "
                        "CUDA GPU, Triton the fp8 kernel on sm_90+, reference and fp8_emulated run anywhere.") from e
    return kernel


class VsaRun:
    """One request's VSA over its denoise evaluations: the pipeline calls `next_evaluation()` once per step before
    the step's DiT call(s); a runner asks `attention(layout, dense_fn)` for the attention of one DiT call, an object
    whose `layer(i)` is main block i's core over (q, k, v, gate) [B, S, N, D]. Under Ulysses it runs after the
    exchange on this rank's heads (every rank routes its own)."""

    def __init__(self, serving: VsaServing):
        self.settings, self.kernel, self.tile = serving.settings, serving.kernel, serving.tile
        self.evaluation = -1
        self.sparse_evaluations: list[int] = []
        self._kept = self._calls = 0.0

    def next_evaluation(self) -> None:
        self.evaluation += 1

    def sparsity(self, layer: int) -> float:
        """The sparsity of main block `layer` in the current evaluation."""
        s = self.settings
        return 0.0 if self.evaluation < s.dense_first_steps or layer in s.dense_layers else s.sparsity

    def attention(self, layout: PackedLayout, dense_fn) -> "VsaCall":
        """The attention of one DiT call over `layout`; `dense_fn` (q, k, v) -> out is the dense attention of the
        runner (its kernel), what an evaluation or layer where every tile is kept runs."""
        if self.evaluation < 0:
            raise ValueError("VsaRun.attention before next_evaluation(): the pipeline counts evaluations from 0.")
        return VsaCall(self, layout_geometry(layout).to(layout.token_tags.device), dense_fn)

    def record(self, kept: float, sparse: bool) -> None:
        self._kept += kept
        self._calls += 1
        if sparse and (not self.sparse_evaluations or self.sparse_evaluations[-1] != self.evaluation):
            self.sparse_evaluations.append(self.evaluation)

    def report(self) -> dict:
        """The clip record's `sparse_attention`: VSA's settings, its kernel, the evaluations (from 0) that ran sparse
        and the mean fraction of (query tile, key tile) pairs computed over every block call (1.0 is dense)."""
        return {"mode": "vsa", **self.settings.to_dict(), "kernel": self.kernel,
                **({"tile": self.tile} if self.tile is not None else {}), "evaluations": self.evaluation + 1,
                "sparse_evaluations": list(self.sparse_evaluations),
                "kept_fraction": round(self._kept / self._calls, 6) if self._calls else None}

    def record_fields(self) -> dict:
        """Its part of the clip's record (models/runner.py RecordPart)."""
        return {"sparse_attention": self.report()}


class VsaCall:
    """The VSA attention of one DiT call: `layer(i)` is block i's (q, k, v, gate) -> out."""

    def __init__(self, run: VsaRun, geometry, dense_fn):
        self.run, self.geometry, self.dense_fn = run, geometry, dense_fn

    def layer(self, i: int):
        sparsity = self.run.sparsity(i)

        def attend(q_BSND, k_BSND, v_BSND, gate_BSND):
            if q_BSND.shape[1] != self.geometry.seq_len:
                raise ValueError(f"VSA got {q_BSND.shape[1]} rows for a layout of {self.geometry.seq_len}.")
            out, kept = vsa_attention(q_BSND, k_BSND, v_BSND, gate_BSND, self.geometry, sparsity,
                                      vsa_attention_kernel(self.run.kernel, self.run.tile), self.dense_fn)
            self.run.record(kept, kept < 1.0)
            return out

        return attend


def request_vsa_run(serving: VsaServing | None, subblock_asked: bool, sparsity: float | None = None) -> VsaRun | None:
    """A request's VsaRun on a FastH3-VSA model (`serving`; None: the model is none, and so is the run), at the
    request's `sparsity` where it states one (its vsa_sparsity; 0: dense attention, the coarse branch kept), else the
    model's; check_vsa_request first."""
    check_vsa_request(serving, subblock_asked, sparsity)
    if serving is None:
        return None
    if sparsity is not None:
        settings = dataclasses.replace(serving.settings, sparsity=vsa_settings(sparsity).sparsity,
                                       sparsity_from="the request's vsa_sparsity")
        serving = dataclasses.replace(serving, settings=settings)
    return VsaRun(serving)


def check_vsa_request(serving: VsaServing | None, subblock_asked: bool, sparsity: float | None) -> None:
    """A request that asks a FastH3-VSA model for SubBlock's sparse attention, or another model for a VSA sparsity:
    one line naming the fix."""
    if serving is not None and subblock_asked:
        raise UserError(f"this model is FastH3-VSA: its attention is VSA at its settings (sparsity "
                        f"{serving.settings.sparsity:g}), and SubBlock's sparse_attention does not apply to it. "
                        "Drop it (VSA's sparsity per request: vsa_sparsity).", field="sparse_attention")
    if serving is None and sparsity is not None:
        raise UserError("vsa_sparsity sets a FastH3-VSA model's VSA, and this model has no VSA gate "
                        "(attn.to_gate_compress). Drop it (block-sparse attention for any model: sparse_attention).",
                        field="vsa_sparsity")


def vsa_call(run, layout: PackedLayout, dense_fn) -> VsaCall:
    """`run.attention(layout, dense_fn)` for a FastH3-VSA model's runner, refusing anything but a VsaRun (a model
    with the gate has no attention without VSA's coarse branch)."""
    if not isinstance(run, VsaRun):
        raise ValueError("A FastH3-VSA DiT runs VSA in every evaluation: pass the request's VsaRun as `extras.sparse` "
                         f"(H3Pipeline.new_sparse_run makes it), got {type(run).__name__}.")
    return run.attention(layout, dense_fn)
