"""bench_e2e.py's summaries: one run's record turned into its row (cold start, step time, gaps, energy, extrapolated to
a 50-step clip), and the table over every row against the Diffusers reference."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from bench_common import NvmlSampler

if TYPE_CHECKING:
    from e2e_ctx import Ctx

FULL_EVALUATIONS = 49  # a 50-step clip


def summarise_run(record: dict, launched: float, ended: float, nvml: NvmlSampler,
                  sparse_split: tuple[int, int] | None = None) -> dict:
    """One run's row. `sparse_split` (a sparse bundle's run): (evaluations this run kept dense, evaluations the full
    clip keeps dense): the clip is extrapolated from the dense and the sparse step times apart."""
    spans, t = record["spans_unix"], record["timings_s"]
    marks = record["step_marks_s"]
    evals = record["evaluations"]
    # The k-th mark is when step k was queued, right after step k-1 finished (each step syncs at its AdaLN lookup):
    # mark differences from the second on are step times.
    diffs = [b - a for a, b in zip(marks, marks[1:])]
    step_s = statistics.median(diffs) if diffs else t["denoise"] / evals
    gen_start, gen_end = spans["text_encode"][0], spans["decode_and_mux"][1]
    out = {
        "cold_start_s": round(spans["denoise"][0] - launched, 3),  # process launch -> first denoise step
        "load": record.get("load"),
        "step_s": round(step_s, 4), "first_step_s": round(marks[0], 3) if marks else None,
        "evaluations": evals, "denoise_s": t["denoise"],
        "video_decode_s": t.get("video_decode"), "audio_decode_s": t.get("audio_decode"), "mux_s": t.get("mux"),
        "decode_tail_s": t.get("decode_tail_s"), "wall_s": record["wall_s"],
        "process_wall_s": round(ended - launched, 2),
        "gaps_s": {
            "launch_to_text_encode": round(spans["text_encode"][0] - launched, 3),
            "text_encode_to_denoise": round(spans["denoise"][0] - spans["text_encode"][1], 3),
            "denoise_to_decode": round(spans["decode_and_mux"][0] - spans["denoise"][1], 3),
            "waiting_for_vaes": round(spans["wait_vaes"][1] - spans["wait_vaes"][0], 3) if "wait_vaes" in spans else None,
            "decode_end_to_exit": round(ended - spans["decode_and_mux"][1], 3),
        },
        "video_vae": {"precision": record.get("vae_precision"), "decoder": record.get("video_decoder")},
        "step_profile": record.get("step_profile"),
        "peak_memory_gib": record.get("peak_memory_gib"), "peak_memory_nvml_gib": nvml.peak_memory_gib(),
        "energy_j": {"clip": nvml.joules(gen_start, gen_end), "denoise": nvml.joules(*spans["denoise"]),
                     "decode_and_mux": nvml.joules(*spans["decode_and_mux"]), "process": nvml.joules(launched, ended)},
        "energy_note": (None if nvml.available else f"NVML unavailable ({nvml.error})"),
    }
    missing = FULL_EVALUATIONS - evals
    out["extrapolated"] = missing > 0
    out["end_to_end_49_s"] = round(record["wall_s"] + missing * step_s, 2)
    clip_j, den_j = out["energy_j"]["clip"], out["energy_j"]["denoise"]
    out["energy_49_j"] = round(clip_j + missing * den_j / evals, 0) if clip_j is not None else None
    if missing:
        out["note"] = (f"{evals} evaluations run; end to end extrapolated to {FULL_EVALUATIONS}: wall + {missing} x the "
                       "median step (energy likewise, from the denoise stage's joules per evaluation)")
    if sparse_split is not None and missing > 0:
        out.update(sparse_extrapolation(record, marks, diffs, *sparse_split))
    return out


def sparse_extrapolation(record: dict, marks: list[float], diffs: list[float], dense_run: int,
                         dense_full: int) -> dict:
    """A sparse bundle's clip from a short run whose first `dense_run` evaluations were dense: the dense and the
    sparse step times apart, each from the mark differences no reading can assign to the other kind (mark k - mark
    k-1 times step k, or on a GPU step k-1, whose kernels the AdaLN sync of step k waits for), the full clip's
    `dense_full` dense evaluations and the rest sparse."""
    evals = record["evaluations"]
    ran = (record.get("sparse_attention") or {}).get("sparse_evaluations")
    dense = [diffs[k - 1] for k in range(2, dense_run)]  # marks 2 .. dense_run - 1: never step 0's warm-up
    sparse = [diffs[k - 1] for k in range(dense_run + 1, evals)]
    if not dense or not sparse or ran != list(range(dense_run, evals)):
        return {"sparse_note": f"no dense/sparse split: sparse evaluations {ran}, {evals} run, {dense_run} dense"}
    dense_s, sparse_s = statistics.median(dense), statistics.median(sparse)
    sparse_full = FULL_EVALUATIONS - dense_full
    end = record["wall_s"] + (dense_full - dense_run) * dense_s + (sparse_full - (evals - dense_run)) * sparse_s
    return {"dense_step_s": round(dense_s, 4), "sparse_step_s": round(sparse_s, 4), "end_to_end_49_s": round(end, 2),
            "note": f"{evals} evaluations run ({dense_run} dense, then sparse: {ran}); end to end extrapolated to the "
                    f"{FULL_EVALUATIONS} evaluations of the 50-step clip, {dense_full} dense and {sparse_full} sparse "
                    f"as the bundle serves it: wall + {dense_full - dense_run} x the dense step + "
                    f"{sparse_full - (evals - dense_run)} x the sparse step"}


def build_summary(res: dict) -> tuple[dict, dict]:
    """Each built row's seconds, whether it streamed its blocks, its peak GPU memory; and the bar on that peak."""
    builds = {row: {k: (r.get("build") or {}).get(k) for k in ("seconds", "streamed", "peak_gpu_gib",
                                                                "peak_gpu_reserved_gib", "check_peak_gpu_gib")}
              for row, r in res.get("rows", {}).items() if (r.get("build") or {}).get("rc") == 0}
    bars = {f"{row}_build_peak_gpu_<=40GB": b["peak_gpu_reserved_gib"] * 2**30 <= 40e9  # what the process took
            for row, b in builds.items() if b["peak_gpu_reserved_gib"] is not None}
    return builds, bars


