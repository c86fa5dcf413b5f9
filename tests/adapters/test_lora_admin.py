"""Adapters loaded and unloaded while a server runs (issue 38 item 2; adapters/catalog.py, the rank's slot
cache in adapters/resident.py ResidentAdapters, the admin calls in server/lora_routes.py), in this process:

  - the ranks' slots are a cache keyed by sha256: more distinct adapters than slots across requests, each request's
    denoise equals its one-adapter run bit for bit, and the slot evicted is the least recently used one that the
    same evaluation does not use
  - a job runs only the file it was admitted with: changed or gone, it fails naming it
  - the set survives a restart (the state file in the data folder)
  - every bad admin call is a 400 (404 for an unknown name) in OpenAI's envelope naming the field, and needs the key
"""

import hashlib
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lora_cases import PROMPT, fmt_original, tiny_factors, write

from h3trt.adapters.catalog import STATE_FILE, AdapterCatalog
from h3trt.adapters.shape import SlotShape
from h3trt.adapters.spec import AdapterSpec
from h3trt.adapters.use import parse_lora_field
from h3trt.adapters.use import AdapterUse
from h3trt.errors import UserError
from h3trt.jobs.model_source import Entry
from h3trt.models.config import H3Config
from h3trt.models.lora_format import LoraError
from h3trt.pipeline.prepare import prepare
from h3trt.request.request import Request

KEY = "test-key-lora-admin"


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def rank8(seed: int) -> dict:
    """Rank-8 factors on the first block's MLP (over a --lora-max-rank 4)."""
    g = torch.Generator().manual_seed(seed)
    return {"blocks.0.mlp.fc2": (torch.randn(8, 96, generator=g), torch.randn(64, 8, generator=g))}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """--lora-dir: a, b, c (rank 4 everywhere) and files the admin call must refuse."""
    d = tmp_path_factory.mktemp("lora-dir")
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        write(d / f"{name}.safetensors", fmt_original(tiny_factors(seed)))
    return d


def use(folder: Path, name: str, scale: float = 1.0) -> AdapterUse:
    """`name` as a server's admission resolves it: its file and sha256 now."""
    path = folder / f"{name}.safetensors"
    return AdapterUse(name, scale, str(path), sha256(path))


def final_of(pipe, uses: tuple[AdapterUse, ...]):
    _, _, final = pipe.denoise_request(prepare(Request.of(PROMPT, steps=2, lora=uses), pipe.canvas))
    return final


def test_the_slots_are_a_cache_and_each_request_equals_its_one_adapter_run(folder, tiny_cache):
    """One model loaded; each pipeline built from its parts with adapters of its own (constructors take built
    parts): the cache's with 2 slots of rank 4 holding a at start, and one per adapter holding only it (fitted: one
    slot of rank 4, the same banks' shapes, so the same clip bit for bit)."""
    from h3trt.adapters.resident import ResidentAdapters
    from h3trt.pipeline.h3_pipeline import H3Pipeline
    from h3trt.pipeline.loading import load_checkpoint

    entry = Entry.local(device="cpu")
    parts = load_checkpoint(entry.model.root, "t2va", "cpu")
    cfg, cpu = H3Config.tiny(), torch.device("cpu")

    def pipeline(*names: str, shape: SlotShape | None = None) -> H3Pipeline:
        specs = tuple(AdapterSpec(n, folder / f"{n}.safetensors") for n in names)
        adapters = ResidentAdapters(specs, cfg, "t2va", torch.float32, cpu, shape)
        return H3Pipeline.from_components(replace(parts, adapters=adapters), cpu, entry.model.canvas)

    pipe = pipeline("a", shape=SlotShape(2, 4))
    alone = {name: final_of(pipeline(name), (AdapterUse(name, 1.0),)) for name in "abc"}

    def held() -> dict[int, str]:
        return {slot: record.file for slot, record in pipe.adapters.slots.records.items()}

    assert held() == {0: "a.safetensors"}  # the adapter at start, loaded with the model
    # b: a free slot. a: cached (now the most recent). c: no free slot, so the least recently used (b) goes.
    for name, after in (("b", {0: "a.safetensors", 1: "b.safetensors"}),
                        ("a", {0: "a.safetensors", 1: "b.safetensors"}),
                        ("c", {0: "a.safetensors", 1: "c.safetensors"}),
                        ("b", {0: "b.safetensors", 1: "c.safetensors"})):
        got = final_of(pipe, (use(folder, name),))
        assert torch.equal(got.video, alone[name].video) and torch.equal(got.audio, alone[name].audio), name
        assert held() == after, (name, held())
    # Two adapters in one evaluation, neither cached at the right moment: a evicts c (least recently used), then c
    # evicts b, never a, which this evaluation uses.
    want = final_of(pipeline("a", "c"), (AdapterUse("a", 0.5), AdapterUse("c", 1.0)))
    got = final_of(pipe, (use(folder, "a", 0.5), use(folder, "c")))
    assert held() == {0: "c.safetensors", 1: "a.safetensors"}
    assert (got.video - want.video).abs().max().item() <= 1e-5


