"""Where a server's clips and uploads live: a folder, or any fsspec URL.

    /var/lib/h3trt              a folder (h3trt serve's data dir; a fleet's path that every node mounts): the ranks
                                write each MP4 in place (media/output_files.py: temporary names, a no-clobber commit)
    s3://bucket/h3trt           object storage (s3fs; any fsspec protocol): each process writes in a scratch folder
                                of its own and `publish` copies the finished files up, the record last

Keys are relative names: `clips/<id>.attempt<n>.mp4`, `.json` (the record) and `.webp` (the thumbnail), the files of
the job's n-th claim (a row from before per-claim names: `clips/<id>.mp4`, ...), and `uploads/<id>/<file>` (a job's
inputs, until it ends). Both kinds answer the same calls, so the API side (admission, content, cancel, expiry) and
the worker side (inputs, outputs) are written once. Credentials and endpoints of object storage are the protocol's own
(for S3, boto's environment: AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

from ..engines.atomic import TEMP_SUFFIX, remove_leftovers
from ..parallel.leftovers import LAUNCH_PREFIX, SCRATCH_PREFIX, owned_temp_dir, sweep_temp_dirs

CHUNK = 1 << 20  # bytes a content response streams at a time from object storage


class Storage:
    """One storage URL (module doc). Thread-safe as its filesystem is (fsspec's are)."""

    def __init__(self, url: str, scratch: Path | None = None):
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.url = str(url)
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.root = root.rstrip("/")
        self.local: Path | None = Path(root) if isinstance(self.fs, LocalFileSystem) else None
        if self.local is not None:
            self.local.mkdir(parents=True, exist_ok=True)
        # Where this process writes a key before it is published: the folder itself, or a private scratch folder.
        self.scratch = self.local if self.local is not None else Path(scratch or owned_temp_dir(SCRATCH_PREFIX))

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def path(self, key: str) -> str:
        """The key's full name: a path, or a URL with its protocol."""
        full = f"{self.root}/{key}"
        return full if self.local is not None else self.fs.unstrip_protocol(full)

    def local_path(self, key: str) -> Path | None:
        """The key as a file of this machine (a folder storage), else None."""
        return self.local / key if self.local is not None else None

    def work_path(self, key: str) -> Path:
        """Where this process writes `key` (its folder created): in place, or in its scratch folder until
        `publish`."""
        path = self.scratch / key
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def publish(self, *keys: str) -> None:
        """Copy what this process wrote under `keys` (files or folders, in order) to the storage and drop its scratch
        copies; in place there is nothing to do. Put the key whose presence means "complete" last."""
        if self.local is not None:
            return
        for key in keys:
            source = self.scratch / key
            if source.is_dir():
                self.fs.put(str(source), f"{self.root}/{key}", recursive=True)
                shutil.rmtree(source, ignore_errors=True)
            elif source.exists():
                self.fs.put_file(str(source), f"{self.root}/{key}")
                source.unlink()

    def fetch(self, key: str) -> Path:
        """A folder of the storage as a folder of this machine (a job's uploads, for its worker): in place, or
        copied into the scratch folder."""
        if self.local is not None:
            return self.local / key
        target = self.scratch / key
        if self.exists(key):
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get(f"{self.root}/{key}/", str(target) + "/", recursive=True)
        return target

    def exists(self, key: str) -> bool:
        if self.local is not None:
            return (self.local / key).exists()
        self.fs.invalidate_cache()  # another process may have written it since this one last listed
        return self.fs.exists(f"{self.root}/{key}")

    def read_text(self, key: str) -> str:
        if self.local is not None:
            return (self.local / key).read_text()
        return self.fs.cat_file(f"{self.root}/{key}").decode()

    def chunks(self, key: str) -> Iterator[bytes]:
        """The file's bytes, CHUNK at a time (a content response from object storage)."""
        with self.fs.open(f"{self.root}/{key}", "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk

    def names(self, folder: str) -> list[str]:
        """The names directly under a folder ([] when it does not exist)."""
        if self.local is not None:
            where = self.local / folder
            return sorted(p.name for p in where.iterdir()) if where.is_dir() else []
        self.fs.invalidate_cache()
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(f"{self.root}/{folder}", detail=False))
        except FileNotFoundError:
            return []

    def discard(self, *keys: str) -> None:
        """Drop this process's unpublished copies of `keys` (object storage's scratch; in place, nothing: the files
        are the storage's)."""
        if self.local is None:
            for key in keys:
                _remove_local(self.scratch / key)

    def remove(self, *keys: str) -> None:
        """Remove files or folders (and any scratch copy); a missing one is no error."""
        self.discard(*keys)
        for key in keys:
            if self.local is not None:
                _remove_local(self.local / key)
                continue
            try:
                self.fs.rm(f"{self.root}/{key}", recursive=True)
            except FileNotFoundError:
                pass

    def temporaries(self, *keys: str) -> list[str]:
        """The temporary names writers of `keys` left beside them (engines/atomic.py temp_path: `.NAME.<host>-<pid>-
        <token>.partial`), whatever host wrote them: a folder storage's (object storage is written from scratch)."""
        if self.local is None:
            return []
        return [str(Path(key).parent / p.name) for key in keys
                for p in (self.local / key).parent.glob(f".{Path(key).name}.*{TEMP_SUFFIX}")]

    def sweep(self) -> dict[str, int]:
        """Remove what killed processes of this host left: the `.partial` files of clips/ (a folder storage), and
        the scratch and rank-group folders in $TMPDIR (a worker replica's start; module doc of parallel/leftovers.py).
        How many of each."""
        partials = remove_leftovers(self.local / "clips") if self.local is not None else []
        return {"partial_files": len(partials), "scratch_folders": len(sweep_temp_dirs(SCRATCH_PREFIX)),
                "launch_folders": len(sweep_temp_dirs(LAUNCH_PREFIX))}

    def close(self) -> None:
        """Drop the scratch folder of object storage (nothing of a folder storage)."""
        if self.local is None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _remove_local(path: Path) -> None:
    try:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


# A job's keys (module doc). The record is published last: its presence means the clip is complete.
#
# Each claim of a job (store.py: the row's `attempts` when a worker took it) writes files of its own names, so a
# worker whose lease ran out and which writes late (it stalled, another worker ran the job again and committed) can
# only ever leave files of its own claim beside the accepted ones, never replace them: the row names the claim whose
# files are the job's (its `clip_attempt`). `attempt` None is the one name per job of rows from before that
# (migration 0003): they still serve their clip.
def clip_key(job_id: str, attempt: int | None = None) -> str:
    return f"clips/{_stem(job_id, attempt)}.mp4"


def record_key(job_id: str, attempt: int | None = None) -> str:
    return f"clips/{_stem(job_id, attempt)}.json"


def thumbnail_key(job_id: str, attempt: int | None = None) -> str:
    return f"clips/{_stem(job_id, attempt)}.webp"


def claim_keys(job_id: str, attempt: int | None) -> tuple[str, ...]:
    """The files one claim of a job writes (the clip, its thumbnail, its record)."""
    return clip_key(job_id, attempt), thumbnail_key(job_id, attempt), record_key(job_id, attempt)


def uploads_key(job_id: str) -> str:
    return f"uploads/{job_id}"


def job_keys(job_id: str, attempts: int = 0) -> tuple[str, ...]:
    """Everything a job may have in storage after `attempts` claims: each claim's files, the one name of rows from
    before per-claim names, its uploads."""
    claims = (None, *range(1, attempts + 1))
    return (*(key for attempt in claims for key in claim_keys(job_id, attempt)), uploads_key(job_id))


def job_of(name: str) -> str:
    """The job a file or folder name under clips/ or uploads/ belongs to."""
    return name.split(".", 1)[0]


def _stem(job_id: str, attempt: int | None) -> str:
    return job_id if attempt is None else f"{job_id}.attempt{attempt}"
