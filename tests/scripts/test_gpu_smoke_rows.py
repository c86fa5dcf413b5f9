"""scripts/gpu_smoke.py's own logic that decides what a row runs in (its clips need a GPU; `--cpu` dry-runs them)."""

import os
import sys

from helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))

import gpu_smoke  # noqa: E402


def test_the_fp8_sparse_row_takes_only_fa4s_carry_off_the_path():
    env = {"PYTHONPATH": os.pathsep.join(["/tmp/site", "/tmp/fa4", "/tmp/fa4/nvidia_cutlass_dsl/dsl_packages",
                                          "/repo"]), "HOME": "/root"}
    assert gpu_smoke.without_fa4(env) == {"PYTHONPATH": os.pathsep.join(["/tmp/site", "/repo"])}
    # Nothing to take off: the row runs in the plain environment (and the --cpu dry run still runs it).
    assert gpu_smoke.without_fa4({"PYTHONPATH": "/tmp/site"}) is None
    assert gpu_smoke.without_fa4({}) is None

