"""Step-cache warm-up and consecutive-skip limit (models/step_cache.py) against a hand-computed decision sequence,
block calls counted, and the named speed profiles (runtime/profiles.py): what each resolves to, explicit knobs over
the profile's, bad values refused in one line before any model loads.

The synthetic block stack: block 0 adds c_k to every element at evaluation k, so its residual is c_k everywhere and
the first-block metric is d_k = |c_k - c_prev| / |c_prev| (c_prev: the last evaluation that ran every block); the
other blocks add 1 each, so a skipped evaluation's output (block 0's plus the stored tail residual) is known too.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import h3trt.cli as cli
from h3trt.errors import UserError
from h3trt.models.step_cache import StepCache, StepCacheConfig
from h3trt.runtime.profiles import PROFILES, profile_fields, request_profile_fields

pytestmark = pytest.mark.unit

LAYERS = 4
# c_k per evaluation, and d_k against the last computed one, by hand (threshold 0.1; T computed, F skipped):
#   k:            0    1    2     3     4     5     6     7     8     9     10
#   c_k:          1.0  1.0  1.05  1.08  1.02  1.5   1.6   2.0   2.1   2.15  2.0
# warm-up 2, at most 2 skips in a row:
#   d_k:          -    -    .05   .08   -     .47   .067  .33   .05   .075  -        (-: not compared)
#   ran:          T    T    F     F     T(cap) T    F     T     F     F     T(cap)
# diffusers' defaults (no warm-up, no limit), against c_prev = 1.0 until k=5, 1.5 until 7, then 2.0:
#   d_k:          -    0    .05   .08   .02   .5    .067  .33   .05   .075  0
#   ran:          T    F    F     F     F     T     F     T     F     F     F
RESIDUALS = (1.0, 1.0, 1.05, 1.08, 1.02, 1.5, 1.6, 2.0, 2.1, 2.15, 2.0)
DBCACHE_RAN = [True, True, False, False, True, True, False, True, False, False, True]
DBCACHE_D = [None, None, 0.05, 0.08, None, 0.47, 0.0667, 1 / 3, 0.05, 0.075, None]
DIFFUSERS_RAN = [True, False, False, False, False, True, False, True, False, False, False]
DIFFUSERS_D = [None, 0.0, 0.05, 0.08, 0.02, 0.5, 0.0667, 1 / 3, 0.05, 0.075, 0.0]


class Stack:
    """The synthetic block stack: counts every block call, per evaluation."""

    def __init__(self):
        self.calls: list[list[int]] = []
        self.c = 0.0

    def evaluate(self, ctx, c: float, x: torch.Tensor) -> torch.Tensor:
        self.c = c
        self.calls.append([])
        return ctx.run_blocks(x, LAYERS, self.block)

    def block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self.calls[-1].append(i)
        return x + (self.c if i == 0 else 1.0)


def run(config: StepCacheConfig, residuals=RESIDUALS):
    cache = StepCache(config, len(residuals))
    ctx, stack = cache.context("cond"), Stack()
    x = torch.zeros(1, 8, 4)
    outs = [stack.evaluate(ctx, c, x) for c in residuals]
    return ctx, stack, outs, cache.report()


def close(got, want):
    return all((g is None and w is None) or (g is not None and w is not None and abs(g - w) < 1e-3)
               for g, w in zip(got, want, strict=True))


def test_warmup_and_skip_limit_follow_the_hand_computed_sequence():
    ctx, stack, outs, report = run(StepCacheConfig("first-block", 0.1, max_skip_steps=2, warmup=2))
    assert ctx.computed == DBCACHE_RAN
    assert close(ctx.metrics, DBCACHE_D), ctx.metrics
    assert report["warmup"] == 2 and report["max_skip_steps"] == 2
    assert report["branches"]["cond"]["skipped_steps"] == [2, 3, 6, 8, 9]


def test_the_defaults_are_diffusers_first_block_cache():
    ctx, _, _, report = run(StepCacheConfig("first-block", 0.1))
    assert ctx.computed == DIFFUSERS_RAN
    assert close(ctx.metrics, DIFFUSERS_D), ctx.metrics
    assert report["warmup"] == 0 and report["max_skip_steps"] is None


def test_a_skipped_evaluation_runs_block_0_alone_and_adds_the_stored_tail():
    _, stack, outs, _ = run(StepCacheConfig("first-block", 0.1, max_skip_steps=2, warmup=2))
    for k, (ran, calls) in enumerate(zip(DBCACHE_RAN, stack.calls)):
        assert calls == (list(range(LAYERS)) if ran else [0]), f"evaluation {k}: blocks {calls}"
        last = max(j for j in range(k + 1) if DBCACHE_RAN[j])  # its tail residual: LAYERS - 1 blocks adding 1
        assert torch.all(outs[k] == RESIDUALS[k] + (LAYERS - 1)), f"evaluation {k} (tail from {last})"
    assert sum(len(c) for c in stack.calls) == LAYERS * sum(DBCACHE_RAN) + DBCACHE_RAN.count(False)


@pytest.mark.parametrize("max_skip", [1, 3])
def test_threshold_inf_takes_every_skip_the_warmup_and_the_limit_allow(max_skip):
    """The worst case a profile can reach (its fastest clip): after the 4 warm-up evaluations, K skips then one run,
    whatever the residuals do (here they change by 100% each time)."""
    residuals = tuple(float(2 ** k) for k in range(14))
    ctx, _, _, report = run(StepCacheConfig("first-block", math.inf, max_skip_steps=max_skip, warmup=4), residuals)
    want = [True] * 4 + [(i % (max_skip + 1)) == max_skip for i in range(10)]
    assert ctx.computed == want
    assert report["threshold"] == "inf" and json.loads(json.dumps(report, allow_nan=False))


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "first-block", "max_skip_steps": 0}, "--cache-max-skip must be a whole number >= 1"),
    ({"kind": "first-block", "max_skip_steps": True}, "--cache-max-skip must be a whole number >= 1"),
    ({"kind": "first-block", "warmup": -1}, "--cache-warmup must be a whole number >= 0"),
    ({"kind": "first-block", "warmup": 1.5}, "--cache-warmup must be a whole number >= 0"),
    ({"kind": "mag", "warmup": 4, "mag_ratios": (0.99,)}, "--cache-warmup applies to --cache first-block"),
    ({"kind": "first-block", "threshold": math.nan}, "--cache-threshold must be >= 0"),
])
def test_bad_cache_knobs_are_refused(kwargs, message):
    kwargs = {"threshold": 0.1, **kwargs}
    with pytest.raises(UserError, match=message):
        StepCacheConfig(**kwargs)


def test_mag_keeps_its_default_skip_limit():
    assert StepCacheConfig("mag", 0.06, (0.99,)).max_skip_steps == 3
