"""h3trt keeps a bytecode cache of its own where the interpreter writes none (PYTHONDONTWRITEBYTECODE=1 and no .pyc
beside torch's source, as on the H200 image): real interpreters, a stand-in `torch` package without bytecode. Its
entry points set it up (h3trt/paths.py); importing the package changes nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from h3trt.parallel.launch import launch

from helpers import REPO

pytestmark = pytest.mark.unit

PROBE = ("import sys; from h3trt.paths import use_bytecode_cache; use_bytecode_cache(); import torch; "
         "print(sys.pycache_prefix); print(sys.dont_write_bytecode); "
         "import importlib.util; print(importlib.util.cache_from_source(torch.__file__))")
STATE = "import os, sys; state = lambda: [sys.pycache_prefix, sys.dont_write_bytecode, dict(os.environ)]; "


def _env(tmp_path, **env) -> dict:
    return {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "H3TRT_PYCACHE")},
            "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}", "PYTHONDONTWRITEBYTECODE": "1",
            "XDG_CACHE_HOME": str(tmp_path / "cache"), **env}


def _python(tmp_path, code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=_env(tmp_path, **env))
    assert out.returncode == 0, out.stderr
    return out.stdout


def _run(tmp_path, **env):
    prefix, dont_write, pyc = _python(tmp_path, PROBE, **env).split()
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


def test_importing_h3trt_changes_no_interpreter_setting_and_no_environment(site):
    # The package and the modules the CLI imports before its `main` runs; where the old package set the cache up.
    code = STATE + "before = state(); import h3trt, h3trt.paths, h3trt.errors, h3trt.cli; after = state()"
    before, after = json.loads(_python(site, f"import json; {code}; print(json.dumps([before, after]))"))
    assert after == before and before[:2] == [None, True]


def test_the_cli_sets_up_the_cache_for_itself_and_the_processes_it_starts(site):
    code = ("import contextlib, io, json, os, sys; from h3trt.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    try:\n        main(['--help'])\n    except BaseException:\n        pass\n"  # the stand-in torch fails
            "import torch, importlib.util\n"
            "print(json.dumps([sys.pycache_prefix, sys.dont_write_bytecode, os.environ.get('PYTHONPYCACHEPREFIX'), "
            "os.environ.get('H3TRT_PYCACHE'), importlib.util.cache_from_source(torch.__file__)]))")
    prefix, dont_write, inherited, mark, pyc = json.loads(_python(site, code))
    assert prefix == inherited == mark == str(site / "cache" / "h3trt" / "pycache") and not dont_write
    assert Path(pyc).is_file() and pyc.startswith(prefix)


def _report_bytecode(rank, world, store, out):
    out.write_text(json.dumps([sys.pycache_prefix, sys.dont_write_bytecode]))


@pytest.mark.multiproc
def test_a_spawned_rank_writes_into_the_cache_its_launcher_set_up(tmp_path, monkeypatch):
    # What the CLI's set-up leaves for its ranks (the environment; a spawned child starts with -B as its parent does).
    prefix = str(tmp_path / "pycache")
    for name, value in {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": prefix, "H3TRT_PYCACHE": prefix}.items():
        monkeypatch.setenv(name, value)
    launch(_report_bytecode, 1, (tmp_path / "rank.json",))
    assert json.loads((tmp_path / "rank.json").read_text()) == [prefix, False]
