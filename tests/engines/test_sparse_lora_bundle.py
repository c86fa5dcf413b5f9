"""A bundle built with both --sparse-attention and --lora-slots serves a request with adapters and sparse attention
on (issue 46 item 5): its sparse evaluations run the halves' twins with adapters (block_pre_lora, block_post_lora)
around the block-sparse attention, as its dense ones run block_lora, compiling nothing at the request.

Tolerance: the bundle is bf16 (its compute dtype), so the compiled DiT is held within a relative error (norm) of 1e-2
of the eager DiT, test_lora_layouts.py's bound for a compiled bf16 twin against its eager function (bf16's rounding
in other fusions: measured 7e-3 against the eager model with the adapter merged, where the plain sparse bundle is 5e-3
from its eager model), while the adapter moves the output by more than 10x that (measured 0.36).
"""

import json
from pathlib import Path

import pytest
import torch

from helpers import BUNDLE_STEPS, dit_inputs
from lora_cases import fmt_original, tiny_factors, write
from h3trt.adapters.merge import LoraSpec, merge_loras
from h3trt.adapters.resident import ResidentAdapters
from h3trt.adapters.slots import BLOCK_TARGETS, LORA_INPUTS, segment_lora_names
from h3trt.adapters.spec import AdapterSpec
from h3trt.adapters.use import AdapterUse
from h3trt.build.config import BuildConfig
from h3trt.cli import main
from h3trt.engines.adaln import load_adaln
from h3trt.engines.bundle import Engine, EngineDiT
from h3trt.engines.guard import no_compile
from h3trt.engines.loaders import load_weights
from h3trt.engines.manifest import content_sha256, read_manifest
from h3trt.errors import UserError
from h3trt.jobs.admission import admit
from h3trt.jobs.model_source import Entry, ModelSource
from h3trt.media.inputs import read_video
from h3trt.models.checkpoint.reader import load_dit
from h3trt.models.dit import EagerDiT
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.runner import EvalExtras
from h3trt.models.sampler import Schedule
from h3trt.models.sparse.plan import sparse_settings
from h3trt.models.sparse.run import SparseRun
from h3trt.request.fields import KEY_WORDS as KEYS
from h3trt.request.request import Request

BF16_TOL = 1e-2  # test_lora_layouts.py's compiled-vs-eager bound for bf16 twins
SCALE = 0.7
PROMPT = "a red fox runs through snow"
TWINS = ("block_pre_lora", "block_post_lora")
# Every evaluation sparse (none dense first, any length), half the key blocks skipped.
SPARSE_SLOT_BUNDLE = ("--precision", "bf16", "--profile", "160x96x5", "--steps", str(BUNDLE_STEPS),
                      "--sparse-attention", "0.5", "--sparse-dense-steps", "0", "--sparse-min-seq", "1",
                      "--lora-slots", "1", "--lora-max-rank", "4")


@pytest.fixture(scope="module")
def sparse_slot_bundle(bundle_cache):
    """The tiny model's bf16 CPU inductor bundle with sparse attention (its default 0.5) and one slot of rank <= 4."""
    built = bundle_cache.get(*SPARSE_SLOT_BUNDLE)
    assert "sparse attention reference (default sparsity 0.5)" in built.stdout, built.stdout
    assert "1 LoRA slot(s) of rank <= 4" in built.stdout, built.stdout
    return built.path


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """A rank-4 adapter on every main block linear (rank 2 on AdaLN) of the tiny model."""
    return write(tmp_path_factory.mktemp("adapter") / "a.safetensors", fmt_original(tiny_factors(1)))


def _inputs(cfg, manifest, step: int):
    layout = pack_t2va(text_tags_for(11), 37, 6, 10, 207)  # another text length than the build example
    s = manifest.schedule
    unique_t, t_index = row_timesteps(layout, *Schedule(s.steps, s.video_shift, s.audio_shift).timesteps()[step])
    video, audio, text = dit_inputs(layout, cfg)
    return video, audio, text.to(torch.bfloat16), unique_t, t_index, layout


def _sparse() -> SparseRun:
    run = SparseRun(sparse_settings(0.5, 0, 1), "reference")
    run.next_evaluation()
    return run


def _counted(dit, names) -> dict:
    calls = dict.fromkeys(names, 0)
    for name in names:
        segment = dit.segments[name]
        dit.segments[name] = lambda *a, _s=segment, _n=name: (calls.__setitem__(_n, calls[_n] + 1), _s(*a))[1]
    return calls


