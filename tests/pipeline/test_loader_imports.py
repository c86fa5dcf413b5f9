"""The cold-start import race (issue 35 item 3): a bundle load runs the text encoder and the VAEs on their own threads
(pipeline/loading.py `Deferred`) while the main thread imports Inductor for the compiled code (engines/loaders.py
`activate_compiled_cache`). Two threads importing through torch._inductor, diffusers and transformers at once saw
half-initialised modules on the H200 ("cannot import name 'IndentedBuffer' from partially initialized module
'torch._inductor.utils'", one cold start in three). `import_loader_modules` imports them all on one thread before
the loader threads start; here the loader threads' bodies run after it, in fresh interpreters (nothing imported
yet), while the main thread imports as Engine.load does, with an import hook recording every module first imported
off the main thread: none of the heavy packages may be. CPU, the tiny checkpoint."""

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from helpers import REPO

HEAVY = ("torch", "diffusers", "transformers", "accelerate", "safetensors")

# One cold start's threads: the text encoder's body (load, throwaway encode), the VAEs' body, and the load pool's
# weight reads, started after the pre-import; the main thread meanwhile activates a bundle's compiled-code cache
# (its Inductor imports). The hook records what a non-main thread imports first.
SCRIPT = textwrap.dedent("""
    import importlib.abc, json, sys, threading

    off_main = []

    class Record(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if threading.current_thread() is not threading.main_thread() and name not in sys.modules:
                off_main.append(name)
            return None

    sys.meta_path.insert(0, Record())
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import torch

    from h3trt.engines.loaders import activate_compiled_cache
    from h3trt.engines.weights_io import chunk_digests, read_safetensors, write_safetensors
    from h3trt.models.vae_precision import VAEPrecision
    from h3trt.pipeline.loading import Deferred, _text_encoder, _vaes, import_loader_modules

    root, scratch = Path(sys.argv[1]), Path(sys.argv[2])
    weights = scratch / "w.safetensors"
    write_safetensors(weights, {"w": torch.arange(4096, dtype=torch.float32)})
    (scratch / "bundle" / "inductor_cache").mkdir(parents=True)
    import_loader_modules()
    pool = ThreadPoolExecutor(2, thread_name_prefix="h3trt-load")
    read = read_safetensors(weights, torch.device("cpu"), pool, chunk_digests(weights, 4096), 4096)

    def text():
        encoder = _text_encoder(root, torch.device("cpu"), torch.float32)
        encoder.encode_t2va("warm-up")
        return _vaes(root, torch.device("cpu"), VAEPrecision("fp32"))

    loading = Deferred(text)
    activate_compiled_cache(scratch / "bundle")  # Engine.load's imports, on the main thread
    loading.result()
    read.result()
    print(json.dumps(sorted(set(off_main))))
""")


def _cold_start(tiny_root: Path, scratch: Path) -> list[str]:
    scratch.mkdir()
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_root / "FL2VA"), str(scratch)], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]  # a half-initialised module is an ImportError: exit 1
    assert "partially initialized" not in done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_loader_threads_import_no_heavy_module_and_never_see_a_half_initialised_one(tiny_root, tmp_path):
    """Four cold starts, two at a time, each in a fresh interpreter: every one exits 0 and its loader threads import
    none of torch, diffusers, transformers (or their helpers) first; without the pre-import, the text encoder's
    thread imported 469 of their modules itself (diffusers, transformers' Qwen models, tokenizers, processors)."""
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda i: _cold_start(tiny_root, tmp_path / f"run{i}"), range(4)))
    for off_main in runs:
        heavy = [name for name in off_main if name.split(".")[0] in HEAVY]
        assert not heavy, f"first imported off the main thread: {heavy[:20]}"
