"""End to end: `h3trt run` on the embedded tiny default writes a valid MP4; bad input fails cleanly."""

import json
import os
import shlex
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from h3trt.cli import main
from h3trt.media.inputs import probe

from helpers import REPO

README = REPO / "README.md"
AAC_FRAME_S = 1024 / 32000  # decoded AAC may run up to one frame past the generated samples


def readme_run_command() -> str:
    """The `h3trt run` part of the README's first set-up command."""
    for line in README.read_text().splitlines():
        if line.startswith("pip install -e . && h3trt run"):
            return line.split("&& ", 1)[1]
    raise AssertionError("README lost its first set-up command")


def readme_video_reference_command() -> list[str]:
    """The README's tiny-model ref2va command with a video reference, without its comment."""
    for line in README.read_text().splitlines():
        if line.startswith("h3trt run") and "clip.mp4" in line and "--ref" in line:
            return shlex.split(line, comments=True)
    raise AssertionError("README lost its video-reference command")


def check_clip(path: Path, frames: int = 124, audio_latents: int = 207, size=(160, 96)):
    info = probe(path)
    assert info["video_codec"] == "h264" and info["pix_fmt"] == "yuv420p"
    assert (info["width"], info["height"]) == size
    assert info["fps"] == 24 and info["frames"] == frames
    assert info["audio_codec"] == "aac" and info["sample_rate"] == 32000 and info["audio_channels"] == 2
    generated_s = audio_latents * 800 / 32000
    assert generated_s <= info["audio_duration"] <= generated_s + AAC_FRAME_S


