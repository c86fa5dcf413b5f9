"""Per-request timelines of a batch run: OUT/timeline.json and OUT/timeline.png.

Each request is one row of intervals on a clock shared by the whole run (seconds since the run started): text and
condition encode, the wait for its batch to fill (`wait_batch`), the batch's shared denoise, the wait for earlier
members of its batch to finish decoding (`wait_decode`), video decode, audio decode and mux. Stacked one row per
request, the host tail (decode and mux after the last denoise) and the idle gaps between batches show at a glance.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .pipeline import StageTimer, write_json_atomic

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


def timeline_names(shard: tuple[int, int]) -> tuple[str, str]:
    """timeline.json/png for a run with one replica group; timeline-group{i}.json/png for group i of several."""
    stem = "timeline" if shard[1] == 1 else f"timeline-group{shard[0]}"
    return f"{stem}.json", f"{stem}.png"


def write_timeline(out_dir: Path, shard: tuple[int, int], rows: list[dict], summary: dict, png: bool,
                   started_unix: float) -> list[Path]:
    """Write the JSON (and the PNG) atomically; `rows` are {"id", "status", "batch", "intervals"}."""
    json_name, png_name = timeline_names(shard)
    data = {"started_unix": started_unix, "clock": "seconds since the run started", "shard": list(shard),
            "summary": summary,
            "requests": [{**row, "intervals": [[s, round(a, 4), round(b, 4)] for s, a, b in row["intervals"]]}
                         for row in rows]}
    written = [Path(out_dir) / json_name]
    write_json_atomic(written[0], data)
    if png:
        written.append(Path(out_dir) / png_name)
        draw_timeline(rows, written[1], title=f"{summary['done']} done, {summary['failed']} failed, "
                                              f"{summary['skipped']} skipped; {summary['clips_per_hour']:.1f} clips/h")
    return written


def draw_timeline(rows: list[dict], path: Path, title: str = "") -> None:
    """One horizontal row of coloured intervals per request, first request on top; written atomically."""
    import matplotlib  # only a batch run that draws its timeline needs matplotlib (about a second to import)

    matplotlib.use("Agg")  # files only: never open a window, never need a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    height = max(2.0, 0.35 * len(rows) + 1.2)
    fig, ax = plt.subplots(figsize=(11, height))
    for y, row in enumerate(rows):
        for stage, start, end in row["intervals"]:
            ax.broken_barh([(start, max(end - start, 1e-4))], (y - 0.4, 0.8), color=STAGE_COLOURS[stage])
    ax.set_yticks(range(len(rows)), [f"{r['id']}{'' if r['status'] == 'done' else ' (' + r['status'] + ')'}"
                                     for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run started")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=c, label=s) for s, c in STAGE_COLOURS.items()], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.partial")
    try:
        fig.savefig(tmp, format="png", dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
