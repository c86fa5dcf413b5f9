"""Safetensors files written from, and read straight into, the device; hashed in chunks while they are read.

Why not `safetensors.torch.load_file` / `save_file`: at full size a bundle holds 22-41 GB of DiT weights. load_file
reads a whole file into host memory and `.to(device)` then copies it from pageable memory, one file at a time, after
a separate pass that hashes every byte on one core (a 4.86 GB bundle took 8.6 s, 0.57 GB/s). save_file needs every
tensor on the host at once (a 33B model is 66 GB of host memory on top of the checkpoint). Here:

- `write_safetensors` streams one tensor at a time from wherever it lives (a GPU tensor through a pinned buffer), in
  the byte layout safetensors itself writes (tensors ordered by element size, then name, so each one is aligned).
- `read_safetensors` splits a file into fixed chunks (the bundle manifest's hash chunks) and hands them to a thread
  pool: each worker reads its chunk with pread into its own pinned buffer, hashes it (hashlib releases the GIL, so
  chunks hash on as many cores as there are workers), and only if the digest matches copies the chunk's bytes into
  the destination tensors on the device, on its own CUDA stream. Nothing from a chunk is used before its digest
  matched; the header is parsed only after chunk 0 verified.

Files on disk: 8-byte little-endian header length N, N bytes of JSON header ({name: {dtype, shape, data_offsets}},
optional "__metadata__"), padded with spaces to a multiple of 8, then the tensor bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from ..models.checkpoint.safetensors_format import DTYPES, MAX_HEADER_BYTES

HASH_CHUNK_BYTES = 64 << 20  # chunk of a bundle file hashed (and read) as one unit; recorded in the manifest
STAGING_BYTES = 64 << 20  # the writer's pinned buffer for device tensors

DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WeightsError(UserError):
    """A weights file that is malformed, or whose bytes do not match the digests it must have."""


# ----------------------------------------------------------------------------------------------------------------------
# Writing


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write `tensors` (any devices) to `path` in safetensors format, one tensor at a time; returns the data bytes.

    Host memory stays at one pinned staging buffer whatever the file size. The file is written under a temporary name
    and renamed into place, so a reader never sees a half-written file."""
    with SafetensorsWriter(path, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, metadata) as writer:
        for name in writer.names:
            writer.write(name, tensors[name])
    return writer.data_bytes


