"""Output files that are never lost, mixed up or left half-written: under concurrency, interruption and full disks.

  * Temporary names are unique per process and live in the target's own folder: `.<name>.<host>-<pid>-<token>.partial`
    (hidden, not ending in .mp4, on the target's filesystem so the final step is a rename). Two runs writing the same
    target never share a temporary file, and a later run can tell a dead process's leftovers from a live one's. These
    names, the renames, the held signals and the holder-naming lock are engines/atomic.py's: `h3trt build` uses them
    for bundles too.
  * The final step never clobbers: a clip's MP4 and its JSON record are committed together, each with no-replace
    semantics (renameat2 RENAME_NOREPLACE, or a hard link where the filesystem lacks it). If either target appeared
    while the run was working, the run fails and removes what it wrote; it never replaces another run's files unless
    `overwrite` (then the pair is replaced under a lock on the folder, so two overwriting runs cannot mix their files).
  * A batch out-dir is locked for the whole run (`OUT/.h3trt-batch.lock`, which names the holder).
  * Ctrl-C cannot split a commit: SIGINT is held back while the pair is renamed into place.
  * `preflight_clip` / `preflight_out_dir` check a target before any model loads: the folder exists or is created,
    is a folder, is writable, and has room for the clip's worst-case size.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# The primitives, shared with `h3trt build`; the floors above engines and the CLI import them from here.
from ..engines.atomic import (HolderLock, InterruptedAfterCommit, LockHeld, OutputError, OutputRefused, discard, forget,
                              interrupts_held, remove_leftovers, remove_own_temps, rename_noreplace, temp_path)

DEFAULT_CRF = 18  # H.264 constant rate factor of every clip (h3trt run --crf)

BATCH_LOCK = ".h3trt-batch.lock"
# Worst-case H.264 bits per pixel and frame at CRF 18: uniform noise, x264's worst case, measured 3.6 (1344x768,
# preset veryfast, zerolatency) and 3.9 (the tiny model's 160x96 noise clips); 6 leaves room. Each 6 CRF steps below
# 18 doubles it (x264's rule of thumb), capped above raw yuv420p (12 bits) plus container overhead.
WORST_CASE_BITS_PER_PIXEL = 6.0
AAC_BYTES_PER_SECOND = 160_000 // 8
CONTAINER_SLACK_BYTES = 1 << 20  # index, headers, the JSON record


class OutputExists(OutputError):
    """A target appeared while this run was working: another run (or person) wrote it first; it was left alone."""


# ----------------------------------------------------------------------------------------------------------------------
# The no-clobber final step


def join_holding_interrupts(thread: threading.Thread) -> bool:
    """Join `thread` with Ctrl-C held back; True if one arrived meanwhile (the caller raises KeyboardInterrupt).

    Why not retry `thread.join()` after a KeyboardInterrupt: on Python 3.11 an interrupted join can mark the thread
    stopped while it still runs (the bpo-45274 fix releases the thread's own lock), so the retry returns at once and
    the process exits under a thread inside torch or FFmpeg: "terminate called without an active exception"."""
    with interrupts_held() as pending:
        thread.join()
    return bool(pending)


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """An exclusive flock on the folder itself (no lock file left behind), held while an --overwrite commit replaces
    a pair of files."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            raise OutputError(f"{folder}: cannot lock the folder to replace files together ({e.strerror}; NFS "
                              "cannot lock folders); remove the old files and run without --overwrite.") from None
        yield
    finally:
        os.close(fd)


def commit(pairs: list[tuple[Path, Path]], overwrite: bool = False) -> None:
    """Move finished temporary files onto their targets, all or none: [(temp, target), ...] in order.

    Without `overwrite` each rename is no-replace; if a target exists (it appeared after the preflight), the targets
    committed so far are taken back (only while they are still this run's file), every temporary file is removed, and
    OutputExists names the target. With `overwrite` the targets are replaced under a lock on their folder.
    SIGINT waits until the commit is over; then InterruptedAfterCommit says what was written."""
    committed = False
    with interrupts_held() as pending:
        done: list[tuple[Path, os.stat_result]] = []
        try:
            if overwrite:
                with _folder_lock(Path(pairs[0][1]).parent):
                    for temp, target in pairs:
                        os.replace(temp, target)
                        forget(temp)
            else:
                for temp, target in pairs:
                    mine = os.stat(temp)
                    try:
                        rename_noreplace(temp, target)
                    except FileExistsError:
                        _take_back(done)
                        raise OutputExists(f"{target} appeared while this run was writing it (another run?); it was "
                                           "left as it is and this run's output was removed. Choose another output, "
                                           "or pass --overwrite.") from None
                    forget(temp)
                    done.append((Path(target), mine))
            committed = True
        except OSError as e:
            _take_back(done)
            raise OutputError(f"{e.filename or pairs[0][1]}: could not be written ({e.strerror}); this run's files "
                              "were removed.") from None
        finally:
            for temp, _ in pairs:
                discard(temp)
    if pending:
        if committed:
            raise InterruptedAfterCommit([Path(t) for _, t in pairs])
        raise KeyboardInterrupt


def _take_back(done: list[tuple[Path, os.stat_result]]) -> None:
    """Remove targets this commit already renamed into place, each only while it is still the same file."""
    for path, st in done:
        with contextlib.suppress(OSError):
            now = os.stat(path)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)


