"""Where `h3trt build` writes: its own temporary folder beside --output, under a lock on the output that names its
holder, swapped into place once the bundle is complete. Whatever stops a build, --output holds the old complete bundle
(or nothing) or the new complete bundle, and the last message says which.

  * The bundle is assembled in `.<output>.<host>-<pid>-<token>.partial` beside --output (engines/atomic.py): hidden,
    unique (two builds never share one), on the output's filesystem so the last step is a rename. A later build
    removes a dead build's.
  * `.<output>.build.lock` beside it names its holder (pid, host, start time, command) and is held for the whole
    build: a second build of the same output is refused, quoting it, before it loads anything. Deleted on release.
  * Before any model loads: the folder is created if missing and must have room for the bundle's estimated size.
  * The swap, with SIGINT and SIGTERM held back until it is over: --overwrite exchanges the new bundle and the old one
    in one atomic rename (renameat2 RENAME_EXCHANGE; where the filesystem lacks it, the old one is renamed aside and
    the new one in), then deletes the old one. Ctrl-C or SIGTERM during the swap or the deletion is acted on after
    it, as an interrupt that says the new bundle was written (the CLI turns SIGTERM into an interrupt everywhere).
  * Stopped before the swap (an error, Ctrl-C, a full disk): the temporary folder is removed and --output is as it
    was. A disk that fills (ENOSPC) is one line. Killed outright (SIGKILL), a build leaves its temporary folder and
    lock file; the next build into that folder removes the one and takes the other.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
from pathlib import Path

from ..engines.atomic import (HolderLock, InterruptedAfterCommit, LockHeld, OutputError, OutputRefused, forget,
                              interrupts_held, remove_leftovers, rename_exchange, rename_noreplace, temp_path)
from ..engines.manifest import MANIFEST
from ..errors import UserError
from .plan import BundleSize

LOCK_SUFFIX = ".build.lock"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse an --output that exists, unless --overwrite and it is a bundle: --overwrite never replaces a file or a
    folder that is not a bundle (`--output ~` must not delete a home folder)."""
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it or choose another --output.")
    if out.is_symlink() or not (out / MANIFEST).is_file():
        raise UserError(f"--output {out} exists and is not an h3trt bundle (no {MANIFEST}); --overwrite replaces only "
                        "a bundle. Remove it yourself, or choose another --output.")


class BundleOutput:
    """`with BundleOutput(out, overwrite, size) as output:` build in `output.work`, then `output.commit()`."""

    def __init__(self, out: Path, overwrite: bool, size: BundleSize, log=print):
        self.out, self.overwrite, self.size, self.log = Path(out), overwrite, size, log
        self.work: Path | None = None
        self._lock: HolderLock | None = None
        self._committed = False

    def __enter__(self) -> BundleOutput:
        """Lock the output, remove dead builds' leftovers, check the free space, make the temporary folder."""
        out, folder = self.out, self.out.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock = HolderLock(folder / f".{out.name}{LOCK_SUFFIX}", remove=True)
            lock.__enter__()
        except LockHeld as e:
            raise OutputRefused(f"{out} is being built by another h3trt build ({e.holder}); wait for it to finish, or "
                                "choose another --output.") from None
        except OSError as e:
            raise OutputRefused(f"--output {out}: cannot write in the folder {folder} ({e.strerror}); choose another "
                                "--output.") from None
        self._lock = lock
        try:
            check_output(out, self.overwrite)  # again, under the lock: another build may have finished meanwhile
            remove_leftovers(folder)
            free = shutil.disk_usage(folder).free
            if free < self.size.total:
                raise OutputRefused(f"--output {out}: {folder} has {free / 1e6:.1f} MB free, and the bundle needs "
                                    f"about {self.size.total / 1e6:.1f} MB ({self.size.describe()}); free some space "
                                    "or choose another --output.")
            self.work = temp_path(out)
            forget(self.work)  # a folder: this class removes it (remove_own_temps unlinks files)
            self.work.mkdir()
            return self
        except BaseException:
            # __exit__ does not run for an __enter__ that raises: a Ctrl-C that lands once the folder exists (just
            # after the leftovers' sweep, say) left it behind
            if self.work is not None:
                shutil.rmtree(self.work, ignore_errors=True)
            self._release()
            raise

    def commit(self) -> None:
        """Swap the finished bundle into place and delete the old one, with SIGINT and SIGTERM held back until both are
        done; either arrived meanwhile: InterruptedAfterCommit (the CLI says the bundle was written, exit 130)."""
        with interrupts_held((signal.SIGINT, signal.SIGTERM)) as pending:
            old = self._swap()
            self._committed = True
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
                if os.path.lexists(old):
                    self.log(f"could not delete all of the previous bundle, now at {old}; remove it yourself")
                else:
                    self.log(f"replaced the previous bundle at {self.out} (deleted)")
        if pending:
            raise InterruptedAfterCommit([self.out])

    def _swap(self) -> Path | None:
        """Put the new bundle at --output; returns where the old one now is (None: there was none)."""
        if not os.path.lexists(self.out):
            try:
                rename_noreplace(self.work, self.out)
            except FileExistsError:
                raise OutputError(f"{self.out} appeared while this build ran (not from h3trt build: it holds the "
                                  "lock); it was left as it is and this build was removed. Choose another --output, "
                                  "or remove it and build again.") from None
            return None
        if rename_exchange(self.work, self.out):
            return self.work
        aside = temp_path(self.out)  # no RENAME_EXCHANGE here: two renames, signals held between them
        forget(aside)
        os.rename(self.out, aside)
        try:
            os.rename(self.work, self.out)
        except OSError:
            os.rename(aside, self.out)
            raise
        return aside

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if self._committed or self.work is None:
                return
            shutil.rmtree(self.work, ignore_errors=True)
            full = _disk_full(error)
            if full is not None:
                free = shutil.disk_usage(self.out.parent).free
                where = f" writing {full.filename}" if full.filename else ""
                raise OutputError(f"--output {self.out}: the disk filled up while building ({full.strerror}{where}; "
                                  f"{self.out.parent} has {free / 1e6:.1f} MB free now, the bundle needs about "
                                  f"{self.size.total / 1e6:.1f} MB); nothing was written and the partial bundle was "
                                  "removed. Free some space and build again.") from None
            if isinstance(error, KeyboardInterrupt) and (self.out / MANIFEST).is_file():
                self.log(f"interrupted: {self.out} is the previous bundle, unchanged; this build's files were removed")
        finally:
            self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None


def _disk_full(error: BaseException | None) -> OSError | None:
    """The ENOSPC (or quota) error behind `error`, wherever it sits in its chain of causes."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _DISK_FULL:
            return error
        error = error.__cause__ or error.__context__
    return None
