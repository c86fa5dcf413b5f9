"""What a low-precision bundle quantizes, and what it keeps in the block dtype.

Only the main blocks' four linears are ever quantized (they are 98% of the DiT's GEMM work). Everything outside the
block stays at the checkpoint's precision by construction: patch projections, condition projection, time embedder,
token refiner and output heads live in the embed/final segments, and AdaLN is baked into bf16 tables. The recipe
can exclude more: whole blocks (served by a second, high-precision block segment) or one linear in every block.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..models.attention import kernels_for

QUANT_PRECISIONS = ("fp8", "nvfp4")
# The quantizable linears of a main block, by their name inside the block (checkpoint-native names).
BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
# Never quantized (documented in the manifest so a reader sees the full picture, not only the configurable part).
ALWAYS_HIGH_PRECISION = ("video_patch_proj", "audio_patch_proj", "condition_proj", "time_embedder", "token_refiner",
                         "final_layer", "adaln_proj (baked tables)", "norms")
CALIBRATIONS = ("max",)
ATTENTION_KERNELS = kernels_for("fp8")  # cudnn | fa3 | emulated: h3trt/calibration/fp8_attention.py says what each runs
# How each precision executes: recorded in the manifest, so a reader knows what the bundle actually does.
EXECUTION = {
    "fp8": "W8A8: e4m3 weights and activations, per-tensor static scales, torch._scaled_mm (cuBLAS on CUDA); the "
           "activation quantization is a pointwise op Inductor fuses into the kernel that produces the activation",
    "nvfp4": "weight-only: packed E2M1 weights with E4M3 scales per 16 values and an fp32 global scale, dequantized "
             "to bf16 inside the compiled block before a bf16 GEMM (saves memory, not time; native FP4 GEMMs need "
             "sm_100+ and are not implemented in this build)",
}


@dataclass(frozen=True)
class QuantRecipe:
    precision: str  # fp8 | nvfp4
    calibration: str = "max"  # activation scale = max |x| over the calibration trajectories / e4m3 max
    exclude_blocks: tuple[int, ...] = ()  # main blocks kept in the block dtype (a second compiled block serves them)
    exclude_linears: tuple[str, ...] = ()  # block linears (BLOCK_LINEARS names) kept in the block dtype everywhere
    fp8_attention: bool = False  # q/k/v quantized to e4m3 with calibrated static scales before attention
    # The FP8 attention kernel baked into the block (h3trt/calibration/fp8_attention.py): "cudnn" (cuDNN's FP8 flash
    # attention) or "fa3" (FlashAttention-3's), chosen on the build GPU by --attention, or "emulated" (the reference
    # numerics, built on a CPU); "" without --fp8-attention.
    attention_kernel: str = ""
    calib_steps: int = 0  # sigma grid points of each calibration trajectory (0: not calibrated)
    calib_prompts: int = 0  # how many prompts the calibration ran

    def __post_init__(self):
        if self.precision not in QUANT_PRECISIONS:
            raise ValueError(f"quantized precision must be one of {QUANT_PRECISIONS}, got {self.precision!r}.")
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {self.calibration!r}.")
        unknown = sorted(set(self.exclude_linears) - set(BLOCK_LINEARS))
        if unknown:
            raise ValueError(f"--quant-exclude names {unknown}; block linears are {list(BLOCK_LINEARS)}, whole blocks "
                             "are blocks.N.")
        if set(self.exclude_linears) == set(BLOCK_LINEARS):
            raise ValueError("--quant-exclude lists every block linear: nothing would be quantized; build bf16.")
        if any(i < 0 for i in self.exclude_blocks) or tuple(sorted(set(self.exclude_blocks))) != self.exclude_blocks:
            raise ValueError(f"exclude_blocks must be distinct non-negative indices in order, got {self.exclude_blocks}.")
        if self.fp8_attention and self.precision != "fp8":
            raise ValueError("--fp8-attention needs --precision fp8 (its q/k/v scales come from the FP8 calibration).")
        kernels = ATTENTION_KERNELS if self.fp8_attention else ("",)
        if self.attention_kernel not in kernels:
            raise ValueError(f"attention_kernel must be one of {kernels} with fp8_attention={self.fp8_attention}, "
                             f"got {self.attention_kernel!r}.")
        if self.needs_calibration and self.calib_steps < 2:
            raise ValueError(f"FP8 needs calibration: --calib-steps must be at least 2, got {self.calib_steps}.")

    @property
    def needs_calibration(self) -> bool:
        """FP8 activation scales are static, so they come from calibration; NVFP4 here is weight-only."""
        return self.precision == "fp8"

    def quantized_linears(self) -> tuple[str, ...]:
        return tuple(n for n in BLOCK_LINEARS if n not in self.exclude_linears)

    def check_layers(self, num_layers: int) -> None:
        bad = [i for i in self.exclude_blocks if i >= num_layers]
        if bad:
            raise ValueError(f"--quant-exclude blocks {bad} do not exist: the model has blocks 0..{num_layers - 1}.")
        if len(self.exclude_blocks) == num_layers:
            raise ValueError(f"--quant-exclude lists all {num_layers} blocks: nothing would be quantized; build bf16.")

    def to_dict(self) -> dict:
        return {**asdict(self), "exclude_blocks": list(self.exclude_blocks),
                "exclude_linears": list(self.exclude_linears), "execution": EXECUTION[self.precision],
                "always_high_precision": list(ALWAYS_HIGH_PRECISION)}

    @classmethod
    def from_dict(cls, data: dict) -> "QuantRecipe":
        keep = {"precision", "calibration", "fp8_attention", "attention_kernel", "calib_steps", "calib_prompts"}
        return cls(**{k: data[k] for k in keep}, exclude_blocks=tuple(data["exclude_blocks"]),
                   exclude_linears=tuple(data["exclude_linears"]))


def parse_exclusions(items) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """`--quant-exclude blocks.0 blocks.49 mlp.fc2` -> ((0, 49), ("mlp.fc2",))."""
    blocks, linears = set(), set()
    for item in items or ():
        if item.startswith("blocks.") and item.removeprefix("blocks.").isdigit():
            blocks.add(int(item.removeprefix("blocks.")))
        elif item in BLOCK_LINEARS:
            linears.add(item)
        else:
            raise ValueError(f"--quant-exclude {item!r}: name a whole block (blocks.N) or a block linear "
                             f"({', '.join(BLOCK_LINEARS)}).")
    return tuple(sorted(blocks)), tuple(n for n in BLOCK_LINEARS if n in linears)


def layer_segments(recipe: "QuantRecipe | None", num_layers: int) -> list[str]:
    """Which compiled block serves each layer: "block" (the recipe's), or "block_hp" (block dtype) for excluded ones."""
    excluded = set(recipe.exclude_blocks) if recipe else set()
    return ["block_hp" if i in excluded else "block" for i in range(num_layers)]