def write_json_file(path: Path, data: dict) -> Path:
    """`data` as JSON in a fresh temporary file beside `path` (not committed); returns the temporary path."""
    tmp = temp_path(path)
    try:
        tmp.write_text(json.dumps(data, indent=1))
    except OSError as e:
        discard(tmp)
        raise OutputError(f"{path}: could not be written ({e.strerror}); its temporary file was removed.") from None
    except BaseException:
        discard(tmp)
        raise
    return tmp


def write_json_atomic(path: Path, data: dict, overwrite: bool = True) -> None:
    """Write JSON under a unique temporary name and rename it into place (replacing, unless `overwrite=False`)."""
    path = Path(path)
    commit([(write_json_file(path, data), path)], overwrite=overwrite)


# ----------------------------------------------------------------------------------------------------------------------
# Preflight: before any model loads


def estimated_clip_bytes(width: int, height: int, num_frames: int, fps: int, crf: int = DEFAULT_CRF) -> int:
    """An upper bound on a clip's MP4 size (worst-case content at this CRF; see WORST_CASE_BITS_PER_PIXEL)."""
    bits = min(16.0, WORST_CASE_BITS_PER_PIXEL * 2.0 ** ((18 - crf) / 6.0))
    video = width * height * num_frames * bits / 8
    return int(video + AAC_BYTES_PER_SECOND * num_frames / fps + CONTAINER_SLACK_BYTES)


_CREATED: list[Path] = []  # the folders this process created for its outputs, outermost first


def _make_folder(folder: Path, what: str) -> None:
    """Create `folder` (and its parents) unless it exists; refuse a file on the way, one line. What it creates is
    remembered: a run that ends without its output removes it again (remove_created_folders_left_empty)."""
    missing = []
    for parent in (folder, *folder.parents):
        if parent.exists():
            if not parent.is_dir():
                raise OutputRefused(f"{what}: {parent} is a file, not a folder; choose another location.")
            break
        missing.append(parent)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputRefused(f"{what}: cannot create the folder {folder} ({e.strerror}); create it or choose another "
                          "location.") from None
    _CREATED.extend(reversed(missing))


def remove_created_folders_left_empty(remove: bool = True) -> list[Path]:
    """Forget the folders this process created for its outputs; with `remove` (a run that ended without its output:
    interrupted, refused, failed) first remove those that hold nothing, innermost first: any file (a clip, a record, a
    batch's lock or timeline, another process's file) keeps its folder."""
    created, removed = list(_CREATED), []
    _CREATED.clear()
    for folder in reversed(created) if remove else ():
        with contextlib.suppress(OSError):
            folder.rmdir()  # an empty folder only: OSError otherwise
            removed.append(folder)
    return removed


