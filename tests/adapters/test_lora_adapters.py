"""Resident LoRA adapters picked per request (issue 38 items 2 and 4, the eager path; h3trt/adapters/): a
request with adapter A at scale s denoises as the model with A merged at s, a request without one is the model
without adapters bit for bit, every bad `lora` is refused before any work naming the field, batches never mix
adapter sets, and a server with two resident adapters gives each job its own.

Tolerance: the unmerged side branch (fp32, CPU) against the merged fp32 weights, through a whole denoise of the
embedded tiny model: max abs error <= ATOL on the final latents, while the adapter moves them by > 100 x that.
"""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from lora_cases import PROMPT, fmt_kohya, fmt_original, tiny_factors, write

from h3trt.adapters.merge import LoraSpec
from h3trt.adapters.spec import AdapterSpec
from h3trt.adapters.use import parse_lora_field
from h3trt.adapters.use import batch_key
from h3trt.adapters.use import AdapterUse
from h3trt.cli import main
from h3trt.errors import UserError
from h3trt.jobs.admission import admit
from h3trt.jobs.model_source import Entry, ModelSource
from h3trt.jobs.work import layout_key
from h3trt.pipeline.prepare import prepare
from h3trt.request.fields import KEY_WORDS as KEYS
from h3trt.request.parse import parse_object
from h3trt.request.request import Request

