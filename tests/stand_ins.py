"""Stand-ins the tests build instead of the real thing, shared across floors: a bundle's manifest as `h3trt build`
writes it (a tiny fp32 CPU bundle) and a bundle folder whose manifest passes every check before a load; a server's
replica groups with none running, and the API over them in this process."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from h3trt.engines.environment import device_arch
from h3trt.engines.manifest import FORMAT_VERSION, content_sha256
from h3trt.models.config import H3Config


def manifest_dict(**changes) -> dict:
    """A format-4 manifest as `h3trt build` writes it (a tiny fp32 CPU bundle), with `changes` ("a.b": value)."""
    data = {
        "backend": "inductor", "precision": "fp32", "task": "t2va", "tasks": ["t2va", "fl2va"],
        "model_config": H3Config.tiny().to_dict(),
        "checkpoint": {"path": "/ckpt", "sha256": "0" * 64},
        "schedule": {"steps": 8, "video_shift": 12.0, "audio_shift": 3},
        "adaln": {"baked": True, "timesteps": 14},
        "profiles": [{"width": 160, "height": 96, "seconds": 5.0, "num_frames": 124}],
        "mesh": {"cfg": 1, "sp": 1, "heads_per_rank": 2, "rows_per_rank": "ceil(S / sp), symbolic"},
        "arch": "cpu-x86_64", "device": "cpu", "versions": {"torch": "2.13"}, "segments": {}, "weight_bytes": {},
        "tiny": True, "build_timings_s": {}, "quant": None, "attention": {}, "vae_precision": "fp32",
        "video_decoder": {"cuda_graph": True}, "loras": [],
        "format_version": FORMAT_VERSION, "hash_chunk_bytes": 64 << 20,
        "files": {"weights/blocks.safetensors": {"bytes": 10, "sha256_chunks": ["a" * 64]}},
    }
    for key, value in changes.items():
        target = data
        *parents, leaf = key.split(".")
        for p in parents:
            target = target[p]
        target[leaf] = value
    data["manifest_sha256"] = content_sha256(data)
    return data


def fake_bundle(root: Path, tiny_root: Path, **changes) -> Path:
    """A bundle folder whose manifest passes every check before a load (this CPU, this torch), with the tiny model's
    text encoder, tokenizer and processor beside it; its segments are absent, so only a refusal can end a run."""
    root.mkdir()
    data = manifest_dict(**{"arch": device_arch(torch.device("cpu")), "versions.torch": torch.__version__,
                            **changes})
    (root / "manifest.json").write_text(json.dumps(data))
    for name in ("text_encoder", "tokenizer", "processor"):
        (root / name).symlink_to(tiny_root / "FL2VA" / name)
    return root


class NoGroups:
    """The replica groups of a server that runs none: no group to report, none serving."""

    def status(self):
        return []

    def serving(self):
        return 0


API_KEY = "test-key-validation"


def api_client(tmp_path, **options):
    """The API (server/app.py over server/service.py, a SQLite store in `tmp_path`, no workers) in this process, behind
    API_KEY: (a TestClient that sends the key, the service)."""
    from fastapi.testclient import TestClient

    from h3trt.jobs.model_source import Entry
    from h3trt.server.app import create_app
    from h3trt.server.metrics import Metrics
    from h3trt.server.options import ServeOptions
    from h3trt.server.service import VideoService
    from h3trt.server.storage import Storage
    from h3trt.server.store import JobStore, sqlite_url

    for folder in ("clips", "uploads"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    opts = ServeOptions(tmp_path, api_key=API_KEY, max_body_bytes=4_000_000, **options)
    service = VideoService(Entry.local(device="cpu"), opts, JobStore(sqlite_url(tmp_path)), Storage(tmp_path),
                           NoGroups(), Metrics(), log=lambda *a, **k: None)
    client = TestClient(create_app(service), raise_server_exceptions=False)
    client.headers["Authorization"] = f"Bearer {API_KEY}"
    return client, service
