"""`h3trt build`: checkpoint -> engine bundle, one function per phase, each returning a typed record (phases.py).

  0. plan: every check that needs no model (plan.py), the fit check among them: the whole DiT on the device where it
     fits, else a block at a time (memory.py), else a one-line refusal; then the output is claimed: locked, its
     leftovers removed, its free space checked against the bundle's estimated size (output.py)
  1. load: the DiT of the task's partition, with the --lora files merged into it and the --distilled file fused
  2. calibrate: fp8 / nvfp4 through ModelOpt on real trajectories of this model, blocks quantized in place
  3. bake: the segment weights (safetensors) and the AdaLN tables (or adaln_proj kept with --keep-adaln)
     (a build that streams its blocks does 1-3 in stream.py: the same files, one block on the device at a time)
  4. compile: embed / block / final once each (one block serves every layer: its weights are inputs) and the video
     decoder's in / block / out per tile shape, or TensorRT plans
  5. copy the eager components (text encoder, tokenizer, processor, VAEs)
  6. check: every artifact loads in a fresh process, under the no-compile guard, and matches the eager segment
  7. write: the typed Manifest the loader reads, every file hashed into it (--sign adds manifest.sig), the build's
     timings and peak GPU memory in it; then the finished bundle is swapped into place
The bundle is assembled in a temporary folder beside the output: a failed or interrupted build leaves the old bundle
(or nothing), never a half-written one.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..adapters.merge import merge_loras
from ..calibration.build import block_weight_sets, calibrate_dit
from ..calibration.recipe import QuantRecipe
from ..calibration.vae_fp8 import EXECUTION as VAE_FP8_EXECUTION
from ..engines.atomic import sha256_file
from ..engines.environment import device_arch, runtime_versions
from ..engines.manifest import (AdalnRecord, Manifest, MeshRecord, ProfileRecord, ScheduleRecord, SparseRecord,
                                VideoDecoderRecord, hash_threads, write_manifest)
from ..engines.video_decoder import parse_video_decoder_name
from ..engines.weights_io import write_safetensors
from ..models.checkpoint.reader import load_dit
from ..models.distilled.merge import merge_distilled
from ..models.dit import H3DiT
from .adaln import bake_tables, schedule_timesteps
from .backends import compile_segment
from .check import check_in_fresh_process
from .config import BuildConfig
from .examples import example_inputs, profile_decoder_specs
from .memory import GIB, device_memory
from .output import BundleOutput, check_output
from .phases import BakedWeights, Calibration, Compiled, LoadedDiT, read_distilled
from .plan import EAGER_COMPONENTS, BuildPlan, plan_build, vsa_serving
from .segments import block_weight_names, dit_segments, embed_segment, final_weight_names
from .stream import adaln_summary, bake_streamed, load_streamed, release_kept
from .tensorrt import build_tensorrt_segments

# Serve each compiled tile decoder as one CUDA graph replay (h3trt/engines/video_decoder.py says why); recorded in the
# manifest, ignored on the CPU. scripts/bench_vae.py measures both ways in one run (bitwise-equal pixels).
VIDEO_DECODER_CUDA_GRAPH = True
# Inductor options the video decoder's segments compile with, over the DiT's (scripts/bench_vae_compile.py measures
# max-autotune against these defaults and prints what to keep).
VIDEO_DECODER_INDUCTOR_OPTIONS: dict = {}


def build(config: BuildConfig, log=print, sign=None, free_memory=device_memory) -> Manifest:
    """Build the bundle `config` asks for at config.output; `sign(root)` writes manifest.sig (engines/signing.py).
    `free_memory(device)`: the device's free memory for the fit check (memory.py; tests pass their own)."""
    out = Path(config.output)
    check_output(out, config.overwrite)  # before anything slow; again under the output's lock
    if torch.device(config.device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the build's peak (peak_memory), the plan's kernel timings included
    plan = plan_build(config, log, free_memory)
    with BundleOutput(out, config.overwrite, plan.size, log) as output:
        dit = load(config, plan, log)
        try:
            calibration, weights = calibrate_and_bake(config, plan, dit, output.work, log)
            compiled = compile_segments(config, plan, dit, calibration, output.work, log)
        finally:
            if dit.blocks is not None:
                dit.blocks.close()
                release_kept(dit)
        copy_components(dit.source.component_root, output.work)
        check_s, check_peak = check(config, compiled, output.work, log)
        memory = peak_memory(plan, check_peak, log)
        manifest = write(output.work, bundle_manifest(config, plan, dit, calibration, weights, compiled,
                                                      {"verify_s": check_s, **memory}, log), sign, log)
        output.commit()
    return manifest


def peak_memory(plan: BuildPlan, check_peak: dict, log) -> dict:
    """The build's peak GPU memory (this process, and the fresh-process check's), for the log and the manifest."""
    if plan.device.type != "cuda":
        return {"streamed": float(plan.streamed)}
    out = {"streamed": float(plan.streamed),
           "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated(plan.device) / GIB,
           "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved(plan.device) / GIB,
           **{f"check_{k}": v for k, v in check_peak.items()}}
    log(f"peak GPU memory: {out['peak_gpu_allocated_gib']:.2f} GiB allocated, {out['peak_gpu_reserved_gib']:.2f} GiB "
        f"reserved (torch.cuda.max_memory_allocated / max_memory_reserved, built "
        f"{'a block at a time' if plan.streamed else 'whole'}); the fresh-process check: "
        + (f"{check_peak['peak_gpu_allocated_gib']:.2f} GiB allocated, {check_peak['peak_gpu_reserved_gib']:.2f} GiB "
           "reserved" if check_peak else "not measured"))
    return out


def load(config: BuildConfig, plan: BuildPlan, log) -> LoadedDiT:
    """1. The DiT of the task's partition, the LoRAs merged into its weights and the --distilled file fused after them:
    everything after (calibration, AdaLN tables, segments) sees them. A streamed build's blocks stay in the checkpoint
    until a phase asks for one (each fused as it arrives)."""
    if plan.streamed:
        dit = load_streamed(config, plan, log)
        log_loras(dit.loras, log)
        if dit.distilled is not None:
            log_distilled(dit.distilled.record(), log, ", each block's parameters as the block arrives")
        return dit
    t0 = time.perf_counter()
    # The --distilled file is read first: a FastH3-VSA file's gates (.set_weight) are parameters a base checkpoint
    # lacks, and the model is built with them (plan.model_cfg.vsa_gate)
    distilled, record = read_distilled(config, plan.model_cfg)
    log(f"loading the {config.task} DiT from {config.model_root} onto {plan.device}")
    model, source = load_dit(config.model_root, config.task, dtype=plan.dtype, device=plan.device,
                             supplied=distilled.fusion.assigned() if distilled is not None else None)
    video_shift, audio_shift = source.shifts  # the checkpoint's: its release metadata, or diffusers' schedulers
    schedules = config.schedules((video_shift, audio_shift))
    seconds = time.perf_counter() - t0
    log(f"loaded {config.task} DiT ({sum(p.numel() for p in model.parameters()) / 1e6:,.1f} M parameters, "
        f"{config.precision}) in {seconds:.1f} s")
    loras = merge_loras(model, config.loras, config.task)
    log_loras(loras, log)
    if distilled is not None:  # in fp32, one rounding per parameter, before calibration and baking
        log_distilled(merge_distilled(model, distilled), log)
    return LoadedDiT(model, source, schedules, tuple(loras), seconds, distilled, record)


def log_loras(loras, log) -> None:
    for r in loras:
        log(f"merged LoRA {r['file']} x {r['scale']:g} into {r['partition']} ({r['modules']} modules, "
            f"{r['layout']}, {r['alpha']})")


def log_distilled(record: dict, log, how: str = "") -> None:
    log(f"fused {record['family']} {record['file']} ({record['parameters']} parameters, {record['scale']}){how}; "
        f"schedule {record['schedule']}")


def calibrate_and_bake(config: BuildConfig, plan: BuildPlan, dit: LoadedDiT, work: Path,
                       log) -> tuple[Calibration, BakedWeights]:
    """2 and 3: on the whole DiT, or (a streamed build) in one pass over its blocks (stream.py): the same files."""
    if dit.blocks is not None:
        return bake_streamed(config, plan, dit, work, log)
    calibration = calibrate(config, plan, dit, log)
    return calibration, bake(config, dit, calibration, work, log)


def calibrate(config: BuildConfig, plan: BuildPlan, dit: LoadedDiT, log) -> Calibration:
    """2. FP8 / NVFP4: calibrate through ModelOpt on real trajectories of this model, then quantize its blocks in
    place. tensorrt keeps ModelOpt's quantizers in the blocks: the ONNX export writes them as Q/DQ, so both backends
    take their scales from the same calibration. Its segments are ONNX graphs, not the recipe's compiled blocks, hence
    no recipe for the phases after."""
    recipe = config.recipe_for(plan.fp8_kernel, plan.vsa_kernel is not None)
    if recipe is None:
        return Calibration(None, None)
    trt = config.backend == "tensorrt"
    vsa = vsa_serving(config, plan)
    recipe, quant = calibrate_dit(dit.model, recipe, dit.source.component_root, config.calib_prompts,
                                  config.profiles[0], config.calibration_schedule(dit.schedules[0]),
                                  keep_modelopt_quantizers=trt, log=log, vsa=vsa)
    if trt:
        return Calibration(None, {**quant, "execution": config.precision.spec.trt_execution})
    return Calibration(recipe, quant)


def bake(config: BuildConfig, dit: LoadedDiT, calibration: Calibration, work: Path, log) -> BakedWeights:
    """3. The segments' weights, and the AdaLN tables for the schedules (or the adaln_proj weights, --keep-adaln)."""
    model = dit.model
    weights = _weights(model, calibration.recipe)
    weights["final"].update(dit.final_extra())  # PDD: one fused head per forward
    sizes = {name: write_safetensors(work / "weights" / f"{name}.safetensors", weights[name])
             for name in ("embed", "blocks", "final")}
    if config.keep_adaln:
        sizes["adaln_weights"] = write_safetensors(work / "weights" / "adaln_weights.safetensors", weights["adaln"])
        return BakedWeights(sizes, AdalnRecord(baked=False))
    adaln_bytes = sum(t.numel() * t.element_size() for t in weights["adaln"].values())
    del weights
    values = schedule_timesteps(*dit.schedules)
    tables = sizes["adaln_tables"] = write_safetensors(work / "weights" / "adaln_tables.safetensors",
                                                       bake_tables(model, values))
    log(adaln_summary(values, len(dit.schedules), tables, adaln_bytes))
    return BakedWeights(sizes, AdalnRecord(True, values.numel(), adaln_bytes, tables, adaln_bytes - tables))


def _weights(model: H3DiT, recipe: QuantRecipe | None = None) -> dict[str, dict[str, torch.Tensor]]:
    # Left where they are (the GPU): write_safetensors streams them to the file one at a time. A host copy of a
    # full-size model is 66 GB of host memory, on top of a checkpoint that may itself sit in RAM (tmpfs).
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    names = {"block": block_weight_names(model.cfg, model.dtype, recipe),
             "block_hp": block_weight_names(model.cfg, model.dtype)}
    return {
        "embed": {n: sd[n] for n in embed_segment(model.cfg, model.dtype).weights},
        "blocks": block_weight_sets(model, recipe, names, sd),
        "final": {n: sd[f"final_layer.{n}"] for n in final_weight_names(model.cfg, model.dtype)},
        "adaln": {**{f"blocks.{i}.{p}": sd[f"blocks.{i}.adaln_proj.linear.{p}"]
                     for i in range(model.cfg.num_layers) for p in ("weight", "bias")},
                  **{f"final.{p}": sd[f"final_layer.adaln_proj.linear.{p}"] for p in ("weight", "bias")}},
    }


def compile_segments(config: BuildConfig, plan: BuildPlan, dit: LoadedDiT, calibration: Calibration, work: Path,
                     log) -> Compiled:
    """4. Each segment compiled once, its binaries captured in the bundle's own Inductor cache; or, for tensorrt, an
    ONNX export and a plan per segment (tensorrt.py: they run only on their target GPUs, and the video decoder stays
    eager, so nothing is compiled or checked here)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir  # Inductor: seconds to import

    model, recipe = dit.model, calibration.recipe
    (work / "segments").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sparse = config.sparse is not None  # at sp=1: the halves beside the fused block (segments.dit_segments)
    slots = config.slots  # --lora-slots: block_lora beside block (segments.dit_segments)
    examples = example_inputs(model, config.profiles[0].geometry, plan.device, config.sp, recipe, sparse, slots)
    if config.backend == "tensorrt":
        segments, record = build_tensorrt_segments(model, examples, config, work, log)
        return Compiled(segments, {}, {}, record, time.perf_counter() - t0)
    specs = {spec.name: spec for spec in dit_segments(model.cfg, plan.dtype, config.sp, recipe, plan.dense_kernel,
                                                      sparse, slots.targets if slots else None)}
    specs.update(profile_decoder_specs(dit.source.component_root, config.profiles, plan.device, config.vae, examples))
    cache = work / "inductor_cache" if config.backend == "inductor" else Path(tempfile.mkdtemp(prefix="h3trt-aoti-"))
    cache.mkdir(parents=True, exist_ok=True)
    segments = {}
    log(f"compiling {len(specs)} segments ({config.backend}): {', '.join(specs)}")
    try:
        with temporary_cache_dir(str(cache)):
            for spec in specs.values():
                ts = time.perf_counter()
                options = VIDEO_DECODER_INDUCTOR_OPTIONS if parse_video_decoder_name(spec.name) else None
                entry = compile_segment(config.backend, spec, examples[spec.name], work / "segments", options)
                segments[spec.name] = {"name": spec.name, **entry, "inputs": spec.inputs, "weights": spec.weights,
                                       "outputs": spec.outputs, "dynamic": spec.dynamic,
                                       **({"lora": spec.lora} if spec.lora else {})}
                log(f"compiled {spec.name} ({config.backend}) in {time.perf_counter() - ts:.1f} s")
    finally:
        if config.backend != "inductor":
            shutil.rmtree(cache, ignore_errors=True)
    _prune_cache(work / "inductor_cache")
    return Compiled(segments, specs, examples, None, time.perf_counter() - t0)


def _prune_cache(cache: Path) -> None:
    """Drop lock files and empty folders: the cache ships as read-only data."""
    if not cache.exists():
        return
    for path in list(cache.rglob("*.lock")) + list(cache.rglob("locks")):
        if path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def copy_components(component_root: Path, work: Path) -> None:
    """5. The eager components, copied so the bundle is self-contained."""
    for name in EAGER_COMPONENTS:
        src = component_root / name
        if src.is_dir():
            shutil.copytree(src, work / name)


def check(config: BuildConfig, compiled: Compiled, work: Path, log) -> tuple[float, dict]:
    """6. Every artifact loads and matches in a fresh process (AOTI on the H200 image segfaults at load); seconds, and
    the check's peak GPU memory (empty on the CPU)."""
    if not compiled.examples:  # tensorrt
        return 0.0, {}
    t0 = time.perf_counter()
    count = len(compiled.examples)
    log(f"checking {count} segments in a fresh process (each loaded under the no-compile guard and run against its "
        "eager segment)")
    peak = check_in_fresh_process(work, config, compiled.segments, compiled.examples, compiled.specs)
    seconds = time.perf_counter() - t0
    log(f"checked {count} segments in a fresh process in {seconds:.1f} s")
    return seconds, peak


def bundle_manifest(config: BuildConfig, plan: BuildPlan, dit: LoadedDiT, calibration: Calibration,
                    weights: BakedWeights, compiled: Compiled, check: dict, log) -> Manifest:
    """The typed manifest of this build, the one the loader reads (its files are hashed in by write_manifest).
    `check`: the fresh-process check's seconds (verify_s) and the build's memory record (peak_memory)."""
    model, source, trt = dit.model, dit.source, compiled.tensorrt
    meta = source.metadata
    timings = {"load_s": dit.seconds, "compile_s": compiled.seconds, **check}
    return Manifest(
        backend=config.backend, precision=config.precision, task=config.task,
        tasks=_served_tasks(config, meta),
        model_config=model.cfg,
        checkpoint={"path": str(config.model_root), "sha256": _checkpoint_sha(source.files, log)},
        schedules=tuple(ScheduleRecord(s.steps, s.video_shift, s.audio_shift, s.rungs) for s in dit.schedules),
        adaln=weights.adaln,
        profiles=tuple(ProfileRecord(p.width, p.height, p.seconds, p.geometry.num_frames) for p in config.profiles),
        mesh=MeshRecord(config.cfg, config.sp, model.cfg.num_heads // config.sp),
        # Plans run on CUDA wherever they were built, on their targets: what Engine.load checks the GPU against.
        arch=",".join(trt["targets"]) if trt else device_arch(plan.device),
        device="cuda" if trt else str(plan.device), versions=runtime_versions(), segments=compiled.segments,
        weight_bytes={k: v for k, v in weights.weight_bytes.items() if k.startswith("adaln")} if trt
        else weights.weight_bytes,
        build_timings_s={k: round(v, 2) for k, v in timings.items()}, tiny=config.tiny, quant=calibration.quant,
        attention={p: c.to_dict() for p, c in plan.attention.items()}, vae_precision=config.vae.name,
        video_decoder=VideoDecoderRecord(VIDEO_DECODER_CUDA_GRAPH, VIDEO_DECODER_INDUCTOR_OPTIONS,
                                         VAE_FP8_EXECUTION if config.vae.quantized else None),
        loras=dit.loras, tensorrt=trt, sparse=_sparse_record(config, plan), lora_slots=config.slots,
        vsa=vsa_serving(config, plan), distilled=dit.distilled_record)


def _served_tasks(config: BuildConfig, meta) -> tuple[str, ...]:
    """The partition's tasks (its release metadata's), less those a --distilled file does not serve (FastH3: t2va)."""
    tasks = tuple(meta.tasks) if meta else ((config.task,) if config.task == "ref2va" else ("t2va", "fl2va"))
    serving = config.distilled_serving
    return tuple(t for t in tasks if t in serving.tasks) if serving is not None else tasks


def _sparse_record(config: BuildConfig, plan: BuildPlan) -> SparseRecord | None:
    if config.sparse is None:
        return None
    choice, s = plan.sparse_kernel, config.sparse
    return SparseRecord(s.sparsity, s.dense_steps, s.min_seq, choice.kernel, choice.block, tile=choice.tile,
                        requested=choice.requested, measured_ms=choice.measured_ms, unavailable=choice.unavailable)


def _checkpoint_sha(files, log) -> str:
    """sha256 over the shards' names and sha256s. The shards hash in parallel (one thread each, up to one per core):
    a full-size checkpoint is 66 GB, over 40 s on one core."""
    log(f"hashing the checkpoint ({len(files)} files, {sum(f.stat().st_size for f in files) / 1e9:.2f} GB) and "
        "the bundle's files into its manifest")
    with ThreadPoolExecutor(hash_threads()) as pool:
        digests = list(pool.map(sha256_file, files))
    h = hashlib.sha256()
    for f, digest in zip(files, digests):
        h.update(f.name.encode() + digest.encode())
    return h.hexdigest()


def write(work: Path, manifest: Manifest, sign, log) -> Manifest:
    """7. The manifest, every file hashed into it, then the signature (before the swap into place)."""
    t0 = time.perf_counter()
    manifest = write_manifest(work, manifest)
    if sign is not None:  # sign(root): manifest.sig beside the manifest (engines/signing.py)
        sign(work)
    log(f"wrote manifest.json: {len(manifest.files)} files, {manifest.total_bytes / 1e6:.1f} MB, hashed in "
        f"{time.perf_counter() - t0:.1f} s")
    return manifest
