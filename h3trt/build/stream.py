"""`h3trt build` a block at a time: phases 1-3 of builder.py (load, calibrate, bake) for a DiT that does not fit on
the build device whole (build/memory.py decides, before anything loads). The GPU memory it holds does not grow with
the number of layers: at full size (50 blocks of 1.3 GB) an fp8 build fits in an H100's 80 GB, where the whole DiT
(66 GB) beside its FP8 copies did not.

  load       the checkpoint's headers (models/checkpoint/stream.py); what lies outside the main blocks (embed and
             final, 1.7 GB at full size) onto the device, where it stays; the blocks stay on the meta device and a
             BlockLoader (block_loader.py) brings each one in when a phase asks for it, LoRAs merged and the
             --distilled file's patches of that block fused as it arrives (every patch checked against the model's
             shapes first, as merge_distilled checks them, the resident ones fused at once).
  calibrate  (FP8, and NVFP4 on data) the prompts encoded, and their trajectories recorded as block 0's inputs
             (calibration/layerwise.py: the blocks come in once per evaluation but the last of each trajectory; a
             FastH3-VSA model's blocks, their gates read with them, attend with VSA as the whole calibration's do).
  bake       one pass over the blocks, each brought in once: ModelOpt calibrates it on the recorded inputs, which
             become the next block's; h3trt's quantized modules take its linears' place; its AdaLN rows are baked
             (or its adaln_proj kept) and its tensors written at their places in the weight files (engines/weights_io.py
             SafetensorsWriter). Then it is dropped, unless the compile's example inputs need it (kept_layers).

Every file is byte for byte a whole build's (tests/build/test_build_stream.py builds the tiny model both ways). The
compile and the check that follow are builder.py's: one block's weights are all their example inputs need.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from ..adapters.merge import LoraMerge
from ..calibration.build import calibration_prompts, calibration_summary, quant_record
from ..calibration.modules import load_quantized_block
from ..calibration.recipe import QuantRecipe, layer_segments
from ..engines.manifest import AdalnRecord
from ..engines.weights_io import SafetensorsWriter, write_safetensors
from ..models.checkpoint.reader import check_state_dict, locate_transformer
from ..models.checkpoint.stream import CheckpointTensors
from ..models.distilled.merge import check_fusion
from ..models.dit import ADALN_PREFIX, Block, build_dit, rope_inv_freq
from .adaln import block_table, final_table, schedule_timesteps, time_embedding
from .block_loader import BlockLoader, load_resident
from .config import BuildConfig
from .memory import kept_layers
from .phases import BakedWeights, Calibration, LoadedDiT, read_distilled
from .plan import BuildPlan, vsa_serving
from .segments import block_weight_specs, embed_segment, final_weight_names


def load_streamed(config: BuildConfig, plan: BuildPlan, log) -> LoadedDiT:
    """1. The DiT with only its resident parts on the device; its blocks read from the checkpoint when asked for."""
    t0 = time.perf_counter()
    source = locate_transformer(config.model_root, config.task)
    log(f"loading the {config.task} DiT from {config.model_root} a block at a time onto {plan.device} (embed and "
        "final stay there; each block is read from the checkpoint when a phase needs it)")
    tensors = CheckpointTensors(source)
    # As builder.load: the --distilled file first, the model built as the plan made it (a FastH3-VSA file's gates,
    # which the checkpoint lacks and the file's .set_weight assigns, are the model's parameters)
    distilled, record = read_distilled(config, plan.model_cfg)
    fusion = distilled.fusion if distilled is not None else None
    supplied = fusion.assigned() if fusion is not None else {}
    source = dataclasses.replace(source, config=plan.model_cfg)
    model = build_dit(source.config, plan.dtype, device="meta")
    shapes = {n: torch.empty(t.shape, device="meta") for n, t in {**supplied, **tensors.tensors}.items()}
    check_state_dict(model, shapes, str(source.files[0].parent if len(source.files) > 1 else source.files[0]))
    schedules = config.schedules(source.shifts)
    merge = (LoraMerge(config.loras, config.task, model.cfg, {n: tuple(p.shape) for n, p in model.named_parameters()})
             if config.loras else None)
    if fusion is not None:  # every patch against the model's shapes (meta), before any is fused
        check_fusion(fusion, dict(model.named_parameters()))
    load_resident(tensors, model, plan.dtype, plan.device, merge, fusion)
    model.rope_inv_freq = rope_inv_freq(source.config).to(plan.device)
    loader = BlockLoader(tensors, model.cfg, plan.dtype, plan.device, merge, fusion)
    seconds = time.perf_counter() - t0
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    log(f"loaded the {config.task} DiT's resident parts ({resident / 1e9:.2f} GB; "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:,.1f} M parameters in all, {config.precision}) in "
        f"{seconds:.1f} s; {model.cfg.num_layers} blocks of {loader.slot_bytes / 1e9:.2f} GB to stream")
    return LoadedDiT(model, source, schedules, tuple(merge.records if merge else ()), seconds, distilled, record,
                     loader)


@torch.no_grad()
def bake_streamed(config: BuildConfig, plan: BuildPlan, dit: LoadedDiT, work: Path,
                  log) -> tuple[Calibration, BakedWeights]:
    """2 and 3. The calibration's recorded inputs, then one pass over the blocks (module docstring)."""
    model, cfg = dit.model, dit.model.cfg
    recipe = config.recipe_for(plan.fp8_kernel, plan.vsa_kernel is not None)
    t0 = time.perf_counter()
    recipe, inputs = _calibration_inputs(config, plan, dit, recipe, log)
    state = model.state_dict()
    sizes = {"embed": write_safetensors(work / "weights" / "embed.safetensors",
                                        {n: state[n] for n in embed_segment(cfg, plan.dtype).weights})}
    baked = not config.keep_adaln
    values = schedule_timesteps(*dit.schedules) if baked else None
    with _BlockFiles(work, cfg, plan.dtype, recipe, values) as files:
        if baked:
            temb = time_embedding(model, values)
            files.adaln.write("timesteps", values.clone())
            files.adaln.write("final", final_table(model, temb))
        else:
            temb = None
            for p in ("weight", "bias"):
                files.adaln.write(f"final.{p}", state[f"final_layer.adaln_proj.linear.{p}"])
        modelopt, amax = _block_pass(config, dit, recipe, inputs, files, temb, log)
    sizes["blocks"] = files.blocks.data_bytes
    sizes["final"] = write_safetensors(work / "weights" / "final.safetensors",
                                       {**{n: state[f"final_layer.{n}"] for n in final_weight_names(cfg, plan.dtype)},
                                        **dit.final_extra()})
    adaln_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ADALN_PREFIX in n)
    quant = None
    if recipe is not None:
        quant = quant_record(recipe, cfg.num_layers, time.perf_counter() - t0, modelopt, amax)
        log(calibration_summary(recipe, modelopt, cfg.num_layers))
    if not baked:
        sizes["adaln_weights"] = files.adaln.data_bytes
        return Calibration(recipe, quant), BakedWeights(sizes, AdalnRecord(baked=False))
    tables = sizes["adaln_tables"] = files.adaln.data_bytes
    log(adaln_summary(values, len(dit.schedules), tables, adaln_bytes))
    return Calibration(recipe, quant), BakedWeights(sizes, AdalnRecord(True, values.numel(), adaln_bytes, tables,
                                                                       adaln_bytes - tables))


