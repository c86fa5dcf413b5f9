"""The parts of a request (h3trt/request/request.py `Request`), each a frozen dataclass with its JSON: what the user
gave (`Inputs`), the canvas it asks for (`Canvas`), the schedule as its front door resolved it and where each value
came from (`ScheduleChoice`, `ScheduleFrom`), classifier-free guidance (`Guidance`) and the speed settings a profile
or the request chose (`Speed`: step cache and block-sparse attention). A request's adapters are h3trt/adapters/'s
`AdapterUse`s."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..models.packing import DEFAULT_DURATION
from ..models.sampler import DEFAULT_GUIDANCE, DEFAULT_SEED, DEFAULT_STEPS
from ..models.sparse_plan import SparseSettings
from ..models.step_cache import StepCacheConfig

REQUEST, DEFAULT = "request", "default"  # ScheduleFrom's words for a request's own value and the model's default


def task_of(image, last_image, refs) -> str:
    """The task a request's inputs make it: references are ref2va, a first or last keyframe fl2va, none t2va (every
    front door derives it here: a stored request, a requests line, the API's job object)."""
    if refs:
        return "ref2va"
    return "fl2va" if (image or last_image) else "t2va"


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

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "image": _text(self.image), "last_image": _text(self.last_image),
                "refs": [str(p) for p in self.refs], "seed": self.seed}

    @classmethod
    def from_json(cls, data: dict) -> Inputs:
        return cls(data["prompt"], _path(data["image"]), _path(data["last_image"]),
                   tuple(Path(p) for p in data["refs"]), data["seed"])


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
    """The request's schedule as its front door resolved it (pipeline/adapter_schedule.py resolve): the steps (sigma
    grid points: steps - 1 DiT evaluations) and the shifts (None: the model's), and where each came from."""

    steps: int = DEFAULT_STEPS
    video_shift: float | None = None
    audio_shift: float | None = None
    origin: ScheduleFrom = ScheduleFrom()

    def to_json(self) -> dict:
        return {"steps": self.steps, "video_shift": self.video_shift, "audio_shift": self.audio_shift,
                "from": self.origin.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> ScheduleChoice:
        return cls(data["steps"], data["video_shift"], data["audio_shift"], ScheduleFrom(**data["from"]))


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
    """What trades exactness for time, as the request or its profile chose: the step cache (None: every block of every
    evaluation runs) and block-sparse attention (its checked settings; sparsity 0: dense), and the profile's name
    they came from (recorded; None: stated knob by knob, or none)."""

    profile: str | None = None
    cache: StepCacheConfig | None = None
    sparse: SparseSettings = SparseSettings()

    @property
    def shares_evaluations(self) -> bool:
        """Whether a request may share its DiT evaluations with others (a batch): a step cache decides per request
        which evaluations to skip, and block-sparse attention counts one request's evaluations."""
        return self.cache is None and not self.sparse.enabled

    def to_json(self) -> dict:
        return {"profile": self.profile, "cache": self.cache.to_dict() if self.cache is not None else None,
                "sparse": self.sparse.to_dict()}

    @classmethod
    def from_json(cls, data: dict) -> Speed:
        cache, sparse = data["cache"], data["sparse"]
        return cls(data["profile"], StepCacheConfig.from_dict(cache) if cache is not None else None,
                   SparseSettings(sparse["sparsity"], sparse["dense_steps"], sparse["min_seq"]))


def _text(path: Path | None) -> str | None:
    return str(path) if path is not None else None


def _path(text: str | None) -> Path | None:
    return Path(text) if text is not None else None
