"""The build floor's whole-against-streamed comparisons (test_build_stream.py, test_build_stream_distilled.py): the
4-layer tiny model's checkpoint, a build's config at the tiny profile, the memory budget between the streamed and
the whole need (what forces a block at a time), a pair of `h3trt build`s in fresh processes and the comparison of
their bundles file by file, and the in-process bake (phases 0-3) of one configuration both ways with the comparison of
its weight files and records.
"""

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from h3trt.build import builder
from h3trt.build.config import BuildConfig, Profile
from h3trt.build.memory import GIB, DeviceMemory, memory_needs
from h3trt.build.plan import plan_build
from h3trt.models.checkpoint.reader import locate_transformer
from h3trt.models.checkpoint.writer import random_state_dict, save_official
from h3trt.models.config import H3Config

LAYERS = 4
PROFILE = Profile(160, 96, 5.0)
# Files whose bytes Inductor makes differently on every compile, whole or streamed alike (two whole builds of the same
# model differ there too: shared objects and pickled graphs carry build paths and ids, so even their sizes follow the
# output folder's name): compared by name where the name is stable, by count where the name hashes the bytes.
COMPILED_BINARY = (".so", ".bin", ".pt2")
HASH_NAMED = ("inductor_cache/fxgraph/", "inductor_cache/aotautograd/")


def tiny_checkpoint(root: Path, tiny_root: Path, cfg: H3Config, seed: int) -> None:
    """`cfg`'s random float32 weights at root/ckpt (official layout, 3 shards), the other components the tiny
    default's."""
    save_official(root / "ckpt", cfg, {"FL2VA": random_state_dict(cfg, seed)}, torch.float32, shards=3)
    for name in os.listdir(tiny_root / "FL2VA"):
        if name not in ("transformer", "model_index.json"):
            os.symlink(tiny_root / "FL2VA" / name, root / "ckpt" / "FL2VA" / name)


def config(root: Path, out: Path, **kw) -> BuildConfig:
    return BuildConfig(root / "ckpt", out, profiles=(PROFILE,), device="cpu", overwrite=True, **kw)


def streamed_budget(cfg: BuildConfig) -> float:
    """GiB between the streamed need and the whole one: what forces a block at a time."""
    needs = memory_needs(cfg, locate_transformer(cfg.model_root, cfg.task), cfg.precision.spec.dtype)
    assert needs.streamed() < needs.whole(), needs
    return (needs.streamed() + needs.whole()) / 2 / GIB


def build_pair(out: Path, root: Path, flags: list[str], budget: float) -> tuple[Path, Path, dict[str, str]]:
    """`h3trt build` of root/ckpt with `flags`, whole and a block at a time (`budget` GiB), each in a fresh process:
    (the whole bundle, the streamed one, each build's log)."""
    logs = {}
    for name, extra in (("whole", []), ("streamed", ["--memory-budget", f"{budget:.9f}"])):
        proc = subprocess.run([sys.executable, "-m", "h3trt.cli", "build", "--model", str(root / "ckpt"), "--output",
                               str(out / name), "--device", "cpu", "--profile", "160x96x5", *flags, *extra],
                              capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-3000:]
        logs[name] = proc.stderr
    return out / "whole", out / "streamed", logs


def _files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def _manifest_without_build_facts(path: Path) -> dict:
    """The manifest less what differs between any two builds: timings and memory, the calibration's seconds, the
    compiled binaries' hashes (and the manifest's own hash, which covers them)."""
    data = json.loads((path / "manifest.json").read_text())
    data.pop("build_timings_s")
    data.pop("manifest_sha256", None)
    if data["quant"] is not None:
        data["quant"].pop("calibration_s")
    data["files"] = {name: entry for name, entry in data["files"].items()
                     if not name.endswith(COMPILED_BINARY) and not name.startswith(HASH_NAMED)}
    return data


def assert_same_bundle(whole: Path, streamed: Path, logs: dict[str, str]) -> dict:
    """Every file of the two bundles equal but the compiled binaries, the manifests equal but the build's facts:
    returns the whole build's manifest, less those."""
    assert "building whole" in logs["whole"] and "building a block at a time" in logs["streamed"]
    a, b = _files(whole), _files(streamed)
    stable = {n for n in a if not n.startswith(HASH_NAMED)}
    assert stable == {n for n in b if not n.startswith(HASH_NAMED)}
    for name in sorted(n for n in stable - {"manifest.json"} if not n.endswith(COMPILED_BINARY)):
        assert filecmp.cmp(a[name], b[name], shallow=False), f"{name} differs"
    assert len([n for n in a if n.startswith(HASH_NAMED)]) == len([n for n in b if n.startswith(HASH_NAMED)])
    for weights in ("embed", "blocks", "final", "adaln_tables"):
        assert f"weights/{weights}.safetensors" in stable
    mw, ms = _manifest_without_build_facts(whole), _manifest_without_build_facts(streamed)
    assert mw == ms
    assert json.loads((streamed / "manifest.json").read_text())["build_timings_s"]["streamed"] == 1.0
    return mw


def weights_of(cfg: BuildConfig, work: Path, free: int):
    """Phases 0-3 in this process (plan with `free` bytes of device memory, load, calibrate and bake), writing the
    weight files into `work`: (plan, the loaded DiT, Calibration, BakedWeights)."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    plan = plan_build(cfg, lambda m: None, lambda device: DeviceMemory(free, "fake device"))
    dit = builder.load(cfg, plan, lambda m: None)
    calibration, baked = builder.calibrate_and_bake(cfg, plan, dit, work, lambda m: None)
    return plan, dit, calibration, baked


def compare_weights(tmp_path: Path, cfg_kw: dict, root: Path) -> tuple:
    """The weight files and records of the whole and the streamed bake of one configuration: equal."""
    cfg = config(root, tmp_path / "unused", **cfg_kw)
    needs = memory_needs(cfg, locate_transformer(cfg.model_root, cfg.task), cfg.precision.spec.dtype)
    p1, d1, c1, w1 = weights_of(cfg, tmp_path / "whole", 100 * GIB)
    p2, dit, c2, w2 = weights_of(cfg, tmp_path / "streamed", needs.streamed())
    assert not p1.streamed and p2.streamed
    assert (d1.schedules, d1.loras, d1.distilled_record) == (dit.schedules, dit.loras, dit.distilled_record)
    names = sorted(p.name for p in (tmp_path / "whole" / "weights").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "streamed" / "weights").iterdir())
    for name in names:
        assert filecmp.cmp(tmp_path / "whole" / "weights" / name, tmp_path / "streamed" / "weights" / name,
                           shallow=False), f"{name} differs"
    assert w1 == w2
    q1, q2 = (dict(c.quant or {}, calibration_s=None) for c in (c1, c2))
    assert q1 == q2 and c1.recipe == c2.recipe
    return dit, c2
