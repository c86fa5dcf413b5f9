"""The context every e2e bench phase runs in (bench_e2e.py, its phase modules e2e_*.py, bench_distilled.py,
distilled_moonshot.py, bench_serve.py): the call's paths, its results JSON, its log, its budget, and each phase's
subprocess bounded by its timeout. A module of its own, so that the phase modules and the other benches import it
without importing bench_e2e, which imports them."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import torch

from bench_common import ROOT

# Each phase's limit (seconds; --timeout PHASE=S), and never past the call's --budget-s: about 2x the H100 estimates
# of the module docstring, so that a slow phase is stopped before it eats the phases after it.
PHASE_TIMEOUTS = {"checkpoint": 150.0, "reference": 200.0, "build": 420.0, "run": 300.0}


# ----------------------------------------------------------------------------------------------------------------------
# Context: paths, results, log


class Ctx:
    def __init__(self, args):
        self.args, self.tiny = args, args.tiny
        self.device = torch.device("cpu" if args.tiny else "cuda")
        self.state, self.bundles = Path(args.state), Path(args.bundles)
        self.ckpt = self.state / "ckpt"
        self.out = Path(args.out)
        self.log_path = self.out.with_suffix(".log")
        self.started = getattr(args, "started", None) or time.time()
        self.results = json.loads(self.out.read_text()) if self.out.exists() else {}
        from h3trt.models.config import H3Config

        self.cfg = H3Config.tiny() if self.tiny else H3Config()
        self.width, self.height = (160, 96) if self.tiny else (1344, 768)
        from h3trt.models.packing import Geometry, frames_for_duration

        self.geometry = Geometry(self.height, self.width, frames_for_duration(5.0))

    def log(self, msg: str) -> None:
        line = f"[{time.time() - self.started:7.1f}s] {msg}"
        print(line, flush=True)
        if getattr(self.args, "child", False):
            return  # a phase's own process: its stdout is the log already (in_own_process)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def save(self) -> None:
        tmp = self.out.with_name(f".{self.out.name}.partial")
        tmp.write_text(json.dumps(self.results, indent=1, default=float))
        os.replace(tmp, self.out)

    def remaining(self) -> float:
        return self.args.budget_s - (time.time() - self.started)

    def timeout(self, phase: str | None) -> float:
        """Seconds a subprocess of `phase` may run: its limit, and never past the call's budget (less 15 s to write
        the results)."""
        limit = (getattr(self.args, "timeouts", None) or PHASE_TIMEOUTS).get(phase, float("inf"))
        return max(5.0, min(limit, self.remaining() - 15.0))

    def subprocess(self, cmd: list[str], env_extra: dict, what: str, phase: str | None = None) -> tuple[int, float]:
        """Run `cmd` with output appended to the log; (exit code, seconds). Killed at its phase's timeout."""
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env_extra}
        timeout = self.timeout(phase)
        self.log(f"{what}: {' '.join(cmd)}  (timeout {timeout:.0f} s)")
        start = time.perf_counter()
        with open(self.log_path, "a") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = -9
                self.log(f"{what}: killed after {timeout:.0f} s (its phase's limit or the call's --budget-s "
                         f"{self.args.budget_s:.0f})")
        return rc, time.perf_counter() - start

    def env(self) -> dict:
        info = {"torch": torch.__version__, "device": str(self.device), "tiny": self.tiny}
        if self.device.type == "cuda":
            info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), cuda=torch.version.cuda,
                        cudnn=torch.backends.cudnn.version())
        return info


def release_gpu_memory() -> None:
    """Hand this process's cached GPU memory back before a child (build, run) needs the GPU."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
