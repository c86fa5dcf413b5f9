"""The one error class a user can fix (a bad flag, a missing file, a request a bundle cannot serve): `h3trt` catches
it once, in cli.main, and prints it as one line naming the fix, exit status 2. Anything else is a bug or a broken
install and keeps its traceback. It is a ValueError, so validation code that catches ValueError keeps working.

The bottom layer: every other layer may import it (tests/test_layers.py), and it imports nothing of h3trt.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake the user can fix; the message names the problem and the fix, in one line."""
