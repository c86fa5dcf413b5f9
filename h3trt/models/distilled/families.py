"""Distilled MiniMax-H3 checkpoints: which family a file is, what it runs, and what it refuses (issue 47).

  `--distilled FILE[@key=value,...]` (DistilledSpec): keys `family` (fasth3 | turbo | pdd: else detected from the
  header), `steps` (Turbo: its grid points; PDD: 5, 7 or 9), `video_shift` / `audio_shift` (Turbo), `alpha` (Turbo,
  where its header has none), `grid` (FastH3 v1: rungs | uniform).

Families (distilled/schedule.py holds their schedules, distilled/files.py their formats, distilled/merge.py the
fusion):
  fasth3  header `format` fastvideo-lora-v2 and a `finetuned_model` in FastVideo's namespace naming fasth3 (vLLM-Omni's
          test of a FastH3 release); T2VA only; fused, so no LoRA per request.
  pdd     header `pdd_num_steps`; heads fused for one forward count; no LoRA per request, no step cache (alibaba-pai:
          "do not stack with other distillations or caches").
  turbo   PEFT keys (`.lora_A.default.weight`); alpha from the header, else LightX2V's reference script's 8; its schedule
          from FILE@steps=..,video_shift=.., else the file's h3trt.* metadata, else TURBO_RELEASES by sha256.
Every family runs CFG off (guidance 1): each is guidance-distilled and was trained and published without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ...errors import UserError
from ..config import H3Config
from ..lora_format import PEFT_DUMP_LAYOUT, REF2VA_COMPONENT, LoraFile, read_lora, sha256_of
from ..lora_targets import TASK_COMPONENTS, route
from ..sampler import Schedule, key_values, schedule_value
from ..vsa.plan import DEFAULT_VSA_SPARSITY, trained_vsa
from .files import (FASTH3_FORMAT, GATE_FILE_SUFFIX, DistilledError, Fusion, lora_fusion, read_fasth3,
                    read_header, read_pdd)
from .schedule import (FASTH3_V1_RUNGS, PDD_BLOCKS, PDD_INTERVALS, FamilySchedule, fasth3_schedule,
                       pdd_schedule, turbo_schedule)

FAMILIES = ("fasth3", "turbo", "pdd")
TURBO_DEFAULT_ALPHA = 8.0  # ModelTC/Minimax-H3-Turbo inference_minimax_h3.py's default (vllm-omni #7062 review)
TURBO_DEFAULT_AUDIO_SHIFT = 3.0  # every LightX2V Turbo file's audio shift
# LightX2V Turbo releases whose header carries no schedule, by sha256: (name, steps, (video, audio) shifts).
TURBO_RELEASES = {
    "5ff4a12c8b4599fec716e1b15a45e504e0d1129111896bdcde5ac4a15e395b29": (
        "lightx2v minimax_h3_fl2v_turbo_4step_v0.1", 5, (12.0, 3.0)),
}
TURBO_TABLE = ("LightX2V's table: the 4-step v0.1 and 544p files steps=5 or 9 at 12/3; the 768p files 6/3; the ref2v "
               "8-step 768p file is 6/3 per ModelTC #15 and 12/3 per diffusers-workflow #149 (the sources conflict)")
# Where a fastvideo-lora-v2 file's VSA sparsity comes from: its header states none, and the files are FastH3 4-step
# Preview v1's (the VSA-DataFree variant was distilled and is served at 0.9)
FASTH3_LORA_VSA = "FastH3 4-step Preview v1 (a fastvideo-lora-v2 file's VSA gates; its header states no sparsity)"
METADATA_KEYS = {"steps": "h3trt.steps", "video_shift": "h3trt.video_shift", "audio_shift": "h3trt.audio_shift"}


@dataclass(frozen=True)
class DistilledSpec:
    """One `--distilled FILE[@key=value,...]` (module doc)."""

    path: Path
    family: str | None = None
    steps: int | None = None
    video_shift: float | None = None
    audio_shift: float | None = None
    alpha: float | None = None
    grid: str | None = None

    @classmethod
    def parse(cls, text: str) -> "DistilledSpec":
        """FILE, or FILE@key=value,... (the part after the last '@' when it holds an '=')."""
        head, at, tail = str(text).rpartition("@")
        if not at or "=" not in tail:
            return cls(Path(text))
        keys = tuple(f.name for f in fields(cls) if f.name != "path")
        return cls(Path(head), **key_values(tail, keys, f"--distilled {text}", _value))

    def __post_init__(self):
        if self.family is not None and self.family not in FAMILIES:
            raise UserError(f"--distilled {self.path}: family must be one of {list(FAMILIES)}, got {self.family!r}.")

    def to_json(self) -> dict:
        return {k: (str(v) if k == "path" else v) for k, v in asdict(self).items() if v is not None}


def _value(key: str, text: str, where: str):
    return text if key in ("family", "grid") else schedule_value(key, text, where)


def detect_family(path: Path, header: dict[str, str], keys: list[str]) -> str:
    """The family a file's header and key names say (module doc); refused when they say none."""
    if header.get("format") == FASTH3_FORMAT:
        identity = header.get("finetuned_model", "").lower()
        if identity.startswith("fastvideo/") and "fasth3" in identity:
            return "fasth3"
        raise DistilledError(f"--distilled {path} is in FastVideo's {FASTH3_FORMAT} format, but its finetuned_model "
                             f"{header.get('finetuned_model')!r} is no FastH3 release; if it is a FastH3 student, say "
                             "so: --distilled FILE@family=fasth3.")
    if "pdd_num_steps" in header:
        return "pdd"
    if any(k.endswith((".lora_A.default.weight", ".lora_B.default.weight")) for k in keys):
        return "turbo"
    raise DistilledError(f"--distilled {path}: its header names no distilled family (no fastvideo-lora-v2 format, no "
                         "pdd_num_steps, no PEFT .default keys); name it: --distilled FILE@family=fasth3|turbo|pdd.")


