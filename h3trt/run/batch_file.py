"""The requests file of `h3trt run --requests`, as a batch plans it: every line parsed by the one schema
(h3trt/request/parse.py: id, task and prompt required) and then `prepare`d (files readable, canvas and duration
allowed) before any model loads; every error names its line, and all errors are reported at once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ..models.sampler import DEFAULT_STEPS, ScheduleValues
from ..models.sparse.plan import SparseSettings
from ..pipeline.prepare import Prepared, prepare
from ..request.fields import KEY_WORDS
from ..request.parse import RUN_REQUIRED, RequestDefaults, RequestLine, read_request_file
from ..request.request import Admitted, CanvasDefaults, Request


@dataclass(frozen=True)
class BatchItem:
    """One validated line of a requests file."""

    id: str
    line: int  # 1-based line number in the file
    admitted: Admitted  # its request and geometry; its batch key says which lines may share a batched denoise

    @property
    def request(self) -> Request:
        return self.admitted.request


def parse_requests(path: Path, canvas: CanvasDefaults, default_steps: int = DEFAULT_STEPS,
                   admit: Callable[[Request], Prepared] | None = None,
                   default_sparse: SparseSettings | None = None,
                   adapter_schedules: Mapping[str, ScheduleValues] | None = None) -> list[BatchItem]:
    """Every line of a JSONL requests file, validated; raises RequestsFileError listing every bad line. A line
    without "steps" takes the schedule of an adapter it names (`adapter_schedules`, by name), else `default_steps` (a
    bundle's default schedule, else DEFAULT_STEPS), one that states no sparse knob `default_sparse`'s (a bundle's
    --sparse-attention defaults); `admit` admits each line's request to the model that will serve it
    (jobs/admission.py, in the file's keys); None: each is only prepared on `canvas`."""

    def check(line: RequestLine) -> BatchItem:
        request = line.request
        # inputs readable, canvas and duration allowed (re-read at run time), and served by the model
        prepared = admit(request) if admit is not None else prepare(request, canvas, KEY_WORDS)
        return BatchItem(line.id, line.line, Admitted(prepared.request, prepared.geometry))

    defaults = RequestDefaults(steps=default_steps, sparse=default_sparse, adapter_schedules=adapter_schedules or {})
    return read_request_file(path, RUN_REQUIRED, defaults, check)
