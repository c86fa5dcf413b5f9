"""The checks of adapters: before anything loads, the --adapter flags (`check_specs`) and the flags against a
bundle's slots (`check_bundle_specs`, `check_bundle_sparse`); at admission, a request's `lora` against the resident set
(`check_adapters`, which the catalog runs too when its set changes)."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..models.config import H3Config
from .info import describe
from .merge import LoraSpec
from .schedule import file_schedule
from .spec import AdapterSpec
from .use import AdapterUse

NO_LORA_SLOTS = ("this bundle was built without LoRA slots, so it serves no per-request adapters; rebuild it with "
                 "h3trt build ... --lora-slots N --lora-max-rank R, or merge the LoRA at build (h3trt build --lora "
                 "FILE[:SCALE]).")


def check_specs(specs: tuple[AdapterSpec, ...]) -> None:
    """The --adapter flags (not --lora-dir's files, which the server checks and may skip): distinct names, files
    that exist, each file's own schedule valid; refused before any model loads."""
    flags = [s for s in specs if not s.from_folder]
    seen = set()
    for s in flags:
        if s.name in seen:
            raise UserError(f"--adapter {s.name}: the name is given twice; each resident adapter needs its own name.")
        seen.add(s.name)
        if not s.path.is_file():
            raise UserError(f"--adapter {s.name}={s.path}: no such file (a LoRA .safetensors).")
    for s in flags:
        file_schedule(s.path)  # its __metadata__ schedule, if any, valid


def check_bundle_sparse(uses: tuple[AdapterUse, ...], sparse_attention: float, segments: dict) -> None:
    """A bundle runs a sparse evaluation's adapters in its halves' twins (block_pre_lora, block_post_lora: h3trt build
    --sparse-attention with --lora-slots); one built by an earlier h3trt has the halves and the slots but not those
    twins, so a request with both is refused there (by admission, naming `lora`) rather than run without its
    adapters or dense unasked. `segments`: the bundle's manifest's."""
    if uses and sparse_attention > 0 and "block_pre" in segments and "block_lora" in segments \
            and "block_pre_lora" not in segments:
        raise UserError(f"lora: this bundle was built by an earlier h3trt, whose block-sparse halves have no adapter "
                        f"slots, and this request's sparse attention is {sparse_attention:g} (its own, its profile's "
                        "or the bundle's default); rebuild it with this h3trt (h3trt build ... --sparse-attention S "
                        "--lora-slots N --lora-max-rank R), or pass sparse_attention 0 (--sparse-attention 0, or a "
                        "dense profile) with lora.", field="lora")


def check_bundle_specs(specs: tuple[AdapterSpec, ...], pinned: tuple[LoraSpec, ...], slots, cfg: H3Config,
                       task: str, folder: Path | None = None) -> None:
    """`--adapter` (and `--lora`, an adapter on every request) against a bundle's LoRA slots (`slots`: its manifest's
    AdapterSlotsRecord, None without any), each file read and routed as the slots will load it; before any model
    loads. One line naming the flag and the fix. `folder`: --lora-dir, whose files the server's catalog checks (and
    skips), but which needs the slots too."""
    adapter_flags = [(f"--adapter {s.name}={s.path}", s.path) for s in specs if not s.from_folder]
    flags = adapter_flags + [(f"--lora {m.path}", m.path) for m in pinned]
    wanted = [f for f, _ in flags] + ([f"--lora-dir {folder}"] if folder is not None else [])
    if not wanted:
        return
    if slots is None:
        raise UserError(f"{wanted[0]}: {NO_LORA_SLOTS}")
    # --lora files hold a slot each for good; the adapters share the rest, loaded on demand (ResidentAdapters)
    adapters = len(wanted) > len(pinned)
    if len(pinned) + adapters > slots.slots:
        needs = f", and {'--adapter' if adapter_flags else '--lora-dir'} needs one more" if adapters else ""
        raise UserError(f"--lora: {len(pinned)} file(s) held on every request, but this bundle has {slots.slots} LoRA "
                        f"slot(s){needs}; pass fewer, or rebuild it with h3trt build ... --lora-slots "
                        f"{len(pinned) + adapters}.")
    covered = {f"blocks.{i}.{t}" for i in range(cfg.num_layers) for t in slots.targets}
    for flag, path in flags:
        if not Path(path).is_file():
            raise UserError(f"{flag}: no such file (a LoRA .safetensors).")
        info = describe(AdapterSpec("check", Path(path)), cfg, task)
        if info.rank > slots.max_rank:
            raise UserError(f"{flag}: rank {info.rank}, over this bundle's --lora-max-rank {slots.max_rank}; rebuild "
                            f"it with h3trt build ... --lora-max-rank {info.rank}, or merge it (h3trt build --lora).")
        outside = [t for t in info.targets if t not in covered]
        if outside:
            raise UserError(f"{flag} adapts {outside[0]}, which this bundle's slots do not hold (they adapt "
                            f"{list(slots.targets)} of every block); merge it at build instead (h3trt build --lora).")


def check_adapters(uses: tuple[AdapterUse, ...], specs: tuple[AdapterSpec, ...], refusal: str | None = None,
                   slots: int | None = None) -> None:
    """Admission's check of a request's `lora` against what the model holds resident, and at most `slots` adapters
    (one evaluation's); UserError naming `lora`. `refusal`: why this model serves no adapters at all (a bundle without
    slots), None where it may."""
    if not uses:
        return
    if refusal is not None:
        raise UserError(f"lora: {refusal}", field="lora")
    resident = [s.name for s in specs]
    if len(uses) > len(specs):
        raise UserError(f"lora asks for {len(uses)} adapters, but this model holds {len(specs)} resident "
                        f"({resident or 'none: start it with --adapter NAME=FILE[:SCALE]'}).", field="lora")
    if slots is not None and len(uses) > slots:
        raise UserError(f"lora asks for {len(uses)} adapters, but one evaluation carries at most {slots} (the "
                        "model's LoRA slots); ask for fewer.", field="lora")
    unknown = [u.name for u in uses if u.name not in resident]
    if unknown:
        raise UserError(f"lora names {unknown}, not resident here; the resident adapters are "
                        f"{resident or 'none (start the model with --adapter NAME=FILE[:SCALE])'}.", field="lora")
