"""Calibration through NVIDIA ModelOpt, over real denoising trajectories of the model being built, and the export of
its quantizers into h3trt's FP8/NVFP4 modules. The TensorRT backend exports the same quantizers as ONNX Q/DQ
(h3trt/build/onnx_export.py), so both backends take their scales from one calibration.

  1. `calibration_tree`: what ModelOpt quantizes, and nothing else. It gets a tree of containers holding the DiT's own
     modules under their DiT names (`blocks.3.mlp.fc1`): the recipe's block linears and, with --fp8-attention, one
     `AttentionCore` per block (q/k/v quantizers; v centered as h3trt's FP8 attention quantizes it). ModelOpt converts
     modules in place, so the DiT's forward runs through its quantizers; adaln_proj, the refiner and the heads are
     never in the tree and never wrapped.
  2. the forward loop, a `Forward`: for a build, h3trt/calibration/trajectories.py (real denoising trajectories of
     the model being built); tests and benchmarks pass their own.
  3. `calibrate`: `mtq.quantize(tree, config, forward_loop)` with the recipe's `--calib-algo` (ModelOpt's names).
  4. `Calibration.export_block`: ModelOpt's amax (and what the algorithm did to the weights) as the tensors of h3trt's
     modules: e4m3 weights with scale amax / 448, NVFP4 weights packed by ModelOpt's own NVFP4 tensor export.

What each algorithm does, in ModelOpt 0.47.0 (checked in its source and tests/calibration/test_calibration.py):
  max          per-tensor amax of every weight and activation; weights untouched.
  percentile   activations through ModelOpt's histogram calibrator, amax at its 99.99th percentile (ModelOpt's
               default). ModelOpt's "max" flow calls `compute_amax()` without a method, which its histogram
               calibrator refuses, so `PercentileCalibrator` names the method; everything else is ModelOpt's.
  smoothquant  ModelOpt's `smoothquant` (alpha 1.0, its default): per-channel input amax a_c, s_c = w_c^0 / a_c, the
               weight's columns multiplied by 1/s (folded into the weights), the input by s before quantization
               (`pre_quant_scale`), then per-tensor amax of the smoothed tensors. ModelOpt 0.47 runs its smoothing
               only on 8-bit integer quantizers (it skips FP8 ones with a warning and leaves per-channel input amax
               behind), so h3trt calibrates with the quantizers declared 8-bit and declares them e4m3 afterwards;
               the smoothing arithmetic never reads the bit width.
  awq_lite     ModelOpt's `awq_lite` (alpha step 0.1): two passes over the trajectories (statistics, then the
               alpha search with the weights fake-quantized), scales folded into the weights (W * s) and the input
               multiplied by 1/s (`pre_quant_scale`), then the weights' amax. The search fake-quantizes NVFP4 with
               ModelOpt's Triton kernel on a GPU; on a CPU, where ModelOpt 0.47 has no NVFP4 kernel, with ModelOpt's
               NVFP4 tensor export (`NVFP4QTensor` quantize + dequantize, registered as a ModelOpt quant backend).
ModelOpt's CUDA extensions are never needed: calibration only collects statistics, and the one fake quantization
(AWQ's search) is Triton or the CPU path above.

Shape legend: B batch, S rows, N heads, D head dim, K a linear's input features.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..models.dit import Block, H3DiT, sdpa_attention
from ..models.precision import Precision
from .formats import FP4_MAX, FP8_MAX, NVFP4_GROUP, fp8_scale, quantize_fp8
from .fp8_attention import centered_attention
from .modules import load_quantized_block
from .recipe import QuantRecipe, check_modelopt, read_prompts  # noqa: F401 (read_prompts: this module's API)

check_modelopt()  # importing this module means calibrating: refuse a missing or other ModelOpt with the fix

with warnings.catch_warnings():
    # ModelOpt warns at import that this transformers release is untested with it; h3trt hands it no transformers model.
    warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")
    import modelopt  # noqa: E402
    import modelopt.torch.quantization as mtq  # noqa: E402
from modelopt.torch.quantization.calib.histogram import HistogramCalibrator  # noqa: E402
from modelopt.torch.quantization.nn import TensorQuantizer  # noqa: E402
from modelopt.torch.quantization.nn.modules.tensor_quantizer import register_quant_backend  # noqa: E402
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor  # noqa: E402

PERCENTILE = 99.99  # ModelOpt's HistogramCalibrator default
# ModelOpt algorithm config per --calib-algo (method and its parameters, ModelOpt's defaults), recorded in the manifest.
ALGORITHMS = {
    "max": {"method": "max"},
    "percentile": {"method": "max"},  # the percentile lives in the activation quantizers' calibrator
    "smoothquant": {"method": "smoothquant", "alpha": 1.0},
    "awq_lite": {"method": "awq_lite", "alpha_step": 0.1},
}
CPU_NVFP4_BACKEND = "h3trt_nvfp4_export_math"
# ONNX Q/DQ scales in bf16, so no Cast sits between a DQ and its MatMul (a Cast blocks TensorRT's fusion). Inductor
# never reads it.
TRT_HIGH_PRECISION = "BFloat16"


# ---- What ModelOpt sees ------------------------------------------------------------------------------------------

class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(D)) v over [B, S, N, D], as a module so ModelOpt can wrap it with q/k/v quantizers."""

    def forward(self, q_BSND, k_BSND, v_BSND):
        return sdpa_attention(q_BSND, k_BSND, v_BSND)


