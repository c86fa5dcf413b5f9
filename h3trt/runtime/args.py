"""The command line's parser: argparse, with a usage mistake reported as every other user error is (cli.main): one
line, `h3trt: error: <message>`, exit status 2, without argparse's usage block in front of it. Where argparse's own
message leaves out the flag or the fix, the line names them.

    parser = OneLineParser(prog="h3trt", description=...)   # subparsers from add_subparsers are OneLineParsers too
"""

from __future__ import annotations

import argparse
import re
from typing import NoReturn

# argparse's name of a flag's type -> what the flag takes
TYPE_KINDS = {"int": "a whole number", "float": "a number"}

_INVALID_TYPE = re.compile(r"argument (?P<flag>[^:/ ]+)\S*: invalid (?P<type>\w+) value: (?P<value>.+)")
_NOT_ALLOWED = re.compile(r"argument (?P<flag>[^:/ ]+)\S*: not allowed with argument (?P<other>[^:/ ]+)\S*")
_NO_VALUE = re.compile(r"argument (?P<flag>[^:/ ]+)\S*: expected (?:one|at least one) argument")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line and exit status 2; `--help` is argparse's. `add_subparsers`
    makes the subcommands' parsers of this class too (argparse's default parser_class is the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"h3trt: error: {explain(message, self.prog)}\n")


def explain(message: str, prog: str) -> str:
    """argparse's `message` as one line that names the flag and the fix; `prog` the command, e.g. "h3trt run"."""
    message = " ".join(message.split())
    if m := _INVALID_TYPE.fullmatch(message):
        kind = TYPE_KINDS.get(m["type"])
        if kind is not None:
            return f"{m['flag']} takes {kind}, got {m['value']}."
        return f"{m['flag']} got {m['value']}, which it cannot read; `{prog} --help` says what it takes."
    if m := _NOT_ALLOWED.fullmatch(message):
        return f"{m['flag']} and {m['other']} cannot be given together; pass one of them."
    if m := _NO_VALUE.fullmatch(message):
        # argparse reads a value that starts with '-' (and is not a plain negative number) as the next flag.
        return f"{m['flag']} needs a value (one that starts with '-' is written {m['flag']}=-VALUE)."
    if message.startswith(("the following arguments are required", "unrecognized arguments",
                           "one of the arguments")):
        return f"{message}; see `{prog} --help`."
    return message
