"""The DiT runner contract (models/runner.py): what one evaluation carries (`EvalExtras`) and what a runner serves
(`RunnerCaps`), checked before anything runs; every runner in the house under it; and a new per-evaluation feature
added end to end on the tiny model without editing h3trt (issue 48 step 3's demonstration)."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest
import torch

from h3trt.errors import UserError
from h3trt.models.runner import NO_EXTRAS, NO_SPARSE_KERNEL, EvalExtras, RunnerCaps

from helpers import REPO

pytestmark = pytest.mark.unit

PACKAGE = REPO / "h3trt"


def test_no_extras_is_a_plain_evaluation_and_extras_are_frozen():
    assert NO_EXTRAS == EvalExtras() and (NO_EXTRAS.cache, NO_EXTRAS.sparse, NO_EXTRAS.adapters) == (None, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        NO_EXTRAS.adapters = object()


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


# ----------------------------------------------------------------------------------------------------------------------
# Every runner in the house under one contract: found by what it is (a class whose __call__ takes a DiT evaluation's
# rows), so a new runner, or a new parameter on one of them, cannot slip past.

CONTRACT = ["self", "video", "audio", "text", "unique_t", "t_index", "layout", "extras"]
KNOWN_RUNNERS = {"EagerDiT", "UlyssesDiT", "EngineDiT", "TrtDiT", "_Runner", "StepRecorder", "StepHeadRunner"}


def _runner_classes() -> dict[str, tuple[str, ast.ClassDef, ast.FunctionDef]]:
    """{class name: (module path, class, its __call__)} of every h3trt class whose __call__ takes `unique_t`."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__call__" and "unique_t" in [
                        a.arg for a in item.args.args]:
                    found[node.name] = (str(path.relative_to(PACKAGE.parent)), node, item)
    return found


def _has_caps(cls: ast.ClassDef) -> bool:
    """A `caps` on the class (an attribute or a property), or set on every instance (`self.caps = ...`)."""
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef) and node.name == "caps":
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for t in targets:
            for leaf in ast.walk(t):
                if (isinstance(leaf, ast.Name) and leaf.id == "caps") or (
                        isinstance(leaf, ast.Attribute) and leaf.attr == "caps"
                        and isinstance(leaf.value, ast.Name) and leaf.value.id == "self"):
                    return True
    return False


def test_every_runner_takes_one_extras_value_and_says_its_caps():
    runners = _runner_classes()
    assert KNOWN_RUNNERS <= set(runners), f"the scan missed {KNOWN_RUNNERS - set(runners)}"
    for name, (path, cls, call) in runners.items():
        args = [a.arg for a in call.args.args]
        assert args == CONTRACT and not call.args.kwonlyargs and call.args.kwarg is None and call.args.vararg is None, (
            f"{path} {name}.__call__{args}: the runner contract is {CONTRACT} (models/runner.py)")
        assert ast.unparse(call.args.defaults[-1]) == "NO_EXTRAS", f"{path} {name}: extras defaults to NO_EXTRAS"
        assert _has_caps(cls), f"{path} {name} says no caps (models/runner.py RunnerCaps)"
    # The imported classes agree with the scan (the Protocol's own signature included).
    from h3trt.calibration.trajectories import _Runner
    from h3trt.engines.bundle import EngineDiT
    from h3trt.engines.tensorrt_runtime import TrtDiT
    from h3trt.eval import StepRecorder
    from h3trt.models.distilled.merge import StepHeadRunner
    from h3trt.models.dit import EagerDiT
    from h3trt.models.runner import DiTRunner
    from h3trt.parallel.ulysses import UlyssesDiT, forward_sp

    want = inspect.signature(DiTRunner.__call__)
    for cls in (EagerDiT, UlyssesDiT, EngineDiT, TrtDiT, _Runner, StepRecorder, StepHeadRunner):
        got = inspect.signature(cls.__call__)
        assert list(got.parameters) == list(want.parameters), cls
        assert got.parameters["extras"].default is NO_EXTRAS, cls
    assert list(inspect.signature(forward_sp).parameters)[-1] == "extras"


