"""Every bad input is one line, exit status 2, before any model loads, and leaves no file: seeds, non-UTF-8 text,
oversized images, outputs that are folders or under files, prompts over the token budget, durations, non-finite
guidance and shifts."""

import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from h3trt.cli import main
from h3trt.request.fields import MAX_PROMPT_TOKENS


def huge_png(path: Path, width=20000, height=20000) -> Path:
    """A PNG whose header claims width x height (the pixel data is a stub: the header is all a refusal may read)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def _one_line_refusal(capsys, argv, message, cwd: Path):
    before = sorted(p.name for p in cwd.rglob("*"))
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if "tiny default model" not in line]
    assert code == 2 and len(err) == 1 and err[0].startswith("h3trt: error: ") and message in err[0], (code, err)
    assert sorted(p.name for p in cwd.rglob("*")) == before  # nothing written, nothing left behind
    return err[0]


@pytest.mark.parametrize("extra, message", [
    (["--seed", str(2 ** 64)], "seed 18446744073709551616 is outside [-2^63, 2^64)"),
    (["--seed", str(-2 ** 63 - 1)], "is outside [-2^63, 2^64)"),
    (["--prompt", "a fox \udcff\udcfe"], "The prompt is not valid UTF-8 (byte 0xff at position 6)"),
    (["--image", "big.png"], "big.png is over h3trt's input limit of 67,108,864 pixels"),
    (["--image", "wide.png"], "wide.png is 9000x8000 (72,000,000 pixels), over h3trt's input limit"),
    (["--ref", "big.png"], "over h3trt's input limit"),
    (["--prompt", "fox " * (MAX_PROMPT_TOKENS + 1)], f"at most {MAX_PROMPT_TOKENS} tokens"),
    (["--duration", "15"], "takes 5 to 14.375 s"),
    (["--duration", "4.9"], "Unsupported duration 4.9 s: MiniMax-H3 takes 5 to 14.375 s"),
    (["--guidance", "nan"], "--guidance must be a finite number >= 1"),
    (["--guidance", "nan", "--negative-prompt", "blurry"], "--guidance must be a finite number >= 1"),
    (["--guidance", "inf", "--negative-prompt", "blurry"], "--guidance must be a finite number >= 1"),
    (["--video-shift", "nan"], "--video-shift must be a positive finite number (the checkpoint's is 12), got nan"),
    (["--audio-shift", "inf"], "--audio-shift must be a positive finite number (the checkpoint's is 3), got inf"),
    (["--video-shift", "0"], "--video-shift must be a positive finite number"),
    (["--width", "-32", "--height", "96"], "(for example 32x96)"),
])
def test_bad_request_is_one_line_before_any_load(tmp_path, tiny_root, no_model_load, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    huge_png(tmp_path / "big.png")
    huge_png(tmp_path / "wide.png", 9000, 8000)  # under PIL's own guard, over h3trt's limit
    argv = ["run", "--prompt", "x", "--output", "out.mp4", "--quiet", *extra]
    if "--prompt" in extra:
        argv = ["run", "--output", "out.mp4", "--quiet", *extra]
    _one_line_refusal(capsys, argv, message, tmp_path)


@pytest.mark.parametrize("output, overwrite, message", [
    ("d.mp4", True, "d.mp4 is a folder"),  # even with --overwrite
    ("afile/c.mp4", False, "afile is a file, not a folder"),
    ("keep.mp4", False, "keep.mp4 and keep.json already exist"),
    ("only.mp4", False, "only.json already exists"),  # the record alone is protected too
    (".mp4", False, "has no file name before the extension"),
])
def test_bad_output_is_one_line_before_any_load(tmp_path, tiny_root, no_model_load, capsys, monkeypatch, output, overwrite,
                                                message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.mp4").mkdir()
    (tmp_path / "afile").write_text("a file")
    (tmp_path / "keep.mp4").write_bytes(b"precious")
    (tmp_path / "keep.json").write_text("{}")
    (tmp_path / "only.json").write_text('{"mine": 1}')
    argv = ["run", "--prompt", "x", "--output", output, "--quiet"] + (["--overwrite"] if overwrite else [])
    _one_line_refusal(capsys, argv, message, tmp_path)
    assert (tmp_path / "keep.mp4").read_bytes() == b"precious" and (tmp_path / "only.json").read_text() == '{"mine": 1}'
    assert (tmp_path / "afile").read_text() == "a file" and (tmp_path / "d.mp4").is_dir()


def test_a_missing_output_folder_is_created(tmp_path, tiny_root, no_model_load, capsys, monkeypatch):
    """The folder is made before the run (then a bad request still refuses with one line), and removed again: the
    refused run wrote nothing into it."""
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--prompt", "x", "--output", "new/deeper/c.mp4", "--quiet", "--model", "no/such"]) == 2
    assert "no/such does not exist" in capsys.readouterr().err
    _one_line_refusal(capsys, ["run", "--prompt", "x", "--output", "new/deeper/c.mp4", "--quiet", "--model",
                               "no/such"], "does not exist", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_bad_jsonl_lines_are_named_with_file_and_line(tmp_path, tiny_root, no_model_load, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = {"task": "t2va", "prompt": "ok", "resolution": "128x32", "steps": 2}
    lines = [json.dumps({**base, "id": "a"}).encode(),
             json.dumps({**base, "id": "b"}).encode().replace(b'"ok"', b'"o\xff\xfek"'),
             json.dumps({**base, "id": "c", "seed": 2 ** 70}).encode(),
             json.dumps({**base, "id": "d", "seed": -2 ** 63}).encode()]  # the lowest seed is fine
    path = tmp_path / "b.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    err = _one_line_refusal(capsys, ["run", "--requests", str(path), "--out-dir", "out", "--quiet"],
                            f"{path}: 2 bad line(s), nothing was run: {path}:2: not valid UTF-8 (byte 0xff at "
                            "column", tmp_path)
    assert f"{path}:3: seed 1180591620717411303424 is outside [-2^63, 2^64)" in err
    assert not (tmp_path / "out").exists()


def test_a_jsonl_prompt_over_the_token_budget_is_named(tmp_path, tiny_root, no_model_load, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps({"id": "a", "task": "t2va", "prompt": "fox " * (MAX_PROMPT_TOKENS + 5)}) + "\n")
    _one_line_refusal(capsys, ["run", "--requests", str(path), "--out-dir", "out", "--quiet"],
                      f"{path}:1: the prompt has", tmp_path)


def test_an_out_dir_that_is_a_file_is_refused(tmp_path, tiny_root, no_model_load, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").write_text("a file")
    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps({"id": "a", "task": "t2va", "prompt": "x"}) + "\n")
    _one_line_refusal(capsys, ["run", "--requests", str(path), "--out-dir", "out", "--quiet"],
                      "--out-dir out is a file", tmp_path)
    assert (tmp_path / "out").read_text() == "a file"


@pytest.mark.parametrize("damaged", ["text_encoder/model.safetensors", "tokenizer/tokenizer.json",
                                     "processor/video_preprocessor_config.json"])
def test_a_truncated_text_encoder_file_is_one_line_naming_it(tmp_path, tiny_root, capsys, monkeypatch, damaged):
    """A `--model` folder whose conditioner file was cut short (an interrupted copy): one line naming the file and
    the fix, not transformers' traceback."""
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    shutil.copytree(tiny_root, model)
    path = model / "FL2VA" / damaged
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    err = _one_line_refusal(capsys, ["run", "--prompt", "x", "--output", "out.mp4", "--quiet", "--model", str(model)],
                            f"{path} is not ", tmp_path)
    assert "download or copy it again" in err


@pytest.mark.parametrize("source", ["bom", "pipe"])
def test_a_requests_file_with_a_bom_or_from_a_pipe_is_read(tmp_path, tiny_root, no_model_load, capsys, monkeypatch,
                                                           source):
    """`--requests` from a file saved with a UTF-8 byte-order mark, or from a pipe (`--requests <(...)`: /dev/fd/N,
    not a regular file), reaches the next check (here: an --out-dir that is a file), the whole file parsed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").write_text("a file")
    content = json.dumps({"id": "a", "task": "t2va", "prompt": "x"}).encode() + b"\n"
    if source == "bom":
        (tmp_path / "b.jsonl").write_bytes(b"\xef\xbb\xbf" + content)
        requests = "b.jsonl"
    else:
        read_fd, write_fd = os.pipe()
        os.write(write_fd, content)
        os.close(write_fd)
        requests = f"/dev/fd/{read_fd}"
    try:
        _one_line_refusal(capsys, ["run", "--requests", requests, "--out-dir", "out", "--quiet"],
                          "--out-dir out is a file", tmp_path)
    finally:
        if source == "pipe":
            os.close(read_fd)
