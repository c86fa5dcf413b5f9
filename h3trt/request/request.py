"""A request, typed once, and the same request admitted: the one shape that travels from the front door that parsed it
to the rank that runs it and the record it leaves.

  - `Request`: its parts (request/parts.py) and its adapters (h3trt/adapters/use.py). `Request.of` makes one from
    the fields a user states, by their names (a requests line's keys, run's flags); `flat` writes those fields back
    (a clip record's `request`, a failure record's), and `from_flat` reads them (also a job row of before, whose
    request was its fields)
  - `Admitted`: a request a model admitted (jobs/admission.py `admit`) with the geometry admission resolved of it. A
    job carries it from admission to the rank, and a server's job row stores its JSON, so nothing is parsed twice
  - `BatchKey.of(admitted)`: the one batch rule, which admitted requests may share a batched denoise (None: it shares
    no evaluation; once the request is encoded, its packed layout must agree too: models/packing.py
    `PackedLayout.digest`, which jobs/work.py `layout_key` keys by)

The JSON is versioned (`VERSION`; another version is refused by name).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Mapping

from ..adapters.use import AdapterUse, batch_key, lora_field
from ..models.packing import DEFAULT_DURATION, Geometry
from ..models.sampler import DEFAULT_GUIDANCE, DEFAULT_SEED, DEFAULT_STEPS
from ..models.step_cache import StepCacheConfig
from .parts import Canvas, Guidance, Inputs, ScheduleChoice, ScheduleFrom, Speed

VERSION = 1  # the JSON's shape; a reader of an older shape keeps the older rows running


@dataclass(frozen=True)
class Request:
    """One generation request, resolved by its front door: what it is made from, its canvas, its schedule, its
    guidance, its speed settings and the adapters it runs with."""

    inputs: Inputs
    canvas: Canvas = Canvas()
    schedule: ScheduleChoice = ScheduleChoice()
    guidance: Guidance = Guidance()
    speed: Speed = Speed()
    adapters: tuple[AdapterUse, ...] = ()

    @classmethod
    def of(cls, prompt: str, image: Path | None = None, last_image: Path | None = None, refs: tuple[Path, ...] = (),
           seed: int = DEFAULT_SEED, steps: int = DEFAULT_STEPS, width: int | None = None, height: int | None = None,
           duration: float = DEFAULT_DURATION, video_shift: float | None = None, audio_shift: float | None = None,
           guidance: float = DEFAULT_GUIDANCE, negative_prompt: str | None = None,
           cache: StepCacheConfig | None = None, sparse_attention: float = 0.0, sparse_dense_steps: int | None = None,
           sparse_min_seq: int | None = None, vsa_sparsity: float | None = None, profile: str | None = None,
           lora: tuple[AdapterUse, ...] = (), schedule_from: ScheduleFrom | None = None) -> Request:
        """A request from the fields a user states, by their names (module doc): the schedule's sources
        (`schedule_from`) as its front door resolved them, None in a request made in code."""
        return cls(Inputs(prompt, image, last_image, tuple(refs), seed), Canvas(width, height, duration),
                   ScheduleChoice(steps, video_shift, audio_shift, schedule_from),
                   Guidance(guidance, negative_prompt),
                   Speed(profile, cache, sparse_attention, sparse_dense_steps, sparse_min_seq, vsa_sparsity), tuple(lora))

    def fields(self) -> dict:
        """`of`'s arguments for this request (`replaced` changes some of them)."""
        i, c, s, g, v = self.inputs, self.canvas, self.schedule, self.guidance, self.speed
        return {"prompt": i.prompt, "image": i.image, "last_image": i.last_image, "refs": i.refs, "seed": i.seed,
                "steps": s.steps, "width": c.width, "height": c.height, "duration": c.duration,
                "video_shift": s.video_shift, "audio_shift": s.audio_shift, "guidance": g.scale,
                "negative_prompt": g.negative_prompt, "cache": v.cache, "sparse_attention": v.sparse_attention,
                "sparse_dense_steps": v.sparse_dense_steps, "sparse_min_seq": v.sparse_min_seq,
                "vsa_sparsity": v.vsa_sparsity, "profile": v.profile, "lora": self.adapters, "schedule_from": s.origin}

    def replaced(self, **fields) -> Request:
        """This request with some of the fields a user states (`of`'s names) replaced: a profile's speed (eval)."""
        return Request.of(**{**self.fields(), **fields})

    @property
    def task(self) -> str:
        return self.inputs.task

    def flat(self) -> dict:
        """The fields a user states, as JSON (a record's `request`): the adapters by name and scale (their files are
        the record's `adapters`), the schedule's sources left out (the record's `schedule_from` has them), `lora`
        only when it names any (a request without adapters is written as before they existed), `vsa_sparsity` only
        when stated (likewise)."""
        data = self.fields()
        data.update(self.inputs.to_json(), cache=self.speed.cache.to_dict() if self.speed.cache is not None else None)
        del data["schedule_from"], data["lora"]
        if self.adapters:
            data["lora"] = lora_field(self.adapters)
        if self.speed.vsa_sparsity is None:
            del data["vsa_sparsity"]  # likewise a request that states no VSA sparsity
        return data

    @classmethod
    def from_flat(cls, fields: Mapping) -> Request:
        """`flat`'s JSON read back (or `of`'s arguments as objects): paths as text, the cache a dict, the adapters
        with or without their resolved file and hash."""
        data = dict(fields)
        data["refs"] = tuple(Path(p) for p in data.get("refs") or ())
        for key in ("image", "last_image"):
            data[key] = Path(data[key]) if data.get(key) else None
        if isinstance(data.get("cache"), dict):
            data["cache"] = StepCacheConfig.from_dict(data["cache"])
        if isinstance(data.get("schedule_from"), dict):
            data["schedule_from"] = ScheduleFrom(**data["schedule_from"])
        data["lora"] = tuple(u if isinstance(u, AdapterUse) else AdapterUse(u["name"], u.get("scale"), u.get("file"),
                                                                            u.get("sha256"))
                             for u in data.get("lora") or ())
        return cls.of(**data)

    def to_json(self, folder: Path | None = None) -> dict:
        """Versioned; `folder`: the input files under it are written relative to it (Inputs.to_json)."""
        return {"version": VERSION, "inputs": self.inputs.to_json(folder), "canvas": self.canvas.to_json(),
                "schedule": self.schedule.to_json(), "guidance": self.guidance.to_json(),
                "speed": self.speed.to_json(), "adapters": [u.to_json() for u in self.adapters]}

    @classmethod
    def from_json(cls, data: dict, folder: Path | None = None) -> Request:
        """`to_json`'s, its relative input paths under `folder`."""
        if data.get("version") != VERSION:
            raise ValueError(f"a stored request of version {data.get('version')!r}; this h3trt reads version "
                             f"{VERSION} (and a job row of before, by its fields: server/rows.py).")
        return cls(Inputs.from_json(data["inputs"], folder), Canvas.from_json(data["canvas"]),
                   ScheduleChoice.from_json(data["schedule"]), Guidance.from_json(data["guidance"]),
                   Speed.from_json(data["speed"]), tuple(AdapterUse.from_json(u) for u in data["adapters"]))


