"""Ray isolation (issue 35 item 2), apart from tests/fleet/test_fleet.py: that module's cluster lives for the whole
module (a module fixture) in the xdist worker that runs it, and a second `ray.init` in the same process is refused
("Maybe you called ray.init twice by accident?"), which failed CI when the token test ran after the fleet's tests in one
module; and Ray reads its token once per process, so a head started in-process after that module's cluster could not
start either. Here every cluster is the test's own, in a child process."""

import json
import os
import select
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from helpers import TESTS
from serving import free_port


# A decoy: what another Ray user leaves on the machine. RAY_ADDRESS and the session file in Ray's default temp folder
# (TMPDIR/ray/ray_current_cluster) name a cluster that is not the test's, and ~/.ray/auth_token holds their token.
ISOLATED = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import ray
from ray_cluster import isolated_ray

with isolated_ray(num_cpus=1) as (context, ray_dir):
    node = ray._private.worker._global_node
    print(json.dumps({"gcs": context.address_info["gcs_address"], "session": node.get_session_dir_path(),
                      "ray_dir": ray_dir, "ran": ray.get(ray.remote(lambda: 42).remote())}))
"""


def _decoy_env(tmp_path) -> dict:
    decoy = f"127.0.0.1:{free_port()}"
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(decoy)
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("another-ray-users-token")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "RAY_ADDRESS": decoy, "TMPDIR": str(tmp_path), "HOME": str(home)}


def test_the_tests_ray_cluster_is_their_own_whatever_else_the_machine_runs(tmp_path):
    """The fleet fixture's cluster (tests/ray_cluster.py), with RAY_ADDRESS and Ray's session file naming another
    cluster and another user's ~/.ray/auth_token: a new head of its own (not the decoy; its session in its own
    folder), its tasks run (its own token), the other user's token file untouched and nothing else written in HOME.
    The fixture's former `ray.init(num_cpus=8, ...)` connected to RAY_ADDRESS and failed ("Connecting to existing
    Ray cluster at address ...", then "When connecting to an existing cluster, num_cpus ... must not be provided")."""
    env = _decoy_env(tmp_path)
    done = subprocess.run([sys.executable, "-c", ISOLATED, str(TESTS)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["gcs"] != env["RAY_ADDRESS"] and got["ran"] == 42, got
    assert got["session"].startswith(got["ray_dir"]), got
    assert "Connecting to existing Ray cluster" not in done.stderr
    home = Path(env["HOME"])
    assert (home / ".ray" / "auth_token").read_text() == "another-ray-users-token"
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == [".ray", ".ray/auth_token"]


def _deploy(address: str, env: dict, tmp_path, store: str) -> subprocess.CompletedProcess:
    # A reachable store and a writable storage: the deploy checks both before it touches Ray (preflight).
    return subprocess.run([sys.executable, "-m", "h3trt.cli", "serve", "--ray", address, "--store", store,
                           "--storage", str(tmp_path / "storage"), "--device", "cpu", "--port", str(free_port())],
                          env=env, capture_output=True, text=True, timeout=120)


# The token-authenticated head of the deploy test, in a process of its own: Ray reads its token once per process, so a
# head started in an xdist worker that already ran another cluster (test_fleet.py's module fixture, in CI) failed to
# start ("Failed to start GCS ... InvalidAuthToken"). It prints its address and folder, then holds until stdin closes.
HEAD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from ray_cluster import isolated_ray

with isolated_ray(num_cpus=1) as (context, ray_dir):
    print(json.dumps({"gcs": context.address_info["gcs_address"], "ray_dir": ray_dir}), flush=True)
    sys.stdin.readline()
"""


@contextmanager
def _token_head():
    """Yields (gcs address, the cluster's folder) of a token-authenticated head in a child process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    head = subprocess.Popen([sys.executable, "-c", HEAD, str(TESTS)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([head.stdout], [], [], 180)
        line = head.stdout.readline() if ready else ""
        if not line:
            head.kill()
            raise AssertionError(f"the Ray head did not start within 180 s: {head.stderr.read()[-3000:]}")
        started = json.loads(line)
        yield started["gcs"], started["ray_dir"]
    finally:
        if head.poll() is None:
            head.stdin.close()
            try:
                head.wait(timeout=60)
            except subprocess.TimeoutExpired:
                head.kill()
                head.wait()


def test_deploy_with_another_users_ray_token_is_one_line_or_works(tiny_cache, tmp_path, postgres):
    """The README's recipe on a token-authenticated cluster (what `ray start --head` makes when it finds a token):
    `h3trt serve --ray HEAD:PORT` from a HOME whose ~/.ray/auth_token is another user's is refused in one line naming
    the file and the fix, at once; with the cluster's token in that file the deploy's connect (deploy.connect, run
    alone so that no fleet is deployed) gets in. Before, Ray never sent the file's token on an explicit address: 20 s
    of retries, then its traceback."""
    with _token_head() as (address, ray_dir):
        env = _decoy_env(tmp_path)
        del env["RAY_ADDRESS"]
        token = Path(env["HOME"]) / ".ray" / "auth_token"
        started = time.monotonic()
        refused = _deploy(address, env, tmp_path, postgres.database())
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "Traceback" not in refused.stderr, refused.stderr[-3000:]
        line = refused.stderr.strip().splitlines()[-1]
        assert f"refused the token in {token}" in line and "ray get-auth-token" in line, line
        assert time.monotonic() - started < 60
        token.write_text((Path(ray_dir) / "auth_token").read_text())  # the head's token, copied to this machine
        connected = subprocess.run(
            [sys.executable, "-c", "import sys, ray; from h3trt.fleet.deploy import connect; connect(sys.argv[1]); "
             "print('nodes', len(ray.nodes()))", address], env=env, capture_output=True, text=True, timeout=120)
        assert connected.returncode == 0 and "nodes 1" in connected.stdout, connected.stderr[-3000:]
        assert "InvalidAuthToken" not in connected.stderr
