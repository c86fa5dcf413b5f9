import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

# Inductor probes the CPU's vector ISAs once per process by compiling and loading a test library for each (about 10 s
# on two cores), into the Inductor cache, which a build points at a fresh folder inside its bundle: every `h3trt build`
# process paid it again. The tests accept the ISAs the CPU's flags name (the probe picks the same ones on the CI
# machine); set before torch loads, and inherited by every process the tests start.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


def _install_compile_cache() -> None:
    """Run the session's C++ compiles through tests/cxx_cache.py, one cache for the session (xdist's workers and
    every process they start inherit CXX and the folder from the controller, which loads this file first): the
    suite's builds of the tiny model repeat the same kernels. Set before torch loads (Inductor reads CXX on import).
    A session that brings its own CXX keeps it."""
    import atexit
    import shutil
    import tempfile

    if "H3TRT_TEST_CXX_CACHE" in os.environ or "CXX" in os.environ or sys.platform != "linux":
        return
    real = shutil.which("g++")
    if real is None:
        return
    folder = tempfile.mkdtemp(prefix="h3trt-test-cxx-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    wrapper = os.path.join(folder, "g++")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cxx_cache.py")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "{real}" "{folder}/entries" "$@"\n')
    os.chmod(wrapper, 0o755)
    os.mkdir(os.path.join(folder, "entries"))
    os.environ["H3TRT_TEST_CXX_CACHE"] = folder
    os.environ["CXX"] = wrapper


_install_compile_cache()

import pytest  # noqa: E402
import torch  # noqa: E402

from h3trt.models.checkpoint.writer import random_state_dict, save_comfy, save_diffusers, save_official
from h3trt.models.config import H3Config

from helpers import PLAIN_BUNDLE


TIERS = ("unit", "multiproc", "build", "serve", "fleet")


BUNDLE_FIXTURES = {"bundle_cache", "bundles", "bundle_copy", "sp2_bundle", "fp8_bundle", "fp8_sp2_bundle",
                   "lora_bundle", "sparse_bundle", "slot_bundle", "turbo_bundle", "vsa_bundle", "fp8_sparse_bundle",
                   "sparse_slot_bundle"}


# The files whose bundle builds and spawned ranks take minutes, longest first (measured on two cores): under
# pytest-xdist (README: `-n 2 --dist loadfile`, one file per worker at a time) they go out first, so that no long file
# starts last while the other worker sits idle. xdist's own order (files with the most tests first) is turned off. A
# shared bundle (BundleCache) is built by the first file that asks: the files that take it built go well after it
# (test_engine.py builds the plain one test_build_hardening.py takes; test_bundle_lora.py the one test_turbo.py takes).
# Every file with a test over 30 s in CI's slowest list belongs here: one left out goes in name order after the listed
# ones, and test_vsa_fp8_bundle.py's build (185 s alone on a loaded machine, test_distilled_vsa.py 275 s and
# test_lora_layouts.py 221 s beside it) then started among the last files.
SLOW_FILES = ("test_mesh.py", "test_fleet.py", "test_engine.py", "test_build_stream.py", "test_quant.py",
              "test_bundle_lora.py", "test_build_stream_distilled.py", "test_distilled_vsa.py", "test_lora_layouts.py",
              "test_vae_precision.py", "test_fewstep.py", "test_serve_api.py", "test_serve_lora_admin.py",
              "test_build_hardening.py", "test_serve_ops.py", "test_parallel_vae.py", "test_hardening.py",
              "test_cli.py", "test_step_cache.py", "test_sparse_bundle.py", "test_sparse_fp8_bundle.py",
              "test_sparse_lora_bundle.py", "test_turbo.py", "test_vsa_bundle.py", "test_vsa_fp8_bundle.py",
              "test_distilled_bundle.py", "test_vsa_fp8.py", "test_distilled_serving.py")


def pytest_configure(config):
    # A suite started in the background by a non-interactive shell inherits SIGINT ignored, as would every h3trt
    # process it starts, and the tests that press Ctrl-C would find it ignored: give them a terminal's Ctrl-C.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # One intra-op thread per worker: the workers already fill the cores, and torch's default (a thread per
        # core in every worker) oversubscribes them. Processes the tests spawn keep torch's default.
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tiers (registered in setup.cfg): a test that takes a built bundle is a build test; a test without a tier
    marker is a unit test. The slow files go first (stable: the order inside each file is kept)."""
    for item in items:
        if BUNDLE_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("build"):
            item.add_marker(pytest.mark.build)
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(pytest.mark.unit)
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))


@pytest.fixture(scope="session")
def tiny_cfg() -> H3Config:
    return H3Config.tiny()


@pytest.fixture(scope="session")
def tiny_states(tiny_cfg):
    """Native float32 weights of the two partitions."""
    return {"FL2VA": random_state_dict(tiny_cfg, 0), "Ref2VA": random_state_dict(tiny_cfg, 1)}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tiny_cfg, tiny_states):
    """The same float32 weights written in the official, diffusers and Comfy layouts."""
    root = tmp_path_factory.mktemp("ckpt")
    official = save_official(root / "official", tiny_cfg, tiny_states, torch.float32, shards=3)
    diffusers = save_diffusers(root / "diffusers", tiny_cfg,
                               {"transformer": tiny_states["FL2VA"], "transformer_ref": tiny_states["Ref2VA"]},
                               torch.float32)
    comfy = save_comfy(root / "comfy" / "h3.safetensors", tiny_cfg, tiny_states["FL2VA"], torch.float32)
    return {"official": official, "diffusers": diffusers, "comfy": comfy}


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """A private cache for the embedded tiny default, shared by every test of the session."""
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session")
def tiny_root(tiny_cache):
    from h3trt.models.tiny import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint()


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if anything loads a model or a bundle: what a refusal "before any model loads" promises."""
    from h3trt.pipeline.h3_pipeline import H3Pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(H3Pipeline, "load", refuse)
    monkeypatch.setattr(H3Pipeline, "load_engine", refuse)


