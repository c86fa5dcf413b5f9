"""A request, typed once, and the same request admitted: the one shape that travels from the front door that parsed it
to the rank that runs it and the record it leaves.

  - its parts, each a frozen dataclass with its JSON: what the user gave (`Inputs`), the canvas it asks for
    (`Canvas`), the schedule as its front door resolved it and where each value came from (`ScheduleChoice`,
    `ScheduleFrom`), classifier-free guidance (`Guidance`) and the speed settings a profile or the request chose
    (`Speed`: step cache, block-sparse attention and a FastH3-VSA model's sparsity); its adapters are
    h3trt/adapters/'s `AdapterUse`s. Beside them: how a model picks a canvas a request leaves out (`CanvasDefaults`),
    and some of a schedule's values (models/sampler.py `ScheduleValues`: what a request or an adapter states, below
    the adapters that bring one), which `ScheduleChoice.resolve` turns into the request's schedule
  - `Request`: its parts and its adapters. `Request.of` makes one from the fields a user states, by their names (a
    requests line's keys, run's flags); `flat` writes those fields back (a clip record's `request`, a failure
    record's), and `from_flat` reads them (also a job row of before, whose request was its fields)
  - `Admitted`: a request a model admitted (jobs/admission.py `admit`) with the geometry admission resolved of it. A
    server's job row stores its JSON, so nothing is parsed twice; a job carries its request and batch key
    (jobs/job.py), and the rank reads the media again, resolving the same geometry (pipeline/prepare.py read_media)
  - `BatchKey.of(admitted)`: the one batch rule, which admitted requests may share a batched denoise (None: it shares
    no evaluation; once the request is encoded, its packed layout must agree too: models/packing.py
    `PackedLayout.digest`, which jobs/work.py `layout_key` keys by)

The JSON is versioned (`VERSION`; another version is refused by name).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, astuple, dataclass, fields
from pathlib import Path
from typing import Mapping

from ..adapters.use import AdapterUse, batch_key, lora_field
from ..errors import UserError
from ..models.packing import CANVAS_MAX_PIXELS, CANVAS_SHORT_EDGE, DEFAULT_DURATION, Geometry
from ..models.sampler import DEFAULT_GUIDANCE, DEFAULT_SEED, DEFAULT_STEPS, ScheduleValues
from ..models.sparse.plan import SparseSettings, sparse_settings
from ..models.step_cache import StepCacheConfig

REQUEST, DEFAULT = "request", "default"  # ScheduleFrom's words for a request's own value and the model's default
REFERENCE_IMAGE_SHORT_EDGE = 2048  # reference images are encoded at their own short edge, upscaling included


def task_of(image, last_image, refs) -> str:
    """The task a request's inputs make it: references are ref2va, a first or last keyframe fl2va, none t2va (every
    front door derives it here: a stored request, a requests line, the API's job object)."""
    if refs:
        return "ref2va"
    return "fl2va" if (image or last_image) else "t2va"


@dataclass(frozen=True)
class CanvasDefaults:
    """How a model picks a canvas when the request names none."""

    short_edge: int = CANVAS_SHORT_EDGE
    max_pixels: int = CANVAS_MAX_PIXELS
    reference_short_edge: int = REFERENCE_IMAGE_SHORT_EDGE


@dataclass(frozen=True)
class Inputs:
    """What the clip is made from: the prompt, the keyframes or references (their files, read at admission and again
    on the rank that runs it), and the seed of its starting noise."""

    prompt: str
    image: Path | None = None  # first keyframe (fl2va)
    last_image: Path | None = None  # last keyframe (fl2va)
    refs: tuple[Path, ...] = ()  # image / audio / video references (ref2va), in the order the model reads them
    seed: int = DEFAULT_SEED

    @property
    def task(self) -> str:
        return task_of(self.image, self.last_image, self.refs)

    def to_json(self, folder: Path | None = None) -> dict:
        """`folder`: the files under it are written relative to it (a server's uploads, which its worker fetches into
        another folder: `from_json`'s `folder`)."""
        return {"prompt": self.prompt, "image": _text(self.image, folder), "last_image": _text(self.last_image, folder),
                "refs": [_text(p, folder) for p in self.refs], "seed": self.seed}

    @classmethod
    def from_json(cls, data: dict, folder: Path | None = None) -> Inputs:
        """`folder`: where the relative paths are (an absolute path stays as it is)."""
        return cls(data["prompt"], _path(data["image"], folder), _path(data["last_image"], folder),
                   tuple(_path(p, folder) for p in data["refs"]), data["seed"])


@dataclass(frozen=True)
class Canvas:
    """The clip's size and length as asked: width and height (both None: the model picks from its defaults and the
    first keyframe's aspect) and seconds (rounded up to the next 17n + 5 frames). Admission resolves it to a
    Geometry."""

    width: int | None = None
    height: int | None = None
    duration: float = DEFAULT_DURATION

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Canvas:
        return cls(data["width"], data["height"], data["duration"])


@dataclass(frozen=True)
class ScheduleFrom:
    """Where each of a request's schedule values came from: "request" (its own), "adapter NAME" (one it names), or
    "default" (the model's: a bundle's first schedule, else H3's 50 steps and the checkpoint's shifts)."""

    steps: str = DEFAULT
    video_shift: str = DEFAULT
    audio_shift: str = DEFAULT

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    def adapters(self) -> dict[str, str]:
        """The keys an adapter gave, and which ("adapter NAME")."""
        return {key: source for key, source in asdict(self).items() if source not in (REQUEST, DEFAULT)}


