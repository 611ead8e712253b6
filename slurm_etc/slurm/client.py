"""The operations the elastic backend needs from Slurm, behind one protocol.

:class:`CliSlurmClient` implements :class:`SlurmClient` with Slurm's command-line tools
(command builders in :mod:`.commands`, parsers in :mod:`.parsers`, one :class:`.SlurmRunner`).

No pyslurm implementation: PyPI has pyslurm only for Slurm 25.11 (and very old releases);
none builds against the 22.05 (Debian 12) or 24.11 (Debian 13) libslurm, and pyslurm cannot
change a job's node count anyway (``modify(nodes=..)`` is ignored), so resizing would go
through scontrol regardless. A pyslurm-backed client can implement this protocol later where
a matching pyslurm is installed.
"""
from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from . import commands, parsers
from .model import BatchSpec, JobInfo, NodeAdminState, NodeInfo, PartitionInfo, SlurmError
from .runner import SlurmRunner


@runtime_checkable
class SlurmClient(Protocol):
    """What slurm-etc asks of Slurm. Job ids are strings (``12``, ``12_3`` for arrays)."""

    def submit(self, spec: BatchSpec) -> str:
        """Submit a batch job; returns its id."""
        ...

    def cancel(self, job_id: str) -> None:
        """Cancel a job (no error if it already ended)."""
        ...

    def jobs(self, job_ids: Sequence[str] = (), *, user: str | None = None,
             partition: str | None = None, name: str | None = None) -> list[JobInfo]:
        """Jobs by id (any state, until Slurm forgets them), or the pending/running ones of a
        user/partition/name. Cheap: suitable for polling."""
        ...

    def job(self, job_id: str) -> JobInfo | None:
        """Every detail of one job (restarts, preempt time, batch host); None if unknown."""
        ...

    def nodes(self, names: Sequence[str] = ()) -> list[NodeInfo]:
        """Nodes (all, or the named ones): state, GRES, reason, partitions."""
        ...

    def partition(self, name: str) -> PartitionInfo:
        """One partition's settings (GraceTime, PreemptMode...)."""
        ...

    def signal(self, job_id: str, signal: str, *, batch: bool = False,
               full: bool = False) -> None:
        """Send a signal to a job's steps; ``batch``: only its batch shell; ``full``: both."""
        ...

    def resize(self, job_id: str, num_nodes: int) -> None:
        """Shrink a running job to ``num_nodes`` (tasks on released nodes are killed)."""
        ...

    def set_node_state(self, nodes: Sequence[str], state: NodeAdminState,
                       reason: str | None = None) -> None:
        """DOWN/DRAIN (with a reason) or RESUME/UNDRAIN nodes (administrator rights)."""
        ...


class CliSlurmClient:
    """:class:`SlurmClient` over sbatch, squeue, scontrol, scancel and sinfo.

    Args:
        runner: runs the commands (its environment picks the cluster via SLURM_CONF).
        workdir: where ``scontrol update NumNodes=`` runs; inside a job it writes
            ``slurm_job_<id>_resize.sh`` there. Default: a throw-away directory.
    """

    def __init__(self, runner: SlurmRunner | None = None, workdir: str | None = None):
        self.runner = runner or SlurmRunner()
        self.workdir = workdir

    def submit(self, spec: BatchSpec) -> str:
        return parsers.parse_sbatch(self.runner.run(commands.sbatch(spec)).stdout)

    def cancel(self, job_id: str) -> None:
        self.runner.run(commands.scancel(job_id))

    def jobs(self, job_ids: Sequence[str] = (), *, user: str | None = None,
             partition: str | None = None, name: str | None = None) -> list[JobInfo]:
        cmd = commands.squeue(job_ids, user=user, partition=partition, name=name)
        res = self.runner.run(cmd, check=False)
        if res.returncode != 0:
            # squeue -j with only unknown ids fails; with some known ones it lists those.
            if job_ids and parsers.is_unknown_job(res.stderr):
                return []
            raise SlurmError(cmd.argv, res.returncode, res.stderr, res.stdout)
        return parsers.parse_squeue(res.stdout)

    def job(self, job_id: str) -> JobInfo | None:
        cmd = commands.scontrol_show_job(job_id)
        res = self.runner.run(cmd, check=False)
        if res.returncode != 0:
            if parsers.is_unknown_job(res.stderr + res.stdout):
                return None
            raise SlurmError(cmd.argv, res.returncode, res.stderr, res.stdout)
        found = [j for j in parsers.parse_scontrol_jobs(res.stdout) if j.job_id == str(job_id)]
        return found[0] if found else None

    def nodes(self, names: Sequence[str] = ()) -> list[NodeInfo]:
        return parsers.parse_sinfo_nodes(self.runner.run(commands.sinfo_nodes(names)).stdout)

    def partition(self, name: str) -> PartitionInfo:
        cmd = commands.scontrol_show_partition(name)
        res = self.runner.run(cmd, check=False)
        info = parsers.parse_scontrol_partition(res.stdout) if res.returncode == 0 else None
        if info is None:
            # scontrol prints "Partition X not found" on stdout.
            raise SlurmError(cmd.argv, res.returncode, res.stderr or res.stdout, res.stdout)
        return info

    def signal(self, job_id: str, signal: str, *, batch: bool = False,
               full: bool = False) -> None:
        self.runner.run(commands.scancel_signal(job_id, signal, batch=batch, full=full))

    def resize(self, job_id: str, num_nodes: int) -> None:
        if self.workdir is not None:
            self.runner.run(commands.scontrol_resize(job_id, num_nodes, cwd=self.workdir))
            return
        with tempfile.TemporaryDirectory(prefix="slurm-etc-resize-") as tmp:
            self.runner.run(commands.scontrol_resize(job_id, num_nodes, cwd=tmp))

    def set_node_state(self, nodes: Sequence[str], state: NodeAdminState,
                       reason: str | None = None) -> None:
        self.runner.run(commands.scontrol_node_state(nodes, state, reason))
