"""A job's row's request: what the API side stores when it admits a job (`row_request`: the admitted request's JSON,
request/request.py `Admitted.to_json`, its uploads named relative to their folder, beside the fields as sent and
OpenAI's echo), and the one reading of it (`stored_request`: the worker that takes the job, which may be another
process than the one that admitted it, or a later one, with the uploads fetched into another folder). Nothing is
parsed again: the request runs as admission resolved it (its adapters' files and hashes, its schedule).

A row written before the admitted request was stored (no "admitted": its fields as sent, the adapters and schedule
admission resolved, the canvas's width and height) is read as it was then: its fields parsed with the model's
defaults, then the stored adapters and schedule put back. A server restarted on an old jobs database runs its rows.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..adapters.use import AdapterUse
from ..request.fields import API_WORDS
from ..request.parse import RequestDefaults, parse_object
from ..request.request import Admitted, BatchKey, Request, ScheduleChoice

ADMITTED = "admitted"  # the row's key for the admitted request's JSON


def row_request(admitted: Admitted, schema: dict, openai: dict, uploads: Path) -> dict:
    """A job's stored request: the admitted request (its input files relative to `uploads`), and the fields as sent
    (`schema`, the one table's keys) and OpenAI's fields as the job's GET echoes them."""
    return {"schema": schema, "openai": openai, ADMITTED: admitted.to_json(uploads)}


def stored_request(stored: dict, uploads: Path, defaults: RequestDefaults) -> tuple[Request, BatchKey | None]:
    """The request a row stores (module doc), its input files in `uploads`, and its batch key (BatchKey.of; None for
    a row of before, which runs alone); `defaults` read a row of before only."""
    if ADMITTED in stored:
        admitted = Admitted.from_json(stored[ADMITTED], uploads)
        return admitted.request, admitted.batch_key
    request = parse_object(stored["schema"], 0, uploads, ("prompt",), defaults, API_WORDS).request
    if stored.get("adapters"):  # as admission resolved them: the files and hashes of then, not the set now
        request = replace(request, adapters=tuple(AdapterUse.from_json(a) for a in stored["adapters"]))
    if stored.get("schedule"):  # and the schedule they gave it then
        request = replace(request, schedule=ScheduleChoice.from_json(stored["schedule"]))
    return request, None


def shown(stored: dict, default_steps: int) -> tuple[int, int, int, list[AdapterUse]]:
    """What a job's GET shows of its stored request before it has a record: its canvas's width and height, its steps
    and its resolved adapters (a row of before: what it stored of them, else the steps as sent or the default)."""
    if ADMITTED in stored:
        data = stored[ADMITTED]
        geometry, request = data["geometry"], data["request"]
        uses = [AdapterUse.from_json(a) for a in request["adapters"]]  # resolved by a server's set, or by name only
        return (geometry["width"], geometry["height"], request["schedule"]["steps"],
                uses if all(u.sha256 for u in uses) else [])
    width, height = stored.get("geometry", [0, 0])
    steps = stored.get("schedule", {}).get("steps", stored["schema"].get("steps", default_steps))
    return width, height, int(steps), [AdapterUse.from_json(a) for a in stored.get("adapters", ())]
