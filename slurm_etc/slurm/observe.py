"""What Slurm's answer means for the job's allocations: pure functions.

:func:`observe_allocation` takes what the backend knows of one allocation (an
:class:`AllocationView`: its :class:`~slurm_etc.lifecycle.AllocationState`, nodes, the
devices the job still holds of it) and what squeue says of its Slurm job (a
:class:`~slurm_etc.slurm.model.JobInfo`, whose state Slurm's name mapped to by the table in
:mod:`slurm_etc.slurm.model`; None: Slurm no longer knows the job), and returns an
:class:`Observation`: the allocation's new view, the events the coordinator is told, in
order, and the actions the backend takes (kill the workers on lost devices, cancel a member
Slurm requeued). :func:`preempt_notice` is the same for a notice read elsewhere (the member's
signal file), :func:`observe_nodes` for sinfo's node states. Nothing here does I/O; the
backend (:meth:`slurm_etc.slurm.backend.SlurmBackend._observe`) carries the results out::

    view = AllocationView("1240", "grow-1", AllocationState.GRANTED, ("n2",),
                          held=(Device("n2", 0), Device("n2", 1)))
    obs = observe_allocation(view, job, gpus_per_node=2, grace_s=30, notice_margin_s=5)
    # job PREEMPTED -> obs.allocation.state LOST,
    #                  obs.events == (Loss("1240", (n2:0, n2:1), "preempted"),)
    #                  obs.actions == (KillWorkersOn("1240", (n2:0, n2:1),
    #                                                "job 1240 is PREEMPTED"),)

The rules, by the allocation's state and the job's (:class:`SlurmJobState`):

- **requested** (submitted, not seen running): running with nodes -> granted (a
  :class:`Grant`; a preempt time already set -> a :class:`PreemptNotice` at once); ended,
  requeued, ending or gone -> lost before it started (a :class:`RequestFailed`); anything
  else (pending, configuring) -> still requested.
- **granted / preempting**: not running (``SIGNALING`` counts as running: Slurm is
  delivering a signal, e.g. the notice) or gone -> lost: a :class:`Loss` of every device
  still held, ``preempted`` when the job was noticed, preempted, requeued or has a preempt
  time, except after a node failure, a failure, a timeout or a completion (``failure``); a
  member Slurm requeued (pending again, although submitted with ``--no-requeue``) is
  cancelled. Running: a preempt time on a granted member -> a notice (once); nodes the job
  no longer has (shrunk by someone else) -> a ``failure`` loss of their devices.
- **lost / released**: nothing more.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator.backend import (
    BackendEvent,
    Grant,
    Loss,
    PreemptNotice,
    RequestFailed,
)

from ..errors import InternalError
from ..lifecycle import AllocationState
from .model import JobInfo, NodeInfo, NodeState, SlurmJobState

# sinfo states of a node the job loses its devices on (besides not responding).
LOST_NODE_STATES = (NodeState.DOWN, NodeState.FAIL, NodeState.DRAINED, NodeState.DRAINING)
# Job states after which a loss is a failure even if a preemption notice came before it
# (a SIGTERM notice before a node failure was the failure's).
FAILURE_JOB_STATES = (SlurmJobState.NODE_FAIL, SlurmJobState.FAILED, SlurmJobState.TIMEOUT,
                      SlurmJobState.COMPLETED)
# Job states that are a preemption whatever came before.
PREEMPTED_JOB_STATES = (SlurmJobState.PREEMPTED, SlurmJobState.REQUEUED)


def devices_of(nodes: Iterable[str], gpus_per_node: int) -> tuple[Device, ...]:
    return tuple(Device(n, i) for n in nodes for i in range(gpus_per_node))


class AllocationFacts:
    """What follows from an allocation's key and state (the view and the backend's own
    record of an allocation both have them)."""

    key: str | None
    state: AllocationState

    @property
    def anchor(self) -> bool:
        return self.key is None

    @property
    def gone(self) -> bool:
        """Ended, lost or released as a whole: no more events."""
        return self.state in (AllocationState.LOST, AllocationState.RELEASED)


@dataclass(frozen=True)
class AllocationView(AllocationFacts):
    """What the backend knows of one allocation (a Slurm job: the anchor or a member).

    Attributes:
        job_id: the Slurm job id.
        key: the request it answers (:attr:`RequestNodes.key`); None for the anchor.
        state: where it is in its lifecycle.
        nodes: its nodes once granted (less those Slurm took back without a word).
        noticed: a :class:`PreemptNotice` was sent for it.
        held: the devices of it the job still holds, in the backend's order.
    """

    job_id: str
    key: str | None
    state: AllocationState = AllocationState.REQUESTED
    nodes: tuple[str, ...] = ()
    noticed: bool = False
    held: tuple[Device, ...] = ()


@dataclass(frozen=True)
class KillWorkersOn:
    """Kill the workers on ``devices`` now (the job lost them); ``why`` for the log."""

    allocation: str
    devices: tuple[Device, ...]
    why: str


@dataclass(frozen=True)
class CancelAllocation:
    """``scancel`` the allocation's Slurm job."""

    job_id: str
    why: str


