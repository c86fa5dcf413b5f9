"""Run by `h3trt build` in a fresh process: load every compiled segment of a bundle in the making, under the
no-compile guard, run it on the build's example inputs and compare with the eager outputs.

    python -m h3trt.build.verify BUNDLE_WORK_DIR EXAMPLES_DIR

Exit 0 when every segment loads and matches; otherwise print the reason and exit 1 (a crash exits by signal).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..engines.guard import no_compile
from ..engines.loaders import load_segments

PEAK_FILE = "peak.json"  # the process's peak GPU memory, beside the examples (build/check.py reads it)


def main(argv: list[str]) -> int:
    work, examples_dir = Path(argv[0]), Path(argv[1])
    plan = json.loads((examples_dir / "plan.json").read_text())
    tensors = load_file(str(examples_dir / "examples.safetensors"))
    device = torch.device(plan["device"])
    entries = {name: item["entry"] for name, item in plan["plan"].items()}
    segments = load_segments(work, plan["backend"], entries, device)
    failed = False
    with torch.no_grad(), no_compile():
        for name, item in plan["plan"].items():
            inputs = [tensors[f"{name}.in.{i}"].to(device) for i in range(item["inputs"])]
            try:
                got = segments[name](*inputs)
            except Exception as e:  # the builder shows the last lines: let them name the segment
                raise RuntimeError(f"segment {name} failed at its first call: {type(e).__name__}: {e}") from e
            for i in range(item["outputs"]):
                want = tensors[f"{name}.out.{i}"].float()
                err = ((got[i].float().cpu() - want).norm() / want.norm().clamp_min(1e-12)).item()
                ok = err <= item["rel_tol"]
                failed |= not ok
                print(f"{name} output {i}: relative error {err:.2e} ({'ok' if ok else 'TOO LARGE'}, "
                      f"tolerance {item['rel_tol']:.0e})")
    if device.type == "cuda":
        gib = 1 << 30
        (examples_dir / PEAK_FILE).write_text(json.dumps({
            "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
            "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved(device) / gib}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
