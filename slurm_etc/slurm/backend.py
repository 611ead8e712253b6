"""The Slurm backend: an anchor job plus member allocations, workers as ``srun`` steps.

It implements :class:`~slurm_etc.coordinator.backend.Backend`. The coordinator runs in the
anchor job's batch script (the policy's minimum, in a normal partition); this backend:

- **anchor**: reads its own allocation (``SLURM_JOB_ID``, its nodes from Slurm) and reports
  it as the first :class:`Grant` (allocation = the Slurm job id, devices = ``node:i`` for each
  GPU of each node; GPUs per node from the job's ``TresPerNode``, the node's GRES, or the
  constructor). The anchor is never released.
- **request** (:class:`RequestNodes`): submits a member allocation with sbatch
  (:func:`member_job_spec`): ``--exclusive`` whole nodes with ``--gres=gpu:<N>`` in the member
  partition/QOS, ``--signal=B:<SIG>@<lead>`` (default USR2: some NCCL versions catch
  SIGUSR1), ``--no-requeue`` (a preempted member is gone; the coordinator asks again with a
  new key when its policy wants nodes: a requeued member that came back by itself would be
  a grant nobody asked for), ``--comment=slurm-etc:<key>`` and the job name
  ``etc-<anchor>-member``, so that a restarted coordinator finds its members with squeue.
  A key seen before submits nothing. The member's batch script is
  ``python -m slurm_etc.slurm.member``: it waits and turns the notice signal (or SIGTERM)
  into a file in the run directory's ``notices/`` at once.
- **grants**: a member reaching RUNNING -> ``Grant(<member job id>, devices, request=key)``
  (its batch shell writes a start file into ``notices/``: Slurm is asked at once);
  a member ending before it ran (cancelled, failed, refused while PENDING) ->
  ``RequestFailed(key, <member job id>, <state>)``.
- **preemption**: a notice file (written within a second of the signal) ->
  :class:`PreemptNotice` with ``deadline = signal time + GraceTime - margin``; squeue's
  ``PreemptTime`` is the backup (same deadline from that time); a granted member leaving
  RUNNING -> :class:`Loss` (``preempted`` when noticed or preempted, else ``failure``).
  A SIGTERM file where the notice signal is another one is ambiguous (Slurm also sends
  SIGTERM to a job whose node went DOWN, or that it cancels): it counts as a notice only if
  the next squeue/sinfo query still shows the member running on nodes in service; else the
  loss comes alone.
- **losses**: a held node DOWN, DRAIN(ED/ING), FAIL or not responding; a member cancelled,
  timed out or failed; the anchor ending. ``srun`` exits 0 even when its step was killed:
  losses come from Slurm's state, worker exits from the task wrapper's report.
- **launch** (:class:`LaunchWorkers`): one step per (allocation, node) and launch:
  ``srun --jobid=<allocation> -N1 -w <node> --ntasks=<k> --overlap --input=all
  python -m slurm_etc.slurm.task <payload>`` (:func:`worker_step_spec`): a step spanning
  several nodes is killed on every node when one of them is lost, and one step per worker
  would cost one srun process per GPU on the coordinator's node. The task wrapper
  (:mod:`.task`) picks its worker by ``SLURM_LOCALID``, narrows ``CUDA_VISIBLE_DEVICES`` to
  the worker's GPU and reports start and exit on stdout. The coordinator's SLURM_* variables
  (the anchor's node list, GPUs, job name...) are removed from the step's environment
  (SLURM_CONF kept). srun's stdout is a file and its stdin a FIFO that srun itself holds
  open for writing too (``<run dir>/steps/gen<G>-<node>-<allocation>-v<first vrank>.out``
  and ``.in``), never pipes to this process: a coordinator that dies leaves its steps
  running, and one restarted on the job's record takes them up (:meth:`SlurmBackend.adopt`:
  the srun pid and start time from the record, the file read again, the FIFO opened again).
- **stop** (:class:`StopWorkers`): ``stop <vrank>`` on the step's stdin (srun broadcasts it
  to its tasks; the wrapper signals its worker with the stop signal), ``kill <vrank>`` after
  the grace, and ``scancel --signal=KILL <job>.<step>`` as the last resort. When is the
  :class:`~slurm_etc.coordinator.supervisor.WorkerSupervisor`'s, as for the local backend;
  this backend supplies the mechanism (its ``do_*`` methods).
- **release** (:class:`ReleaseDevices`): a whole member -> ``scancel``; whole nodes at the end
  of a member's node list -> ``scontrol update JobId=<member> NumNodes=<k>`` (Slurm keeps the
  first nodes); anything else stays allocated (idle) until the rest of that member is
  released: Slurm cannot free chosen GPUs of a node, nor (by NumNodes) chosen nodes.

Signals. The notice reaches the member's batch shell only (``B:``); without ``B:`` Slurm
would send it to every step, i.e. to the workers. Workers run with the notice signal
ignored (the wrapper sets SIG_IGN before it starts them; the worker entry point ignores
SIGUSR2 as well), so nothing dies on a notice before the migration committed. Where the site
has no ``preempt_send_user_signal``, Slurm sends SIGTERM to every process of the member
when the grace starts: configure ``notice_signal="TERM"``; the workers on members then run
with SIGTERM ignored, are stopped with SIGINT instead, and die by SIGKILL at the deadline.

Every Slurm command goes through the :class:`~slurm_etc.slurm.client.SlurmClient` with a
timeout; a failed action raises :class:`BackendError` with one line; a failed query in
:meth:`SlurmBackend.poll` is logged and retried, later and later while Slurm says it is busy
(rate limited, timed out, unreachable).

``poll`` reads the notice directory and the steps' output on every call and asks Slurm only
when the pure policy of :mod:`.cadence` says so: in steady state one full query every
``steady_poll_s`` (30 s: one squeue of all of the job's allocations by job id, one sinfo,
which also answers :meth:`SlurmBackend.usable_nodes`); a member under a preemption notice
every ``poll_interval_s`` (2 s); a pending member every 2 s at first, then less often the
longer it pends (every 30 s after two minutes), and at once when its batch shell writes its
start file (the grant); a full query at once when a worker is killed by a signal nobody here
sent or a member got SIGTERM. One allocation is asked with ``scontrol show job`` (two RPCs;
squeue of one job costs three). It blocks only for a Slurm query (bounded by the client's
timeout). What squeue and sinfo say is decided by the pure functions of :mod:`.observe`
(:func:`~.observe.observe_allocation`, :func:`~.observe.observe_nodes`); this class carries
their results out. A pending member's Reason is logged once per change, in words
(:func:`~.observe.pending_gloss`).
"""
from __future__ import annotations

import functools
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, TypeVar