def summarise(ctx: Ctx) -> None:
    res, ref = ctx.results, ctx.results.get("reference", {})
    diffusers_e2e = ref.get("diffusers_end_to_end_s")
    rows = []
    if ref.get("diffusers"):
        d = ref["diffusers"]
        rows.append(("Diffusers bf16 (extrapolated)", d["s"], FULL_EVALUATIONS * d["s"],
                     (ref.get("vae_decode") or {}).get("s"), None, diffusers_e2e, None, None, d.get("peak_gib"),
                     ref.get("diffusers_end_to_end_joules")))
    if ref.get("h3trt_eager"):
        e = ref["h3trt_eager"]
        rows.append(("h3trt eager bf16 (DiT only)", e["s"], FULL_EVALUATIONS * e["s"], None, None, None, None, None,
                     e.get("peak_gib"), None))
    summary = {}
    for row, r in res.get("rows", {}).items():
        run = r.get("run") or {}
        if "step_s" not in run:
            continue
        load = (run.get("load") or {}).get("engine", {})
        rows.append((f"h3trt bundle {row}" + (" (extrapolated)" if run["extrapolated"] else ""), run["step_s"],
                     FULL_EVALUATIONS * run["step_s"], run["video_decode_s"], run["mux_s"], run["end_to_end_49_s"],
                     run["cold_start_s"], load.get("weights_GBps"), (run.get("peak_memory_gib") or {}).get("allocated"),
                     run.get("energy_49_j")))
        starts = {k: {"ready_s": r[k].get("ready_s"),
                      "weights_GBps": ((r[k].get("load") or {}).get("engine") or {}).get("weights_GBps"),
                      "process_to_load_s": (r[k].get("load") or {}).get("process_to_load_s")}
                  for k in ("second_start", "warm_start") if isinstance(r.get(k), dict) and "ready_s" in r[k]}
        warm = r.get("warm_run") or {}
        if "cold_start_s" in warm:
            starts["warm_run"] = {"cold_start_s": warm["cold_start_s"], "first_step_s": warm.get("first_step_s"),
                                  "weights_GBps": (warm["load"].get("engine") or {}).get("weights_GBps"),
                                  "process_to_load_s": warm["load"].get("process_to_load_s")}
        summary[row] = {"end_to_end_49_s": run["end_to_end_49_s"], "cold_start_s": run["cold_start_s"],
                        "first_step_s": run.get("first_step_s"), "python_bytecode": run.get("python_bytecode"),
                        "process_to_load_s": (run.get("load") or {}).get("process_to_load_s"), **starts,
                        "weights_GBps": load.get("weights_GBps"),
                        "speedup_vs_diffusers": (round(diffusers_e2e / run["end_to_end_49_s"], 3)
                                                 if diffusers_e2e else None),
                        "host_idle_fraction": (run.get("step_profile") or {}).get("idle_fraction"),
                        "video_vae": run.get("video_vae"), "peak_memory_gib": run.get("peak_memory_gib"),
                        "extrapolation": run.get("note")}
    builds, bars = build_summary(res)
    if "bf16" in summary and summary["bf16"]["speedup_vs_diffusers"]:
        bars["bf16_vs_diffusers_>=1.15x"] = summary["bf16"]["speedup_vs_diffusers"] >= 1.15
    if "fp8" in summary:
        bars["fp8_cold_start_<=15s"] = summary["fp8"]["cold_start_s"] <= 15.0
        if summary["fp8"]["weights_GBps"] is not None:
            bars["fp8_weights_>=3GBps"] = summary["fp8"]["weights_GBps"] >= 3.0
    res["summary"] = {"rows": summary, "builds": builds, "bars": bars}
    for line in summary_lines(ctx, rows, ref, builds, summary, bars):
        ctx.log(line)


