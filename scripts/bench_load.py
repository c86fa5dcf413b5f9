"""Weight-load throughput on the device (issue 18's cold start): is a bundle's load bounded by the disk or by h3trt's
loader? One run, one file, every reader on the same bytes:

    python scripts/bench_load.py --dirs /tmp /dev/shm --gb 12 --json $OUT/load_h200.json

For each folder (a disk, and a RAM-backed tmpfs for comparison) a safetensors file of --gb GB is written (bf16
tensors of 256 MiB, random bytes), then read after its pages were dropped from the page cache:
  dd_direct        `dd iflag=direct bs=64M`: the raw sequential read of the device, no page cache
  pread_T          T threads pread 64 MiB chunks into host memory (the loader's access pattern, nothing else)
  h3trt_T[_hash]   h3trt.engines.weights_io.read_safetensors into GPU memory on T threads, each chunk sha256-checked
                   against the manifest digests (_hash, a first load) or trusted (a load the verified-once record
                   covers): what `h3trt run --engine` does with a bundle's weight files
GB/s are decimal (1e9 bytes) over the wall time of the read. A tmpfs cannot drop its pages (they are the files), so
its rows measure the loader with no disk under it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import bench_common  # noqa: E402,F401  (first: it puts this checkout on sys.path)

from h3trt.engines.weights_io import HASH_CHUNK_BYTES, chunk_digests, read_safetensors, write_safetensors  # noqa: E402

TENSOR_BYTES = 256 << 20


def drop_pages(path: Path) -> str:
    """Write back and drop the file's pages (fadvise: no root needed); also ask the kernel to drop clean caches."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "fadvise + drop_caches"
    except OSError:
        return "fadvise"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def pread_all(path: Path, threads: int) -> None:
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)

    def one(offset: int) -> None:
        buf = bytearray(min(HASH_CHUNK_BYTES, size - offset))
        view = memoryview(buf)
        done = 0
        while done < len(view):
            done += os.preadv(fd, [view[done:]], offset + done)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(0, size, HASH_CHUNK_BYTES)))
    finally:
        os.close(fd)


def h3trt_read(path: Path, threads: int, digests, device: torch.device) -> None:
    with ThreadPoolExecutor(threads) as pool:
        tensors = read_safetensors(path, device, pool, digests).result()
    if device.type == "cuda":
        torch.cuda.synchronize()
    del tensors


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"env": {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "torch": torch.__version__, "cpus": os.cpu_count(), "gb": args.gb},
              "rows": {}}
    count = max(1, int(args.gb * 1e9) // TENSOR_BYTES)
    for folder in args.dirs:
        folder = Path(folder)
        work = folder / "h3trt-bench-load"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        path = work / "weights.safetensors"
        try:
            g = torch.Generator().manual_seed(0)
            block = torch.randint(0, 255, (TENSOR_BYTES,), dtype=torch.uint8, generator=g)
            tensors = {f"w{i:03d}": block.view(torch.bfloat16).roll(i) for i in range(count)}
            write_s = timed(lambda: write_safetensors(path, tensors))
            del tensors
            size = path.stat().st_size
            with ThreadPoolExecutor(16) as pool:
                hash_s = timed(lambda: chunk_digests(path, HASH_CHUNK_BYTES, pool))
                digests = chunk_digests(path, HASH_CHUNK_BYTES, pool)
            rows = result["rows"][str(folder)] = {
                "bytes": size, "write_GBps": round(size / 1e9 / write_s, 3),
                "hash_16_threads_cached_GBps": round(size / 1e9 / hash_s, 3), "reads": {}}
            print(f"{folder}: {size / 1e9:.2f} GB written at {rows['write_GBps']} GB/s; sha256 on 16 threads from the "
                  f"page cache {rows['hash_16_threads_cached_GBps']} GB/s", flush=True)
            readers = [("dd_direct", lambda: subprocess.run(
                ["dd", f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct"], check=True, capture_output=True))]
            for t in args.threads:
                readers.append((f"pread_{t}", lambda t=t: pread_all(path, t)))
            for t in args.threads:
                readers.append((f"h3trt_{t}", lambda t=t: h3trt_read(path, t, None, device)))
                readers.append((f"h3trt_{t}_hash", lambda t=t: h3trt_read(path, t, digests, device)))
            for name, fn in readers:
                how = drop_pages(path)
                try:
                    seconds = timed(fn)
                except (subprocess.CalledProcessError, OSError) as e:  # O_DIRECT refused (tmpfs)
                    rows["reads"][name] = {"error": str(e)[:200]}
                    print(f"  {name:16s} failed: {str(e)[:120]}", flush=True)
                    continue
                rows["reads"][name] = {"seconds": round(seconds, 3), "GBps": round(size / 1e9 / seconds, 3),
                                       "pages": how}
                print(f"  {name:16s} {seconds:7.2f} s  {size / 1e9 / seconds:6.2f} GB/s", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dirs", nargs="+", default=["/tmp", "/dev/shm"], help="folders to read from (a disk, a tmpfs)")
    p.add_argument("--gb", type=float, default=12.0, help="file size in GB (default 12)")
    p.add_argument("--threads", nargs="+", type=int, default=[16, 32], help="reader threads (default 16 32)")
    p.add_argument("--json", type=Path, required=True)
    run(p.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
