"""One requests schema for `run --requests` and `eval --requests`, the typed Manifest, the entry resolver and the CLI's
closed choices: pure parsing, no model, no compiler (milliseconds each)."""

from __future__ import annotations

import codecs
import json
import os
import threading
from pathlib import Path

import pytest

from h3trt.cli import main
from h3trt.engines.manifest import BundleError, Manifest, bundle_identity, content_sha256
from h3trt.models.precision import Precision
from h3trt.models.sampler import DEFAULT_SEED, DEFAULT_STEPS
from h3trt.run.batch_file import parse_requests
from h3trt.jobs.model_source import TINY_CANVAS, Entry, ModelSource
from h3trt.request.parse import (EVAL_REQUIRED, RUN_REQUIRED, RequestsFileError, read_eval_requests,
                                   read_request_file)

from stand_ins import manifest_dict

pytestmark = pytest.mark.unit


def _write(path, lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


# ---------------------------------------------------------------------------------------------------------------------
# One schema: a `run --requests` file evaluates as it is


def test_eval_takes_a_run_requests_file_with_id_and_task(tmp_path):
    (tmp_path / "first.png").write_bytes(b"")  # paths resolve against the file; eval reads them when it runs
    path = _write(tmp_path / "run.jsonl", [
        {"id": "fox", "task": "t2va", "prompt": "a red fox runs", "seed": 3},
        {"id": "key", "task": "fl2va", "prompt": "a fox", "image": "first.png", "resolution": "128x64"},
        {"prompt": "no id, the engine's canvas", "steps": 4},
    ])
    manifest = Manifest.from_dict(manifest_dict())
    fox, key, plain = read_eval_requests(path, manifest)
    assert (fox.inputs.prompt, fox.inputs.seed, fox.task, fox.schedule.steps, fox.canvas.width, fox.canvas.height,
            fox.canvas.duration) == (
        "a red fox runs", 3, "t2va", 8, 160, 96, 5.0)  # the engine's schedule and first profile
    assert key.task == "fl2va" and key.inputs.image == tmp_path / "first.png" and (key.canvas.width, key.canvas.height) == (128, 64)
    assert plain.inputs.seed == DEFAULT_SEED and plain.schedule.steps == 4
    # The same file runs as a batch (which needs the ids and tasks).
    assert [i.id for i in parse_requests(_write(tmp_path / "b.jsonl", [{"id": "fox", "task": "t2va",
                                                                         "prompt": "a fox"}]), TINY_CANVAS)] == ["fox"]


def test_a_bad_line_names_its_fault_not_a_missing_prompt(tmp_path):
    path = _write(tmp_path / "eval.jsonl", [
        {"prompt": "a fox", "sed": 3},
        {"seed": 3},
        {"prompt": "a fox", "task": "fl2va"},
        {"prompt": "a fox", "width": 128},
        {"prompt": "a fox", "id": "a/b"},
        {"prompt": "a fox", "steps": "8"},
    ])
    with pytest.raises(RequestsFileError) as err:
        read_request_file(path, EVAL_REQUIRED)
    lines = {n: next(e for e in str(err.value).split("; ") if f"eval.jsonl:{n}: " in e) for n in range(1, 7)}
    assert "unknown key(s) ['sed']" in lines[1] and "missing" not in lines[1]  # it has a prompt
    assert "missing ['prompt']" in lines[2]
    assert "task 'fl2va' takes image and/or last_image" in lines[3]
    assert "width and height go together" in lines[4]
    assert "id 'a/b' must be" in lines[5]
    assert 'steps must be an integer, got "8"' in lines[6]
    assert "6 bad line(s), nothing was run" in str(err.value)


def test_run_requires_id_and_task_eval_does_not(tmp_path):
    path = _write(tmp_path / "r.jsonl", [{"prompt": "a fox"}])
    assert [r.inputs.prompt for r in read_eval_requests(path, Manifest.from_dict(manifest_dict()))] == ["a fox"]
    with pytest.raises(RequestsFileError, match=r"r.jsonl:1: missing \['id', 'task'\]"):
        parse_requests(path, TINY_CANVAS)


def test_a_byte_order_mark_is_skipped(tmp_path):
    """Editors on Windows save UTF-8 with a byte-order mark; Python's JSON parser refuses it ("Unexpected UTF-8 BOM")."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(codecs.BOM_UTF8 + b'{"id": "a", "task": "t2va", "prompt": "caf\xc3\xa9"}\n'
                     b'{"id": "b", "task": "t2va", "prompt": "b"}\n')
    lines = read_request_file(path, RUN_REQUIRED)
    assert [(line.line, line.id, line.request.inputs.prompt) for line in lines] == [(1, "a", "caf\u00e9"), (2, "b", "b")]


def _pipe_path(content: bytes) -> str:
    """A real pipe, as `--requests <(...)` hands it over: /dev/fd/N of the read end, the writer done and closed."""
    read_fd, write_fd = os.pipe()
    os.write(write_fd, content)
    os.close(write_fd)
    return f"/dev/fd/{read_fd}"


def test_a_pipe_is_read_once_and_its_paths_are_relative_to_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _pipe_path(b'{"id": "k", "task": "fl2va", "prompt": "a fox", "image": "first.png"}\n')
    try:
        (line,) = read_request_file(Path(path), RUN_REQUIRED)
    finally:
        os.close(int(path.rsplit("/", 1)[1]))
    assert line.request.inputs.image == tmp_path / "first.png"

    fifo = tmp_path / "requests.fifo"  # a named pipe: read once too
    os.mkfifo(fifo)
    # The writer blocks until a reader opens the pipe: a daemon, so a reader that never opens it cannot hang pytest.
    writer = threading.Thread(target=fifo.write_bytes, args=(b'{"prompt": "a fox"}\n',), daemon=True)
    writer.start()
    assert [r.request.inputs.prompt for r in read_request_file(fifo, EVAL_REQUIRED)] == ["a fox"]
    writer.join(timeout=10)


def test_a_folder_or_missing_file_is_named(tmp_path):
    with pytest.raises(RequestsFileError, match="no such requests file"):
        read_request_file(tmp_path / "missing.jsonl", RUN_REQUIRED)
    with pytest.raises(RequestsFileError, match="is a folder"):
        read_request_file(tmp_path, RUN_REQUIRED)


# ---------------------------------------------------------------------------------------------------------------------
# The typed manifest


def test_manifest_reads_every_field_typed_and_keeps_the_raw_json():
    data = manifest_dict()
    m = Manifest.from_dict(data)
    assert m.raw is data and m.schedule.steps == 8 and m.schedule.audio_shift == 3.0  # an integer is a JSON number
    assert (m.mesh.sp, m.mesh.cfg, m.mesh.heads_per_rank) == (1, 1, 2) and m.adaln.baked and m.adaln.timesteps == 14
    assert m.profiles[0].num_frames == 124 and m.tasks == ("t2va", "fl2va") and m.device_type == "cpu"
    assert m.model_config.num_heads == 2 and m.files["weights/blocks.safetensors"].sha256_chunks == ("a" * 64,)
    assert m.total_bytes == 10 and m.quant is None and m.tensorrt is None
    assert m.precision is Precision.FP32 and m.vae_precision is Precision.FP32  # parsed once, here
    # The record's identity hashes the JSON as written, not this class.
    assert bundle_identity(m)["manifest_sha256"] == data["manifest_sha256"] == content_sha256(data)


@pytest.mark.parametrize("key, value, message", [
    ("schedule.steps", "fifty", "field 'schedule.steps' must be an integer, got \"fifty\""),
    ("schedule.video_shift", True, "field 'schedule.video_shift' must be a number, got true"),
    ("mesh.sp", 0, "field 'mesh.sp' must be an integer >= 1, got 0"),
    ("precision", "fp16", "field 'precision' must be one of ['bf16', 'fp32', 'fp8', 'nvfp4'], got \"fp16\""),
    ("backend", "onnx", "field 'backend' must be one of ['inductor', 'aoti', 'tensorrt']"),
    ("vae_precision", None, "field 'vae_precision' must be one of ['fp32', 'bf16', 'fp8'], got null"),
    ("tasks", ["t2v"], "field 'tasks' must be a non-empty list of ['t2va', 'fl2va', 'ref2va']"),
    ("adaln.baked", "yes", "field 'adaln.baked' must be true or false"),
    ("video_decoder", [], "field 'video_decoder' must be an object"),
    ("profiles", [], "field 'profiles' must be a non-empty list"),
    ("model_config.hidden_sizes", 3, "field 'model_config' is not a model config"),
])
def test_manifest_refuses_a_malformed_field_by_name(key, value, message):
    with pytest.raises(BundleError) as err:
        Manifest.from_dict(manifest_dict(**{key: value}), "b/manifest.json")
    assert str(err.value).startswith("b/manifest.json: ") and message in str(err.value)
    assert "rebuild" in str(err.value)


def test_manifest_refuses_a_missing_field():
    data = manifest_dict()
    del data["schedule"]
    with pytest.raises(BundleError, match="field 'schedule' must be an object, it is missing"):
        Manifest.from_dict(data)


# ---------------------------------------------------------------------------------------------------------------------
# The entry resolver and the CLI's closed choices


def test_entry_resolves_the_tiny_model_without_building_it():
    entry = Entry.local(device="cpu")
    model, launch = entry.model, entry.launch
    assert model.kind == "tiny" and model.path is None and model.tiny and model.canvas == TINY_CANVAS
    assert model.default_steps == DEFAULT_STEPS and model.model_name == "embedded-tiny" and model.record_extra == {}
    assert not launch.on_mesh and launch.world == 1 and launch.device_type == "cpu" and launch.first


def test_a_checkpoint_is_located_once_per_task(tiny_checkpoints, monkeypatch):
    """Admission asks for the component root on every request, the mesh and the worker spec for the heads: one
    model source reads the checkpoint's folders and configs once per task (an Entry used to locate it on each call)."""
    import h3trt.jobs.model_source as model_source

    calls, root = [], tiny_checkpoints["official"]

    def counted(path, task):
        calls.append(task)
        return locate(path, task)

    locate = model_source.locate_transformer
    monkeypatch.setattr(model_source, "locate_transformer", counted)
    entry = Entry.local(ModelSource.resolve(model=root), "cpu")
    for _ in range(3):
        assert entry.model.component_root("t2va") == locate(root, "t2va").component_root
        assert entry.model.config("t2va").num_heads == entry.worker_spec("t2va", entry.mesh("t2va")).num_heads
    entry.model.component_root("ref2va")
    assert calls == ["t2va", "ref2va"]


def test_entry_refuses_flags_that_do_not_fit_the_source(tmp_path):
    with pytest.raises(ValueError, match="--trust checks a bundle's signature; pass it with --engine"):
        ModelSource.resolve(model=tmp_path, trust=tmp_path / "k.pub")
    with pytest.raises(ValueError, match="--vae-precision must be one of"):
        ModelSource.resolve(vae_precision="fp16")
    with pytest.raises(BundleError, match="is not an h3trt bundle"):
        ModelSource.resolve(engine=tmp_path)


@pytest.mark.parametrize("flag, value", [("--precision", "bogus"), ("--backend", "onnx"), ("--task", "t2v")])
def test_build_refuses_an_unknown_choice_in_argparse(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["build", "--model", "tiny", "--output", str(tmp_path / "b"), flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: invalid choice: '{value}'" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