from slurm_etc.alloc.topology import ClusterTopology, Device
from slurm_etc.coordinator.backend import (
    BackendDefaults,
    BackendError,
    BackendEvent,
    CancelRequest,
    Grant,
    LaunchWorkers,
    Loss,
    PreemptNotice,
    ReleaseDevices,
    RequestFailed,
    RequestNodes,
    StopWorkers,
    WorkerState,
)
from slurm_etc.coordinator.processes import AdoptedProcess, process_start
from slurm_etc.coordinator.supervisor import Supervised, WorkerSupervisor
from slurm_etc.protocol import env as envvars

from ..lifecycle import AllocationState
from . import cadence, commands, parsers, step_options
from .client import CliSlurmClient, SlurmClient
from .member import NOTICES, STARTED
from .model import (
    BatchSpec,
    JobInfo,
    NodeInfo,
    SlurmError,
    SlurmJobState,
    StepSpec,
    check_signal,
)
from .observe import (
    AllocationFacts,
    AllocationView,
    CancelAllocation,
    KillWorkersOn,
    Observation,
    devices_of,
    observe_allocation,
    observe_nodes,
    pending_gloss,
    preempt_notice,
)
from .runner import SlurmRunner
from .task import MARK, encode_payload

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

COMMENT_PREFIX = "slurm-etc:"
# How long close() waits for stopped workers before it kills them.
CLOSE_GRACE_S = 5.0
# After `kill <vrank>`, how long before the step itself is killed with scancel.
KILL_BACKSTOP_S = 5.0
# How long a launch waits for a stopping worker whose vrank or device it reuses (past the
# backstop).
STOPPING_WAIT_S = KILL_BACKSTOP_S + 5.0
# A worker killed by SIGTERM/SIGKILL that nobody here sent is reported up to this late, so
# that the Loss that explains it (Slurm's state lags its signals) comes first.
EXIT_HOLD_S = 5.0
# Under the run directory: each step's stdout file and stdin FIFO.
STEP_FILES = "steps"
# How soon Slurm is asked again after a signal it sent (a worker killed, a member's SIGTERM):
# Slurm may show the job RUNNING for a moment after its signal.
LOOK_AGAIN_S = 0.5


# --------------------------------------------------------------------------- pure builders


def member_job_name(anchor_job: str) -> str:
    return f"etc-{anchor_job}-member"


def member_comment(key: str) -> str:
    """``slurm-etc:<key>``, the key percent-encoded (no spaces, no ``=``: scontrol prints the
    comment as one ``key=value`` field)."""
    return COMMENT_PREFIX + urllib.parse.quote(key, safe="-_.~:/@+")


def key_of_comment(comment: str) -> str | None:
    if not comment.startswith(COMMENT_PREFIX):
        return None
    return urllib.parse.unquote(comment[len(COMMENT_PREFIX):])


def member_script(python: str, run_dir: str, notice_signal: str, anchor_job: str) -> str:
    """The member's batch script: ``exec`` so that the Python process is the batch shell
    (``--signal=B:`` signals that process only)."""
    import shlex

    return ("#!/bin/sh\n"
            "# slurm-etc member allocation: holds its nodes for the coordinator's srun steps\n"
            f"exec {shlex.quote(python)} -m slurm_etc.slurm.member"
            f" --run-dir {shlex.quote(run_dir)} --signal {check_signal(notice_signal)}"
            f" --anchor {shlex.quote(anchor_job)}\n")


def member_job_spec(*, anchor_job: str, key: str, nodes: int, gpus_per_node: int,
                    run_dir: str, python: str, partition: str | None = "scavenge",
                    qos: str | None = None, account: str | None = None,
                    time_limit: str | None = None, notice_signal: str = "USR2",
                    signal_lead_s: int = 120, output: str | None = None,
                    extra: Sequence[str] = ()) -> BatchSpec:
    """The sbatch description of a member allocation for request ``key``."""
    return BatchSpec(
        script=member_script(python, run_dir, notice_signal, anchor_job),
        name=member_job_name(anchor_job),
        partition=partition,
        qos=qos,
        account=account,
        nodes=nodes,
        gpus_per_node=gpus_per_node or None,
        exclusive=True,
        time_limit=time_limit,
        signal=f"{check_signal(notice_signal)}@{signal_lead_s}",
        signal_batch_only=True,
        requeue=False,
        output=output or os.path.join(run_dir, "member-%j.out"),
        extra=(f"--comment={member_comment(key)}", *extra),
    )


@dataclass(frozen=True)
class TaskSpec:
    """One worker of a step: task ``i`` of the step runs ``tasks[i]``."""

    vrank: int
    local: int
    env: Mapping[str, str] = field(default_factory=dict)


def worker_step_spec(*, allocation: str, node: str, tasks: Sequence[TaskSpec],
                     argv: Sequence[str], python: str, ignore: Sequence[str] = ("USR2",),
                     stop_signal: str = "TERM", error: str | None = None,
                     options: Sequence[str] = ()) -> StepSpec:
    """The srun step of ``tasks`` (workers on one node of one allocation); ``options``: the
    site's and the job's own srun options (:mod:`.step_options`), after the step's."""
    payload = {
        "argv": list(argv),
        "ignore": [check_signal(s) for s in ignore],
        "stop_signal": check_signal(stop_signal),
        "tasks": [{"vrank": t.vrank, "local": t.local, "env": dict(t.env)} for t in tasks],
    }
    return StepSpec(
        job_id=allocation, nodes=1, ntasks=len(tasks), nodelist=(node,), overlap=True,
        label=True, error=error,
        # stdin to every task (stop/kill lines); one task ending leaves the others running.
        extra=("--input=all", "--kill-on-bad-exit=0", "--wait=0", *options),
        argv=(python, "-m", "slurm_etc.slurm.task", encode_payload(payload)),
    )


def clean_shrink(nodes: Sequence[str], released: set[str]) -> int | None:
    """The NumNodes that releases exactly ``released`` (Slurm keeps a shrinking job's first
    nodes), or None when ``released`` is not a tail of ``nodes`` (or is all of them)."""
    keep = len(nodes) - len(released)
    if not released or keep < 1 or set(nodes[keep:]) != released:
        return None
    return keep


# --------------------------------------------------------------------------- the backend


@dataclass
class _Alloc(AllocationFacts):
    """One allocation as this backend keeps it; what Slurm says of it is observed by
    :func:`~slurm_etc.slurm.observe.observe_allocation` on its :meth:`view`."""

    job_id: str
    key: str | None  # None: the anchor
    nodes: tuple[str, ...] = ()
    state: AllocationState = AllocationState.REQUESTED
    noticed: bool = False  # a PreemptNotice was sent for it (true still once it ended)
    released: set[Device] = field(default_factory=set)
    pending: str | None = None  # squeue's Reason while it pends, as last logged
    since: float = 0.0  # when it was submitted or found (monotonic)

    @property
    def in_flux(self) -> bool:
        """Its state in Slurm is about to change: pending, or under a preemption notice."""
        return self.state in (AllocationState.REQUESTED, AllocationState.PREEMPTING)

    @property
    def pending_member(self) -> bool:
        return self.state is AllocationState.REQUESTED and not self.anchor

    def view(self, held: Mapping[Device, str]) -> AllocationView:
        return AllocationView(self.job_id, self.key, self.state, self.nodes, self.noticed,
                              tuple(d for d, j in held.items() if j == self.job_id))