class QuantAttentionCore(AttentionCore):
    """ModelOpt's form of AttentionCore (registered below): q, k and the row-centered v pass e4m3 quantizers, as
    h3trt's FP8 attention quantizes them (h3trt/calibration/fp8_attention.py); the mean returns in full precision."""

    def _setup(self):
        self.q_bmm_quantizer, self.k_bmm_quantizer, self.v_bmm_quantizer = (TensorQuantizer() for _ in range(3))

    def forward(self, q_BSND, k_BSND, v_BSND):
        return centered_attention(q_BSND, k_BSND, v_BSND, self.q_bmm_quantizer, self.k_bmm_quantizer,
                                  self.v_bmm_quantizer)


mtq.register(original_cls=AttentionCore, quantized_cls=QuantAttentionCore)


class PercentileCalibrator(HistogramCalibrator):
    """ModelOpt's histogram calibrator with its percentile method chosen up front (see the module docstring)."""

    def __init__(self, num_bits=8, axis=None, unsigned=False, percentile: float = PERCENTILE):
        super().__init__(num_bits, axis, unsigned)
        self.percentile = percentile

    def compute_amax(self):
        return super().compute_amax("percentile", percentile=self.percentile)


def _nvfp4_export_math(x: torch.Tensor, quantizer) -> torch.Tensor:
    """NVFP4 fake quantization through ModelOpt's NVFP4 tensor export (quantize, then dequantize), with the global
    amax the Triton kernel would take: for the CPU, where ModelOpt 0.47's NVFP4 fake-quant kernels do not run."""
    block = quantizer.block_sizes[-1]
    global_scale = quantizer._get_amax(x).float().amax() / (FP4_MAX * FP8_MAX)
    packed, block_scale, global_scale = NVFP4QTensor.quantize(x, block, weights_scaling_factor_2=global_scale)
    return packed.dequantize(x.dtype, scale=block_scale, double_scale=global_scale, block_sizes={-1: block})


register_quant_backend(CPU_NVFP4_BACKEND, _nvfp4_export_math)


class _Node(nn.Module):
    """A container of the calibration tree: it holds the DiT's own modules, by reference."""


def calibration_tree(blocks: Sequence[Block | None], recipe: QuantRecipe) -> nn.Module:
    """`blocks.{i}.{linear}` for the recipe's linears of every quantized block, `blocks.{i}.attn.core` with FP8
    attention; excluded blocks, and the None entries of a one-block tree (calibrate_block), are empty nodes (their
    index keeps its place)."""
    root = _Node()
    root.blocks = nn.ModuleList()
    for i, block in enumerate(blocks):
        node = _Node()
        if block is not None and i not in recipe.exclude_blocks:
            for name in recipe.quantized_linears():
                parent, leaf = name.split(".")
                if not hasattr(node, parent):
                    setattr(node, parent, _Node())
                setattr(getattr(node, parent), leaf, block.get_submodule(name))
            if recipe.fp8_attention:
                if not hasattr(node, "attn"):
                    node.attn = _Node()
                node.attn.core = AttentionCore()
        root.blocks.append(node)
    return root


