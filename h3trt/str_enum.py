"""`StrEnum`: the base of h3trt's vocabularies (precisions, job statuses, event kinds, stages, model sources, launch
kinds), each a str enum whose members carry their facts.

A member is its value wherever it leaves the program: it compares and hashes equal to the string, and prints, formats
(f-strings, argparse's "choose from"), reprs (messages' {x!r}) and serialises (json.dumps, a database row) as it, so
files, rows and messages keep the same bytes. Python 3.11's enum.StrEnum does the first half; h3trt runs on 3.10 too,
and its repr would show the class.

Imports nothing of h3trt (every layer may use it).
"""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """A str enum that is its value wherever it is printed or written (module doc)."""

    __format__ = str.__format__

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)