def _rel(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_the_build_compiles_the_halves_twins_beside_the_halves(sparse_slot_bundle):
    m = read_manifest(sparse_slot_bundle)
    for half, twin in zip(("block_pre", "block_post"), TWINS):
        plain, entry = m.segments[half], m.segments[twin]
        assert entry["inputs"] == plain["inputs"] + list(LORA_INPUTS) and entry["weights"] == plain["weights"]
        assert entry["dynamic"]["lora_rows"] == {"0": "G"}  # any adapter set, one compiled twin
    pre, post = (m.segments[t]["lora"] for t in TWINS)
    assert pre == ["attn.qkv_proj.lora_down", "attn.qkv_proj.lora_up"]
    assert pre + post == m.segments["block_lora"]["lora"] == segment_lora_names(BLOCK_TARGETS)


def test_a_sparse_evaluation_with_an_adapter_equals_the_eager_model_with_it_merged(sparse_slot_bundle, adapter,
                                                                                   tiny_root):
    """Sparse and adapted at once: the halves' twins, never the plain halves or the fused block, under the
    no-compile guard; the eager DiT with the adapter merged into its weights at the same strength, routed the same
    (the same blocks kept), is the reference."""
    engine = Engine.load(sparse_slot_bundle, "cpu")
    m, dit = engine.manifest, engine.dit
    bundle_side = ResidentAdapters((AdapterSpec("a", adapter, SCALE),), m.model_config, m.task, torch.bfloat16,
                                   torch.device("cpu"), slots=dit.lora_slots)
    base = EagerDiT(load_dit(tiny_root, "t2va", torch.bfloat16)[0], "reference")
    merged_model = load_dit(tiny_root, "t2va", torch.bfloat16)[0]
    merge_loras(merged_model, [LoraSpec(adapter, SCALE)], "t2va")
    merged = EagerDiT(merged_model, "reference")
    calls = _counted(dit, ("block", "block_lora", "block_pre", "block_post", *TWINS))
    layers = m.model_config.num_layers
    with torch.no_grad(), no_compile():
        for step in (0, 3):  # the first evaluation (one distinct t) and a later one
            args = _inputs(m.model_config, m, step)
            runs = [_sparse() for _ in range(3)]
            got = dit(*args, EvalExtras(sparse=runs[0], adapters=bundle_side.select((AdapterUse("a"),))))
            want, plain = merged(*args, EvalExtras(sparse=runs[1])), base(*args, EvalExtras(sparse=runs[2]))
            reports = [r.report() for r in runs]
            assert reports[0] == reports[1] == reports[2] and 0 < reports[0]["kept_fraction"] < 1
            for g, w, p in zip(got, want, plain):
                err = _rel(g, w)
                assert err <= BF16_TOL, f"relative error {err:.2e} at step {step}"
                assert _rel(w, p) > 10 * BF16_TOL  # the adapter really moved it
    assert calls == {"block": 0, "block_lora": 0, "block_pre": 0, "block_post": 0, **dict.fromkeys(TWINS, 2 * layers)}


def test_without_adapters_it_is_the_plain_sparse_bundle_bit_for_bit(sparse_slot_bundle, adapter):
    """The runner a sparse bundle without slots builds, over this bundle's halves, weights and tables, gives the same
    bits as this bundle's runner given no adapters (or one at scale 0), with the adapter loaded in the slot; the
    twins never run. A runner over an earlier h3trt's entries (halves without twins) refuses a sparse evaluation
    with adapters rather than run it without them."""
    engine = Engine.load(sparse_slot_bundle, "cpu")
    m, dit = engine.manifest, engine.dit
    entries = {k: v for k, v in m.segments.items() if not k.endswith("_lora")}
    weights = {n: load_weights(sparse_slot_bundle / "weights" / f"{n}.safetensors", torch.device("cpu"))
               for n in ("embed", "blocks", "final")}
    adaln = load_adaln(sparse_slot_bundle, m, m.model_config, torch.device("cpu"))
    without_slots = EngineDiT(m.model_config, {k: dit.segments[k] for k in entries}, entries, weights, adaln,
                              torch.device("cpu"), sparse_kernel="reference")
    ResidentAdapters((AdapterSpec("a", adapter),), m.model_config, m.task, torch.bfloat16, torch.device("cpu"),
                     slots=dit.lora_slots)
    calls = _counted(dit, TWINS)
    args = _inputs(m.model_config, m, 2)
    with torch.no_grad(), no_compile():
        want = without_slots(*args, EvalExtras(sparse=_sparse()))
        for got in (dit(*args, EvalExtras(sparse=_sparse())),
                    dit(*args, EvalExtras(sparse=_sparse(), adapters=dit.lora_slots.select([(0, 0.0)])))):
            assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert calls == dict.fromkeys(TWINS, 0)
    earlier = {k: v for k, v in m.segments.items() if k not in TWINS}
    old = EngineDiT(m.model_config, {k: dit.segments[k] for k in earlier}, earlier, weights, adaln,
                    torch.device("cpu"), sparse_kernel="reference", lora_slots=dit.lora_slots)
    with torch.no_grad(), pytest.raises(ValueError, match="halves have no twin with adapters"):
        old(*args, EvalExtras(sparse=_sparse(), adapters=dit.lora_slots.select([(0, 1.0)])))


def _earlier_bundle(bundle: Path, root: Path) -> Path:
    """The bundle as an earlier h3trt wrote it for admission (its manifest without the halves' twins, rehashed; its
    other files linked: admission reads the text encoder's)."""
    data = json.loads((bundle / "manifest.json").read_text())
    for twin in TWINS:
        del data["segments"][twin]
    data["manifest_sha256"] = content_sha256(data)
    root.mkdir()
    (root / "manifest.json").write_text(json.dumps(data))
    for child in bundle.iterdir():
        if child.name != "manifest.json":
            (root / child.name).symlink_to(child)
    return root


def test_admission_admits_adapters_with_sparse_attention_and_refuses_an_earlier_bundle(sparse_slot_bundle, adapter,
                                                                                        tmp_path):
    specs = (AdapterSpec("a", adapter),)
    entry = Entry.local(ModelSource.resolve(engine=sparse_slot_bundle), "cpu", specs)
    both = [Request.of(PROMPT, steps=BUNDLE_STEPS, sparse_attention=s, lora=(AdapterUse("a"),)) for s in (0.5, 0.75)]
    for request in both:
        admit(entry, request, KEYS)
    old = Entry.local(ModelSource.resolve(engine=_earlier_bundle(sparse_slot_bundle, tmp_path / "old")), "cpu", specs)
    admit(old, Request.of(PROMPT, steps=BUNDLE_STEPS, sparse_attention=0, lora=(AdapterUse("a"),)), KEYS)  # dense
    admit(old, Request.of(PROMPT, steps=BUNDLE_STEPS), KEYS)  # sparse, no adapters
    for request in both:
        with pytest.raises(UserError, match="built by an earlier h3trt.*rebuild it with this h3trt.*--sparse-attention "
                                            "S --lora-slots N.*or pass sparse_attention 0") as e:
            admit(old, request, KEYS)
        assert e.value.field == "lora" and "\n" not in str(e.value)


def test_a_served_clip_runs_its_adapter_on_every_sparse_evaluation(sparse_slot_bundle, adapter, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(json.dumps({"id": i, "task": "t2va", "prompt": PROMPT, **extra}) for i, extra in (
        ("a", {"lora": [{"name": "a", "scale": SCALE}]}), ("plain", {}))) + "\n")
    out = tmp_path / "out"
    assert main(["run", "--engine", str(sparse_slot_bundle), "--requests", str(batch), "--out-dir", str(out),
                 "--adapter", f"a={adapter}", "--quiet"]) == 0
    records = {i: json.loads((out / f"{i}.json").read_text()) for i in ("a", "plain")}
    assert [(r["name"], r["scale"]) for r in records["a"]["adapters"]] == [("a", SCALE)]
    assert records["plain"].get("adapters") is None
    for record in records.values():  # every evaluation sparse, adapted or not
        sparse = record["sparse_attention"]
        assert sparse["sparsity"] == 0.5 and sparse["sparse_evaluations"] == list(range(BUNDLE_STEPS - 1))
    assert not (read_video(out / "a.mp4")[0] == read_video(out / "plain.mp4")[0]).all()


@pytest.mark.parametrize("fields, words", [
    # TensorRT fuses attention in its plans and takes no slot banks: build with --backend inductor.
    ({"backend": "tensorrt", "device": "cuda"}, "--sparse-attention applies to the inductor and aoti backends.*"
                                                "--backend inductor"),
    # The sharded halves have no twins with adapters: build --sp 1.
    ({"sp": 2}, r"--lora-slots is built for --sp 1 only.*Build --sp 1"),
])
def test_what_still_cannot_go_with_both_is_one_line_naming_the_fix(fields, words):
    with pytest.raises(UserError, match=words) as e:
        BuildConfig(Path("model"), Path("out"), tiny=True, sparse_attention=0.5, lora_slots=1, lora_max_rank=4,
                    **fields)
    assert "\n" not in str(e.value)


def test_a_vsa_model_refuses_both_naming_its_own_sparsity_flag():
    config = BuildConfig(Path("model"), Path("out"), tiny=True, device="cpu", sparse_attention=0.5, lora_slots=1,
                         lora_max_rank=4)
    with pytest.raises(UserError, match="FastH3-VSA model.*--sparse-attention, --lora-slots cannot serve. Drop them; "
                                        "set its sparsity with --vsa-sparsity") as e:
        config.check_vsa(vsa_model=True)
    assert "\n" not in str(e.value)