def test_adapters_at_start_beyond_the_free_slots_are_read_when_first_named(folder, monkeypatch):
    """A --lora-dir may hold many more adapters than the slots: each rank reads at start only those that fill the
    free slots (a full-size adapter is hundreds of MB); one named later by a request is read then, once."""
    import h3trt.adapters.resident as resident_module
    from h3trt.adapters.slots import AdapterSlots

    read = []
    real = AdapterSlots.read
    monkeypatch.setattr(AdapterSlots, "read", lambda self, path: read.append(Path(path).name) or real(self, path))
    specs = tuple(AdapterSpec(n, folder / f"{n}.safetensors") for n in "abc")
    resident = resident_module.ResidentAdapters(specs, H3Config.tiny(), "t2va", torch.float32, torch.device("cpu"),
                                         SlotShape(1, 4))
    assert read == ["a.safetensors"]
    run = resident.select((AdapterUse("c", 0.5),))
    assert read == ["a.safetensors", "c.safetensors"] and run.uses == ((0, 0.5),)
    assert resident.slots.records[0].sha256 == sha256(folder / "c.safetensors")
    assert resident.record((AdapterUse("c", 0.5),))[0]["sha256"] == sha256(folder / "c.safetensors")
    assert len(read) == 2  # the record named it without reading it again


def test_a_job_runs_only_the_file_it_was_admitted_with(folder, tmp_path):
    from h3trt.adapters.resident import ResidentAdapters

    cache = ResidentAdapters((), H3Config.tiny(), "t2va", torch.float32, torch.device("cpu"), SlotShape(1, 4))
    moved = tmp_path / "x.safetensors"
    moved.write_bytes((folder / "b.safetensors").read_bytes())
    admitted = AdapterUse("x", 1.0, str(moved), sha256(moved))
    moved.write_bytes((folder / "c.safetensors").read_bytes())  # replaced after the job was admitted
    with pytest.raises(LoraError, match=rf"lora 'x': its file {moved} changed since the job was admitted"):
        cache.select((admitted,))
    moved.unlink()
    with pytest.raises(LoraError, match=rf"lora 'x': its file {moved} is gone since the job was admitted"):
        cache.select((admitted,))
    assert cache.slots.records == {}  # nothing was loaded


def test_the_set_survives_a_restart_and_a_lost_file_is_logged_not_fatal(folder, tmp_path):
    state, cfg, logged = tmp_path / STATE_FILE, H3Config.tiny(), []
    start = (AdapterSpec("a", folder / "a.safetensors"), AdapterSpec("b", folder / "b.safetensors"))
    first = AdapterCatalog.start(start, cfg, "t2va", folder=folder, state=state)
    assert first.shape == SlotShape(4, 64)  # --lora-dir: room to load more (max(4, 2), max(64, 4))
    first.load("style", "c.safetensors", 0.5)
    first.unload("a")
    copy = folder / "copy.safetensors"
    copy.write_bytes((folder / "a.safetensors").read_bytes())
    first.load("gone", "copy.safetensors")
    copy.unlink()
    again = AdapterCatalog.start(start, cfg, "t2va", folder=folder, state=state,
                                 log=lambda event, **fields: logged.append((event, fields["name"])))
    assert again.names() == ["b", "style"] and again.specs()[1].scale == 0.5
    assert logged == [("lora_skipped", "gone")]
    assert json.loads(state.read_text()) == {"loaded": [{"name": "style", "file": "c.safetensors", "scale": 0.5}],
                                             "unloaded": ["a"]}
    # Resolution: the file and hash of now; a later reload of the name never changes what was resolved.
    resolved = again.resolve((AdapterUse("style"),))
    assert resolved == (AdapterUse("style", 0.5, str(folder / "c.safetensors"), sha256(folder / "c.safetensors")),)
    again.unload("style")
    again.load("style", "a.safetensors")
    assert resolved[0].sha256 == sha256(folder / "c.safetensors")
    # Without --lora-dir the set is fixed and fits the adapters exactly.
    fixed = AdapterCatalog.start(start, cfg, "t2va")
    assert fixed.shape == SlotShape(2, 4)
    with pytest.raises(UserError, match="started without one; start it with --lora-dir DIR") as e:
        fixed.load("c", "c.safetensors")
    assert e.value.field == "file"


