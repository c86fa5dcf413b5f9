"""The one error class a user can fix (a bad flag, a missing file, a request a bundle cannot serve): `h3trt` catches
it once, in cli.main, and prints it as one line naming the fix, exit status 2. Anything else is a bug or a broken
install and keeps its traceback. It is a ValueError, so validation code that catches ValueError keeps working.

The bottom layer: every other layer may import it (tests/house/test_layers.py), and it imports nothing of h3trt.
"""

from __future__ import annotations

from contextlib import contextmanager


class UserError(ValueError):
    """A mistake the user can fix; the message names the problem and the fix, in one line. `field`: the request
    field it is about, as the request schema's key (request/fields.py), or None; a front door names it in its own
    words from there (the API's 400 `param`), never by reading the message."""

    field: str | None = None  # the class's default: a subclass whose other base's __init__ runs first has it too

    def __init__(self, message: str = "", field: str | None = None):
        super().__init__(message)
        self.field = field  # kept by pickling: an exception's __reduce__ carries its __dict__


class MediaError(UserError):
    """A user-facing media problem (an input file missing, unreadable, of a kind H3 takes no reference of); the
    message is one line: file, problem, fix. A server's failed job names it bad_media."""


@contextmanager
def about(field: str):
    """A UserError raised inside is about `field` unless it already names its own (a reader of a file does not know
    which request field named the file)."""
    try:
        yield
    except UserError as e:
        if e.field is None:
            e.field = field
        raise
