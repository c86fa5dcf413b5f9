"""The test session's compile cache (tests/cxx_cache.py): a repeated command is answered from the cache with the
first run's bytes, a different input compiles again, and a failed compile fails as it did and is not kept."""

import os
import subprocess
import sys
from pathlib import Path

from helpers import TESTS

CACHE = TESTS / "cxx_cache.py"
# A stand-in compiler: `-o OUT IN` copies IN to OUT and counts its runs; an input holding "bad" fails.
COMPILER = """#!/bin/sh
echo run >> "$(dirname "$0")/runs"
grep -q bad "$3" && { echo "error: bad input" >&2; exit 1; }
cp "$3" "$2"
"""


def _compile(tmp_path: Path, source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CACHE), str(tmp_path / "cc"), str(tmp_path / "entries"), "-o",
                           str(out), str(source)], capture_output=True, text=True)


def test_a_repeat_is_served_from_the_cache_and_a_failure_is_not_kept(tmp_path):
    (tmp_path / "cc").write_text(COMPILER)
    os.chmod(tmp_path / "cc", 0o755)
    (tmp_path / "entries").mkdir()
    runs = tmp_path / "runs"
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("kernel one")
    assert _compile(tmp_path, a, tmp_path / "first.so").returncode == 0
    b.write_text("kernel one")  # same content at another path: the same compile
    assert _compile(tmp_path, b, tmp_path / "second.so").returncode == 0
    assert (tmp_path / "second.so").read_text() == "kernel one" and len(runs.read_text().split()) == 1
    b.write_text("kernel two")
    assert _compile(tmp_path, b, tmp_path / "third.so").returncode == 0
    assert (tmp_path / "third.so").read_text() == "kernel two" and len(runs.read_text().split()) == 2
    a.write_text("bad kernel")
    for _ in range(2):
        failed = _compile(tmp_path, a, tmp_path / "bad.so")
        assert failed.returncode == 1 and "error: bad input" in failed.stderr
    assert len(runs.read_text().split()) == 4 and not (tmp_path / "bad.so").exists()
