"""The typed request (h3trt/request/): its parts and their versioned JSON, its flat JSON (a record's `request`, and a
job row's request of before) read back, the admitted request and the one batch rule. Pure: no model, no file read
(milliseconds each)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from h3trt.adapters.use import AdapterUse
from h3trt.models.packing import Geometry
from h3trt.models.sampler import ScheduleValues
from h3trt.models.sparse.plan import SparseSettings
from h3trt.models.step_cache import StepCacheConfig
from h3trt.request.parse import RequestDefaults, parse_object
from h3trt.request.request import (VERSION, Admitted, BatchKey, Canvas, Guidance, Inputs, Request, ScheduleChoice,
                                   ScheduleFrom, Speed)

pytestmark = pytest.mark.unit

TURBO = AdapterUse("turbo", 0.8, "/loras/turbo.safetensors", "ab" * 32)
FULL = Request(Inputs("a fox", Path("first.png"), Path("last.png"), (), 7), Canvas(160, 96, 6.0),
               ScheduleChoice(8, 5.0, None, ScheduleFrom("adapter turbo", "adapter turbo", "default")),
               Guidance(1.0, None),
               Speed("balanced", StepCacheConfig("first-block", math.inf, max_skip_steps=3, warmup=4), 0.75, 10, 4096),
               (TURBO, AdapterUse("style")))
GEOMETRY = Geometry(96, 160, 141)


def test_a_request_and_an_admitted_request_survive_their_json():
    data = json.loads(json.dumps(FULL.to_json()))  # strict JSON: the infinite threshold is written as "inf"
    assert data["version"] == VERSION and data["speed"]["cache"]["threshold"] == "inf"
    assert Request.from_json(data) == FULL
    admitted = Admitted(FULL, GEOMETRY)
    assert Admitted.from_json(json.loads(json.dumps(admitted.to_json()))) == admitted


def test_another_version_is_refused_by_name():
    data = {**FULL.to_json(), "version": VERSION + 1}
    with pytest.raises(ValueError, match=f"a stored request of version {VERSION + 1}; this h3trt reads version"):
        Request.from_json(data)
    with pytest.raises(ValueError, match="admitted request of version None"):
        Admitted.from_json({"request": FULL.to_json(), "geometry": {}})


def test_a_parsed_request_and_its_flat_json(tmp_path):
    """A request as a front door parses it (its schedule from the adapter it names, its speed from a profile) is the
    typed request part by part, and its flat JSON (a record's `request`) reads back to it."""
    line = {"prompt": "a fox", "image": "first.png", "seed": 7, "resolution": "160x96", "duration": 6,
            "profile": "balanced", "sparse_dense_steps": 12, "sparse_min_seq": 64,
            "lora": [{"name": "turbo", "scale": 0.8}]}
    defaults = RequestDefaults(steps=50, adapter_schedules={"turbo": ScheduleValues(8, 5.0)})
    typed = parse_object(line, 1, tmp_path, ("prompt",), defaults).request
    assert typed.inputs == Inputs("a fox", tmp_path / "first.png", None, (), 7) and typed.task == "fl2va"
    assert typed.canvas == Canvas(160, 96, 6.0)
    assert typed.schedule == ScheduleChoice(8, 5.0, None, ScheduleFrom("adapter turbo", "adapter turbo", "default"))
    assert typed.speed.profile == "balanced" and typed.speed.cache.kind == "first-block"
    assert typed.speed.sparse == SparseSettings(0.75, 12, 64) and typed.adapters == (AdapterUse("turbo", 0.8),)
    record = json.loads(json.dumps(typed.flat()))  # a record's `request`, and its schedule's sources
    assert "schedule_from" not in record and record["lora"] == [{"name": "turbo", "scale": 0.8}]
    assert Request.from_flat({**record, "schedule_from": typed.schedule.origin.to_json()}) == typed


def test_the_flat_json_keeps_what_was_left_unstated():
    """A sparse knob left None runs its default (Speed.sparse) and stays None in the flat JSON, as the records written
    before the typed request have it (a batch compares a finished clip's record with its line's request)."""
    typed = Request.from_flat({"prompt": "a fox", "steps": 4, "sparse_attention": 0.5})
    assert typed.speed.sparse == SparseSettings(0.5, 10, 4096) and typed.schedule.origin is None
    assert typed.flat()["sparse_dense_steps"] is None and "lora" not in typed.flat()
    resolved = Request.from_flat({"prompt": "x", "steps": 4, "lora": [TURBO.to_json()]})
    assert resolved.adapters == (TURBO,)  # a job row's resolved adapters keep their file and hash


def test_equal_keys_for_requests_that_may_share_a_batched_denoise():
    def key(request: Request, geometry: Geometry = GEOMETRY) -> BatchKey | None:
        return Admitted(request, geometry).batch_key

    plain = dataclasses.replace(FULL, speed=Speed())
    other = dataclasses.replace(plain, inputs=dataclasses.replace(plain.inputs, prompt="a cat", seed=9))
    assert key(plain) == key(other) == BatchKey("fl2va", 96, 160, 141, 8, 5.0, None,
                                                (("turbo", 0.8, "ab" * 32), ("style", None)))
    # Another prompt and seed share the batch; another task or length does not.
    assert key(dataclasses.replace(plain, inputs=Inputs("a fox"))).task == "t2va"
    assert key(plain, Geometry(96, 160, 124)) != key(plain)
    reloaded = dataclasses.replace(plain, adapters=(dataclasses.replace(TURBO, sha256="cd" * 32), AdapterUse("style")))
    assert key(reloaded) != key(plain)  # the same name, another file
    assert key(dataclasses.replace(plain, adapters=(TURBO,))) != key(plain)  # another adapter set
    # What shares no evaluation is denoised alone: guidance's two branches, a step cache, sparse attention.
    assert key(dataclasses.replace(plain, guidance=Guidance(3.0, "blurry"))) is None
    assert key(FULL) is None and key(dataclasses.replace(plain, speed=Speed(sparse_attention=0.5))) is None
    assert key(dataclasses.replace(plain, speed=Speed(cache=StepCacheConfig("first-block", 0.1)))) is None


def test_a_requests_vsa_sparsity_travels_every_json_and_an_older_row_reads_the_models(tmp_path):
    """A FastH3-VSA request's vsa_sparsity (the field table's row, run's --vsa-sparsity) survives the versioned JSON a
    job row stores and the flat JSON a record keeps; a row or record written before the key existed reads None (the
    model's sparsity), and the flat JSON of a request that states none has no key (as records of before)."""
    typed = parse_object({"prompt": "a fox", "steps": 4, "vsa_sparsity": 0.5}, 1, tmp_path, ("prompt",),
                         RequestDefaults(steps=50)).request
    assert typed.speed.vsa_sparsity == 0.5
    assert Request.from_json(json.loads(json.dumps(typed.to_json()))) == typed
    assert typed.flat()["vsa_sparsity"] == 0.5 and Request.from_flat(typed.flat()).speed.vsa_sparsity == 0.5
    older = typed.to_json()
    del older["speed"]["vsa_sparsity"]
    assert Request.from_json(older).speed.vsa_sparsity is None
    assert "vsa_sparsity" not in FULL.flat() and Request.from_flat(FULL.flat()).speed.vsa_sparsity is None
