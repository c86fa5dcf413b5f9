"""`h3trt serve --adapter NAME=FILE[:SCALE]` (issue 38 item 2, the eager path): two adapters resident in a real server
process (the tiny model on the CPU), GET /v1/loras lists them, jobs interleaved A, B, A, none each get their own
adapter (A's two clips are the same clip, B's and the plain one differ), the record and the job object name them,
and every bad `lora` is a 400 with param lora before anything is queued."""

import hashlib
import json

import pytest

from serving import Server, png
from lora_cases import fmt_kohya, fmt_original, tiny_factors, write

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_cache):
    folder = tmp_path_factory.mktemp("adapters")
    a = write(folder / "a.safetensors", fmt_original(tiny_factors(1)))
    b = write(folder / "b.safetensors", fmt_kohya(tiny_factors(2), {"blocks.0.mlp.fc1": 2.0}))
    srv = Server(tmp_path_factory.mktemp("serve") / "data", "--device", "cpu", "--adapter", f"a={a}:0.7",
                 "--adapter", f"b={b}")
    try:
        srv.wait("/ready")
        yield srv, a, b
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_loras_are_listed(served):
    server, a, b = served
    with server.http() as c:
        listed = c.get("/v1/loras").json()
    assert listed["object"] == "list" and [x["name"] for x in listed["data"]] == ["a", "b"]
    first = listed["data"][0]
    assert (first["file"], first["sha256"], first["scale"], first["rank"]) == ("a.safetensors", sha256(a), 0.7, 4)
    assert "blocks.0.attn.qkv_proj" in first["targets"] and first["size_bytes"] > 0


def test_each_job_runs_with_its_own_adapter(served):
    server, a, b = served
    jobs = [server.create(prompt="a fox", seed=3, **extra)
            for extra in ({"lora": [{"name": "a"}]}, {"lora": [{"name": "b", "scale": 0.5}]},
                          {"lora": [{"name": "a"}]}, {})]
    done = [server.wait_job(j["id"]) for j in jobs]
    assert [j["status"] for j in done] == ["completed"] * 4, done
    records = [json.loads((server.data_dir / "clips" / f"{j['id']}.attempt1.json").read_text()) for j in jobs]
    assert records[0]["adapters"] == [{"name": "a", "file": "a.safetensors", "sha256": sha256(a), "scale": 0.7}]
    assert records[1]["adapters"] == [{"name": "b", "file": "b.safetensors", "sha256": sha256(b), "scale": 0.5}]
    assert "adapters" not in records[3]
    clips = [r["mp4_sha256"] for r in records]
    assert clips[0] == clips[2] and len(set(clips)) == 3  # A twice is one clip; B and none are others
    assert done[0]["lora"] == records[0]["adapters"] and "lora" not in done[3]  # the job object, absent when none


@pytest.mark.parametrize("lora,words", [
    ([{"name": "zebra"}], "not resident here; the resident adapters are ['a', 'b']"),
    ([{"name": "a"}, {"name": "b"}, {"name": "c"}], "asks for 3 adapters, but this model holds 2"),
    ([{"name": "a", "scale": "strong"}], "scale must be a finite number"),
    ({"name": "a"}, "lora must be a list"),
    ("a", "lora must be a JSON list"),
])
def test_a_bad_lora_is_a_400_naming_it(served, lora, words):
    server = served[0]
    with server.http() as c:
        before = len(c.get("/v1/videos", params={"limit": 100}).json()["data"])
        r = c.post("/v1/videos", json={"prompt": "x", "lora": lora})
        after = len(c.get("/v1/videos", params={"limit": 100}).json()["data"])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "lora" and words in error["message"], error
    assert after == before


def test_multipart_sends_lora_as_json_text(served, tmp_path):
    server = served[0]
    first = png(tmp_path / "first.png", 1)
    with server.http() as c:
        r = c.post("/v1/videos", data={"prompt": "x", "size": "128x32", "steps": "2",
                                       "lora": json.dumps([{"name": "b"}])},
                   files=[("input_reference", ("first.png", first.read_bytes(), "image/png"))])
    assert r.status_code == 200, r.text
    job = server.wait_job(r.json()["id"])
    assert job["status"] == "completed" and job["lora"][0]["name"] == "b", job
