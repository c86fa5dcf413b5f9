"""Serving a TensorRT bundle: each plan behind the segment interface, the DiT runner over them, and the refusal of a
GPU that cannot run the plans.

Which GPU runs which plan (tensorrt_notes.md 1.1, 1.8): a TensorRT-RTX plan runs only on the compute capabilities it
was built for among sm_80/86/89/120/121 (an H200, sm_90, refuses it at deserialization); a full-TensorRT plan runs
on the GPU model it was built on. Plans are not portable across TensorRT versions. Each refusal here names the GPU,
its compute capability and the plan's targets, before any plan is deserialized.

Legend as in `h3trt.models.dit`: S packed rows, V/A/L video/audio/text rows, T distinct timesteps.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from ..models.config import NUM_MODALITIES, H3Config
from ..models.dit import rope_inv_freq, rope_tables
from ..models.block_stack import run_block_stack
from ..models.runner import NO_EXTRAS, EvalExtras, RunnerCaps
from .adaln import load_adaln
from .caps import bundle_caps
from .bundle_files import verify_files
from .manifest import BundleError, Manifest


def plan_device_problem(trt_info: dict, gpu: str | None, capability: tuple[int, int] | None,
                        installed: dict[str, str]) -> str | None:
    """Why this process cannot run the bundle's plans, or None. `gpu`/`capability`: the CUDA device (None: no GPU);
    `installed`: {flavour: version} of the TensorRT modules importable here."""
    flavour, version, targets = trt_info["flavour"], trt_info["version"], trt_info["targets"]
    built = f"{flavour} {version} plans for {', '.join(targets)}"
    if gpu is None:
        return (f"This bundle holds {built}; TensorRT plans run on a CUDA GPU and this process has none. Serve it on "
                f"a GPU of compute capability {' or '.join(_cc(t) for t in targets)}.")
    here = f"sm{capability[0]}{capability[1]}"
    if here not in targets:
        hint = (" Hopper and datacenter Blackwell run only full-TensorRT plans (NVIDIA's containers; tensorrt is not "
                "on PyPI): build the bundle there with `h3trt build --backend tensorrt`."
                if flavour == "tensorrt_rtx" and capability[0] in (9, 10) else
                f" Rebuild with --trt-targets {here}." if flavour == "tensorrt_rtx" else
                " Rebuild the bundle on this GPU model.")
        return (f"This bundle holds {built}; this GPU, {gpu}, has compute capability {capability[0]}.{capability[1]} "
                f"({here}), which the plans cannot run on.{hint}")
    if installed.get(flavour) != version:
        have = installed.get(flavour)
        return (f"This bundle holds {built}; this process has {flavour} {have or 'not installed'}. Plans are specific "
                f"to the TensorRT version: install {flavour}=={version} or rebuild the bundle here.")
    return None


def _cc(target: str) -> str:
    digits = target.removeprefix("sm")
    return f"{digits[:-1]}.{digits[-1]}"


def installed_flavours() -> dict[str, str]:
    found = {}
    for name in ("tensorrt", "tensorrt_rtx"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        if hasattr(module, "Runtime"):
            found[name] = module.__version__
    return found


def check_plan_device(trt_info: dict, device: torch.device) -> None:
    gpu = capability = None
    if device.type == "cuda" and torch.cuda.is_available():
        gpu, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
    problem = plan_device_problem(trt_info, gpu, capability, installed_flavours())
    if problem:
        raise BundleError(problem)


def pick_profile(profiles: list[dict[str, list]], shapes: dict[str, tuple[int, ...]], segment: str) -> int:
    """The first optimization profile whose [min, max] box holds every input shape (profiles follow the bundle's
    --canvas order). Refuses, naming the shapes, when none does."""
    for index, profile in enumerate(profiles):
        if all(all(lo <= s <= hi for s, lo, hi in zip(shapes[name], box[0], box[2])) for name, box in profile.items()):
            return index
    boxes = "; ".join(", ".join(f"{n} {tuple(b[0])}..{tuple(b[2])}" for n, b in p.items()) for p in profiles)
    raise BundleError(f"The {segment} plan has no optimization profile for input shapes "
                      f"{ {n: tuple(s) for n, s in shapes.items()} }; its profiles are: {boxes}. Rebuild with a "
                      "--canvas for this resolution and duration.")


class TrtSegment:
    """One plan behind the segment interface: call with the segment's activation inputs, get a tuple of outputs."""

    def __init__(self, trt, plan: bytes, entry: dict, device: torch.device, flavour: str):
        self.entry, self.device, self.trt = entry, device, trt
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise BundleError(f"TensorRT could not deserialize {entry['artifact']} on "
                              f"{torch.cuda.get_device_name(device)}; see the TensorRT message above.")
        if flavour == "tensorrt_rtx":
            # TensorRT-RTX compiles kernels at context creation (its JIT step); the runtime config holds that cache.
            self.context = self.engine.create_execution_context(self.engine.create_runtime_config())
        else:
            self.context = self.engine.create_execution_context()
        self.profile = None

    def _dtype(self, name: str) -> torch.dtype:
        t = self.trt.DataType
        table = {t.FLOAT: torch.float32, t.HALF: torch.float16, t.BF16: torch.bfloat16, t.INT64: torch.int64,
                 t.INT32: torch.int32, t.BOOL: torch.bool}
        return table[self.engine.get_tensor_dtype(name)]

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        names = self.entry["inputs"]
        # The plans' inputs/outputs live on the current CUDA stream; (0 on a CPU device: only a stand-in runtime in
        # the tests runs there, since check_plan_device refuses every GPU-less load).
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        profile = pick_profile(self.entry["profiles"], {n: tuple(t.shape) for n, t in zip(names, inputs)},
                               self.entry["name"])
        if profile != self.profile:
            self.context.set_optimization_profile_async(profile, stream)
            self.profile = profile
        # The eager segments cast their inputs to the weights' dtype first; the plan's inputs carry those dtypes.
        keep = [t.to(self.device, self._dtype(n)).contiguous() for n, t in zip(names, inputs)]
        for name, tensor in zip(names, keep):
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        outputs = []
        for name in self.entry["outputs"]:
            out = torch.empty(tuple(self.context.get_tensor_shape(name)), dtype=self._dtype(name), device=self.device)
            self.context.set_tensor_address(name, out.data_ptr())
            outputs.append(out)
        if not self.context.execute_async_v3(stream):
            raise RuntimeError(f"TensorRT failed to execute {self.entry['artifact']}.")
        return tuple(outputs)


