"""A bundle's files checked against its manifest's file table: what a load refuses before reading any content (files
missing, of another size, or not part of the bundle), every byte hashed (`h3trt verify`, a TensorRT load), and one
load's overlapped verification on a thread pool (`BundleVerification`), which reads the DiT weights into the device
while it hashes them and trusts what the verified-once record (verified.py) says is unchanged.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .manifest import UNLISTED, BundleError, Manifest, hash_threads
from .verified import VerifiedRecord, identity
from .weights_io import ReadStats, WeightsError, chunk_digests, read_safetensors, verify_file


def verify_files(root: Path, manifest: Manifest) -> list[str]:
    """Problems with the bundle's files: missing, changed or unexpected. Empty when every hash matches. Hashes every
    byte (chunks in parallel), whatever the verified-once record says."""
    root = Path(root)
    listed = manifest.files
    problems = structure_problems(root, manifest)
    present = [rel for rel in listed if (root / rel).is_file() and (root / rel).stat().st_size == listed[rel].bytes]
    with ThreadPoolExecutor(hash_threads()) as pool:
        digests = {rel: chunk_digests(root / rel, manifest.hash_chunk_bytes, pool) for rel in present}
    problems += [f"{rel} changed (sha256 differs from the manifest)" for rel in present
                 if tuple(digests[rel]) != listed[rel].sha256_chunks]
    return problems


def structure_problems(root: Path, manifest: Manifest) -> list[str]:
    """What a load refuses before reading any content: files missing, of another size, or not part of the bundle."""
    root = Path(root)
    listed, problems = manifest.files, []
    for rel, meta in listed.items():
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel} is missing")
        elif path.stat().st_size != meta.bytes:
            problems.append(f"{rel} changed (size {path.stat().st_size} bytes, the manifest says {meta.bytes})")
    extra = sorted(set(hash_tree_names(root)) - set(listed))
    return problems + [f"{rel} is not part of the bundle" for rel in extra]


def hash_tree_names(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()
            and p.relative_to(root).as_posix() not in UNLISTED]


def _settle(future: Future, error: BaseException | None) -> None:
    """Complete `future` with `error` (None: success), unless it was cancelled meanwhile (an abandoned load)."""
    if future.set_running_or_notify_cancel():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def mismatch(root: Path, problems: list[str]) -> BundleError:
    listed = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
    return BundleError(f"{root} does not match its manifest: {listed}. Re-copy the bundle or rebuild it.")


class BundleVerification:
    """Every file of one bundle load, checked against the manifest on one thread pool: hashed in chunks (read into the
    device for weight files), or trusted by the verified-once record. Each file's identity is taken before it is read
    and checked again after; when every file has matched, the record is updated so that the next load hashes
    nothing that did not change."""

    def __init__(self, root: Path, manifest: Manifest, threads: int, use_record: bool = True):
        self.root, self.manifest, self.threads = Path(root), manifest, threads
        self.chunk_bytes = manifest.hash_chunk_bytes
        self.record = VerifiedRecord.open(root)
        files = manifest.files
        self.identity = {rel: identity(self.root / rel) for rel in files}
        # Under --trust every byte is hashed: the record guards against accidents, a signature against intent.
        self.trusted = {rel for rel in files if use_record and self.record.trusted(rel, self.identity[rel])}
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="h3trt-load")
        self.futures: dict[str, Future] = {}
        self.done_at: dict[str, float] = {}  # perf_counter when each file was checked (and read)
        self.weight_stats, self.other_stats = ReadStats(), ReadStats()
        self.started = time.perf_counter()
        self.finished_s: float | None = None  # seconds from the start until every file was checked
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self._all_done = threading.Event()

    def _digests(self, rel: str) -> list[str] | None:
        return None if rel in self.trusted else list(self.manifest.files[rel].sha256_chunks)

    def read(self, rel: str, device: torch.device) -> Future:
        return self._track(rel, read_safetensors(self.root / rel, device, self.pool, self._digests(rel),
                                                 self.chunk_bytes, self.weight_stats, rel))

    def verify(self, rels: list[str], track: bool = True) -> list[Future]:
        out = []
        for rel in rels:
            digests = self._digests(rel)
            if digests is None:
                future: Future = Future()
                future.set_result(None)
            else:
                future = verify_file(self.root / rel, self.pool, digests, self.chunk_bytes, self.other_stats, rel)
            out.append(self._track(rel, future) if track else future)
        return out

    def verify_after(self, gate: list[Future], rels: list[str]) -> None:
        """Verify `rels` once every future of `gate` is done (whatever its outcome). They are tracked from now on,
        so `wait_prefix` and `wait_all` wait for them."""
        placeholders = {rel: self._track(rel, Future()) for rel in rels}
        remaining = [len(gate)]
        lock = threading.Lock()

        def release(_=None) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0] > 0:
                    return
            for rel, outer in placeholders.items():
                try:
                    (inner,) = self.verify([rel], track=False)
                except RuntimeError:  # the pool was shut down: the load was abandoned
                    _settle(outer, WeightsError(f"{rel}: the load was abandoned"))
                    continue
                inner.add_done_callback(lambda f, outer=outer: _settle(outer, f.exception()))

        if not gate:
            remaining[0] = 1
            release()
        for future in gate:
            future.add_done_callback(release)

    def _track(self, rel: str, future: Future) -> Future:
        with self._lock:
            self._pending += 1
        self.futures[rel] = future
        future.add_done_callback(lambda f, rel=rel: self._done(rel, f))
        return future

    def _same_file(self, rel: str) -> bool:
        try:
            return identity(self.root / rel) == self.identity[rel]
        except OSError:
            return False

    def _done(self, rel: str, future: Future) -> None:
        self.done_at[rel] = time.perf_counter()
        error = future.exception() if not future.cancelled() else WeightsError(f"{rel}: the load was abandoned")
        if error is None and not self._same_file(rel):
            error = WeightsError(f"{rel} changed while it was being loaded")
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._pending -= 1
            last = self._closed and self._pending == 0
        if last:
            self._finish()

    def close_submissions(self) -> None:
        with self._lock:
            self._closed = True
            last = self._pending == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        self.finished_s = time.perf_counter() - self.started
        if self.error is None:
            for rel in self.manifest.files:
                self.record.add(rel, self.identity[rel])
            self.record.save()
        self.pool.shutdown(wait=False)
        self._all_done.set()

    def _raise(self, error: BaseException) -> None:
        if isinstance(error, WeightsError):
            raise mismatch(self.root, [str(error)]) from None
        raise error

    def result(self, future: Future):
        try:
            value = future.result()
        except BaseException as e:
            self._raise(e)
        rel = next(r for r, f in self.futures.items() if f is future)
        if not self._same_file(rel):
            self._raise(WeightsError(f"{rel} changed while it was being loaded"))
        return value

    def wait(self, futures: list[Future]) -> None:
        for f in futures:
            self.result(f)

    def wait_prefix(self, prefix: str) -> None:
        self.wait([f for rel, f in self.futures.items() if rel.startswith(prefix)])

    def wait_all(self) -> dict:
        """Block until every file was checked; raise if one did not match. Returns the background share's report."""
        self._all_done.wait()
        if self.error is not None:
            self._raise(self.error)
        return {"all_files_checked_s": round(self.finished_s, 4), "components_read": self.other_stats.to_dict()}

    def abandon(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)
