"""Environment variables through which a launched worker finds its job, place and channel.

The backend sets the ones that describe the worker (vrank, generation, device); the
coordinator's channel supplies the ones that reach it (:meth:`CoordinatorChannel.worker_env`)
and the coordinator the job's (first layout, devices per node, timeouts; the run's recovery
settings: :class:`~slurm_etc.protocol.recovery.Recovery`). Every name is here, and a worker
reads them back in one place (:meth:`WorkerEnv.of`). Values are names, numbers, addresses
and paths only: the job's secret never travels in the environment (or argv), only the path
of its owner-only file.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from slurm_etc.plan.errors import ConfigError

JOB: Final = "SLURM_ETC_JOB"
VRANK: Final = "SLURM_ETC_VRANK"
GENERATION: Final = "SLURM_ETC_GENERATION"
COORDINATOR: Final = "SLURM_ETC_COORDINATOR"
SECRET_FILE: Final = "SLURM_ETC_SECRET_FILE"
NODE: Final = "SLURM_ETC_NODE"
LOCAL_INDEX: Final = "SLURM_ETC_LOCAL_INDEX"
DEVICE: Final = "SLURM_ETC_DEVICE"
LAYOUT: Final = "SLURM_ETC_LAYOUT"  # "dp=2,tp=1,pp=1,dist-opt@0-1" (config@vrank runs)
GPUS_PER_NODE: Final = "SLURM_ETC_GPUS_PER_NODE"
TIMEOUT: Final = "SLURM_ETC_TIMEOUT_S"
# How long a worker that hears nothing from its coordinator waits for it (a reattach)
# before it exits; it holds (trains no step) after HOLD_AFTER_S of silence.
REATTACH_WAIT: Final = "SLURM_ETC_REATTACH_WAIT_S"
THREADS: Final = "OMP_NUM_THREADS"

DEFAULT_TIMEOUT_S: Final = 300.0
DEFAULT_REATTACH_WAIT_S: Final = 120.0


@dataclass(frozen=True)
class WorkerEnv:
    """What a launched worker reads from its environment (see the module doc).

    Attributes:
        job, vrank, generation: who it is (the generation it was launched for).
        layout: the first layout (``config@vranks``) where it is part of it; None for a
            process that joins with a resize.
        gpus_per_node: devices per node of the job's cluster.
        timeout_s: the bound of its collectives and store requests.
        reattach_wait_s: how long it waits for a silent coordinator before it exits.
    """

    job: str
    vrank: int
    generation: int = 0
    layout: str | None = None
    gpus_per_node: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    reattach_wait_s: float = DEFAULT_REATTACH_WAIT_S

    @classmethod
    def of(cls, environ: Mapping[str, str]) -> WorkerEnv:
        """Read ``environ``; ConfigError names the variable and its value when one is
        missing or malformed."""
        if not environ.get(JOB) or not environ.get(VRANK):
            missing = ", ".join(n for n in (JOB, VRANK) if not environ.get(n))
            raise ConfigError(f"not launched as a slurm-etc worker: {missing} not set")

        def number(name: str, kind: type[int] | type[float], default: float) -> float:
            text = environ.get(name, "")
            if not text.strip():
                return default
            try:
                value = kind(text)
            except ValueError:
                raise ConfigError(f"{name}={text!r}: expected a number") from None
            if value < 0:
                raise ConfigError(f"{name}={text!r}: expected a number >= 0")
            return value

        return cls(job=environ[JOB], vrank=int(number(VRANK, int, 0)),
                   generation=int(number(GENERATION, int, 0)),
                   layout=environ.get(LAYOUT) or None,
                   gpus_per_node=max(1, int(number(GPUS_PER_NODE, int, 1))),
                   timeout_s=number(TIMEOUT, float, DEFAULT_TIMEOUT_S),
                   reattach_wait_s=number(REATTACH_WAIT, float, DEFAULT_REATTACH_WAIT_S)
                   or DEFAULT_REATTACH_WAIT_S)


def thread_share(environ: Mapping[str, str], cores: int, workers: int) -> dict[str, str]:
    """The worker's ``OMP_NUM_THREADS``: its share of the node's cores (torchrun's
    convention: ``cores // workers`` on that node, at least 1), or nothing where the user set
    it in ``environ`` (the coordinator's environment, which reaches the worker as it is).
    Without it every CPU worker starts a thread per core and the node is oversubscribed
    (a 36-step CPU job took 4 min 15 s instead of 24 s)."""
    if environ.get(THREADS, "").strip():
        return {}
    return {THREADS: str(max(1, cores // max(1, workers)))}


def node_cores(environ: Mapping[str, str]) -> int:
    """The cores this process may use: Slurm's count for the allocation on this node where
    it says one, else the scheduler affinity (a cgroup or taskset limit), else all."""
    try:
        return max(1, int(environ.get("SLURM_CPUS_ON_NODE", "")))
    except ValueError:
        pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
