"""Step-cache warm-up and consecutive-skip limit (models/step_cache.py) against a hand-computed decision sequence,
block calls counted, and the named speed profiles (request/fields.py PROFILES, request/parse.py profile_fields): what each resolves to, explicit knobs over
the profile's, bad values refused in one line before any model loads.

The synthetic block stack: block 0 adds c_k to every element at evaluation k, so its residual is c_k everywhere and
the first-block metric is d_k = |c_k - c_prev| / |c_prev| (c_prev: the last evaluation that ran every block); the
other blocks add 1 each, so a skipped evaluation's output (block 0's plus the stored tail residual) is known too.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from h3trt.errors import UserError
from h3trt.models.step_cache import StepCache, StepCacheConfig
from h3trt.request.fields import PROFILES
from h3trt.request.parse import profile_fields

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


# ----------------------------------------------------------------------------------------------------------------------
# The named profiles

# The documented table (README, 'Speed profiles'): (step cache kind, threshold, warm-up, skips in a row), sparsity,
# dense leading evaluations.
TABLE = {
    "lossless": (None, 0.0, None),
    "quality": (("first-block", 0.04, 4, 1), 0.0, None),
    "balanced": (("first-block", 0.12, 4, 3), 0.75, 10),
    "fast": (("first-block", 0.24, 4, 3), 0.80, 10),
}


def cache_of(fields):
    c = fields["cache"]
    return None if c is None else (c.kind, c.threshold, c.warmup, c.max_skip_steps)


@pytest.mark.parametrize("name", list(TABLE))
def test_each_profile_resolves_to_its_settings(name):
    fields = profile_fields(name)
    cache, sparsity, dense = TABLE[name]
    assert fields["profile"] == name and cache_of(fields) == cache
    assert fields["sparse_attention"] == sparsity and fields.get("sparse_dense_steps") == dense
    assert set(PROFILES) == set(TABLE)


@pytest.mark.parametrize("knobs, cache, sparse", [
    ({"threshold": 0.3}, ("first-block", 0.3, 4, 3), (0.75, 10)),
    ({"warmup": 0, "max_skip_steps": 1}, ("first-block", 0.12, 0, 1), (0.75, 10)),  # 0 is stated, not "unset"
    ({"sparse_attention": 0.5, "sparse_dense_steps": 2}, ("first-block", 0.12, 4, 3), (0.5, 2)),
    ({"sparse_attention": 0.0}, ("first-block", 0.12, 4, 3), (0.0, 10)),
    ({"cache": "mag", "mag_ratios": (0.99, 0.98)}, ("mag", 0.06, 0, 3), (0.75, 10)),  # the cache replaced whole
])
def test_an_explicit_knob_overrides_the_profiles_value_for_that_knob_only(knobs, cache, sparse):
    fields = profile_fields("balanced", **knobs)
    assert cache_of(fields) == cache
    assert (fields["sparse_attention"], fields["sparse_dense_steps"]) == sparse


def test_without_a_profile_the_flags_alone_decide():
    assert profile_fields(None) == {"profile": None, "cache": None}
    assert cache_of(profile_fields(None, "first-block")) == ("first-block", 0.05, 0, None)  # diffusers' defaults




def test_run_builds_the_request_from_the_profile_and_the_flags(h3trt, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr("h3trt.run.commands.run_clip", lambda entry, request, *args: seen.append(request) or 0)
    code, err = h3trt("run", "--prompt", "a fox", "--output", str(tmp_path / "c.mp4"), "--device", "cpu",
                      "--profile", "fast", "--cache-max-skip", "1")
    assert code == 0, err
    (request,) = seen
    assert request.speed.profile == "fast" and (request.speed.sparse_attention, request.speed.sparse_dense_steps) == (0.8, 10)
    assert (request.speed.cache.threshold, request.speed.cache.warmup, request.speed.cache.max_skip_steps) == (0.24, 4, 1)


@pytest.mark.parametrize("flags, line", [
    (["--profile", "turbo"],
     "argument --profile: invalid choice: 'turbo' (choose from 'lossless', 'quality', 'balanced', 'fast')"),
    (["--profile", "quality", "--cache-max-skip", "0"], "--cache-max-skip must be a whole number >= 1"),
    (["--profile", "quality", "--cache-warmup", "-1"], "--cache-warmup must be a whole number >= 0"),
    (["--profile", "balanced", "--cache-threshold", "nan"], "--cache-threshold must be >= 0"),
    (["--profile", "lossless", "--cache-warmup", "2"],
     "--cache-warmup configure step caching, and --profile lossless has no step cache; add --cache first-block"),
    (["--cache-max-skip", "2"], "--cache-max-skip configure step caching; add --cache first-block or --cache mag."),
    (["--profile", "balanced", "--cache", "mag", "--mag-ratios", "0.99", "--cache-warmup", "4"],
     "--cache-warmup applies to --cache first-block"),
])
def test_bad_profile_values_are_one_line_and_exit_2(h3trt, no_model_load, tmp_path, flags, line):
    code, err = h3trt("run", "--prompt", "a fox", "--output", str(tmp_path / "c.mp4"), "--device", "cpu", *flags)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"h3trt: error: {line}"), err


def test_a_batch_takes_profiles_from_its_lines_not_the_flags(h3trt, no_model_load, tmp_path):
    requests = tmp_path / "r.jsonl"
    requests.write_text('{"id": "a", "task": "t2va", "prompt": "a fox", "profile": "fast"}\n')
    code, err = h3trt("run", "--requests", str(requests), "--out-dir", str(tmp_path / "out"), "--profile", "fast",
                      "--cache-warmup", "0")
    assert code == 2 and len(err) == 1 and "--profile --cache-warmup set one clip's speed profile" in err[0], err
    # Before: the cache knobs but --cache were ignored with --requests (the batch ran without them, silently).
    code, err = h3trt("run", "--requests", str(requests), "--out-dir", str(tmp_path / "out"),
                      "--cache-threshold", "0.1")
    assert code == 2 and len(err) == 1 and "--cache-threshold set one clip's speed profile" in err[0], err


@pytest.mark.parametrize("line, check", [
    ({"profile": "fast", "cache_max_skip": 1}, lambda r: (r.speed.cache.threshold, r.speed.cache.max_skip_steps) == (0.24, 1)),
    ({"cache": "first-block", "cache_warmup": 4}, lambda r: (r.speed.cache.warmup, r.speed.cache.max_skip_steps) == (4, None)),
    ({"profile": "lossless"}, lambda r: r.speed.cache is None and r.speed.sparse_attention == 0.0 and r.speed.profile == "lossless"),
])
def test_request_lines_take_a_profile_and_cache_keys(line, check):
    assert check(request_of({"prompt": "a fox", **line}))


@pytest.mark.parametrize("line, message", [
    ({"profile": "turbo"}, "profile 'turbo' is not one of ['lossless', 'quality', 'balanced', 'fast']"),
    ({"profile": 3}, "profile must be one of"),
    ({"cache": "mag"}, "cache must be 'first-block' in a request"),
    ({"profile": "fast", "cache_threshold": "0.1"}, "cache_threshold must be a number"),
    ({"profile": "fast", "cache_warmup": 1.5}, "cache_warmup must be a whole number"),
    ({"profile": "fast", "cache_max_skip": 0}, "cache_max_skip must be a whole number >= 1"),
    ({"cache_warmup": 2}, 'cache_warmup configure step caching; add "cache": "first-block"'),
    ({"profile": "lossless", "cache_threshold": 0.1}, "and profile 'lossless' has no step cache"),
])
def test_bad_request_keys_are_refused_by_name(line, message):
    with pytest.raises(UserError, match=re.escape(message)):
        request_of({"prompt": "a fox", **line})


def request_of(data: dict):
    from pathlib import Path

    from h3trt.request.parse import parse_object

    return parse_object(data, 1, Path("."), ("prompt",)).request


def test_the_api_passes_the_profile_and_cache_fields_on(tmp_path):
    """The server's schema step (server/service.py _to_schema), multipart included: numbers arrive as text."""
    from types import SimpleNamespace

    from h3trt.server.service import ApiError, VideoService

    service = SimpleNamespace(model_id="h3")
    schema, _ = VideoService._to_schema(service, {"prompt": "a fox", "profile": "balanced", "cache_warmup": "2",
                                                  "cache_max_skip": "1"}, [], tmp_path, multipart=True, sent={})
    request = request_of(schema)
    assert request.speed.profile == "balanced" and (request.speed.cache.warmup, request.speed.cache.max_skip_steps) == (2, 1)
    with pytest.raises(ApiError, match="unknown field"):
        VideoService._to_schema(service, {"prompt": "a fox", "cache_retention": 0.1}, [], tmp_path, multipart=False, sent={})
