"""Shared test inputs: where the checkout's folders are (the tests live a floor deep, tests/<floor>/, so a test finds
the repository through REPO, never by counting its own parents); the flags of the shared bundles; the random DiT
activations every parity test feeds the model (one generator, drawn in the order video, audio, text, so a seed
reproduces the same tensors wherever it is used) and a random main block with its inputs; small filesystems for the
hardening tests; a distribution made to look not installed; setup.py's version ranges."""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import os
import subprocess
from pathlib import Path

import pytest
import torch

from h3trt.models.config import H3Config
from h3trt.models.dit import Block, rope_inv_freq, rope_tables
from h3trt.models.packing import PackedLayout, pack_t2va, row_timesteps, text_tags_for

TESTS = Path(__file__).resolve().parent  # tests/: this file, conftest.py and the other support modules
REPO = TESTS.parent  # the checkout: h3trt/, scripts/, setup.py, README.md
DATA = TESTS / "data"  # the stored fixtures

BUNDLE_STEPS = 6  # the schedule the shared bundles bake: a served clip is 5 DiT evaluations, not 49
# The flags of the shared bundles (conftest.py BundleCache): the tiny model's fp32 CPU bundle at its 160x96x5 profile
# for BUNDLE_STEPS steps, plain (test_engine.py's, signed there; test_build_hardening.py's old bundle), and with two
# LoRA slots of rank 4 and a second, few-step schedule (test_bundle_lora.py's and test_turbo.py's).
PLAIN_BUNDLE = ("--precision", "fp32", "--profile", "160x96x5", "--steps", str(BUNDLE_STEPS))
SLOT_BUNDLE = ("--precision", "fp32", "--profile", "160x96x5", "--steps", f"{BUNDLE_STEPS},4", "--video-shift", "12,5",
               "--lora-slots", "2", "--lora-max-rank", "4")


def dit_inputs(layout: PackedLayout, cfg: H3Config, seed: int = 0, batch: int = 1,
               text_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random float32 (video [B, V, video_patch_dim], audio [B, A, audio_in_channels], text [B, L, text_dim]) rows
    for `layout`; `text_rows` overrides L (default: the layout's text rows)."""
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(batch, layout.video_index.numel(), cfg.video_patch_dim, generator=g)
    audio = torch.randn(batch, layout.audio_index.numel(), cfg.audio_in_channels, generator=g)
    text = torch.randn(batch, layout.text_index.numel() if text_rows is None else text_rows, cfg.text_dim,
                       generator=g)
    return video, audio, text


def tiny_block(cfg: H3Config, g: torch.Generator, dtype: torch.dtype):
    """A main block of `cfg` with random weights (scale 0.1, drawn from `g`), in `dtype`, eval, with the small t2va
    layout the block tests feed it and its rope tables: (block, layout, rope)."""
    block = Block(cfg)
    for p in block.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.1
    block = block.to(dtype).eval().requires_grad_(False)
    layout = pack_t2va(text_tags_for(9), 3, 4, 6, 5)
    return block, layout, rope_tables(layout.position_ids, rope_inv_freq(cfg))


def tiny_block_inputs(cfg: H3Config, seed: int = 0):
    """`tiny_block` in bf16 and its inputs: (block, (x, modulation, row tags, rope tables)), the arguments of its
    forward."""
    g = torch.Generator().manual_seed(seed)
    block, layout, rope = tiny_block(cfg, g, torch.bfloat16)
    _, t_index = row_timesteps(layout, 0.3, 0.6)
    x = torch.randn(1, layout.seq_len, cfg.hidden_size, generator=g).bfloat16()
    mod = block.modulation(torch.randn(2, cfg.time_embed_dim, generator=g)).contiguous()
    return block, (x, mod, t_index * 3 + layout.token_tags, rope)


def uninstalled(monkeypatch, distribution: str) -> None:
    """importlib.metadata.version(`distribution`) raises PackageNotFoundError, as where it is not installed."""
    real = importlib.metadata.version

    def version(name):
        if name == distribution:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


@contextlib.contextmanager
def small_filesystem(path: Path, size: str, read_only: bool = False):
    """A small (or read-only) filesystem at `path`: a tmpfs mount as root, chmod otherwise (read-only only)."""
    path.mkdir()
    if os.geteuid() != 0:
        if not read_only:
            pytest.skip("a small filesystem needs root (mount -t tmpfs)")
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    opts = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill_disk(folder: Path) -> None:
    """Take every byte left on `folder`'s filesystem (a file `filler` in it), as another writer would."""
    with contextlib.suppress(OSError), open(folder / "filler", "wb") as f:
        while True:
            f.write(b"\0" * 65536)
            f.flush()


def setup_requirements(distribution: str) -> list:
    """Every requirement on `distribution` in this checkout's setup.py (install_requires and every extra), as
    packaging's Requirement: read from the source, not from the installed metadata, which may be another checkout's."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    found = []
    for node in ast.walk(ast.parse((REPO / "setup.py").read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                requirement = Requirement(node.value)
            except InvalidRequirement:
                continue  # a description or a comment-like string, not a requirement
            if canonicalize_name(requirement.name) == canonicalize_name(distribution):
                found.append(requirement)
    return found


class Logged:
    """A server's log (server/log.py) kept in memory: log(event, **fields) appends; `events(name)` the fields of each
    event of that name."""

    def __init__(self):
        self.lines: list[tuple[str, dict]] = []

    def __call__(self, event: str, **fields) -> None:
        self.lines.append((event, fields))

    def events(self, name: str) -> list[dict]:
        return [fields for event, fields in self.lines if event == name]
