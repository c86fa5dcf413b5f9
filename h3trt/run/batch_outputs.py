"""What a batch may replace in its --out-dir: only the files it made, as its own records show.

A batch writes OUT/<id>.mp4 and OUT/<id>.json per request and OUT/<stem>.json and .png, the timeline. Every record and
timeline it writes carries MADE_BY (a done record also holds its clip's size and sha256, a timeline its PNG's).
Before any model loads, `plan_out_dir` sorts what OUT holds for each request:

  nothing there                          run it; its files are committed without replacing anything
  our record of a failure, no clip       run it again, replacing that record
  our record, done, no clip              run it again, and say so
  our record, done, the clip changed     refused: truncated or edited after it was made; kept
  our record, done, the clip verifies:
      the same request                   finished: skipped
      another request (the line changed) refused: the finished clip is kept
  any other file in the way              refused: not ours (the user's a.json, b.mp4, timeline.json, ...)

A refusal is one line naming every such file or id, before any model loads. Files that no record of ours marks may be
the user's, and nothing says they can be made again. A finished clip of a changed request is refused rather than
skipped or remade: skipping would leave a clip of the old request under the id while the run reports success, and
remaking it would throw away a finished clip (minutes of GPU time, maybe the one the user wanted) because a line was
edited. A clip that no longer matches its record is refused rather than remade: clips are committed whole, so a
mismatch means something outside h3trt changed the file after it was finished (a person trimming it, a program, a
disk fault); the batch cannot tell a ruined clip from an edited one, replacing it cannot be undone, and deleting it
to have it made again is one command. `--overwrite` runs those requests anyway and replaces their files (said once
when the run starts); finished requests are still skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..engines.atomic import sha256_file
from .batch_file import BatchItem
from ..media.output_files import OutputRefused
from ..pipeline.records import ClipRecord

MADE_BY = "h3trt run --requests"  # the marker in every record and timeline a batch writes: what marks a file ours
LISTED = 10  # names a message lists before "and N more"


def output_paths(out_dir: Path, item: BatchItem) -> tuple[Path, Path]:
    return Path(out_dir) / f"{item.id}.mp4", Path(out_dir) / f"{item.id}.json"


def timeline_paths(out_dir: Path, stem: str) -> tuple[Path, Path]:
    return Path(out_dir) / f"{stem}.json", Path(out_dir) / f"{stem}.png"


def _read_ours(path: Path) -> dict | None:
    """The JSON object at `path` if a batch wrote it (it carries MADE_BY); None if absent, unreadable or not ours."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):  # absent, a folder, not UTF-8, not JSON
        return None
    return data if isinstance(data, dict) and data.get("made_by") == MADE_BY else None


def our_record(path: Path, job_id: str) -> dict | None:
    """The record at `path` if a batch wrote it for request `job_id`, else None."""
    data = _read_ours(path)
    return data if data is not None and data.get("id") == job_id else None


def our_timeline(path: Path) -> dict | None:
    """The timeline at `path` if a batch wrote it, else None."""
    return _read_ours(path)


@dataclass(frozen=True)
class ClipState:
    """What OUT holds for one request: `kind` is new, retry, missing, damaged, finished, changed or foreign; `paths`
    the files not ours; `why` how a damaged clip differs from its record."""

    kind: str
    paths: tuple[Path, ...] = ()
    why: str = ""


def clip_damage(mp4: Path, record: ClipRecord) -> str | None:
    """How the clip at `mp4` differs from what its done record holds (size first: a truncation shows without
    reading the file), or None when it matches."""
    size, recorded = mp4.stat().st_size, record.mp4_bytes
    if recorded is not None and size != recorded:
        return f"{mp4} is {size} bytes, its record says {recorded}"
    if sha256_file(mp4) != record.mp4_sha256:
        return f"the sha256 of {mp4} is not the one its record holds"
    return None


def clip_state(out_dir: Path, item: BatchItem) -> ClipState:
    mp4, json_path = output_paths(out_dir, item)
    has_mp4, has_json = mp4.exists(), json_path.exists()
    if not has_json:
        return ClipState("foreign", (mp4,)) if has_mp4 else ClipState("new")
    record = our_record(json_path, item.id)
    if record is None:
        return ClipState("foreign", (json_path, mp4) if has_mp4 else (json_path,))
    if record.get("status") != "done":
        return ClipState("foreign", (mp4,)) if has_mp4 else ClipState("retry")  # a failure record marks no clip
    if not has_mp4:
        return ClipState("missing")  # nothing to keep; a SIGKILL between the record's and the clip's rename, too
    clip = ClipRecord.from_json(record)
    damage = clip_damage(mp4, clip)
    if damage is not None:
        return ClipState("damaged", why=damage)
    if clip.request != item.request.flat():
        return ClipState("changed")  # a finished clip of what the line asked before
    return ClipState("finished")