class SafetensorsWriter:
    """A safetensors file whose tensors are declared up front ({name: (dtype, shape)}) and written in any order, each
    at its place: what a build that makes a file's tensors a block at a time writes (h3trt/build/stream.py). The bytes
    are write_safetensors': the same header, tensors ordered by element size, then name (so each one is aligned).
    Written under a temporary name; `close` checks that every tensor was written, then renames it into place (a
    failure, or leaving the `with` by an exception, removes it)."""

    def __init__(self, path: Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.names = sorted(specs, key=lambda n: (-specs[n][0].itemsize, n))  # safetensors' order
        header, offset, self.places = {}, 0, {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        for name in self.names:
            dtype, shape = specs[name]
            if dtype not in DTYPE_NAMES:
                raise WeightsError(f"{name}: dtype {dtype} has no safetensors name.")
            size = dtype.itemsize * math.prod(shape)
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.places[name] = (dtype, tuple(shape), offset)
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.data_bytes, self.data_start = offset, 8 + len(raw)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(f".{self.path.name}.partial")
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.written: set[str] = set()
        self._staging = None
        self._lock = threading.Lock()  # write() may be called from a writer thread
        _pwrite_all(self.fd, memoryview(struct.pack("<Q", len(raw)) + raw), 0)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """`tensor` (any device) at its place; it must have the declared dtype and shape."""
        dtype, shape, offset = self.places[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise WeightsError(f"{name}: declared {dtype} {list(shape)}, given {tensor.dtype} {list(tensor.shape)}.")
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        at = self.data_start + offset
        with self._lock:
            if flat.device.type == "cpu":
                _pwrite_all(self.fd, memoryview(flat.numpy()), at)
            else:
                if self._staging is None:
                    self._staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
                for start in range(0, flat.numel(), STAGING_BYTES):
                    piece = flat[start:start + STAGING_BYTES]
                    self._staging[:piece.numel()].copy_(piece)  # synchronous: the buffer is reused at once
                    _pwrite_all(self.fd, memoryview(self._staging[:piece.numel()].numpy()), at + start)
            self.written.add(name)

    def close(self) -> None:
        missing = [n for n in self.names if n not in self.written]
        os.close(self.fd)
        if missing:
            os.unlink(self.tmp)
            raise RuntimeError(f"{self.path.name}: {len(missing)} declared tensors were never written ({missing[:3]} "
                               "...); the file was not written.")
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        os.close(self.fd)
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


# ----------------------------------------------------------------------------------------------------------------------
# Chunk hashes


def chunk_digests(path: Path, chunk_bytes: int = HASH_CHUNK_BYTES, pool: ThreadPoolExecutor | None = None) -> list[str]:
    """sha256 of every `chunk_bytes` piece of the file, in order (one digest for a file up to one chunk: then it is
    the file's plain sha256). Chunks hash in parallel on `pool`'s threads."""
    size = Path(path).stat().st_size
    count = max(1, -(-size // chunk_bytes))
    fd = os.open(path, os.O_RDONLY)
    try:
        work = [(k * chunk_bytes, min(chunk_bytes, size - k * chunk_bytes)) for k in range(count)]
        if pool is None or count == 1:
            return [_hash_range(fd, off, n) for off, n in work]
        return [f.result() for f in [pool.submit(_hash_range, fd, off, n) for off, n in work]]
    finally:
        os.close(fd)


def _hash_range(fd: int, offset: int, size: int) -> str:
    buf = _thread_buffer(size, pinned=False)
    _pread_into(fd, memoryview(buf.numpy())[:size], offset)
    return hashlib.sha256(memoryview(buf.numpy())[:size]).hexdigest()


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise WeightsError(f"unexpected end of file at byte {offset + done} (the file is truncated).")
        done += n


_LOCAL = threading.local()


def _thread_buffer(size: int, pinned: bool) -> torch.Tensor:
    """This thread's reusable host buffer of at least `size` bytes (pinned for device copies)."""
    key = "pinned" if pinned else "plain"
    buf = getattr(_LOCAL, key, None)
    if buf is None or buf.numel() < size:
        buf = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=pinned)
        setattr(_LOCAL, key, buf)
    return buf


# ----------------------------------------------------------------------------------------------------------------------
# Reading


@dataclass
class ReadStats:
    """Where a read's time went, summed over the worker threads (they overlap: these add up to more than the wall)."""

    bytes: int = 0
    chunks: int = 0
    hashed_chunks: int = 0
    read_s: float = 0.0
    hash_s: float = 0.0
    copy_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, hashed: bool, read_s: float, hash_s: float, copy_s: float) -> None:
        with self.lock:
            self.bytes += nbytes
            self.chunks += 1
            self.hashed_chunks += int(hashed)
            self.read_s += read_s
            self.hash_s += hash_s
            self.copy_s += copy_s

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "chunks": self.chunks, "hashed_chunks": self.hashed_chunks,
                "thread_read_s": round(self.read_s, 3), "thread_hash_s": round(self.hash_s, 3),
                "thread_copy_s": round(self.copy_s, 3)}


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def parse_header(raw: bytes, file_size: int, where: str) -> list[_Entry]:
    """The tensors of a safetensors file from its first bytes (at least 8 + header length of them)."""
    if len(raw) < 8:
        raise WeightsError(f"{where} is too short to be a safetensors file ({file_size} bytes).")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise WeightsError(f"{where}: header length {n} is impossible for a {file_size}-byte file (corrupted).")
    if 8 + n > len(raw):
        raise WeightsError(f"{where}: the {n}-byte header does not fit in the first hash chunk.")
    try:
        header = json.loads(raw[8:8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightsError(f"{where}: the header is not JSON ({e}); the file is corrupted.") from None
    data_start, entries = 8 + n, []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[meta["dtype"]]
            shape = tuple(int(s) for s in meta["shape"])
            begin, end = (data_start + int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsError(f"{where}: tensor {name!r} has a malformed header entry ({e!r}).") from None
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize or not data_start <= begin <= end <= file_size:
            raise WeightsError(f"{where}: tensor {name!r} ({meta['dtype']} {list(shape)}) has byte range "
                               f"[{begin}, {end}) that does not fit its shape or the file.")
        entries.append(_Entry(name, dtype, shape, begin, end))
    return entries


class _Chunks:
    """One file's chunked read into its destination tensors (all allocated before any chunk is copied)."""

    def __init__(self, path: Path, device: torch.device | None, digests: list[str] | None, chunk_bytes: int,
                 stats: ReadStats, label: str | None = None):
        self.path, self.device, self.digests, self.chunk_bytes, self.stats = Path(path), device, digests, chunk_bytes, stats
        self.label = label or str(path)
        self.size = self.path.stat().st_size
        self.count = max(1, -(-self.size // chunk_bytes))
        if digests is not None and len(digests) != self.count:
            raise WeightsError(f"{self.label} changed: {self.size} bytes ({self.count} chunks of {chunk_bytes}), but "
                               f"the manifest lists {len(digests)} chunk digests")
        self.fd = os.open(self.path, os.O_RDONLY)
        self.entries: list[_Entry] = []
        self.tensors: dict[str, torch.Tensor] = {}

    def _read_checked(self, k: int) -> tuple[torch.Tensor, int, int, float, float]:
        """Chunk k in this thread's buffer, its digest checked: (buffer, offset, bytes, read s, hash s)."""
        offset = k * self.chunk_bytes
        n = min(self.chunk_bytes, self.size - offset)
        buf = _thread_buffer(n, pinned=self.device is not None and self.device.type == "cuda")
        view = memoryview(buf.numpy())[:n]
        t0 = time.perf_counter()
        _pread_into(self.fd, view, offset)
        t1 = time.perf_counter()
        if self.digests is not None and hashlib.sha256(view).hexdigest() != self.digests[k]:
            raise WeightsError(f"{self.label} changed: bytes {offset}-{offset + n} do not match the manifest's "
                               f"sha256 (chunk {k} of {self.count})")
        return buf, offset, n, t1 - t0, time.perf_counter() - t1

    def head(self) -> int:
        """Read and check the chunks holding the header (one, unless the header is larger than a chunk), parse it,
        allocate the destination tensors and copy those chunks' tensor bytes; returns the next chunk to read."""
        raw, k = bytearray(), 0
        while k < self.count:
            buf, offset, n, read_s, hash_s = self._read_checked(k)
            raw += memoryview(buf.numpy())[:n]
            self.stats.add(n, self.digests is not None, read_s, hash_s, 0.0)
            k += 1
            if len(raw) >= 8 and len(raw) >= 8 + struct.unpack("<Q", raw[:8])[0]:
                break
        if self.device is None:
            return k
        self.entries = parse_header(bytes(raw), self.size, self.label)
        self.tensors = {e.name: torch.empty(e.shape, dtype=e.dtype, device=self.device) for e in self.entries}
        self._copy(torch.frombuffer(raw, dtype=torch.uint8), 0, len(raw))
        return k

    def chunk(self, k: int) -> None:
        """Read and check chunk k, then copy its bytes into the destination tensors (with no device: check only)."""
        buf, offset, n, read_s, hash_s = self._read_checked(k)
        t = time.perf_counter()
        if self.device is not None:
            self._copy(buf, offset, n)
        self.stats.add(n, self.digests is not None, read_s, hash_s, time.perf_counter() - t)

    def _copy(self, buf: torch.Tensor, offset: int, n: int) -> None:
        end = offset + n
        pieces = [(e, max(e.begin, offset), min(e.end, end)) for e in self.entries if e.begin < end and e.end > offset]
        if not pieces:
            return
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else _null():
            for e, a, b in pieces:
                if a == b:
                    continue
                dst = self.tensors[e.name].view(-1).view(torch.uint8)
                dst[a - e.begin:b - e.begin].copy_(buf[a - offset:b - offset], non_blocking=stream is not None)
        if stream is not None:
            stream.synchronize()  # the buffer is this thread's and is refilled by its next chunk

    def close(self) -> None:
        os.close(self.fd)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def read_safetensors(path: Path, device: torch.device, pool: ThreadPoolExecutor, digests: list[str] | None,
                     chunk_bytes: int = HASH_CHUNK_BYTES, stats: ReadStats | None = None,
                     label: str | None = None) -> "Future[dict]":
    """Start reading `path` into tensors on `device`; the future gives {name: tensor}.

    `digests`: the sha256 each chunk must have (None: the file is already trusted, read without hashing). The
    chunk(s) holding the header are read first (digests checked, then the header parsed and the tensors allocated);
    the other chunks go to `pool`. The future raises WeightsError if any chunk's digest differs; no tensor is returned in that case.
    `label` names the file in errors (a bundle-relative path)."""
    return _run_chunks(path, torch.device(device), pool, digests, chunk_bytes, stats, label)


def verify_file(path: Path, pool: ThreadPoolExecutor, digests: list[str], chunk_bytes: int = HASH_CHUNK_BYTES,
                stats: ReadStats | None = None, label: str | None = None) -> "Future[None]":
    """Start checking every chunk of `path` against `digests` on `pool`; the future raises WeightsError on a
    mismatch."""
    return _run_chunks(path, None, pool, digests, chunk_bytes, stats, label)


def _run_chunks(path, device, pool, digests, chunk_bytes, stats, label) -> Future:
    stats = stats if stats is not None else ReadStats()
    result: Future = Future()

    def start() -> None:
        try:
            job = _Chunks(path, device, digests, chunk_bytes, stats, label)
        except (OSError, WeightsError) as e:
            result.set_exception(e if isinstance(e, WeightsError) else WeightsError(f"{label or path}: {e}"))
            return
        try:
            first = job.head()
        except BaseException as e:
            job.close()
            result.set_exception(e)
            return
        rest = [pool.submit(job.chunk, k) for k in range(first, job.count)]
        pending = [len(rest)]
        lock = threading.Lock()

        def finish() -> None:
            job.close()
            errors = [f.exception() for f in rest if f.exception() is not None]
            if errors:
                result.set_exception(errors[0])
            else:
                result.set_result(job.tensors if device is not None else None)

        if not rest:
            finish()
            return

        def done(_):
            with lock:
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                finish()

        for f in rest:
            f.add_done_callback(done)

    pool.submit(start)
    return result