# ----------------------------------------------------------------------------------------------------------------------
# A new per-evaluation feature, end to end on the tiny model, without touching h3trt: one more EvalExtras field, a
# runner that reads it, and the pipeline's one place that builds a request's extras. Everything between (the unguided
# and guided denoisers, the step cache's per-branch contexts, the sparse run's counting, the recorder) passes it on,
# and the clip's record asks it for its part as it asks every feature (models/runner.py RecordPart).

@dataclasses.dataclass(frozen=True)
class Stamp:
    """The new feature's run over one request: here, the request's prompt, which the runner checks it got."""

    prompt: str

    def record_fields(self) -> dict:
        return {"stamp": {"prompt": self.prompt}}


@dataclasses.dataclass(frozen=True)
class StampedExtras(EvalExtras):
    stamp: Stamp | None = None


class StampReader:
    """A runner that reads the new field (its "support"), then runs the runner it wraps."""

    def __init__(self, inner):
        self.inner, self.cfg, self.caps, self.seen = inner, inner.cfg, inner.caps, []

    def __call__(self, video, audio, text, unique_t, t_index, layout, extras: EvalExtras = NO_EXTRAS):
        self.seen.append(extras)
        return self.inner(video, audio, text, unique_t, t_index, layout, extras)


def _stamped_pipeline(parts, runner):
    from h3trt.pipeline.h3_pipeline import H3Pipeline

    class StampedPipeline(H3Pipeline):
        def eval_extras(self, request, cache, sparse):
            base = super().eval_extras(request, cache, sparse)
            return StampedExtras(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                                 stamp=Stamp(request.inputs.prompt))

    return StampedPipeline.from_components(dataclasses.replace(parts, dit=runner), "cpu")


@pytest.mark.parametrize("guided", [False, True])
def test_a_new_extras_field_reaches_every_evaluation_of_every_branch(tiny_cache, guided):
    from h3trt.eval import StepRecorder
    from h3trt.jobs.model_source import Entry
    from h3trt.models.step_cache import StepCacheConfig
    from h3trt.pipeline.prepare import prepare
    from h3trt.request.request import Request

    entry = Entry.local(device="cpu")
    parts = entry.components("t2va")
    reader = StampReader(parts.dit)
    pipeline = _stamped_pipeline(parts, StepRecorder(reader))  # the recorder passes it on too
    guidance = {"guidance": 2.5, "negative_prompt": "blurry"} if guided else {}
    request = Request.of("a fox in the snow", steps=3, seed=2, cache=StepCacheConfig("first-block", 0.05),
                         sparse_attention=0.5, sparse_dense_steps=0, sparse_min_seq=1, **guidance)
    schedule, _, final = pipeline.denoise_request(prepare(request, entry.model.canvas))
    assert torch.isfinite(final.video).all()
    branches = ("cond", "uncond") if guided else ("cond",)
    assert len(reader.seen) == schedule.num_evaluations * len(branches)
    for extras in reader.seen:
        assert type(extras) is StampedExtras and extras.stamp == Stamp("a fox in the snow")
        assert extras.sparse is reader.seen[0].sparse is not None  # one run over the request's evaluations
        assert extras.adapters is None  # no adapters asked
    # Each branch its own step cache context, the new field beside it
    assert [e.cache.name for e in reader.seen] == [*branches] * schedule.num_evaluations
    assert reader.seen[0].sparse.report()["evaluations"] == schedule.num_evaluations  # both branches: one each


