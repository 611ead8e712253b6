"""Python's cyclic garbage collector held off while training is paused.

A process that imported torch and megatron-core holds millions of Python objects. The
data phase allocates thousands of small ones (tensor views, pending operations), so the
collector runs during it: young-generation passes cost up to 0.03 s, and a full pass over
every object costs 0.5 s on this machine's shared cores (measured inside the data phase of
``bench/data_phase.py``, a tp reshape of ``small``: 0.13-0.15 s without it, 0.53-0.66 s
with it). Reference counting still frees everything acyclic at once; cycles made during
the pause wait for the next collection, after training resumed.

:func:`collector_paused` nests and may be entered from several threads at once (the
threaded test transport runs one executor per thread): the first entry disables the
collector, the last exit puts back what it found.
"""
from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Inside: the cyclic garbage collector does not run (see the module docstring)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