@dataclass(frozen=True)
class ScheduleChoice:
    """The request's schedule as its front door resolved it (`resolve`): the steps (sigma grid points: steps - 1 DiT
    evaluations) and the shifts (None: the model's), and where each came from (None: not said, a request made in
    code)."""

    steps: int = DEFAULT_STEPS
    video_shift: float | None = None
    audio_shift: float | None = None
    origin: ScheduleFrom | None = None

    def to_json(self) -> dict:
        return {"steps": self.steps, "video_shift": self.video_shift, "audio_shift": self.audio_shift,
                "from": self.origin.to_json() if self.origin is not None else None}

    @classmethod
    def from_json(cls, data: dict) -> ScheduleChoice:
        origin = data["from"]
        return cls(data["steps"], data["video_shift"], data["audio_shift"],
                   ScheduleFrom(**origin) if origin is not None else None)

    @classmethod
    def resolve(cls, stated: ScheduleValues, names: tuple[str, ...], schedules: Mapping[str, ScheduleValues],
                default_steps: int) -> ScheduleChoice:
        """A request's schedule, key by key: `stated` (its own values); else the value the adapters its `lora` names
        give (`names`; `schedules` theirs, by name: one not there gives nothing, and admission refuses one not
        resident; two giving different values: refused, naming `lora`); else the model's default (`default_steps`;
        a shift left to the default stays None: the pipeline takes the model's). The resolved values are the
        request's from then on: admission checks them against what a bundle serves, and a batch keys on them."""
        values, sources = {}, {}
        for f in fields(ScheduleValues):
            key = f.name
            offers = {name: getattr(schedules[name], key) for name in names
                      if name in schedules and getattr(schedules[name], key) is not None}
            if getattr(stated, key) is not None:
                values[key], sources[key] = getattr(stated, key), REQUEST
            elif len(set(offers.values())) > 1:
                said = ", ".join(f"{name} {value:g}" for name, value in offers.items())
                raise UserError(f"lora: the adapters this request names bring different {key} ({said}); state {key} "
                                "in the request, or name one of them.", field="lora")
            elif offers:
                values[key], sources[key] = next(iter(offers.values())), "adapter " + ", ".join(offers)
            else:
                values[key], sources[key] = default_steps if key == "steps" else None, DEFAULT
        return cls(**values, origin=ScheduleFrom(**sources))


@dataclass(frozen=True)
class Guidance:
    """Classifier-free guidance: its scale (1: off, H3's default, one branch) and the negative branch's prompt
    (required when the scale is over 1)."""

    scale: float = DEFAULT_GUIDANCE
    negative_prompt: str | None = None

    @property
    def branches(self) -> int:
        """DiT evaluations per step: the positive branch, and the negative one under guidance."""
        return 2 if self.scale > 1.0 else 1

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Guidance:
        return cls(data["scale"], data["negative_prompt"])


@dataclass(frozen=True)
class Speed:
    """What trades exactness for time, as the request or its profile chose (request/fields.py PROFILES): the step cache
    (None: every block of every evaluation runs) and block-sparse attention as stated (the fraction of key blocks
    skipped, 0: dense; the leading evaluations kept dense and the shortest attention made sparse, None: their
    defaults), a FastH3-VSA model's VSA sparsity (None: the model's), and the profile's name they came from
    (recorded; None: stated knob by knob, or none)."""

    profile: str | None = None
    cache: StepCacheConfig | None = None
    sparse_attention: float = 0.0
    sparse_dense_steps: int | None = None
    sparse_min_seq: int | None = None
    vsa_sparsity: float | None = None  # a FastH3-VSA model's VSA sparsity for this request (None: the model's)

    @property
    def sparse(self) -> SparseSettings:
        """The block-sparse settings that run (models/sparse/plan.py; a knob left None takes its default), the request
        keys' names in a message."""
        return sparse_settings(self.sparse_attention or 0.0, self.sparse_dense_steps, self.sparse_min_seq, where="")

    @property
    def shares_evaluations(self) -> bool:
        """Whether a request may share its DiT evaluations with others (a batch): a step cache decides per request
        which evaluations to skip, and block-sparse attention counts one request's evaluations."""
        return self.cache is None and not self.sparse_attention

    def to_json(self) -> dict:
        return {"profile": self.profile, "cache": self.cache.to_dict() if self.cache is not None else None,
                "sparse_attention": self.sparse_attention, "sparse_dense_steps": self.sparse_dense_steps,
                "sparse_min_seq": self.sparse_min_seq, "vsa_sparsity": self.vsa_sparsity}

    @classmethod
    def from_json(cls, data: dict) -> Speed:
        cache = data["cache"]
        return cls(data["profile"], StepCacheConfig.from_dict(cache) if cache is not None else None,
                   data["sparse_attention"], data["sparse_dense_steps"], data["sparse_min_seq"],
                   data.get("vsa_sparsity"))  # a row stored before the key existed: the model's


def _text(path: Path | None, folder: Path | None = None) -> str | None:
    if path is None:
        return None
    if folder is not None and Path(path).is_relative_to(folder):
        return str(Path(path).relative_to(folder))
    return str(path)


def _path(text: str | None, folder: Path | None = None) -> Path | None:
    if not text:
        return None
    return Path(text) if folder is None or Path(text).is_absolute() else Path(folder) / text


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
                             f"{VERSION} (and a job row of before, by its fields: server/service.py stored_request).")
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
