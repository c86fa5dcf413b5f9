"""An admitted request: the request as its front door resolved it, and what admission resolved of it against the
model (jobs/admission.py `admit`): the geometry its inputs and the model's canvas give. It is what a job carries from
admission to the rank (a job's row stores its JSON), so nothing is parsed twice; and it answers the one batch rule
(`BatchKey.of`): which admitted requests may share a batched denoise.

The batch rule has two halves: before encoding, `BatchKey` (the same task, canvas, frames, schedule and adapter set,
and a request whose every evaluation can be shared: one branch, no step cache, dense attention); after encoding, the
packed layout (the same text length and condition rows), which only the encoded request knows.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.packing import Geometry
from .request import VERSION, Request


@dataclass(frozen=True)
class BatchKey:
    """What requests that share one batched denoise have in common before encoding (module doc); equal keys may share
    one, from the same model."""

    task: str
    height: int
    width: int
    num_frames: int
    steps: int
    video_shift: float | None  # None: the model's (the same for every request of one model)
    audio_shift: float | None
    adapters: tuple = ()  # each AdapterUse's batch_part, in the request's order (one evaluation carries one set)

    @classmethod
    def of(cls, admitted: Admitted) -> BatchKey | None:
        """The key of an admitted request; None for one that shares no evaluation (guidance runs two branches per
        step, a step cache decides per request which evaluations to skip, block-sparse attention counts one
        request's evaluations): it is denoised alone."""
        req, geo = admitted.request, admitted.geometry
        if req.guidance.branches > 1 or not req.speed.shares_evaluations:
            return None
        s = req.schedule
        return cls(req.task, geo.height, geo.width, geo.num_frames, s.steps, s.video_shift, s.audio_shift,
                   tuple(u.batch_part for u in req.adapters))


@dataclass(frozen=True)
class Admitted:
    """A request a model admitted (module doc), with the geometry admission resolved."""

    request: Request
    geometry: Geometry

    @property
    def batch_key(self) -> BatchKey | None:
        return BatchKey.of(self)

    def to_json(self) -> dict:
        """What a job's row stores (versioned with its request: `Request.to_json`)."""
        g = self.geometry
        return {"version": VERSION, "request": self.request.to_json(),
                "geometry": {"height": g.height, "width": g.width, "num_frames": g.num_frames}}

    @classmethod
    def from_json(cls, data: dict) -> Admitted:
        if data.get("version") != VERSION:
            raise ValueError(f"a stored admitted request of version {data.get('version')!r}; this h3trt reads version "
                             f"{VERSION}.")
        g = data["geometry"]
        return cls(Request.from_json(data["request"]), Geometry(g["height"], g["width"], g["num_frames"]))
