"""scripts/bench_lora.py's adapter files and what loading and switching them costs (issue 44: loading an adapter into a
slot costs no more than reading its file; switching compiles nothing).

Rows, seconds, each the median of --load-repeats (files just written: reads come from the page cache):
  file_read_hash    one pass over the file: read in 32 MB chunks and sha256 (the floor of any load that hashes)
  read_lora         lora_format.read_lora, the read the slots used before issue 44: every tensor copied out of the
                    file on the host, then the file hashed in a second pass (the issue's "reading its file")
  slots_read        AdapterSlots.read: adapters/stream.py, the file read once onto the slots' device, each chunk
                    hashed as it is read and copied through pinned buffers on a side stream while the next is read
  load_read_file    AdapterSlots.load of a file read onto the device: routing, finiteness checked there (one sync),
                    the copies into the banks
  load_from_path    AdapterSlots.load(slot, path): slots_read + load_read_file, what a server's switch costs
                    (bar: <= read_lora)
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time
from pathlib import Path

import torch

from bench_common import sync  # noqa: F401  (first: puts this checkout on sys.path)

from h3trt.adapters.slots import AdapterSlots, target_shape
from h3trt.engines.guard import no_compile
from h3trt.models.config import H3Config

BF16 = torch.bfloat16
ADAPTED = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")  # issue 38: every attention and MLP linear
CHUNK = 32 << 20


def timed_s(fn, dev: torch.device) -> tuple[object, float]:
    """(fn(), seconds), the device synchronised before and after."""
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t0


def write_adapter(path: Path, cfg: H3Config, rank: int, seed: int, dev: torch.device) -> int:
    """A rank-`rank` LoRA on every attention and MLP linear of all cfg.num_layers blocks, bf16, in ai-toolkit's
    original names (`diffusion_model.blocks.{i}.{linear}.lora_A|B.weight`; no alpha: scaling 1): its size in bytes.
    Drawn on `dev` (the full size is 300M values), written from the CPU."""
    from safetensors.torch import save_file

    g = torch.Generator(dev).manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for local in ADAPTED:
            n_in, n_out, _ = target_shape(cfg, local)
            key = f"diffusion_model.blocks.{i}.{local}"
            down = torch.randn(rank, n_in, generator=g, device=dev) / n_in ** 0.5
            up = 0.3 * torch.randn(n_out, rank, generator=g, device=dev) / rank ** 0.5
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = (t.to("cpu", BF16) for t in (down, up))
    save_file(tensors, str(path))
    return path.stat().st_size


def read_and_hash(path: Path) -> str:
    """One pass over the file, read in chunks and hashed: what any load that hashes the file must at least do."""
    h, buf = hashlib.sha256(), bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def load_adapters(cfg: H3Config, slots: AdapterSlots, work: Path, rank: int, dev: torch.device, repeats: int) -> dict:
    """Write adapters A and B, time reading and loading them (module doc); leaves A in slot 0 and B in slot 1 (one
    slot: A)."""
    from h3trt.models.lora_format import read_lora

    files = {name: work / f"adapter_{name}.safetensors" for name in ("A", "B")}
    t0 = time.perf_counter()
    nbytes = {name: write_adapter(path, cfg, rank, seed, dev) for seed, (name, path) in enumerate(files.items())}
    out = {"files": {n: str(p) for n, p in files.items()}, "file_bytes": nbytes["A"],
           "write_s": round(time.perf_counter() - t0, 3), "layers": cfg.num_layers, "rank": rank,
           "linears": list(ADAPTED), "page_cache": "the files were just written: reads come from the page cache"}
    rows: dict[str, list[float]] = {k: [] for k in ("file_read_hash", "read_lora", "slots_read", "load_read_file",
                                                    "load_from_path")}
    for _ in range(repeats):
        rows["file_read_hash"].append(timed_s(lambda: read_and_hash(files["A"]), dev)[1])
        rows["read_lora"].append(timed_s(lambda: read_lora(files["A"], cfg.head_dim), dev)[1])
        lora, seconds = timed_s(lambda: slots.read(files["A"]), dev)
        rows["slots_read"].append(seconds)
        rows["load_read_file"].append(timed_s(lambda: slots.load(0, lora), dev)[1])
        del lora
        if slots.num_slots > 1:
            rows["load_from_path"].append(timed_s(lambda: slots.load(1, files["B"]), dev)[1])
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    out.update(seconds=rows, median_s=med, slot_record=dataclasses.asdict(slots.records[0]))
    if "load_from_path" in med:
        out["bar"] = {"load_from_path_s": med["load_from_path"], "read_lora_s": med["read_lora"],
                      "at_most": "read_lora", "met": med["load_from_path"] <= med["read_lora"]}
    print(f"adapter: {nbytes['A'] / 1e6:.0f} MB; " + ", ".join(f"{k} {v:.3f} s" for k, v in med.items()), flush=True)
    return out


def wall_ms(fn, dev: torch.device, iters: int) -> float:
    """Median wall-clock ms of fn() with the device synchronised around each call: what a caller waits, the host's
    part included (select is host work and a small copy; CUDA events would time only the device's share)."""
    return statistics.median(timed_s(fn, dev)[1] for _ in range(iters)) * 1e3


def switching(evaluate, slots: AdapterSlots, files: dict, dev: torch.device, iters: int) -> dict:
    """Under no_compile: switch between resident slots, then load B where A was (a used slot, from its path); the
    evaluations that follow, and the steady evaluation, all by the wall clock. `evaluate(run)`: one evaluation."""
    one = [(0, 1.0)]
    out = {"timing": f"wall clock, device synchronised; steady and select: median of {iters}",
           "select_ms": wall_ms(lambda: slots.select(one), dev, iters)}
    with no_compile():
        out["steady_evaluation_ms"] = wall_ms(lambda: evaluate(slots.select(one)), dev, iters)
        with_a = evaluate(slots.select(one))
        if slots.num_slots > 1:
            with_b, seconds = timed_s(lambda: evaluate(slots.select([(1, 1.0)])), dev)
            out["first_evaluation_after_switching_slots_ms"] = seconds * 1e3
        out["load_b_into_used_slot_0_s"] = timed_s(lambda: slots.load(0, files["B"]), dev)[1]
        after, seconds = timed_s(lambda: evaluate(slots.select(one)), dev)
        out["first_evaluation_after_loading_ms"] = seconds * 1e3
    out["no_compile"] = "every evaluation above ran under engines/guard.py no_compile: nothing compiled"
    out["reload_changed_the_output"] = not torch.equal(after, with_a)
    if slots.num_slots > 1:
        out["reloaded_slot_equals_the_other_slot"] = torch.equal(after, with_b)
    return out
