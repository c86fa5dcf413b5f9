"""The parts of a request (h3trt/request/request.py `Request`), each a frozen dataclass with its JSON: what the user
gave (`Inputs`), the canvas it asks for (`Canvas`), the schedule as its front door resolved it and where each value
came from (`ScheduleChoice`, `ScheduleFrom`), classifier-free guidance (`Guidance`) and the speed settings a profile
or the request chose (`Speed`: step cache, block-sparse attention and a FastH3-VSA model's sparsity). A request's adapters are h3trt/adapters/'s
`AdapterUse`s. Beside them: how a model picks a canvas a request leaves out (`CanvasDefaults`), and some of a
schedule's values (models/sampler.py `ScheduleValues`: what a request or an adapter states, below the adapters that
bring one), which `ScheduleChoice.resolve` turns into the request's schedule."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Mapping

from ..errors import UserError
from ..models.packing import CANVAS_MAX_PIXELS, CANVAS_SHORT_EDGE, DEFAULT_DURATION
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
    """What trades exactness for time, as the request or its profile chose (request/profiles.py): the step cache
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
