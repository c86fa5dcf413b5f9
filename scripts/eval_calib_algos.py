"""`h3trt eval` per --calib-algo on the tiny model, CPU: one bundle per (precision, algorithm), each against the eager
tiny model on the same requests and seeds. The tiny model has random weights: the numbers measure how far each
recipe moves the computation, not picture quality.

    python scripts/eval_calib_algos.py --work /tmp/calib-eval --json bench/results/calib_algos_tiny_cpu.json

Every bundle is built by `h3trt build` in a fresh process (--device cpu, --steps 6; calibrated on CALIB_PROMPTS with
--calib-steps 4 where the algorithm takes data) and evaluated by `h3trt eval` in another. A bf16 bundle is the floor:
what compiling alone moves. Reported per bundle: calibration seconds, the mean final latent relative error (video,
audio), decoded-video PSNR and SSIM, audio log-spectral distance, and the weights' bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = (("bf16", None), ("fp8", "max"), ("fp8", "percentile"), ("fp8", "smoothquant"), ("nvfp4", "max"),
            ("nvfp4", "awq_lite"))
CALIB_PROMPTS = ("a red fox runs through fresh snow", "waves break on a rocky shore at dusk",
                 "a street musician plays the violin in the rain")
REQUESTS = ({"prompt": "a lighthouse at night, rain on the glass", "seed": 5},
            {"prompt": "a paper boat drifts down a gutter stream", "seed": 11})
STEPS, CALIB_STEPS = 6, 4


def _run(cmd: list[str], env: dict) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout + proc.stderr


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="folder for the bundles and per-bundle eval JSON")
    p.add_argument("--json", type=Path, required=True, help="where to write the summary")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    prompts, requests = args.work / "calib_prompts.txt", args.work / "requests.jsonl"
    prompts.write_text("\n".join(CALIB_PROMPTS) + "\n")
    requests.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    h3trt = [sys.executable, "-m", "h3trt.cli"]
    result = {"model": "tiny (random weights)", "device": "cpu", "steps": STEPS, "calib_steps": CALIB_STEPS,
              "calib_prompts": list(CALIB_PROMPTS), "requests": list(REQUESTS), "reference": "eager tiny model, bf16",
              "bundles": {}}
    for precision, algo in VARIANTS:
        name = precision if algo is None else f"{precision}_{algo}"
        bundle, out = args.work / name, args.work / f"{name}_eval.json"
        cmd = h3trt + ["build", "--model", "tiny", "--output", str(bundle), "--device", "cpu", "--precision", precision,
                       "--steps", str(STEPS), "--overwrite"]
        if algo is not None:
            cmd += ["--calib-algo", algo]
            if precision == "fp8" or algo == "awq_lite":
                cmd += ["--calib-prompts", str(prompts), "--calib-steps", str(CALIB_STEPS)]
        t0 = time.perf_counter()
        _run(cmd, env)
        build_s = time.perf_counter() - t0
        out.unlink(missing_ok=True)
        _run(h3trt + ["eval", "--engine", str(bundle), "--reference", "tiny", "--requests", str(requests), "--json",
                      str(out), "--device", "cpu"], env)
        manifest = json.loads((bundle / "manifest.json").read_text())
        mean = json.loads(out.read_text())["mean"]
        quant = manifest.get("quant") or {}
        row = {"build_s": round(build_s, 1), "calibration_s": quant.get("calibration_s"),
               "modelopt": quant.get("modelopt"), "block_weight_bytes": manifest["weight_bytes"]["blocks"],
               "final_latent_rel_err_video": mean["final_latent_rel_err_video"],
               "final_latent_rel_err_audio": mean["final_latent_rel_err_audio"],
               "latent_rel_err_per_step_video": mean["latent_rel_err_per_step_video"],
               "psnr_db": mean["psnr_db"], "ssim": mean["ssim"], "audio_lsd_db": mean["audio_lsd_db"]}
        result["bundles"][name] = row
        print(f"{name:18s} build {build_s:6.1f} s (calibration {row['calibration_s']} s): final latent rel err video "
              f"{row['final_latent_rel_err_video']:.3e} audio {row['final_latent_rel_err_audio']:.3e}, PSNR "
              f"{row['psnr_db']:.2f} dB, SSIM {row['ssim']:.4f}, audio LSD {row['audio_lsd_db']:.3f} dB", flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
