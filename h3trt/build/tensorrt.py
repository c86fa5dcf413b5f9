"""TensorRT plans for the DiT segments: which TensorRT builds them, for which GPUs, over which shapes.

Two flavours build plans (tensorrt_notes.md sections 0 and 8):
  - `tensorrt`, the full datacenter builder, when it is importable: it builds for the GPU it runs on (H100/H200,
    B200 ...). It is not on PyPI (its wheels there are stubs that download from NVIDIA's index); it comes with
    NVIDIA's containers.
  - `tensorrt_rtx` otherwise (`pip install tensorrt-rtx`): it builds without a GPU for chosen compute capabilities
    (`--trt-targets`), but its plans run only on sm_80/86/89/120/121: an H200 (sm_90) refuses them at load.

Every network is strongly typed (the ONNX graph's dtypes and Q/DQ decide each layer's precision; TensorRT-RTX only
builds strongly typed networks). One optimization profile per bundle profile (`--canvas`); its ranges come from
`shape_ranges`, a pure function of the geometry.

Legend: S packed rows, V video rows, A audio rows, L text rows, T distinct timesteps, M = 3T modulation rows.
"""

from __future__ import annotations

import importlib
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..calibration.recipe import parse_exclusions
from ..errors import UserError
from ..models.config import H3Config
from ..models.packing import AUDIO_CHANNELS, Geometry
from ..models.precision import Precision
from .onnx_export import export_graph, onnx_output_names, segment_graphs

# Targets TensorRT-RTX 1.7.1 can compile for (its ComputeCapability enum; no sm_90, sm_100 or sm_103). Which of them
# hold which precision, and which a build targets by default, is the precision's spec (trt_targets).
RTX_TARGETS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")
# Text rows a request may bring: the prompt's tokens plus the vision rows of keyframes shown to the text encoder.
# A plan refuses shapes past its profile, so the cap is generous; the optimum is a typical prompt.
TEXT_ROWS = (1, 128, 1024)
# Distinct timesteps of one t2va/fl2va evaluation: video t, audio t, condition rows at max(t, 0.999).
TIMESTEPS = (1, 2, 3)
# Keyframe condition frames a t2va/fl2va request packs in front of the audio: none, first, first and last.
KEYFRAMES = (0, 1, 2)


@dataclass(frozen=True)
class TrtFlavour:
    """The TensorRT that builds (and later runs) the plans."""

    name: str  # "tensorrt" or "tensorrt_rtx"
    version: str

    def __post_init__(self):
        if self.name not in ("tensorrt", "tensorrt_rtx"):
            raise ValueError(f"TensorRT flavour must be tensorrt or tensorrt_rtx, got {self.name!r}.")

    @property
    def module(self):
        return importlib.import_module(self.name)


