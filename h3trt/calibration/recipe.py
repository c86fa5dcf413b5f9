"""What a low-precision bundle quantizes, and what it keeps in the block dtype.

Only the main blocks' four linears are ever quantized (they are 98% of the DiT's GEMM work). Everything outside the
block stays at the checkpoint's precision by construction: patch projections, condition projection, time embedder,
token refiner and output heads live in the embed/final segments, and AdaLN is baked into bf16 tables. The recipe
can exclude more: whole blocks (served by a second, high-precision block segment) or one linear in every block.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import UserError
from ..models.attention import kernels_for
from ..models.precision import QUANT_PRECISIONS, Precision

# The quantizable linears of a main block, by their name inside the block (checkpoint-native names).
BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
# Never quantized (documented in the manifest so a reader sees the full picture, not only the configurable part).
ALWAYS_HIGH_PRECISION = ("video_patch_proj", "audio_patch_proj", "condition_proj", "time_embedder", "token_refiner",
                         "final_layer", "adaln_proj (baked tables)", "norms")
# What each calibration algorithm a precision takes (its spec's calib_algos, by ModelOpt's names) does to the model;
# h3trt/calibration/calibrate.py runs them through ModelOpt.
CALIB_ALGO_NOTES = {
    "max": "scale = max |x| / format max over the calibration data (ModelOpt's max calibrator); weights per tensor",
    "percentile": "activation scale from the 99.99th percentile of |x| (ModelOpt's histogram calibrator), clipping "
                  "outliers; weights as max",
    "smoothquant": "per-input-channel scales s = 1 / max |x_c| (alpha 1) moved from the activations into the weights "
                   "(W * 1/s folded in, x * s before quantization: the pre_quant_scale buffer), then max",
    "awq_lite": "per-input-channel scales searched (alpha in 0..1) to minimise the quantized layer's output error, "
                "folded into the weights (W * s) with x * 1/s before the GEMM (pre_quant_scale); weights then max",
}
# How FP8 GEMMs accumulate (torch._scaled_mm's use_fast_accum; the first is the default): "fast" keeps the Hopper
# tensor cores' FP8 accumulator over the whole reduction, "exact" promotes partial sums to fp32 every few k-blocks
# (cuBLAS's default). Measured on the H200 by scripts/bench_fp8.py (bench/README.md: speed and the block's error).
FP8_ACCUMS = ("fast", "exact")
# cudnn | fa3 | emulated: h3trt/calibration/fp8_attention.py says what each runs
ATTENTION_KERNELS = kernels_for(Precision.FP8)
# The ModelOpt release the calibration is written against: its algorithms' defaults, its SmoothQuant's int8 gate and
# its NVFP4 tensor export (h3trt/calibration/calibrate.py says where each is used). Another release is refused,
# not guessed at.
MODELOPT_VERSION = "0.47.0"
MODELOPT_FIX = (f"pip install 'h3trt[calibration]' (nvidia-modelopt=={MODELOPT_VERSION}, pure Python on the CPU; "
                "h3trt calibrates every FP8/NVFP4 bundle through it)")

MAX_CALIB_PROMPTS = 64  # a calibration file is a handful of prompts; more is a wrong file, not more accuracy


def read_prompts(path: Path) -> list[str]:
    """One prompt per line; blank lines and lines starting with '#' are skipped."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--calib-prompts {path} does not exist; give a text file with one prompt per line.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--calib-prompts {path} cannot be read as UTF-8 text ({e}); pass a readable UTF-8 file with "
                        "one prompt per line.") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if not prompts:
        raise UserError(f"--calib-prompts {path} has no prompts (one per line; '#' starts a comment).")
    if len(prompts) > MAX_CALIB_PROMPTS:
        raise UserError(f"--calib-prompts {path} has {len(prompts)} prompts; at most {MAX_CALIB_PROMPTS} are used "
                        "for calibration. Trim the file.")
    return prompts


