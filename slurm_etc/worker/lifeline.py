"""Processes that never outlive the one they work for (Linux: ``prctl(PR_SET_PDEATHSIG)``).

The local backend arms each worker it starts (:func:`parent_death_hook`, run between fork
and exec: the kernel SIGKILLs the worker when the coordinator dies); a worker arms every
process it forks itself (:func:`children_die_with_me`: the multiprocessing Manager of
megatron's checkpoint save, data-loader processes), so a SIGKILLed coordinator leaves
nothing of its job behind. Where there is no prctl (not Linux) both do nothing and the
workers' silence bound ends them (:mod:`slurm_etc.worker.trainer`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import threading
import time
from collections.abc import Callable
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


def parent_death_hook(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die (SIGKILL, kept across exec) when
    ``parent`` dies, and exit at once if it is gone already; None without prctl."""
    prctl = _prctl()
    if prctl is None:
        return None

    def arm() -> None:  # between fork and exec: no locks, no imports
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(70)

    return arm


def children_die_with_me(poll_s: float = 0.2) -> None:
    """What this process starts dies with it, and all of it when this one's parent dies.

    Processes it forks get their own parent-death signal. Those it spawns (fork + exec:
    megatron's checkpoint save starts a multiprocessing Manager with the ``spawn``
    context) cannot be armed so; they share this process's group, which the local backend
    starts in a session of its own. So where this process leads its group, the kernel's
    SIGKILL at its parent's death (:func:`parent_death_hook`) is replaced by a thread that
    sees the parent gone within ``poll_s`` and SIGKILLs the whole group; elsewhere (an srun
    task) the parent-death signal stays as it is."""
    global _armed_forks
    prctl = _prctl()
    if prctl is None or _armed_forks:
        return
    _armed_forks = True
    me, parent = os.getpid(), os.getppid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != me:
            os._exit(70)

    os.register_at_fork(after_in_child=arm)
    if os.getpgrp() != me or parent == 1:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.killpg(me, signal.SIGKILL)  # this process, and every one of its group

    threading.Thread(target=watch, name="lifeline", daemon=True).start()
    prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)  # the thread takes the group down instead
    if os.getppid() != parent:  # gone meanwhile
        os.killpg(me, signal.SIGKILL)
