"""Per-request timelines of a batch run: OUT/timeline.json and OUT/timeline.png.

Each request is one row of intervals on a clock shared by the whole run (seconds since the run started): text and
condition encode, the wait for its batch to fill (`wait_batch`), the batch's shared denoise, the wait for earlier
members of its batch to finish decoding (`wait_decode`), video decode, audio decode and mux. Stacked one row per
request, the host tail (decode and mux after the last denoise) and the idle gaps between batches show at a glance.
"""

from __future__ import annotations

from pathlib import Path

from ..engines.atomic import sha256_file
from .batch_outputs import MADE_BY, our_timeline, timeline_paths
from ..media.output_files import commit, discard, temp_path, write_json_file
from ..pipeline.records import STAGE_COLOURS

def write_timeline(out_dir: Path, stem: str, rows: list[dict], summary: dict, png: bool,
                   started_unix: float, replace: bool = True) -> list[Path]:
    """Write OUT/<stem>.json (and OUT/<stem>.png), committed together; `rows` are {"id", "status", "group", "batch",
    "intervals"}. `stem` is "timeline", or "timeline-group{i}" for torchrun's group i (each group serves its own
    share there). The JSON carries MADE_BY and the PNG's size and sha256: what marks both as a batch's own
    (batch_outputs.py). `replace`: whether existing files may be replaced (the plan found them ours, or --overwrite);
    otherwise a file that appeared meanwhile is kept and files.OutputExists raised.

    A resumed run keeps the earlier runs' rows: each run is listed in `runs` (its start and summary) and each row
    says which run it belongs to, its intervals in seconds since that run started. `summary` and `started_unix` at
    the top are the latest run's."""
    path, png_path = timeline_paths(out_dir, stem)
    runs, earlier = _earlier_runs(path)
    run = len(runs)
    runs.append({"started_unix": started_unix, "summary": summary})
    data = {"made_by": MADE_BY, "started_unix": started_unix, "clock": "seconds since the row's run started",
            "summary": summary, "runs": runs,
            "requests": earlier + [{**row, "run": run,
                                    "intervals": [[s, round(a, 4), round(b, 4)] for s, a, b in row["intervals"]]}
                                   for row in rows]}
    pairs = []
    try:
        if png:
            title = (f"{summary['done']} done, {summary['failed']} failed, {summary['skipped']} skipped; "
                     f"{summary['clips_per_hour']:.1f} clips/h" + (f"; rows of {run + 1} runs" if run else ""))
            pairs.append((temp_path(png_path), png_path))
            draw_timeline(data["requests"], pairs[0][0], title=title)
            data["png"] = {"bytes": pairs[0][0].stat().st_size, "sha256": sha256_file(pairs[0][0])}
        pairs.insert(0, (write_json_file(path, data), path))
    except BaseException:
        for temp, _ in pairs:
            discard(temp)
        raise
    commit(pairs, overwrite=replace)
    return [target for _, target in pairs]


def _earlier_runs(path: Path) -> tuple[list[dict], list[dict]]:
    """The runs and rows of an existing timeline of ours (batch_outputs.our_timeline); none from any other file."""
    old = our_timeline(path)
    if old is None:
        return [], []  # absent, or not ours (then --overwrite was given): this run's timeline starts afresh
    try:
        runs, rows = list(old["runs"]), [dict(row, run=row["run"]) for row in old["requests"]]
    except (KeyError, TypeError, ValueError):
        return [], []  # ours but damaged: this run's timeline replaces it (the clips' own records are untouched)
    return runs, rows


def legend_stages(rows: list[dict]) -> list[str]:
    """The stages the rows draw, in STAGE_COLOURS order: the legend names what is on the chart and nothing else."""
    drawn = {stage for row in rows for stage, _, _ in row["intervals"]}
    return [s for s in STAGE_COLOURS if s in drawn]


def draw_timeline(rows: list[dict], path: Path, title: str = "") -> None:
    """One horizontal row of coloured intervals per request, first request on top, saved as a PNG at `path` itself
    (write_timeline passes a temporary name and commits it). Rows of several runs are labelled with their run; the
    legend lists the stages drawn."""
    import matplotlib  # only a batch run that draws its timeline needs matplotlib (about a second to import)

    matplotlib.use("Agg")  # files only: never open a window, never need a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    height = max(2.0, 0.35 * len(rows) + 1.2)
    fig, ax = plt.subplots(figsize=(11, height))
    for y, row in enumerate(rows):
        for stage, start, end in row["intervals"]:
            ax.broken_barh([(start, max(end - start, 1e-4))], (y - 0.4, 0.8), color=STAGE_COLOURS[stage])
    several = len({row.get("run", 0) for row in rows}) > 1
    ax.set_yticks(range(len(rows)), [f"{r['id']}{'' if r['status'] == 'done' else ' (' + r['status'] + ')'}"
                                     f"{' run ' + str(r.get('run', 0) + 1) if several else ''}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since its run started" if several else "seconds since the run started")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=STAGE_COLOURS[s], label=s) for s in legend_stages(rows)], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png", dpi=110)
    finally:
        plt.close(fig)