def adaln_summary(values: torch.Tensor, schedules: int, tables: int, adaln_bytes: int) -> str:
    saved = adaln_bytes - tables  # negative for a model this small: its tables outweigh its weights
    return (f"baked AdaLN for {values.numel()} timesteps ({schedules} schedule(s)): {tables / 1e6:.1f} MB of tables "
            f"replace {adaln_bytes / 1e6:.1f} MB of adaln_proj weights ("
            + (f"{saved / 1e6:.1f} MB saved)" if saved >= 0 else f"{-saved / 1e6:.1f} MB more: at this width the "
               "tables of every step are larger than the weights; --keep-adaln keeps the weights instead)"))


def _calibration_inputs(config: BuildConfig, plan: BuildPlan, dit: LoadedDiT, recipe: QuantRecipe | None, log):
    """(the recipe with its prompt count, block 0's recorded inputs or None): the prompts encoded with the text
    encoder alone on the device, then their trajectories (calibration/layerwise.py)."""
    if recipe is None:
        return None, None
    recipe, prompts = calibration_prompts(recipe, config.calib_prompts, dit.model.cfg.num_layers)
    if prompts is None:
        return recipe, None
    from ..calibration.layerwise import encode_prompts, record_block_inputs  # the text encoder's dependencies

    texts = encode_prompts(dit.source.component_root, prompts, plan.device, plan.dtype)
    store = torch.device("cpu") if plan.memory.calibration_inputs_on_host else plan.device
    inputs = record_block_inputs(dit.model, dit.blocks, texts, recipe, config.calibration_schedule(dit.schedules[0]),
                                 config.profiles[0].geometry, store, log, vsa_serving(config, plan))
    log(f"recorded {len(inputs)} calibration evaluations' block inputs on {store} "
        f"({sum(x.x.numel() * x.x.element_size() for x in inputs) / 1e9:.2f} GB)")
    return recipe, inputs


