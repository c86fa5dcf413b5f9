"""The builder's quantization step: calibrate the loaded DiT through ModelOpt (h3trt/calibration/calibrate.py), then put
h3trt's quantized modules into its blocks (Inductor/AOTI) or leave ModelOpt's quantizers there for the ONNX Q/DQ
(TensorRT), and say which compiled block serves each layer."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from ..errors import UserError
from ..models.config import NUM_MODALITIES, NUM_MODULATION_PARAMS
from ..models.dit import ADALN_PREFIX, EMBED_PREFIXES, H3DiT, build_dit
from ..models.sampler import Schedule
from ..models.vsa.plan import VsaServing
from .modules import quantized_template
from .recipe import QuantRecipe, layer_segments, read_prompts
from .trajectories import trajectory_forward


def calibrate_dit(model: H3DiT, recipe: QuantRecipe, component_root: Path, calib_prompts: Path | None, profile,
                  schedule: Schedule, keep_modelopt_quantizers: bool = False,
                  log=print, vsa: VsaServing | None = None) -> tuple[QuantRecipe, dict]:
    """Calibrate every non-excluded block of `model` through ModelOpt and quantize it in place: h3trt's FP8/NVFP4
    modules, or (`keep_modelopt_quantizers`, the TensorRT backend) ModelOpt's own, which the ONNX export writes as
    Q/DQ. Returns the recipe with the calibration's size filled in, and the manifest's `quant` record. `schedule`:
    each trajectory's (BuildConfig.calibration_schedule). `vsa`: a FastH3-VSA model's settings and kernel, which its
    trajectories attend with (the served attention)."""
    # Imported here, not at the top: it imports ModelOpt (seconds, and an optional dependency a bf16 build never needs).
    from .calibrate import calibrate, quantize_blocks

    recipe, prompts = calibration_prompts(recipe, calib_prompts, model.cfg.num_layers)
    forward = None
    if prompts is not None:
        forward = trajectory_forward(model, component_root, prompts, schedule, profile.width, profile.height,
                                     profile.seconds, log, vsa)
    t0 = time.perf_counter()
    calibration = calibrate(model.blocks, recipe, forward, log)
    amax = {f"blocks.{i}": calibration.amax(i) for i in range(model.cfg.num_layers) if i not in recipe.exclude_blocks}
    if not keep_modelopt_quantizers:
        quantize_blocks(model, calibration)
    log(calibration_summary(recipe, calibration.record, model.cfg.num_layers))
    return recipe, quant_record(recipe, model.cfg.num_layers, time.perf_counter() - t0, calibration.record, amax)


def calibration_prompts(recipe: QuantRecipe, calib_prompts: Path | None,
                        num_layers: int) -> tuple[QuantRecipe, list[str] | None]:
    """The recipe checked against the model's layers, with the number of prompts filled in, and the prompts (None:
    a weight-only calibration, which refuses prompts)."""
    recipe.check_layers(num_layers)
    if recipe.needs_calibration_data:
        prompts = read_prompts(calib_prompts)
        return dataclasses.replace(recipe, calib_prompts=len(prompts)), prompts
    if calib_prompts is not None:
        raise UserError(f"--precision {recipe.precision} --calib-algo {recipe.calib_algo} calibrates the weights "
                        "only (weight-only NVFP4): it runs no trajectories. Drop --calib-prompts, or use --calib-algo "
                        "awq_lite.")
    return recipe, None


def quant_record(recipe: QuantRecipe, num_layers: int, seconds: float, modelopt: dict, amax: dict) -> dict:
    """The manifest's `quant` record of a calibration: the recipe, which block serves each layer, how ModelOpt ran and
    every calibrated block's maxima."""
    return {**recipe.to_dict(), "layer_segments": layer_segments(recipe, num_layers),
            "calibration_s": round(seconds, 2), "modelopt": modelopt, "amax": amax}


def calibration_summary(recipe: QuantRecipe, modelopt: dict, num_layers: int) -> str:
    return (f"calibrated ({recipe.calib_algo}, ModelOpt {modelopt['version']}) and quantized "
            f"{num_layers - len(recipe.exclude_blocks)} of {num_layers} blocks to {recipe.precision} "
            f"({', '.join(recipe.quantized_linears())}{', FP8 attention' if recipe.fp8_attention else ''})")


def block_weight_sets(model: H3DiT, recipe: QuantRecipe | None, names_of: dict[str, list[str]],
                      state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The blocks' weight file: each layer under the names its serving segment declares (`names_of[segment]`)."""
    out = {}
    for i, segment in enumerate(layer_segments(recipe, model.cfg.num_layers)):
        out.update({f"blocks.{i}.{n}": state[f"blocks.{i}.{n}"] for n in names_of[segment]})
    return out


def first_layer(recipe: QuantRecipe | None, num_layers: int, segment: str) -> int:
    """The first layer a block segment serves: its weights are the build's example for that segment."""
    return layer_segments(recipe, num_layers).index(segment)


def dit_weight_bytes(cfg, recipe: QuantRecipe | None, baked_timesteps: int | None,
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Bytes of a bundle's DiT weight files for `cfg` without allocating anything (meta tensors): embed, blocks
    (as the recipe quantizes them), final, and the AdaLN tables for `baked_timesteps` (None: adaln_proj kept)."""
    model = build_dit(cfg, dtype, device="meta")
    for i, block in enumerate(model.blocks):
        if recipe is not None and i not in recipe.exclude_blocks:
            quantized_template(block, cfg, recipe)

    def nbytes(pred) -> int:
        tensors = list(model.named_parameters()) + list(model.named_buffers(remove_duplicate=False))
        return sum(t.numel() * t.element_size() for n, t in tensors if pred(n) and n != "rope_inv_freq")

    out = {"embed": nbytes(lambda n: n.startswith(EMBED_PREFIXES)),
           "blocks": nbytes(lambda n: n.startswith("blocks.") and ADALN_PREFIX not in n),
           "final": nbytes(lambda n: n.startswith("final_layer.") and ADALN_PREFIX not in n)}
    if baked_timesteps is None:
        out["adaln_weights"] = nbytes(lambda n: ADALN_PREFIX in n)
    else:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        per_t = cfg.num_layers * NUM_MODALITIES * NUM_MODULATION_PARAMS * cfg.hidden_size + 2 * cfg.hidden_size
        out["adaln_tables"] = baked_timesteps * per_t * itemsize + baked_timesteps * 4
    out["total"] = sum(out.values())
    return out