@dataclass
class Distilled:
    """A distilled file read for one model and task: what it serves (`serving`: family, schedule, tasks), its fusion,
    and PDD's fused heads."""

    spec: DistilledSpec
    serving: "DistilledServing"
    fusion: Fusion
    heads: dict | None = None  # PDD: the fused heads per forward (pdd.fused_step_heads), for the served schedule

    @property
    def family(self) -> str:
        return self.serving.family

    @property
    def plan(self) -> FamilySchedule:
        return self.serving.plan

    def record(self) -> dict:
        """The manifest's and every clip record's `distilled` entry."""
        return {**self.serving.record(), **self.fusion.record(), "spec": self.spec.to_json()}


def schedule_json(schedule: Schedule) -> dict:
    return {"steps": schedule.steps, "video_shift": schedule.video_shift, "audio_shift": schedule.audio_shift,
            "rungs": list(schedule.rungs) if schedule.rungs is not None else None}


def plan_distilled(spec: DistilledSpec, task: str | None = None) -> "DistilledServing":
    """What `spec`'s file serves, from its header (a Turbo file with no schedule of its own: its sha256 too), no
    tensor read: the family detected (or named), its schedule, its tasks; `task` (None: not checked here) refused
    when the file does not serve it."""
    header, keys = read_header(spec.path)
    family = spec.family or detect_family(spec.path, header, keys)
    _refuse_keys(spec, family)
    if family == "fasth3":
        gates = any(k.endswith(GATE_FILE_SUFFIX) for k in keys)  # FastH3-VSA: the file sets every block's gate
        serving = DistilledServing("fasth3", fasth3_schedule(FASTH3_V1_RUNGS, grid=spec.grid or "rungs"), ("t2va",),
                                   trained_vsa(DEFAULT_VSA_SPARSITY, FASTH3_LORA_VSA) if gates else None)
    elif family == "pdd":
        forwards = (spec.steps or 9) - 1
        if forwards not in PDD_BLOCKS:
            raise DistilledError(f"--distilled {spec.path}@steps={forwards + 1}: PDD runs 4, 6 or 8 forwards (steps 5, "
                                 "7 or 9); other counts give noise.")
        serving = DistilledServing("pdd", pdd_schedule(forwards), ("t2va", "fl2va", "ref2va"))
    else:
        steps, shifts = _turbo_schedule(spec, header)
        ref = any(k.startswith(f"{REF2VA_COMPONENT}.") for k in keys)
        serving = DistilledServing("turbo", turbo_schedule(steps, shifts), ("ref2va",) if ref else tuple(TASK_COMPONENTS))
    if task is not None:
        check_task(serving.family, serving.tasks, task, spec.path)
    return serving


def load_distilled(spec: DistilledSpec, cfg: H3Config, task: str, serving: DistilledServing | None = None) -> Distilled:
    """Read `spec`'s file for a model of `cfg` serving `task`'s partition: its tensors, after plan_distilled unless
    the caller has its `serving` already (a build's BuildConfig.distilled_serving: a Turbo file without a schedule in
    its header is hashed to plan it, a whole pass over the file)."""
    serving = serving if serving is not None else plan_distilled(spec, task)
    header, _ = read_header(spec.path)
    if serving.family == "fasth3":
        return Distilled(spec, serving, read_fasth3(spec.path, cfg, header))
    if serving.family == "pdd":
        return _load_pdd(spec, serving, cfg, header)
    return Distilled(spec, serving, _turbo_fusion(spec, cfg, task))


