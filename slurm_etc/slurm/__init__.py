"""Slurm adapter and the Slurm backend (:mod:`.backend`, beside the local one in
:mod:`slurm_etc.local`; :mod:`.member` and :mod:`.task` are the scripts it submits and runs).
Pure command builders (:mod:`.commands`), pure parsers (:mod:`.parsers`),
one runner (:mod:`.runner`) and the :class:`SlurmClient` protocol with its command-line
implementation (:mod:`.client`). Slurm states map to :class:`SlurmJobState`/:class:`NodeState`
by tables in :mod:`.model`.

Works with Slurm 22.05 (Debian 12) and 24.11 (Debian 13). There is no pyslurm-backed client:
no pyslurm release matching these Slurm versions installs from PyPI (see :mod:`.client`).
"""
from .client import CliSlurmClient, SlurmClient
from .model import (
    BatchSpec,
    Command,
    JobInfo,
    NodeAdminState,
    NodeInfo,
    NodeState,
    PartitionInfo,
    SlurmError,
    SlurmJobState,
    SlurmSpecError,
    StepSpec,
)
from .runner import Result, SlurmRunner

__all__ = [
    "CliSlurmClient", "Command", "JobInfo", "BatchSpec", "SlurmJobState", "NodeAdminState",
    "NodeInfo",
    "NodeState", "PartitionInfo", "Result", "SlurmClient", "SlurmError", "SlurmRunner",
    "SlurmSpecError", "StepSpec",
]
