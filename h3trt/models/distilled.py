"""Distilled MiniMax-H3 checkpoints: which family a file is, what it runs, and what it refuses (issue 47).

  `--distilled FILE[@key=value,...]` (DistilledSpec): keys `family` (fasth3 | turbo | pdd: else detected from the
  header), `steps` (Turbo: its grid points; PDD: 5, 7 or 9), `video_shift` / `audio_shift` (Turbo), `alpha` (Turbo,
  where its header has none), `grid` (FastH3 v1: rungs | uniform).

Families (distilled_schedule.py holds their schedules, distilled_files.py their formats, distilled_merge.py the
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

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..errors import UserError
from .config import H3Config
from .distilled_files import (FASTH3_FORMAT, DistilledError, Fusion, lora_fusion, read_fasth3, read_header,
                              read_pdd, sha256_of)
from .distilled_schedule import (FASTH3_V1_RUNGS, PDD_BLOCKS, PDD_INTERVALS, FamilySchedule, fasth3_schedule,
                                 pdd_schedule, turbo_schedule)
from .lora import TASK_COMPONENTS, route
from .lora_file import REF2VA_COMPONENT, read_lora
from .sampler import MAX_STEPS, Schedule

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
        values: dict = {}
        kinds = {f.name: f.type for f in fields(cls) if f.name != "path"}
        for pair in tail.split(","):
            key, sep, value = pair.strip().partition("=")
            if not sep or key not in kinds or key in values:
                raise UserError(f"--distilled {text}: expected KEY=VALUE pairs after '@', each key once, of "
                                f"{list(kinds)}; got {pair.strip()!r}.")
            values[key] = _value(key, value.strip(), text)
        return cls(Path(head), **values)

    def __post_init__(self):
        if self.family is not None and self.family not in FAMILIES:
            raise UserError(f"--distilled {self.path}: family must be one of {list(FAMILIES)}, got {self.family!r}.")

    def to_json(self) -> dict:
        return {k: (str(v) if k == "path" else v) for k, v in asdict(self).items() if v is not None}


def _value(key: str, text: str, where: str):
    if key in ("family", "grid"):
        return text
    try:
        value = int(text) if key == "steps" else float(text)
    except ValueError:
        value = None
    if key == "steps" and (value is None or not 2 <= value <= MAX_STEPS):
        raise UserError(f"--distilled {where}: steps must be an integer from 2 to {MAX_STEPS}, got {text!r}.")
    if key != "steps" and (value is None or not (math.isfinite(value) and value > 0)):
        raise UserError(f"--distilled {where}: {key} must be a positive finite number, got {text!r}.")
    return value


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
    """A distilled file read for one model and task: its family, fusion, schedule and the tasks it serves."""

    spec: DistilledSpec
    family: str
    fusion: Fusion
    plan: FamilySchedule
    tasks: tuple[str, ...]
    heads: dict | None = None  # PDD: the fused heads per forward (pdd.fused_step_heads), for plan.schedule

    def record(self) -> dict:
        """The manifest's and every clip record's `distilled` entry."""
        return {"family": self.family, **self.fusion.record(), "spec": self.spec.to_json(),
                "schedule": schedule_json(self.plan.schedule), "tasks": list(self.tasks),
                "vsa": None}  # the VSA settings (issue 47 item 4) are recorded here once VSA serves them

    def serving(self) -> "DistilledServing":
        return DistilledServing(self.family, self.plan, self.tasks)


def schedule_json(schedule: Schedule) -> dict:
    return {"steps": schedule.steps, "video_shift": schedule.video_shift, "audio_shift": schedule.audio_shift,
            "rungs": list(schedule.rungs) if schedule.rungs is not None else None}


def load_distilled(spec: DistilledSpec, cfg: H3Config, task: str) -> Distilled:
    """Read `spec`'s file for a model of `cfg` serving `task`'s partition: the family detected (or named), the file
    read into a Fusion, the schedule resolved, every mismatch refused in one line."""
    header, keys = read_header(spec.path)
    family = spec.family or detect_family(spec.path, header, keys)
    _refuse_keys(spec, family)
    if family == "fasth3":
        fusion = read_fasth3(spec.path, cfg, header)
        distilled = Distilled(spec, family, fusion, fasth3_schedule(FASTH3_V1_RUNGS, grid=spec.grid or "rungs"),
                              ("t2va",))
    elif family == "pdd":
        distilled = _load_pdd(spec, cfg, header)
    else:
        distilled = _load_turbo(spec, cfg, task, header)
    check_task(distilled.family, distilled.tasks, task, spec.path)
    return distilled


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
                             f"({partition}); build or run it with --task {tasks[0]}.")


def _load_pdd(spec: DistilledSpec, cfg: H3Config, header: dict[str, str]) -> Distilled:
    from .pdd import fused_step_heads

    fusion = read_pdd(spec.path, cfg, header)
    if (fusion.counts["intervals"], fusion.counts["block_size"]) != (PDD_INTERVALS, 4):
        raise DistilledError(f"--distilled {spec.path}: pdd_num_steps {fusion.counts['intervals']} and "
                             f"pdd_block_size {fusion.counts['block_size']}; h3trt runs the released "
                             f"{PDD_INTERVALS}-interval, block-4 heads.")
    forwards = (spec.steps or 9) - 1
    if forwards not in PDD_BLOCKS:
        raise DistilledError(f"--distilled {spec.path}@steps={forwards + 1}: PDD runs 4, 6 or 8 forwards (steps 5, 7 "
                             "or 9); other counts give noise.")
    plan = pdd_schedule(forwards)
    for head, (weight, bias) in fusion.heads.items():
        if weight.shape[0] != PDD_INTERVALS or bias.shape[0] != PDD_INTERVALS:
            raise DistilledError(f"--distilled {spec.path}: the {head} bank holds {weight.shape[0]} heads, the header "
                                 f"{PDD_INTERVALS} intervals.")
    heads = fused_step_heads(fusion.heads, (plan.schedule.video_shift, plan.schedule.audio_shift),
                             PDD_BLOCKS[forwards])
    return Distilled(spec, "pdd", fusion, plan, ("t2va", "fl2va", "ref2va"), heads)


def _load_turbo(spec: DistilledSpec, cfg: H3Config, task: str, header: dict[str, str]) -> Distilled:
    lora = read_lora(spec.path, cfg.head_dim)
    prefix, modules = route(lora, task)
    sha = lora.sha256
    release = TURBO_RELEASES.get(sha)
    if lora.alpha_given and spec.alpha is not None:
        raise UserError(f"--distilled {spec.path}@alpha={spec.alpha:g}: the file states its own alpha "
                        f"({lora.alpha_rule}); drop alpha.")
    if lora.alpha_given:
        rule, scale_of = lora.alpha_rule, None
    else:
        alpha = spec.alpha or TURBO_DEFAULT_ALPHA
        why = "FILE@alpha" if spec.alpha else "LightX2V's reference default, its header has none"
        rule, scale_of = f"alpha {alpha:g} ({why}) / rank", (lambda m, a=alpha: a / m.up.shape[1])
    fusion = lora_fusion(lora, modules, cfg, rule, scale_of)
    steps, shifts = _turbo_schedule(spec, header, release)
    tasks = ("ref2va",) if prefix == REF2VA_COMPONENT else tuple(TASK_COMPONENTS)
    return Distilled(spec, "turbo", fusion, turbo_schedule(steps, shifts), tasks)


def _turbo_schedule(spec: DistilledSpec, header: dict[str, str],
                    release) -> tuple[int, tuple[float, float]]:
    """The spec's values, else the header's h3trt.* metadata, else a known release's; steps and the video shift
    must come from somewhere (LightX2V's headers state neither; where its sources conflict, the user decides)."""
    stated = {k: getattr(spec, k) for k in METADATA_KEYS}
    for key, name in METADATA_KEYS.items():
        if stated[key] is None and name in header:
            stated[key] = _value(key, header[name], f"{spec.path} __metadata__ {name}")
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

    @property
    def adapters_refusal(self) -> str | None:
        """Why this model takes no LoRA per request (fused FastH3; PDD, which stacks with no other distillation)."""
        if self.family == "turbo":
            return None
        why = "is fused into the weights" if self.family == "fasth3" else "stacks with no other LoRA or distillation"
        return (f"this model runs a {self.family} distilled checkpoint, which {why}: a LoRA per request is not "
                "served; drop the lora field (or use a base-model bundle).")

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
