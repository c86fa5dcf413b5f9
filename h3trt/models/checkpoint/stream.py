"""A checkpoint's DiT tensors read a few at a time: `h3trt build` when the DiT does not fit on its device whole
(h3trt/build/stream.py materializes one block at a time from here).

Why not `load_dit`: it reads every tensor into host memory, then moves the whole DiT onto the device (66 GB at full
size). A build machine can be short of both. The H100 the project measures on has 80 GB of GPU memory and 128 GiB of
host memory, and the full-size checkpoint alone (77.5 GB) takes most of that host memory when it lives in /dev/shm,
for want of disk: a second host copy of the DiT, pinned or not, does not fit beside it. So nothing here copies the
model: the safetensors headers are parsed once (names, dtypes, shapes, byte ranges) and `read` copies only the tensors
asked for, with pread straight from the file (tmpfs or the page cache) into a buffer the caller owns and reuses (the
builder's pinned staging slots). The host footprint is that buffer, whatever the model's size.

The layout conversions are `read_native_state_dict`'s, one native tensor at a time, on whatever device the bytes were
moved to (a row permutation, a row-half swap and a concatenation are exact anywhere): official shards' per-head
interleaved QKV de-interleaved to [q; k; v]; diffusers names mapped to native ones, to_q/to_k/to_v concatenated,
fc1's halves swapped to [gate; value]; a Comfy file's prefix dropped. Same checks too: a tensor in two shards, a
pruned checkpoint, rope.inv_freq against the config.
"""

from __future__ import annotations

import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..weight_layout import deinterleave_qkv, swap_halves
from .names import native_name
from .reader import DAMAGED_FILE_FIX, CheckpointError, TransformerSource, check_rope_inv_freq, check_unpruned
from .safetensors_format import DTYPES as SAFETENSORS_DTYPES, MAX_HEADER_BYTES

