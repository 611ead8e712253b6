"""Environment variables through which a launched worker finds its job, place and channel.

The backend sets the ones that describe the worker (vrank, generation, device); the
coordinator's channel supplies the ones that reach it (:meth:`CoordinatorChannel.worker_env`).
Values are names, numbers, addresses and paths only: the job's secret never travels in the
environment (or argv), only the path of its owner-only file.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

JOB: Final = "SLURM_ETC_JOB"
VRANK: Final = "SLURM_ETC_VRANK"
GENERATION: Final = "SLURM_ETC_GENERATION"
COORDINATOR: Final = "SLURM_ETC_COORDINATOR"
SECRET_FILE: Final = "SLURM_ETC_SECRET_FILE"
NODE: Final = "SLURM_ETC_NODE"
LOCAL_INDEX: Final = "SLURM_ETC_LOCAL_INDEX"
DEVICE: Final = "SLURM_ETC_DEVICE"
THREADS: Final = "OMP_NUM_THREADS"


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