# --- the admin calls over HTTP (the app in this process, no workers) -------------------------------------------------


@pytest.fixture(scope="module")
def admin(folder, tmp_path_factory, tiny_cache):
    from fastapi.testclient import TestClient

    from h3trt.server.app import create_app
    from h3trt.server.metrics import Metrics
    from h3trt.server.options import ServeOptions
    from h3trt.server.service import VideoService
    from h3trt.server.storage import Storage
    from h3trt.server.store import JobStore, sqlite_url

    from stand_ins import NoGroups

    data = tmp_path_factory.mktemp("admin")
    for sub in ("clips", "uploads"):
        (data / sub).mkdir()
    lora_dir = tmp_path_factory.mktemp("admin-loras")
    for name in ("a", "b"):
        (lora_dir / f"{name}.safetensors").write_bytes((folder / f"{name}.safetensors").read_bytes())
    entry = Entry.local(device="cpu", folder=lora_dir, num_slots=2, max_rank=4)
    adapters = entry.adapter_catalog(data / STATE_FILE)
    # Files that arrive in the folder while the server runs, which the admin call must refuse.
    write(lora_dir / "big.safetensors", fmt_original(rank8(4)))
    write(lora_dir / "dora.safetensors", {**fmt_original(tiny_factors(5)),
                                          "blocks.0.attn.out_proj.dora_scale": torch.ones(64)})
    g = torch.Generator().manual_seed(6)
    write(lora_dir / "head.safetensors", fmt_original({"final_layer.video_out": (torch.randn(4, 64, generator=g),
                                                                                  torch.randn(96, 4, generator=g))}))
    (lora_dir / "notes.txt").write_text("not a LoRA")
    outside = data / "outside.safetensors"
    outside.write_bytes((folder / "c.safetensors").read_bytes())
    os.symlink(outside, lora_dir / "link.safetensors")
    service = VideoService(entry, ServeOptions(data, api_key=KEY), JobStore(sqlite_url(data)), Storage(data),
                           NoGroups(), Metrics(), log=lambda *a, **k: None, adapters=adapters)
    client = TestClient(create_app(service), raise_server_exceptions=False)
    client.headers["Authorization"] = f"Bearer {KEY}"
    yield client, service, lora_dir
    service.store.close()


