"""Environment variables through which a launched worker finds its job, place and channel.

The backend sets the ones that describe the worker (vrank, generation, device); the
coordinator's channel supplies the ones that reach it (:meth:`CoordinatorChannel.worker_env`).
Values are names, numbers, addresses and paths only: the job's secret never travels in the
environment (or argv), only the path of its owner-only file.
"""
from __future__ import annotations

from typing import Final

JOB: Final = "SLURM_ETC_JOB"
VRANK: Final = "SLURM_ETC_VRANK"
GENERATION: Final = "SLURM_ETC_GENERATION"
COORDINATOR: Final = "SLURM_ETC_COORDINATOR"
SECRET_FILE: Final = "SLURM_ETC_SECRET_FILE"
NODE: Final = "SLURM_ETC_NODE"
LOCAL_INDEX: Final = "SLURM_ETC_LOCAL_INDEX"
DEVICE: Final = "SLURM_ETC_DEVICE"