def test_a_bundles_caps_come_from_its_manifest():
    """What admission checks a bundle's requests against, before anything loads (engines/caps.py): a manifest's
    fields, each changed alone."""
    from types import SimpleNamespace

    from h3trt.adapters.checks import NO_LORA_SLOTS
    from h3trt.engines.caps import NO_SPARSE_HALVES, SHARDED_SPARSE_KERNEL, bundle_caps
    from h3trt.engines.manifest import AdapterSlotsRecord, SparseRecord
    from h3trt.models.vsa.plan import VsaServing, VsaSettings

    batched = {"block": {"inputs": ["x"], "dynamic": {"x": {"0": "B", "1": "S"}}}}
    plain = dict(sparse=None, lora_slots=None, vsa=None, backend="inductor", mesh=SimpleNamespace(sp=1),
                 segments=batched)

    def caps(**changed) -> RunnerCaps:
        return bundle_caps(SimpleNamespace(**{**plain, **changed}))

    assert caps() == RunnerCaps(None, NO_SPARSE_HALVES, adapter_problem=NO_LORA_SLOTS)
    sparse = SparseRecord(0.5, 1, 64, "fp8", 64, tile="m64n64w4s3")
    assert (caps(sparse=sparse).sparse_kernel, caps(sparse=sparse).sparse_tile) == ("fp8", "m64n64w4s3")
    assert caps(mesh=SimpleNamespace(sp=2)).sparse_kernel == SHARDED_SPARSE_KERNEL  # its halves, fa4 if it loads
    assert caps(backend="tensorrt").sparse_problem is None  # the plans fuse attention: NO_SPARSE_KERNEL's words
    vsa = VsaServing(VsaSettings(), "reference")
    assert caps(vsa=vsa).vsa == vsa and caps(vsa=vsa).sparse_kernel is None
    slots = AdapterSlotsRecord(3, 4, ("attn.qkv_proj",))
    assert (caps(lora_slots=slots).adapter_slots, caps(lora_slots=slots).adapter_problem) == (3, None)
    assert bundle_caps(SimpleNamespace(**{**plain, "lora_slots": slots}), pinned=1).adapter_slots == 2
    assert not caps(segments={"block": {"inputs": ["x"], "dynamic": {"x": {"1": "S"}}}}).batches
    with pytest.raises(UserError, match="this bundle serves no block-sparse attention") as e:
        caps().check(sparse=True, adapters=0)
    assert e.value.field == "sparse_attention"
    with pytest.raises(UserError, match="lora: this bundle was built without LoRA slots"):
        caps().check(sparse=False, adapters=1)


@pytest.mark.parametrize("guided", [False, True])
def test_a_new_extras_field_reaches_the_clips_record_as_every_feature_does(tiny_cache, tmp_path, guided):
    """The clip's record asks each member of the request's extras for its fields (pipeline/records.py clip_record):
    the new field's part is written (after the record's own fields, which do not name it yet) beside the step cache's
    and the sparse run's, each asked the same way."""
    from h3trt.jobs.model_source import Entry
    from h3trt.models.step_cache import StepCacheConfig
    from h3trt.pipeline.h3_pipeline import Target
    from h3trt.pipeline.prepare import prepare
    from h3trt.request.request import Request

    entry = Entry.local(device="cpu")
    parts = entry.components("t2va")
    reader = StampReader(parts.dit)
    pipeline = _stamped_pipeline(parts, reader)
    guidance = {"guidance": 2.5, "negative_prompt": "blurry"} if guided else {}
    request = Request.of("a fox in the snow", steps=3, seed=2, cache=StepCacheConfig("first-block", 0.05),
                         sparse_attention=0.5, sparse_dense_steps=0, sparse_min_seq=1, **guidance)
    clip = pipeline.generate(prepare(request, entry.model.canvas), Target(tmp_path / "clip.mp4"))
    written = clip.record.to_json()
    assert written["stamp"] == {"prompt": "a fox in the snow"} and list(written)[-1] == "stamp"
    extras = reader.seen[0]
    assert written["sparse_attention"] == extras.sparse.report()  # the same run the evaluations carried
    assert written["step_cache"] == extras.cache.cache.report()
    assert sorted(written["step_cache"]["branches"]) == (["cond", "uncond"] if guided else ["cond"])
    assert written["sparse_attention"]["evaluations"] == written["evaluations"]


def test_the_records_parts_write_their_own_fields_once():
    """pipeline/records.py feature_fields: a feature writes the record's feature fields or fields the record does not
    name; not a field of the record's own, nor one another feature wrote; a None writes nothing."""
    from h3trt.pipeline.records import FEATURE_FIELDS, KnownFields, feature_fields

    assert feature_fields([KnownFields({"step_cache": {"kind": "x"}, "adapters": None}), KnownFields({"new": 1})]) == (
        {"step_cache": {"kind": "x"}}, {"new": 1})
    assert set(FEATURE_FIELDS) == {"loras", "adapters", "distilled", "step_cache", "sparse_attention"}
    with pytest.raises(ValueError, match="two features write the clip record's 'new'"):
        feature_fields([KnownFields({"new": 1}), KnownFields({"new": 2})])
    with pytest.raises(ValueError, match="writes the clip record's 'prompt', which no feature writes"):
        feature_fields([KnownFields({"prompt": "another"})])
