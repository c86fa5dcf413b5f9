"""Named speed profiles: step reuse and block-sparse attention chosen together, by one name (`h3trt run --profile`,
a request line's or an API job's "profile"). A profile sets a request's step cache (models/step_cache.py) and its
`sparse_attention` / `sparse_dense_steps` (models/sparse/attention.py); a knob stated explicitly (a flag, a key) wins
over the profile's value for that knob, and only for that knob.

| profile  | step cache (first-block, DBCache Fn=1 Bn=0)           | sparse attention           |
|----------|-------------------------------------------------------|----------------------------|
| lossless | none                                                  | none (dense)               |
| quality  | warm-up 4, threshold 0.04, at most 1 skip in a row    | none (dense)               |
| balanced | warm-up 4, threshold 0.12, at most 3 skips in a row   | 0.75, first 10 evals dense |
| fast     | warm-up 4, threshold 0.24, at most 3 skips in a row   | 0.80, first 10 evals dense |

Why these values: the step caches are SGLang's published MiniMax-H3 Cache-DiT profiles (high / medium / low:
SSIM 0.931 / 0.818 / 0.794 against its lossless clip, 4xH200), the peers' starting point. quality keeps attention
dense: it is the profile whose clip should stay closest to lossless, and sparsity adds its own distance on top of the
cache's. balanced adds SubBlock at 0.75, the sparsity SGLang serves H3 with and the one the H200 kernel bars are set
at (a quarter of the key blocks kept); fast adds 0.80, the sparsity of SGLang's fastest published H3 run (SubBlock 0.80
with Cache-DiT). Both keep the first 10 evaluations dense, as SubBlock does (its measurements: 5 dense steps halve the
clip's cosine to dense). What each costs and saves on H3 is measured on the H200 (README, "Speed profiles").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..errors import UserError
from ..models.sparse.plan import SparseSettings, sparse_settings
from ..models.step_cache import DEFAULT_THRESHOLDS, StepCacheConfig, check_knob

DBCACHE_WARMUP = 4  # SGLang's max_warmup_steps for H3's profiles
SPARSE_DENSE_STEPS = 10  # SubBlock's default: the first evaluations stay dense


def _dbcache(threshold: float, max_skip: int) -> StepCacheConfig:
    return StepCacheConfig("first-block", threshold, max_skip_steps=max_skip, warmup=DBCACHE_WARMUP)


@dataclass(frozen=True)
class Profile:
    """One named profile: what it sets on a request."""

    name: str
    cache: StepCacheConfig | None  # None: every block of every evaluation runs
    sparse_attention: float  # fraction of key blocks skipped per (head, video query block); 0: dense
    sparse_dense_steps: int | None  # leading evaluations kept dense (None: dense throughout, nothing to keep)


PROFILES = {p.name: p for p in (
    Profile("lossless", None, 0.0, None),
    Profile("quality", _dbcache(0.04, 1), 0.0, None),
    Profile("balanced", _dbcache(0.12, 3), 0.75, SPARSE_DENSE_STEPS),
    Profile("fast", _dbcache(0.24, 3), 0.80, SPARSE_DENSE_STEPS),
)}
PROFILE_NAMES = tuple(PROFILES)

# A step-cache knob (StepCacheConfig's field) -> the flag that states it; request keys are the flags' names with
# underscores (cache_threshold, ...), where a request may state them (REQUEST_KEYS).
CACHE_FLAGS = {"threshold": "--cache-threshold", "warmup": "--cache-warmup", "max_skip_steps": "--cache-max-skip",
               "retention_ratio": "--cache-retention", "mag_ratios": "--mag-ratios", "calibrate": "--mag-calibrate"}
# What a request line or an API job may state beside the profile. MagCache stays on the command line: it needs the
# model's ratios, measured by an --mag-calibrate run.
REQUEST_KEYS = {"cache": "kind", "cache_threshold": "threshold", "cache_warmup": "warmup",
                "cache_max_skip": "max_skip_steps"}


SPARSE_KEYS = ("sparse_attention", "sparse_dense_steps", "sparse_min_seq")  # request keys, as the flags' names


def profile_fields(profile: str | None, cache: str | None = None, sparse_attention: float | None = None,
                   sparse_dense_steps: int | None = None, sparse_min_seq: int | None = None, where: str = "--",
                   **cache_knobs) -> dict:
    """The request fields (request/request.py Request.of's) a profile and the explicitly stated knobs give: `cache` (the
    step-cache kind, --cache), `cache_knobs` (StepCacheConfig's fields, each None when not stated), the sparsity.
    A knob given explicitly overrides the profile's value for it; `cache` naming another kind than the profile's
    replaces the profile's step cache (its knobs were the other kind's). The sparse values are checked here, before
    any model loads (models/sparse/plan.py; `where` "--" names the flags in a message, "" the request keys)."""
    base = None
    if profile is not None:
        if profile not in PROFILES:
            raise UserError(f"profile {profile!r} is not one of {list(PROFILE_NAMES)} (README, 'Speed profiles').",
                            field="profile")
        base = PROFILES[profile]
    stated = {k: v for k, v in cache_knobs.items() if v is not None}
    unknown = set(stated) - set(CACHE_FLAGS)
    if unknown:
        raise TypeError(f"profile_fields got unknown step-cache knobs {sorted(unknown)}.")
    kind = cache if cache is not None else (base.cache.kind if base is not None and base.cache else None)
    fields = {"profile": profile, "cache": None}
    if kind is None:
        if stated:
            flags = " ".join(CACHE_FLAGS[k] for k in CACHE_FLAGS if k in stated)
            none = f", and --profile {profile} has no step cache" if base is not None else ""
            raise UserError(f"{flags} configure step caching{none}; add --cache first-block or --cache mag.",
                            field="cache")
    else:
        start = {}
        if base is not None and base.cache is not None and base.cache.kind == kind:
            start = {k: v for k, v in asdict(base.cache).items() if k != "kind"}
            start["mag_ratios"] = base.cache.mag_ratios
        start.setdefault("threshold", DEFAULT_THRESHOLDS[kind])
        fields["cache"] = StepCacheConfig(kind, **{**start, **stated})
    for name, given, own in (("sparse_attention", sparse_attention, base.sparse_attention if base else None),
                             ("sparse_dense_steps", sparse_dense_steps, base.sparse_dense_steps if base else None)):
        value = given if given is not None else own
        if value is not None:
            fields[name] = value
    if sparse_min_seq is not None:
        fields["sparse_min_seq"] = sparse_min_seq
    sparse_settings(fields.get("sparse_attention"), fields.get("sparse_dense_steps"), sparse_min_seq, where)
    return fields


def with_bundle_sparse(fields: dict, defaults: SparseSettings | None) -> dict:
    """`fields` (profile_fields' or request_profile_fields' request fields) with a bundle's default sparse settings
    (h3trt build --sparse-attention; None: it has none) filling each sparse knob neither the request nor its profile
    set: an explicit value (a flag, a key, a profile's) > the bundle's default > the built-in default (dense)."""
    if defaults is None:
        return fields
    own = {"sparse_attention": defaults.sparsity, "sparse_dense_steps": defaults.dense_steps,
           "sparse_min_seq": defaults.min_seq}
    return {**{k: v for k, v in own.items() if fields.get(k) is None}, **fields}


def request_profile_fields(data: dict) -> dict:
    """A request object's "profile" and step-cache keys (REQUEST_KEYS), and its sparse keys where it states them, ->
    the request fields (`profile_fields`); {} when it states none of them. UserError names the key at fault."""
    profile = data.get("profile")
    if profile is not None and not isinstance(profile, str):
        raise UserError(f"profile must be one of {list(PROFILE_NAMES)}, got {profile!r}.", field="profile")
    knobs = {}
    for key, field in REQUEST_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        if field == "kind":
            if value in ("none", "off", "", False):
                raise UserError(f"cache {value!r} is not a step cache: a request runs none unless it or its profile "
                                "asks for one; leave cache out, with no profile or profile 'lossless'.", field=key)
            if value != "first-block":
                raise UserError(f"cache must be 'first-block' in a request, got {value!r} (MagCache needs the "
                                "model's ratios: h3trt run --cache mag --mag-ratios ...).", field=key)
        elif isinstance(value, bool) or not isinstance(value, (int, float) if field == "threshold" else int):
            what = "a number" if field == "threshold" else "a whole number"
            raise UserError(f"{key} must be {what}, got {value!r}.", field=key)
        elif isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{key} must be finite, got {value}.", field=key)
        else:
            check_knob(field, value, flags=False)
        knobs[field] = float(value) if field == "threshold" else value
    sparse = {k: data[k] for k in SPARSE_KEYS if data.get(k) is not None}
    if profile is None and not knobs and not sparse:
        return {}
    kind = knobs.pop("kind", None)
    base = PROFILES.get(profile)  # an unknown name is refused by profile_fields, by name
    if knobs and kind is None and (profile is None or (base is not None and base.cache is None)):
        keys = ", ".join(k for k, f in REQUEST_KEYS.items() if f in knobs)
        none = f", and profile {profile!r} has no step cache" if profile is not None else ""
        raise UserError(f"{keys} configure step caching{none}; add \"cache\": \"first-block\" or a profile "
                        "that caches (quality, balanced, fast).", field=keys.split(", ")[0])
    return profile_fields(profile, kind, **sparse, where="", **knobs)