def _format_cfg(base: dict, quantizer: str) -> dict:
    (entry,) = [e for e in base["quant_cfg"] if e.get("quantizer_name") == quantizer and "cfg" in e]
    return dict(copy.deepcopy(entry["cfg"]), trt_high_precision_dtype=TRT_HIGH_PRECISION)


def modelopt_config(recipe: QuantRecipe, device: torch.device) -> dict:
    """The `mtq.quantize` config: formats from ModelOpt's own FP8_DEFAULT_CFG / NVFP4_DEFAULT_CFG entries, applied to
    every quantizer of the calibration tree (it holds only what the recipe quantizes). FP8 quantizes weights and
    inputs; NVFP4 the weights only (h3trt's Inductor block dequantizes them to bf16), or with the recipe's
    fp4_activations the inputs too (the TensorRT backend's FP4 GEMMs)."""
    base = getattr(mtq, recipe.precision.spec.modelopt_config)
    weight, inputs = _format_cfg(base, "*weight_quantizer"), _format_cfg(base, "*input_quantizer")
    attention = _format_cfg(mtq.FP8_DEFAULT_CFG, "*input_quantizer")
    if recipe.calib_algo == "percentile":
        inputs["calibrator"] = attention["calibrator"] = (PercentileCalibrator, (), {"percentile": PERCENTILE})
    if recipe.calib_algo == "smoothquant":  # declared e4m3 after smoothing (module docstring)
        weight["num_bits"] = inputs["num_bits"] = 8
    if recipe.precision is Precision.NVFP4 and device.type == "cpu" and not recipe.fp4_activations:
        # Weight-only on the CPU (AWQ's search fake-quantizes). Never for the TensorRT graphs: a quant backend has no
        # ONNX form, and their FP4 activations have no CPU kernel anyway (the builder refuses them on a CPU).
        weight["backend"] = CPU_NVFP4_BACKEND
    quant_cfg = [{"quantizer_name": "*", "enable": False}, {"quantizer_name": "*weight_quantizer", "cfg": weight}]
    if recipe.quantizes_activations:
        quant_cfg.append({"quantizer_name": "*input_quantizer", "cfg": inputs})
    if recipe.fp8_attention:
        quant_cfg.append({"quantizer_name": "*_bmm_quantizer", "cfg": attention})
    return {"quant_cfg": quant_cfg, "algorithm": dict(ALGORITHMS[recipe.calib_algo])}


# ---- Running it --------------------------------------------------------------------------------------------------

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Forwards the calibration data through the blocks, calling the given attention core wherever they attend.
Forward = Callable[[AttentionFn], None]


class _AttentionRouter:
    """The attention core of the block running now (a forward pre-hook on each block says which): one callable the
    whole DiT can take as its attn_fn."""

    def __init__(self, blocks: Sequence[Block], tree: nn.Module):
        self.tree, self.current = tree, -1
        self.hooks = [b.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "current", i))
                      for i, b in enumerate(blocks)]

    def __call__(self, q, k, v):
        return attention_core(self.tree, self.current)(q, k, v)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def attention_core(tree: nn.Module, index: int) -> AttentionFn:
    """Block `index`'s ModelOpt-quantized attention core, or bf16 SDPA where the block has none."""
    attn = getattr(tree.blocks[index], "attn", None)
    return getattr(attn, "core", None) or sdpa_attention


