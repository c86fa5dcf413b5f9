"""Engine bundles on the CPU: build the tiny model with both backends, serve from the bundle without compiling,
match the eager path, and refuse every mismatch with a message that says what differs.

Tolerances: fp32 bundles; the compiled DiT matches the eager DiT to a relative error (norm) of 1e-5, and a whole
clip served from a bundle decodes to frames within 1 uint8 level (mean) of the eager clip.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from h3trt.build.adaln import schedule_timesteps
from h3trt.engines.adaln import BakedAdaLN
from h3trt.build.builder import build
from h3trt.build.check import BuildError, check_in_fresh_process
from h3trt.build.examples import example_inputs
from h3trt.build.config import BuildConfig, Profile
from h3trt.build.segments import dit_segments
from h3trt.cli import main
from h3trt.engines.bundle import Engine
from h3trt.engines.guard import CompilerInvoked, no_compile
from h3trt.engines.atomic import sha256_file
from h3trt.engines.manifest import BundleError, bundle_identity, content_sha256, read_manifest
from h3trt.engines.weights_io import chunk_digests
from h3trt.engines.signing import load_private_key, sign_bundle
from h3trt.errors import UserError
from h3trt.models.checkpoint.reader import load_dit
from h3trt.models.dit import EagerDiT
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.sampler import Schedule
from h3trt.media.inputs import read_video

from helpers import BUNDLE_STEPS, REPO, dit_inputs

TINY_PROFILE = Profile(160, 96, 5.0)
REL_TOL = 1e-5


@pytest.mark.parametrize("backend", ["inductor", "aoti"])
def test_compiled_dit_matches_eager(backend, bundles, tiny_root):
    engine = Engine.load(bundles[backend], "cpu")
    eager = EagerDiT(load_dit(tiny_root, "t2va", torch.float32)[0])
    cfg = eager.cfg
    steps = Schedule(BUNDLE_STEPS).timesteps()  # the schedule the inductor bundle's AdaLN tables are baked for
    layouts = [pack_t2va(text_tags_for(11), 37, 6, 10, 207),  # another text length than the build example
               pack_t2va(text_tags_for(23, [range(2, 9)]), 7, 6, 10, 23, keyframes=("first", "last"))]
    with torch.no_grad(), no_compile():
        for layout in layouts:
            for tv, ta in (steps[0], steps[3]):  # steps[0] has one distinct timestep: the T >= 2 padding path
                unique_t, t_index = row_timesteps(layout, tv, ta)
                args = (*dit_inputs(layout, cfg), unique_t, t_index, layout)
                for got, want in zip(engine.dit(*args), eager(*args)):
                    err = ((got - want).norm() / want.norm()).item()
                    assert err <= REL_TOL, f"{backend}: relative error {err:.2e} at t=({tv}, {ta})"


def test_run_from_bundle_matches_eager_run(bundles, signing_keys, tmp_path, tiny_cache):
    """Served under --trust (the bundle is signed): the record names the manifest and the key that vouched for it."""
    eager_out, engine_out = tmp_path / "eager.mp4", tmp_path / "engine.mp4"
    steps = ["--steps", str(BUNDLE_STEPS)]
    assert main(["run", "--prompt", "a fox", "--output", str(eager_out), "--quiet", *steps]) == 0
    assert main(["run", "--engine", str(bundles["inductor"]), "--trust", str(signing_keys["builder"][1]), "--prompt",
                 "a fox", "--output", str(engine_out), "--quiet", *steps]) == 0
    a, _, _ = read_video(eager_out)
    b, fps, audio = read_video(engine_out)
    assert a.shape == b.shape == (124, 96, 160, 3) and fps == 24 and audio is not None
    assert np.abs(a.astype(np.float32) - b.astype(np.float32)).mean() <= 1.0
    record = json.loads(engine_out.with_suffix(".json").read_text())
    assert record["bundle"]["backend"] == "inductor" and record["vae_precision"] == "fp32"
    assert json.loads(eager_out.with_suffix(".json").read_text())["vae_precision"] == "fp32"  # the CPU default
    assert record["bundle"]["manifest_sha256"] == read_manifest(bundles["inductor"]).manifest_sha256
    assert len(record["bundle"]["signed_by"]) == 64 and record["mp4_sha256"] == sha256_file(engine_out)
    # The cold start's first part, process start to the bundle load: this test process started long before.
    assert record["load"]["process_to_load_s"] > record["load"]["engine_s"] > 0


@pytest.mark.parametrize("flags", [["--sparse-attention", "0.5"], ["--profile", "balanced"]])
def test_a_one_process_bundle_without_halves_refuses_sparse_attention_in_one_line(bundles, tmp_path, tiny_cache,
                                                                                   capsys, monkeypatch, flags):
    """Built without --sparse-attention, its compiled block holds its attention: a sparse request (stated, or a
    profile's) is refused before denoising with both fixes, never run dense silently
    (tests/engines/test_sparse_bundle.py serves one built with it)."""
    from h3trt.pipeline.h3_pipeline import H3Pipeline

    monkeypatch.setattr(H3Pipeline, "_encode_text", lambda *a, **k: pytest.fail("the request got past the check"))
    code = main(["run", "--engine", str(bundles["inductor"]), "--prompt", "a fox", "--output",
                 str(tmp_path / "s.mp4"), "--quiet", "--steps", str(BUNDLE_STEPS), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("h3trt: error: this bundle serves no block-sparse attention"), err
    assert "--sparse-attention 0" in err[-1] and "rebuild the bundle with h3trt build" in err[-1], err
    assert "--sparse-attention SPARSITY" in err[-1] and not (tmp_path / "s.mp4").exists()


@pytest.mark.parametrize("backend", ["inductor", "aoti"])
def test_compiled_video_decoder_matches_eager(backend, bundles):
    from h3trt.models.checkpoint.vae import load_video_vae

    engine = Engine.load(bundles[backend], "cpu")
    eager = load_video_vae(bundles[backend])
    served = load_video_vae(bundles[backend])
    served.tile_decoders = engine.video_decoders(served.vae)
    z = torch.randn(1, 24, 37, 6, 10, generator=torch.Generator().manual_seed(3))
    with no_compile():
        got = torch.cat(list(served.decode_stream(z)), dim=2)
    want = torch.cat(list(eager.decode_stream(z)), dim=2)
    assert got.shape == want.shape == (1, 3, 124, 96, 160)
    assert (got - want).abs().max() <= 1e-4  # pixels in [0, 1]
    with pytest.raises(ValueError, match="no compiled video decoder for a 7-latent window of 4x6"):
        list(served.decode_stream(z[..., :4, :6]))


def test_serving_compiles_nothing():
    """The guard `h3trt run --engine` serves under raises on any compiler entry, so the runs above prove the bundle
    carried everything."""
    with no_compile(), pytest.raises(Exception) as info:
        torch.compile(lambda x: x * 2 + 1)(torch.randn(8))
    assert "invoked while serving from a bundle" in str(info.value) or isinstance(info.value, CompilerInvoked)


def test_an_error_right_after_the_load_exits_with_its_code(bundles):
    """The pipeline returns while the VAEs still load in the background; a process that ends right then (any error
    after the load) must exit with its own code. A daemon loader thread still inside torch at interpreter exit made it
    abort instead ("terminate called without an active exception", exit 134)."""
    code = ("import sys\nfrom h3trt.pipeline.h3_pipeline import H3Pipeline\n"
            f"H3Pipeline.load_engine({str(bundles['inductor'])!r}, 'cpu')\nsys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3 and "terminate called" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.multiproc
def test_a_killed_engine_run_leaves_no_copy_of_the_compiled_code(bundles, tmp_path, tiny_cache):
    """`h3trt run --engine` copies the bundle's compiled code to $TMPDIR/h3trt-engine-cache-*. Sent SIGTERM (which
    the CLI takes as Ctrl-C: exit 130), the run removes its copy; sent SIGKILL, the copy stays (nothing runs), and the
    next run from a bundle removes it. (tests/engines/test_engine_cache.py: the same without a bundle or the CLI's
    handler, and the sweep's cases.)"""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(REPO))

    def run(name):
        return subprocess.Popen([sys.executable, "-m", "h3trt.cli", "run", "--engine", str(bundles["inductor"]),
                                 "--prompt", "a fox", "--output", str(tmp_path / f"{name}.mp4"), "--quiet"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def copies():
        return sorted(tmp.glob("h3trt-engine-cache-*"))

    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = run(sig.name)
        deadline = time.monotonic() + 300
        while not copies():  # the moment the copy exists: it may be half-made, the hardest case
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == (130 if sig == signal.SIGTERM else -sig), err[-2000:]
        left = copies()
        seen = {p.name: sorted(str(f.relative_to(p)) for f in p.rglob("*"))[:10] for p in left}
        assert (left == []) if sig == signal.SIGTERM else (len(left) == 1 and f"-{proc.pid}-" in left[0].name), (
            sig.name, proc.pid, seen, err[-2000:])
    later = run("later")
    _, err = later.communicate(timeout=600)
    assert later.returncode == 0 and copies() == [], err[-2000:]


def test_a_request_the_bundle_cannot_serve_is_refused_before_the_load(bundles, tmp_path, monkeypatch, capsys):
    """A schedule the AdaLN tables were not baked for, or a --profile-step past the last evaluation, is refused
    from the manifest alone: nothing loads."""
    from h3trt.pipeline.h3_pipeline import H3Pipeline

    monkeypatch.setattr(H3Pipeline, "load_engine", lambda *a, **k: pytest.fail("the bundle was loaded"))
    base = ["run", "--engine", str(bundles["inductor"]), "--prompt", "a fox", "--output", str(tmp_path / "a.mp4")]
    assert main([*base, "--steps", str(BUNDLE_STEPS + 1)]) == 2
    assert "baked for steps=" in capsys.readouterr().err
    assert main([*base, "--profile-step", str(BUNDLE_STEPS)]) == 2
    assert f"pick one of 1..{BUNDLE_STEPS - 1}" in capsys.readouterr().err


@pytest.mark.parametrize("bytecode", [True, False])
def test_a_bundle_run_without_bytecode_says_how_to_fix_it(bundles, tmp_path, monkeypatch, capsys, bytecode):
    """No compiled bytecode for torch (PYTHONDONTWRITEBYTECODE=1 images) costs every cold start seconds of compiling
    Python: h3trt run names it and the fix, and says nothing when the bytecode is there."""
    from h3trt.jobs import model_source as entry_module
    from h3trt.pipeline.h3_pipeline import H3Pipeline

    monkeypatch.setattr(entry_module, "torch_bytecode", lambda: bytecode)
    # Stopped right after the note: a UserError is one line and exit 2 (any other error is a bug and propagates).
    monkeypatch.setattr(H3Pipeline, "load_engine", lambda *a, **k: (_ for _ in ()).throw(UserError("stop here")))
    assert main(["run", "--engine", str(bundles["inductor"]), "--prompt", "a fox", "--output",
                 str(tmp_path / "a.mp4")]) == 2
    err = capsys.readouterr().err
    assert "stop here" in err and ("PYTHONPYCACHEPREFIX" in err) != bytecode


def test_segments_load_on_one_compile_thread(bundles, monkeypatch):
    """Loading a bundle's segments must not start Inductor's pool of compile workers (a process per core importing
    torch: 5.3 s of the full-size segment load on the H200 machine): the load runs with compile_threads 1, and the
    process's own setting is back afterwards."""
    import torch._inductor.config as inductor_config
    from h3trt.engines import loaders

    seen = []
    real = loaders.load_segment
    monkeypatch.setattr(loaders, "load_segment",
                        lambda *a, **k: seen.append(inductor_config.compile_threads) or real(*a, **k))
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    root = bundles["inductor"]
    manifest = read_manifest(root)
    # Set and restored by hand: monkeypatch would delete the entry on undo (it cannot see a config module's values).
    before = inductor_config.compile_threads
    inductor_config.compile_threads = 7
    try:
        segments = loaders.load_segments(root, manifest.backend, manifest.segments, torch.device("cpu"))
        assert set(segments) == set(manifest.segments) and seen == [1] * len(manifest.segments)
        assert inductor_config.compile_threads == 7
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")  # Inductor's own knob, when a user sets it, wins
        loaders.load_segments(root, manifest.backend, manifest.segments, torch.device("cpu"))
        assert seen[len(manifest.segments):] == [4] * len(manifest.segments)
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "many")
        with pytest.raises(ValueError, match="TORCHINDUCTOR_COMPILE_THREADS"):
            loaders.load_segments(root, manifest.backend, manifest.segments, torch.device("cpu"))
    finally:
        inductor_config.compile_threads = before


def test_manifest_records_the_build(bundles):
    m = read_manifest(bundles["inductor"])
    assert m.backend == "inductor" and m.precision == "fp32" and m.arch.startswith("cpu-")
    assert m.versions["torch"] == torch.__version__
    assert m.adaln.baked and m.adaln.timesteps == schedule_timesteps(Schedule(BUNDLE_STEPS)).numel()
    assert (m.mesh.cfg, m.mesh.sp, m.mesh.heads_per_rank) == (1, 1, 2)
    assert m.tasks == ("t2va", "fl2va") and m.model_config.num_heads == 2
    # 160x96: one 6x10 tile; the decoder as in + one block serving both layers + out, at the CPU default fp32
    assert set(m.segments) == {"embed", "block", "final", "video_decoder_in_7x6x10", "video_decoder_block_7x6x10",
                               "video_decoder_out_7x6x10"}
    assert m.vae_precision == "fp32" and m.video_decoder_cuda_graph in (True, False)
    assert not any(name.startswith("weights/adaln_weights") for name in m.files)  # adaln_proj left out
    assert m.hash_chunk_bytes == 64 << 20
    assert all(len(f.sha256_chunks) == max(1, -(-f.bytes // (64 << 20))) and all(len(d) == 64 for d in
               f.sha256_chunks) for f in m.files.values())
    # fp32 attention on a CPU: torch SDPA, nothing timed, at the bundle's attention shape (every row, 2 heads).
    att = m.attention["fp32"]
    assert set(m.attention) == {"fp32"} and (att["kernel"], att["requested"], att["measured_ms"]) == (
        "sdpa", "auto", {})
    assert att["shape"]["heads"] == 2 and att["shape"]["rows"] > 1000
    keep = read_manifest(bundles["aoti"])
    assert not keep.adaln.baked and "weights/adaln_weights.safetensors" in keep.files


@pytest.fixture
def bundle_copy(bundles, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(bundles["inductor"], dst)
    return dst


def _edit_manifest(root, rehash=True, **changes):
    """Change manifest fields; `rehash` also recomputes manifest_sha256, as someone who means it would."""
    path = root / "manifest.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        target = data
        *parents, leaf = key.split(".")
        for p in parents:
            target = target[p]
        target[leaf] = value
    if rehash:
        data["manifest_sha256"] = content_sha256(data)
    path.write_text(json.dumps(data))


def test_refuses_a_changed_file(bundle_copy, capsys):
    weights = bundle_copy / "weights" / "blocks.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(BundleError, match="weights/blocks.safetensors changed"):
        Engine.load(bundle_copy, "cpu")
    assert main(["verify", str(bundle_copy)]) == 1
    assert "blocks.safetensors changed" in capsys.readouterr().err


def test_verify_and_inspect_an_intact_bundle(bundles, capsys):
    assert main(["verify", str(bundles["inductor"])]) == 0
    assert main(["inspect", str(bundles["inductor"])]) == 0
    shown = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert shown["backend"] == "inductor" and shown["segments"]["block"].endswith(".inductor.bin")


@pytest.mark.parametrize("change, message", [
    ({"versions.torch": "2.11.0+cu130"}, "built with torch 2.11.0+cu130"),
    ({"arch": "sm_90"}, "built for sm_90"),
    ({"format_version": 99}, "bundle format 99"),
    # A kernel this machine cannot run is refused, never replaced by another one.
    ({"attention": {"bf16": {"kernel": "fa3"}}}, "the fa3 bf16 attention kernel needs a CUDA GPU"),
    ({"attention": {"fp32": {"kernel": "sdpa"}, "fp8": {"kernel": "cudnn"}}}, "the cudnn fp8 attention kernel needs"),
])
def test_refuses_another_environment(bundle_copy, change, message):
    _edit_manifest(bundle_copy, **change)
    with pytest.raises(BundleError, match=re.escape(message)):
        Engine.load(bundle_copy, "cpu")


def test_refuses_a_mesh_that_does_not_match(bundles):
    from h3trt.parallel.mesh import MeshConfig

    with pytest.raises(BundleError, match=r"built for sp=1 x cfg=1 .* launched as replica\(1\) x cfg\(1\) x sp\(2\)"):
        Engine.load(bundles["inductor"], "cpu", MeshConfig(sp=2))


@pytest.mark.parametrize("extra, message", [
    (["--width", "128", "--height", "96"], "not built for 128x96, 124 frames; its profiles are 160x96x5s"),
    (["--duration", "6"], "not built for 160x96, 158 frames"),
    (["--steps", "10"], f"baked for steps={BUNDLE_STEPS}, video shift 12, audio shift 3"),
    (["--vae-precision", "bf16", "--steps", str(BUNDLE_STEPS)], "video decoder was compiled at --vae-precision fp32; the run asks for bf16"),
])
def test_refuses_requests_the_bundle_cannot_serve(bundles, tmp_path, extra, message, capsys):
    out = tmp_path / "x.mp4"
    assert main(["run", "--engine", str(bundles["inductor"]), "--prompt", "x", "--output", str(out), "--quiet",
                 *extra]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_keep_adaln_bundle_serves_another_schedule(bundles, tmp_path):
    out = tmp_path / "short.mp4"
    assert main(["run", "--engine", str(bundles["aoti"]), "--prompt", "x", "--output", str(out), "--quiet",
                 "--steps", "4"]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["evaluations"] == 3


def test_baked_tables_refuse_unknown_timesteps(bundles):
    from safetensors.torch import load_file

    tables = BakedAdaLN(load_file(str(bundles["inductor"] / "weights" / "adaln_tables.safetensors")), torch.device("cpu"))
    with pytest.raises(ValueError, match="not in this bundle's baked AdaLN tables"):
        tables.rows(torch.tensor([0.123456]))


def test_build_is_refused_when_a_segment_fails_to_load(bundles, tmp_path, tiny_root):
    """The fresh-process check before the manifest: a segment that cannot load stops the build with the reason."""
    work = tmp_path / "work"
    shutil.copytree(bundles["inductor"], work)
    (work / "segments" / "final.inductor.bin").write_bytes(b"not a compiled artifact")
    model, _ = load_dit(tiny_root, "t2va", torch.float32)
    manifest = read_manifest(bundles["inductor"])
    config = BuildConfig(tiny_root, tmp_path / "out", precision="fp32", profiles=(TINY_PROFILE,), device="cpu")
    specs = {spec.name: spec for spec in dit_segments(model.cfg, torch.float32)}
    with pytest.raises(BuildError, match="failed to load or match in a fresh process"):
        check_in_fresh_process(work, config, manifest.segments, example_inputs(model, TINY_PROFILE.geometry, "cpu"),
                              specs)


def test_build_refuses_bad_options(tiny_root, tmp_path):
    with pytest.raises(ValueError, match=r"sp=3 does not divide the 2 attention heads .* valid sp: \[1, 2\]"):
        build(BuildConfig(tiny_root, tmp_path / "b", sp=3, device="cpu"))
    with pytest.raises(ValueError, match="cfg must be 1 or 2"):
        BuildConfig(tiny_root, tmp_path / "b", cfg=3)
    with pytest.raises(ValueError, match="--precision fp8 needs --calib-prompts"):
        BuildConfig(tiny_root, tmp_path / "b", precision="fp8")
    with pytest.raises(ValueError, match="--attention must be one of"):
        BuildConfig(tiny_root, tmp_path / "b", attention="flash")
    with pytest.raises(ValueError, match="Drop --attention with --backend tensorrt"):
        BuildConfig(tiny_root, tmp_path / "b", backend="tensorrt", attention="fa3")
    with pytest.raises(UserError, match="--attention fa3: the fa3 bf16 attention kernel needs a CUDA GPU"):
        build(BuildConfig(tiny_root, tmp_path / "b", device="cpu", attention="fa3"))
    assert os.listdir(tmp_path) == []  # refused before the output was claimed
    with pytest.raises(ValueError, match="WIDTHxHEIGHTxSECONDS"):
        Profile.parse("1344x768")
    with pytest.raises(ValueError, match="Unsupported resolution"):
        Profile.parse("1350x768x5")


def test_a_process_serving_a_bundle_refuses_to_build(bundles, tiny_root, tmp_path):
    """After a bundle's compiled-code cache is active, a build in the same process would miss kernels (measured);
    it is refused with the way out."""
    Engine.load(bundles["inductor"], "cpu")
    with pytest.raises(UserError, match=r"already serves from the bundle .* Build in a fresh process"):
        build(BuildConfig(tiny_root, tmp_path / "b", precision="fp32", profiles=(TINY_PROFILE,), device="cpu"))
    assert os.listdir(tmp_path) == []  # refused before the output was claimed


def test_an_edited_manifest_field_is_refused(bundle_copy, capsys):
    """num_layers 2 -> 1 keeps the manifest valid JSON: refused by verify and by a load, since the manifest hashes
    its own content. Re-hashed by hand it passes an unsigned verify (accidents only), but its manifest_sha256, which
    every clip's record carries, is another."""
    before = bundle_identity(read_manifest(bundle_copy))
    _edit_manifest(bundle_copy, rehash=False, **{"model_config.num_layers": 1})
    assert main(["verify", str(bundle_copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "manifest.json was changed after the build" in err[0], err
    with pytest.raises(BundleError, match="changed after the build"):
        Engine.load(bundle_copy, "cpu")
    _edit_manifest(bundle_copy, **{"model_config.num_layers": 1})
    assert main(["verify", str(bundle_copy)]) == 0
    assert "detects accidental changes only: pass --trust KEY.pub" in capsys.readouterr().out
    after = bundle_identity(read_manifest(bundle_copy))
    assert after["manifest_sha256"] != before["manifest_sha256"] and after["files_sha256"] == before["files_sha256"]


def test_a_signed_bundle_verifies_under_trust_and_shows_its_hash(bundles, signing_keys, capsys):
    assert main(["verify", str(bundles["inductor"]), "--trust", str(signing_keys["builder"][1])]) == 0
    assert "signed by the trusted key" in capsys.readouterr().out
    assert main(["inspect", str(bundles["inductor"])]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["signature"].startswith("ed25519 by key ") and len(shown["manifest_sha256"]) == 64
    assert main(["verify", str(bundles["aoti"]), "--trust", str(signing_keys["builder"][1])]) == 2  # unsigned
    assert "is not signed" in capsys.readouterr().err


def _cache_python_file(root):
    return next(p for p in sorted((root / "inductor_cache").rglob("*.py")))


@pytest.mark.parametrize("tamper, message", [
    ("file", "changed (sha256 differs from the manifest)"),  # a file edited, the manifest left alone
    ("file_and_hash", "the manifest changed after it was signed"),  # the file and its hash (and manifest_sha256)
    ("extra_file", "is not part of the bundle"),
    ("other_key", "it was signed by key"),  # re-signed by someone else
    ("unsigned", "is not signed"),
])
def test_trust_refuses_any_change_before_code_loads(bundle_copy, signing_keys, monkeypatch, capsys, tamper, message):
    """Under --trust a bundle whose code (here an Inductor wrapper .py in its cache) or manifest changed in any way is
    refused by verify, by `run` and by a load, and none of its code is loaded."""
    import h3trt.engines.bundle as bundle_module

    code = _cache_python_file(bundle_copy)
    rel = code.relative_to(bundle_copy).as_posix()
    if tamper in ("file", "file_and_hash"):  # one byte replaced: the size stays, so only the content hash can tell
        data = code.read_bytes()
        code.write_bytes(data[:-2] + (b"#" if data[-2:-1] != b"#" else b"!") + data[-1:])
    if tamper == "file_and_hash":
        data = json.loads((bundle_copy / "manifest.json").read_text())
        data["files"][rel] = {**data["files"][rel], "sha256_chunks": chunk_digests(code, data["hash_chunk_bytes"]),
                              "bytes": code.stat().st_size}
        data["manifest_sha256"] = content_sha256(data)  # a consistent manifest: an unsigned verify would pass it
        (bundle_copy / "manifest.json").write_text(json.dumps(data))
        assert main(["verify", str(bundle_copy)]) == 0
        capsys.readouterr()
    if tamper == "extra_file":
        (bundle_copy / "inductor_cache" / "sitecustomize.py").write_text("import os\n")
    if tamper == "other_key":
        sign_bundle(bundle_copy, load_private_key(signing_keys["other"][0]))
    if tamper == "unsigned":
        (bundle_copy / "manifest.sig").unlink()
    pub = str(signing_keys["builder"][1])

    def no_code(*args, **kwargs):
        raise AssertionError("the bundle's code was loaded")

    monkeypatch.setattr(bundle_module, "load_segments", no_code)
    # 1: the signed manifest holds, a file does not match it; 2: the manifest itself cannot be trusted (README)
    status = {"file": 1, "extra_file": 1, "file_and_hash": 2, "other_key": 2, "unsigned": 2}[tamper]
    assert main(["verify", str(bundle_copy), "--trust", pub]) == status
    assert message in capsys.readouterr().err
    load_message = {"file_and_hash": "after it was signed",  # a load hashes while reading: it names the chunk
                    "file": re.escape(rel) + r" changed: bytes .* do not match the manifest's sha256"}
    with pytest.raises(BundleError, match=load_message.get(tamper, re.escape(message))):
        Engine.load(bundle_copy, "cpu", trust=pub)


def test_keygen_makes_a_private_and_a_public_key(tmp_path, capsys):
    key = tmp_path / "k"
    assert main(["keygen", str(key)]) == 0
    assert (key.stat().st_mode & 0o777) == 0o600 and (tmp_path / "k.pub").read_text().startswith("-----BEGIN PUBLIC")
    assert main(["keygen", str(key)]) == 2  # an existing key is never replaced
    assert "already exists" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# Cold start of a whole bundle: the verified-once record, chunks hashed while read (engines/weights_io.py)


@pytest.fixture
def bundle(bundles):
    return bundles["inductor"]


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


def _load(root):
    engine = Engine.load(root, "cpu", threads=3)
    engine.verification.wait_all()
    return engine


def test_second_load_hashes_nothing_and_gives_the_same_weights(bundle, private_cache):
    first = _load(bundle)
    assert first.load_report["files_trusted"] == 0 and first.load_report["weights_read"]["hashed_chunks"] > 0
    # The eager components (VAEs) are verified only after the DiT weights were read: they never share the disk.
    done = first.verification.done_at
    weights_read = max(t for rel, t in done.items() if rel.startswith("weights/"))
    assert all(t >= weights_read for rel, t in done.items() if rel.startswith(("video_vae/", "audio_vae/")))
    assert any(rel.startswith("video_vae/") for rel in done)
    second = _load(bundle)
    assert second.load_report["files_hashed"] == 0 and second.load_report["weights_read"]["hashed_chunks"] == 0
    report = second.load_report
    assert report["weights_bytes"] > 0 and report["weights_GBps"] > 0
    for key in ("checks_s", "code_verified_s", "segments_s", "weights_s", "total_s"):
        assert report[key] >= 0
    from safetensors.torch import load_file

    want = load_file(str(bundle / "weights" / "blocks.safetensors"))
    for i, layer in enumerate(second.dit.block_w["block"]):
        names = second.manifest.segments["block"]["weights"]
        for name, t in zip(names, layer):
            assert torch.equal(t, want[f"blocks.{i}.{name}"])


@pytest.mark.parametrize("change", ["content_same_mtime", "size", "content"])
def test_record_does_not_hide_a_changed_file(bundle, private_cache, tmp_path, change):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    _load(copy)  # verified once: the record now trusts every file
    path = copy / "weights" / "blocks.safetensors"
    raw = bytearray(path.read_bytes())
    st = os.stat(path)
    if change == "size":
        raw += b"\0" * 8
    else:
        raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    if change == "content_same_mtime":
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(BundleError, match="weights/blocks.safetensors changed"):
        _load(copy)


def test_a_tampered_component_is_refused_before_use(bundle, private_cache, tmp_path):
    from h3trt.pipeline.h3_pipeline import H3Pipeline

    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    vae = next((copy / "video_vae").rglob("*.safetensors"))
    raw = bytearray(vae.read_bytes())
    raw[-1] ^= 0x01
    vae.write_bytes(bytes(raw))
    pipeline = H3Pipeline.load_engine(copy, "cpu")  # the DiT and text encoder load; the VAE loads in the background
    with pytest.raises(BundleError, match="video_vae/.*changed"):
        pipeline.video_vae
    from h3trt.engines.verified import VerifiedRecord, identity

    record = VerifiedRecord.open(copy)
    assert not record.trusted(vae.relative_to(copy).as_posix(), identity(vae))


@pytest.mark.parametrize("private", [True, False])
def test_a_key_of_another_type_is_refused_by_name(tmp_path, private):
    """--sign / --trust with a PEM key that is not Ed25519 (here EC P-256) is one error naming the flag and the fix."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from h3trt.engines.signing import load_public_key

    key = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / ("k" if private else "k.pub")
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()) if private else
                     key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    flag, kind, fix = ("--sign", "private", "h3trt keygen") if private else ("--trust", "public", "KEY.pub")
    with pytest.raises(ValueError, match=rf"{flag} .* not an Ed25519 {kind} key; .*{fix}"):
        (load_private_key if private else load_public_key)(path)
