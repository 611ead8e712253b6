"""What a worker starts never outlives it (Linux: ``prctl(PR_SET_PDEATHSIG)``).

A worker itself outlives a coordinator that was SIGKILLed or crashed: it holds at its step
boundary and waits up to its reattach wait (``REATTACH_WAIT``) for a coordinator restarted
on the same job and record to take it up again (:mod:`slurm_etc.worker.trainer`). A
coordinator that ends cleanly (the job's end, SIGTERM, Ctrl-C) stops its workers itself.

What a worker forks (data-loader processes) gets its own parent-death signal here
(:func:`children_die_with_me`), so it goes when the worker goes. What it spawns (fork +
exec: megatron's checkpoint save starts a multiprocessing Manager with the ``spawn``
context) cannot be armed so; it shares the worker's process group, which the local
backend starts in a session of its own and signals as a whole (a stop, a kill, a reattached
worker's too). Where there is no prctl (not Linux) nothing is armed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
from functools import lru_cache
from typing import Any

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_armed_forks = False


@lru_cache(maxsize=1)
def _prctl() -> Any:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                   ctypes.c_ulong]
    return fn


def children_die_with_me() -> None:
    """Every process this one forks from now on dies (SIGKILL) when this one dies, and
    exits at once if this one is gone already by the time it runs."""
    global _armed_forks
    prctl = _prctl()
    if prctl is None or _armed_forks:
        return
    _armed_forks = True
    me = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != me:
            os._exit(70)

    os.register_at_fork(after_in_child=arm)
