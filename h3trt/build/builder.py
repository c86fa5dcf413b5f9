"""`h3trt build`: checkpoint -> engine bundle.

  1. load the DiT of the task's partition and merge the --lora files into it
  2. write the segment weights (safetensors) and bake the AdaLN tables (or keep adaln_proj with --keep-adaln)
  3. compile embed / block / final once each (one block serves every layer: its weights are inputs)
  4. copy the eager components (text encoder, tokenizer, processor, VAEs)
  5. load every artifact in a fresh process, under the no-compile guard, and check it against the eager segment
  6. hash every file into manifest.json (which hashes its own content; --sign adds manifest.sig), then rename the
     finished bundle into place
The bundle is assembled in `<output>.partial` and only renamed when complete: a failed build leaves nothing that
looks like a bundle.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ..calibration.build import block_weight_sets, calibrate_dit, first_layer
from ..calibration.recipe import QuantRecipe
from ..errors import UserError
from ..engines.loaders import bundle_activated
from ..engines.manifest import Manifest, device_arch, hash_threads, runtime_versions, sha256_file, write_manifest
from ..engines.weights_io import write_safetensors
from ..models.checkpoint import load_dit, locate_transformer
from ..models.config import NUM_MODALITIES
from ..models.dit import H3DiT
from ..models.lora import merge_loras
from ..models.packing import Geometry, pack_t2va, row_timesteps, text_tags_for
from ..models.precision import Precision
from ..models.sampler import Schedule
from ..models.vae_precision import VAEPrecision
from ..models.video_vae import decoder_prologue
from ..parallel.mesh import MeshConfig
from ..parallel.ulysses import padded_length
from ..calibration.vae_fp8 import EXECUTION as VAE_FP8_EXECUTION, load_video_vae_at
from ..engines.video_decoder import parse_video_decoder_name
from .adaln import bake_tables, schedule_timesteps
from .config import BuildConfig, Profile
from .backends import compile_segment
from .segments import (block_weight_names, dit_segments, embed_segment, final_weight_names,
                       video_decoder_segments)
from .tensorrt import build_tensorrt_segments
from .attention_choice import AttentionShape, resolve_attention

EAGER_COMPONENTS = ("text_encoder", "tokenizer", "processor", "video_vae", "audio_vae", "vae")
EXAMPLE_TEXT_ROWS = 37  # the text length the example inputs use; every dimension is dynamic anyway
VERIFY_TIMEOUT_S = 900
# Serve each compiled tile decoder as one CUDA graph replay (h3trt/engines/video_decoder.py says why); recorded in the
# manifest, ignored on the CPU. scripts/bench_vae.py measures both ways in one run (bitwise-equal pixels).
VIDEO_DECODER_CUDA_GRAPH = True
# Inductor options the video decoder's segments compile with, over the DiT's (scripts/bench_vae_compile.py measures
# max-autotune against these defaults and prints what to keep).
VIDEO_DECODER_INDUCTOR_OPTIONS: dict = {}


class BuildError(RuntimeError):
    """The build failed, not its user: compiled code that does not load or match in a fresh process, or a check that
    did not finish. The message gives the reason (the check's last lines). A user's mistake is a UserError."""


def _weights(model: H3DiT, recipe: QuantRecipe | None = None) -> dict[str, dict[str, torch.Tensor]]:
    # Left where they are (the GPU): `_save` streams them to the file one at a time. A host copy of a full-size model
    # is 66 GB of host memory, on top of a checkpoint that may itself sit in RAM (tmpfs).
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


@torch.no_grad()
def example_inputs(model: H3DiT, geometry: Geometry, device, sp: int = 1,
                   recipe: QuantRecipe | None = None) -> dict[str, list[torch.Tensor]]:
    """Inputs for every segment at one profile (fl2va with a first keyframe, so condition rows are present), from
    the eager model: the same tensors check the compiled segments. With sp > 1 the block halves get the first rank's
    rows of the padded sequence."""
    cfg = model.cfg
    layout = pack_t2va(text_tags_for(EXAMPLE_TEXT_ROWS, [range(3, 9)]), geometry.latent_frames, geometry.latent_height,
                       geometry.latent_width, geometry.audio_latents, cfg.patch_size, ("first",)).to(device)
    g = torch.Generator().manual_seed(0)
    video = torch.randn(1, layout.video_index.numel(), cfg.video_patch_dim, generator=g).to(device)
    audio = torch.randn(1, layout.audio_index.numel(), cfg.audio_in_channels, generator=g).to(device)
    text = torch.randn(1, EXAMPLE_TEXT_ROWS, cfg.text_dim, generator=g).to(device, model.dtype)
    unique_t, t_index = (t.to(device) for t in row_timesteps(layout, 0.25, 0.5))
    sd = model.state_dict()
    emb, *blocks, fin = dit_segments(cfg, model.dtype, sp, recipe)
    x, temb = model.embed(video, audio, text, unique_t, layout.video_index, layout.audio_index, layout.text_index,
                          layout.seq_len)
    cos, sin = model.rope(layout.position_ids)
    adaln_index = t_index * NUM_MODALITIES + layout.token_tags
    mod = model.blocks[0].modulation(temb).contiguous()
    examples = {
        "embed": [video, audio, text, unique_t, layout.video_index, layout.audio_index, layout.text_index,
                  layout.token_tags] + [sd[n] for n in emb.weights],
        "final": [x, model.final_layer.modulation(temb).contiguous(), t_index, layout.video_index, layout.audio_index]
                 + [sd[f"final_layer.{n}"] for n in fin.weights],
    }
    if sp == 1:
        examples["block"] = [x, mod, adaln_index, cos, sin]
    else:
        rows = padded_length(layout.seq_len, sp) // sp
        x, adaln_index, cos, sin = (F.pad(t, (0, 0) * (t.dim() - 1 - d) + (0, rows * sp - layout.seq_len))
                                    .narrow(d, 0, rows).contiguous() for t, d in
                                    ((x, 1), (adaln_index, 0), (cos, 0), (sin, 0)))
        attn = torch.randn(sp, 1, rows, cfg.num_heads // sp, cfg.head_dim, generator=g).to(device, model.dtype)
        examples["block_pre"] = [x, mod, adaln_index, cos, sin]
        examples["block_post"] = [x, attn, mod, adaln_index]
    if sp != 1 and recipe is not None and recipe.fp8_attention:
        # Sharded FP8 attention: every real row, a rank's heads (what the exchange hands it).
        examples["attention"] = [torch.randn(1, layout.seq_len, cfg.num_heads // sp, cfg.head_dim, generator=g)
                                 .to(device, model.dtype) for _ in range(3)]
    if "block_hp" in {spec.name for spec in blocks}:
        examples["block_hp"] = list(examples["block"])
    for spec in blocks:
        i = first_layer(recipe, cfg.num_layers, spec.name) if spec.name in ("block", "block_hp") else 0
        examples[spec.name] += [sd[f"blocks.{i}.{n}"] for n in spec.weights]
    return examples


def _seq_len(cfg, profile: Profile) -> int:
    """Packed rows of a profile's request as the build's example packs it (text, keyframe, video, audio)."""
    geometry = profile.geometry
    return pack_t2va(text_tags_for(EXAMPLE_TEXT_ROWS, [range(3, 9)]), geometry.latent_frames, geometry.latent_height,
                     geometry.latent_width, geometry.audio_latents, cfg.patch_size, ("first",)).seq_len


def mesh_record(cfg, config: BuildConfig) -> dict:
    """The mesh baked into the segments: sp fixes each rank's heads (the block halves' buffer layout is static), the
    rows per rank stay symbolic (ceil(S / sp) for a packed length S). Any number of replicas may serve a bundle: a
    replica group is one more copy of the same ranks."""
    return {"cfg": config.cfg, "sp": config.sp, "heads_per_rank": cfg.num_heads // config.sp,
            "rows_per_rank": "ceil(S / sp), symbolic"}


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    return write_safetensors(path, tensors)


def build(config: BuildConfig, log=print, sign=None) -> Manifest:
    out = Path(config.output)
    if out.exists() and not config.overwrite:
        raise ValueError(f"{out} already exists; pass --overwrite to replace it or choose another --output.")
    # sp against the heads, before anything slow.
    model_cfg = locate_transformer(config.model_root, config.task).config
    MeshConfig(cfg=config.cfg, sp=config.sp).validate(config.cfg * config.sp, model_cfg.num_heads)
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is visible; use --device cpu.")
    if device.type == "cuda" and (device.index or 0) != 0:
        # Compiled code names the device it was compiled on; bundles are compiled on, and served from, the process's
        # cuda:0 (h3trt/parallel/devices.py). `h3trt build --device cuda:N` makes GPU N this process's cuda:0.
        raise ValueError(f"Bundles are compiled on the process's cuda:0, not {device}; use h3trt build --device "
                         f"cuda:{device.index}, which makes that GPU the process's cuda:0.")
    dtype = config.precision.spec.dtype
    # The attention kernels, before anything slow: measured at the bundle's attention shape (every row of the
    # longest profile, one rank's heads), or a named kernel checked against this GPU.
    attention = {}
    if config.backend != "tensorrt":
        shape = AttentionShape(max(_seq_len(model_cfg, p) for p in config.profiles),
                               model_cfg.num_heads // config.sp, model_cfg.head_dim)
        for precision in config.attention_precisions():
            choice = resolve_attention(config.attention, precision, device, shape)
            attention[precision] = choice
            timed = ", ".join(f"{k} {ms:.2f} ms" for k, ms in choice.measured_ms.items())
            left_out = "; ".join(f"{k} left out: {r}" for k, r in choice.unavailable.items())
            log(f"{precision} attention: {choice.kernel} (--attention {config.attention}"
                f"{', measured ' + timed if timed else ''} at {shape.rows} rows x {shape.heads} heads)"
                f"{'; ' + left_out if left_out else ''}")
    if config.backend in ("inductor", "aoti") and bundle_activated():
        # Measured: after a bundle's cache is activated, a build in the same process leaves some C++ kernels out of
        # the new bundle's cache, and its fresh-process check then finds the compiler invoked.
        raise UserError(f"This process already serves from the bundle {bundle_activated()}; a build here would not "
                         "capture every compiled kernel. Build in a fresh process (`h3trt build ...`).")
    fp8_kernel = attention[Precision.FP8].kernel if Precision.FP8 in attention else ""
    dense_kernel = next((c.kernel for p, c in attention.items() if p != Precision.FP8), "sdpa")
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    (work / "segments").mkdir(parents=True)
    timings = {}
    try:
        # 1. The DiT of the task's partition.
        t0 = time.perf_counter()
        model, source = load_dit(config.model_root, config.task, dtype=dtype, device=device)
        meta = source.metadata
        video_shift, audio_shift = source.shifts  # the checkpoint's: its release metadata, or diffusers' schedulers
        schedule = Schedule(config.steps, config.video_shift or video_shift, config.audio_shift or audio_shift)
        timings["load_s"] = time.perf_counter() - t0
        log(f"loaded {config.task} DiT ({sum(p.numel() for p in model.parameters()) / 1e6:,.1f} M parameters, "
            f"{config.precision}) in {timings['load_s']:.1f} s")

        # 1a. LoRAs, merged into the weights: everything below (calibration, AdaLN tables, segments) sees them.
        loras = merge_loras(model, config.loras, config.task)
        for r in loras:
            log(f"merged LoRA {r['file']} x {r['scale']:g} into {r['partition']} ({r['modules']} modules, "
                f"{r['layout']}, {r['alpha']})")

        # 1b. FP8 / NVFP4: calibrate through ModelOpt on real trajectories of this model, then quantize its blocks in
        # place. tensorrt keeps ModelOpt's quantizers in the blocks: the ONNX export writes them as Q/DQ, so both
        # backends take their scales from the same calibration. Its segments are ONNX graphs, not the recipe's
        # compiled blocks, hence no recipe for the steps below.
        recipe, quant = config.recipe_for(fp8_kernel), None
        if recipe is not None:
            trt = config.backend == "tensorrt"
            recipe, quant = calibrate_dit(model, recipe, source.component_root, config.calib_prompts,
                                          config.profiles[0], (schedule.video_shift, schedule.audio_shift),
                                          keep_modelopt_quantizers=trt, log=log)
            if trt:
                quant["execution"], recipe = config.precision.spec.trt_execution, None

        # 2. Weights, and the AdaLN tables for the schedule.
        weights = _weights(model, recipe)
        sizes = {name: _save(work / "weights" / f"{name}.safetensors", weights[name])
                 for name in ("embed", "blocks", "final")}
        adaln_bytes = sum(t.numel() * t.element_size() for t in weights["adaln"].values())
        if config.keep_adaln:
            sizes["adaln_weights"] = _save(work / "weights" / "adaln_weights.safetensors", weights["adaln"])
            adaln = {"baked": False, "bytes_saved": 0}
        else:
            values = schedule_timesteps(schedule)
            sizes["adaln_tables"] = _save(work / "weights" / "adaln_tables.safetensors", bake_tables(model, values))
            adaln = {"baked": True, "timesteps": values.numel(), "adaln_weight_bytes": adaln_bytes,
                     "table_bytes": sizes["adaln_tables"], "bytes_saved": adaln_bytes - sizes["adaln_tables"]}
            saved = adaln["bytes_saved"]  # negative for a model this small: its tables outweigh its weights
            log(f"baked AdaLN for {values.numel()} timesteps: {sizes['adaln_tables'] / 1e6:.1f} MB of tables replace "
                f"{adaln_bytes / 1e6:.1f} MB of adaln_proj weights ("
                + (f"{saved / 1e6:.1f} MB saved)" if saved >= 0 else f"{-saved / 1e6:.1f} MB more: at this width the "
                   "tables of every step are larger than the weights; --keep-adaln keeps the weights instead)"))
        del weights

        # 3. Compile each segment once, capturing the compiled binaries in the bundle's own Inductor cache.
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir  # Inductor: seconds to import

        examples = example_inputs(model, config.profiles[0].geometry, device, config.sp, recipe)
        specs = {spec.name: spec for spec in dit_segments(model.cfg, dtype, config.sp, recipe, dense_kernel)}
        specs.update(_video_decoder_specs(source.component_root, config.profiles, device, config.vae, examples))
        if config.backend == "tensorrt":  # ONNX export + TensorRT plans instead of torch compiles (tensorrt.py)
            trt_segments, trt_record = build_tensorrt_segments(model, examples, config, work, log)
            # Plans run only on their target GPUs, and the video decoder stays eager: no torch compile, no check here.
            specs, examples = {}, {}
        cache = work / "inductor_cache" if config.backend == "inductor" else Path(tempfile.mkdtemp(prefix="h3trt-aoti-"))
        cache.mkdir(parents=True, exist_ok=True)
        segments = {}
        t0 = time.perf_counter()
        with temporary_cache_dir(str(cache)):
            for spec in specs.values():
                ts = time.perf_counter()
                options = VIDEO_DECODER_INDUCTOR_OPTIONS if parse_video_decoder_name(spec.name) else None
                entry = compile_segment(config.backend, spec, examples[spec.name], work / "segments", options)
                segments[spec.name] = {"name": spec.name, **entry, "inputs": spec.inputs, "weights": spec.weights,
                                       "outputs": spec.outputs, "dynamic": spec.dynamic}
                log(f"compiled {spec.name} ({config.backend}) in {time.perf_counter() - ts:.1f} s")
        timings["compile_s"] = time.perf_counter() - t0
        if config.backend != "inductor":
            shutil.rmtree(cache, ignore_errors=True)
        _prune_cache(work / "inductor_cache")

        if config.backend == "tensorrt":
            segments = trt_segments

        # 4. The eager components, copied so the bundle is self-contained.
        for name in EAGER_COMPONENTS:
            src = source.component_root / name
            if src.is_dir():
                shutil.copytree(src, work / name)

        # 5. Every artifact loads and matches in a fresh process (AOTI on the H200 image segfaults at load).
        t0 = time.perf_counter()
        _verify_in_subprocess(work, config, segments, examples, specs)
        timings["verify_s"] = time.perf_counter() - t0

        # 6. Manifest last, then the rename.
        manifest = {
            "backend": config.backend, "precision": config.precision, "task": config.task,
            "tasks": list(meta.tasks) if meta else ([config.task] if config.task == "ref2va" else ["t2va", "fl2va"]),
            "model_config": model.cfg.to_dict(), "checkpoint": {"path": str(config.model_root),
                                                                "sha256": _checkpoint_sha(source.files)},
            "schedule": {"steps": schedule.steps, "video_shift": schedule.video_shift,
                         "audio_shift": schedule.audio_shift},
            "adaln": adaln, "profiles": [{**asdict(p), "num_frames": p.geometry.num_frames} for p in config.profiles],
            "mesh": mesh_record(model.cfg, config), "arch": device_arch(device), "device": str(device),
            "versions": runtime_versions(), "segments": segments, "weight_bytes": sizes, "tiny": config.tiny,
            "build_timings_s": {k: round(v, 2) for k, v in timings.items()}, "quant": quant,
            "attention": {p: c.to_dict() for p, c in attention.items()},
            "vae_precision": config.vae.name,
            "video_decoder": {"segments": "in + block (one compiled block serves every layer) + out, per tile shape",
                              "cuda_graph": VIDEO_DECODER_CUDA_GRAPH,
                              "inductor_options": VIDEO_DECODER_INDUCTOR_OPTIONS,
                              "fp8": VAE_FP8_EXECUTION if config.vae.quantized else None},
            "loras": loras,
        }
        if config.backend == "tensorrt":
            # Flavour, version, targets: what Engine.load checks the GPU against. Plans run on CUDA, wherever built.
            manifest.update(tensorrt=trt_record, device="cuda", arch=",".join(trt_record["targets"]),
                            weight_bytes={k: v for k, v in sizes.items() if k.startswith("adaln")})
        manifest = write_manifest(work, manifest)
        if sign is not None:  # sign(root): manifest.sig beside the manifest (engines/signing.py), before the rename
            sign(work)
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
        return manifest
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _prune_cache(cache: Path) -> None:
    """Drop lock files and empty folders: the cache ships as read-only data."""
    if not cache.exists():
        return
    for path in list(cache.rglob("*.lock")) + list(cache.rglob("locks")):
        if path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def _checkpoint_sha(files) -> str:
    """sha256 over the shards' names and sha256s. The shards hash in parallel (one thread each, up to one per core):
    a full-size checkpoint is 66 GB, over 40 s on one core."""
    with ThreadPoolExecutor(hash_threads()) as pool:
        digests = list(pool.map(sha256_file, files))
    h = hashlib.sha256()
    for f, digest in zip(files, digests):
        h.update(f.name.encode() + digest.encode())
    return h.hexdigest()


def _video_decoder_specs(component_root: Path, profiles, device, precision: VAEPrecision, examples: dict) -> dict:
    """The video decoder segments (in, block, out) of every (window, tile) shape the profiles decode, at
    `precision`; fills `examples`."""
    video_vae = load_video_vae_at(component_root, device, precision)
    shapes = sorted({key for p in profiles for key in video_vae.tile_shapes(p.geometry.latent_frames,
                                                                             p.geometry.latent_height,
                                                                             p.geometry.latent_width)})
    specs, found = video_decoder_specs(video_vae, shapes)
    examples.update(found)
    return specs


def video_decoder_specs(video_vae, shapes) -> tuple[dict, dict]:
    """({name: SegmentSpec}, {name: example inputs}) of the in / block / out segments of each (window latents, tile h,
    tile w) in `shapes`, bound to `video_vae`'s tensors (block: layer 0's); the block's and out's example activations
    come from the eager `in` on a seeded latent."""
    vae = video_vae.vae
    tensors = {**dict(vae.named_parameters()), **dict(vae.named_buffers())}
    block = vae.decoder.transformer_blocks[0]
    block_tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}
    channels = vae.config.latent_channels
    specs, examples = {}, {}
    for t, h, w in shapes:
        seg_in, seg_block, seg_out = video_decoder_segments(vae, t, h, w)
        z = torch.randn(1, channels, t, h, w, generator=torch.Generator().manual_seed(0)).to(video_vae.device,
                                                                                             video_vae.dtype)
        with torch.no_grad():
            x, cos, sin = decoder_prologue(vae, z)
        examples[seg_in.name] = [z] + [tensors[n].detach() for n in seg_in.weights]
        examples[seg_block.name] = [x, cos, sin] + [block_tensors[n].detach() for n in seg_block.weights]
        examples[seg_out.name] = [x] + [tensors[n].detach() for n in seg_out.weights]
        specs.update({s.name: s for s in (seg_in, seg_block, seg_out)})
    return specs, examples


def _verify_in_subprocess(work: Path, config: BuildConfig, segments: dict, examples: dict, specs: dict) -> None:
    if not examples:  # a tensorrt build: its plans run only on their target GPUs
        return

    with tempfile.TemporaryDirectory(prefix="h3trt-verify-") as tmp:
        tensors, plan = {}, {}
        for name, inputs in examples.items():
            spec = specs[name]
            with torch.no_grad():
                want = spec.fn(*inputs)
            want = want if isinstance(want, tuple) else (want,)
            for i, t in enumerate(inputs):
                tensors[f"{name}.in.{i}"] = t.detach().cpu().clone()  # clones: safetensors refuses shared storage
            for i, t in enumerate(want):
                tensors[f"{name}.out.{i}"] = t.detach().cpu().clone()
            rel_tol = (config.vae.verify_rel_tol if parse_video_decoder_name(name)
                       else config.precision.spec.verify_rel_tol)
            plan[name] = {"entry": segments[name], "inputs": len(inputs), "outputs": len(want), "rel_tol": rel_tol}
        save_file(tensors, f"{tmp}/examples.safetensors")
        del tensors, want  # host copies (at full size ~13 GB, the video decoder's fp32 weights): free for the child
        Path(tmp, "plan.json").write_text(json.dumps({
            "backend": config.backend, "device": config.device, "plan": plan}))
        try:
            proc = subprocess.run([sys.executable, "-m", "h3trt.build.verify", str(work), tmp], capture_output=True,
                                  text=True, timeout=VERIFY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise BuildError(f"Loading the compiled segments in a fresh process did not finish in {VERIFY_TIMEOUT_S} s; "
                             "the bundle was not written.") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        how = " (the process crashed: signal %d)" % -proc.returncode if proc.returncode < 0 else ""
        raise BuildError(f"The {config.backend} segments failed to load or match in a fresh process{how}; the bundle "
                         f"was not written. Try another --backend. Last output:\n{tail}")
