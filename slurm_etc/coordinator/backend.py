"""The backend seam: how the coordinator learns about resources and acts on them.

Events come in (:class:`Grant`, :class:`PreemptNotice`, :class:`Loss`,
:class:`WorkerExited` when a worker process ends, :class:`RequestFailed` when a request ends
without a grant, :class:`EndTraining` when a scripted cluster's scenario is over); actions
go out (:class:`RequestNodes`, :class:`ReleaseDevices`, :class:`LaunchWorkers`,
:class:`StopWorkers`). All are plain frozen
dataclasses: the reconcile loop, the store and the tests build and compare them without any
I/O. A :class:`Backend` turns actions into processes and allocations: the local backend
(:mod:`slurm_etc.local.backend`, processes on this machine and scripted events)
and the Slurm backend (member allocations, ``srun``) implement the same protocol.

How the reconcile loop (:mod:`.loop`) uses a backend (the loop stays in control; nothing
here calls back)::

    while running:
        for event in backend.poll():          # never blocks
            record(event); apply(event)       # the job's SQLite record first
        ...                                   # channel.recv(...) -> Progress(step=s)
        backend.on_step(s)                    # a scripted backend fires the events due by s
        decide (policy/), plan and settle resizes (reconcile.py, pure), then for each action:
            record what it needs known         # a request's key, a migration's generation
            perform(backend, action)
            record what it made                # a launched worker's pid and start time

Every action is idempotent, so a restarted coordinator may replay the actions it recorded:
a request with a key seen before, a release of devices no longer held, a launch of a vrank
already running, a stop of a worker already stopped, all do nothing.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias

from slurm_etc.alloc.topology import Device

from ..errors import InternalError

if TYPE_CHECKING:
    from pathlib import Path


class BackendError(InternalError, RuntimeError):
    """An action the backend cannot carry out (e.g. a launch on a device the job does not
    hold); the message says what and why."""


# --------------------------------------------------------------------------- events in


@dataclass(frozen=True)
class Grant:
    """An allocation started: the job now holds ``devices``.

    Attributes:
        allocation: the allocation's id (a Slurm job id; ``a0``, ``a1``, ... locally).
        devices: the devices it holds, sorted.
        request: the :attr:`RequestNodes.key` it satisfies; None for the anchor allocation
            and for grants nobody asked for (a scripted grant with no request pending).
    """

    allocation: str
    devices: tuple[Device, ...]
    request: str | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        return _nodes(self.devices)


@dataclass(frozen=True)
class PreemptNotice:
    """``devices`` of ``allocation`` will be taken at ``deadline`` (unix seconds).

    Releasing them before the deadline hands them back cleanly; still held at the deadline,
    their workers are killed and a :class:`Loss` with cause ``preempted`` follows."""

    allocation: str
    devices: tuple[Device, ...]
    deadline: float

    @property
    def nodes(self) -> tuple[str, ...]:
        return _nodes(self.devices)


@dataclass(frozen=True)
class Loss:
    """``devices`` of ``allocation`` are gone (their workers are dead or being killed)."""

    allocation: str
    devices: tuple[Device, ...]
    cause: Literal["failure", "preempted"] = "failure"

    @property
    def nodes(self) -> tuple[str, ...]:
        return _nodes(self.devices)


@dataclass(frozen=True)
class WorkerExited:
    """A worker process ended.

    Attributes:
        returncode: its exit status (negative: killed by that signal; ``UNKNOWN_EXIT``: it
            ended and nobody can read its status, a process adopted after a restart).
        stopped: True when it ended after a :class:`StopWorkers` (or a release/loss of its
            device made the backend kill it); False for an exit nobody asked for.
    """

    vrank: int
    generation: int
    device: Device
    returncode: int
    stopped: bool


@dataclass(frozen=True)
class RequestFailed:
    """A :class:`RequestNodes` ended without a grant (its allocation was cancelled, failed or
    refused while pending): the request is over and the job may ask again.

    Attributes:
        request: the :attr:`RequestNodes.key`.
        allocation: the allocation that ended (a Slurm job id).
        reason: what ended it (Slurm's state).
    """

    request: str
    allocation: str
    reason: str = ""

    @property
    def devices(self) -> tuple[Device, ...]:
        return ()


@dataclass(frozen=True)
class EndTraining:
    """The backend ends the job's training: the coordinator stops the workers at a step
    boundary once no resize is in flight, and the job ends finished (a scripted cluster
    whose events all played out, :mod:`slurm_etc.local.script`'s ``end_step``; Slurm never
    sends it: a job there trains to its own end, or its time limit)."""

    reason: str

    @property
    def devices(self) -> tuple[Device, ...]:
        return ()


BackendEvent: TypeAlias = (Grant | PreemptNotice | Loss | WorkerExited | RequestFailed
                           | EndTraining)


# --------------------------------------------------------------------------- actions out


@dataclass(frozen=True)
class RequestNodes:
    """Ask for ``nodes`` more whole nodes (Slurm: submit a member allocation).

    ``key`` names the request; a second request with the same key is the same request."""

    nodes: int
    key: str
    reason: str = ""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise BackendError(f"request {self.key!r}: nodes must be >= 1, got {self.nodes}")


def request_key(n: int) -> str:
    """The :attr:`RequestNodes.key` of the job's ``n``-th node request (``grow-<n>``); a
    restarted coordinator numbers on after the recorded requests, so no key comes twice."""
    return f"grow-{n}"


@dataclass(frozen=True)
class CancelRequest:
    """Withdraw the :class:`RequestNodes` of ``key`` if it was not granted yet (Slurm:
    ``scancel`` the pending member); a granted one is left as it is."""

    key: str
    reason: str = ""


@dataclass(frozen=True)
class ReleaseDevices:
    """Give ``devices`` back (workers on them should have been stopped first; the backend
    kills any still running there)."""

    devices: tuple[Device, ...]
    reason: str = ""


@dataclass(frozen=True)
class WorkerSpec:
    """One worker of a launch: its vrank, device and extra environment."""

    vrank: int
    device: Device
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchWorkers:
    """Start ``argv`` once per worker for ``generation``.

    Every worker's environment is the coordinator's own, plus ``env`` (e.g. the channel's
    :meth:`~slurm_etc.protocol.channel.CoordinatorChannel.worker_env`), plus its
    :attr:`WorkerSpec.env`, plus ``SLURM_ETC_VRANK``, ``_GENERATION``, ``_NODE``,
    ``_LOCAL_INDEX`` and ``_DEVICE`` (``node:index``) set by the backend."""

    generation: int
    workers: tuple[WorkerSpec, ...]
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.argv:
            raise BackendError("launch: argv is empty")
        vranks = [w.vrank for w in self.workers]
        devices = [w.device for w in self.workers]
        if len(set(vranks)) != len(vranks) or len(set(devices)) != len(devices):
            pairs = ", ".join(f"{w.vrank}@{w.device}" for w in self.workers)
            raise BackendError(f"launch of generation {self.generation}: vranks and devices "
                               f"must be distinct, got {pairs}")


@dataclass(frozen=True)
class StopWorkers:
    """Stop the workers of ``vranks``: SIGTERM now, SIGKILL after ``grace_s``."""

    vranks: tuple[int, ...]
    grace_s: float = 10.0
    reason: str = ""


Action: TypeAlias = RequestNodes | ReleaseDevices | LaunchWorkers | StopWorkers | CancelRequest


# The status of a worker that ended whose exit status nobody can read: one adopted from an
# earlier coordinator of the job (not this process's child). Outside every real status
# (0..255; a signal is negative).
UNKNOWN_EXIT = 256


@dataclass(frozen=True)
class WorkerState:
    """What the backend knows of one worker process (``returncode`` None while running)."""

    vrank: int
    generation: int
    device: Device
    pid: int
    returncode: int | None = None
    stopping: bool = False
    start: int | None = None  # when the process started (local: clock ticks since boot)

    @property
    def running(self) -> bool:
        return self.returncode is None


class Backend(Protocol):
    """Resources and worker processes of one job. No method blocks for long."""

    def poll(self) -> list[BackendEvent]:
        """Events observed since the last call, in order; never blocks."""
        ...

    def on_step(self, step: int) -> None:
        """The job reached ``step``; the coordinator calls it only when settled (no resize in
        flight, no event waiting for its decision). Scripted backends fire the next group of
        events due by then (one group per call, and not before the group fired before was
        polled); the Slurm backend ignores it."""
        ...

    def request(self, action: RequestNodes) -> None:
        """Ask for more nodes; a :class:`Grant` with ``request=action.key`` follows, maybe."""
        ...

    def release(self, action: ReleaseDevices) -> None:
        """Give devices back; those not held are ignored."""
        ...

    def launch(self, action: LaunchWorkers) -> None:
        """Start the workers; vranks already running are left alone.

        Raises:
            BackendError: a device the job does not hold, or one another worker runs on.
        """
        ...

    def stop(self, action: StopWorkers) -> None:
        """Signal the workers to stop (returns at once; :class:`WorkerExited` follows)."""
        ...

    def workers(self) -> Mapping[int, WorkerState]:
        """The worker processes started by this backend, by vrank (latest per vrank)."""
        ...

    def close(self) -> None:
        """Stop every worker still running and free what the backend holds."""
        ...

    # The optional part: a backend without one of these inherits :class:`BackendDefaults`'s.

    def cancel_request(self, action: CancelRequest) -> None:
        """Withdraw a request not granted yet; a granted or unknown one is left alone."""
        ...

    def request_can_be_met(self, key: str) -> bool:
        """Whether the pending request ``key`` can still be granted (False: it cannot, e.g.
        more nodes than the cluster has free)."""
        ...

    @property
    def pending_reasons(self) -> Mapping[str, str | None]:
        """Why each pending request waits (Slurm's reason), by request key."""
        ...

    def usable_nodes(self) -> int | None:
        """The nodes this job can hold now (None: not known now, the last count stays)."""
        ...

    def adopt(self, recorded: Sequence[WorkerState]) -> list[int]:
        """Take up the workers an earlier coordinator of the job launched: the vranks of
        those still alive."""
        ...

    def keep_state(self, path: Path, *, resume: bool) -> None:
        """Keep the backend's own state in ``path`` (``resume``: take up what is there)."""
        ...


class BackendDefaults:
    """The optional methods of :class:`Backend`, as a backend without them behaves: a
    backend inherits this and overrides the ones it has."""

    def cancel_request(self, action: CancelRequest) -> None:
        """No withdrawal: the request runs its course."""

    def request_can_be_met(self, key: str) -> bool:
        """Nothing known against it: True."""
        return True

    @property
    def pending_reasons(self) -> Mapping[str, str | None]:
        """No reasons known."""
        return {}

    def usable_nodes(self) -> int | None:
        """Not known: the coordinator keeps the count it started with."""
        return None

    def adopt(self, recorded: Sequence[WorkerState]) -> list[int]:
        """Reattaches nothing."""
        return []

    def keep_state(self, path: Path, *, resume: bool) -> None:
        """No state of its own to keep."""


def perform(backend: Backend, action: Action) -> None:
    """Carry out one action on ``backend``."""
    match action:
        case RequestNodes():
            backend.request(action)
        case ReleaseDevices():
            backend.release(action)
        case LaunchWorkers():
            backend.launch(action)
        case StopWorkers():
            backend.stop(action)
        case CancelRequest():
            backend.cancel_request(action)
        case _:
            raise BackendError(f"unknown action {action!r}")


def _nodes(devices: tuple[Device, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(d.node for d in devices))
