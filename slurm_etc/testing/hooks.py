"""The switches the tests (and ``slurm-etc demo --inject``) set in a process's
environment, read into the runtime's hooks.

* ``SLURM_ETC_INJECT=<phase>[@<vrank>[,<generation>]]``: a worker SIGKILLs itself at that
  phase of a resize (:class:`~slurm_etc.migrate.faults.KillSpec`); several, separated by
  ``;``, are armed together (``slurm-etc soak``).
* ``SLURM_ETC_PLANT_STALE_COPIES=1``: a worker's peer copies are a step stale (a planted
  bug the node-loss oracle must catch).
* ``SLURM_ETC_PLANT_CORRUPT_COPIES=1``: a byte of each shard of every peer copy a worker
  keeps changes after its fingerprint was taken (the rebuilt-state check must stop the job).
* ``SLURM_ETC_COORDINATOR_INJECT=<point>``: the coordinator SIGKILLs itself the first time
  it reaches ``point`` (one of :data:`~slurm_etc.coordinator.loop.KILL_POINTS`).
"""
from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from slurm_etc.migrate.faults import KillSpec

if TYPE_CHECKING:
    from slurm_etc.worker.trainer import TrainerHooks

logger = logging.getLogger(__name__)

INJECT_ENV = "SLURM_ETC_INJECT"
STALE_COPIES_ENV = "SLURM_ETC_PLANT_STALE_COPIES"
CORRUPT_COPIES_ENV = "SLURM_ETC_PLANT_CORRUPT_COPIES"
COORDINATOR_INJECT = "SLURM_ETC_COORDINATOR_INJECT"


def kill_spec_from_env(environ: Mapping[str, str] | None = None) -> KillSpec | None:
    """The worker's ``SLURM_ETC_INJECT``, parsed (None when unset or empty)."""
    text = (os.environ if environ is None else environ).get(INJECT_ENV, "")
    return KillSpec.parse_many(text) if text.strip() else None


def trainer_hooks_from_env(environ: Mapping[str, str] | None = None) -> TrainerHooks:
    """The trainer hooks the environment asks for (the defaults where it asks nothing)."""
    from slurm_etc.worker.trainer import TrainerHooks  # torch: not at import

    env = os.environ if environ is None else environ
    return TrainerHooks(kill=kill_spec_from_env(env),
                        stale_peer_copies=bool(env.get(STALE_COPIES_ENV)),
                        corrupt_peer_copies=bool(env.get(CORRUPT_COPIES_ENV)))


def coordinator_crash_from_env(environ: Mapping[str, str] | None = None
                               ) -> Callable[[str], None] | None:
    """The coordinator's crash hook ``SLURM_ETC_COORDINATOR_INJECT`` asks for: SIGKILL this
    process at that point (None when unset)."""
    point = (os.environ if environ is None else environ).get(COORDINATOR_INJECT, "").strip()
    if not point:
        return None
    from slurm_etc.coordinator.loop import KILL_POINTS, VOTE_KILL_POINTS

    if point not in KILL_POINTS + VOTE_KILL_POINTS:
        raise ValueError(f"{COORDINATOR_INJECT}={point!r}: not a kill point; one of "
                         f"{', '.join(KILL_POINTS + VOTE_KILL_POINTS)}")

    def crash(reached: str) -> None:
        if reached == point:
            logger.error("%s=%s: killing the coordinator", COORDINATOR_INJECT, point)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
    return crash