def _error(r, status: int, param: str | None, words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_an_adapters_scale_is_bounded_where_it_is_stated_and_the_schema_says_so(admin, folder, capsys):
    """A strength of 1e30 held a worker through its whole denoise to fail as numerical_error: a request's scale, an
    admin call's default, --adapter's and --lora's are refused outside the one bound, which the API's schema states."""
    from h3trt.adapters.use import MAX_LORA_SCALE
    from h3trt.cli import main

    client, service, _ = admin
    words = f"must be a finite number from {-MAX_LORA_SCALE:g} to {MAX_LORA_SCALE:g}"
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    props = body["properties"] if "properties" in body else spec["components"]["schemas"][
        body["$ref"].rsplit("/", 1)[1]]["properties"]
    assert props["lora"]["items"]["properties"]["scale"] == {"type": "number", "minimum": -MAX_LORA_SCALE,
                                                             "maximum": MAX_LORA_SCALE}
    admin_body = spec["paths"]["/v1/loras"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert (admin_body["properties"]["scale"]["minimum"], admin_body["properties"]["scale"]["maximum"]) == (
        -MAX_LORA_SCALE, MAX_LORA_SCALE)
    before = service.store.counts().get("queued", 0)
    for scale in (1e30, -MAX_LORA_SCALE - 1, 10 ** 400):
        _error(client.post("/v1/videos", json={"prompt": "x", "size": "128x32", "steps": 2,
                                               "lora": [{"name": "a", "scale": scale}]}), 400, "lora", words)
        _error(client.post("/v1/loras", json={"name": "huge", "file": "a.safetensors", "scale": scale}), 400,
               "scale", words)
    assert service.store.counts().get("queued", 0) == before and "huge" not in service.adapters.names()
    a = folder / "a.safetensors"
    for flag, value in (("--adapter", f"a={a}:1e30"), ("--lora", f"{a}:-101")):
        with pytest.raises(SystemExit) as refused:
            main(["run", "--prompt", "x", "--output", "x.mp4", flag, value])
        assert refused.value.code == 2 and f"the scale {words}" in capsys.readouterr().err
    for scale in (-MAX_LORA_SCALE, MAX_LORA_SCALE):  # the edges are taken
        assert parse_lora_field([{"name": "a", "scale": scale}]) == (AdapterUse("a", scale),)
        assert AdapterSpec.parse(f"a={a}:{scale}").scale == scale


def test_admin_and_adapter_errors_name_the_fix_this_server_takes(admin, tmp_path, tiny_cache):
    """An absolute path inside --lora-dir was refused as "outside"; a rank over a checkpoint server's slots pointed at
    h3trt build; more adapters than the slots blamed "the server's --lora-slots" (a bundle's are its build's); a fleet,
    which refuses --lora-dir, was told to start with it."""
    from h3trt.server.metrics import Metrics
    from h3trt.server.options import ServeOptions
    from h3trt.server.service import ApiError, VideoService
    from h3trt.server.storage import Storage
    from h3trt.server.store import JobStore, sqlite_url

    from stand_ins import NoGroups

    client, service, lora_dir = admin
    error = _error(client.post("/v1/loras", json={"name": "x", "file": str(lora_dir / "a.safetensors")}), 400,
                   "file", "an absolute path, '..', a backslash or a NUL is refused")
    assert "outside" not in error["message"]
    _error(client.post("/v1/loras", json={"name": "x", "file": "big.safetensors"}), 400, "file",
           "create the slots with max rank >= 8 (a model's: h3trt serve --lora-max-rank;")
    assert client.post("/v1/loras", json={"name": "third", "file": "a.safetensors"}).status_code == 200
    try:
        error = _error(client.post("/v1/videos", json={"prompt": "x", "size": "128x32", "steps": 2, "lora": [
            {"name": "a"}, {"name": "b"}, {"name": "third"}]}), 400, "lora", "at most 2 (the model's LoRA slots)")
        assert "--" not in error["message"]
    finally:
        client.delete("/v1/loras/third")
    for fleet, words in ((True, "a fleet (h3trt serve --ray) loads no adapter while it serves"),
                         (False, "started without one; start it with --lora-dir DIR")):
        other = VideoService(Entry.local(device="cpu"), ServeOptions(tmp_path), JobStore(sqlite_url(tmp_path)),
                             Storage(tmp_path), NoGroups(), Metrics(), log=lambda *a, **k: None, fleet=fleet)
        try:
            with pytest.raises(ApiError, match=re.escape(words)) as refused:
                other.load_lora({"name": "x", "file": "a.safetensors"})
            assert refused.value.param == "file" and ("--lora-dir" not in str(refused.value)) == fleet
        finally:
            other.store.close()


def test_load_list_and_unload_while_serving(admin):
    from h3trt.server.queue import StoreQueue
    from h3trt.server.service import request_defaults

    client, service, lora_dir = admin
    assert [x["name"] for x in client.get("/v1/loras").json()["data"]] == ["a", "b"]  # --lora-dir's, by stem
    r = client.post("/v1/loras", json={"name": "style", "file": "a.safetensors", "scale": 0.5})
    assert r.status_code == 200, r.text
    assert {k: r.json()[k] for k in ("name", "file", "scale", "rank")} == {"name": "style", "file": "a.safetensors",
                                                                           "scale": 0.5, "rank": 4}
    assert "style" in [x["name"] for x in client.get("/v1/loras").json()["data"]]
    job = client.post("/v1/videos", json={"prompt": "x", "size": "128x32", "steps": 2, "lora": [{"name": "style"}]})
    assert job.status_code == 200, job.text
    resolved = {"name": "style", "file": "a.safetensors", "sha256": sha256(lora_dir / "a.safetensors"), "scale": 0.5}
    assert job.json()["lora"] == [resolved]  # the job object names what admission resolved
    assert client.delete("/v1/loras/style").json() == {"name": "style", "object": "lora", "deleted": True}
    _error(client.post("/v1/videos", json={"prompt": "x", "lora": [{"name": "style"}]}), 400, "lora",
           "not resident here")
    # The name loaded again with another file: the queued job keeps what it was admitted with, shown and run.
    assert client.post("/v1/loras", json={"name": "style", "file": "b.safetensors"}).status_code == 200
    assert client.get(f"/v1/videos/{job.json()['id']}").json()["lora"] == [resolved]
    queue = StoreQueue(service.store, service.storage, 60.0, request_defaults(service.entry), service.metrics,
                       lambda *a, **k: None)
    taken = queue.take(0, 1)
    assert [j.id for j in taken] == [job.json()["id"]]
    assert taken[0].request.adapters == (AdapterUse("style", 0.5, str(lora_dir / "a.safetensors"),
                                                sha256(lora_dir / "a.safetensors")),)
    assert client.delete("/v1/loras/style").status_code == 200


def test_an_adapter_loaded_while_serving_brings_its_schedule_and_its_jobs_keep_it(admin):
    """A Turbo-like file (its schedule in its metadata) loaded by the admin call: a job naming it and stating no steps
    runs the adapter's steps, and keeps them when the adapter is unloaded before a worker takes the job (the row
    holds the schedule admission resolved, as it holds the file and hash)."""
    from h3trt.server.queue import StoreQueue
    from h3trt.server.service import request_defaults

    client, service, lora_dir = admin
    write(lora_dir / "fast.safetensors", fmt_original(tiny_factors(7)), {"h3trt.steps": "4", "h3trt.video_shift": "5"})
    r = client.post("/v1/loras", json={"name": "fast", "file": "fast.safetensors"})
    assert r.status_code == 200 and r.json()["schedule"] == {"steps": 4, "video_shift": 5.0}, r.text
    job = client.post("/v1/videos", json={"prompt": "x", "size": "128x32", "lora": [{"name": "fast"}]})
    assert job.status_code == 200 and job.json()["steps"] == 4, job.text
    assert client.delete("/v1/loras/fast").status_code == 200
    queue = StoreQueue(service.store, service.storage, 60.0, request_defaults(service.entry), service.metrics,
                       lambda *a, **k: None)
    (taken,) = queue.take(0, 1)
    assert taken.id == job.json()["id"]
    assert (taken.request.schedule.steps, taken.request.schedule.video_shift) == (4, 5.0)
    assert taken.request.schedule.origin.to_json()["steps"] == "adapter fast"


@pytest.mark.parametrize("body,param,words", [
    ({"name": "x", "file": "a.safetensors", "rank": 4}, "rank", "unknown field(s) ['rank']"),
    ({"file": "a.safetensors"}, "name", "name is required"),
    ({"name": "x"}, "file", "file is required"),
    ({"name": "../x", "file": "a.safetensors"}, "name", "an adapter's name is 1-64 of"),
    ({"name": "a b", "file": "a.safetensors"}, "name", "an adapter's name is 1-64 of"),
    ({"name": "a", "file": "b.safetensors"}, "name", "name 'a' is taken by a loaded adapter"),
    ({"name": "x", "file": "a.safetensors", "scale": "strong"}, "scale", "must be a finite number"),
    ({"name": "x", "file": "a.safetensors", "scale": True}, "scale", "must be a finite number"),
    ({"name": "x", "file": "/etc/passwd.safetensors"}, "file", "an absolute path, '..', a backslash or a NUL is refused"),
    ({"name": "x", "file": "../outside.safetensors"}, "file", "an absolute path, '..', a backslash or a NUL is refused"),
    ({"name": "x", "file": "link.safetensors"}, "file", "it leads outside the server's --lora-dir"),
    ({"name": "x", "file": "notes.txt"}, "file", "name a .safetensors file inside the server's --lora-dir"),
    ({"name": "x", "file": 3}, "file", "name a .safetensors file"),
    ({"name": "x", "file": "nope.safetensors"}, "file", "no such file in the server's --lora-dir"),
    ({"name": "x", "file": "big.safetensors"}, "file", "has rank 8, over the slots' max rank 4"),
    ({"name": "x", "file": "dora.safetensors"}, "file", "file 'dora.safetensors' is a DoRA adapter"),
    ({"name": "x", "file": "head.safetensors"}, "file", "which is not a linear of the main blocks"),
])
def test_every_bad_admin_call_is_a_400_naming_its_field(admin, body, param, words):
    client, service, lora_dir = admin
    before = service.adapters.names()
    error = _error(client.post("/v1/loras", json=body), 400, param, words)
    assert str(lora_dir) not in error["message"]  # the client's words, never the server's path
    assert service.adapters.names() == before


def test_the_admin_calls_need_the_key_and_a_json_object(admin):
    client, service, _ = admin
    for r in (client.post("/v1/loras", json={"name": "x", "file": "a.safetensors"}, headers={"Authorization": ""}),
              client.delete("/v1/loras/a", headers={"Authorization": "Bearer wrong"}),
              client.get("/v1/loras", headers={"Authorization": ""})):
        _error(r, 401, None, "Missing or wrong API key")
    assert "a" in service.adapters.names()
    _error(client.post("/v1/loras", content=b"{", headers={"content-type": "application/json"}), 400, None,
           "not valid JSON")
    _error(client.post("/v1/loras", json=["a"]), 400, None, "must be a JSON object")
    _error(client.delete("/v1/loras/zebra"), 404, "name", "No adapter named 'zebra' is loaded here")


def test_a_server_without_lora_dir_refuses_the_admin_call(tmp_path, tiny_cache):
    from stand_ins import api_client

    client, service = api_client(tmp_path)
    _error(client.post("/v1/loras", json={"name": "x", "file": "a.safetensors"}), 400, "file",
           "started without one; start it with --lora-dir DIR")
    service.store.close()


def test_a_lora_dir_file_the_server_cannot_serve_is_skipped_listed_and_named_to_jobs(folder, tmp_path, tiny_cache,
                                                                                     monkeypatch):
    """A file in --lora-dir that POST /v1/loras refuses (garbage, truncated, a link out of the folder, a name that is
    no adapter's or is taken, a rank over the slots) made the next `serve --lora-dir DIR` exit 2: the service stayed
    down until someone cleaned the folder. It starts without them, logs each (lora_skipped), GET /v1/loras lists them
    with why, and a job naming one is refused with that reason; so are the adapters loras.json names that fail now."""
    from fastapi.testclient import TestClient

    from h3trt.adapters import memory as slots_memory
    from h3trt.adapters.memory import unit_bytes
    from h3trt.server.app import create_app
    from h3trt.server.metrics import Metrics
    from h3trt.server.options import ServeOptions
    from h3trt.server.service import VideoService
    from h3trt.server.storage import Storage
    from h3trt.server.store import JobStore, sqlite_url

    from stand_ins import NoGroups

    good = (folder / "a.safetensors").read_bytes()
    d, data = tmp_path / "loras", tmp_path / "data"
    d.mkdir()
    for sub in ("clips", "uploads"):
        (data / sub).mkdir(parents=True)
    for name, content in (("a", good), ("garbage", b"not a safetensors file"), ("truncated", good[:len(good) // 2]),
                          ("-x", good), ("dup", good), ("later", good)):
        (d / f"{name}.safetensors").write_bytes(content)
    (tmp_path / "outside.safetensors").write_bytes(good)
    os.symlink(tmp_path / "outside.safetensors", d / "link.safetensors")
    write(d / "big.safetensors", fmt_original(rank8(4)))
    flag = (AdapterSpec("dup", folder / "b.safetensors"),)
    entry = Entry.local(device="cpu", adapters=flag, folder=d, num_slots=2, max_rank=4)
    entry.adapter_catalog(data / STATE_FILE).unload("later")  # kept in loras.json: started without, for good
    catalog = entry.adapter_catalog(data / STATE_FILE)
    catalog.load("again", "later.safetensors", 0.5)  # loras.json: loaded; its file goes bad before the restart
    (d / "later.safetensors").write_bytes(b"broken since")
    logged = []
    catalog = entry.adapter_catalog(data / STATE_FILE, lambda event, **f: logged.append((event, f["name"])))
    assert catalog.names() == ["dup", "a"]
    why = {s.name: (s.file, s.source, s.reason) for s in catalog.skipped()}
    assert sorted(why) == ["-x", "again", "big", "dup", "garbage", "link", "truncated"]
    assert sorted(logged) == [("lora_skipped", name) for name in sorted(why)]
    for name, words in (("-x", "its stem is not an adapter's name"), ("dup", "the name is taken"),
                        ("garbage", "not a readable safetensors file"), ("truncated", "not a readable safetensors"),
                        ("link", "it leads outside the server's --lora-dir (a link)"),
                        ("big", "has rank 8, over the slots' max rank 4"), ("again", "not a readable safetensors")):
        assert words in why[name][2] and str(tmp_path) not in why[name][2], (name, why[name])
    assert why["again"][:2] == ("later.safetensors", STATE_FILE) and why["big"][:2] == ("big.safetensors", "--lora-dir")
    service = VideoService(entry, ServeOptions(data), JobStore(sqlite_url(data)), Storage(data), NoGroups(), Metrics(),
                           log=lambda *a, **k: None, adapters=catalog)
    try:
        client = TestClient(create_app(service), raise_server_exceptions=False)
        listed = client.get("/v1/loras").json()
        assert [x["name"] for x in listed["data"]] == ["dup", "a"]
        assert {s["name"]: s["reason"] for s in listed["skipped"]} == {n: w[2] for n, w in why.items()}
        error = _error(client.post("/v1/videos", json={"prompt": "x", "size": "128x32", "steps": 2,
                                                       "lora": [{"name": "garbage"}]}), 400, "lora",
                       "lora 'garbage': this server started without it (--lora-dir file 'garbage.safetensors': ")
        assert why["garbage"][2] in error["message"] and service.store.counts().get("queued", 0) == 0
    finally:
        service.store.close()
    # A rank the memory cannot hold for the slots fitted at start is skipped too (the set stays up).
    write(d / "huge.safetensors", fmt_original({"blocks.0.mlp.fc2": (torch.randn(128, 96), torch.randn(64, 128))}))
    unit = unit_bytes(H3Config.tiny(), dtype=torch.float32)
    monkeypatch.setattr(slots_memory, "memory_of", lambda device: (4 * 100 * unit, "a small host"))
    fitted = Entry.local(device="cpu", folder=d).adapter_catalog()
    assert fitted.shape == SlotShape(4, 64) and "huge" not in fitted.names()
    assert "rank 128, over the largest rank these slots may have in memory (100)" in {
        s.name: s.reason for s in fitted.skipped()}["huge"]


def test_the_flags_are_checked_before_anything_loads(folder, tmp_path, capsys):
    from h3trt.cli import main

    entry = Entry.local(device="cpu", adapters=(AdapterSpec("x", folder / "a.safetensors"),), folder=folder)
    assert [s.name for s in entry.adapters.specs] == ["x", "a", "b", "c"]  # --adapter, then DIR's files by stem
    for kwargs, words in (({"folder": tmp_path / "none"}, "--lora-dir .*none: not a folder"),
                          ({"num_slots": 2}, "--lora-slots and --lora-max-rank size the slots of LoRA adapters"),
                          ({"adapters": (AdapterSpec("a", folder / "a.safetensors"),
                                         AdapterSpec("a", folder / "b.safetensors"))},
                           "--adapter a: the name is given twice")):
        with pytest.raises(UserError, match=words):
            Entry.local(device="cpu", **kwargs)
    with pytest.raises(UserError, match=r"--adapter big: .* has rank 8, over the slots' max rank 4"):
        write(tmp_path / "big.safetensors", fmt_original(rank8(4)))
        AdapterCatalog.start((AdapterSpec("big", tmp_path / "big.safetensors"),), H3Config.tiny(), "t2va",
                             max_rank=4, folder=folder)
    assert main(["serve", "--ray", "auto", "--lora-dir", str(folder)]) == 2
    assert "a fleet (--ray) serves the adapters it was deployed with" in capsys.readouterr().err