@dataclass(frozen=True)
class Calibration:
    """A finished ModelOpt calibration: the tree (ModelOpt's quantizers, in place in the DiT's modules) and the record
    of how it ran."""

    tree: nn.Module
    recipe: QuantRecipe
    record: dict  # library, version, algorithm and its parameters, device, forward passes

    def quantizers(self, index: int) -> dict[str, TensorQuantizer]:
        """Block `index`'s enabled quantizers by name inside the block (`mlp.fc1.input_quantizer`, ...)."""
        node = self.tree.blocks[index]
        return {n: m for n, m in node.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled}

    def amax(self, index: int) -> dict[str, float]:
        """The calibrated maxima the manifest records: `{linear}.weight`, `{linear}.input` (FP8), `attn.q|k|v`."""
        out = {}
        for name, q in self.quantizers(index).items():
            module, kind = name.rsplit(".", 1)
            key = {"weight_quantizer": f"{module}.weight", "input_quantizer": f"{module}.input"}.get(kind)
            out[key or f"attn.{kind[0]}"] = round(float(q.amax.float().amax()), 6)
        return dict(sorted(out.items()))

    @torch.no_grad()
    def export_block(self, index: int) -> dict[str, torch.Tensor]:
        """The tensors of block `index`'s h3trt modules (names inside the block), from ModelOpt's quantizers and the
        weights as the algorithm left them (SmoothQuant and AWQ fold their scales in)."""
        node, recipe, out = self.tree.blocks[index], self.recipe, {}
        for name in recipe.quantized_linears():
            linear = node.get_submodule(name)
            weight, wq, iq = linear.weight.detach(), linear.weight_quantizer, linear.input_quantizer
            if recipe.precision is Precision.FP8:
                scale = fp8_scale(wq.amax)
                out.update({f"{name}.weight": quantize_fp8(weight, scale), f"{name}.weight_scale": scale,
                            f"{name}.input_scale": fp8_scale(iq.amax)})
            else:
                global_scale = wq.amax.float() / (FP4_MAX * FP8_MAX)
                packed, block_scale, global_scale = NVFP4QTensor.quantize(weight, NVFP4_GROUP,
                                                                          weights_scaling_factor_2=global_scale)
                out.update({f"{name}.weight_packed": packed._quantized_data,
                            f"{name}.weight_block_scale": block_scale,
                            f"{name}.weight_global_scale": global_scale.float().reshape(1)})
            if recipe.smooths_inputs:
                if iq.pre_quant_scale is None:
                    raise RuntimeError(f"ModelOpt's {recipe.calib_algo} left no pre_quant_scale on blocks.{index}."
                                       f"{name}: it skipped the layer (see its warnings above).")
                out[f"{name}.pre_quant_scale"] = iq.pre_quant_scale.detach().to(weight.dtype).reshape(-1)
        if recipe.fp8_attention:
            core = node.attn.core
            for n in ("q", "k", "v"):
                out[f"attn.{n}_scale"] = fp8_scale(getattr(core, f"{n}_bmm_quantizer").amax)
        return {k: v.contiguous() for k, v in out.items()}


@torch.no_grad()
def calibrate(blocks: Sequence[Block], recipe: QuantRecipe, forward: Forward | None, log=print) -> Calibration:
    """Quantize the recipe's modules of `blocks` with ModelOpt and calibrate them by `forward` (None: weights only,
    for NVFP4 with max). The blocks keep ModelOpt's quantizers in place afterwards: `Calibration.export_block` reads
    them for h3trt's modules, and the ONNX export writes them as Q/DQ."""
    _check_forward(recipe, forward is not None)
    tree = calibration_tree(blocks, recipe)
    router = _AttentionRouter(blocks, tree)
    passes = []

    def forward_loop(_tree):
        passes.append(len(passes) + 1)
        log(f"calibration ({recipe.calib_algo}) pass {len(passes)}")
        forward(router)

    try:
        return _run_modelopt(tree, recipe, next(iter(blocks)).norm1.weight.device,
                             forward_loop if forward is not None else None, passes)
    finally:
        router.close()


# The forward passes each --calib-algo makes over the calibration data (ModelOpt 0.47: awq_lite caches statistics,
# then searches); every pass sees the same, unquantized activations.
FORWARD_PASSES = {"max": 1, "percentile": 1, "smoothquant": 1, "awq_lite": 2}
# Replays block `index`'s recorded inputs through it, attending through the given core; `last`: the algorithm's
# last pass, whose outputs become the next block's inputs (h3trt/calibration/layerwise.py).
Replay = Callable[[AttentionFn, bool], None]


