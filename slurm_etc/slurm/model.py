"""What the Slurm adapter talks about: our job and node states, job and node snapshots, the
description of a batch job and of a step, and the one error type.

Slurm's own state names are mapped to our enums by tables (:data:`SLURM_JOB_STATES`,
:data:`SLURM_NODE_STATES`); the raw name is kept beside the mapped state.
"""
from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from ..errors import InputError, InternalError


class SlurmError(InternalError, RuntimeError):
    """A Slurm command failed: one line naming the command, its exit code and its stderr."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str, stdout: str = "",
                 what: str | None = None):
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.stdout = stdout
        self.timed_out = what is not None and what.startswith("timed out")
        cmd = " ".join(self.argv)
        detail = " | ".join(line.strip() for line in stderr.strip().splitlines() if line.strip())
        if what is None:
            what = f"exit {returncode}"
        super().__init__(f"`{cmd}` failed ({what}): {detail or '(no stderr)'}")


class SlurmSpecError(InputError, ValueError):
    """A job or step description that cannot become a valid command, with the fix."""


class SlurmJobState(enum.Enum):
    """Job states as slurm-etc reasons about them (Slurm's names map here by a table)."""

    PENDING = "pending"
    STARTING = "starting"  # resources allocated, nodes being configured
    RUNNING = "running"
    SUSPENDED = "suspended"
    ENDING = "ending"  # completing, signaling, staging out: resources about to go
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    PREEMPTED = "preempted"
    REQUEUED = "requeued"  # requeued, will be pending again
    NODE_FAIL = "node_fail"
    UNKNOWN = "unknown"

    @property
    def holds_resources(self) -> bool:
        """The job has (or is about to have) nodes allocated."""
        return self in (SlurmJobState.STARTING, SlurmJobState.RUNNING, SlurmJobState.SUSPENDED,
                        SlurmJobState.ENDING)

    @property
    def finished(self) -> bool:
        """The job ended for good (no requeue pending)."""
        return self in (SlurmJobState.COMPLETED, SlurmJobState.FAILED, SlurmJobState.CANCELLED,
                        SlurmJobState.TIMEOUT, SlurmJobState.PREEMPTED, SlurmJobState.NODE_FAIL)


# Slurm's base job states (squeue %T / -O State, scontrol JobState=, sacct State) -> ours.
SLURM_JOB_STATES: Mapping[str, SlurmJobState] = {
    "PENDING": SlurmJobState.PENDING,
    "RESV_DEL_HOLD": SlurmJobState.PENDING,
    "CONFIGURING": SlurmJobState.STARTING,
    "RUNNING": SlurmJobState.RUNNING,
    "RESIZING": SlurmJobState.RUNNING,
    "SUSPENDED": SlurmJobState.SUSPENDED,
    "STOPPED": SlurmJobState.SUSPENDED,
    "COMPLETING": SlurmJobState.ENDING,
    "SIGNALING": SlurmJobState.ENDING,
    "STAGE_OUT": SlurmJobState.ENDING,
    "COMPLETED": SlurmJobState.COMPLETED,
    "FAILED": SlurmJobState.FAILED,
    "OUT_OF_MEMORY": SlurmJobState.FAILED,
    "SPECIAL_EXIT": SlurmJobState.FAILED,
    "CANCELLED": SlurmJobState.CANCELLED,
    "REVOKED": SlurmJobState.CANCELLED,
    "TIMEOUT": SlurmJobState.TIMEOUT,
    "DEADLINE": SlurmJobState.TIMEOUT,
    "PREEMPTED": SlurmJobState.PREEMPTED,
    "REQUEUED": SlurmJobState.REQUEUED,
    "REQUEUE_FED": SlurmJobState.REQUEUED,
    "REQUEUE_HOLD": SlurmJobState.REQUEUED,
    "NODE_FAIL": SlurmJobState.NODE_FAIL,
    "BOOT_FAIL": SlurmJobState.NODE_FAIL,
}

# squeue's compact codes (%t) -> Slurm's long names.
SLURM_JOB_STATE_CODES: Mapping[str, str] = {
    "PD": "PENDING", "CF": "CONFIGURING", "R": "RUNNING", "RS": "RESIZING", "S": "SUSPENDED",
    "ST": "STOPPED", "CG": "COMPLETING", "SI": "SIGNALING", "SO": "STAGE_OUT",
    "CD": "COMPLETED", "F": "FAILED", "OOM": "OUT_OF_MEMORY", "SE": "SPECIAL_EXIT",
    "CA": "CANCELLED", "RV": "REVOKED", "TO": "TIMEOUT", "DL": "DEADLINE", "PR": "PREEMPTED",
    "RQ": "REQUEUED", "RF": "REQUEUE_FED", "RH": "REQUEUE_HOLD", "NF": "NODE_FAIL",
    "BF": "BOOT_FAIL", "RD": "RESV_DEL_HOLD",
}


def job_state(raw: str) -> SlurmJobState:
    """Our state for Slurm's job state text (long name, compact code, ``CANCELLED by 0``)."""
    word = raw.strip().split(" ", 1)[0].split("+", 1)[0].upper()
    word = SLURM_JOB_STATE_CODES.get(word, word)
    return SLURM_JOB_STATES.get(word, SlurmJobState.UNKNOWN)


class NodeState(enum.Enum):
    """Node states as slurm-etc reasons about them."""

    IDLE = "idle"
    MIXED = "mixed"  # partly allocated
    ALLOCATED = "allocated"
    COMPLETING = "completing"
    DRAINING = "draining"  # drained once its jobs end
    DRAINED = "drained"
    DOWN = "down"
    FAIL = "fail"
    RESERVED = "reserved"
    MAINT = "maint"
    POWERED_DOWN = "powered_down"
    FUTURE = "future"
    UNKNOWN = "unknown"

    @property
    def schedulable(self) -> bool:
        """New jobs may start on the node."""
        return self in (NodeState.IDLE, NodeState.MIXED, NodeState.ALLOCATED,
                        NodeState.COMPLETING, NodeState.RESERVED)


# sinfo's long state names (%T / -O StateLong), without their flag suffix -> ours.
SLURM_NODE_STATES: Mapping[str, NodeState] = {
    "idle": NodeState.IDLE,
    "mixed": NodeState.MIXED,
    "allocated": NodeState.ALLOCATED,
    "completing": NodeState.COMPLETING,
    "draining": NodeState.DRAINING,
    "drng": NodeState.DRAINING,
    "drained": NodeState.DRAINED,
    "down": NodeState.DOWN,
    "fail": NodeState.FAIL,
    "failing": NodeState.FAIL,
    "reserved": NodeState.RESERVED,
    "maint": NodeState.MAINT,
    "powered_down": NodeState.POWERED_DOWN,
    "powering_down": NodeState.POWERED_DOWN,
    "power_down": NodeState.POWERED_DOWN,
    "powering_up": NodeState.POWERED_DOWN,
    "future": NodeState.FUTURE,
    "planned": NodeState.IDLE,  # 23.02+: idle, planned for a pending job
    "blocked": NodeState.RESERVED,
    "inval": NodeState.UNKNOWN,
    "unknown": NodeState.UNKNOWN,
}

# Flag characters sinfo appends to a state: * not responding, ~ powered off, # powering up,
# ! pending power down, % powering down, $ maintenance reservation, @ pending reboot,
# ^ reboot issued, - planned.
NODE_STATE_FLAGS = "*~#!%$@^-"


def node_state(raw: str) -> tuple[NodeState, bool]:
    """Our state and whether the node responds, for sinfo's state text (``down*``, ``idle~``,
    ``idle+drain``)."""
    text = raw.strip().lower()
    responding = "*" not in text and "not_responding" not in text
    base, *flags = [part.rstrip(NODE_STATE_FLAGS) for part in text.split("+")]
    state = SLURM_NODE_STATES.get(base, NodeState.UNKNOWN)
    if "drain" in flags and state not in (NodeState.DOWN, NodeState.FAIL):
        state = NodeState.DRAINED if state == NodeState.IDLE else NodeState.DRAINING
    return state, responding


class NodeAdminState(enum.Enum):
    """States an administrator (or slurm-etc's fault injection) sets on a node."""

    DOWN = "DOWN"
    DRAIN = "DRAIN"
    RESUME = "RESUME"
    UNDRAIN = "UNDRAIN"

    @property
    def needs_reason(self) -> bool:
        return self in (NodeAdminState.DOWN, NodeAdminState.DRAIN)


@dataclass(frozen=True)
class JobInfo:
    """One job as Slurm reports it (squeue or scontrol)."""

    job_id: str
    state: SlurmJobState
    slurm_state: str
    name: str = ""
    partition: str = ""
    num_nodes: int = 0
    nodelist: str = ""  # Slurm's compressed form, e.g. "n[1-2]"; "" while pending
    nodes: tuple[str, ...] = ()  # expanded
    reason: str | None = None  # None when Slurm says "None"
    batch_host: str | None = None
    preempt_time: datetime | None = None  # set once the job is picked for preemption
    restarts: int | None = None  # requeues so far (scontrol only)
    user: str = ""
    fields: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class NodeInfo:
    """One node as sinfo reports it (its partitions merged)."""

    name: str
    state: NodeState
    slurm_state: str
    responding: bool
    cpus: int = 0
    gres: str = ""
    gpus: int = 0
    gpus_used: int = 0
    partitions: tuple[str, ...] = ()
    reason: str | None = None

    @property
    def usable(self) -> bool:
        """Schedulable and responding."""
        return self.state.schedulable and self.responding


@dataclass(frozen=True)
class PartitionInfo:
    """One partition as ``scontrol show partition`` reports it.

    ``grace_time`` is the seconds between a job being picked for preemption (its signal,
    where the site sets ``preempt_send_user_signal``) and its end (0: none)."""

    name: str
    grace_time: int = 0
    preempt_mode: str = ""
    priority_tier: int = 0
    max_nodes: int | None = None  # None: UNLIMITED
    fields: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)


