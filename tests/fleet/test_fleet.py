"""The fleet (h3trt/fleet/) for real: a local Ray cluster started here, `h3trt serve --ray ADDRESS` deploying to it two
worker replicas of a 2-rank gloo group (the tiny model on the CPU, its cheapest clip) behind the one ingress, the job
store in PostgreSQL (a throwaway Debian cluster, tests/postgres.py) and the clips in S3 through s3fs (moto's server
mode as the local S3-compatible stand-in, tests/conftest.py `s3`). One cluster and one deployment serve the module;
the replica kill runs last. Also, without the cluster: the queue-depth autoscaling policy and the fleet's options."""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from helpers import REPO
from ray_cluster import isolated_ray
from serving import ENDED, SMALL, ffprobe, free_port

KEY = "fleet-key-51c2"
LEASE_S = 4  # short, so a killed replica's job runs again within seconds


def _rows(url: str) -> dict:
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.connect() as c:
        rows = {r.id: r for r in c.execute(text("SELECT * FROM jobs"))}
    engine.dispose()
    return rows


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_cache, postgres, s3):
    from ray import serve

    bucket, client = s3
    store = postgres.database()
    env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                      "AWS_ENDPOINT_URL", "XDG_CACHE_HOME")}
    # This checkout's h3trt in every Ray worker (the replicas import the deployments from it).
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    # Small: 2 cores. Logical CPUs only count placement (4 rank bundles, the ingress); the object store is unused.
    # The cluster is this module's own (tests/ray_cluster.py), whatever else runs on the machine.
    with isolated_ray(num_cpus=8, object_store_memory=80 * 2**20, runtime_env={"env_vars": env}) as (context, _):
        port = free_port()
        log = tmp_path_factory.mktemp("fleet") / "deploy.log"
        try:
            with open(log, "wb") as out:
                deployed = subprocess.run(
                    [sys.executable, "-m", "h3trt.cli", "serve", "--ray", context.address_info["gcs_address"],
                     "--store", store, "--storage", f"s3://{bucket}/fleet", "--gpus", "2", "--sp", "2", "--device",
                     "cpu", "--min-replicas", "2", "--max-replicas", "2", "--lease", f"{LEASE_S}s", "--port",
                     str(port), "--api-key", KEY, "--retention", "1h"], stdout=out, stderr=subprocess.STDOUT,
                    env={**os.environ, **env}, timeout=480)
            assert deployed.returncode == 0, log.read_text()[-4000:]
            yield SimpleNamespace(url=f"http://127.0.0.1:{port}", store=store, bucket=bucket, s3=client, log=log,
                                  postgres=postgres)
        finally:
            serve.shutdown()


