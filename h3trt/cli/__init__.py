"""h3trt command line: parse the arguments, call one function.

    h3trt run --prompt "..." --output clip.mp4 [--image first.png] [--last-image last.png] [--ref FILE ...] [...]
    h3trt run --requests FILE --out-dir DIR [--max-batch N] [...]
    h3trt serve [--engine DIR | --model PATH] [--port 8000] [--api-key KEY] [--data-dir DIR] [...]
    h3trt build --model PATH|tiny --output DIR [--precision bf16|fp8|nvfp4] [...]
    h3trt eval | inspect | verify | keygen

The flags are in cli/parser.py, what each command calls in cli/commands.py (a few lines each: the work lives below,
run/commands.py for run, server/ for serve, build/ for build). Nothing heavy is imported at the top: torch and the model
code load inside `main`, where an interrupt (Ctrl-C, or SIGTERM, treated alike) during the first second's imports is
one line too. Errors the user can fix are one line on stderr and exit status 2; a failed job, rank, output or bundle
check is one line and exit 1; an interrupt exits 130. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import signal
import sys

from ..errors import UserError  # imports nothing: the one class a user's mistake raises, caught once in `main`
from ..paths import use_bytecode_cache  # imports nothing either

COMMANDS = {"run": "cmd_run", "serve": "cmd_serve", "build": "cmd_build", "eval": "cmd_eval",
            "inspect": "cmd_inspect", "verify": "cmd_verify", "keygen": "cmd_keygen"}


_signalled: list[int] = []  # the interrupts (SIGINT, SIGTERM) this process has received


def _interrupt(signum, frame):
    _signalled.append(signum)
    raise KeyboardInterrupt


def main(argv=None) -> int:
    use_bytecode_cache()  # before the first heavy import (torch), so this process and its ranks keep their bytecode
    # SIGTERM ends a run as Ctrl-C does: temporaries removed, what was finished kept, one line (`serve` installs its
    # own: it drains). Installed before anything heavy is imported, so a signal in the first second is handled too.
    _signalled.clear()
    # The caller's handlers come back when main returns: a test process (or any program) that calls main keeps its
    # own, and a later signal there never raises KeyboardInterrupt from inside whatever code it happens to hit.
    callers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _interrupt)
    if callers[signal.SIGINT] is signal.default_int_handler:  # not where the parent ignores Ctrl-C
        signal.signal(signal.SIGINT, _interrupt)
    status = None  # stays None when an exception leaves main (a bug, a usage mistake's SystemExit)
    try:
        from .parser import build_parser

        args = build_parser().parse_args(argv)  # a usage mistake is one line and exit 2 (cli/args.py)
        status = _call(args)
    except Exception as e:
        interrupt = _interrupt_behind(e)
        if interrupt is None:
            raise
        status = _interrupted(interrupt)
    except KeyboardInterrupt as e:
        status = _interrupted(e)
    finally:
        _forget_caught_interrupts()
        _forget_created_folders(remove_empty=status != 0)
        for signum, handler in callers.items():
            if handler is not None:  # None: a handler installed outside Python, which Python cannot put back
                signal.signal(signum, handler)
    return status


def _forget_created_folders(remove_empty: bool) -> None:
    """A run that ends without its output (interrupted, refused, failed) leaves no folder it created for it empty."""
    output_files = sys.modules.get("h3trt.media.output_files")  # not imported: nothing was created
    if output_files is not None:
        output_files.remove_created_folders_left_empty(remove=remove_empty)


def _forget_caught_interrupts() -> None:
    """Keep the exit status this process returns. CPython marks an interrupt "unhandled" when it ends any string
    `exec`/`eval` (a dataclass or namedtuple being defined, a library's generated code), even one a caller catches,
    and under `python -m` (how torchrun starts ranks, how tests start the CLI) it then dies by SIGINT at exit (-2)
    instead of returning 130 (or 0, or 1). Each string exec clears the mark as it starts: one empty one does."""
    exec("", {})


def _interrupt_behind(error: BaseException) -> KeyboardInterrupt | None:
    """The interrupt behind an error, if any. An error raised while an interrupt unwound (torch's
    `with torch.device(...)` exit: "trying to pop from empty mode stack") or after one arrived is the user's interrupt,
    not a bug and not a bad input: a library can swallow the KeyboardInterrupt and raise its own error instead
    (safetensors, interrupted inside `get_tensor`: "could not determine the shape of object type
    'torch.storage.UntypedStorage'", which the loader reports as a corrupted file)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return KeyboardInterrupt() if _signalled else None


def _interrupted(e: KeyboardInterrupt) -> int:
    from ..media.output_files import InterruptedAfterCommit, remove_own_temps

    remove_own_temps()  # whatever an unwinding frame did not get to
    if isinstance(e, InterruptedAfterCommit):
        print(f"h3trt: interrupted after writing {' and '.join(map(str, e.targets))}.", file=sys.stderr)
    else:
        print("h3trt: interrupted; no output was written (temporary files removed).", file=sys.stderr)
    return 130


def _call(args) -> int:
    """Run the command. A UserError (OutputRefused included) is the user's to fix: one line, exit 2. A failed output,
    rank, job or bundle check (the work was attempted and says why it failed): one line, exit 1. Anything else (a
    ValueError or RuntimeError included) is a bug or a broken install and propagates with its traceback."""
    from ..build.check import BuildError
    from ..parallel.launch import RankFailed
    from ..media.output_files import OutputError
    from ..jobs.job import JobFailed
    from . import commands

    try:
        commands.choose_gpu(args)
        return getattr(commands, COMMANDS[args.command])(args)
    except UserError as e:
        if _signalled:  # after an interrupt arrived, an error is its consequence (_interrupt_behind)
            return _interrupted(KeyboardInterrupt())
        from ..models.checkpoint.reader import CheckpointError  # its errors list a problem per line; they keep their lines

        print(f"h3trt: error: {str(e) if isinstance(e, CheckpointError) else ' '.join(str(e).split())}",
              file=sys.stderr)
        return 2
    except (OutputError, RankFailed, JobFailed, BuildError) as e:  # attempted: the result could not be made/written
        if _signalled:
            return _interrupted(KeyboardInterrupt())
        print(f"h3trt: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