_FAMILY_KEYS = {"fasth3": ("family", "grid"), "pdd": ("family", "steps"),
                "turbo": ("family", "steps", "video_shift", "audio_shift", "alpha")}


def _refuse_keys(spec: DistilledSpec, family: str) -> None:
    given = [k for k, v in asdict(spec).items() if v is not None and k != "path"]
    bad = [k for k in given if k not in _FAMILY_KEYS[family]]
    if bad:
        raise UserError(f"--distilled {spec.path} is a {family} file, which takes {list(_FAMILY_KEYS[family])} after "
                        f"'@', not {bad}: its schedule is the one it was distilled for.")


def check_task(family: str, tasks: tuple[str, ...], task: str, path: Path | str) -> None:
    if task not in tasks:
        partition = "Ref2VA" if TASK_COMPONENTS[task] == REF2VA_COMPONENT else "FL2VA"
        raise DistilledError(f"--distilled {path}: this {family} file serves {list(tasks)} only, not {task} "
                             f"({partition}); build or run it with --task {tasks[0]}.", field="task")


def _load_pdd(spec: DistilledSpec, serving: "DistilledServing", cfg: H3Config, header: dict[str, str]) -> Distilled:
    from .pdd import fused_step_heads

    fusion = read_pdd(spec.path, cfg, header)
    if (fusion.counts["intervals"], fusion.counts["block_size"]) != (PDD_INTERVALS, 4):
        raise DistilledError(f"--distilled {spec.path}: pdd_num_steps {fusion.counts['intervals']} and "
                             f"pdd_block_size {fusion.counts['block_size']}; h3trt runs the released "
                             f"{PDD_INTERVALS}-interval, block-4 heads.")
    for head, (weight, bias) in fusion.heads.items():
        if weight.shape[0] != PDD_INTERVALS or bias.shape[0] != PDD_INTERVALS:
            raise DistilledError(f"--distilled {spec.path}: the {head} bank holds {weight.shape[0]} heads, the header "
                                 f"{PDD_INTERVALS} intervals.")
    schedule = serving.plan.schedule
    heads = fused_step_heads(fusion.heads, (schedule.video_shift, schedule.audio_shift),
                             PDD_BLOCKS[schedule.steps - 1])
    return Distilled(spec, serving, fusion, heads)


def _turbo_fusion(spec: DistilledSpec, cfg: H3Config, task: str) -> Fusion:
    lora = read_lora(spec.path, cfg.head_dim)
    if lora.alpha_given and spec.alpha is not None:
        raise UserError(f"--distilled {spec.path}@alpha={spec.alpha:g}: the file states its own alpha "
                        f"({lora.alpha_rule}); drop alpha.")
    lora = turbo_alpha(lora, spec.alpha, "FILE@alpha" if spec.alpha else None, declared=True)
    _, modules = route(lora, task)
    return lora_fusion(lora, modules, cfg, lora.alpha_rule)


def turbo_alpha(lora: LoraFile, alpha: float | None = None, why: str | None = None,
                declared: bool = False) -> LoraFile:
    """A LightX2V Turbo file whose header states no alpha at its family's scale: `alpha` (else LightX2V's reference
    script's TURBO_DEFAULT_ALPHA) / rank per module, as every stack that runs Turbo applies it (SGLang, vLLM-Omni,
    LightX2V), where diffusers' alpha-less rule (alpha == rank) would merge it 16x too strong. `declared`: the caller
    knows it is Turbo (--distilled); else a Turbo file is a peft state-dict dump (`.default.` keys: LightX2V's layout).
    Any other file, or one that states its alpha, is returned as it is. `--adapter` and `--distilled` apply it;
    `--lora` merges as diffusers loads a file (the oracle)."""
    if lora.alpha_given or not (declared or lora.layout == PEFT_DUMP_LAYOUT):
        return lora
    alpha = alpha or TURBO_DEFAULT_ALPHA
    components = {prefix: {name: dataclasses.replace(m, scaling=alpha / m.up.shape[1]) for name, m in modules.items()}
                  for prefix, modules in lora.components.items()}
    why = why or "LightX2V's reference default: a Turbo file whose header has none"
    return dataclasses.replace(lora, components=components, alpha_rule=f"alpha {alpha:g} ({why}) / rank")