_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def check_signal(sig: str) -> str:
    """A signal name or number as Slurm takes it: ``USR2``, ``SIGUSR2``, ``12``."""
    s = sig.upper()
    if not re.fullmatch(r"(?:SIG)?[A-Z0-9]+", s):
        raise SlurmSpecError(f"signal {sig!r} is not a signal name or number (e.g. USR2, 12)")
    return s.removeprefix("SIG")


@dataclass(frozen=True)
class BatchSpec:
    """A batch job to submit with sbatch.

    Args:
        script: the batch script's text (``#!`` line first); sbatch reads it from stdin.
        signal: ``SIG@SECONDS`` sent before the time limit, and at preemption when the site
            sets ``preempt_send_user_signal``; with ``signal_batch_only`` it goes to the batch
            shell only (``B:``), otherwise to every step but not the batch shell.
        gpus_per_node: becomes ``--gres=gpu:N`` (accepted by every Slurm release).
        extra: further sbatch options, passed as they are.
    """

    script: str
    name: str | None = None
    partition: str | None = None
    nodes: int | None = None
    ntasks_per_node: int | None = None
    cpus_per_task: int | None = None
    gpus_per_node: int | None = None
    exclusive: bool = False
    nodelist: Sequence[str] = ()
    exclude: Sequence[str] = ()
    time_limit: str | None = None
    signal: str | None = None
    signal_batch_only: bool = False
    requeue: bool | None = None
    output: str | None = None
    error: str | None = None
    workdir: str | None = None
    account: str | None = None
    qos: str | None = None
    dependency: str | None = None
    hold: bool = False
    extra: Sequence[str] = ()

    def __post_init__(self):
        if not self.script.startswith("#!"):
            raise SlurmSpecError("script must start with a #! line (sbatch refuses others)")
        for attr in ("nodes", "ntasks_per_node", "cpus_per_task"):
            value = getattr(self, attr)
            if value is not None and value < 1:
                raise SlurmSpecError(f"{attr} ({value}) must be at least 1")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise SlurmSpecError(f"gpus_per_node ({self.gpus_per_node}) must be >= 0")
        if self.signal is not None:
            sig, _, secs = self.signal.partition("@")
            check_signal(sig)
            if secs and not secs.isdigit():
                raise SlurmSpecError(f"signal {self.signal!r}: the time after @ must be whole "
                                     "seconds, e.g. USR2@60")
        elif self.signal_batch_only:
            raise SlurmSpecError("signal_batch_only needs signal (e.g. signal='USR2@60')")
        if self.name is not None and not _NAME.match(self.name):
            raise SlurmSpecError(f"job name {self.name!r}: use letters, digits, '_', '.', '-'")
        if isinstance(self.nodelist, str) or isinstance(self.exclude, str):
            raise SlurmSpecError("nodelist and exclude are sequences of node names")