def _check_writable(folder: Path, what: str) -> None:
    probe = temp_path(folder / "probe")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
    except OSError as e:
        raise OutputRefused(f"{what}: the folder {folder} is not writable ({e.strerror}); choose another location."
                          ) from None
    finally:
        discard(probe)


def _check_space(folder: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise OutputRefused(f"{what}: {folder} has {free / 1e6:.1f} MB free, and the clip may need up to "
                          f"{need / 1e6:.1f} MB (worst-case content); free some space or choose another location.")


def preflight_clip(mp4: Path, record: Path, overwrite: bool, need_bytes: int) -> None:
    """Before any model loads: the folder is created if missing, is writable and has `need_bytes` free; neither the
    MP4 nor its record is a folder; neither exists unless `overwrite`. Leftovers of killed runs are removed."""
    mp4, record = Path(mp4), Path(record)
    for path in (mp4, record):
        if path.is_dir():
            raise OutputRefused(f"{path} is a folder; --output must name a file (e.g. {path / 'clip.mp4'}).")
    folder = mp4.parent
    _make_folder(folder, str(mp4))
    remove_leftovers(folder)
    if not overwrite:
        existing = [str(p) for p in (mp4, record) if p.exists()]
        if existing:
            raise OutputRefused(f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; pass "
                              "--overwrite to replace the clip and its record, or choose another --output.")
    _check_writable(folder, str(mp4))
    _check_space(folder, need_bytes, str(mp4))


def preflight_out_dir(out_dir: Path, need_bytes: int) -> None:
    """Before any model loads: --out-dir is a folder (created if missing), writable, with room for its largest clip."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputRefused(f"--out-dir {out_dir} is a file; pass a folder (created if missing).")
    _make_folder(out_dir, f"--out-dir {out_dir}")
    remove_leftovers(out_dir)
    _check_writable(out_dir, f"--out-dir {out_dir}")
    _check_space(out_dir, need_bytes, f"--out-dir {out_dir}")


# ----------------------------------------------------------------------------------------------------------------------
# The batch out-dir lock


def hold_folder(folder: Path, busy: Callable[[str], Exception], refused: Callable[[OSError], Exception]) -> HolderLock:
    """`folder`'s lock (BATCH_LOCK: its content names the holder), taken and held: one batch per out-dir, one server
    per data folder. Raises `busy(holder)` when another process holds it, `refused(error)` when it cannot be taken."""
    lock = HolderLock(Path(folder) / BATCH_LOCK)
    try:
        lock.__enter__()
    except LockHeld as e:
        raise busy(e.holder) from None
    except OSError as e:
        raise refused(e) from None
    return lock


class OutputBusy(OutputRefused):
    """Another run holds the out-dir."""


@dataclass
class BatchLock:
    """An exclusive lock on a batch out-dir for the whole run: OUT/.h3trt-batch.lock, whose content names the holder
    (pid, host, start time, command). The lock dies with its process, so a killed run never blocks the next; the file
    stays (empty once released)."""

    out_dir: Path
    _lock: HolderLock | None = None

    def __enter__(self) -> BatchLock:
        self._lock = hold_folder(
            self.out_dir,
            busy=lambda holder: OutputBusy(f"--out-dir {self.out_dir} is in use by another h3trt batch ({holder}); "
                                           "wait for it to finish, or pass another --out-dir."),
            refused=lambda e: OutputRefused(f"--out-dir {self.out_dir}: cannot lock it ({e.strerror})."))
        return self

    def __exit__(self, *exc) -> None:
        if self._lock is not None:
            self._lock.__exit__(*exc)
            self._lock = None