ATOL = 1e-5


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two adapters in two layouts: original names (alpha-less), kohya with alphas."""
    folder = tmp_path_factory.mktemp("adapters")
    a = write(folder / "a.safetensors", fmt_original(tiny_factors(1)))
    b = write(folder / "b.safetensors", fmt_kohya(tiny_factors(2), {"blocks.0.mlp.fc1": 2.0}))
    return a, b


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def denoised(entry: Entry, request: Request):
    pipe = entry.load("t2va")
    _, _, final = pipe.denoise_request(prepare(request, entry.model.canvas))
    return final


def test_a_request_with_an_adapter_equals_the_merged_model_and_one_without_is_the_plain_model(files, tiny_cache):
    a, b = files
    resident = Entry.local(device="cpu", adapters=(AdapterSpec("a", a, 0.5), AdapterSpec("b", b)))
    plain = denoised(Entry.local(device="cpu"), Request.of(PROMPT, steps=3))
    merged = denoised(Entry.local(ModelSource.resolve(loras=(LoraSpec(a, 0.7),)), "cpu"), Request.of(PROMPT, steps=3))
    picked = denoised(resident, Request.of(PROMPT, steps=3, lora=(AdapterUse("a", 0.7),)))
    for got, want, base in ((picked.video, merged.video, plain.video), (picked.audio, merged.audio, plain.audio)):
        assert (got - want).abs().max().item() <= ATOL
        assert (want - base).abs().max().item() > 100 * ATOL  # the adapter moved the latents far beyond ATOL
    # The default strength: scale left out is --adapter's (0.5), not 1.
    half = denoised(Entry.local(ModelSource.resolve(loras=(LoraSpec(a, 0.5),)), "cpu"), Request.of(PROMPT, steps=3))
    default = denoised(resident, Request.of(PROMPT, steps=3, lora=(AdapterUse("a"),)))
    assert (default.video - half.video).abs().max().item() <= ATOL
    # No adapter named: bit for bit the model started without adapters.
    none = denoised(resident, Request.of(PROMPT, steps=3))
    assert torch.equal(none.video, plain.video) and torch.equal(none.audio, plain.audio)


def test_the_request_field_reads_checks_and_writes_back(tmp_path):
    line = parse_object({"prompt": "p", "lora": [{"name": "a", "scale": 0.5}, {"name": "b"}]}, 1, tmp_path, ())
    assert line.request.adapters == (AdapterUse("a", 0.5), AdapterUse("b"))
    assert line.request.flat()["lora"] == [{"name": "a", "scale": 0.5}, {"name": "b"}]
    assert "lora" not in Request.of("p").flat()  # a request without adapters is written as before
    for bad, words in (("a", "list of"), ([{"name": 3}], "name a string"), ([{"name": "a", "scale": "1"}], "finite"),
                       ([{"name": "a", "scale": float("nan")}], "finite"),
                       ([{"name": "a", "scale": 10 ** 400}], "finite"), ([{"name": "a", "x": 1}], "name a string"),
                       ([{"name": "a"}, {"name": "a"}], "each adapter once")):
        with pytest.raises(UserError, match=words) as e:
            parse_lora_field(bad)
        assert e.value.field == "lora"


def test_admission_refuses_unknown_names_too_many_and_bundles_naming_lora(files, tiny_cache):
    a, b = files
    entry = Entry.local(device="cpu", adapters=(AdapterSpec("a", a),))
    admit(entry, Request.of(PROMPT, lora=(AdapterUse("a", 2.0),)), KEYS)  # admitted
    for uses, words in (((AdapterUse("zebra"),), r"\['zebra'\], not resident here; the resident adapters are \['a'\]"),
                        ((AdapterUse("a"), AdapterUse("b")), "asks for 2 adapters, but this model holds 1")):
        with pytest.raises(UserError, match=words) as e:
            admit(entry, Request.of(PROMPT, lora=uses), KEYS)
        assert e.value.field == "lora"
    with pytest.raises(UserError, match="holds 0 resident"):
        admit(Entry.local(device="cpu"), Request.of(PROMPT, lora=(AdapterUse("a"),)), KEYS)


def test_a_bundle_without_slots_refuses_adapters_in_one_line(files, monkeypatch):
    """(A bundle with slots serves them: tests/engines/test_bundle_lora.py, which also refuses them on a bundle
    without.)"""
    from h3trt.adapters.checks import check_adapters
    from h3trt.adapters.checks import NO_LORA_SLOTS

    with pytest.raises(UserError, match="built without LoRA slots, so it serves no per-request adapters; rebuild it "
                                        r"with h3trt build \.\.\. --lora-slots N --lora-max-rank R") as e:
        check_adapters((AdapterUse("a"),), (AdapterSpec("a", files[0]),), NO_LORA_SLOTS)
    assert e.value.field == "lora" and "\n" not in NO_LORA_SLOTS


def test_adapter_flag_parsing(tmp_path, capsys):
    assert AdapterSpec.parse("style=s.safetensors:0.8") == AdapterSpec("style", Path("s.safetensors"), 0.8)
    assert AdapterSpec.parse("s=dir:x/f.safetensors") == AdapterSpec("s", Path("dir:x/f.safetensors"), 1.0)
    for bad in ("noname.safetensors", "=f.safetensors", "a b=f", "a=f:inf"):
        with pytest.raises(UserError):
            AdapterSpec.parse(bad)
    with pytest.raises(UserError, match="given twice"):
        Entry.local(device="cpu", adapters=(AdapterSpec("a", Path(__file__)), AdapterSpec("a", Path(__file__))))
    with pytest.raises(UserError, match="no such file"):
        Entry.local(device="cpu", adapters=(AdapterSpec("a", tmp_path / "missing.safetensors"),))
    with pytest.raises(SystemExit) as e:
        main(["run", "--prompt", "p", "--output", str(tmp_path / "x.mp4"), "--adapter", "a=f:nan"])
    assert e.value.code == 2
    assert "argument --adapter: --adapter 'a=f:nan': the scale must be a finite number" in capsys.readouterr().err


def test_adapter_sets_split_batches(files, tiny_cache):
    """Requests with different adapters (or strengths) never share a batched evaluation: their batch keys differ,
    layout_key splits a batch that took them together anyway, and denoise_batch refuses a mixed one."""
    assert batch_key(()) == () and batch_key((AdapterUse("a", 1.0),)) != batch_key((AdapterUse("a", 0.5),))
    a, b = files
    entry = Entry.local(device="cpu", adapters=(AdapterSpec("a", a), AdapterSpec("b", b)))
    pipe = entry.load("t2va")
    encoded = [pipe.encode_request(prepare(Request.of(PROMPT, steps=2, lora=uses), entry.model.canvas))
               for uses in ((), (AdapterUse("a"),), (AdapterUse("b"),), (AdapterUse("a"),))]
    keys = [layout_key(e) for e in encoded]
    assert len(set(keys[:3])) == 3 and keys[1] == keys[3]
    plain = Entry.local(device="cpu").load("t2va").encode_request(prepare(Request.of(PROMPT, steps=2), entry.model.canvas))
    assert layout_key(plain) == keys[0]  # a request without adapters keys as before
    with pytest.raises(ValueError, match="one LoRA adapter set"):
        pipe.denoise_batch(encoded[:2])


def _lines(path: Path, lines: list) -> Path:
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_run_requests_picks_adapters_per_line_and_records_them(files, tmp_path, tiny_cache, capsys):
    a, b = files
    small = {"task": "t2va", "prompt": PROMPT, "resolution": "128x32", "steps": 2}
    lines = [{"id": "plain", **small}, {"id": "a", **small, "lora": [{"name": "a", "scale": 0.7}]},
             {"id": "b", **small, "lora": [{"name": "b"}]}]
    out = tmp_path / "out"
    assert main(["run", "--requests", str(_lines(tmp_path / "r.jsonl", lines)), "--out-dir", str(out),
                 "--device", "cpu", "--max-batch", "3", "--adapter", f"a={a}", "--adapter", f"b={b}:0.6"]) == 0
    records = {i: json.loads((out / f"{i}.json").read_text()) for i in ("plain", "a", "b")}
    assert "adapters" not in records["plain"] and "lora" not in records["plain"]["request"]
    assert records["a"]["adapters"] == [{"name": "a", "file": "a.safetensors", "sha256": sha256(a), "scale": 0.7}]
    assert records["b"]["adapters"] == [{"name": "b", "file": "b.safetensors", "sha256": sha256(b), "scale": 0.6}]
    assert len({r["mp4_sha256"] for r in records.values()}) == 3
    assert all(r["batch"]["size"] == 1 for r in records.values())  # three adapter sets: three evaluations
    # A bad lora field: one line per bad line, exit 2, nothing run.
    capsys.readouterr()
    bad = [{"id": "x", **small, "lora": [{"name": "zebra"}]}, {"id": "y", **small, "lora": [{"name": "a", "scale": None,
                                                                                            "w": 1}]}]
    assert main(["run", "--requests", str(_lines(tmp_path / "bad.jsonl", bad)), "--out-dir", str(tmp_path / "o2"),
                 "--device", "cpu", "--adapter", f"a={a}"]) == 2
    err = capsys.readouterr().err
    assert ":1: lora names ['zebra'], not resident here" in err and ":2: lora must be a list" in err
    assert len(err.strip().splitlines()) == 1


def test_one_prompt_with_an_adapter_says_how_to_apply_it(files, tmp_path, h3trt, no_model_load):
    """`run --prompt --adapter a=FILE` exited 0 with a plain clip (one prompt names no adapter): one line saying how,
    before any model loads."""
    code, err = h3trt("run", "--prompt", "p", "--output", str(tmp_path / "x.mp4"), "--adapter", f"a={files[0]}")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("h3trt: error: --adapter a=...: resident adapters run only for the requests that name")
    assert "pass --lora FILE[:SCALE] to apply a LoRA to this clip" in err[0]
    assert not (tmp_path / "x.mp4").exists()
