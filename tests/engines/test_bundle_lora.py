"""A bundle built with --lora-slots N --lora-max-rank R serves per-request LoRA adapters (issue 38 item 1, compiled):
its block_lora segment takes the slot banks as inputs, so an adapter is data. A request with adapters equals the eager
model with the same adapters, switching adapters compiles nothing, a request without adapters runs the plain block,
and every bad combination is one line naming the flag (or the field) and the fix.

Tolerance: test_engine.py's for fp32 bundles, the compiled DiT within a relative error (norm) of 1e-5 of the eager DiT
(here the eager DiT with the same adapters in its own slots), while the adapters move the output by > 100 x that.

"Bit-identical to a bundle built without slots": a request without adapters (or with every adapter at scale 0) runs
the same `block` segment (compiled from the same spec and example inputs as a bundle without slots compiles it:
test_the_manifest_records...) through the runner a bundle without slots builds, and test_a_request_without_adapters_...
shows that runner's output equal bit for bit, with adapters loaded in the slots or not, and block_lora never called.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import BUNDLE_STEPS, SLOT_BUNDLE, dit_inputs
from lora_cases import fmt_original, tiny_factors, write
from h3trt.adapters.merge import LoraSpec
from h3trt.adapters.resident import ResidentAdapters
from h3trt.adapters.slots import BLOCK_TARGETS, segment_lora_names
from h3trt.adapters.spec import AdapterSpec
from h3trt.adapters.use import AdapterUse
from h3trt.build.config import BuildConfig
from h3trt.build.segments import dit_segments
from h3trt.cli import main
from h3trt.engines.adaln import load_adaln
from h3trt.engines.bundle import Engine, EngineDiT
from h3trt.engines.guard import no_compile
from h3trt.engines.loaders import load_weights
from h3trt.engines.manifest import AdapterSlotsRecord, content_sha256, read_manifest
from h3trt.errors import UserError
from h3trt.jobs.admission import admit
from h3trt.jobs.model_source import Entry, ModelSource
from h3trt.models.checkpoint.reader import load_dit
from h3trt.models.dit import EagerDiT
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.runner import EvalExtras
from h3trt.models.sampler import Schedule
from h3trt.request.fields import KEY_WORDS as KEYS
from h3trt.request.request import Request

REL_TOL = 1e-5  # test_engine.py's compiled-vs-eager bound for fp32 bundles
SLOTS, MAX_RANK = 2, 4
PROMPT = "a red fox runs through snow"


@pytest.fixture(scope="module")
def slot_bundle(bundle_cache):
    """The fp32 CPU inductor bundle of conftest's `bundles` (160x96x5, BUNDLE_STEPS) with 2 slots of rank <= 4, and
    a second schedule baked (conftest's SLOT_BUNDLE, shared with test_turbo.py; BUNDLE_STEPS is its default)."""
    built = bundle_cache.get(*SLOT_BUNDLE)
    assert f"{SLOTS} LoRA slot(s) of rank <= {MAX_RANK}" in built.stdout, built.stdout
    return built.path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Adapters a and b (rank 4; 2 on AdaLN), one of rank 8 (over the slots' 4), one on the embedding too."""
    folder = tmp_path_factory.mktemp("adapters")
    big = {m: (torch.cat([d, d]), torch.cat([u, u], 1) / 2) for m, (d, u) in tiny_factors(3).items()}
    outside = dict(tiny_factors(4))
    outside["condition_proj"] = (torch.randn(2, 48), torch.randn(64, 2))  # not a main block linear
    return {"a": write(folder / "a.safetensors", fmt_original(tiny_factors(1))),
            "b": write(folder / "b.safetensors", fmt_original(tiny_factors(2))),
            "big": write(folder / "big.safetensors", fmt_original(big)),
            "outside": write(folder / "outside.safetensors", fmt_original(outside))}


def _inputs(cfg, schedule: Schedule, step: int):
    layout = pack_t2va(text_tags_for(11), 7, 6, 10, 23)  # another text length than the build example
    unique_t, t_index = row_timesteps(layout, *schedule.timesteps()[step])
    return (*dit_inputs(layout, cfg), unique_t, t_index, layout)


def _schedule(manifest) -> Schedule:
    s = manifest.schedule
    return Schedule(s.steps, s.video_shift, s.audio_shift)


def test_the_manifest_records_the_slots_and_the_block_lora_twin(slot_bundle):
    m = read_manifest(slot_bundle)
    assert m.lora_slots == AdapterSlotsRecord(SLOTS, MAX_RANK, BLOCK_TARGETS)
    twin, block = m.segments["block_lora"], m.segments["block"]
    assert twin["inputs"] == block["inputs"] + ["lora_rows", "lora_row_scales"] and twin["weights"] == block["weights"]
    assert twin["dynamic"]["lora_rows"] == {"0": "G"}  # any adapter set, one compiled twin
    assert twin["lora"] == segment_lora_names(BLOCK_TARGETS) and "adaln_proj.linear.lora_down" not in twin["lora"]
    # Every other segment is recorded as a bundle without slots records it (same spec: the same inputs and weights).
    plain = {s.name: s for s in dit_segments(m.model_config, torch.float32)}
    for name, spec in plain.items():
        assert (m.segments[name]["inputs"], m.segments[name]["weights"]) == (spec.inputs, spec.weights)
        assert "lora" not in m.segments[name]
    # The banks are not stored: zeros until an adapter loads, allocated by the load.
    with safe_open(str(slot_bundle / "weights" / "blocks.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "lora" in k]
    engine = Engine.load(slot_bundle, "cpu")
    assert engine.dit.lora_slots.num_slots == SLOTS and engine.dit.lora_slots.max_rank == MAX_RANK
    assert all(not t.any() for pair in engine.dit.lora_slots.banks.values() for t in pair)


def test_bundle_adapters_equal_the_eager_adapters_and_switching_them_compiles_nothing(slot_bundle, files, tiny_root):
    engine = Engine.load(slot_bundle, "cpu")
    m = engine.manifest
    specs = (AdapterSpec("a", files["a"], 0.7), AdapterSpec("b", files["b"]))
    bundle_side = ResidentAdapters(specs, m.model_config, m.task, torch.float32, torch.device("cpu"),
                                   slots=engine.dit.lora_slots)
    eager = EagerDiT(load_dit(tiny_root, "t2va", torch.float32)[0])
    eager_side = ResidentAdapters(specs, m.model_config, m.task, torch.float32, torch.device("cpu"))
    schedule = _schedule(m)
    sets = [(AdapterUse("a"),), (AdapterUse("b", 1.3),), (AdapterUse("a", 0.4), AdapterUse("b")), (AdapterUse("a"),)]
    with torch.no_grad(), no_compile():  # the guard: any compile while adapters switch raises
        for step in (0, 3):  # the first evaluation (one distinct t) and a later one
            args = _inputs(m.model_config, schedule, step)
            plain = engine.dit(*args)
            for uses in sets:  # switched between evaluations, back and forth
                got = engine.dit(*args, EvalExtras(adapters=bundle_side.select(uses)))
                want = eager(*args, EvalExtras(adapters=eager_side.select(uses)))
                for g, w, p in zip(got, want, plain):
                    err = ((g - w).norm() / w.norm()).item()
                    assert err <= REL_TOL, f"relative error {err:.2e} with {uses} at step {step}"
                    assert ((w - p).norm() / p.norm()).item() > 100 * REL_TOL  # the adapters really moved it


def test_a_request_without_adapters_is_the_plain_runner_bit_for_bit(slot_bundle, files):
    """The runner a bundle without slots builds, over this bundle's `block`, weights and tables, gives the same bits
    as this bundle's runner given no adapters: with the slots empty, and with adapters loaded in them."""
    engine = Engine.load(slot_bundle, "cpu")
    m, dit = engine.manifest, engine.dit
    entries = {k: v for k, v in m.segments.items() if not k.endswith("_lora")}
    weights = {n: load_weights(slot_bundle / "weights" / f"{n}.safetensors", torch.device("cpu"))
               for n in ("embed", "blocks", "final")}
    without_slots = EngineDiT(m.model_config, {k: dit.segments[k] for k in entries}, entries, weights,
                              load_adaln(slot_bundle, m, m.model_config, torch.device("cpu")), torch.device("cpu"))
    calls = {"block": 0, "block_lora": 0}
    for name in calls:
        segment = dit.segments[name]
        dit.segments[name] = lambda *a, _s=segment, _n=name: (calls.__setitem__(_n, calls[_n] + 1), _s(*a))[1]
    args = _inputs(m.model_config, _schedule(m), 2)
    with torch.no_grad(), no_compile():
        want = without_slots(*args)
        empty = dit(*args)
        ResidentAdapters((AdapterSpec("a", files["a"]), AdapterSpec("b", files["b"])), m.model_config, m.task,
                         torch.float32, torch.device("cpu"), slots=dit.lora_slots)
        loaded = dit(*args)
        # Adapters named at scale 0 add nothing: not computed at all, the plain block runs (issue 44).
        zero = dit(*args, EvalExtras(adapters=dit.lora_slots.select([(0, 0.0), (1, 0.0)])))
        assert calls == {"block": 3 * m.model_config.num_layers, "block_lora": 0}
        dit(*args, EvalExtras(adapters=dit.lora_slots.select([(0, 1.0)])))
        assert calls["block_lora"] == m.model_config.num_layers  # the twin runs only for an evaluation with adapters
    for w, e, lo, z in zip(want, empty, loaded, zero):
        assert torch.equal(e, w) and torch.equal(lo, w) and torch.equal(z, w)


def test_build_flags_are_refused_in_one_line():
    cases = [({"lora_slots": 2}, "--lora-slots N and --lora-max-rank R go together"),
             ({"lora_max_rank": 8}, "go together"),
             ({"lora_slots": 0, "lora_max_rank": 8}, "--lora-slots must be a whole number >= 1"),
             ({"lora_slots": 2, "lora_max_rank": 8, "sp": 2}, r"--lora-slots is built for --sp 1 only"),
             ({"lora_slots": 2, "lora_max_rank": 8, "backend": "tensorrt", "device": "cuda"},
              "--lora-slots applies to the inductor and aoti backends")]
    for fields, words in cases:
        with pytest.raises(UserError, match=words) as e:
            BuildConfig(Path("model"), Path("out"), **fields)
        assert "\n" not in str(e.value)


def test_the_cli_refuses_a_bad_slot_count(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["build", "--model", "tiny", "--output", str(tmp_path / "b"), "--lora-slots", "0", "--lora-max-rank", "4"])
    assert e.value.code == 2 and "--lora-slots: takes a whole number of at least 1" in capsys.readouterr().err


def _without_slots(slot_bundle: Path, root: Path) -> Path:
    """A bundle's manifest as a build without --lora-slots writes it (the record and the twin left out, rehashed):
    what an Entry and admission read."""
    data = json.loads((slot_bundle / "manifest.json").read_text())
    del data["lora_slots"], data["segments"]["block_lora"]
    data["manifest_sha256"] = content_sha256(data)
    root.mkdir()
    (root / "manifest.json").write_text(json.dumps(data))
    return root


def test_adapters_a_bundle_cannot_hold_are_refused_before_any_model_loads(slot_bundle, files, tmp_path, capsys,
                                                                        no_model_load):
    spec = {n: AdapterSpec(n, p) for n, p in files.items()}
    cases = [((spec["big"],), (), "--adapter big=.*: rank 8, over this bundle's --lora-max-rank 4; rebuild it with "
                                  r"h3trt build \.\.\. --lora-max-rank 8"),
             ((spec["a"],), (LoraSpec(files["a"]), LoraSpec(files["b"])),
              r"--lora: 2 file\(s\) held on every request, but this bundle has 2 LoRA slot\(s\), and --adapter needs "
              "one more.* --lora-slots 3"),
             ((spec["outside"],), (), "adapts condition_proj, which this bundle's slots do not hold"),
             ((), (LoraSpec(files["big"]),), "--lora .*big.safetensors: rank 8, over")]
    for adapters, loras, words in cases:
        with pytest.raises(UserError, match=words) as e:
            Entry.local(ModelSource.resolve(engine=slot_bundle, loras=loras), "cpu", adapters)
        assert "\n" not in str(e.value)
    plain = _without_slots(slot_bundle, tmp_path / "plain")
    for adapters, loras in (((spec["a"],), ()), ((), (LoraSpec(files["a"]),))):
        with pytest.raises(UserError, match="built without LoRA slots.*--lora-slots N --lora-max-rank R"):
            Entry.local(ModelSource.resolve(engine=plain, loras=loras), "cpu", adapters)
    with pytest.raises(UserError, match="lora: this bundle was built without LoRA slots") as e:
        admit(Entry.local(ModelSource.resolve(engine=plain), "cpu"), Request.of(PROMPT, lora=(AdapterUse("a"),)), KEYS)
    assert e.value.field == "lora"
    # The CLI: exit 2, one line, nothing loaded (no_model_load).
    out = tmp_path / "clip.mp4"
    assert main(["run", "--engine", str(slot_bundle), "--adapter", f"big={files['big']}", "--prompt", PROMPT,
                 "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--lora-max-rank 4" in err[0] and not out.exists()


def test_adapters_with_sparse_attention_are_refused_only_for_the_sparse_attention_it_lacks(slot_bundle, files,
                                                                                             tmp_path, capsys):
    """This bundle was built without --sparse-attention: a request with adapters and sparse attention is admitted as
    far as its adapters go (a bundle with the halves serves both: test_sparse_lora_bundle.py), and refused, as the
    same request without adapters is, for the sparse attention: one line naming the rebuild, not the adapters."""
    entry = Entry.local(ModelSource.resolve(engine=slot_bundle), "cpu", (AdapterSpec("a", files["a"]),))
    admit(entry, Request.of(PROMPT, steps=BUNDLE_STEPS, lora=(AdapterUse("a"),)), KEYS)  # dense: admitted
    # Sparse, with or without adapters: this bundle has no halves, so its caps refuse the sparse attention before
    # anything loads (engines/caps.py), naming the rebuild, not the adapters
    for lora in ((), (AdapterUse("a"),)):
        with pytest.raises(UserError, match="built without --sparse-attention.*--sparse-attention 0") as e:
            admit(entry, Request.of(PROMPT, steps=BUNDLE_STEPS, sparse_attention=0.5, lora=lora), KEYS)
        assert e.value.field == "sparse_attention"
    out = tmp_path / "clip.mp4"
    assert main(["run", "--engine", str(slot_bundle), "--lora", str(files["a"]), "--prompt", PROMPT,
                 "--sparse-attention", "0.5", "--output", str(out), "--quiet"]) == 2  # --lora: unmerged, in a slot
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "built without --sparse-attention" in err[0] and "--sparse-attention 0" in err[0]
    assert not out.exists()


def test_run_serves_adapters_per_request_and_lora_on_every_request(slot_bundle, files, tmp_path):
    from h3trt.media.inputs import read_video

    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(json.dumps({"id": i, "task": "t2va", "prompt": PROMPT, **extra}) for i, extra in (
        ("a", {"lora": [{"name": "a", "scale": 0.7}]}), ("plain", {}))) + "\n")
    assert main(["run", "--engine", str(slot_bundle), "--requests", str(batch), "--out-dir", str(tmp_path / "out"),
                 "--adapter", f"a={files['a']}", "--adapter", f"b={files['b']}:0.5", "--quiet"]) == 0
    records = {i: json.loads((tmp_path / "out" / f"{i}.json").read_text()) for i in ("a", "plain")}
    assert [(r["name"], r["scale"]) for r in records["a"]["adapters"]] == [("a", 0.7)]
    assert records["plain"].get("adapters") is None
    # --lora FILE:0.7 on a bundle with slots: the same adapter, unmerged, on every request (here one).
    out = tmp_path / "lora.mp4"
    assert main(["run", "--engine", str(slot_bundle), "--lora", f"{files['a']}:0.7", "--prompt", PROMPT,
                 "--output", str(out), "--quiet"]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert [(r["name"], r["file"], r["scale"]) for r in record["adapters"]] == [("--lora", "a.safetensors", 0.7)]
    frames = {k: read_video(p)[0] for k, p in (("a", tmp_path / "out" / "a.mp4"), ("lora", out),
                                                    ("plain", tmp_path / "out" / "plain.mp4"))}
    assert (frames["a"] == frames["lora"]).all() and not (frames["a"] == frames["plain"]).all()
    shutil.rmtree(tmp_path / "out")


def test_a_bundle_serves_the_servers_changing_set_through_its_slots(slot_bundle, files, tmp_path):
    """`serve --engine B --lora-dir DIR`: the catalog has the bundle's slots (count, rank, targets from its manifest),
    an adapter loaded while it serves is resolved at admission and loaded on demand into the bundle's banks, more
    adapters than slots take turns (least recently used out), and a file the slots cannot hold is a 400 on `file`."""
    from h3trt.pipeline.loading import load_bundle

    folder = tmp_path / "loras"
    folder.mkdir()
    shutil.copy(files["a"], folder / "a.safetensors")
    entry = Entry.local(ModelSource.resolve(engine=slot_bundle), "cpu", folder=folder)
    catalog = entry.adapter_catalog()
    assert (catalog.shape.num_slots, catalog.shape.max_rank) == (SLOTS, MAX_RANK)
    assert catalog.shape.targets == read_manifest(slot_bundle).lora_slots.targets
    for name in ("b", "big"):
        shutil.copy(files[name], folder / f"{name}.safetensors")
    catalog.load("b", "b.safetensors", 0.5)
    write(folder / "c.safetensors", fmt_original(tiny_factors(5)))
    catalog.load("c", "c.safetensors")  # a third file: more adapters than the bundle's two slots
    with pytest.raises(UserError, match="rank 8, over the slots' max rank 4") as e:
        catalog.load("big", "big.safetensors")
    assert e.value.field == "file"
    requests = [admit(entry, Request.of(PROMPT, steps=BUNDLE_STEPS, lora=(AdapterUse(n),)), KEYS,
                      adapters=catalog).request for n in ("a", "b", "c", "a")]
    assert [(u.scale, Path(u.file).name) for r in requests for u in r.adapters] == [
        (1.0, "a.safetensors"), (0.5, "b.safetensors"), (1.0, "c.safetensors"), (1.0, "a.safetensors")]
    assert load_bundle(slot_bundle, "cpu").adapters is None  # `run` without adapters: no slot cache at all
    served = load_bundle(slot_bundle, "cpu", serve_adapters=True).adapters  # as a server's rank: none at start
    assert served is not None and not served.slots.records
    used = []
    for request in requests:
        ((slot, _),) = served.select(request.adapters).uses
        used.append(slot)
        assert served.slots.records[slot].sha256 == request.adapters[0].sha256
        assert served.record(request.adapters)[0]["sha256"] == request.adapters[0].sha256
    assert used == [0, 1, 0, 1]  # c takes a's slot (least recently used), then a takes b's