@dataclass
class _Step:
    allocation: str
    node: str
    generation: int
    proc: subprocess.Popen[bytes] | AdoptedProcess  # srun
    vranks: tuple[int, ...]
    log: IO[bytes] | None
    out: IO[bytes]  # srun's stdout file (the wrapper's start and exit lines), read as it grows
    inbox: Path  # the FIFO srun reads as its stdin: stop and kill lines
    step_id: str | None = None
    buf: bytes = b""
    done: bool = False


@dataclass
class _Task:
    """The supervisor's handle on one worker: its task in an srun step."""

    step: _Step
    hold_until: float | None = None  # an unexplained kill waits this long for its Loss
    code: int | None = None  # from the wrapper's exit line


_Worker = Supervised[_Task]


class SlurmBackend(BackendDefaults):
    """Allocations and workers of one elastic job on Slurm.

    Args:
        run_dir: the job's directory on a filesystem shared by the anchor and the members
            (notices/ and member logs go there).
        anchor_job: the anchor's job id (default: ``SLURM_JOB_ID``: the coordinator runs in
            the anchor's batch script).
        client: the Slurm client (default: the command-line one, with the coordinator's
            SLURM_* variables removed from the commands' environment, SLURM_CONF kept).
        gpus_per_node: GPUs per node (default: the anchor's ``TresPerNode``, else the node's
            GRES).
        member_partition, member_qos, member_account, member_time: where members go.
        member_extra: further sbatch options for members.
        notice_signal: the preemption signal (``USR2``; ``TERM`` where the site sends
            only SIGTERM, i.e. has no ``preempt_send_user_signal``).
        signal_lead_s: the ``@<seconds>`` of ``--signal`` (before the time limit).
        grace_s: seconds from notice to loss (default: the member partition's GraceTime).
        notice_margin_s: taken off the grace in a notice's deadline.
        poll_interval_s: the least time between two Slurm queries in :meth:`poll` while a
            member is under a notice or a member request has just been submitted
            (:mod:`.cadence`).
        steady_poll_s: the least time between two full queries (every allocation and the
            nodes' states) otherwise (:data:`.cadence.STEADY_POLL_S`).
        python: the interpreter for the member script and the task wrapper (default: this
            one; it must exist at the same path on every node).
        log_dir: each step's stderr (the workers' output, ``--label``ed) goes to
            ``<log_dir>/gen<G>-<node>-<allocation>.log``; None: the coordinator's stderr.
        recover: look for members of this anchor that a previous coordinator submitted.
        clock: unix seconds (deadlines); injectable for tests.
        srun_options: added verbatim to every worker step's srun, never to the
            coordinator's own Slurm commands (:mod:`.step_options`: containers, binding).
        monotonic: the clock of the query cadence; injectable for tests.
        jitter: a number in [0, 1) per busy answer (spreads the back-off); injectable.
    """

    def __init__(self, run_dir: str | Path, *, anchor_job: str | None = None,
                 client: SlurmClient | None = None, gpus_per_node: int | None = None,
                 member_partition: str | None = "scavenge", member_qos: str | None = None,
                 member_account: str | None = None, member_time: str | None = None,
                 member_extra: Sequence[str] = (), notice_signal: str = "USR2",
                 signal_lead_s: int = 120, grace_s: float | None = None,
                 notice_margin_s: float = 5.0,
                 poll_interval_s: float = cadence.FAST_POLL_S,
                 steady_poll_s: float = cadence.STEADY_POLL_S,
                 python: str = sys.executable, log_dir: str | Path | None = None,
                 recover: bool = True, clock: Callable[[], float] = time.time,
                 srun_options: Sequence[str] = (),
                 monotonic: Callable[[], float] = time.monotonic,
                 jitter: Callable[[], float] = random.random) -> None:
        self.run_dir = Path(run_dir).absolute()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / NOTICES).mkdir(exist_ok=True)
        anchor = anchor_job or os.environ.get("SLURM_JOB_ID")
        if not anchor:
            raise BackendError("the Slurm backend runs inside the anchor job (SLURM_JOB_ID is "
                               "not set) or needs anchor_job=<job id>")
        self.anchor_job = str(anchor)
        self.client: SlurmClient = client or CliSlurmClient(
            SlurmRunner(timeout=30.0, env=commands.step_environment(os.environ)))
        self.member_partition = member_partition
        self.member_qos = member_qos
        self.member_account = member_account
        self.member_time = member_time
        self.member_extra = tuple(member_extra)
        self.notice_signal = check_signal(notice_signal)
        self.signal_lead_s = signal_lead_s
        self.notice_margin_s = notice_margin_s
        try:
            self.cadence = cadence.Cadence(steady_s=steady_poll_s, fast_s=poll_interval_s)
        except ValueError as e:
            raise BackendError(f"Slurm backend: {e}") from None
        self._monotonic = monotonic
        self._jitter = jitter
        self.python = python
        self.srun_options = step_options.check(srun_options, "srun options")
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._clock = clock
        self._grace_s = grace_s
        self._allocs: dict[str, _Alloc] = {}
        self._held: dict[Device, str] = {}
        self._keys: dict[str, str] = {}  # request key -> member job id
        # stop -> grace -> kill -> backstop -> report; this backend's do_* hooks are the
        # mechanism
        self._workers: WorkerSupervisor[_Task] = WorkerSupervisor(
            self, name="[slurm]", backstop_s=KILL_BACKSTOP_S)
        self._steps: list[_Step] = []
        self._events: list[BackendEvent] = []
        self._seen_notices: set[str] = set()
        # SIGTERM files (notice signal not TERM) waiting for a query: job id -> signal time
        self._term_notices: dict[str, float] = {}
        self._cadence = cadence.PollState()
        self._last_error: str | None = None
        # the last sinfo of a full query (monotonic time, nodes): usable_nodes answers from it
        self._nodes_seen: tuple[float, list[NodeInfo]] | None = None
        self._closed = False
        self._threads_said = False
        self._topology: ClusterTopology | None = None

        job = self._ask(lambda: self.client.job(self.anchor_job), "read the anchor job")
        if job is None or job.state is not SlurmJobState.RUNNING or not job.nodes:
            raise BackendError(f"anchor job {self.anchor_job} is not running "
                               f"({job.slurm_state if job else 'unknown to Slurm'})")
        self.gpus_per_node = gpus_per_node or self._gpus_of(job)
        self._anchor_partition = job.partition
        a = _Alloc(self.anchor_job, None)
        self._allocs[a.job_id] = a
        self._observe(a, job)  # its Grant
        if recover:
            self._recover()

    @classmethod
    def from_environment(cls, job_id: str | None = None, policy: Any = None,
                         srun_args: Sequence[str] = (), **kwargs: Any) -> "SlurmBackend":
        """The backend of the coordinator running in the anchor's batch script.

        The anchor is ``SLURM_JOB_ID``. Members go to the admin policy's ``grow_partition``
        and ``grow_qos`` where it names them, else to ``SLURM_ETC_MEMBER_PARTITION`` /
        ``SLURM_ETC_MEMBER_QOS`` (else Slurm's default partition); the notice signal is
        ``SLURM_ETC_NOTICE_SIGNAL`` (USR2); the policy's ``preempt_grace_s`` is the signal's
        lead time. The run directory (shared by every node) is ``SLURM_ETC_RUN_DIR``, else
        ``$SLURM_SUBMIT_DIR/.slurm-etc/<anchor>``; step logs go to its ``logs/``.
        ``job_id`` (the coordinator's name of the job) is not the anchor's id. Worker steps
        get the site's srun options, ``SLURM_ETC_SRUN_ARGS`` and ``srun_args``
        (:func:`.step_options.step_options`).
        """
        env = os.environ
        anchor = env.get("SLURM_JOB_ID")
        if not anchor:
            raise BackendError("--backend slurm runs inside the anchor job's batch script "
                               "(SLURM_JOB_ID is not set): submit scripts/elastic.sbatch")
        run_dir = Path(env.get("SLURM_ETC_RUN_DIR")
                       or Path(env.get("SLURM_SUBMIT_DIR", os.getcwd())) / ".slurm-etc" / anchor)
        lead = int(getattr(policy, "preempt_grace_s", 0) or 0)
        options: dict[str, Any] = {
            "anchor_job": anchor,
            "member_partition": getattr(policy, "grow_partition", None)
            or env.get("SLURM_ETC_MEMBER_PARTITION") or None,
            "member_qos": getattr(policy, "grow_qos", None)
            or env.get("SLURM_ETC_MEMBER_QOS") or None,
            "notice_signal": env.get("SLURM_ETC_NOTICE_SIGNAL", "USR2"),
            "signal_lead_s": lead or 120,
            "log_dir": run_dir / "logs",
            "srun_options": step_options.step_options(env, srun_args),
        }
        options.update(kwargs)
        return cls(run_dir, **options)

    @property
    def poll_interval_s(self) -> float:
        """Seconds between two queries while a member pends or is under a notice."""
        return self.cadence.fast_s

    @property
    def steady_poll_s(self) -> float:
        """Seconds between two full queries in steady state."""
        return self.cadence.steady_s

    @property
    def pending_reasons(self) -> Mapping[str, str | None]:
        """Request key -> squeue's Reason, for each member still pending (as last seen)."""
        return {a.key: a.pending for a in self._allocs.values()
                if a.key is not None and a.state is AllocationState.REQUESTED}

    @property
    def topology(self) -> ClusterTopology:
        """The nodes this job may ever hold, in Slurm's order: those of the anchor's and the
        member partition with at least ``gpus_per_node`` GPUs (read once), and the anchor's
        own. No switch topology (Slurm's topology.conf is not read)."""
        if self._topology is None:
            wanted = {p for p in (self._anchor_partition, self.member_partition) if p}
            try:
                # a full query's sinfo lists every node: no need to ask again
                nodes = self._nodes_seen[1] if self._nodes_seen else self.client.nodes()
            except SlurmError as e:
                raise BackendError(f"cannot list the cluster's nodes: {e}") from None
            names = [n.name for n in nodes if n.gpus >= self.gpus_per_node
                     and (not wanted or wanted & set(n.partitions))]
            anchor_nodes = self._allocs[self.anchor_job].nodes
            names += [n for n in anchor_nodes if n not in names]
            self._topology = ClusterTopology(self.gpus_per_node, tuple(names))
        return self._topology

    def usable_nodes(self) -> int | None:
        """How many of :attr:`topology`'s nodes this job can hold now: those Slurm would
        start a job on (not DOWN, DRAIN, FAIL, not responding) and those it holds. From the
        last full query's sinfo when it is younger than ``steady_poll_s`` (the coordinator
        asks after a loss, which a query just found, and every minute), else one sinfo;
        None when Slurm does not answer."""
        names = set(self.topology.nodes)
        seen = self._nodes_seen
        if seen is not None and self._monotonic() - seen[0] < self.cadence.steady_s:
            nodes = seen[1]
        else:
            try:
                nodes = self.client.nodes()
            except SlurmError as e:
                logger.warning("[slurm] cannot count the partition's usable nodes: %s", e)
                return None
        held = {d.node for d in self._held}
        return len({n.name for n in nodes if n.name in names and (n.usable or n.name in held)}
                   | (held & names))

    def __enter__(self) -> "SlurmBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def held(self) -> Mapping[Device, str]:
        """Devices the job holds now, with their allocation (Slurm job id)."""
        return dict(self._held)

    @property
    def members(self) -> Mapping[str, str]:
        """Request key -> member job id, for every member submitted (or recovered)."""
        return dict(self._keys)

    @property
    def grace_s(self) -> float:
        """Seconds from a notice to the loss: the constructor's, else the member partition's
        GraceTime (asked once)."""
        if self._grace_s is None:
            grace = 0.0
            if self.member_partition:
                try:
                    grace = float(self.client.partition(self.member_partition).grace_time)
                except SlurmError as e:
                    logger.warning("[slurm] GraceTime of %s unknown (%s); deadlines are the "
                                   "notice time", self.member_partition, e)
            self._grace_s = grace
        return self._grace_s

    # -- Backend ----------------------------------------------------------------------
    def poll(self) -> list[BackendEvent]:
        now = self._clock()
        self._query_if_due()
        self._read_notices()
        self._read_steps(now)
        out, self._events = self._events, []
        return out

    def on_step(self, step: int) -> None:
        """Slurm's events do not depend on the job's step."""

    def request(self, action: RequestNodes) -> None:
        if action.key in self._keys:
            return
        spec = member_job_spec(
            anchor_job=self.anchor_job, key=action.key, nodes=action.nodes,
            gpus_per_node=self.gpus_per_node, run_dir=str(self.run_dir), python=self.python,
            partition=self.member_partition, qos=self.member_qos,
            account=self.member_account, time_limit=self.member_time,
            notice_signal=self.notice_signal, signal_lead_s=self.signal_lead_s,
            extra=self.member_extra)
        job_id = self._act(lambda: self.client.submit(spec),
                           f"request {action.key!r} ({action.nodes} node(s))")
        self._keys[action.key] = job_id
        # in flux: asked often at first, then less (cadence.Flux), at once on its start file
        self._allocs[job_id] = _Alloc(job_id, action.key, since=self._monotonic())
        logger.info("[slurm] request %s: member job %s for %d node(s) in %s%s", action.key,
                    job_id, action.nodes, self.member_partition or "the default partition",
                    f": {action.reason}" if action.reason else "")

    def cancel_request(self, action: CancelRequest) -> None:
        """scancel the member of ``action.key`` while it is still pending (a granted one
        stays: its grant is reported as any other); its end comes back as RequestFailed."""
        job_id = self._keys.get(action.key)
        a = self._allocs.get(job_id) if job_id is not None else None
        if a is None or a.state is not AllocationState.REQUESTED:
            return
        self._act(functools.partial(self.client.cancel, a.job_id),
                  f"withdraw request {action.key}")
        logger.info("[slurm] withdrew request %s (scancel of pending member %s)%s",
                    action.key, a.job_id, f": {action.reason}" if action.reason else "")

    def release(self, action: ReleaseDevices) -> None:
        by_alloc: dict[str, list[Device]] = {}
        for d in action.devices:
            if d in self._held:
                by_alloc.setdefault(self._held[d], []).append(d)
        for job_id, devices in by_alloc.items():
            a = self._allocs[job_id]
            if a.anchor:
                logger.warning("[slurm] not releasing %s: the anchor job %s is never released",
                               ",".join(map(str, devices)), job_id)
                continue
            self._kill_on(set(devices), "released")
            for d in devices:
                del self._held[d]
            a.released.update(devices)
            left = [d for d, j in self._held.items() if j == job_id]
            if not left:
                a.state = AllocationState.RELEASED
                self._act(functools.partial(self.client.cancel, job_id),
                          f"release member {job_id}")
                logger.info("[slurm] released member %s (scancel)%s", job_id,
                            f": {action.reason}" if action.reason else "")
                continue
            self._shrink(a)

    def launch(self, action: LaunchWorkers) -> None:
        self._read_steps(self._clock())  # an exit not yet seen is reported first
        # a worker being stopped or killed on a device or under a vrank this launch uses (a
        # joiner of an aborted resize, whose retry maps other vranks to its devices; a worker
        # that left the job; one on a released or lost device): let it end first, bounded
        wanted = {spec.device for spec in action.workers}
        vranks = {spec.vrank for spec in action.workers}
        until = time.monotonic() + STOPPING_WAIT_S
        while time.monotonic() < until and any(
                not w.reported and w.state.stopping
                and (w.state.device in wanted or w.state.vrank in vranks)
                for w in self._workers.all()):
            time.sleep(0.05)
            self._read_steps(self._clock())
        busy = {w.state.device: w.state.vrank for w in self._workers.all()
                if not w.reported}
        groups: dict[tuple[str, str], list[TaskSpec]] = {}
        for spec in action.workers:
            current = self._workers.get(spec.vrank)
            if current is not None and not current.reported:
                if current.state.device != spec.device:
                    raise BackendError(f"launch of vrank {spec.vrank} on {spec.device}: it "
                                       f"already runs on {current.state.device}")
                if current.state.generation != action.generation:
                    # never taken for the new worker: that one would never start
                    raise BackendError(f"launch of vrank {spec.vrank} (generation "
                                       f"{action.generation}) on {spec.device}: its worker "
                                       f"of generation {current.state.generation} still "
                                       "runs; stop it first")
                continue  # the same launch again (a retried action): a no-op
            if spec.device not in self._held:
                held = ",".join(map(str, self._held)) or "nothing"
                raise BackendError(f"launch of vrank {spec.vrank} on {spec.device}: the job "
                                   f"does not hold {spec.device} (held: {held})")
            if spec.device in busy:
                raise BackendError(f"launch of vrank {spec.vrank} on {spec.device}: vrank "
                                   f"{busy[spec.device]} runs there")
            task_env = {**self._threads(), **action.env, **spec.env,
                        envvars.VRANK: str(spec.vrank),
                        envvars.GENERATION: str(action.generation),
                        envvars.NODE: spec.device.node,
                        envvars.LOCAL_INDEX: str(spec.device.local),
                        envvars.DEVICE: str(spec.device)}
            key = (self._held[spec.device], spec.device.node)
            groups.setdefault(key, []).append(TaskSpec(spec.vrank, spec.device.local, task_env))
        for (job_id, node), tasks in groups.items():
            self._start_step(action, job_id, node, tasks)

    def _threads(self) -> dict[str, str]:
        """OMP_NUM_THREADS for every worker (said once): this node's cores over its
        workers, one per GPU (members are whole nodes of the same shape, --exclusive). A
        value in the coordinator's environment reaches the workers through srun as it is."""
        cores = envvars.node_cores(os.environ)
        threads = envvars.thread_share(os.environ, cores, self.gpus_per_node)
        if not self._threads_said:
            self._threads_said = True
            if threads:
                logger.info("workers get %s=%s (%d cores per node / %d workers per node; set "
                            "it to choose)", envvars.THREADS, threads[envvars.THREADS], cores,
                            self.gpus_per_node)
            else:
                logger.info("workers keep %s=%s from this environment", envvars.THREADS,
                            os.environ[envvars.THREADS])
        return threads

    def stop(self, action: StopWorkers) -> None:
        self._workers.stop(action.vranks, self._clock(), action.grace_s, action.reason)

    def workers(self) -> Mapping[int, WorkerState]:
        return self._workers.states()

    def adopt(self, recorded: Sequence[WorkerState]) -> list[int]:
        """Take up the workers an earlier coordinator of this job launched (from the record:
        vrank, generation, device, and the pid and start time of their step's srun, which
        ran on this node), those whose srun still runs on a device this backend holds and
        whose task has not reported its exit; returns their vranks. Members a killed
        coordinator submitted were found at construction (``recover``); they are read from
        Slurm first, so that their devices count as held. The step's stdout file is read
        again from its start (its step id, the exits so far), its FIFO opened again for
        stops."""
        self._query(cadence.Ask(True, "adopt"))
        steps: dict[tuple[int, int], list[WorkerState]] = {}
        for w in recorded:
            current = self._workers.get(w.vrank)
            if current is not None and not current.reported:
                continue
            if w.start is not None and w.device in self._held:
                steps.setdefault((w.pid, w.start), []).append(w)
        out: list[int] = []
        for (pid, start), ws in sorted(steps.items()):
            places = {(w.generation, w.device.node, self._held[w.device]) for w in ws}
            if process_start(pid) != start or len(places) != 1:
                continue
            ((generation, node, job_id),) = places
            vranks = tuple(sorted(w.vrank for w in ws))
            out_path, inbox = self._step_files(generation, node, job_id, vranks[0])
            try:
                reader = open(out_path, "rb", buffering=0)
            except OSError:
                continue
            step = _Step(job_id, node, generation, AdoptedProcess(pid, start), vranks, None,
                         reader, inbox)
            self._steps.append(step)
            for w in ws:
                self._workers.add(replace(w, returncode=None, stopping=False), _Task(step))
            self._read_output(step)
            live = [v for v in vranks
                    if (worker := self._workers.get(v)) is not None and worker.handle.code is None]
            out += live
            logger.info("[slurm] adopted vranks %s (gen %d) on %s in %s: srun pid %d%s",
                        ",".join(map(str, live)) or "-", generation, node, job_id, pid,
                        f" ({len(vranks) - len(live)} ended meanwhile)"
                        if len(live) < len(vranks) else "")
        return sorted(out)

    def close(self) -> None:
        """Cancels the members still pending, stops every worker (stop, then kill after
        CLOSE_GRACE_S, then the steps) and cancels the other members; the anchor is left
        alone (the coordinator runs in it)."""
        if self._closed:
            return
        self._closed = True
        # Pending members hold no worker: cancelled first, before the workers' grace.
        self._cancel_members(AllocationState.REQUESTED)
        deadline = time.monotonic() + CLOSE_GRACE_S + KILL_BACKSTOP_S
        self._workers.close(self._clock(), CLOSE_GRACE_S, KILL_BACKSTOP_S,
                            refresh=self._read_step_outputs)
        while time.monotonic() < deadline and any(not s.done for s in self._steps):
            self._read_step_outputs()  # srun ends shortly after its last task
            time.sleep(0.05)
        for s in self._steps:
            if not s.done:
                self._cancel_step(s)
                try:
                    s.proc.wait(5)
                except subprocess.TimeoutExpired:
                    s.proc.kill()
                    s.proc.wait()
            self._finish_step(s)
        self._cancel_members()

    def _cancel_members(self, only: AllocationState | None = None) -> None:
        for a in self._allocs.values():
            if a.anchor or a.gone or (only is not None and a.state is not only):
                continue
            was, a.state = a.state, AllocationState.RELEASED
            try:
                self.client.cancel(a.job_id)
            except SlurmError as e:
                logger.error("[slurm] could not cancel member %s: %s", a.job_id, e)
            else:
                logger.info("[slurm] closing: cancelled member %s (%s)", a.job_id, was)

    # -- allocations ------------------------------------------------------------------
    def _gpus_of(self, job: JobInfo) -> int:
        gpus = parsers.gpus_per_node_of_job(job)
        if gpus:
            return gpus
        nodes = self._ask(lambda: self.client.nodes(job.nodes[:1]), "read the anchor's nodes")
        if nodes and nodes[0].gpus:
            return nodes[0].gpus
        raise BackendError(f"anchor job {job.job_id} holds no GPUs that Slurm reports "
                           "(submit it with --gres=gpu:N, or pass gpus_per_node)")

    def _recover(self) -> None:
        """Members a previous coordinator of this anchor submitted (pending or running)."""
        try:
            found = self.client.jobs(name=member_job_name(self.anchor_job))
        except SlurmError as e:
            logger.warning("[slurm] could not look for earlier members: %s", e)
            return
        for j in found:
            try:
                detail = self.client.job(j.job_id)
            except SlurmError as e:
                logger.warning("[slurm] could not read member %s: %s", j.job_id, e)
                continue
            key = key_of_comment(detail.fields.get("Comment", "")) if detail else None
            if key is None or key in self._keys:
                continue
            self._keys[key] = j.job_id
            self._allocs[j.job_id] = _Alloc(j.job_id, key, since=self._monotonic())
            logger.info("[slurm] found member %s of request %s (%s)", j.job_id, key,
                        j.slurm_state)

    def _query_if_due(self) -> None:
        """The query :func:`.cadence.next_ask` says is due now, if any; SIGTERM files read
        before a full query are confirmed (or not) by it."""
        now = self._monotonic()
        pending = [now - a.since for a in self._allocs.values() if a.pending_member]
        flux = cadence.Flux(
            noticed=any(a.state is AllocationState.PREEMPTING for a in self._allocs.values()),
            pending_s=min(pending) if pending else None)
        ask = cadence.next_ask(self.cadence, self._cadence, now, flux)
        if ask is None:
            return
        if not ask.full:
            self._query(ask)
            return
        waiting, self._term_notices = self._term_notices, {}
        if self._query(ask):
            self._confirm_term_notices(waiting)
        else:
            self._term_notices = {**waiting, **self._term_notices}

    def _query(self, ask: cadence.Ask) -> bool:
        """Grants, losses, notices by PreemptTime: a full query asks Slurm about every live
        allocation (one squeue, or scontrol for one) and its nodes (one sinfo), another only
        about the allocations in flux. False if Slurm did not answer."""
        now = self._monotonic()
        live = [a for a in self._allocs.values() if not a.gone and (ask.full or a.in_flux)]
        try:
            jobs = self._jobs([a.job_id for a in live])
            nodes = self.client.nodes() if ask.full and self._held else None
        except SlurmError as e:
            self._query_failed(now, ask, e)
            return False
        if self._cadence.busy:
            logger.info("[slurm] Slurm answers again (after %d busy answer(s))",
                        self._cadence.busy)
        self._cadence = cadence.answered(self.cadence, self._cadence, now, ask,
                                         cadence.Outcome.ANSWERED)
        self._last_error = None
        logger.debug("[slurm] %s query (%s): %d job(s)%s", "full" if ask.full else "fast",
                     ask.why, len(live), "" if nodes is None else f", {len(nodes)} node(s)")
        for a in live:
            self._observe(a, jobs.get(a.job_id))
        if nodes is not None:
            self._nodes_seen = (now, nodes)
            self._carry_out(*observe_nodes(self._held, nodes))
        return True

    def _jobs(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        """What Slurm says of ``job_ids``: one squeue, or ``scontrol show job`` for one id
        (two RPCs where squeue of one job costs three on 22.05)."""
        if not job_ids:
            return {}
        if len(job_ids) == 1:
            job = self.client.job(job_ids[0])
            return {job.job_id: job} if job is not None else {}
        return {j.job_id: j for j in self.client.jobs(job_ids)}

    def _query_failed(self, now: float, ask: cadence.Ask, e: SlurmError) -> None:
        """One line per kind of failure: a busy Slurm backs off (:mod:`.cadence`), said
        once until it answers again; another failure is retried after poll_interval_s,
        said once per distinct error."""
        busy = e.timed_out or parsers.is_busy(f"{e.stderr}\n{e.stdout}")
        self._cadence = cadence.answered(
            self.cadence, self._cadence, now, ask,
            cadence.Outcome.BUSY if busy else cadence.Outcome.FAILED, self._jitter())
        wait = self._cadence.retry_at - now
        if busy and self._cadence.busy == 1:
            logger.warning("[slurm] query failed, Slurm is busy: asking again in %.0f s, then "
                           "less often (at most every %.0f s) until it answers: %s", wait,
                           self.cadence.backoff_cap_s, e)
        elif busy:
            logger.debug("[slurm] still busy (%d): next query in %.0f s", self._cadence.busy,
                         wait)
        elif str(e) != self._last_error:
            logger.warning("[slurm] query failed (retrying every %.1f s): %s",
                           self.cadence.fast_s, e)
        self._last_error = str(e)

    def _confirm_term_notices(self, waiting: dict[str, float]) -> None:
        """SIGTERM files read before this query: a notice if the member still runs whole
        (a node DOWN or a cancel already showed as its loss in this query)."""
        for job_id, since in waiting.items():
            a = self._allocs[job_id]
            whole = all(d in self._held for d in devices_of(a.nodes, self.gpus_per_node)
                        if d not in a.released)
            if not a.gone and whole:
                self._notice(a, since, "SIGTERM in its batch shell, still running after it")
            elif not a.noticed:
                logger.info("[slurm] member %s: SIGTERM with its loss, not a notice", job_id)

    def _observe(self, a: _Alloc, job: JobInfo | None) -> None:
        """What squeue says of ``a``'s job (None: unknown to Slurm), observed by the pure
        :func:`~slurm_etc.slurm.observe.observe_allocation` and carried out here."""
        # the member partition's GraceTime is asked (once) only where a notice can come
        grace = (self.grace_s if job is not None and job.preempt_time is not None
                 and not a.anchor else None)
        if a.state is AllocationState.REQUESTED and job is not None \
                and job.state is SlurmJobState.PENDING and (job.reason or "") != a.pending:
            a.pending = job.reason or ""
            gloss = pending_gloss(job.reason)
            logger.info("[slurm] member request %s pending: %s%s", a.key, job.reason or "None",
                        f" ({gloss})" if gloss else "")
        self._apply(a, observe_allocation(a.view(self._held), job,
                                          gpus_per_node=self.gpus_per_node, grace_s=grace,
                                          notice_margin_s=self.notice_margin_s),
                    "squeue PreemptTime")

    def _notice(self, a: _Alloc, since: float, source: str) -> None:
        self._apply(a, preempt_notice(a.view(self._held), since, grace_s=self.grace_s,
                                      notice_margin_s=self.notice_margin_s), source)

    def _apply(self, a: _Alloc, obs: Observation, source: str) -> None:
        """An observation of ``a`` carried out: its new state, the kills and cancels, then
        its events (``source``: what a notice came from, for the log)."""
        new = obs.allocation
        a.state, a.nodes, a.noticed = new.state, new.nodes, new.noticed
        self._carry_out(obs.events, obs.actions, source)

    def _carry_out(self, events: Sequence[BackendEvent],
                   actions: Sequence[KillWorkersOn | CancelAllocation], source: str = "") -> None:
        whys = {}
        for action in actions:
            match action:
                case KillWorkersOn(allocation, devices, why):
                    whys[allocation, devices] = why
                    self._kill_on(set(devices), why)
                case CancelAllocation(job_id, why):
                    try:
                        self.client.cancel(job_id)
                    except SlurmError as e:
                        logger.warning("[slurm] could not cancel member %s (%s): %s", job_id,
                                       why, e)
        for event in events:
            match event:
                case Grant(allocation, devices):
                    for d in devices:
                        self._held[d] = allocation
                    logger.info("[slurm] %s %s granted: %s",
                                "anchor" if allocation == self.anchor_job else "member",
                                allocation, ",".join(event.nodes))
                case Loss(allocation, devices, cause):
                    for d in devices:
                        del self._held[d]
                    logger.warning("[slurm] lost %s of %s (%s): %s", ",".join(map(str, devices)),
                                   allocation, cause, whys.get((allocation, devices), ""))
                case PreemptNotice(allocation, _, deadline):
                    logger.info("[slurm] member %s will be preempted (%s): deadline in %.1f s",
                                allocation, source, deadline - self._clock())
                case RequestFailed(key, allocation, reason):
                    logger.warning("[slurm] member %s of request %s ended before it started "
                                   "(%s)", allocation, key, reason)
            self._events.append(event)

    def _read_notices(self) -> None:
        try:
            names = sorted(os.listdir(self.run_dir / NOTICES))
        except OSError:
            return
        for name in names:
            if name.startswith(".") or name in self._seen_notices:
                continue
            m = re.fullmatch(r"(\d+(?:_\d+)?)\.(\d+)\.([A-Z0-9]+)\.json", name)
            if not m:
                self._seen_notices.add(name)
                continue
            a = self._allocs.get(m.group(1))
            if a is None or a.gone:
                self._seen_notices.add(name)
                continue
            if m.group(3) == STARTED:  # its batch shell started: the grant, ask Slurm now
                self._seen_notices.add(name)
                if a.state is AllocationState.REQUESTED:
                    self._cadence = cadence.hurry(self._cadence, self._monotonic())
                continue
            if a.state is AllocationState.REQUESTED:
                continue  # signalled before we saw it running: handled once granted
            self._seen_notices.add(name)
            try:
                since = os.stat(self.run_dir / NOTICES / name).st_mtime
            except OSError:
                since = self._clock()
            if m.group(3) == "TERM" and self.notice_signal != "TERM":
                self._term_notices.setdefault(a.job_id, since)  # see _confirm_term_notices
                # the full query that tells a notice from a loss, soon
                self._cadence = cadence.hurry(self._cadence, self._monotonic() + LOOK_AGAIN_S)
            else:
                self._notice(a, since, f"SIG{m.group(3)} in its batch shell")

    def _shrink(self, a: _Alloc) -> None:
        """Frees the member's nodes whose every device was released, where NumNodes can."""
        freed = {n for n in a.nodes
                 if all(d in a.released for d in devices_of([n], self.gpus_per_node))}
        keep = clean_shrink(a.nodes, freed)
        if keep is None:
            if freed:
                logger.info("[slurm] member %s keeps %s until all of it is released (Slurm "
                            "shrinks a job by its last nodes only)", a.job_id,
                            ",".join(sorted(freed)))
            return
        self._act(lambda: self.client.resize(a.job_id, keep),
                  f"shrink member {a.job_id} to {keep} node(s)")
        a.nodes = a.nodes[:keep]
        logger.info("[slurm] member %s shrunk to %s", a.job_id, ",".join(a.nodes))

    # -- steps ------------------------------------------------------------------------
    def _start_step(self, action: LaunchWorkers, job_id: str, node: str,
                    tasks: list[TaskSpec]) -> None:
        log: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"gen{action.generation}-{node}-{job_id}.log", "ab")
        out_path, inbox = self._step_files(action.generation, node, job_id,
                                           min(t.vrank for t in tasks))
        on_member = not self._allocs[job_id].anchor
        term_is_notice = self.notice_signal == "TERM" and on_member
        spec = worker_step_spec(
            allocation=job_id, node=node, tasks=tasks, argv=action.argv, python=self.python,
            ignore=(self.notice_signal, *(("TERM",) if term_is_notice else ())),
            stop_signal="INT" if term_is_notice else "TERM", options=self.srun_options)
        cmd = commands.srun(spec)
        env = {**commands.step_environment(os.environ), **action.env}
        stdin = -1
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            inbox.unlink(missing_ok=True)
            os.mkfifo(inbox, 0o600)
            # srun holds both ends of its stdin: it never reads end-of-file, so the stop and
            # kill lines of a coordinator restarted after this one died still reach the tasks
            stdin = os.open(inbox, os.O_RDWR)
            with open(out_path, "wb") as stdout:
                proc = subprocess.Popen(cmd.argv, env=env, stdin=stdin, stdout=stdout,
                                        stderr=log, start_new_session=True)
        except OSError as e:
            if log is not None:
                log.close()
            raise BackendError(f"launch on {node} ({job_id}): cannot start srun: "
                               f"{e.strerror}") from None
        finally:
            if stdin >= 0:
                os.close(stdin)
        step = _Step(job_id, node, action.generation, proc, tuple(t.vrank for t in tasks), log,
                     open(out_path, "rb", buffering=0), inbox)
        self._steps.append(step)
        start = process_start(proc.pid)
        for t in tasks:
            state = WorkerState(t.vrank, action.generation, Device(node, t.local), proc.pid,
                                start=start)
            self._workers.add(state, _Task(step))
        logger.info("[slurm] launched vranks %s (gen %d) on %s in %s: srun pid %d",
                    ",".join(map(str, step.vranks)), action.generation, node, job_id,
                    proc.pid)

    def _read_step_outputs(self) -> None:
        """The wrappers' lines each step wrote since the last read; the steps whose srun
        ended."""
        for step in self._steps:
            if step.done:
                continue
            self._read_output(step)
            if step.proc.poll() is not None:
                self._read_output(step)
                self._finish_step(step)

    def _read_steps(self, now: float) -> None:
        """Read the steps, then the supervisor's sweep: report the workers that ended (an
        unexplained kill held back a while for its Loss), escalate the stops due."""
        self._read_step_outputs()
        unexpected = [w.handle for w in self._workers.all() if not w.reported
                      and not w.state.stopping and self.do_exit_status(w) is not None
                      and w.handle.code in (None, -signal.SIGTERM, -signal.SIGKILL)]
        if any(t.hold_until is None for t in unexpected):
            # Killed by a signal nobody here sent: Slurm's (the end of a preemption grace, a
            # node lost...). Ask Slurm now (unless it said it is busy), so that the Loss
            # comes first and the exit counts as stopped, as it would had the loss been seen
            # first.
            self._cadence = cadence.hurry(self._cadence, self._monotonic())
            self._query_if_due()
        held_back = {id(t) for t in unexpected}
        for t in unexpected:
            if t.hold_until is None:
                t.hold_until = now + EXIT_HOLD_S
        if unexpected:
            # Slurm may show the job RUNNING for a moment after its signal: look again soon.
            self._cadence = cadence.hurry(self._cadence, self._monotonic() + LOOK_AGAIN_S)

        def hold(w: _Worker) -> bool:  # held back for the Loss that explains it
            return (id(w.handle) in held_back and not w.state.stopping
                    and w.handle.hold_until is not None and now < w.handle.hold_until)

        self._events += self._workers.sweep(now, hold)

    def _read_output(self, step: _Step) -> None:
        if step.out.closed:
            return
        try:
            step.buf += step.out.read() or b""  # what srun wrote since the last read
        except OSError:
            return
        *lines, step.buf = step.buf.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            # srun --label prefixes "<task>: "
            _, _, rest = line.partition(MARK)
            words = rest.split()
            if not words:
                continue
            w = self._workers.get(int(words[1])) if len(words) > 1 and words[1].isdigit() \
                else None
            if w is None or w.handle.step is not step:
                continue
            if words[0] == "start" and len(words) >= 4:
                step.step_id = step.step_id or (words[3] if words[3] != "?" else None)
            elif words[0] == "exit" and len(words) >= 3:
                w.handle.code = int(words[2])

    def _finish_step(self, step: _Step) -> None:
        if step.done:
            return
        step.done = True
        step.out.close()
        step.inbox.unlink(missing_ok=True)
        if step.log is not None:
            step.log.close()

    def _tell(self, step: _Step, line: str) -> None:
        if step.done:
            return
        try:
            fd = os.open(step.inbox, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return  # srun ended (no reader) or its FIFO is gone
        try:
            os.write(fd, line.encode() + b"\n")
        except OSError:
            pass
        finally:
            os.close(fd)

    def _step_files(self, generation: int, node: str, job_id: str,
                    first_vrank: int) -> tuple[Path, Path]:
        """A step's stdout file and stdin FIFO: named by what the record keeps of its launch
        (generation, device, vranks) and the allocation holding the device, so that
        :meth:`adopt` finds them again."""
        base = f"gen{generation}-{node}-{job_id}-v{first_vrank}"
        return (self.run_dir / STEP_FILES / f"{base}.out",
                self.run_dir / STEP_FILES / f"{base}.in")

    def _cancel_step(self, step: _Step) -> None:
        if step.done or step.step_id is None:
            return
        try:
            self.client.signal(f"{step.allocation}.{step.step_id}", "KILL")
        except SlurmError as e:
            logger.warning("[slurm] could not kill step %s.%s: %s", step.allocation,
                           step.step_id, e)

    def _kill_on(self, devices: set[Device], why: str) -> None:
        """Kill the workers on ``devices``; an exit not reported yet is the loss's too."""
        for w in self._workers.all():
            if not w.reported and w.state.device in devices:
                self._workers.kill(w, self._clock(), why)

    # -- the supervisor's mechanism (slurm_etc.coordinator.supervisor) ----------------------
    def do_exit_status(self, w: _Worker) -> int | None:
        """The wrapper's exit line, else -9 once its step ended without a word (as read
        by the last :meth:`_read_step_outputs`), else None."""
        if w.handle.code is not None:
            return w.handle.code
        return -9 if w.handle.step.done else None

    def do_stop(self, w: _Worker) -> None:
        self._tell(w.handle.step, f"stop {w.vrank}")

    def do_kill(self, w: _Worker) -> None:
        self._tell(w.handle.step, f"kill {w.vrank}")

    def do_backstop(self, w: _Worker) -> None:
        self._cancel_step(w.handle.step)

    def do_ended(self, w: _Worker) -> None:
        logger.info("[slurm] vrank %d (gen %d) on %s exited with %d%s", w.vrank,
                    w.state.generation, w.state.device, w.state.returncode,
                    "" if w.handle.code is not None else " (its step ended without a word)")

    def do_describe(self, w: _Worker) -> str:
        step = w.handle.step
        return f"step {step.allocation}.{step.step_id or '?'} on {step.node}"

    # -- Slurm calls ------------------------------------------------------------------
    @staticmethod
    def _ask(call: Callable[[], _T], what: str) -> _T:
        try:
            return call()
        except SlurmError as e:
            raise BackendError(f"cannot {what}: {e}") from None

    def _act(self, call: Callable[[], str | None], what: str) -> str:
        try:
            return call() or ""
        except SlurmError as e:
            raise BackendError(f"{what} failed: {e}") from None