ObserverAction = KillWorkersOn | CancelAllocation


@dataclass(frozen=True)
class Observation:
    """The allocation's new view, the events to emit and the actions to take, in order."""

    allocation: AllocationView
    events: tuple[BackendEvent, ...] = ()
    actions: tuple[ObserverAction, ...] = ()

    def then(self, later: Observation) -> Observation:
        """This observation followed by ``later`` (whose view is the newer)."""
        return Observation(later.allocation, self.events + later.events,
                           self.actions + later.actions)


def observe_allocation(view: AllocationView, job: JobInfo | None, *, gpus_per_node: int,
                       grace_s: float | None, notice_margin_s: float) -> Observation:
    """What squeue's ``job`` (None: unknown to Slurm) means for the allocation ``view``.

    Args:
        gpus_per_node: the devices of each node of a grant.
        grace_s: seconds from a preemption notice to the loss (the member partition's
            GraceTime); None where the job has no preempt time (no notice can come of it).
        notice_margin_s: taken off the grace in a notice's deadline.
    """
    now = Observation(view)
    if view.gone:
        return now
    state = job.state if job is not None else None
    if job is not None and job.slurm_state.upper().startswith("SIGNALING"):
        # Transient, while Slurm delivers a signal (e.g. the preemption notice): the job
        # still runs.
        state = SlurmJobState.RUNNING
    if view.state is AllocationState.REQUESTED:
        if job is not None and state is SlurmJobState.RUNNING and job.nodes:
            granted = _grant(view, job.nodes, gpus_per_node)
            if job.preempt_time is None:
                return granted
            return granted.then(preempt_notice(granted.allocation, job.preempt_time.timestamp(),
                                               grace_s=grace_s, notice_margin_s=notice_margin_s))
        if job is None or state is None or state.finished or state in (
                SlurmJobState.REQUEUED, SlurmJobState.ENDING):
            why = job.slurm_state if job is not None else "gone"
            return Observation(replace(view, state=AllocationState.LOST),
                               (RequestFailed(view.key, view.job_id, why),)
                               if view.key is not None else ())
        return now
    if state is not SlurmJobState.RUNNING or job is None:
        if state in FAILURE_JOB_STATES:
            preempted = False
        else:
            preempted = (view.noticed or state in PREEMPTED_JOB_STATES
                         or (job is not None and job.preempt_time is not None))
        lost = _lose(view, view.held, "preempted" if preempted else "failure",
                     f"job {view.job_id} is {job.slurm_state if job is not None else 'gone'}")
        lost = replace(lost, allocation=replace(lost.allocation, state=AllocationState.LOST))
        if not view.anchor and state is SlurmJobState.PENDING:
            return lost.then(Observation(lost.allocation, actions=(CancelAllocation(
                view.job_id, "requeued although submitted with --no-requeue"),)))
        return lost
    if job.preempt_time is not None and view.state is AllocationState.GRANTED:
        now = now.then(preempt_notice(view, job.preempt_time.timestamp(), grace_s=grace_s,
                                      notice_margin_s=notice_margin_s))
    missing = set(view.nodes) - set(job.nodes)
    if missing:  # shrunk by someone else
        shrunk = _lose(now.allocation, [d for d in now.allocation.held if d.node in missing],
                       "failure", f"job {view.job_id} no longer holds "
                                  f"{','.join(sorted(missing))}")
        now = now.then(replace(shrunk, allocation=replace(
            shrunk.allocation, nodes=tuple(n for n in view.nodes if n not in missing))))
    return now