@dataclass(frozen=True)
class StepSpec:
    """A job step to launch with ``srun --jobid`` into an existing allocation."""

    job_id: str
    argv: Sequence[str]
    nodes: int | None = None
    ntasks: int | None = None
    ntasks_per_node: int | None = None
    nodelist: Sequence[str] = ()
    gpus_per_task: int | None = None
    cpus_per_task: int | None = None
    overlap: bool = False  # run beside other steps (else a second step waits silently)
    label: bool = False
    output: str | None = None
    error: str | None = None
    signal: str | None = None
    kill_on_bad_exit: bool = False
    extra: Sequence[str] = ()

    def __post_init__(self):
        if not self.argv:
            raise SlurmSpecError("a step needs a command (argv is empty)")
        if isinstance(self.argv, str):
            raise SlurmSpecError("argv is a sequence of arguments, not one string")
        for attr in ("nodes", "ntasks", "ntasks_per_node", "gpus_per_task", "cpus_per_task"):
            value = getattr(self, attr)
            if value is not None and value < 1:
                raise SlurmSpecError(f"{attr} ({value}) must be at least 1")
        if self.nodelist and self.nodes is not None and len(self.nodelist) > self.nodes:
            raise SlurmSpecError(f"nodelist names {len(self.nodelist)} nodes but nodes is "
                                 f"{self.nodes}")


@dataclass(frozen=True)
class Command:
    """A command line and what to feed its stdin."""

    argv: tuple[str, ...]
    stdin: str | None = None
    cwd: str | None = None

    def __str__(self) -> str:
        return " ".join(self.argv)
