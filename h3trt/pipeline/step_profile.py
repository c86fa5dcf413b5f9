"""Host overhead of one denoising step: how long the GPU sat idle, waiting for the host, inside a DiT evaluation.

`h3trt run --profile-step N` runs evaluation N under torch.profiler (CUDA activity only: CUPTI records every kernel
and copy, the host side is not instrumented, so the profile changes the step by little) between two device
synchronisations. Busy time is the union of the device intervals (kernels, copies, memsets); idle time is the rest
of the step's wall time, which is what the host costs it: Python and launch work the GPU had to wait for, host
syncs (the baked AdaLN row lookup), and the gap between the first synchronisation and the first kernel. CUDA graphs
per segment would remove the launch share of it; they are worth their complexity only where the idle share is
more than about 1% of the step.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # chrome-trace "cat" of device-side activity


def busy_and_idle(intervals: list[tuple[float, float]], start: float, end: float) -> dict:
    """Union of device `intervals` (any unit, clipped to [start, end]) and what is left of [start, end]: busy, idle,
    the number of idle gaps and the longest. Pure: unit-tested."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals if b > start and a < end)
    busy, gaps, longest, cursor = 0.0, 0, 0.0, start
    for a, b in clipped:
        if a > cursor:
            gaps += 1
            longest = max(longest, a - cursor)
        if b > cursor:
            busy += b - max(a, cursor)
            cursor = b
    if end > cursor:
        gaps += 1
        longest = max(longest, end - cursor)
    total = end - start
    return {"wall": total, "busy": busy, "idle": total - busy, "idle_fraction": (total - busy) / total if total else 0.0,
            "gaps": gaps, "longest_gap": longest}


class StepProfiler:
    """Wraps a denoiser (video, audio, unique_t, t_index) -> velocities; evaluation `step` (1-based) runs profiled.
    `report` holds the result once that evaluation has run (None before)."""

    def __init__(self, model, step: int, device: torch.device):
        if step < 1:
            raise ValueError(f"--profile-step counts evaluations from 1, got {step}.")
        self.model, self.step, self.device = model, step, torch.device(device)
        self.calls = 0
        self.report: dict | None = None

    def __call__(self, *args):
        self.calls += 1
        if self.calls != self.step:
            return self.model(*args)
        if self.device.type != "cuda":
            start = time.perf_counter()
            out = self.model(*args)
            self.report = {"step": self.step, "device": str(self.device), "wall_ms": (time.perf_counter() - start) * 1e3,
                           "note": "no GPU: host overhead between GPU work is not defined on the CPU"}
            return out
        return self._profiled(*args)

    def _profiled(self, *args):
        """The evaluation under the profiler. A profiler that cannot run (no CUPTI in this process) does not fail the
        request: the evaluation runs unprofiled and the report says why there is no figure."""
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize(self.device)
        try:
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.__enter__()
        except Exception as e:
            self.report = {"step": self.step, "device": str(self.device), "error": f"torch.profiler: {e}"}
            return self.model(*args)
        try:
            torch.cuda.synchronize(self.device)
            marker = torch.empty(1, device=self.device)
            marker.zero_()  # a device event at the start of the step, on the profiler's clock
            out = self.model(*args)
            torch.cuda.synchronize(self.device)
            marker.zero_()  # and one at its end
            torch.cuda.synchronize(self.device)
        finally:
            prof.__exit__(None, None, None)
        try:
            self.report = self._summarise(prof)
        except Exception as e:  # the measurement failed, not the request: the record says so
            self.report = {"step": self.step, "device": str(self.device), "error": f"{type(e).__name__}: {e}"}
        return out

    def _summarise(self, prof) -> dict:
        with tempfile.TemporaryDirectory(prefix="h3trt-profile-") as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        device_events = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in trace.get("traceEvents", [])
                         if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X"]
        if len(device_events) < 3:
            raise RuntimeError(f"the profiler recorded {len(device_events)} device events (is CUPTI working in this "
                               "process?), so no host-overhead figure can be given")
        device_events.sort()
        # The first and last device events are the two marker memsets: the step is what lies between them.
        start, end = device_events[0][1], device_events[-1][0]
        stats = busy_and_idle(device_events[1:-1], start, end)
        return {"step": self.step, "device": str(self.device), "device_events": len(device_events) - 2,
                "wall_ms": round(stats["wall"] / 1e3, 3), "busy_ms": round(stats["busy"] / 1e3, 3),
                "idle_ms": round(stats["idle"] / 1e3, 3), "idle_fraction": round(stats["idle_fraction"], 5),
                "idle_gaps": stats["gaps"], "longest_gap_ms": round(stats["longest_gap"] / 1e3, 3)}