def test_readme_first_command(tmp_path, tiny_cache):
    env = dict(os.environ, XDG_CACHE_HOME=str(tiny_cache))
    cmd = shlex.split(readme_run_command())
    assert cmd[0] == "h3trt"
    proc = subprocess.run([sys.executable, "-m", "h3trt.cli", *cmd[1:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "clip.mp4"
    check_clip(out)
    record = json.loads((tmp_path / "clip.json").read_text())
    assert record["task"] == "t2va" and record["frames"] == 124 and record["evaluations"] == 49
    assert set(record["timings_s"]) >= {"text_encode", "denoise", "video_decode", "audio_decode", "mux"}
    assert "random weights" in proc.stderr  # the user is told the clip is noise
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial files left


def _png(path: Path, size=(120, 80), seed=0) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def _wav(path: Path, seconds=1.0, rate=16000) -> Path:
    t = np.arange(int(seconds * rate)) / rate
    data = (0.3 * np.sin(2 * np.pi * 330 * t) * 32767).astype(np.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate), w.writeframes(data.tobytes())
    return path


def test_fl2va_both_keyframes(tmp_path, tiny_cache):
    out = tmp_path / "kf.mp4"
    code = main(["run", "--prompt", "a door opens", "--output", str(out), "--image", str(_png(tmp_path / "a.png")),
                 "--last-image", str(_png(tmp_path / "b.png", (90, 60), 1)), "--steps", "6", "--quiet"])
    assert code == 0
    check_clip(out, size=(128, 96))  # the tiny canvas for the first keyframe's 3:2 aspect (short edge 96)
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["task"] == "fl2va" and record["sequence_rows"] > 0


def test_ref2va_image_and_audio(tmp_path, tiny_cache):
    out = tmp_path / "ref.mp4"
    code = main(["run", "--prompt", "she sings", "--output", str(out), "--ref", str(_png(tmp_path / "face.png")),
                 str(_wav(tmp_path / "voice.wav")), "--steps", "4", "--quiet", "--seed", "7"])
    assert code == 0
    check_clip(out)
    assert json.loads(out.with_suffix(".json").read_text())["task"] == "ref2va"


def test_readme_video_reference_runs_without_torchvision(tmp_path, tiny_cache, monkeypatch):
    """ref2va with an image and a video reference (a real MP4 with a soundtrack), from the README's install: no
    torchvision (transformers' Qwen3-VL video processor needs it; h3trt/models/qwen_video.py does not)."""
    from h3trt.media.mp4 import write_mp4

    monkeypatch.chdir(tmp_path)
    cmd = readme_video_reference_command()
    assert cmd[:2] == ["h3trt", "run"]
    _png(tmp_path / "face.png")
    t = np.arange(30)[:, None, None, None]  # 30 frames at 24 fps: one 22-frame VAE window and two vision blocks
    frames = np.clip(np.linspace(0, 255, 64)[None, None, :, None] + 5 * t, 0, 255).astype(np.uint8)
    tone = (0.2 * np.sin(2 * np.pi * 440 * np.arange(32000) / 32000)).astype(np.float32)
    write_mp4(tmp_path / "clip.mp4", np.broadcast_to(frames, (30, 48, 64, 3)), np.stack([tone, tone]))
    assert main([*cmd[1:], "--steps", "4", "--quiet"]) == 0
    out = tmp_path / "ref.mp4"
    check_clip(out)
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["task"] == "ref2va" and record["request"]["refs"] == ["face.png", "clip.mp4"]


@pytest.mark.parametrize("extra, message", [
    (["--width", "100", "--height", "64"], "Unsupported resolution 100x64"),
    (["--width", "1600", "--height", "800"], "larger than MiniMax-H3's canvas"),
    (["--width", "640"], "--width and --height go together"),
    (["--duration", "20"], "Unsupported duration 20 s"),
    (["--duration", "2"], "Unsupported duration 2 s"),
    (["--image", "missing.png"], "missing.png does not exist"),
    (["--image", "notanimage.png"], "is not a readable image"),
    (["--ref", "voice.wav"], "audio reference must be paired"),
    (["--steps", "1"], "--steps must be at least 2"),
    (["--model", "no/such/folder"], "does not exist"),
])
def test_bad_input_fails_with_one_line_and_no_output(tmp_path, tiny_cache, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notanimage.png").write_text("this is text, not a PNG")
    _wav(tmp_path / "voice.wav")
    code = main(["run", "--prompt", "x", "--output", "out.mp4", "--quiet", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("h3trt: error: ") and message in err[0], err
    assert not (tmp_path / "out.mp4").exists() and not (tmp_path / "out.json").exists()


def test_existing_output_is_not_overwritten(tmp_path, tiny_cache, capsys):
    out = tmp_path / "keep.mp4"
    out.write_bytes(b"precious")
    assert main(["run", "--prompt", "x", "--output", str(out), "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert out.read_bytes() == b"precious"


@pytest.mark.multiproc
def test_sequence_parallel_run_writes_the_same_clip(tmp_path, tiny_cache):
    """--gpus 2 spawns two ranks (gloo on the CPU) that share the sequence; rank 0 writes. Same frames as one process
    (mean within 1 uint8 level: the sharded attention reorders float sums)."""
    from h3trt.media.inputs import read_video

    one, two = tmp_path / "one.mp4", tmp_path / "two.mp4"
    assert main(["run", "--prompt", "a fox", "--output", str(one), "--quiet", "--steps", "8", "--device", "cpu"]) == 0
    assert main(["run", "--prompt", "a fox", "--output", str(two), "--quiet", "--steps", "8", "--device", "cpu",
                 "--gpus", "2"]) == 0
    a, b = read_video(one)[0], read_video(two)[0]
    assert a.shape == b.shape and np.abs(a.astype(np.float32) - b.astype(np.float32)).mean() <= 1.0
    assert json.loads(two.with_suffix(".json").read_text())["mesh"]["sp"] == 2


def test_sequence_parallel_degree_must_divide_the_heads(tmp_path, tiny_cache, capsys):
    assert main(["run", "--prompt", "x", "--output", str(tmp_path / "x.mp4"), "--quiet", "--device", "cpu",
                 "--gpus", "3"]) == 2
    assert "sp=3 does not divide the 2 attention heads" in capsys.readouterr().err


def test_an_interrupt_that_ended_a_string_exec_still_exits_130(tmp_path):
    """CI saw an interrupted `python -m h3trt.cli build` print its line and die by SIGINT (-2) instead of exiting 130:
    CPython marks an interrupt that ends a string exec (dataclasses, namedtuples, generated code) unhandled even when
    it is caught, and `-m` then kills the process at exit. Here a command's string exec is interrupted."""
    (tmp_path / "interrupted_cli.py").write_text(
        "import sys\n"
        "from h3trt.cli import commands, main\n"
        "commands.cmd_inspect = lambda args: exec('raise KeyboardInterrupt', {})\n"
        "sys.exit(main(['inspect', 'x']))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(README.parent)]))
    done = subprocess.run([sys.executable, "-m", "interrupted_cli"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 130, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == "h3trt: interrupted; no output was written (temporary files removed).", done.stderr


def test_main_gives_the_callers_signal_handlers_back(tmp_path, capsys):
    """main handles SIGINT and SIGTERM while it runs; a program that calls it (a test worker) keeps its own handlers
    afterwards: a later signal there raised KeyboardInterrupt inside a library's garbage-collection callback."""
    import signal

    def own(signum, frame):
        pass

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, own)
    try:
        assert main(["inspect", str(tmp_path / "missing")]) == 2  # an error
        assert main(["keygen", str(tmp_path / "key")]) == 0  # a command that returns
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_sparse_attention_that_no_evaluation_can_run_is_said_on_stderr(tmp_path, tiny_cache, capsys):
    """`run --sparse-attention 0.75` where every evaluation stays dense exited 0 silently: one line on stderr says
    why (the dense steps, or the attention's length), and the record lists no sparse evaluation, as before. A run
    with sparse evaluations says nothing."""
    small = ["--width", "128", "--height", "32", "--steps", "3", "--quiet", "--sparse-attention", "0.75"]
    cases = ((["--sparse-min-seq", "1"], "all 2 of its evaluations are among the first 10 kept dense "
                                         "(--sparse-dense-steps)"),
             (["--sparse-dense-steps", "0"], "its attentions are shorter than --sparse-min-seq 4096 rows"),
             (["--sparse-dense-steps", "1", "--sparse-min-seq", "1"], None))
    for i, (flags, why) in enumerate(cases):
        out = tmp_path / f"{i}.mp4"
        assert main(["run", "--prompt", "a fox", "--output", str(out), *small, *flags]) == 0
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("h3trt: note: block-sparse")]
        sparse = json.loads(out.with_suffix(".json").read_text())["sparse_attention"]
        if why is None:
            assert notes == [] and sparse["sparse_evaluations"] == [1]
        else:
            assert notes == [f"h3trt: note: block-sparse attention (sparsity 0.75) ran on no evaluation: {why}; the "
                             "clip is dense, as its record's sparse_attention says."]
            assert sparse["sparse_evaluations"] == []