def check_modelopt() -> str:
    """ModelOpt's version, or the error that names the fix; reads package metadata only (importing ModelOpt takes
    seconds), so a build refuses before it loads anything."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("nvidia-modelopt")
    except PackageNotFoundError:
        raise UserError(f"FP8/NVFP4 calibration runs through NVIDIA ModelOpt, which is not installed: "
                           f"{MODELOPT_FIX}.") from None
    if found != MODELOPT_VERSION:
        raise UserError(f"h3trt's calibration is written against nvidia-modelopt {MODELOPT_VERSION}; found {found}. "
                           f"{MODELOPT_FIX}.")
    return found


@dataclass(frozen=True)
class QuantRecipe:
    precision: Precision  # one of QUANT_PRECISIONS (a string is parsed)
    calib_algo: str = "max"  # ModelOpt calibration algorithm (one of the precision's calib_algos)
    exclude_blocks: tuple[int, ...] = ()  # main blocks kept in the block dtype (a second compiled block serves them)
    exclude_linears: tuple[str, ...] = ()  # block linears (BLOCK_LINEARS names) kept in the block dtype everywhere
    fp8_attention: bool = False  # q/k/v quantized to e4m3 with calibrated static scales before attention
    # The FP8 attention kernel baked into the block (h3trt/calibration/fp8_attention.py): "cudnn" (cuDNN's FP8 flash
    # attention) or "fa3" (FlashAttention-3's), chosen on the build GPU by --attention, or "emulated" (the reference
    # numerics, built on a CPU); "" without --fp8-attention.
    attention_kernel: str = ""
    # NVFP4 activations too, dynamically per 16 values with a calibrated global range (the TensorRT backend's FP4
    # GEMMs); False: NVFP4 weights only (the Inductor block dequantizes them to bf16).
    fp4_activations: bool = False
    calib_steps: int = 0  # sigma grid points of each calibration trajectory (0: not calibrated)
    calib_prompts: int = 0  # how many prompts the calibration ran
    fp8_accum: str = FP8_ACCUMS[0]  # fp8: how the GEMMs accumulate (FP8_ACCUMS); unused by nvfp4

    def __post_init__(self):
        object.__setattr__(self, "precision", Precision.parse(self.precision, QUANT_PRECISIONS,
                                                              "quantized precision"))
        algos = self.precision.spec.calib_algos
        if self.calib_algo not in algos:
            known = {a for p in QUANT_PRECISIONS for a in p.spec.calib_algos}
            why = (self.precision.spec.calib_algos_why if self.calib_algo in known
                   else f"h3trt drives ModelOpt's {', '.join(sorted(known))}")
            raise UserError(f"--calib-algo {self.calib_algo} does not apply to --precision {self.precision}: it takes "
                            f"{', '.join(algos)} (default {algos[0]}); {why}.")
        unknown = sorted(set(self.exclude_linears) - set(BLOCK_LINEARS))
        if unknown:
            raise UserError(f"--quant-exclude names {unknown}; block linears are {list(BLOCK_LINEARS)}, whole blocks "
                            "are blocks.N.")
        if set(self.exclude_linears) == set(BLOCK_LINEARS):
            raise UserError("--quant-exclude lists every block linear: nothing would be quantized; build bf16.")
        if any(i < 0 for i in self.exclude_blocks) or tuple(sorted(set(self.exclude_blocks))) != self.exclude_blocks:
            raise ValueError(f"exclude_blocks must be distinct non-negative indices in order, got {self.exclude_blocks}.")
        if self.fp8_accum not in FP8_ACCUMS:
            raise UserError(f"--fp8-accum must be one of {FP8_ACCUMS}, got {self.fp8_accum!r}.")
        if self.fp4_activations and self.precision is not Precision.NVFP4:
            raise ValueError("fp4_activations applies to --precision nvfp4.")
        if self.fp8_attention and self.precision is not Precision.FP8:
            raise UserError("--fp8-attention needs --precision fp8 (its q/k/v scales come from the FP8 calibration).")
        kernels = ATTENTION_KERNELS if self.fp8_attention else ("",)
        if self.attention_kernel not in kernels:
            raise ValueError(f"attention_kernel must be one of {kernels} with fp8_attention={self.fp8_attention}, "
                             f"got {self.attention_kernel!r}.")
        if self.needs_calibration_data and self.calib_steps < 2:
            raise UserError(f"--precision {self.precision} --calib-algo {self.calib_algo} calibrates on trajectories: "
                            f"--calib-steps must be at least 2, got {self.calib_steps}.")

    @property
    def needs_calibration_data(self) -> bool:
        """FP8 activation scales are static, so they come from calibration runs, FP4 activations need their global
        range, and AWQ searches its scales on them; weight-only NVFP4 with max needs only the weights."""
        return self.quantizes_activations or self.calib_algo == "awq_lite"

    @property
    def quantizes_activations(self) -> bool:
        """The block linears' inputs are quantized too: FP8's static scales, or NVFP4's FP4 activations."""
        return self.precision.spec.calibrated_activations or self.fp4_activations

    @property
    def smooths_inputs(self) -> bool:
        """SmoothQuant and AWQ leave a per-input-channel scale that multiplies each linear's input (pre_quant_scale)."""
        return self.calib_algo in ("smoothquant", "awq_lite")

    def quantized_linears(self) -> tuple[str, ...]:
        return tuple(n for n in BLOCK_LINEARS if n not in self.exclude_linears)

    def check_layers(self, num_layers: int) -> None:
        bad = [i for i in self.exclude_blocks if i >= num_layers]
        if bad:
            raise UserError(f"--quant-exclude blocks {bad} do not exist: the model has blocks 0..{num_layers - 1}.")
        if len(self.exclude_blocks) == num_layers:
            raise UserError(f"--quant-exclude lists all {num_layers} blocks: nothing would be quantized; build bf16.")

    def to_dict(self) -> dict:
        return {**asdict(self), "exclude_blocks": list(self.exclude_blocks),
                "exclude_linears": list(self.exclude_linears), "execution": self.precision.spec.execution,
                "always_high_precision": list(ALWAYS_HIGH_PRECISION)}

    @classmethod
    def from_dict(cls, data: dict) -> "QuantRecipe":
        keep = {"precision", "calib_algo", "fp4_activations", "fp8_attention", "attention_kernel", "calib_steps",
                "calib_prompts"}
        # Bundles recorded before fp8_accum existed ran cuBLAS's default, exact accumulation.
        return cls(**{k: data[k] for k in keep}, exclude_blocks=tuple(data["exclude_blocks"]),
                   exclude_linears=tuple(data["exclude_linears"]), fp8_accum=data.get("fp8_accum", "exact"))


def parse_exclusions(items) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """`--quant-exclude blocks.0 blocks.49 mlp.fc2` -> ((0, 49), ("mlp.fc2",))."""
    blocks, linears = set(), set()
    for item in items or ():
        if item.startswith("blocks.") and item.removeprefix("blocks.").isdigit():
            blocks.add(int(item.removeprefix("blocks.")))
        elif item in BLOCK_LINEARS:
            linears.add(item)
        else:
            raise UserError(f"--quant-exclude {item!r}: name a whole block (blocks.N) or a block linear "
                            f"({', '.join(BLOCK_LINEARS)}).")
    return tuple(sorted(blocks)), tuple(n for n in BLOCK_LINEARS if n in linears)


def layer_segments(recipe: "QuantRecipe | None", num_layers: int) -> list[str]:
    """Which compiled block serves each layer: "block" (the recipe's), or "block_hp" (block dtype) for excluded ones."""
    excluded = set(recipe.exclude_blocks) if recipe else set()
    return ["block_hp" if i in excluded else "block" for i in range(num_layers)]
