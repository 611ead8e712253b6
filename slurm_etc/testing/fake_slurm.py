"""An in-memory :class:`~slurm_etc.slurm.client.SlurmClient` that behaves, for unit tests.

Jobs and nodes live in dictionaries; the test moves them (:meth:`FakeSlurmClient.start`,
:meth:`~FakeSlurmClient.preempt`, :meth:`~FakeSlurmClient.end`, :meth:`~FakeSlurmClient.
set_node_state`) and the code under test sees them through the same protocol as the real
client: ``jobs``/``job`` answer like squeue/scontrol (unknown ids are skipped / None),
``cancel`` of a finished job is no error, ``resize`` keeps a job's first nodes, and every
call is recorded in :attr:`FakeSlurmClient.calls`. Set :attr:`FakeSlurmClient.fail` to make
the next calls raise :class:`SlurmError` (a slurmctld that does not answer).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from slurm_etc.slurm import commands
from slurm_etc.slurm.model import (
    BatchSpec,
    JobInfo,
    NodeAdminState,
    NodeInfo,
    NodeState,
    PartitionInfo,
    SlurmError,
    SlurmJobState,
)


class FakeSlurmClient:
    """Slurm in memory: ``nodes`` names with ``gpus`` GPUs each, all in ``partitions``."""

    def __init__(self, nodes: Sequence[str] = ("n1", "n2", "n3", "n4"), gpus: int = 2,
                 partitions: Sequence[str] = ("main", "scavenge", "high"),
                 grace_time: int = 30) -> None:
        self.gpus = gpus
        self.grace_time = grace_time
        self._partitions = tuple(partitions)
        self._nodes = {n: NodeInfo(n, NodeState.IDLE, "idle", True, cpus=8, gres=f"gpu:{gpus}",
                                   gpus=gpus, partitions=self._partitions) for n in nodes}
        self._jobs: dict[str, JobInfo] = {}
        self._next = 100
        self.specs: dict[str, BatchSpec] = {}
        self.calls: list[tuple[str, ...]] = []
        self.fail: str | None = None

    # -- the test's side ------------------------------------------------------------------
    def add_job(self, name: str = "job", partition: str = "main", nodes: Sequence[str] = (),
                gpus_per_node: int | None = None) -> str:
        """A job already running (e.g. the anchor)."""
        job_id = self._new_id()
        fields = {"TresPerNode": f"gres:gpu:{gpus_per_node}"} if gpus_per_node else {}
        self._jobs[job_id] = JobInfo(job_id, SlurmJobState.RUNNING, "RUNNING", name=name,
                                     partition=partition, num_nodes=len(nodes),
                                     nodelist=",".join(nodes), nodes=tuple(nodes),
                                     fields=fields)
        return job_id

    def start(self, job_id: str, nodes: Sequence[str]) -> None:
        self._set(job_id, state=SlurmJobState.RUNNING, slurm_state="RUNNING", nodes=tuple(nodes),
                  nodelist=",".join(nodes), num_nodes=len(nodes))

    def preempt(self, job_id: str, when: datetime | None = None) -> None:
        """Picked for preemption: still RUNNING, with a preempt time (the grace runs)."""
        self._set(job_id, preempt_time=when or datetime.now())

    def end(self, job_id: str, slurm_state: str = "PREEMPTED") -> None:
        from slurm_etc.slurm.model import job_state

        self._set(job_id, state=job_state(slurm_state), slurm_state=slurm_state)

    def set_state(self, node: str, state: NodeState, raw: str, reason: str | None = None
                  ) -> None:
        self._nodes[node] = replace(self._nodes[node], state=state, slurm_state=raw,
                                    reason=reason)

    # -- SlurmClient ------------------------------------------------------------------------
    def submit(self, spec: BatchSpec) -> str:
        cmd = commands.sbatch(spec)  # the real builder validates as sbatch would
        self._call("sbatch", *cmd.argv[2:])
        job_id = self._new_id()
        comment = next((a.split("=", 1)[1] for a in spec.extra if a.startswith("--comment=")),
                       "")
        self._jobs[job_id] = JobInfo(job_id, SlurmJobState.PENDING, "PENDING", name=spec.name or "",
                                     partition=spec.partition or self._partitions[0],
                                     num_nodes=spec.nodes or 1, reason="Resources",
                                     fields={"Comment": comment} if comment else {})
        self.specs[job_id] = spec
        return job_id

    def cancel(self, job_id: str) -> None:
        self._call("scancel", job_id)
        job = self._jobs.get(job_id)
        if job is not None and not job.state.finished:
            self._set(job_id, state=SlurmJobState.CANCELLED, slurm_state="CANCELLED")

    def jobs(self, job_ids: Sequence[str] = (), *, user: str | None = None,
             partition: str | None = None, name: str | None = None) -> list[JobInfo]:
        self._call("squeue", *job_ids, *([f"--name={name}"] if name else []))
        if job_ids:
            return [self._jobs[j] for j in job_ids if j in self._jobs]
        return [j for j in self._jobs.values() if not j.state.finished
                and (name is None or j.name == name)
                and (partition is None or j.partition == partition)]

    def job(self, job_id: str) -> JobInfo | None:
        self._call("scontrol-show-job", job_id)
        return self._jobs.get(job_id)

    def nodes(self, names: Sequence[str] = ()) -> list[NodeInfo]:
        self._call("sinfo", *names)
        return [n for name, n in self._nodes.items() if not names or name in names]

    def partition(self, name: str) -> PartitionInfo:
        self._call("scontrol-show-partition", name)
        if name not in self._partitions:
            raise SlurmError(("scontrol", "show", "partition", name), 1,
                             f"Partition {name} not found")
        return PartitionInfo(name, grace_time=self.grace_time if name == "scavenge" else 0)

    def signal(self, job_id: str, signal: str, *, batch: bool = False,
               full: bool = False) -> None:
        self._call("scancel-signal", job_id, signal)

    def resize(self, job_id: str, num_nodes: int) -> None:
        self._call("scontrol-resize", job_id, str(num_nodes))
        job = self._jobs[job_id]
        keep = job.nodes[:num_nodes]
        self._set(job_id, nodes=keep, nodelist=",".join(keep), num_nodes=len(keep))

    def set_node_state(self, nodes: Sequence[str], state: NodeAdminState,
                       reason: str | None = None) -> None:
        self._call("scontrol-node", *nodes, state.value)
        for n in nodes:
            if state is NodeAdminState.DOWN:
                self.set_state(n, NodeState.DOWN, "down", reason)
            elif state is NodeAdminState.DRAIN:
                self.set_state(n, NodeState.DRAINED, "drained", reason)
            else:
                self.set_state(n, NodeState.IDLE, "idle")

    # -- internals ----------------------------------------------------------------------------
    def _new_id(self) -> str:
        self._next += 1
        return str(self._next)

    def _set(self, job_id: str, **changes: object) -> None:
        self._jobs[job_id] = replace(self._jobs[job_id], **changes)  # type: ignore[arg-type]

    def _call(self, *argv: str) -> None:
        if self.fail:
            raise SlurmError(argv, 1, self.fail)
        self.calls.append(argv)
