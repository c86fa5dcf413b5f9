"""The DiT runner contract (models/runner.py): what one evaluation carries (`EvalExtras`) and what a runner serves
(`RunnerCaps`), checked before anything runs. Pure: no model (milliseconds)."""

from __future__ import annotations

import dataclasses

import pytest

from h3trt.errors import UserError
from h3trt.models.runner import NO_EXTRAS, NO_SPARSE_KERNEL, EvalExtras, RunnerCaps

pytestmark = pytest.mark.unit


def test_no_extras_is_a_plain_evaluation_and_extras_are_frozen():
    assert NO_EXTRAS == EvalExtras() and (NO_EXTRAS.cache, NO_EXTRAS.sparse, NO_EXTRAS.lora) == (None, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        NO_EXTRAS.lora = object()


def test_caps_refuse_what_a_runner_does_not_serve_naming_the_field():
    plain = RunnerCaps()
    plain.check(sparse=False, adapters=0)  # a plain request runs anywhere
    for caps, asked, field, words in (
            (plain, {"sparse": True, "adapters": 0}, "sparse_attention", NO_SPARSE_KERNEL[:40]),
            (RunnerCaps(sparse_problem="the kernel failed at load: x"), {"sparse": True, "adapters": 0},
             "sparse_attention", "the kernel failed at load: x"),
            (plain, {"sparse": False, "adapters": 1}, "lora", "holds no adapter slots"),
            (RunnerCaps(adapter_slots=2), {"sparse": False, "adapters": 3}, "lora", "at most 2 (the model's LoRA slots)"),
            (RunnerCaps(batches=False), {"sparse": False, "adapters": 0, "batch": 2}, None, "compiled for batch 1")):
        with pytest.raises(UserError) as e:
            caps.check(**asked)
        assert words in str(e.value) and e.value.field == field
    RunnerCaps(sparse_kernel="triton", adapter_slots=2).check(sparse=True, adapters=2, batch=4)