def finished(out_dir: Path, item: BatchItem) -> bool:
    """Whether OUT/<id>.mp4 and OUT/<id>.json are this batch's, done, for this same request, the MP4 as recorded."""
    return clip_state(out_dir, item).kind == "finished"


def _timeline_foreign(out_dir: Path, stem: str, png: bool) -> list[Path]:
    """The timeline files in the way that are not ours: a JSON without MADE_BY, a PNG its timeline does not record."""
    json_path, png_path = timeline_paths(out_dir, stem)
    data = our_timeline(json_path)
    foreign = [json_path] if json_path.exists() and data is None else []
    if png and png_path.exists():
        recorded = (data or {}).get("png") or {}
        if (recorded.get("bytes") != png_path.stat().st_size or recorded.get("sha256") != sha256_file(png_path)):
            foreign.append(png_path)
    return foreign


def _listed(names: list[str]) -> str:
    more = len(names) - LISTED
    return ", ".join(names[:LISTED]) + (f" and {more} more" if more > 0 else "")


@dataclass
class OutPlan:
    """What a batch does with each request's files and each timeline, decided before any model loads."""

    finished: set[str] = field(default_factory=set)  # ids whose clip is done for this very request: skipped
    replace: set[str] = field(default_factory=set)  # ids whose existing files the run may replace
    timelines: dict[str, bool] = field(default_factory=dict)  # stem -> whether its existing files may be replaced
    notes: list[str] = field(default_factory=list)  # said once when the run starts


def plan_out_dir(out_dir: Path, items: list[BatchItem], stems: list[str], png: bool, overwrite: bool) -> OutPlan:
    """Sort what OUT holds (module docstring). Raises OutputRefused naming every file in the way that is not ours,
    unless `overwrite`; `stems` are the timelines this run writes (with their PNGs when `png`)."""
    out_dir, plan, foreign, changed, damaged = Path(out_dir), OutPlan(), [], [], []
    for item in items:
        state = clip_state(out_dir, item)
        if state.kind == "finished":
            plan.finished.add(item.id)
        elif state.kind != "new":
            plan.replace.add(item.id)
        foreign += state.paths
        if state.kind == "changed":
            changed.append(f"{item.id} (line {item.line})")
        elif state.kind == "damaged":
            damaged.append(f"{item.id} ({state.why})")
        elif state.kind == "missing":
            plan.notes.append(f"{item.id}: {output_paths(out_dir, item)[0]} is gone though its record says done; "
                              "making it again")
    for stem in stems:
        foreign += _timeline_foreign(out_dir, stem, png)
        plan.timelines[stem] = any(p.exists() for p in timeline_paths(out_dir, stem)[:2 if png else 1])
    files, ids, clips = _listed([str(p) for p in foreign]), _listed(changed), _listed(damaged)
    if overwrite:
        plan.notes += [f"--overwrite: replacing {files} (not made by this batch)"] if foreign else []
        plan.notes += [f"--overwrite: making {ids} again for the changed request, replacing the finished clip"
                       ] if changed else []
        plan.notes += [f"--overwrite: making {clips} again, replacing the clip that no longer matches its record"
                       ] if damaged else []
        return plan
    refusals = [f"holds {files}, which this batch did not make (no record of an h3trt batch marks them); they may be "
                "yours, so they are kept"] if foreign else []
    refusals += [f"holds the finished clip of {ids}, whose request line changed since the clip was made; the clip is "
                 "kept (give the changed request a new id to keep both)"] if changed else []
    refusals += [f"holds {clips}: a clip that no longer matches its record, truncated or edited after the batch "
                 "finished it; it is kept (delete it to have it made again)"] if damaged else []
    if refusals:
        raise OutputRefused(f"--out-dir {out_dir} " + "; it ".join(refusals) + ". Nothing was run. Pass another "
                            "--out-dir, move those files away, or pass --overwrite to replace them.")
    return plan