@pytest.fixture(scope="session")
def signing_keys(tmp_path_factory):
    """Two Ed25519 key pairs as `h3trt keygen` makes them, {name: (private, public)}: the builder's and another's."""
    from h3trt.engines.signing import generate_key

    root = tmp_path_factory.mktemp("keys")
    return {name: generate_key(root / name) for name in ("builder", "other")}


class Built(NamedTuple):
    path: Path  # the bundle: shared by every test that built the same flags, so never changed (copy it to edit it)
    stdout: str  # what its `h3trt build` printed
    stderr: str


class BundleCache:
    """Tiny bundles by their `h3trt build` flags, each built once per test run: every module that builds the same
    flags shares it, across both xdist workers (the first to ask builds under a file lock; the other waits, then reads
    it, or its failure). Each is built by the CLI in a fresh process, as users build (a process that already serves a
    bundle refuses to build, and any earlier test may have loaded one). The folder is the run's (see shared_root)."""

    def __init__(self, root: Path):
        self.root = root

    def get(self, *flags: str, timeout: float = 1800) -> Built:
        """`h3trt build --model tiny --device cpu FLAGS`'s bundle."""
        from filelock import FileLock

        flags = ("--model", "tiny", "--device", "cpu", *flags)
        folder = self.root / hashlib.sha256("\0".join(flags).encode()).hexdigest()[:16]
        self.root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder) + ".lock"):
            if not (folder / "returncode").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                proc = subprocess.run([sys.executable, "-m", "h3trt.cli", "build", *flags, "--output",
                                       str(folder / "bundle")], capture_output=True, text=True, timeout=timeout)
                (folder / "flags").write_text(shlex.join(flags))
                (folder / "stdout").write_text(proc.stdout)
                (folder / "stderr").write_text(proc.stderr)
                (folder / "returncode").write_text(str(proc.returncode))  # last: the others read a whole build
        built = Built(folder / "bundle", (folder / "stdout").read_text(), (folder / "stderr").read_text())
        assert (folder / "returncode").read_text() == "0", f"h3trt build {shlex.join(flags)}:\n{built.stderr[-3000:]}"
        return built


def shared_root(tmp_path_factory) -> Path:
    """A folder of this test run that both xdist workers see: the parent of a worker's base folder (pytest-N/, which
    holds popen-gw0/ and popen-gw1/), else the base folder itself."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"


@pytest.fixture(scope="session")
def bundle_cache(tmp_path_factory, tiny_cache) -> BundleCache:
    return BundleCache(shared_root(tmp_path_factory) / "bundles")


@pytest.fixture(scope="session")
def bundles(tmp_path_factory, bundle_cache, signing_keys):
    """fp32 CPU bundles of the tiny model at its 160x96x5 profile, for BUNDLE_STEPS steps: inductor (AdaLN baked; a
    copy of the shared plain bundle, signed by signing_keys["builder"] as `--sign` signs) and aoti (--keep-adaln,
    unsigned)."""
    from h3trt.engines.signing import load_private_key, sign_bundle

    root = tmp_path_factory.mktemp("bundles")
    shutil.copytree(bundle_cache.get(*PLAIN_BUNDLE).path, root / "inductor")
    sign_bundle(root / "inductor", load_private_key(signing_keys["builder"][0]))
    return {"inductor": root / "inductor",
            "aoti": bundle_cache.get(*PLAIN_BUNDLE, "--backend", "aoti", "--keep-adaln").path}


@pytest.fixture(scope="session")
def postgres():
    """A throwaway PostgreSQL server (tests/postgres.py), one per test process; each user makes its own database."""
    sys.path.insert(0, os.path.dirname(__file__))
    from postgres import Postgres

    server = Postgres()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3():
    """A local S3-compatible server: moto's server mode, a stand-in for a fleet's object storage (AWS S3, MinIO, ...),
    on a free port in a thread of this process, with a fresh bucket. Sets boto's environment (credentials, region,
    AWS_ENDPOINT_URL) for this process and the processes it starts, as a fleet's nodes would have it; yields
    (bucket, boto3 client)."""
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3")
    client.create_bucket(Bucket="h3trt-test")
    yield "h3trt-test", client
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def h3trt(capsys):
    """cli.main as the `h3trt` script calls it: returns (exit status, stderr lines)."""
    from h3trt import cli

    def run(*argv: str) -> tuple[int, list[str]]:
        try:
            code = cli.main(list(argv))
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err.strip().splitlines()

    return run