class _BlockFiles:
    """The weight files the block pass writes into, each tensor at its place: blocks.safetensors, and
    adaln_tables.safetensors (or adaln_weights.safetensors with --keep-adaln). Their headers come from the segments'
    templates, so the pass can write block by block what a whole build writes at once."""

    def __init__(self, work: Path, cfg, dtype: torch.dtype, recipe: QuantRecipe | None, values: torch.Tensor | None):
        specs = {"block": block_weight_specs(cfg, dtype, recipe), "block_hp": block_weight_specs(cfg, dtype)}
        self.segments = layer_segments(recipe, cfg.num_layers)
        self.names = {seg: list(spec) for seg, spec in specs.items()}
        blocks = {f"blocks.{i}.{n}": spec for i, seg in enumerate(self.segments) for n, spec in specs[seg].items()}
        H, E, M = cfg.hidden_size, cfg.time_embed_dim, cfg.modulation_dim
        if values is not None:
            U = values.numel()
            adaln = {"timesteps": (torch.float32, (U,)), "final": (dtype, (U, 2, H)),
                     **{f"blocks.{i}": (dtype, (U, 3, 6, H)) for i in range(cfg.num_layers)}}
            name = "adaln_tables"
        else:
            adaln = {"final.weight": (dtype, (2 * H, E)), "final.bias": (dtype, (2 * H,)),
                     **{f"blocks.{i}.{p}": (dtype, (M, E) if p == "weight" else (M,))
                        for i in range(cfg.num_layers) for p in ("weight", "bias")}}
            name = "adaln_weights"
        self.blocks = SafetensorsWriter(work / "weights" / "blocks.safetensors", blocks)
        self.adaln = SafetensorsWriter(work / "weights" / f"{name}.safetensors", adaln)

    def __enter__(self) -> "_BlockFiles":
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        for writer in (self.blocks, self.adaln):
            writer.__exit__(exc_type, *exc)
        return False


def _block_pass(config: BuildConfig, dit: LoadedDiT, recipe: QuantRecipe | None, inputs, files: _BlockFiles,
                temb: torch.Tensor | None, log) -> tuple[dict | None, dict]:
    """Each block brought in once: calibrated and quantized, its AdaLN baked, written; kept where the compile needs
    it. Returns ModelOpt's record (None: not quantized) and every calibrated block's maxima."""
    from ..calibration.layerwise import calibrate_layer

    model, loader, cfg = dit.model, dit.blocks, dit.model.cfg
    keep, modelopt, amax = kept_layers(recipe, cfg.num_layers), None, {}
    for i in range(cfg.num_layers):
        t0 = time.perf_counter()
        block = loader.load(i)
        calibration = calibrate_layer(block, i, cfg.num_layers, recipe, inputs, log) if recipe is not None else None
        if calibration is not None:
            load_quantized_block(block, cfg, recipe, calibration.export_block(i))
            amax[f"blocks.{i}"] = calibration.amax(i)
            modelopt = modelopt or calibration.record
            del calibration  # ModelOpt's tree holds the block's bf16 linears
        state = block.state_dict()
        for n in files.names[files.segments[i]]:
            files.blocks.write(f"blocks.{i}.{n}", state[n])
        if temb is not None:
            files.adaln.write(f"blocks.{i}", block_table(block, temb))
        else:
            for p in ("weight", "bias"):
                files.adaln.write(f"blocks.{i}.{p}", state[f"adaln_proj.linear.{p}"])
        if i in keep:
            model.blocks[i] = block
        del block, state
        done = "calibrated, quantized, baked" if f"blocks.{i}" in amax else "baked"
        log(f"block {i + 1}/{cfg.num_layers}: {done} and written in {time.perf_counter() - t0:.2f} s")
    return modelopt, amax


def release_kept(dit: LoadedDiT) -> None:
    """After the compile: the blocks kept for its example inputs go back to the meta device."""
    model = dit.model
    for i, block in enumerate(model.blocks):
        if not block.norm1.weight.is_meta:
            with torch.device("meta"):
                model.blocks[i] = Block(model.cfg).to(model.dtype)
    if model.condition_proj.weight.device.type == "cuda":
        torch.cuda.empty_cache()