class TrtDiT:
    """The DiT forward from plans (the runner contract: models/runner.py): embed, one plan per layer, final. Weights
    live in the plans; the modulation tables (baked or live AdaLN) and the rotary tables are inputs, as in every
    bundle. Its plans fuse their attention and hold no adapters: `caps` serves a step cache alone (the loader's come
    from the manifest: engines/caps.py)."""

    def __init__(self, cfg: H3Config, segments: dict[str, TrtSegment], adaln, device: torch.device,
                 caps: RunnerCaps = RunnerCaps()):
        self.cfg, self.adaln, self.device, self.caps = cfg, adaln, device, caps
        self.embed, self.final = segments["embed"], segments["final"]
        self.blocks = [segments[f"block_{i}"] for i in range(cfg.num_layers)]
        self.inv_freq = rope_inv_freq(cfg).to(device)

    def __call__(self, video, audio, text, unique_t, t_index, layout, extras: EvalExtras = NO_EXTRAS):
        if extras.sparse is not None or extras.adapters is not None:  # admission checks the caps: a caller's mistake
            raise ValueError("a TensorRT bundle runs no block-sparse attention and no adapters (its caps say so).")
        x, temb = self.embed(video, audio, text, unique_t, layout.video_index, layout.audio_index, layout.text_index,
                             layout.token_tags)
        rows = self.adaln.rows(unique_t)
        adaln_index = t_index * NUM_MODALITIES + layout.token_tags
        cos, sin = rope_tables(layout.position_ids, self.inv_freq)

        def block_fn(i, x, adaln_index, rope):
            return self.blocks[i](x, self.adaln.block(i, rows, temb).contiguous(), adaln_index, *rope)[0]

        x = run_block_stack(x, len(self.blocks), block_fn, adaln_index, (cos, sin), extras.cache)
        return self.final(x, self.adaln.final_table(rows, temb).contiguous(), t_index, layout.video_index,
                          layout.audio_index)


def load_trt_engine(engine_cls, root: Path, manifest: Manifest, device: torch.device, mesh=None):
    """`Engine.load` for a tensorrt bundle: device check first, then hashes, plans, AdaLN. The video decoder runs
    eagerly from the bundle's copied VAE (the plans cover the DiT only)."""
    info = manifest.tensorrt
    if mesh is not None and mesh.world_size != 1:
        raise BundleError(f"This TensorRT bundle serves one process; the job has world size {mesh.world_size}. "
                          "Launch one rank.")
    check_plan_device(info, device)
    problems = verify_files(root, manifest)
    if problems:
        raise BundleError(f"{root} does not match its manifest: {'; '.join(problems[:10])}. Re-copy or rebuild it.")
    cfg = manifest.model_config
    trt = importlib.import_module(info["flavour"])
    segments = {name: TrtSegment(trt, (root / "segments" / e["artifact"]).read_bytes(), e, device, info["flavour"])
                for name, e in manifest.segments.items()}
    adaln = load_adaln(root, manifest, cfg, device)
    dit = TrtDiT(cfg, segments, adaln, device, bundle_caps(manifest))
    return engine_cls(root, manifest, dit, segments, compiled_video_decoder=False)