def detect_flavour() -> TrtFlavour:
    """The full builder when importable (it can target the local datacenter GPU), else TensorRT-RTX."""
    for name in ("tensorrt", "tensorrt_rtx"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        if hasattr(module, "Builder"):  # the PyPI `tensorrt` stubs import but have no builder
            return TrtFlavour(name, module.__version__)
    raise UserError("--backend tensorrt needs TensorRT: `pip install tensorrt-rtx` (builds for RTX-class GPUs "
                    "sm_80/86/89/120 without a GPU), or NVIDIA's full `tensorrt` (datacenter GPUs; from NVIDIA's "
                    "containers, not PyPI).")


def parse_targets(text: str | None, precision: Precision, flavour: TrtFlavour) -> tuple[str, ...]:
    """`--trt-targets sm89,sm120` -> ("sm89", "sm120"), checked against what the flavour and precision allow."""
    if flavour.name == "tensorrt":
        # The full builder tunes kernels on the GPU it runs on and its plans run on that GPU model only.
        if text:
            raise UserError("--trt-targets applies to TensorRT-RTX; the full tensorrt builder builds for the GPU it "
                            "runs on. Drop --trt-targets, or build where only tensorrt-rtx is installed.")
        if not torch.cuda.is_available():
            raise UserError("The full tensorrt builder needs a CUDA GPU to build on; none is visible.")
        major, minor = torch.cuda.get_device_capability()
        return (f"sm{major}{minor}",)
    targets = tuple(t.strip().lower().replace("_", "") for t in text.split(",") if t.strip()) if text else \
        precision.spec.trt_default_targets
    unknown = [t for t in targets if t not in RTX_TARGETS]
    if unknown:
        raise UserError(f"--trt-targets {','.join(unknown)}: TensorRT-RTX {flavour.version} compiles for "
                        f"{', '.join(RTX_TARGETS)} only (no sm90/sm100: Hopper and datacenter Blackwell need the "
                        "full tensorrt builder).")
    wrong = [t for t in targets if t not in precision.spec.trt_targets]
    if wrong:
        raise UserError(f"--precision {precision} cannot be built for {','.join(wrong)}: {precision} plans need "
                        f"one of {', '.join(precision.spec.trt_targets)} (FP8 GEMMs need Ada or RTX Blackwell, "
                        "FP4 needs RTX Blackwell). Choose other --trt-targets or another --precision.")
    if len(set(targets)) != len(targets) or not targets:
        raise UserError(f"--trt-targets must list distinct targets, got {text!r}.")
    return targets


def shape_ranges(cfg: H3Config, geometry: Geometry) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every dynamic dimension for one bundle profile of a t2va/fl2va bundle.

    The optimum is a t2va request with a typical prompt; the maximum covers both keyframes and TEXT_ROWS[2] text rows.
    """
    _, ph, pw = cfg.patch_size
    rows_per_frame = (geometry.latent_height // ph) * (geometry.latent_width // pw)
    target_video = geometry.latent_frames * rows_per_frame
    V = tuple(target_video + k * rows_per_frame for k in KEYFRAMES)
    A = AUDIO_CHANNELS * geometry.audio_latents
    L = TEXT_ROWS
    return {"V": V, "A": (A, A, A), "L": L, "S": tuple(l + v + A for l, v in zip(L, V)), "T": TIMESTEPS,
            "M": tuple(3 * t for t in TIMESTEPS)}


def input_shapes(spec, example: list[torch.Tensor], ranges: dict[str, tuple[int, int, int]]) -> dict[str, tuple]:
    """{input: (min shape, opt shape, max shape)}: the example's static dims, each dynamic dim from `ranges`."""
    shapes = {}
    for name, tensor in zip(spec.inputs, example):
        dims = spec.dynamic.get(name, {})
        shapes[name] = tuple(tuple(ranges[dims[d]][k] if d in dims else size for d, size in enumerate(tensor.shape))
                             for k in range(3))
    return shapes


class _Log:
    """Keeps the builder's messages: the layer list and memory totals are only reported there without a GPU."""

    def __init__(self, trt):
        class Logger(trt.ILogger):
            def __init__(inner):
                trt.ILogger.__init__(inner)
                inner.lines = []

            def log(inner, severity, msg):
                inner.lines.append((severity, msg))

        self.logger = Logger()
        self.trt = trt

    @property
    def lines(self) -> list[str]:
        return [m for _, m in self.logger.lines]

    def errors(self) -> list[str]:
        bad = (self.trt.ILogger.Severity.ERROR, self.trt.ILogger.Severity.INTERNAL_ERROR)
        return [m for s, m in self.logger.lines if s in bad]


def build_plan(flavour: TrtFlavour, onnx_path: Path, plan_path: Path, profiles: list[dict[str, tuple]],
               targets: tuple[str, ...]) -> dict:
    """Parse `onnx_path`, build a strongly typed plan with one optimization profile per entry of `profiles`, write it
    to `plan_path`. Returns what the build reports: bytes, seconds, layer names, activation bytes, fused attention."""
    trt = flavour.module
    log = _Log(trt)
    builder = trt.Builder(log.logger)
    # TensorRT 11 (and -RTX) networks are always strongly typed; 10.x needs the flag to be.
    strongly = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if strongly is None else 1 << int(strongly))
    parser = trt.OnnxParser(network, log.logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(parser.get_error(i).desc() for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT ({flavour.name} {flavour.version}) could not parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    if flavour.name == "tensorrt_rtx":
        config.num_compute_capabilities = len(targets)
        for i, target in enumerate(targets):
            config.set_compute_capability(getattr(trt.ComputeCapability, target.upper()), i)
    # DETAILED: the build log lists every layer (how fused attention shows without a GPU to inspect the plan).
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    for shapes in profiles:
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            name = network.get_input(i).name
            profile.set_shape(name, *shapes[name])
        config.add_optimization_profile(profile)
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - t0
    if plan is None:
        raise RuntimeError(f"TensorRT ({flavour.name} {flavour.version}) failed to build {onnx_path.name} for "
                           f"{','.join(targets)}: " + " | ".join(log.errors()[-5:]))
    tmp = plan_path.with_name(plan_path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(memoryview(plan))
    tmp.replace(plan_path)
    return {"plan_bytes": plan_path.stat().st_size, "build_s": round(seconds, 2), **build_report(log.lines)}


def build_report(lines: list[str]) -> dict:
    """From a DETAILED build log (one line per layer): layer names, activation memory, whether attention is one
    fused kernel, and the tensor types each GEMM reads (FP8 / FP4 there means the Q/DQ really became a
    low-precision GEMM)."""
    layer_lines = [row for line in lines for row in line.splitlines() if "LayerType:" in row]
    layers = [re.search(r"Name: ([^,]+), LayerType:", row).group(1) for row in layer_lines]
    gemm_types = sorted({t for row in layer_lines if "LayerType: gemm" in row
                         for t in re.findall(r"Datatype: (\w+)", row)})
    activation = [int(m.group(1)) for line in lines for m in [re.search(r"Total Activation Memory: (\d+)", line)] if m]
    return {"layers": layers, "activation_bytes": activation[-1] if activation else None,
            "fused_attention": any("mha" in name.lower() for name in layers), "gemm_types": gemm_types}


# Rows of the block example the ONNX trace runs on. Every sequence dimension is dynamic, so the trace needs only
# ranks and dtypes; at the full example (37,838 rows) the traced explicit attention would hold 56 x S^2 bf16 scores
# (160 GB).
TRACE_ROWS = 256


def _trace_block_example(example: list[torch.Tensor]) -> list[torch.Tensor]:
    x, mod, adaln_index, cos, sin = example
    n = min(TRACE_ROWS, x.shape[1])
    return [x[:, :n].contiguous(), mod, adaln_index[:n].contiguous(), cos[:n].contiguous(), sin[:n].contiguous()]


def build_plans(model, examples: dict, geometries: list[Geometry], precision: Precision, targets: tuple[str, ...],
                flavour: TrtFlavour, segments_dir: Path, log=print, exclude_blocks: tuple[int, ...] = ()
                ) -> dict[str, dict]:
    """Export every segment of `model` to ONNX, build its plan into `segments_dir`, return the manifest entries by
    segment name. `examples` are the builder's example inputs.

    fp8/nvfp4: the blocks (but `exclude_blocks`) must hold ModelOpt's calibrated quantizers
    (h3trt.calibration.calibrate.calibrate, which the builder runs over real trajectories); the export writes them as
    Q/DQ."""
    quantize = precision.spec.quantized
    if quantize:
        # ModelOpt is the calibration's dependency (h3trt[calibration]); a bf16/fp32 plan build never needs it.
        from modelopt.torch.quantization.utils import is_quantized

        bare = [i for i, layer in enumerate(model.blocks) if i not in exclude_blocks and not is_quantized(layer)]
        if bare:
            raise ValueError(f"--precision {precision}: blocks {bare} hold no ModelOpt quantizers; calibrate them "
                             "first (h3trt.calibration.calibrate.calibrate).")
    entries = {}
    with tempfile.TemporaryDirectory(prefix="h3trt-onnx-") as tmp:
        for name, (module, spec) in segment_graphs(model).items():
            is_block = name.startswith("block_")
            quantized = quantize and is_block and int(name.removeprefix("block_")) not in exclude_blocks
            example = examples["block" if is_block else name][:len(spec.inputs)]
            trace = _trace_block_example(example) if is_block else example
            t0 = time.perf_counter()
            onnx_path = export_graph(module, spec, trace, Path(tmp) / f"{name}.onnx",
                                     nvfp4=quantized and precision is Precision.NVFP4)
            export_s = time.perf_counter() - t0
            profiles = [input_shapes(spec, example, shape_ranges(model.cfg, g)) for g in geometries]
            report = build_plan(flavour, onnx_path, segments_dir / f"{name}.plan", profiles, targets)
            onnx_path.unlink()
            onnx_path.with_name(onnx_path.name + ".data").unlink()
            log(f"{name}: exported in {export_s:.1f} s, plan built in {report['build_s']:.1f} s "
                f"({report['plan_bytes'] / 1e6:.1f} MB, {len(report['layers'])} layers, attention "
                f"{'fused' if report['fused_attention'] else 'not fused'}, "
                f"GEMMs read {'/'.join(report['gemm_types'])})")
            entries[name] = {"name": name, "artifact": f"{name}.plan", "inputs": spec.inputs,
                             "outputs": onnx_output_names(spec), "dynamic": spec.dynamic,
                             "profiles": [{k: [list(s) for s in v] for k, v in p.items()} for p in profiles],
                             "quantized": precision if quantized else None, "export_s": round(export_s, 2),
                             **{k: v for k, v in report.items() if k != "layers"}, "layers": len(report["layers"])}
    return entries


def check_build_config(config) -> None:
    """What a tensorrt build refuses up front (BuildConfig.__post_init__ calls this for --backend tensorrt)."""
    if config.task == "ref2va":
        raise UserError("--backend tensorrt builds t2va/fl2va bundles; ref2va's reference rows have no shape range "
                        "yet. Use --backend inductor for ref2va.")
    if config.sp != 1:
        raise UserError(f"--backend tensorrt serves one process; --sp {config.sp} needs the inductor backend.")
    if config.fp8_attention:
        raise UserError("--fp8-attention is h3trt's FP8 attention op, which the inductor and aoti backends compile; "
                        "the TensorRT graphs run attention as one fused bf16 MHA kernel. Drop --fp8-attention or use "
                        "--backend inductor.")
    if config.precision is Precision.NVFP4 and config.device != "cuda" and not config.device.startswith("cuda:"):
        raise UserError("--backend tensorrt --precision nvfp4 needs --device cuda (compute capability >= 8.9): its "
                        "FP4 activation quantizers have no CPU kernel in ModelOpt, and the ONNX export runs them.")
    if config.trt_targets is not None:
        targets = [t.strip().lower().replace("_", "") for t in config.trt_targets.split(",") if t.strip()]
        if not targets or any(t not in RTX_TARGETS for t in targets):
            raise UserError(f"--trt-targets must be a comma-separated list of {', '.join(RTX_TARGETS)} (what "
                            f"TensorRT-RTX compiles for), got {config.trt_targets!r}. Hopper (sm90) and datacenter "
                            "Blackwell (sm100) need the full tensorrt builder, which builds for the GPU it runs on.")


def build_tensorrt_segments(model, examples: dict, config, work: Path, log=print) -> tuple[dict, dict]:
    """The builder's step 3 for --backend tensorrt: plans into `work/segments`, and the manifest's `tensorrt` record
    (flavour, version, targets). The plans embed the weights, so the segment weight files are dropped; the AdaLN
    tables / weights stay (the modulation table is a plan input)."""
    flavour = detect_flavour()
    targets = parse_targets(config.trt_targets, config.precision, flavour)
    log(f"building TensorRT plans with {flavour.name} {flavour.version} for {', '.join(targets)} "
        f"({config.precision}, {len(config.profiles)} optimization profile(s))")
    t0 = time.perf_counter()
    exclude = parse_exclusions(config.quant_exclude)[0]  # blocks.N kept bf16: calibrated without quantizers
    segments = build_plans(model, examples, [p.geometry for p in config.profiles], config.precision, targets, flavour,
                           work / "segments", log, exclude)
    seconds = time.perf_counter() - t0
    for name in ("embed", "blocks", "final"):
        (work / "weights" / f"{name}.safetensors").unlink(missing_ok=True)
    return segments, {"flavour": flavour.name, "version": flavour.version, "targets": list(targets),
                      "strongly_typed": True, "onnx_opset": 20,
                      "export_and_build_s": round(seconds, 2)}
