"""Where h3trt keeps its files outside a bundle and an output folder: the user's cache, and Python's bytecode cache.

`cache_dir()` is $XDG_CACHE_HOME/h3trt (default ~/.cache/h3trt): the embedded tiny model (models/tiny.py), the
verified-once records (engines/verified.py) and the bytecode cache below.

`use_bytecode_cache()` makes sure Python keeps compiled bytecode for what the process imports next. Where the
interpreter writes none (PYTHONDONTWRITEBYTECODE=1, as the H200 image sets, or a read-only install) and torch has no
bytecode beside its source, every process would compile torch, Inductor and transformers from source: seconds of
every cold start (26.6-31.0 s to the first step of a full-size bundle on the H200 image, against 13.4-17.6 s with
bytecode). h3trt then keeps a bytecode cache of its own, cache_dir()/pycache, which every later process reads: a
server's restart, a fleet scaling from zero, each spawned rank. A prefix the user set (PYTHONPYCACHEPREFIX) is left as
it is. The entry points call it (the CLI's `main`, a spawned rank's `parallel.launch._entry`, a fleet replica's
constructor), never an import: a program that imports h3trt keeps its own interpreter settings and environment.

Imports nothing of h3trt (every layer may use it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The prefix h3trt set for this process tree (PYTHONPYCACHEPREFIX alone looks like a user's).
PYCACHE_MARK = "H3TRT_PYCACHE"


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/h3trt, default ~/.cache/h3trt (read each call: tests and benches point it elsewhere)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "h3trt"


def use_bytecode_cache() -> None:
    """Keep compiled bytecode where Python writes none (module doc). The CLI calls it before torch is imported; a
    spawned rank or a fleet replica has imported torch by then (unpickling its target did), so it reads what its
    launcher compiled through the inherited PYTHONPYCACHEPREFIX and from here on writes what it compiles itself."""
    import importlib.util

    prefix = str(cache_dir() / "pycache")
    if sys.pycache_prefix is not None and sys.pycache_prefix in (prefix, os.environ.get(PYCACHE_MARK)):
        sys.dont_write_bytecode = False  # h3trt's cache, inherited from an h3trt process: write what this one compiles
        return
    if sys.pycache_prefix is not None:  # the user chose where bytecode goes
        return
    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    if spec is None or spec.origin is None:
        return
    compiled = os.path.isfile(importlib.util.cache_from_source(spec.origin))
    writable = os.access(os.path.dirname(spec.origin), os.W_OK)
    if compiled or (writable and not sys.dont_write_bytecode):
        return  # torch has its bytecode, or Python will write it beside the source
    try:
        os.makedirs(prefix, exist_ok=True)
    except OSError:
        return  # no writable cache: Python compiles from source, as before (h3trt run says so)
    if not os.access(prefix, os.W_OK):
        return
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False
    # Processes this one starts (a build's fresh-process check, torchrun ranks) read the same cache from their start.
    os.environ.setdefault("PYTHONPYCACHEPREFIX", prefix)
    os.environ.setdefault(PYCACHE_MARK, prefix)  # so they know it is h3trt's, not a prefix their user chose
