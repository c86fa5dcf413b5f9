"""A LoRA file read once onto a device: read in chunks, hashed as it is read, each chunk copied to the device while
the next is read (issue 44: loading an adapter into a slot costs no more than reading its file).

`lora_format.read_lora` copies every tensor out of the file, then hashes the file in a second pass, and the slots then
copied each factor from pageable host memory after checking it on the host. Here:
  1. safetensors checks the header against the file (`lora_format.opened_safetensors`); the header gives each
     tensor's byte range in the data section;
  2. the data section is read once, in CHUNK_BYTES chunks, by a reader thread into pinned staging buffers; this
     thread hashes each chunk (hashlib and file reads release the GIL) and queues its host->device copy on a side
     stream: reading, hashing and copying overlap, and the file is never read twice;
  3. the tensors are views of the one device buffer, normalised there by `lora_format.lora_from_tensors` (every layout,
     alpha rule and refusal of read_lora); AdapterSlots.load checks their finiteness on the device.
On the CPU the file is read straight into the buffer, hashed chunk by chunk (no staging, no copy).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..models.lora_format import LoraError, LoraFile, file_metadata, lora_from_tensors, opened_safetensors
from ..models.checkpoint.safetensors_format import DTYPES as SAFETENSORS_DTYPES

CHUNK_BYTES = 32 << 20  # a chunk: large enough that a copy's launch is noise, small enough to overlap well
STAGING_BUFFERS = 3  # one being read, one being hashed and copied, one whose copy may still run


class Staging:
    """The host buffers a file streams through to `device`, and the side stream that copies them: pinned buffers
    and a CUDA stream for a CUDA device, made once per set of slots (pinning costs milliseconds per buffer); none on
    the CPU, where the file is read straight into its tensors (`staged` forces the buffers there: the tests' way
    through the reader thread)."""

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES, count: int = STAGING_BUFFERS,
                 staged: bool | None = None):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.buffers = ([torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(count)]
                        if (cuda if staged is None else staged) else [])
        self.stream = torch.cuda.Stream(self.device) if cuda else None


def read_lora_to(path: str | Path, device: torch.device, head_dim: int, staging: Staging) -> LoraFile:
    """The LoRA file at `path`, its tensors on `device` (views of one buffer there) and its sha256, in one pass."""
    path = Path(path)
    with opened_safetensors(path) as f:
        file_meta = file_metadata(f, path)
    head, entries = _header(path)
    data = torch.empty(path.stat().st_size - len(head), dtype=torch.uint8, device=device)
    hasher = hashlib.sha256(head)
    if staging.buffers:
        _stream_into(path, len(head), data, hasher, staging)
    else:
        _read_into(path, len(head), data, hasher)
    state = {name: _tensor(data, entry, name, path) for name, entry in entries.items()}
    return lora_from_tensors(path, state, file_meta, hasher.hexdigest(), head_dim)


def _header(path: Path) -> tuple[bytes, dict]:
    """(the header's bytes as the file holds them, its tensor entries): safetensors checked it already."""
    with open(path, "rb") as f:
        size_bytes = f.read(8)
        text = f.read(struct.unpack("<Q", size_bytes)[0])
    entries = json.loads(text)
    entries.pop("__metadata__", None)
    return size_bytes + text, entries


def _tensor(data: torch.Tensor, entry: dict, name: str, path: Path) -> torch.Tensor:
    """One tensor of the file as a view of the data section `data` (a copy where its offset is not aligned to its
    element size, which safetensors' own writer never leaves)."""
    dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise LoraError(f"--lora {path}: {name} is {entry['dtype']}, a dtype h3trt does not read (a LoRA's factors are "
                        f"one of {sorted(SAFETENSORS_DTYPES)}).")
    begin, end = entry["data_offsets"]
    raw = data[begin:end]
    if begin % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(entry["shape"])


def _fill(f, view: memoryview, path: Path) -> None:
    """Read exactly len(view) bytes of `f` into `view`."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise LoraError(f"--lora {path} ended before its header's last tensor: it changed while it was read. "
                            "Read it again once it is complete.")
        got += n


def _read_into(path: Path, start: int, data: torch.Tensor, hasher) -> None:
    """The CPU: the data section read into `data` itself, each chunk hashed as it arrives."""
    view = memoryview(data.numpy())
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        for begin in range(0, len(view), CHUNK_BYTES):
            chunk = view[begin:begin + CHUNK_BYTES]
            _fill(f, chunk, path)
            hasher.update(chunk)


def _stream_into(path: Path, start: int, data: torch.Tensor, hasher, staging: Staging) -> None:
    """A reader thread fills the staging buffers in turn; this thread hashes each filled one and copies it into
    `data` (on CUDA: on the side stream, asynchronously). A buffer is read into again only once the copy that last
    read it has finished."""
    buffers, stream = staging.buffers, staging.stream
    chunk = buffers[0].numel()
    count = -(-data.numel() // chunk)
    copied: list[torch.cuda.Event | None] = [None] * len(buffers)  # the copy that last read each buffer
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(data.device))  # `data`'s memory may still be in use there
    try:
        with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1, thread_name_prefix="h3trt-lora-read") as pool:
            f.seek(start)

            def read(i: int) -> tuple[int, int]:
                slot, n = i % len(buffers), min(chunk, data.numel() - i * chunk)
                if copied[slot] is not None:
                    copied[slot].synchronize()
                _fill(f, memoryview(buffers[slot].numpy())[:n], path)
                return slot, n

            pending = pool.submit(read, 0)
            for i in range(count):
                slot, n = pending.result()
                if i + 1 < count:
                    pending = pool.submit(read, i + 1)
                hasher.update(memoryview(buffers[slot].numpy())[:n])
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    data[i * chunk:i * chunk + n].copy_(buffers[slot][:n], non_blocking=stream is not None)
                    if stream is not None:
                        copied[slot] = torch.cuda.Event()
                        copied[slot].record(stream)
    finally:
        if stream is not None:
            stream.synchronize()  # no copy outlives the call: the buffers are the next read's
