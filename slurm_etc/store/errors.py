"""The store's error and the one hint its messages share, beneath both ``db`` and ``guard``
(so neither imports the other to name them)."""
from __future__ import annotations

from ..errors import InputError

BUSY_TIMEOUT_S = 10.0


class StoreError(InputError, RuntimeError):
    """The database cannot be opened, is not ours, or cannot be brought to the current
    schema (one line: where and why)."""


def locked_hint(text: str) -> str:
    """A sqlite error text; "database is locked" says what that means."""
    if "database is locked" in text:
        # sqlite3 gave up after BUSY_TIMEOUT_S: say so rather than leave the user guessing
        text += (f" (another process held its lock for {BUSY_TIMEOUT_S:g} s: a running "
                 "coordinator or a stuck client; nothing was written, try again later)")
    return text
