"""h3trt keeps a bytecode cache of its own where the interpreter writes none (PYTHONDONTWRITEBYTECODE=1 and no .pyc
beside torch's source, as on the H200 image): real interpreters, a stand-in `torch` package without bytecode."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import sys, h3trt, torch; print(sys.pycache_prefix); print(sys.dont_write_bytecode); "
         "import importlib.util; print(importlib.util.cache_from_source(torch.__file__))")


def _run(tmp_path, **env):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                         env={**{k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX",
                                                                                  "H3TRT_PYCACHE")},
                              "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}", "PYTHONDONTWRITEBYTECODE": "1",
                              "XDG_CACHE_HOME": str(tmp_path / "cache"), **env})
    assert out.returncode == 0, out.stderr
    prefix, dont_write, pyc = out.stdout.split()
    return prefix, dont_write == "True", Path(pyc)


@pytest.fixture
def site(tmp_path):
    """A `torch` package with no bytecode beside it, first on the path."""
    (tmp_path / "site" / "torch").mkdir(parents=True)
    (tmp_path / "site" / "torch" / "__init__.py").write_text("VALUE = 1\n")
    return tmp_path


def test_no_bytecode_anywhere_gets_a_cache_of_its_own_that_the_next_process_reads(site):
    prefix, dont_write, pyc = _run(site)
    assert prefix == str(site / "cache" / "h3trt" / "pycache") and not dont_write
    assert pyc.is_file() and str(pyc).startswith(prefix)  # torch was compiled into it, once
    assert not (site / "site" / "torch" / "__pycache__").exists()  # nothing written beside the source
    first = pyc.stat().st_mtime_ns
    assert _run(site)[2].stat().st_mtime_ns == first  # the next process read it, compiled nothing again
    # A process started by an h3trt process inherits the prefix (PYTHONPYCACHEPREFIX) and writes into it too.
    inherited, dont_write, _ = _run(site, PYTHONPYCACHEPREFIX=prefix)
    assert inherited == prefix and not dont_write
    # ...even under another user cache folder (a bench giving each process its own): the mark says it is h3trt's.
    inherited, dont_write, _ = _run(site, PYTHONPYCACHEPREFIX=prefix, H3TRT_PYCACHE=prefix,
                                    XDG_CACHE_HOME=str(site / "other"))
    assert inherited == prefix and not dont_write


def test_a_prefix_the_user_chose_and_bytecode_that_exists_are_left_alone(site):
    mine = site / "mine"
    prefix, dont_write, _ = _run(site, PYTHONPYCACHEPREFIX=str(mine))
    assert prefix == str(mine) and dont_write  # the user's prefix and flag, as they set them
    import compileall

    assert compileall.compile_dir(str(site / "site" / "torch"), quiet=1)  # the image ships .pyc: nothing to do
    prefix, dont_write, _ = _run(site)
    assert prefix == "None" and dont_write
