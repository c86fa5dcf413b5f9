"""A request, typed once: its parts (request/parts.py) and its adapters, the one shape that travels from the front
door that parsed it to the rank that runs it and the record it leaves.

Its JSON is versioned (`VERSION`; `from_json` refuses another version by name). `from_flat` reads the flat shape
requests had before (pipeline/request.py Request's fields, as objects or as their JSON: a record's `request`, a job
row's), and `flat` writes it (the record's `request` keeps it), so the typed request can wrap today's while the front
doors move onto it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..adapters.use import AdapterUse
from ..models.packing import DEFAULT_DURATION
from ..models.sampler import DEFAULT_GUIDANCE, DEFAULT_SEED
from ..models.sparse_plan import sparse_settings
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

    @property
    def task(self) -> str:
        return self.inputs.task

    def to_json(self) -> dict:
        return {"version": VERSION, "inputs": self.inputs.to_json(), "canvas": self.canvas.to_json(),
                "schedule": self.schedule.to_json(), "guidance": self.guidance.to_json(),
                "speed": self.speed.to_json(), "adapters": [u.to_json() for u in self.adapters]}

    @classmethod
    def from_json(cls, data: dict) -> Request:
        if data.get("version") != VERSION:
            raise ValueError(f"a stored request of version {data.get('version')!r}; this h3trt reads version "
                             f"{VERSION} (and the flat shape before it: Request.from_flat).")
        return cls(Inputs.from_json(data["inputs"]), Canvas.from_json(data["canvas"]),
                   ScheduleChoice.from_json(data["schedule"]), Guidance.from_json(data["guidance"]),
                   Speed.from_json(data["speed"]), tuple(AdapterUse.from_json(u) for u in data["adapters"]))

    @classmethod
    def from_flat(cls, fields: Mapping) -> Request:
        """The flat shape of before (module doc): pipeline/request.py Request's field names, each value as the object
        or as its JSON (a record's `request`: paths as text, the cache a dict, `lora` name and scale only). The
        sparse settings are resolved here: a knob left None takes its default."""
        get = fields.get
        refs = tuple(Path(p) for p in get("refs") or ())
        inputs = Inputs(fields["prompt"], _path(get("image")), _path(get("last_image")), refs,
                        get("seed", DEFAULT_SEED))
        origin = get("schedule_from")
        schedule = ScheduleChoice(fields["steps"], get("video_shift"), get("audio_shift"),
                                  ScheduleFrom(**origin) if isinstance(origin, dict) else origin or ScheduleFrom())
        cache = get("cache")
        speed = Speed(get("profile"), StepCacheConfig.from_dict(cache) if isinstance(cache, dict) else cache,
                      sparse_settings(get("sparse_attention") or 0.0, get("sparse_dense_steps"),
                                      get("sparse_min_seq"), where=""))
        uses = tuple(u if isinstance(u, AdapterUse) else AdapterUse(u["name"], u.get("scale"), u.get("file"),
                                                                    u.get("sha256")) for u in get("lora") or ())
        return cls(inputs, Canvas(get("width"), get("height"), get("duration", DEFAULT_DURATION)), schedule,
                   Guidance(get("guidance", DEFAULT_GUIDANCE), get("negative_prompt")), speed, uses)

    def flat(self) -> dict:
        """The flat shape of before, as JSON (a clip record's `request`): the adapters by name and scale (their files
        are the record's `adapters`), the schedule's sources left out (the record's `schedule` has them)."""
        i, c, s, sparse = self.inputs, self.canvas, self.schedule, self.speed.sparse
        data = {**i.to_json(), "steps": s.steps, "width": c.width, "height": c.height, "duration": c.duration,
                "video_shift": s.video_shift, "audio_shift": s.audio_shift, "guidance": self.guidance.scale,
                "negative_prompt": self.guidance.negative_prompt,
                "cache": self.speed.cache.to_dict() if self.speed.cache is not None else None,
                "sparse_attention": sparse.sparsity, "sparse_dense_steps": sparse.dense_steps,
                "sparse_min_seq": sparse.min_seq, "profile": self.speed.profile}
        if self.adapters:  # a request without adapters is written as before they existed
            data["lora"] = [{"name": u.name, **({"scale": u.scale} if u.scale is not None else {})}
                            for u in self.adapters]
        return data


def _path(value) -> Path | None:
    return Path(value) if value else None
