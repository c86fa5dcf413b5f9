"""A compile cache for the test session's C++ compiler (the tests' CXX; conftest.py installs it).

Every `h3trt build` compiles into a fresh Inductor cache inside its bundle, so the suite's dozen builds of the tiny
model compile the same kernels over and over (about half of a CPU build's time is g++). This wrapper runs the real
compiler once per distinct command and copies its output on a repeat: the key is the command with every argument that
names an existing file replaced by that file's content hash, and the output path left out. Anything else (no single
`-o`, a failed compile, an error in this script) runs the real compiler as it is. The cache lives as long as the
session (conftest.py removes it), so headers and compiler cannot change under it.

    python cxx_cache.py REAL_COMPILER CACHE_DIR ARGS...
"""

import hashlib
import os
import shutil
import subprocess
import sys


def _key(compiler: str, args: list[str], out_at: int) -> str:
    h = hashlib.sha256(compiler.encode())
    for i, arg in enumerate(args):
        if i == out_at:
            h.update(b"\0<out>")
            continue
        if os.path.isfile(arg):
            with open(arg, "rb") as f:
                h.update(b"\0<file>" + hashlib.sha256(f.read()).digest())
        else:
            h.update(b"\0" + arg.encode())
    return h.hexdigest()


def main(compiler: str, cache: str, args: list[str]) -> int:
    outs = [i + 1 for i, a in enumerate(args) if a == "-o" and i + 1 < len(args)]
    if len(outs) != 1:
        return subprocess.call([compiler, *args])
    out = args[outs[0]]
    try:
        entry = os.path.join(cache, _key(compiler, args, outs[0]))
        if os.path.isfile(entry):
            shutil.copy(entry, out)  # the bytes and the mode bits the compiler gave them
            return 0
    except OSError:
        entry = None
    code = subprocess.call([compiler, *args])
    if code == 0 and entry is not None and os.path.isfile(out):
        tmp = f"{entry}.{os.getpid()}.tmp"
        try:
            shutil.copy(out, tmp)
            os.replace(tmp, entry)  # two processes compiling one command both write whole entries
        except OSError:
            pass
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
