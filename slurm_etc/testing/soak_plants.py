"""Planted bugs in what ``slurm-etc soak`` observed (:class:`slurm_etc.harness.soak.
Observed`), one per check of :mod:`slurm_etc.harness.soak_checks`: each shows its check
catches a job that went wrong that way (tests/unit/test_soak.py on made-up records,
tests/dist/test_soak.py on a real soak's).

Nothing in the runtime imports this module.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

from slurm_etc.harness.soak_checks import RecordSeen, trained


def _restart(record: RecordSeen, shift: int) -> RecordSeen:
    """The second generation that trained starts ``shift`` steps after the first one's last
    step (its state at that step + ``shift`` - 1), and no lost steps are recorded into it."""
    ran = trained(record)
    if len(ran) < 2:
        raise ValueError("the record has one generation that trained: nothing to plant")
    before, g = ran[0], ran[1]
    at = int(before.last_step or 0) + shift - 1
    gens = tuple(replace(x, first_step=at) if x is g else x for x in record.generations)
    migs = tuple(replace(m, lost_steps=None) if m.to_generation == g.number else m
                 for m in record.migrations)
    return replace(record, generations=gens, migrations=migs)


def step_twice(record: RecordSeen) -> RecordSeen:
    """The second generation that trained starts at the first one's last step again, with
    no lost steps recorded: that step is trained twice, unrecorded."""
    return _restart(record, 0)


def step_skipped(record: RecordSeen) -> RecordSeen:
    """The second generation that trained starts a step after the first one's next: a step
    never trained."""
    return _restart(record, 2)


def loss_off_by_one_ulp(heard: list[tuple[int, float]], step: int | None = None
                        ) -> list[tuple[int, float]]:
    """The last heard loss of ``step`` (default: the last step) one ulp up."""
    if not heard:
        raise ValueError("no loss heard: nothing to plant")
    target = heard[-1][0] if step is None else step
    i = max(i for i, (s, _x) in enumerate(heard) if s == target)
    out = list(heard)
    out[i] = (target, math.nextafter(heard[i][1], math.inf))
    return out


def migration_left_open(record: RecordSeen) -> RecordSeen:
    """The last migration's outcome never written (neither committed nor aborted)."""
    if not record.migrations:
        raise ValueError("the record has no migration: nothing to plant")
    *rest, last = record.migrations
    return replace(record, migrations=(*rest, replace(last, outcome=None)))


def lease_kept(record: RecordSeen) -> RecordSeen:
    """The job's lease still held after the job ended."""
    return replace(record, lease_released=False)


def leftover_process(job: str, mark: str) -> subprocess.Popen[Any]:
    """A process of the job that outlived it (a sleeping child carrying the job's mark);
    the caller kills it."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            env={**os.environ, mark: job}, start_new_session=True)