def preempt_notice(view: AllocationView, since: float, *, grace_s: float | None,
                   notice_margin_s: float) -> Observation:
    """A granted member picked for preemption at ``since`` (unix seconds): a
    :class:`PreemptNotice` of every device still held, with the deadline ``since + grace -
    margin`` (never before ``since``); the allocation is then ``preempting``. An allocation
    not granted (already noticed, pending, gone) or the anchor: nothing."""
    if view.state is not AllocationState.GRANTED or view.anchor:
        return Observation(view)
    if grace_s is None:
        raise InternalError(f"a notice of member {view.job_id} needs the grace time")
    deadline = since + max(0.0, grace_s - notice_margin_s)
    return Observation(replace(view, state=AllocationState.PREEMPTING, noticed=True),
                       (PreemptNotice(view.job_id, view.held, deadline),))


def observe_nodes(held: Mapping[Device, str], nodes: Sequence[NodeInfo]
                  ) -> tuple[tuple[Loss, ...], tuple[KillWorkersOn, ...]]:
    """sinfo's ``nodes`` against the devices the job holds (device -> allocation): a
    ``failure`` :class:`Loss` of the devices on each node that is DOWN, DRAIN(ED/ING), FAIL
    or not responding, one per allocation, with the kill of their workers."""
    held = dict(held)
    events: list[Loss] = []
    actions: list[KillWorkersOn] = []
    for n in nodes:
        if n.state not in LOST_NODE_STATES and n.responding:
            continue
        lost = [d for d in held if d.node == n.name]
        why = f"node {n.name} is {n.slurm_state}" + (f" ({n.reason})" if n.reason else "")
        for job_id in dict.fromkeys(held[d] for d in lost):
            devices = tuple(d for d in lost if held.get(d) == job_id)
            actions.append(KillWorkersOn(job_id, devices, why))
            events.append(Loss(job_id, devices, "failure"))
            for d in devices:
                del held[d]
    return tuple(events), tuple(actions)


def _grant(view: AllocationView, nodes: Sequence[str], gpus_per_node: int) -> Observation:
    devices = devices_of(nodes, gpus_per_node)
    return Observation(replace(view, state=AllocationState.GRANTED, nodes=tuple(nodes),
                               held=devices),
                       (Grant(view.job_id, devices, view.key),))


def _lose(view: AllocationView, devices: Sequence[Device],
          cause: Literal["failure", "preempted"], why: str) -> Observation:
    devices = tuple(d for d in devices if d in view.held)
    if not devices:
        return Observation(view)
    left = tuple(d for d in view.held if d not in devices)
    return Observation(replace(view, held=left), (Loss(view.job_id, devices, cause),),
                       (KillWorkersOn(view.job_id, devices, why),))


# squeue's Reason for a pending job, in words (by prefix, the first that matches): a limit
# is the site's (Slurm holds the job whatever is free), the others wait for nodes or a time.
_PENDING_GLOSS = (
    ("QOS", "held by Slurm: QOS limit"),
    ("Assoc", "held by Slurm: account/association limit"),
    ("Partition", "held by Slurm: partition limit"),
    ("ReqNodeNotAvail", "the nodes it needs are down, drained or reserved"),
    ("Reservation", "waiting for a reservation"),
    ("Resources", "waiting for free nodes"),
    ("Priority", "jobs of higher priority go first"),
    ("Dependency", "waiting for a dependency"),
    ("BeginTime", "not before its begin time"),
    ("JobHeld", "held (scontrol release)"),
    ("Licenses", "waiting for licenses"),
)


def pending_gloss(reason: str | None) -> str:
    """squeue's Reason for a pending member in words (``QOSMaxNodePerUserLimit`` ->
    ``held by Slurm: QOS limit``); ``""`` where there is nothing to add."""
    if not reason:
        return "not yet scheduled"
    for prefix, words in _PENDING_GLOSS:
        if reason.startswith(prefix):
            return words
    return ""
