"""Per-request timelines of a batch run: OUT/timeline.json and OUT/timeline.png.

Each request is one row of intervals on a clock shared by the whole run (seconds since the run started): text and
condition encode, the wait for its batch to fill (`wait_batch`), the batch's shared denoise, the wait for earlier
members of its batch to finish decoding (`wait_decode`), video decode, audio decode and mux. Stacked one row per
request, the host tail (decode and mux after the last denoise) and the idle gaps between batches show at a glance.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .files import commit, discard, temp_path, write_json_atomic
from .records import StageTimer

# Colour per stage (the PNG's legend order); a stage not listed here is refused rather than drawn grey.
STAGE_COLOURS = {
    "text_encode": "#4c72b0",
    "condition_encode": "#64b5cd",
    "wait_batch": "#dddddd",
    "denoise": "#dd8452",
    "wait_decode": "#bbbbbb",
    "video_decode": "#55a868",
    "audio_decode": "#8172b3",
    "mux": "#c44e52",
    "decode_mux": "#937860",  # decode and mux overlapped on threads/ranks: one bar for the whole call
}


class TimelineTimer(StageTimer):
    """A StageTimer that also keeps every interval, in seconds since `origin` (a `time.perf_counter()` value)."""

    def __init__(self, device: torch.device, origin: float):
        super().__init__(device)
        self.origin = origin
        self.intervals: list[tuple[str, float, float]] = []

    def mark(self, stage: str, start: float, end: float) -> None:
        """An interval for the timeline only (its seconds are already charged elsewhere)."""
        self.intervals.append((stage, start - self.origin, end - self.origin))

    def add(self, stage: str, start: float, end: float) -> None:
        if stage not in STAGE_COLOURS:
            raise ValueError(f"Timeline stage {stage!r} is not one of {list(STAGE_COLOURS)}; add it to STAGE_COLOURS.")
        super().add(stage, start, end)
        start, end = start - self.origin, end - self.origin
        last = self.intervals[-1] if self.intervals else None
        if last is not None and last[0] == stage and start - last[2] < 1e-3:
            self.intervals[-1] = (stage, last[1], end)  # one bar for back-to-back pieces of one stage
        else:
            self.intervals.append((stage, start, end))


def write_timeline(out_dir: Path, stem: str, rows: list[dict], summary: dict, png: bool,
                   started_unix: float) -> list[Path]:
    """Write OUT/<stem>.json (and OUT/<stem>.png) atomically; `rows` are {"id", "status", "group", "batch",
    "intervals"}. `stem` is "timeline", or "timeline-group{i}" for torchrun's group i (each group serves its own
    share there).

    A resumed run keeps the earlier runs' rows: each run is listed in `runs` (its start and summary) and each row
    says which run it belongs to, its intervals in seconds since that run started. `summary` and `started_unix` at
    the top are the latest run's."""
    json_name, png_name = f"{stem}.json", f"{stem}.png"
    path = Path(out_dir) / json_name
    runs, earlier = _earlier_runs(path)
    run = len(runs)
    runs.append({"started_unix": started_unix, "summary": summary})
    data = {"started_unix": started_unix, "clock": "seconds since the row's run started", "summary": summary, "runs": runs,
            "requests": earlier + [{**row, "run": run,
                                    "intervals": [[s, round(a, 4), round(b, 4)] for s, a, b in row["intervals"]]}
                                   for row in rows]}
    written = [path]
    write_json_atomic(path, data)
    if png:
        written.append(Path(out_dir) / png_name)
        title = (f"{summary['done']} done, {summary['failed']} failed, {summary['skipped']} skipped; "
                 f"{summary['clips_per_hour']:.1f} clips/h" + (f"; rows of {run + 1} runs" if run else ""))
        draw_timeline(data["requests"], written[1], title=title)
    return written


def _earlier_runs(path: Path) -> tuple[list[dict], list[dict]]:
    """The runs and rows of an existing timeline (a file from before runs were kept counts as one run)."""
    if not path.exists():
        return [], []
    try:
        old = json.loads(path.read_text())
        runs = old.get("runs") or [{"started_unix": old["started_unix"], "summary": old["summary"]}]
        rows = [{**row, "run": row.get("run", 0)} for row in old["requests"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [], []  # unreadable: this run's timeline replaces it (the clips' own records are untouched)
    return runs, rows


def legend_stages(rows: list[dict]) -> list[str]:
    """The stages the rows draw, in STAGE_COLOURS order: the legend names what is on the chart and nothing else."""
    drawn = {stage for row in rows for stage, _, _ in row["intervals"]}
    return [s for s in STAGE_COLOURS if s in drawn]


def draw_timeline(rows: list[dict], path: Path, title: str = "") -> None:
    """One horizontal row of coloured intervals per request, first request on top; written atomically. Rows of
    several runs are labelled with their run; the legend lists the stages drawn."""
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
    tmp = temp_path(path)
    try:
        fig.savefig(tmp, format="png", dpi=110)
        commit([(tmp, path)], overwrite=True)
    finally:
        plt.close(fig)
        discard(tmp)