def _http(fleet) -> httpx.Client:
    return httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _wait(fleet, job_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    with _http(fleet) as c:
        while time.monotonic() < deadline:
            job = c.get(f"/v1/videos/{job_id}").json()
            if job["status"] in ENDED:
                return job
            time.sleep(0.3)
    raise AssertionError(f"{job_id} is still {job['status']} after {timeout} s")


def _objects(fleet) -> list[str]:
    listed = fleet.s3.list_objects_v2(Bucket=fleet.bucket, Prefix="fleet/")
    return sorted(o["Key"] for o in listed.get("Contents", []))


@pytest.mark.fleet
def test_openai_sdk_create_poll_download_delete_on_the_fleet(fleet, tmp_path):
    import openai

    with httpx.Client(base_url=fleet.url, timeout=30) as c:
        ready = c.get("/ready").json()
    assert ready["ready"] and ready["groups_serving"] == 2, ready
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    video = client.videos.create_and_poll(prompt="a red fox runs through snow", seconds="5", size="128x32",
                                          extra_body={"seed": 7, "steps": 2}, poll_interval_ms=200)
    assert video.status == "completed" and video.progress == 100, video
    mp4 = tmp_path / "clip.mp4"
    client.videos.download_content(video.id).write_to_file(mp4)
    codecs = {s["codec_name"]: s for s in ffprobe(mp4)["streams"]}
    assert codecs["h264"]["width"] == 128 and codecs["aac"]["channels"] == 2
    assert client.videos.download_content(video.id, variant="thumbnail").read()[8:12] == b"WEBP"
    assert {f"fleet/clips/{video.id}.attempt1.{ext}" for ext in ("mp4", "json", "webp")} <= set(_objects(fleet))
    row = _rows(fleet.store)[video.id]
    assert row.output == f"s3://{fleet.bucket}/fleet/clips/{video.id}.attempt1.mp4" and row.attempts == 1
    assert client.videos.delete(video.id).deleted
    with _http(fleet) as c:
        assert c.get(f"/v1/videos/{video.id}").status_code == 404
    assert not [k for k in _objects(fleet) if video.id in k]  # MP4, record and thumbnail gone with the row


@pytest.mark.fleet
def test_30_jobs_from_10_clients_run_exactly_once_over_2_replicas(fleet, tmp_path):
    def client(i: int) -> list[str]:
        with _http(fleet) as c:
            return [c.post("/v1/videos", json={**SMALL, "prompt": f"client {i} job {j}", "seed": 3 * i + j})
                    .raise_for_status().json()["id"] for j in range(3)]

    with ThreadPoolExecutor(10) as pool:
        ids = [job for jobs in pool.map(client, range(10)) for job in jobs]
    assert len(set(ids)) == 30
    ended = [_wait(fleet, job, timeout=600) for job in ids]
    assert [j["status"] for j in ended] == ["completed"] * 30, [j for j in ended if j["status"] != "completed"]
    rows = _rows(fleet.store)
    assert [rows[job].attempts for job in ids] == [1] * 30  # the store: each job taken once, by one worker
    replicas = {rows[job].worker.rsplit("/", 1)[0] for job in ids}
    assert len(replicas) == 2, replicas  # both replicas took jobs
    with _http(fleet) as c:
        for job in ids:
            mp4 = tmp_path / f"{job}.mp4"
            mp4.write_bytes(c.get(f"/v1/videos/{job}/content").raise_for_status().content)
            assert {s["codec_name"] for s in ffprobe(mp4)["streams"]} == {"h264", "aac"}


@pytest.mark.fleet
def test_a_store_outage_is_a_503_and_not_ready_and_the_running_jobs_finish_once(fleet):
    """PostgreSQL stopped for 10 s (over 2 leases) while both replicas run a job: every API answer is a 503 envelope,
    /ready is false, and once it is back both jobs complete on their first attempt, on the replicas that had them."""
    with _http(fleet) as c:
        jobs = [c.post("/v1/videos", json={"prompt": f"through the outage {i}", "size": "160x96", "steps": 30})
                .raise_for_status().json()["id"] for i in range(2)]
        deadline = time.monotonic() + 300
        while not all(c.get(f"/v1/videos/{j}").json()["evaluations"]["done"] >= 1 for j in jobs):
            assert time.monotonic() < deadline, "the jobs never started denoising"
            time.sleep(0.2)
        workers = {j: r.worker for j, r in _rows(fleet.store).items() if j in jobs}
        fleet.postgres.halt()
        try:
            down_until = time.monotonic() + 10
            while time.monotonic() < down_until:
                for answer in (c.get("/v1/videos"), c.get(f"/v1/videos/{jobs[0]}"),
                               c.post("/v1/videos", json={**SMALL, "prompt": "during the outage"})):
                    assert answer.status_code == 503, answer.text
                    assert answer.json()["error"]["code"] == "store_unreachable", answer.text
                ready = c.get("/ready")
                assert ready.status_code == 503 and ready.json()["store_reachable"] is False, ready.text
                time.sleep(1)
        finally:
            fleet.postgres.start()
    ended = [_wait(fleet, j) for j in jobs]
    assert [(j["status"], j["attempts"]) for j in ended] == [("completed", 1)] * 2, ended
    rows = _rows(fleet.store)
    assert {j: rows[j].worker for j in jobs} == workers  # no replica was replaced, no job moved
    with _http(fleet) as c:
        assert c.get("/ready").json()["ready"]


@pytest.mark.fleet
def test_a_replica_killed_mid_job_its_job_finishes_on_the_other(fleet):
    with _http(fleet) as c:
        long = c.post("/v1/videos", json={"prompt": "its replica dies", "size": "160x96", "steps": 30}).json()["id"]
        others = [c.post("/v1/videos", json={**SMALL, "prompt": f"after {i}"}).json()["id"] for i in range(3)]
        deadline = time.monotonic() + 300
        while c.get(f"/v1/videos/{long}").json()["evaluations"]["done"] < 1:
            assert time.monotonic() < deadline, "the long job never started denoising"
            time.sleep(0.2)
    worker = _rows(fleet.store)[long].worker  # host:pid/group0 of the Serve replica running it
    os.kill(int(worker.split("/")[0].rsplit(":", 1)[1]), signal.SIGKILL)  # the replica's process; its ranks follow
    job = _wait(fleet, long, timeout=300)
    assert job["status"] == "completed" and job["attempts"] == 2, job  # re-queued once, finished elsewhere
    assert [_wait(fleet, j)["status"] for j in others] == ["completed"] * 3
    rows = _rows(fleet.store)
    assert rows[long].worker.split("/")[0] != worker.split("/")[0]
    assert [rows[j].attempts for j in others] == [1] * 3  # queued behind it, each run once
    assert sum(1 for k in _objects(fleet) if long in k) == 3  # one MP4, record and thumbnail: no duplicates


def test_queue_depth_policy():
    from h3trt.fleet.autoscale import QueueDepthPolicy, desired_replicas

    assert [desired_replicas(q, r, 1) for q, r in ((0, 0), (0, 2), (3, 2), (5, 0))] == [0, 2, 5, 5]
    assert desired_replicas(5, 2, 2) == 4  # one job waits behind each running one
    policy = QueueDepthPolicy(jobs_per_replica=2)

    def ctx(metrics):
        return SimpleNamespace(aggregated_metrics=metrics, target_num_replicas=3, policy_state={"k": 1})

    # Every replica reports the fleet's counts (read from the shared store): the largest, not the sum.
    assert policy(ctx({"queued": {"r1": 6.0, "r2": 5.0}, "running": {"r1": 2.0, "r2": 2.0}})) == (4, {"k": 1})
    assert policy(ctx({})) == (3, {"k": 1})  # nothing reported yet: keep the target


def test_fleet_options_refuse_what_cannot_work():
    from h3trt.errors import UserError
    from h3trt.fleet.options import FleetOptions

    pg = "postgresql+psycopg://h3trt@db/h3trt"
    with pytest.raises(UserError, match="share one job store"):
        FleetOptions("auto", "sqlite:///jobs.sqlite3", "/mnt/h3trt")
    with pytest.raises(UserError, match="1 <= min <= max"):
        FleetOptions("auto", pg, "/mnt/h3trt", min_replicas=3, max_replicas=2)
    with pytest.raises(UserError, match="--lease must be at least 2 s"):
        FleetOptions("auto", pg, "/mnt/h3trt", lease_s=1)
    assert FleetOptions("auto", pg, "s3://bucket/h3trt", 1, 4).max_replicas == 4
