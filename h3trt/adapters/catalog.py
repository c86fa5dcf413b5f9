"""The adapters a server offers by name, a set that changes while it serves (issue 38 item 2: `h3trt serve
--lora-dir DIR` and the admin calls POST /v1/loras, DELETE /v1/loras/{name}).

  - at start: --adapter NAME=FILE[:SCALE] and every DIR/*.safetensors (named by its stem), then what the admin
    calls changed before the last stop (the state file in the data folder: adapters loaded, start adapters
    unloaded), each file read and checked once against the slots the ranks will have (`SlotShape`: the flags', or
    fitted to these adapters)
  - `load`: a file inside DIR (never a path outside it) under a new name, read and checked whole before it joins
    the set (every layout `--lora` reads, with its refusals; rank <= the slots' max rank; only the main blocks'
    linears); `unload`: the name leaves the set. Neither touches a rank: the ranks load adapters on demand
  - `resolve`: admission's view. A request's names become the file, its sha256 and the scale as they are now,
    stored with the job (the job's row): what the set becomes afterwards (an unload, the name loaded again with
    another file) never changes a job already queued. Its worker loads the file by that hash, and fails the job,
    naming it, if the file changed or vanished meanwhile (resident.read_resolved)

The checks run against AdapterSlots on the meta device: the ranks' bank shapes, without their memory.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..errors import UserError
from ..models.config import H3Config
from ..models.lora_format import LoraError, LoraFile, read_lora
from ..models.sampler import ScheduleValues
from .checks import check_adapters
from .info import AdapterInfo, adapter_rank, info_of
from .shape import SERVE_SLOTS, SlotShape
from .slots import BLOCK_TARGETS, AdapterSlots
from .spec import NAME_PATTERN, AdapterSpec
from .use import SCALE_RANGE, AdapterUse, scale_in_range

STATE_FILE = "loras.json"  # in a server's data folder: what the admin calls changed, kept across restarts


@dataclass(frozen=True)
class Skipped:
    """An adapter the server started without: a --lora-dir file, or one the state file names, that it cannot serve."""

    name: str
    file: str  # its file's name (in --lora-dir): the server's paths stay its own
    reason: str
    source: str  # "--lora-dir" or STATE_FILE

    def to_json(self) -> dict:
        return {"name": self.name, "file": self.file, "reason": self.reason, "source": self.source}


class AdapterCatalog:
    """A server's current set of adapters (module doc). Thread-safe: the API's worker threads call it at once."""

    def __init__(self, cfg: H3Config, task: str, shape: SlotShape, folder: Path | None = None,
                 state: Path | None = None):
        """`folder`: --lora-dir, where `load` takes files from (None: the set is fixed); `state`: the file that keeps
        the admin calls' changes (None: not kept)."""
        self.cfg, self.task, self.shape, self.folder, self.state = cfg, task, shape, folder, state
        self._checker = AdapterSlots(cfg, task, 1, shape.max_rank, device="meta", targets=shape.targets)
        self._lock = threading.Lock()
        self._set: dict[str, tuple[AdapterSpec, AdapterInfo]] = {}
        self._started: set[str] = set()  # the names the command line gave
        self._loaded: dict[str, dict] = {}  # name -> {"file", "scale"}: loaded by the admin call (the state file)
        self._unloaded: set[str] = set()  # start names the admin call unloaded (the state file)
        self._skipped: dict[str, Skipped] = {}  # what the start left out, by name, until that name is loaded again

    @classmethod
    def start(cls, specs: tuple[AdapterSpec, ...], cfg: H3Config, task: str, num_slots: int | None = None,
              max_rank: int | None = None, folder: Path | None = None, state: Path | None = None,
              log: Callable[..., None] = lambda event, **fields: None, targets: tuple[str, ...] = BLOCK_TARGETS,
              rank_limit: Callable[[int], int] | None = None) -> "AdapterCatalog":
        """The set a server starts with (module doc). A refused --adapter is one line (UserError). A --lora-dir file,
        or an adapter the state file names, that cannot be served (unreadable, not a LoRA this model takes, a link out
        of the folder, a name taken or not a name, over the slots' rank or over the rank `rank_limit(N)` says N slots
        may have in memory) is left out: logged (`lora_skipped`), listed with why (`skipped`: GET /v1/loras), and a
        job naming it is refused with that reason."""
        kept = _read_state(state) if state is not None and folder is not None else {"loaded": [], "unloaded": []}
        unloaded = set(kept["unloaded"])
        flags = [s for s in specs if s.name not in unloaded and not s.from_folder]
        files = {s.name: _read(s, cfg, f"--adapter {s.name}") for s in flags}
        ranks = {s.name: adapter_rank(files[s.name], task) for s in flags}
        skipped: dict[str, Skipped] = {}

        def skip(spec: AdapterSpec, source: str, why: str) -> None:
            skipped[spec.name] = Skipped(spec.name, spec.path.name, " ".join(why.split())[:300], source)
            log("lora_skipped", name=spec.name, file=spec.path.name, source=source, reason=skipped[spec.name].reason)

        later = []  # (spec, the state file's name for its file or None, where it came from): skipped if refused
        optional = [(s, None, "--lora-dir") for s in specs if s.from_folder and s.name not in unloaded] + [
            (AdapterSpec(e["name"], Path(e["file"]), e["scale"]), e["file"], STATE_FILE) for e in kept["loaded"]]
        for spec, file, source in optional:
            try:
                spec = _optional_spec(spec, file, folder, ranks)
                files[spec.name] = _read(spec, cfg, f"adapter {spec.name}")
                ranks[spec.name] = adapter_rank(files[spec.name], task)
                later.append((spec, file, source))
            except UserError as e:  # LoraError too
                skip(spec, source, str(e))
        if rank_limit is not None and max_rank is None:  # the memory's bound on slots fitted to the largest
            most = rank_limit(num_slots or max(SERVE_SLOTS if folder is not None else 1, len(ranks)))
            for spec, file, source in [x for x in later if ranks[x[0].name] > most]:
                skip(spec, source, f"adapter {spec.name}: rank {ranks.pop(spec.name)}, over the largest rank these "
                     f"slots may have in memory ({most})")
                later.remove((spec, file, source))
        shape = SlotShape.fitted(list(ranks.values()), num_slots, max_rank, folder is not None, targets)
        catalog = cls(cfg, task, shape, folder, state)
        catalog._started = {s.name for s in specs}
        catalog._unloaded = unloaded & catalog._started
        catalog._skipped = skipped
        for spec in flags:
            catalog._set[spec.name] = (spec, catalog._check(spec, files[spec.name], f"--adapter {spec.name}"))
        for spec, file, source in later:
            try:
                info = catalog._check(spec, files[spec.name], f"adapter {spec.name}")
            except UserError as e:
                skip(spec, source, str(e))
                continue
            catalog._set[spec.name] = (spec, info)
            if file is not None:
                catalog._loaded[spec.name] = {"file": file, "scale": spec.scale}
        catalog._save()
        return catalog

    # --- what the API reads ---------------------------------------------------------------------------------------

    def specs(self) -> tuple[AdapterSpec, ...]:
        """The set now, as specs (what the ranks start with)."""
        with self._lock:
            return tuple(spec for spec, _ in self._set.values())

    def infos(self) -> list[AdapterInfo]:
        """The set now, as GET /v1/loras lists it, in the order it was made."""
        with self._lock:
            return [info for _, info in self._set.values()]

    def schedules(self) -> dict[str, ScheduleValues]:
        """The set's own schedules, by name (as read when each joined the set: no file is opened per request)."""
        with self._lock:
            return {name: ScheduleValues(**info.schedule) for name, (_, info) in self._set.items() if info.schedule}

    def skipped(self) -> list[Skipped]:
        """What the start left out, and why (GET /v1/loras lists it)."""
        with self._lock:
            return list(self._skipped.values())

    def resolve(self, uses: tuple[AdapterUse, ...]) -> tuple[AdapterUse, ...]:
        """A request's adapters resolved (module doc); UserError naming `lora` for a name not in the set (one the
        start skipped: with its reason), or more adapters than one evaluation carries."""
        if not uses:
            return uses
        with self._lock:
            specs = {name: spec for name, (spec, _) in self._set.items()}
            infos = {name: info for name, (_, info) in self._set.items()}
            skipped = [self._skipped[u.name] for u in uses if u.name not in specs and u.name in self._skipped]
        if skipped:
            s = skipped[0]
            raise UserError(f"lora {s.name!r}: this server started without it ({s.source} file {s.file!r}: "
                            f"{s.reason}); fix the file and load it (POST /v1/loras), or name another.", field="lora")
        check_adapters(uses, tuple(specs.values()), None, self.shape.num_slots)
        return tuple(AdapterUse(u.name, specs[u.name].scale if u.scale is None else u.scale, str(specs[u.name].path),
                                infos[u.name].sha256) for u in uses)

    # --- the admin calls ------------------------------------------------------------------------------------------

    def load(self, name: str, file: str, scale: float = 1.0) -> AdapterInfo:
        """POST /v1/loras: `file` (relative to --lora-dir) joins the set as `name` at default strength `scale`, once
        read and checked whole; UserError naming the field at fault."""
        if self.folder is None:
            raise UserError("file: this server loads adapters only from its --lora-dir, and it was started without "
                            "one; start it with --lora-dir DIR (a fleet, h3trt serve --ray, serves the adapters it "
                            "was deployed with).", field="file")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise UserError(f"name {json.dumps(name)}: an adapter's name is 1-64 of [A-Za-z0-9._-], starting with a "
                            "letter or digit.", field="name")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale_in_range(scale):
            raise UserError(f"scale {json.dumps(scale)}: the default strength must be {SCALE_RANGE}.", field="scale")
        self._taken(name, self.names())
        spec = AdapterSpec(name, _inside(self.folder, file), float(scale))
        lora = _read(spec, self.cfg, f"file {file!r}", shown=file)
        info = self._check(spec, lora, f"file {file!r}", shown=file)
        with self._lock:
            self._taken(name, self._set)  # a concurrent load of the same name may have won meanwhile
            self._set[name] = (spec, info)
            self._skipped.pop(name, None)  # the name serves again
            self._loaded[name] = {"file": file, "scale": spec.scale}
            self._save()
        return info

    def unload(self, name: str) -> None:
        """DELETE /v1/loras/{name}: the name leaves the set (queued jobs that named it keep their resolved file);
        KeyError when no adapter has that name."""
        with self._lock:
            if name not in self._set:
                raise KeyError(name)
            del self._set[name]
            self._loaded.pop(name, None)
            if name in self._started:
                self._unloaded.add(name)
            self._save()

    def names(self) -> list[str]:
        with self._lock:
            return list(self._set)

    @staticmethod
    def _taken(name: str, names) -> None:
        if name in names:
            raise UserError(f"name {name!r} is taken by a loaded adapter; unload it first (DELETE /v1/loras/{name}) "
                            "or pick another name.", field="name")

    def _check(self, spec: AdapterSpec, lora: LoraFile, where: str, shown: str | None = None) -> AdapterInfo:
        """The file against the ranks' slots (their targets and max rank; meta banks: nothing is written)."""
        try:
            return info_of(spec, self._checker.load(0, lora))
        except LoraError as e:
            raise UserError(_in_words(str(e), spec.path, where if shown is None else f"file {shown!r}"),
                            field="file") from None

    def _save(self) -> None:
        """The admin calls' changes, for the next start (written whole, then renamed into place)."""
        if self.state is None or self.folder is None:
            return
        data = {"loaded": [{"name": n, **e} for n, e in self._loaded.items()], "unloaded": sorted(self._unloaded)}
        tmp = self.state.with_name(f".{self.state.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(self.state)


def _inside(folder: Path, file) -> Path:
    """`file` as a path inside `folder` (--lora-dir): relative, no '..', resolving (links too) inside the folder."""
    if not isinstance(file, str) or not file.endswith(".safetensors"):
        raise UserError(f"file {json.dumps(file)}: name a .safetensors file inside the server's --lora-dir, relative "
                        "to it (e.g. style.safetensors).", field="file")
    if Path(file).is_absolute() or ".." in Path(file).parts or "\\" in file or "\0" in file:
        raise UserError(f"file {file!r}: an absolute path, '..', a backslash or a NUL is refused; name a file inside "
                        "the server's --lora-dir, relative to it (e.g. style.safetensors).", field="file")
    root = folder.resolve()
    path = (root / file).resolve()
    if not path.is_relative_to(root):
        raise UserError(f"file {file!r}: it leads outside the server's --lora-dir (a link); copy the file into the "
                        "folder.", field="file")
    if not path.is_file():
        raise UserError(f"file {file!r}: no such file in the server's --lora-dir; copy it there first.", field="file")
    return path


def _optional_spec(spec: AdapterSpec, file: str | None, folder: Path, taken) -> AdapterSpec:
    """A --lora-dir file's spec (`file` None), or the state file's adapter with its `file`, as the set will hold it
    (its path inside --lora-dir, checked: a link out of the folder is refused); UserError when its name is not an
    adapter's name or is `taken`."""
    if not NAME_PATTERN.fullmatch(spec.name):
        raise UserError(f"{spec.path.name}: its stem is not an adapter's name (1-64 of [A-Za-z0-9._-], starting "
                        "with a letter or digit); rename the file.")
    if spec.name in taken:
        raise UserError(f"adapter {spec.name}: the name is taken by another adapter at start (an --adapter, or a "
                        "--lora-dir file); rename the file.")
    return replace(spec, path=_inside(folder, file if file is not None else spec.path.name))


def _read(spec: AdapterSpec, cfg: H3Config, where: str, shown: str | None = None) -> LoraFile:
    try:
        return read_lora(spec.path, cfg.head_dim)
    except LoraError as e:
        raise UserError(_in_words(str(e), spec.path, where if shown is None else f"file {shown!r}"),
                        field="file") from None


def _in_words(message: str, path: Path, where: str) -> str:
    """A LoRA reader's message ("--lora /abs/path: ...") in the caller's words, without the server's path."""
    message = " ".join(message.split())
    for text in dict.fromkeys((f"--lora {path}", f"--lora {path.resolve()}")):
        message = message.replace(text, where)
    return message.replace(str(path.resolve()), path.name).replace(str(path), path.name)


def _read_state(state: Path) -> dict:
    """The state file's changes ({"loaded": [{"name", "file", "scale"}], "unloaded": [names]}); none if absent."""
    if not state.is_file():
        return {"loaded": [], "unloaded": []}
    try:
        data = json.loads(state.read_text())
        return {"loaded": [{"name": str(e["name"]), "file": str(e["file"]), "scale": float(e["scale"])}
                           for e in data["loaded"]], "unloaded": [str(n) for n in data["unloaded"]]}
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{state}: the adapters kept from the last run cannot be read ({e}); fix or remove the "
                        "file (the set is then what the command line says).") from None