@dataclass(frozen=True)
class Admitted:
    """A request a model admitted (module doc), with the geometry admission resolved."""

    request: Request
    geometry: Geometry

    @property
    def batch_key(self) -> BatchKey | None:
        return BatchKey.of(self)

    def to_json(self, folder: Path | None = None) -> dict:
        """What a job's row stores (versioned with its request: `Request.to_json`, `folder` as there)."""
        g = self.geometry
        return {"version": VERSION, "request": self.request.to_json(folder),
                "geometry": {"height": g.height, "width": g.width, "num_frames": g.num_frames}}

    @classmethod
    def from_json(cls, data: dict, folder: Path | None = None) -> Admitted:
        if data.get("version") != VERSION:
            raise ValueError(f"a stored admitted request of version {data.get('version')!r}; this h3trt reads version "
                             f"{VERSION}.")
        g = data["geometry"]
        return cls(Request.from_json(data["request"], folder), Geometry(g["height"], g["width"], g["num_frames"]))


@dataclass(frozen=True)
class BatchKey:
    """What requests that share one batched denoise have in common before encoding: the same task, canvas, frames,
    schedule and adapter set (one evaluation carries one set), from the same model. After encoding their packed
    layouts must agree too (models/packing.py PackedLayout.digest: the same text length and condition rows)."""

    task: str
    height: int
    width: int
    num_frames: int
    steps: int
    video_shift: float | None  # None: the model's (the same for every request of one model)
    audio_shift: float | None
    adapters: tuple = ()  # each AdapterUse's batch_part, in the request's order

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
                   batch_key(req.adapters))

    def digest(self) -> str:
        """The key as a job store's row holds it (server/store.py `batch_key`, which a claim matches in SQL): equal
        keys, equal digests, in any process; the request JSON's VERSION is part of it, so rows of another shape
        never match."""
        return hashlib.sha256(json.dumps([VERSION, *astuple(self)]).encode()).hexdigest()
