"""`h3trt build`'s check before it writes the manifest: every compiled artifact loads in a fresh process, under the
no-compile guard, and matches the eager segment on the build's example inputs (h3trt/build/verify.py is that process).
A failure here is the build's, not the user's: BuildError, with the check's last lines."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..engines.video_decoder import parse_video_decoder_name
from .config import BuildConfig
from .verify import PEAK_FILE

VERIFY_TIMEOUT_S = 900
# The relative error each segment may show is the precision table's (models/precision.py: verify_rel_tol).


class BuildError(RuntimeError):
    """The build failed, not its user: compiled code that does not load or match in a fresh process, or a check that
    did not finish. The message gives the reason (the check's last lines). A user's mistake is a UserError."""


def check_in_fresh_process(work: Path, config: BuildConfig, segments: dict, examples: dict, specs: dict) -> dict:
    """Load `segments` (their manifest entries) from `work` in a fresh process and run them on `examples`, comparing
    with `specs`' eager functions; BuildError when one fails to load or match. Returns the process's peak GPU memory
    ({peak_gpu_allocated_gib, peak_gpu_reserved_gib}; empty on the CPU)."""
    with tempfile.TemporaryDirectory(prefix="h3trt-verify-") as tmp:
        tensors, plan = {}, {}
        for name, inputs in examples.items():
            spec = specs[name]
            with torch.no_grad():
                want = spec.fn(*inputs)
            want = want if isinstance(want, tuple) else (want,)
            for i, t in enumerate(inputs):
                tensors[f"{name}.in.{i}"] = t.detach().cpu().clone()  # clones: safetensors refuses shared storage
            for i, t in enumerate(want):
                tensors[f"{name}.out.{i}"] = t.detach().cpu().clone()
            rel_tol = (config.vae.verify_rel_tol if parse_video_decoder_name(name)
                       else config.precision.spec.verify_rel_tol)
            plan[name] = {"entry": segments[name], "inputs": len(inputs), "outputs": len(want), "rel_tol": rel_tol}
        save_file(tensors, f"{tmp}/examples.safetensors")
        del tensors, want  # host copies (at full size ~13 GB, the video decoder's fp32 weights): free for the child
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what this process no longer uses, for the child's
        Path(tmp, "plan.json").write_text(json.dumps({
            "backend": config.backend, "device": config.device, "plan": plan}))
        try:
            proc = subprocess.run([sys.executable, "-m", "h3trt.build.verify", str(work), tmp], capture_output=True,
                                  text=True, timeout=VERIFY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise BuildError(f"Loading the compiled segments in a fresh process did not finish in {VERIFY_TIMEOUT_S} "
                             "s; the bundle was not written.") from None
        peak_file = Path(tmp, PEAK_FILE)
        peak = json.loads(peak_file.read_text()) if proc.returncode == 0 and peak_file.exists() else {}
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        how = " (the process crashed: signal %d)" % -proc.returncode if proc.returncode < 0 else ""
        raise BuildError(f"The {config.backend} segments failed to load or match in a fresh process{how}; the bundle "
                         f"was not written. Try another --backend. Last output:\n{tail}")
    return peak
