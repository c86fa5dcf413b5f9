"""Step caching: skip the DiT's block stack on evaluations a cached residual predicts, with the semantics of
diffusers 0.42.1's hooks (`hooks/first_block_cache.py`, `hooks/mag_cache.py`). Opt-in; off unless a request asks.

first-block (FBCache): block 0 always runs. Its residual r = block_0(x) - x is compared with r_prev, the block-0
  residual of the last evaluation that ran every block: d = mean|r - r_prev| / mean|r_prev| over the whole packed
  stream. d > threshold: the other blocks run, and r_prev and the tail residual t = out - block_0(x) are stored.
  Otherwise the output is block_0(x) + t and nothing is stored, so a run of skips is measured against the same r_prev.
  The first evaluation always runs (no r_prev). Two knobs from Cache-DiT's DBCache (Fn=1, Bn=0; what SGLang and
  vLLM-Omni run on H3), off by default so the default is diffusers' exactly:
  - `warmup` W: the first W evaluations of each branch run every block (r_prev is stored; d is not computed).
  - `max_skip_steps` K: after K skips in a row the next evaluation runs every block (d is not computed) and the run
    starts again; any evaluation that runs every block ends a run. None: no limit.
  The hit rule stays diffusers' (skip iff d <= threshold; DBCache skips iff d < threshold: they differ only where d
  equals the threshold exactly). `threshold=inf` skips every evaluation the warm-up and K allow: a profile's
  worst-case (fastest) clip. Two differences from Cache-DiT's code, by choice: its counter of consecutive hits counts
  from the second hit after a forced run (its K=1 then allows 2 in a row) and is not reset by a natural miss; h3trt's
  K is exact (at most K in a row, every miss resets). Its threshold >= 1 means "always hit" and <= 0 "never"; h3trt's
  threshold is only compared with d (0: skip only an unchanged residual).
mag (MagCache): decided from the step index alone, with a per-model ratio list (the expected ratio of consecutive
  residual magnitudes) interpolated to the number of evaluations by nearest index. From step round(retention * N)
  on: ratio *= mag_ratios[i], steps += 1, err += |1 - ratio|; the whole stack is skipped (out = x + the last computed
  residual out - x) while err <= threshold and steps <= max_skip_steps, else it runs and the accumulators reset.
  Float32 scalar arithmetic, as the reference's tensors. With a ratio of exactly 1.0, err stays 0: the reference
  skips there even at threshold 0, and so does h3trt.

State lives per denoiser call name ("cond", and "uncond" for the negative guidance branch), like the reference's
cache contexts, and per generation. Under sequence parallelism every rank must take the same decision: FBCache
all-reduces the two sums of its metric over the sp group, leaving the padding rows out; MagCache decides from the
step index. Shapes: x [B, S, H] (S: this rank's rows under sp).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import UserError

CACHE_KINDS = ("first-block", "mag")
# The reference's defaults (FirstBlockCacheConfig, MagCacheConfig).
DEFAULT_THRESHOLDS = {"first-block": 0.05, "mag": 0.06}
DEFAULT_MAX_SKIP_STEPS = 3
DEFAULT_RETENTION_RATIO = 0.2

LayerFn = Callable[[int, torch.Tensor], torch.Tensor]  # (layer index, x [B, S, H]) -> x

# The knobs a request may state too: each one's flag, request key and what it takes (its bound, the schema's too).
KNOBS = {"threshold": ("--cache-threshold", "cache_threshold", ">= 0 (0: skip only what is exactly "
                       "predicted; inf: every skip the warm-up and the max skip allow)"),
         "max_skip_steps": ("--cache-max-skip", "cache_max_skip", "a whole number >= 1 (consecutive skipped "
                            "evaluations at most; leave it out for no limit)"),
         "warmup": ("--cache-warmup", "cache_warmup", "a whole number >= 0 (leading evaluations that run every "
                    "block)")}


def check_knob(knob: str, value, flags: bool = True) -> None:
    """`value` for the step-cache knob `knob` (a StepCacheConfig field of KNOBS) within its bound, else one line
    naming its flag (`flags`) or its request key, about that key (the API's param)."""
    flag, key, takes = KNOBS[knob]
    least = 0 if knob != "max_skip_steps" else 1
    ok = value >= 0 if knob == "threshold" else not _not_int(value) and value >= least  # NaN fails `>= 0`
    if not ok:
        raise UserError(f"{flag if flags else key} must be {takes}, got {value!r}.", field=key)


@dataclass(frozen=True)
class StepCacheConfig:
    """What a request asks of step caching."""

    kind: str  # "first-block" or "mag"
    threshold: float  # FBCache: relative change of block 0's residual; MagCache: accumulated ratio error
    mag_ratios: tuple[float, ...] | None = None  # MagCache: the model's ratio per step (interpolated to the steps)
    # Consecutive skips at most (K). None: MagCache's default 3; for FBCache no limit (diffusers').
    max_skip_steps: int | None = None
    retention_ratio: float = DEFAULT_RETENTION_RATIO  # MagCache: leading fraction of the steps never skipped
    calibrate: bool = False  # MagCache: skip nothing, measure the ratios of this model and schedule
    warmup: int = 0  # FBCache: leading evaluations of each branch that run every block (DBCache's max_warmup_steps)

    def __post_init__(self):
        if self.kind not in CACHE_KINDS:
            raise UserError(f"--cache must be one of {CACHE_KINDS}, got {self.kind!r}.")
        for knob in KNOBS:
            if getattr(self, knob) is not None:
                check_knob(knob, getattr(self, knob))
        if self.kind == "first-block":
            if self.mag_ratios is not None or self.calibrate:
                raise UserError("--mag-ratios and --mag-calibrate apply to --cache mag, not first-block.")
            return
        if self.warmup:
            raise UserError("--cache-warmup applies to --cache first-block; mag never skips its leading steps "
                            "(--cache-retention, a fraction of the steps).")
        if self.max_skip_steps is None:  # the reference's MagCacheConfig default, recorded as it ran
            object.__setattr__(self, "max_skip_steps", DEFAULT_MAX_SKIP_STEPS)
        if (self.mag_ratios is None) == (not self.calibrate):
            raise UserError("--cache mag needs the model's ratios: --mag-ratios R1,R2,... (or a .json list), or "
                            "--mag-calibrate to measure them on one run (recorded in the clip's JSON); not both.")
        if self.mag_ratios is not None:
            # Each ratio scales the predicted residual magnitude: with 0, a negative, inf or nan the accumulated error
            # is meaningless (nan compares false, inf never skips again), so every value is checked, by position.
            bad = [f"{r} (#{i + 1})" for i, r in enumerate(self.mag_ratios) if not (math.isfinite(r) and r > 0)]
            if bad or not self.mag_ratios:
                raise UserError(f"--mag-ratios must be finite positive numbers, "
                                f"{'not ' + ', '.join(bad) if bad else 'and at least one'}. Measure this model's "
                                "with --mag-calibrate (its clip's JSON then serves as --mag-ratios FILE).")
        if not 0.0 <= self.retention_ratio <= 1.0:
            raise UserError(f"--cache-retention must be in [0, 1], got {self.retention_ratio}.")

    def to_dict(self) -> dict:
        data = asdict(self)
        data["mag_ratios"] = list(self.mag_ratios) if self.mag_ratios is not None else None
        data["threshold"] = json_number(self.threshold)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> StepCacheConfig:
        """`to_dict`'s JSON read back (a stored request's cache)."""
        ratios = data.get("mag_ratios")
        return cls(**{**data, "threshold": float(data["threshold"]),
                      "mag_ratios": tuple(ratios) if ratios is not None else None})


def json_number(x: float) -> float | str:
    """inf as the string "inf": a record is strict JSON (JSON has no infinity), and --cache-threshold inf is valid."""
    return "inf" if math.isinf(x) else x


def _not_int(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def nearest_interp(ratios: torch.Tensor, length: int) -> torch.Tensor:
    """The reference's `nearest_interp`: ratios [R] -> [length] by rounded index (float32 grid)."""
    if length == 1:
        return ratios[-1:]
    scale = (len(ratios) - 1) / (length - 1)
    grid = torch.arange(length, dtype=torch.float32)
    return ratios[torch.round(grid * scale).long()]


class StepCache:
    """One generation's cache: a state per denoiser call name, created on first use."""

    def __init__(self, config: StepCacheConfig, num_evaluations: int):
        self.config, self.num_evaluations = config, num_evaluations
        self.ratios = None
        if config.mag_ratios is not None:
            given = torch.tensor(config.mag_ratios)  # float32, as the reference's MagCacheConfig
            self.ratios = given if len(given) == num_evaluations else nearest_interp(given, num_evaluations)
        self.contexts: dict[str, CacheContext] = {}
        self.gathered: dict[str, dict] = {}

    def context(self, name: str = "cond") -> "CacheContext":
        if name not in self.contexts:
            self.contexts[name] = CacheContext(self, name)
        return self.contexts[name]

    def gather(self, group) -> None:
        """Under cfg parallelism each rank runs one branch: collect every branch's record on every rank."""
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, {n: c.record() for n, c in self.contexts.items() if c.computed}, group=group)
        self.gathered = {k: v for part in parts for k, v in part.items()}

    def report(self) -> dict:
        """What the clip record says: the settings, the ratios used, and each branch's skipped evaluations."""
        cfg = self.config
        out = {"kind": cfg.kind, "threshold": json_number(cfg.threshold), "evaluations": self.num_evaluations}
        if cfg.kind == "first-block":
            out.update(warmup=cfg.warmup, max_skip_steps=cfg.max_skip_steps)
        if cfg.kind == "mag":
            out.update(max_skip_steps=cfg.max_skip_steps, retention_ratio=cfg.retention_ratio,
                       retention_steps=self.retention_steps, calibrate=cfg.calibrate,
                       mag_ratios_given=len(cfg.mag_ratios) if cfg.mag_ratios is not None else None,
                       mag_ratios=[float(r) for r in self.ratios] if self.ratios is not None else None)
        branches = {n: c.record() for n, c in self.contexts.items()}
        branches.update(self.gathered)
        out["branches"] = dict(sorted(branches.items()))
        out["skipped"] = sum(len(b["skipped_steps"]) for b in branches.values())
        out["computed"] = sum(b["computed"] for b in branches.values())
        return out

    @property
    def retention_steps(self) -> int:
        return int(self.config.retention_ratio * self.num_evaluations + 0.5)


class CacheContext:
    """The state of one denoiser call name across a generation's evaluations."""

    def __init__(self, cache: StepCache, name: str):
        self.cache, self.config, self.name = cache, cache.config, name
        self.computed: list[bool] = []  # per evaluation: did the block stack run
        self.metrics: list[float | None] = []  # FBCache: the relative change it compared (None: first evaluation)
        self.head_residual = self.tail_residual = None  # FBCache
        self.skip_run = 0  # FBCache: skips in a row so far
        self.previous_residual = None  # MagCache
        self.step_index = 0
        self._reset_accumulators()
        self.calibration_ratios: list[float] = []
        self.calibrated: list[float] | None = None

    def _reset_accumulators(self) -> None:
        self.accumulated_ratio, self.accumulated_err, self.accumulated_steps = 1.0, 0.0, 0

    def record_fields(self) -> dict:
        """The step cache's part of the clip's record (models/runner.py RecordPart): one `step_cache`, every branch
        in it, whichever branch's context a request's extras hold."""
        return {"step_cache": self.cache.report()}

    def record(self) -> dict:
        """This branch's part of its cache's report: what it computed and skipped."""
        out = {"computed": sum(self.computed),
               "skipped_steps": [i for i, ran in enumerate(self.computed) if not ran]}
        if self.config.kind == "first-block":
            out["relative_change"] = [None if m is None else round(m, 6) for m in self.metrics]
        if self.calibrated is not None:
            out["mag_ratios_calibrated"] = self.calibrated
        return out

    def run_blocks(self, x, num_layers: int, block_fn: LayerFn, group=None, live_rows=None):
        """The block stack over x [B, S, H] (this rank's rows under sp: `group`, with `live_rows` of them real) ->
        [B, S, H], skipping what this evaluation's decision allows (models/block_stack.py calls this)."""
        if self.config.kind == "first-block":
            return self._first_block(x, num_layers, block_fn, group, live_rows)
        return self._mag(x, num_layers, block_fn, group, live_rows)

    # FBCache ---------------------------------------------------------------------------------------------------------
    def _first_block(self, x, num_layers, block_fn, group, live_rows):
        if num_layers < 2:
            raise ValueError("The first-block cache needs a head block and a tail: at least 2 layers.")
        head_out = block_fn(0, x)
        residual = head_out - x
        metric = _relative_change(residual, self.head_residual, group, live_rows) if self._may_skip() else None
        self.metrics.append(metric)
        if metric is not None and not metric > self.config.threshold:
            self.computed.append(False)
            self.skip_run += 1
            return self.tail_residual + head_out
        self.computed.append(True)
        self.skip_run = 0
        out = head_out
        for i in range(1, num_layers):
            out = block_fn(i, out)
        self.head_residual, self.tail_residual = residual, out - head_out
        return out

    def _may_skip(self) -> bool:
        """Whether this evaluation may skip at all, decided from counts alone (the same on every sp rank): not in the
        warm-up, not past K skips in a row, and with an r_prev to compare."""
        cfg = self.config
        if self.head_residual is None or len(self.computed) < cfg.warmup:
            return False
        return cfg.max_skip_steps is None or self.skip_run < cfg.max_skip_steps

    # MagCache --------------------------------------------------------------------------------------------------------
    def _mag(self, x, num_layers, block_fn, group, live_rows):
        cache, cfg = self.cache, self.config
        compute = True
        if not cfg.calibrate:
            step = self.step_index
            scale = cache.ratios[step] if step < len(cache.ratios) else 1.0
            if step >= cache.retention_steps:
                self.accumulated_ratio *= scale  # a float32 0-d tensor from here on, as in the reference
                self.accumulated_steps += 1
                self.accumulated_err += abs(1.0 - self.accumulated_ratio)
                if (self.previous_residual is not None and self.accumulated_err <= cfg.threshold
                        and self.accumulated_steps <= cfg.max_skip_steps):
                    compute = False
                else:
                    self._reset_accumulators()
        self.computed.append(compute)
        if not compute:
            out = x + self.previous_residual
        else:
            out = x
            for i in range(num_layers):
                out = block_fn(i, out)
            residual = out - x
            if cfg.calibrate:
                self.calibration_ratios.append(1.0 if self.previous_residual is None else
                                               _norm_ratio(residual, self.previous_residual, group, live_rows))
            self.previous_residual = residual
        self.step_index += 1
        if self.step_index >= cache.num_evaluations:  # the end of the loop: the reference resets its state here
            if cfg.calibrate:
                self.calibrated = [round(r, 6) for r in self.calibration_ratios]
            self.step_index, self.previous_residual, self.calibration_ratios = 0, None, []
            self._reset_accumulators()
        return out


def _live(t: torch.Tensor, live_rows: int | None) -> torch.Tensor:
    return t if live_rows is None else t[:, :live_rows]


def _relative_change(residual: torch.Tensor, previous: torch.Tensor, group, live_rows) -> float:
    """mean|r - r_prev| / mean|r_prev| over every real row. Unsharded: the reference's expression exactly; sharded:
    the two sums all-reduced in fp32 (the element counts cancel), so every rank compares the same number."""
    if group is None and live_rows is None:
        return ((residual - previous).abs().mean() / previous.abs().mean()).item()
    r, p = _live(residual, live_rows), _live(previous, live_rows)
    sums = torch.stack([(r - p).abs().float().sum(), p.abs().float().sum()])
    if group is not None:
        dist.all_reduce(sums, group=group)
    return (sums[0] / sums[1]).item()


def _norm_ratio(current: torch.Tensor, previous: torch.Tensor, group, live_rows) -> float:
    """MagCache calibration: mean over rows of |current row| / (|previous row| + 1e-8)."""
    c, p = _live(current, live_rows), _live(previous, live_rows)
    ratios = torch.linalg.norm(c.float(), dim=-1) / (torch.linalg.norm(p.float(), dim=-1) + 1e-8)
    if group is None and live_rows is None:
        return ratios.mean().item()
    sums = torch.stack([ratios.sum(), torch.tensor(float(ratios.numel()), device=ratios.device)])
    if group is not None:
        dist.all_reduce(sums, group=group)
    return (sums[0] / sums[1]).item()
