"""The verified-once record: which bundle files this user has already hashed, by file identity, so that a later
load reads them without hashing again.

Stored outside the bundle, in the user's cache (`$XDG_CACHE_HOME/h3trt/verified/<manifest digest>.json`), one record
per manifest (its bytes' sha256: a changed manifest has no record). An entry says: the file at this relative path,
with this (device, inode, size, mtime_ns, ctime_ns), had every chunk digest the manifest lists when this user's
process read it. A load trusts a file only if its identity is exactly that, and checks the identity again after
reading it (a file that changed while being read is refused).

What it guarantees, and what not:
- Any write through the filesystem changes a file's mtime and ctime; a replaced or re-copied file has another inode.
  The ctime cannot be set from user space (restoring the mtime with `touch -d` / utime moves the ctime to now), so a
  file edited through the filesystem, by anyone, is hashed again and refused if it differs.
- Someone who can write the bundle but not this user's cache cannot make a changed file look verified.
- Not covered: bytes that change without a filesystem write (media errors, bit rot, writes to the raw block
  device), filesystems that do not keep ctime/inodes faithfully (some network or FUSE mounts), and anyone who can
  write this user's cache (they could as well edit the installed h3trt). `h3trt verify` always hashes every byte and
  ignores the record; use it after a copy you do not trust, or periodically on long-lived storage.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..paths import cache_dir

RECORD_VERSION = 1


def cache_root() -> Path:
    return cache_dir() / "verified"


def manifest_digest(root: Path) -> str:
    return hashlib.sha256((Path(root) / "manifest.json").read_bytes()).hexdigest()


def identity(path: Path) -> dict:
    """What a record compares: device and inode (the same file), size, mtime and ctime in ns (its content unchanged)."""
    st = os.stat(path)
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}


def _key(rel: str, ident: dict) -> str:
    # One entry per (path, inode): two copies of one bundle on this machine keep their own entries.
    return f"{rel}@{ident['dev']}:{ident['ino']}"


class VerifiedRecord:
    """The record of one manifest. `trusted(rel, ident)` -> bool; `add(rel, ident)`; `save()` writes it atomically."""

    def __init__(self, digest: str, entries: dict[str, dict], path: Path):
        self.digest, self.entries, self.path = digest, entries, path

    @classmethod
    def open(cls, root: Path) -> "VerifiedRecord":
        digest = manifest_digest(root)
        path = cache_root() / f"{digest[:32]}.json"
        entries = {}
        try:
            data = json.loads(path.read_text())
            if data.get("version") == RECORD_VERSION and data.get("manifest_sha256") == digest:
                entries = data.get("files", {})
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            entries = {}
        return cls(digest, entries, path)

    def trusted(self, rel: str, ident: dict) -> bool:
        return self.entries.get(_key(rel, ident)) == ident

    def add(self, rel: str, ident: dict) -> None:
        self.entries[_key(rel, ident)] = ident

    def save(self) -> None:
        """Write the record (merged with what another process may have written meanwhile); a cache that cannot be
        written only means the next load hashes again."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                theirs = json.loads(self.path.read_text())
                if theirs.get("manifest_sha256") == self.digest and theirs.get("version") == RECORD_VERSION:
                    self.entries = {**theirs.get("files", {}), **self.entries}
            except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                pass
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial")
            tmp.write_text(json.dumps({"version": RECORD_VERSION, "manifest_sha256": self.digest,
                                       "files": self.entries}, indent=0))
            os.replace(tmp, self.path)
        except OSError:
            pass