READ_CHUNK_BYTES = 64 << 20  # one pread; a tensor's chunks go to several threads (a read releases the GIL)
ALIGN = 64  # where each tensor starts inside a read buffer: any dtype's view of it is aligned
_QKV_PARTS = re.compile(r"^(.*)\.attn\.to_([qkv])\.weight$")


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a file holds it: its byte range [begin, begin + nbytes)."""

    file: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    nbytes: int


@dataclass(frozen=True)
class NativeTensor:
    """A tensor under its native name: the stored tensor(s) it is made of, and the conversion that makes it."""

    name: str
    parts: tuple[StoredTensor, ...]  # one, or a diffusers attention's to_q, to_k, to_v
    convert: str  # "" | "deinterleave_qkv" | "swap_halves" | "concat"
    shape: tuple[int, ...]


def safetensors_header(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """{key: (dtype, shape, begin, end)} of a safetensors file, byte offsets from the file's start."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if n is None or n > MAX_HEADER_BYTES or 8 + n > size:
                raise ValueError(f"a header length that does not fit the {size}-byte file")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}); {DAMAGED_FILE_FIX}.") from None
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape = SAFETENSORS_DTYPES[meta["dtype"]], tuple(int(s) for s in meta["shape"])
            begin, end = (8 + n + int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {key!r} has a malformed header entry ({e!r}); "
                                  f"{DAMAGED_FILE_FIX}.") from None
        if end - begin != dtype.itemsize * _numel(shape) or not 8 + n <= begin <= end <= size:
            raise CheckpointError(f"{path}: tensor {key!r} has byte range [{begin}, {end}) that does not fit its "
                                  f"shape {list(shape)} or the file; {DAMAGED_FILE_FIX}.")
        out[key] = (dtype, shape, begin, end)
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class CheckpointTensors:
    """The DiT tensors of `source` by native name, none read until asked for."""

    def __init__(self, source: TransformerSource):
        self.source, cfg = source, source.config
        stored: dict[str, StoredTensor] = {}
        for file in source.files:
            for key, (dtype, shape, begin, end) in safetensors_header(file).items():
                if key in stored:
                    raise CheckpointError(f"Tensor {key!r} appears in more than one shard (again in {file}).")
                stored[key] = StoredTensor(file, key, dtype, shape, begin, end - begin)
        if source.prefix:
            stored = {k[len(source.prefix):] if k.startswith(source.prefix) else k: v for k, v in stored.items()}
        check_unpruned(stored)
        self.tensors: dict[str, NativeTensor] = {}
        if source.naming == "diffusers":
            self._diffusers(stored)
        else:
            for key, t in stored.items():
                qkv = (source.qkv_interleaved and key.endswith(".attn.qkv_proj.weight") and len(t.shape) == 2
                       and t.shape[0] == 3 * cfg.inner_dim)
                self.tensors[key] = NativeTensor(key, (t,), "deinterleave_qkv" if qkv else "", t.shape)
        inv = self.tensors.pop("rope.inv_freq", None)  # recomputed by the model; checked so a wrong config cannot hide
        if inv is not None:
            check_rope_inv_freq(self.read_cpu([inv])[inv.name], cfg)

    def _diffusers(self, stored: dict[str, StoredTensor]) -> None:
        fused: dict[str, dict[str, StoredTensor]] = {}
        for key, t in stored.items():
            m = _QKV_PARTS.match(key)
            if m:
                fused.setdefault(m.group(1), {})[m.group(2)] = t
                continue
            name = native_name(key)
            self.tensors[name] = NativeTensor(name, (t,), "swap_halves" if name.endswith(".mlp.fc1.weight") else "",
                                              t.shape)
        for prefix, parts in fused.items():
            if set(parts) != {"q", "k", "v"}:
                raise CheckpointError(f"{prefix}.attn has only to_{'/to_'.join(sorted(parts))}; to_q, to_k, to_v are "
                                      "all needed.")
            q, k, v = parts["q"], parts["k"], parts["v"]
            name = native_name(prefix) + ".attn.qkv_proj.weight"
            self.tensors[name] = NativeTensor(name, (q, k, v), "concat",
                                              (q.shape[0] + k.shape[0] + v.shape[0], *q.shape[1:]))

    def nbytes(self, tensors: list[NativeTensor]) -> int:
        """Bytes a read of `tensors` needs in its buffer (each part aligned)."""
        return sum(-(-p.nbytes // ALIGN) * ALIGN for t in tensors for p in t.parts)

    def read(self, tensors: list[NativeTensor], buffer: torch.Tensor,
             pool: ThreadPoolExecutor) -> dict[str, list[torch.Tensor]]:
        """Copy the stored bytes of `tensors` into `buffer` (uint8, host; at least `nbytes(tensors)`): {name: [uint8
        view of each part]}, in the checkpoint's layout. The chunks are read on `pool`'s threads."""
        views, jobs, offset = {}, [], 0
        for t in tensors:
            views[t.name] = []
            for part in t.parts:
                view = buffer[offset:offset + part.nbytes]
                views[t.name].append(view)
                jobs += [(part, view, start) for start in range(0, part.nbytes, READ_CHUNK_BYTES)]
                offset += -(-part.nbytes // ALIGN) * ALIGN
        fds = {f: os.open(f, os.O_RDONLY) for f in {p.file for p, _, _ in jobs}}
        try:
            for future in [pool.submit(_pread, fds[p.file], p, view, start) for p, view, start in jobs]:
                future.result()
        finally:
            for fd in fds.values():
                os.close(fd)
        return views

    def convert(self, t: NativeTensor, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The native tensor `t` from its parts' bytes (uint8, on any device, each its own allocation or an aligned
        view), converted to the native layout and cast to `dtype` there."""
        raw = [b.view(p.dtype).view(p.shape) for b, p in zip(parts, t.parts)]
        if t.convert == "deinterleave_qkv":
            value = deinterleave_qkv(raw[0], self.source.config.num_heads, self.source.config.head_dim)
        elif t.convert == "swap_halves":
            value = swap_halves(raw[0])
        elif t.convert == "concat":
            value = torch.cat(raw)
        else:
            value = raw[0]
        return value.to(dtype)

    def read_cpu(self, tensors: list[NativeTensor]) -> dict[str, torch.Tensor]:
        """`tensors` read into host memory of their own, native layout, the checkpoint's dtype (small reads)."""
        buffer = torch.empty(self.nbytes(tensors), dtype=torch.uint8)
        with ThreadPoolExecutor(1) as pool:
            views = self.read(tensors, buffer, pool)
        return {t.name: self.convert(t, [v.clone() for v in views[t.name]], t.parts[0].dtype) for t in tensors}


def _pread(fd: int, part: StoredTensor, view: torch.Tensor, start: int) -> None:
    """Bytes [start, start + READ_CHUNK_BYTES) of `part` into the same range of `view`."""
    n = min(READ_CHUNK_BYTES, part.nbytes - start)
    dest = memoryview(view[start:start + n].numpy())
    done = 0
    while done < n:
        got = os.preadv(fd, [dest[done:]], part.begin + start + done)
        if got <= 0:
            raise CheckpointError(f"{part.file}: tensor {part.key!r} ends before its {part.nbytes} bytes (the file is "
                                  f"truncated); {DAMAGED_FILE_FIX}.")
        done += got