@torch.no_grad()
def calibrate_block(block: Block, index: int, num_layers: int, recipe: QuantRecipe, replay: Replay | None,
                    log=print) -> Calibration:
    """`calibrate` for block `index` of `num_layers` alone, its data replayed by `replay` (None: weights only): a
    ModelOpt quantizer's statistics depend only on the inputs it sees, in the order it sees them, so a block replayed
    on the inputs the whole model's forward would feed it, in that order, calibrates to the same scales
    (h3trt/calibration/layerwise.py). The record is `calibrate`'s: its passes count the algorithm's passes over the
    data."""
    _check_forward(recipe, replay is not None)
    blocks: list[Block | None] = [None] * num_layers
    blocks[index] = block
    tree = calibration_tree(blocks, recipe)
    core, passes = attention_core(tree, index), []

    def forward_loop(_tree):
        passes.append(len(passes) + 1)
        replay(core, len(passes) == FORWARD_PASSES[recipe.calib_algo])

    calibration = _run_modelopt(tree, recipe, block.norm1.weight.device, forward_loop if replay else None, passes)
    if replay is not None and len(passes) != FORWARD_PASSES[recipe.calib_algo]:
        raise RuntimeError(f"ModelOpt's {recipe.calib_algo} made {len(passes)} passes over block {index}'s data, not "
                           f"the {FORWARD_PASSES[recipe.calib_algo]} FORWARD_PASSES says: the next block's inputs "
                           "would be wrong (another ModelOpt release?).")
    return calibration


def _check_forward(recipe: QuantRecipe, given: bool) -> None:
    if given != recipe.needs_calibration_data:
        raise ValueError(f"--precision {recipe.precision} --calib-algo {recipe.calib_algo} "
                         f"{'needs no data' if given else 'calibrates on data: give it a forward'}.")


def _run_modelopt(tree: nn.Module, recipe: QuantRecipe, device: torch.device, forward_loop, passes: list) \
        -> Calibration:
    """`mtq.quantize` over `tree` with the recipe's config, then the checks, and the record of how it ran."""
    config = modelopt_config(recipe, device)
    mtq.quantize(tree, config, forward_loop)
    if recipe.calib_algo == "smoothquant":
        for m in tree.modules():
            if isinstance(m, TensorQuantizer) and m.num_bits == 8:
                m.num_bits = (4, 3)  # the e4m3 the ranges were calibrated for (module docstring)
    _check_calibrated(tree, recipe)
    fake_quant = ("none: calibration only collects ranges" if recipe.calib_algo != "awq_lite" else
                  "ModelOpt NVFP4QTensor (CPU)" if device.type == "cpu" else "ModelOpt Triton NVFP4 kernel")
    record = {"library": "nvidia-modelopt", "version": modelopt.__version__, "algorithm": recipe.calib_algo,
              "modelopt_algorithm": config["algorithm"], "device": str(device), "forward_passes": len(passes),
              "fake_quant_during_calibration": fake_quant}
    if recipe.calib_algo == "percentile":
        record["percentile"] = PERCENTILE
    return Calibration(tree, recipe, record)


def _check_calibrated(tree: nn.Module, recipe: QuantRecipe) -> None:
    """Every enabled quantizer ends with a finite per-tensor range (NVFP4's is the global one its block scales are
    normalised by): ModelOpt only warns about a quantizer the data never reached."""
    for name, q in tree.named_modules():
        if not isinstance(q, TensorQuantizer) or not q.is_enabled:
            continue
        if q.amax is None or q.amax.numel() != 1 or not torch.isfinite(q.amax).all():
            raise RuntimeError(f"ModelOpt left {name} without a per-tensor range (amax {q.amax}): the calibration "
                               f"runs never reached it, or --calib-algo {recipe.calib_algo} left per-channel ranges.")


def quantize_blocks(model: H3DiT, calibration: Calibration) -> None:
    """h3trt's FP8/NVFP4 modules in place of the calibrated ones, in every block the recipe quantizes."""
    for i, block in enumerate(model.blocks):
        if i not in calibration.recipe.exclude_blocks:
            load_quantized_block(block, model.cfg, calibration.recipe, calibration.export_block(i))
