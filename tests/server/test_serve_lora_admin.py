"""`h3trt serve --lora-dir DIR` with adapters loaded and unloaded while it runs (issue 38 item 2), against a real server
process (the tiny model on the CPU) with ONE slot (of the default max rank, 64), so that every switch of adapter evicts
the one before:

  - an adapter loaded while the server runs serves the next job, whose clip equals its one-adapter `h3trt run`
  - an unload while a job naming the adapter is queued: that job still completes with it, and a new request naming
    it is a 400 with param lora; the name loaded again with another file never changes the queued job
  - a file removed after its job was admitted: the job fails naming it, and never runs another adapter
  - three adapters through one slot, each clip equal to its one-adapter run (the slots are a cache by sha256)

and, at every default flag (issue 45 item 8), a served clip is its `h3trt run --adapter` clip byte for byte: the
server's slots (4 of rank 64) and run's (fitted to the file: one of rank 4) compute the adapter's own rank rows, never
a slot's padding (adapters/slots.py).
"""

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from serving import SMALL, Server
from lora_cases import fmt_original, tiny_factors, write


pytestmark = pytest.mark.serve

KEY = "test-key-lora-admin-serve"
JOB = {"prompt": "a fox in the snow", "seed": 5, **SMALL}


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    made = tmp_path_factory.mktemp("loras")
    return {name: write(made / f"{name}.safetensors", fmt_original(tiny_factors(seed)))
            for name, seed in (("a", 1), ("b", 2), ("c", 3))}


@pytest.fixture(scope="module")
def run_clip(files, tmp_path_factory):
    """name -> the mp4 sha256 of `one_adapter_clip`, made once per module."""
    made = {}

    def clip(name: str) -> str:
        if name not in made:
            made[name] = one_adapter_clip(files, name, tmp_path_factory.mktemp(f"run-{name}"))
        return made[name]

    return clip


def one_adapter_clip(files, name, tmp_path) -> str:
    """The clip of `h3trt run --requests` with `name` the only adapter it holds, picked by the line: its sha256. Run
    in a process of its own, as the server's rank is: a pytest-xdist worker runs torch on one thread
    (conftest.py), whose sums round otherwise than the rank's, and the clips are compared bit for bit."""
    line = {"id": f"ref-{name}", "task": "t2va", "prompt": JOB["prompt"], "seed": JOB["seed"],
            "resolution": JOB["size"], "steps": JOB["steps"], "lora": [{"name": name}]}
    requests = tmp_path / f"ref-{name}.jsonl"
    requests.write_text(json.dumps(line) + "\n")
    out = tmp_path / f"ref-{name}"
    done = subprocess.run([sys.executable, "-m", "h3trt.cli", "run", "--requests", str(requests), "--out-dir", str(out),
                           "--device", "cpu", "--adapter", f"{name}={files[name]}", "--quiet"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((out / f"ref-{name}.json").read_text())
    assert record["adapters"][0]["sha256"] == sha256(files[name])
    return record["mp4_sha256"]


def test_a_served_clip_at_the_default_flags_is_the_run_clip_byte_for_byte(files, tmp_path, tiny_cache, run_clip):
    folder = tmp_path / "lora-dir"
    folder.mkdir()
    for name in ("a", "b"):  # both resident in the server's 4 slots of rank 64; the run fits its one slot to a
        shutil.copy(files[name], folder / f"{name}.safetensors")
    server = Server(tmp_path / "data", "--device", "cpu", "--lora-dir", str(folder), api_key=KEY)
    try:
        server.wait("/ready")
        with server.http() as c:
            listed = {a["name"]: a for a in c.get("/v1/loras").json()["data"]}
        assert listed["a"]["rank"] == 4
        done = server.wait_job(server.create(**JOB, lora=[{"name": "a"}])["id"])
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert done["status"] == "completed", done
    record = json.loads((server.data_dir / "clips" / f"{done['id']}.attempt1.json").read_text())
    assert record["adapters"] == [{"name": "a", "file": "a.safetensors", "sha256": sha256(files["a"]), "scale": 1.0}]
    assert record["mp4_sha256"] == run_clip("a")


def test_adapters_load_and_unload_while_jobs_run(files, tmp_path, tiny_cache, run_clip):
    folder = tmp_path / "lora-dir"
    folder.mkdir()
    shutil.copy(files["a"], folder / "a.safetensors")  # the adapter at start; b and c arrive while it runs
    # One slot, of the default max rank 64: each one-adapter `h3trt run` fits its only slot to the file (rank 4).
    server = Server(tmp_path / "data", "--device", "cpu", "--lora-dir", str(folder), "--lora-slots", "1",
                    api_key=KEY)
    try:
        server.wait("/ready")
        with server.http() as c:
            blocker = server.create(prompt="hold the worker", steps=1000)  # keeps the next jobs queued
            server.wait_job(blocker["id"], until=("in_progress",))
            shutil.copy(files["b"], folder / "b.safetensors")
            shutil.copy(files["c"], folder / "c.safetensors")
            shutil.copy(files["a"], folder / "gone.safetensors")
            assert c.post("/v1/loras", json={"name": "b", "file": "b.safetensors"}).status_code == 200
            assert c.post("/v1/loras", json={"name": "gone", "file": "gone.safetensors"}).status_code == 200
            queued_b = server.create(**JOB, lora=[{"name": "b"}])
            gone = server.create(**JOB, lora=[{"name": "gone"}])
            assert c.delete("/v1/loras/b").status_code == 200
            refused = c.post("/v1/videos", json={**JOB, "lora": [{"name": "b"}]})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora", refused.text
            assert c.post("/v1/loras", json={"name": "b", "file": "c.safetensors"}).status_code == 200  # reloaded
            reloaded_b = server.create(**JOB, lora=[{"name": "b"}])
            then_a = server.create(**JOB, lora=[{"name": "a"}])
            (folder / "gone.safetensors").unlink()
            assert server.job(queued_b["id"])["status"] == "queued"  # all of it happened while it waited
            assert c.post(f"/v1/videos/{blocker['id']}/cancel").status_code == 200
        done = {key: server.wait_job(job["id"]) for key, job in
                (("b", queued_b), ("c", reloaded_b), ("a", then_a), ("gone", gone))}
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert done["gone"]["status"] == "failed", done["gone"]
    assert "lora 'gone': its file" in done["gone"]["error"]["message"]
    assert "is gone since the job was admitted" in done["gone"]["error"]["message"]
    for key, file in (("b", "b"), ("c", "c"), ("a", "a")):
        assert done[key]["status"] == "completed", done[key]
        record = json.loads((server.data_dir / "clips" / f"{done[key]['id']}.attempt1.json").read_text())
        name = "a" if key == "a" else "b"
        assert record["adapters"] == [{"name": name, "file": f"{file}.safetensors", "sha256": sha256(files[file]),
                                       "scale": 1.0}]
        assert record["mp4_sha256"] == run_clip(file), key
