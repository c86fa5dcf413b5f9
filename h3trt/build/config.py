"""What `h3trt build` is asked for: the build's one frozen configuration (every flag of the command, validated once,
before anything loads) and the request profiles a bundle serves."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..adapters.memory import check_slots_fit
from ..adapters.merge import LoraSpec
from ..adapters.slots import BLOCK_TARGETS
from ..calibration.recipe import FP8_ACCUMS, QuantRecipe, check_modelopt, parse_exclusions
from ..engines.manifest import AdapterSlotsRecord
from ..errors import UserError
from ..models.attention import ATTENTION_REQUESTS
from ..models.checkpoint.reader import TASK_PARTITIONS, CheckpointError, locate_transformer
from ..models.config import H3Config
from ..models.distilled.families import DistilledServing, DistilledSpec, plan_distilled
from ..models.distilled.contract import checkpoint_contract, refuse_export_base
from ..models.distilled.schedule import uniform_rungs
from ..models.packing import Geometry, frames_for_duration, validate_canvas
from ..models.precision import Precision
from ..models.sampler import DEFAULT_STEPS, Schedule, check_steps, shifted_sigmas
from ..models.sparse.fp8 import FP8_SPARSE_KERNELS
from ..models.sparse.plan import SparseSettings, sparse_settings
from ..models.vae_precision import VAEPrecision
from ..models.vsa.plan import VsaSettings, served_vsa_settings, vsa_settings
from ..parallel.mesh import MeshConfig
from .backends import BACKENDS
from .segments import check_sharded_recipe
from .sparse_choice import SPARSE_KERNEL_REQUESTS
from .tensorrt import check_build_config

DEFAULT_CALIB_STEPS = 8  # fp8: the longest calibration trajectory taken by default (grid points)


@dataclass(frozen=True)
class Profile:
    width: int
    height: int
    seconds: float

    @classmethod
    def parse(cls, text: str) -> "Profile":
        try:
            w, h, s = text.lower().split("x")
            profile = cls(int(w), int(h), float(s))
        except ValueError:
            raise UserError(f"--canvas must be WIDTHxHEIGHTxSECONDS (e.g. 1344x768x5), got {text!r}.") from None
        validate_canvas(profile.height, profile.width)
        frames_for_duration(profile.seconds)
        return profile

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.height, self.width, frames_for_duration(self.seconds))


@dataclass(frozen=True)
class BuildConfig:
    model_root: Path
    output: Path
    task: str = "t2va"
    precision: Precision = Precision.BF16  # --precision (a string is parsed)
    profiles: tuple[Profile, ...] = (Profile(1344, 768, 5.0),)
    # The schedules the AdaLN tables are baked for (--steps 50,8): each one's sigma grid points, and its shifts, one
    # per schedule or one for all (None: the checkpoint's sigma_shift_scales). An int or a single shift is taken as
    # such a tuple; the first schedule is a request's default (`schedules`).
    steps: tuple[int, ...] | None = None  # None: not given (the default, or a --distilled family's)
    video_shift: tuple[float | None, ...] = (None,)
    audio_shift: tuple[float | None, ...] = (None,)
    device: str = "cuda"
    backend: str = "inductor"
    keep_adaln: bool = False
    sp: int = 1  # Ulysses degree the bundle serves: baked into the block segments' head grouping
    overwrite: bool = False
    tiny: bool = False
    cfg: int = 1  # guidance-branch parallel degree the bundle is launched with (1: H3 is guidance-distilled)
    calib_prompts: Path | None = None  # fp8 / awq_lite: text file, one calibration prompt per line
    calib_steps: int | None = None  # fp8 / awq_lite: sigma points of each calibration trajectory (None: see recipe)
    calib_algo: str | None = None  # fp8/nvfp4: ModelOpt calibration algorithm (None: the precision's calib_algos[0])
    quant_exclude: tuple[str, ...] = ()  # fp8/nvfp4: blocks.N and/or block linear names kept in bf16
    fp8_attention: bool = False  # fp8: q/k/v in e4m3 with calibrated scales
    fp8_accum: str | None = None  # fp8: GEMM accumulation, FP8_ACCUMS (None: the first, fast)
    trt_targets: str | None = None  # tensorrt: compute capabilities of the plans, e.g. "sm89,sm120" (None: default)
    # Attention kernel (h3trt/build/attention_choice.py): auto (the fastest measured on the build GPU; a CPU build's
    # one kernel), or cudnn / fa3 for every attention of the bundle, FP8 attention included.
    attention: str = "auto"
    vae_precision: str | None = None  # video decoder: fp32 | bf16 | fp8 (None: bf16 on CUDA, fp32 on the CPU)
    loras: tuple[LoraSpec, ...] = ()  # merged into the DiT before calibration, baking and compiling, in order
    # Block-sparse attention (models/sparse/plan.py): with --sparse-attention (0 included) the bundle serves it, its
    # sparsity and the two knobs below being its requests' defaults; None: it serves none at sp=1 (build/segments.py).
    sparse_attention: float | None = None
    sparse_dense_steps: int | None = None  # None: SubBlock's default (10)
    sparse_min_seq: int | None = None  # None: SubBlock's default (4096 rows)
    # The block-sparse kernel (build/sparse_choice.py): auto (the fastest measured at the bundle's shape on a GPU), or
    # one named (fa4, fp8 with --fp8-attention, reference, fp8_emulated).
    sparse_kernel: str = "auto"
    # Per-request LoRA adapters (adapters/slots.py): N slots of max rank R on every main block's linears; the
    # bundle compiles block_lora beside block, and with --sparse-attention the halves' twins beside the halves
    # (build/segments.py). None and None: no slots.
    lora_slots: int | None = None
    lora_max_rank: int | None = None
    # --memory-budget: the device memory (GiB) the build may hold at once, at most what the device has free (None:
    # what it has free). A DiT that does not fit whole in it is built a block at a time (build/memory.py decides).
    memory_budget: float | None = None
    # FastH3-VSA (a checkpoint whose blocks carry attn.to_gate_compress; models/vsa/plan.py): the VSA settings the
    # bundle serves, recorded in its manifest (None: FastH3 v1's, sparsity 0.9, no step or block dense). Refused for a
    # checkpoint without the gate (build/plan.py, once the checkpoint is located).
    vsa_sparsity: float | None = None
    vsa_dense_first_steps: int | None = None
    vsa_dense_layers: tuple[int, ...] | None = None
    # A distilled checkpoint (models/distilled/families.py) fused in fp32 after the LoRAs, before calibration; the bundle bakes
    # its family's schedule, and only that one
    distilled: DistilledSpec | None = None

    def __post_init__(self):
        # the flags' own values first: the schedules may read a FastH3 export's sidecar from the checkpoint
        if self.backend not in BACKENDS:
            raise UserError(f"--backend must be one of {BACKENDS}, got {self.backend!r}.")
        object.__setattr__(self, "precision", Precision.parse(self.precision))  # one of DIT_PRECISIONS
        if self.attention not in ATTENTION_REQUESTS:
            raise UserError(f"--attention must be one of {ATTENTION_REQUESTS}, got {self.attention!r}.")
        if self.backend == "tensorrt" and self.attention != "auto":
            raise UserError("--attention picks the kernel of the inductor and aoti backends; TensorRT fuses attention "
                            "in its own plans. Drop --attention with --backend tensorrt.")
        if self.task not in TASK_PARTITIONS:
            raise UserError(f"--task must be one of {sorted(TASK_PARTITIONS)}, got {self.task!r}.")
        self.vae  # validates --vae-precision
        self._check_schedules()
        if self.precision.spec.quantized:
            # validates --calib-algo against the precision, exclusions, --fp8-attention and --calib-steps
            recipe = self.recipe_for("emulated")
            if self.sp > 1:
                check_sharded_recipe(recipe, self.sp)
            if recipe.needs_calibration_data and self.calib_prompts is None:
                what = ("AWQ's scales are" if recipe.calib_algo == "awq_lite" else "its activation ranges are")
                raise UserError(f"--precision {self.precision} needs --calib-prompts FILE (one prompt per line) for "
                                f"--calib-algo {recipe.calib_algo}: {what} calibrated on real denoising trajectories.")
            check_modelopt()  # calibration runs through ModelOpt: missing or another version is refused here
        elif (self.quant_exclude or self.fp8_attention or self.calib_prompts is not None
              or self.calib_algo is not None):
            raise UserError(f"--quant-exclude, --fp8-attention, --calib-prompts and --calib-algo apply to --precision "
                            f"fp8/nvfp4, not {self.precision}.")
        if self.fp8_accum is not None and (self.precision is not Precision.FP8 or self.backend == "tensorrt"):
            raise UserError("--fp8-accum sets how the inductor and aoti backends' FP8 GEMMs accumulate: it applies to "
                            f"--precision fp8 (got {self.precision}) and not to --backend tensorrt, whose plans "
                            "choose their own kernels.")
        MeshConfig(cfg=self.cfg, sp=self.sp)  # degrees >= 1, cfg 1 or 2; sp against the heads once they are known
        if not self.profiles:
            raise UserError("At least one --canvas is needed.")
        for spec in self.loras:  # before the (slow) checkpoint load
            if not Path(spec.path).is_file():
                raise UserError(f"--lora {spec.path} does not exist; pass a LoRA .safetensors file.")
        if self.backend == "tensorrt":
            check_build_config(self)
        elif self.trt_targets is not None:
            raise UserError("--trt-targets applies to --backend tensorrt.")
        self._check_sparse()
        self._check_lora_slots()
        if self.memory_budget is not None and not (isinstance(self.memory_budget, (int, float))
                                                   and 0 < self.memory_budget < float("inf")):
            raise UserError(f"--memory-budget must be a positive number of GiB, got {self.memory_budget!r}.")
        vsa_settings(self.vsa_sparsity, self.vsa_dense_first_steps, self.vsa_dense_layers)  # values, by flag

    def _check_schedules(self) -> None:
        """--steps, --video-shift and --audio-shift as tuples of one entry per schedule (a single shift: every
        schedule's), each schedule valid; a --distilled bundle's are its family's."""
        if self.distilled_serving is not None:
            self._check_distilled()
        steps = (DEFAULT_STEPS,) if self.steps is None else self.steps
        steps = steps if isinstance(steps, tuple) else (steps,)
        if not steps:
            raise UserError(f"--steps needs at least one schedule's grid points (default {DEFAULT_STEPS}).")
        object.__setattr__(self, "steps", steps)
        for flag, key in (("--video-shift", "video_shift"), ("--audio-shift", "audio_shift")):
            shifts = getattr(self, key) if isinstance(getattr(self, key), tuple) else (getattr(self, key),)
            if len(shifts) not in (1, len(steps)):
                raise UserError(f"{flag} takes one shift for every schedule or one per --steps value ({len(steps)}: "
                                f"{','.join(map(str, steps))}), got {len(shifts)}.")
            object.__setattr__(self, key, shifts * len(steps) if len(shifts) == 1 else shifts)
        for n, video, audio in zip(self.steps, self.video_shift, self.audio_shift):
            check_steps(n, "--steps", field=None)
            for shift in (video, audio):
                if shift is not None:
                    shifted_sigmas(2, shift)  # UserError: a positive finite shift

    @cached_property
    def distilled_serving(self) -> DistilledServing | None:
        """What the --distilled file serves (its header read: family, schedule, tasks), or a full FastH3 export's
        sidecar (models/distilled/contract.py); None for a base checkpoint."""
        if self.distilled is not None:
            return plan_distilled(self.distilled, self.task)
        contract = self.contract
        return contract[0] if contract is not None else None

    def model_config(self, checkpoint: H3Config) -> H3Config:
        """The model this build makes of the checkpoint's config: a FastH3-VSA file's gates (`.set_weight`) make it a
        FastH3-VSA one (vsa_gate), which the plan, the fit check and the load (whole or streamed) all build."""
        serving = self.distilled_serving
        return serving.with_gates(checkpoint) if serving is not None else checkpoint

    @cached_property
    def contract(self) -> tuple[DistilledServing, dict] | None:
        """A full FastH3 export's sidecar (its ladder and record); None: a base checkpoint, or a --distilled file."""
        if self.distilled is not None:
            return None
        try:
            source = locate_transformer(self.model_root, self.task)
        except CheckpointError:  # a missing or unreadable checkpoint fails at the load, with the same message
            return None
        return checkpoint_contract(source.component_root, source.shifts, source.config.vsa_gate, self.task)

    def _check_distilled(self) -> None:
        """--distilled: its family's schedule is the bundle's (the schedule flags are refused), and what it cannot go
        with: other LoRAs and LoRA slots beside a FastH3 or PDD file, a task it does not serve."""
        if self.distilled is not None:
            try:
                root = locate_transformer(self.model_root, self.task).component_root
            except CheckpointError:  # a missing or unreadable checkpoint fails at the load, after the flags' checks
                root = None
            if root is not None:
                refuse_export_base(root, self.distilled.path)
        given = [flag for flag, value in (("--steps", self.steps), ("--video-shift", self.video_shift),
                                          ("--audio-shift", self.audio_shift)) if value not in (None, (None,))]
        if given:
            raise UserError(f"{' '.join(given)}: a distilled bundle bakes the schedule its file was distilled for; "
                            "state a Turbo file's as --distilled FILE@steps=N,video_shift=S, PDD's forwards as "
                            "@steps=5|7|9, and drop the flags.")
        serving = self.distilled_serving
        if self.loras and serving.merged_lora_refusal is not None:
            raise UserError(serving.merged_lora_refusal)
        if self.lora_slots is not None and serving.adapters_refusal is not None:
            raise UserError(f"--lora-slots: {serving.adapters_refusal}")
        if serving.family == "pdd" and self.backend == "tensorrt":
            raise UserError("--backend tensorrt bakes the final heads into its plans; a PDD bundle picks one head per "
                            "forward at run time: build it with --backend inductor.")
        s = serving.plan.schedule
        if self.calib_steps is not None and self.calib_steps > s.steps:
            raise UserError(f"--calib-steps {self.calib_steps}: a distilled bundle calibrates on its family's schedule "
                            f"of {s.steps} grid points ({s.steps - 1} forwards); give at most {s.steps} (N: its first "
                            "N - 1 forwards), or leave it out.")
        for key, value in (("steps", s.steps), ("video_shift", s.video_shift), ("audio_shift", s.audio_shift)):
            object.__setattr__(self, key, (value,))

    def schedules(self, shifts: tuple[float, float]) -> tuple[Schedule, ...]:
        """The schedules the bundle bakes, in order (the first: the default), the checkpoint's `shifts` (video,
        audio) where the flags give none; refused when two are one schedule. A --distilled bundle's: its family's."""
        if self.distilled_serving is not None:
            return (self.distilled_serving.plan.schedule,)
        schedules = tuple(Schedule.resolve(n, v, a, shifts)
                          for n, v, a in zip(self.steps, self.video_shift, self.audio_shift))
        twice = [s for i, s in enumerate(schedules) if s in schedules[:i]]
        if twice:
            raise UserError(f"--steps/--video-shift/--audio-shift name the schedule steps={twice[0].steps}, shifts "
                            f"{twice[0].video_shift:g}/{twice[0].audio_shift:g} twice (the checkpoint's shifts are "
                            f"{shifts[0]:g}/{shifts[1]:g}); name each schedule once.")
        return schedules

    def _check_lora_slots(self) -> None:
        """--lora-slots and --lora-max-rank: both or neither, positive, and what a bundle with slots cannot be."""
        n, r = self.lora_slots, self.lora_max_rank
        if n is None and r is None:
            return
        if n is None or r is None:
            raise UserError("--lora-slots N and --lora-max-rank R go together (N adapters resident, each of rank "
                            f"<= R); got --lora-slots {n} and --lora-max-rank {r}. Pass both, or neither.")
        for flag, value in (("--lora-slots", n), ("--lora-max-rank", r)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{flag} must be a whole number >= 1, got {value!r}.")
        if self.backend == "tensorrt":
            raise UserError("--lora-slots applies to the inductor and aoti backends: a TensorRT plan takes no slot "
                            "banks. Build with --backend inductor, or merge the LoRA with --lora FILE[:SCALE].")
        if self.sp != 1:
            raise UserError(f"--lora-slots is built for --sp 1 only (got --sp {self.sp}): the sharded halves have no "
                            "twin with adapters. Build --sp 1, or drop --lora-slots/--lora-max-rank.")
        # The banks are allocated to compile the block's twin and by every load of the bundle: they must fit.
        cfg = H3Config.tiny() if self.tiny else locate_transformer(self.model_root, self.task).config
        check_slots_fit(cfg, n, r, self.device, self.precision.spec.dtype)

    @property
    def slots(self) -> AdapterSlotsRecord | None:
        """The manifest's record of the LoRA slots (engines/manifest.py), None without any."""
        if self.lora_slots is None:
            return None
        return AdapterSlotsRecord(self.lora_slots, self.lora_max_rank, BLOCK_TARGETS)

    def _check_sparse(self) -> None:
        """--sparse-attention and its knobs: their values (one line, the flags named), and what a bundle that serves
        sparse attention cannot be."""
        if self.sparse_kernel not in SPARSE_KERNEL_REQUESTS:
            raise UserError(f"--sparse-kernel must be one of {SPARSE_KERNEL_REQUESTS}, got {self.sparse_kernel!r}.")
        if self.sparse_attention is None:
            if self.sparse_dense_steps is not None or self.sparse_min_seq is not None or self.sparse_kernel != "auto":
                raise UserError("--sparse-dense-steps, --sparse-min-seq and --sparse-kernel set up a bundle that "
                                "serves block-sparse attention; add --sparse-attention SPARSITY (0: dense unless a "
                                "request asks).")
            return
        if self.sparse_kernel in FP8_SPARSE_KERNELS and not self.fp8_attention:
            raise UserError(f"--sparse-kernel {self.sparse_kernel} runs FP8 attention with each layer's calibrated "
                            "q/k/v scales: add --precision fp8 --fp8-attention, or pick fa4 or reference.")
        sparse_settings(self.sparse_attention, self.sparse_dense_steps, self.sparse_min_seq)  # UserError, by flag
        if self.backend == "tensorrt":
            raise UserError("--sparse-attention applies to the inductor and aoti backends: TensorRT fuses attention "
                            "inside its plans, so no sparse kernel can run between their halves. Drop "
                            "--sparse-attention, or build with --backend inductor.")
        recipe = self.recipe_for("emulated")
        if recipe is not None and recipe.exclude_blocks:
            raise UserError(f"--sparse-attention with --quant-exclude blocks.N (blocks {list(recipe.exclude_blocks)}) "
                            "is not built: a bf16 block would need its own pair of halves around the sparse "
                            "attention. Exclude block linears instead (attn.qkv_proj, mlp.fc1, ...), or drop "
                            "--sparse-attention.")

    @property
    def vsa_flags(self) -> bool:
        """Whether any --vsa-* flag was given."""
        return (self.vsa_sparsity, self.vsa_dense_first_steps, self.vsa_dense_layers) != (None, None, None)

    def vsa(self, num_layers: int) -> VsaSettings:
        """The VSA settings a FastH3-VSA bundle serves (the --vsa-* flags over the sparsity its distilled file or
        export was distilled at, else FastH3 v1's defaults; models/vsa/plan.py served_vsa_settings), its dense layers
        checked against the model's `num_layers`."""
        serving = self.distilled_serving
        return served_vsa_settings(serving.vsa if serving is not None else None, self.vsa_sparsity,
                                   self.vsa_dense_first_steps, self.vsa_dense_layers, num_layers)

    def check_vsa(self, vsa_model: bool) -> None:
        """What a FastH3-VSA bundle cannot be, and --vsa-* flags on a model without the gate (build/plan.py calls it
        once the checkpoint is located)."""
        if not vsa_model:
            if self.vsa_flags:
                raise UserError("--vsa-sparsity, --vsa-dense-first-steps and --vsa-dense-layers set a FastH3-VSA "
                                "model's sparse attention; this checkpoint's blocks carry no attn.to_gate_compress "
                                "(not a VSA model). Drop them (block-sparse attention for any model: "
                                "--sparse-attention).")
            return
        recipe = self.recipe_for("emulated")
        conflicts = [flag for flag, on in (
            ("--backend tensorrt", self.backend == "tensorrt"), ("--sparse-attention", self.sparse is not None),
            ("--lora-slots", self.slots is not None),
            ("--quant-exclude blocks.N", recipe is not None and bool(recipe.exclude_blocks))) if on]
        if conflicts:
            raise UserError(f"this checkpoint is a FastH3-VSA model: its attention is VSA in every block (the block "
                            f"halves around it), which {', '.join(conflicts)} cannot serve. Drop "
                            f"{'it' if len(conflicts) == 1 else 'them'}; set its sparsity with --vsa-sparsity.")
        # --fp8-attention on a VSA model is FP8 VSA (build/vsa_choice.py races the fp8 kernel): recipe_for and
        # attention_precisions leave the dense FP8 attention out of it (vsa_model)

    @property
    def sparse(self) -> SparseSettings | None:
        """The bundle's default sparse settings (None: built without --sparse-attention)."""
        if self.sparse_attention is None:
            return None
        return sparse_settings(self.sparse_attention, self.sparse_dense_steps, self.sparse_min_seq)

    @property
    def vae(self) -> VAEPrecision:
        """The video decoder's precision. TensorRT plans serve on CUDA wherever they were built, and so does their
        (eager) video decoder."""
        return VAEPrecision.resolve(self.vae_precision, "cuda" if self.backend == "tensorrt" else self.device)

    def recipe_for(self, fp8_kernel: str, vsa_model: bool = False) -> QuantRecipe | None:
        """The quantization recipe, its FP8 attention (with --fp8-attention) running `fp8_kernel`. On a FastH3-VSA
        model (`vsa_model`) the recipe has no FP8 attention: --fp8-attention is VSA's fp8 kernel there, with its own
        per-call scales (models/vsa/fp8.py), and no calibrated attention segment."""
        if not self.precision.spec.quantized:
            return None
        blocks, linears = parse_exclusions(self.quant_exclude)
        algo = self.calib_algo or self.precision.spec.calib_algos[0]
        recipe = QuantRecipe(self.precision, algo, exclude_blocks=blocks, exclude_linears=linears,
                             fp4_activations=self.precision is Precision.NVFP4 and self.backend == "tensorrt",
                             fp8_attention=self.fp8_attention and not vsa_model,
                             attention_kernel=fp8_kernel if self.fp8_attention and not vsa_model else "",
                             calib_steps=self.calibration_steps, fp8_accum=self.fp8_accum or FP8_ACCUMS[0])
        # A weight-only calibration runs no trajectories: its manifest says 0 steps.
        return recipe if recipe.needs_calibration_data else dataclasses.replace(recipe, calib_steps=0)

    @property
    def calibration_steps(self) -> int:
        """--calib-steps, else the bundle's default (first) schedule when it has at most DEFAULT_CALIB_STEPS points or
        is a distilled family's (a few-step bundle calibrates on exactly the timesteps it serves), else a
        DEFAULT_CALIB_STEPS-point grid with the default schedule's shifts (a cost cap: a 50-point trajectory costs 6x
        the calibration time for max scales)."""
        if self.calib_steps is not None:
            return self.calib_steps
        if self.steps[0] <= DEFAULT_CALIB_STEPS or self.distilled_serving is not None:
            return self.steps[0]
        return DEFAULT_CALIB_STEPS

    def calibration_schedule(self, served: Schedule) -> Schedule:
        """What each calibration trajectory runs (calibration_steps points), `served` the bundle's default schedule.
        A distilled bundle calibrates on its family's own schedule, rungs and all; with --calib-steps N below its
        grid points, on its first N - 1 forwards exactly (each evaluation sees the timestep and latents it serves;
        the trajectory stops there). Any other bundle: an N-point uniform grid at the served shifts."""
        n = self.calibration_steps
        if self.distilled_serving is None:
            return Schedule(n, served.video_shift, served.audio_shift)
        if n == served.steps:
            return served
        positions = served.rungs if served.rungs is not None else uniform_rungs(served.steps - 1)
        return Schedule(n, served.video_shift, served.audio_shift, positions[: n - 1])

    def attention_precisions(self, vsa_model: bool = False) -> tuple[Precision, ...]:
        """Every precision the bundle's dense attention runs in: the block dtype's (always: the block_hp layers, or
        every layer), and fp8 with --fp8-attention but on a FastH3-VSA model (`vsa_model`), whose FP8 is VSA's."""
        fp8 = self.fp8_attention and not vsa_model
        return (self.precision.spec.attention,) + ((Precision.FP8,) if fp8 else ())