def _turbo_schedule(spec: DistilledSpec, header: dict[str, str]) -> tuple[int, tuple[float, float]]:
    """The spec's values, else the header's h3trt.* metadata, else a known release's (by sha256); steps and the video
    shift must come from somewhere (LightX2V's headers state neither; where its sources conflict, the user decides)."""
    stated = {k: getattr(spec, k) for k in METADATA_KEYS}
    for key, name in METADATA_KEYS.items():
        if stated[key] is None and name in header:
            stated[key] = _value(key, header[name], f"{spec.path} __metadata__ {name}")
    if stated["steps"] is None or stated["video_shift"] is None:
        release = TURBO_RELEASES.get(sha256_of(spec.path))
        if release is not None:
            defaults = dict(zip(METADATA_KEYS, (release[1], *release[2])))
            stated = {k: defaults[k] if v is None else v for k, v in stated.items()}
    if stated["steps"] is None or stated["video_shift"] is None:
        raise DistilledError(f"--distilled {spec.path}: a Turbo file's header states no schedule; state the one it was "
                             f"trained for: --distilled FILE@steps=5,video_shift=6 ({TURBO_TABLE}).")
    audio = stated["audio_shift"] if stated["audio_shift"] is not None else TURBO_DEFAULT_AUDIO_SHIFT
    return stated["steps"], (stated["video_shift"], audio)


@dataclass(frozen=True)
class DistilledServing:
    """What a loaded distilled model (eager, or a bundle's manifest) tells admission and the pipeline."""

    family: str
    plan: FamilySchedule
    tasks: tuple[str, ...]
    # FastH3-VSA (a file that sets the gates, an export whose blocks carry them): the sparsity and tiles it was
    # distilled at (vsa.plan.trained_vsa); what the model serves is the manifest's `vsa` (vsa.plan.served_vsa_settings)
    vsa: dict | None = None

    def record(self) -> dict:
        return {"family": self.family, "schedule": schedule_json(self.plan.schedule), "tasks": list(self.tasks),
                "other_steps": self.plan.other_steps, "shifts_fixed": self.plan.shifts_fixed, "vsa": self.vsa}

    def with_gates(self, cfg: H3Config) -> H3Config:
        """The model config this file makes of a checkpoint's `cfg`: a FastH3-VSA file's gates turn vsa_gate on."""
        return dataclasses.replace(cfg, vsa_gate=True) if self.vsa is not None else cfg

    @classmethod
    def from_record(cls, record: dict) -> "DistilledServing":
        """The inverse of `record` (a bundle's manifest)."""
        s = record["schedule"]
        schedule = Schedule(s["steps"], s["video_shift"], s["audio_shift"],
                            tuple(s["rungs"]) if s.get("rungs") is not None else None)
        fix = pdd_schedule(schedule.steps - 1).fix.replace("load the file", "rebuild") if record["family"] == "pdd" else ""
        return cls(record["family"], FamilySchedule(schedule, record["other_steps"], record["shifts_fixed"], fix),
                   tuple(record["tasks"]), record.get("vsa"))

    @property
    def adapters_refusal(self) -> str | None:
        """Why this model takes no LoRA per request (fused FastH3; PDD, which stacks with no other distillation)."""
        if self.family == "turbo":
            return None
        why = "is fused into the weights" if self.family == "fasth3" else "stacks with no other LoRA or distillation"
        return (f"this model runs a {self.family} distilled checkpoint, which {why}: a LoRA per request is not "
                "served; drop the lora field (or use a base-model bundle).")

    @property
    def merged_lora_refusal(self) -> str | None:
        """Why no other LoRA may be merged beside this file (--lora): FastH3 and PDD stack with none."""
        if self.family == "turbo":
            return None
        return (f"--lora: a {self.family} distilled checkpoint stacks with no other LoRA (vLLM-Omni and alibaba-pai "
                "refuse it too); drop --lora, or merge the LoRA into a base-model bundle.")

    def check(self, task: str, guidance: float, cache: object | None) -> None:
        """Refuse a request this family cannot run (its schedule is checked by `schedule`)."""
        check_task(self.family, self.tasks, task, "this model")
        if guidance != 1.0:
            raise UserError(f"guidance is {guidance:g}, but this {self.family} model is guidance-distilled and runs "
                            "CFG off; leave guidance at 1.", field="guidance")
        if cache is not None and self.family == "pdd":
            raise UserError("a step cache skips evaluations, but each PDD forward predicts its own block of "
                            "intervals (alibaba-pai: do not stack PDD with caches); drop the cache.", field="cache")

    def schedule(self, steps: int | None, video_shift: float | None, audio_shift: float | None) -> Schedule:
        return self.plan.for_request(steps, video_shift, audio_shift, self.family)