def summary_lines(ctx: Ctx, rows: list[tuple], ref: dict, builds: dict, summary: dict, bars: dict) -> list[str]:
    """The summary's table and lines, as the log prints them."""
    head = (f"{'':34} {'s/step':>7} {'denoise49':>9} {'decode':>7} {'mux':>6} {'e2e s':>7} {'cold s':>7} "
            f"{'GB/s':>6} {'peakGiB':>7} {'J/clip':>8}")
    lines = [f"5 s {ctx.width}x{ctx.height} clip, 49 evaluations, {ctx.env().get('gpu', ctx.device)}", head]
    for name, *vals in rows:
        cells = [("" if v is None else f"{v:.3f}" if i == 0 else f"{v:.1f}") for i, v in enumerate(vals)]
        widths = [7, 9, 7, 6, 7, 7, 6, 7, 8]
        lines.append(f"{name:34} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    if ref.get("diffusers", {}).get("how"):
        lines.append(f"Diffusers: {ref['diffusers']['how']}")
    for row, b in builds.items():
        lines.append(f"{row} build: {b['seconds']} s, {'a block at a time' if b['streamed'] else 'whole'}, peak GPU "
                     f"memory {b['peak_gpu_gib']} GiB allocated / {b['peak_gpu_reserved_gib']} GiB reserved (its "
                     f"fresh-process check {b['check_peak_gpu_gib']} GiB)")
    for row, s in summary.items():
        lines.append(f"{row}: {s['speedup_vs_diffusers']}x Diffusers end to end; host idle "
                     f"{s['host_idle_fraction']} of a step; video VAE {s['video_vae']}; process start to bundle "
                     f"load {s['process_to_load_s']} s")
        if "warm_run" in s:
            w = s["warm_run"]
            lines.append(f"{row} warm_run (pages cached, record present): first step {w['cold_start_s']} s after "
                         f"launch, weights {w['weights_GBps']} GB/s, process start to bundle load "
                         f"{w['process_to_load_s']} s, first step took {w['first_step_s']} s")
        for k in ("second_start", "warm_start"):
            if k in s:
                lines.append(f"{row} {k}: ready {s[k]['ready_s']} s after launch (before the text encode), weights "
                             f"{s[k]['weights_GBps']} GB/s, process start to bundle load {s[k]['process_to_load_s']} s")
    if ctx.tiny:
        lines.append("--tiny: the tiny config on the CPU proves the flow; its numbers and the bars mean nothing")
    else:
        lines += [f"bar {k}: {'met' if v else 'NOT met'}" for k, v in bars.items()]
    return lines
