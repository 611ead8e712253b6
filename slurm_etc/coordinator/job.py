"""What one job's coordinator keeps between the turns of its loop, by concern.

The coordinator (``loop.py``) holds these few values and nothing else of its own: what the
job holds (``reconcile.Holdings``, frozen, replaced whole by the pure functions of
``reconcile.py`` and ``devices.py``), the resize in flight and what it leaves behind
(:class:`Resizing`), the node request and the partition's count (:class:`NodeRequest`),
the workers launched (:class:`Launches`), what a restart took up (:class:`Restart`), where
the job is in its life (:class:`Phase`) and what the loop watches over time
(:class:`Watch`). The edges it acts through (backend, record, channel, store, clock) are
:class:`Edges`; what it runs, :class:`JobSpec`.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.alloc.topology import ClusterTopology, Device
from slurm_etc.lifecycle import JobState
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.protocol.env import DEFAULT_REATTACH_WAIT_S
from slurm_etc.protocol.recovery import Recovery

from . import outlook
from .backend import Backend, request_key
from .journal import Journal
from .pause import PauseTracker
from .reconcile import InflightResize, LateAnswers

# How long a launched worker has to say Hello (slurm-etc run --join-timeout): a cold import of
# torch and megatron-core takes seconds; a script that never calls run_worker never says it.
DEFAULT_JOIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class JobSpec:
    """What the coordinator runs.

    Attributes:
        job_id, name: the job's id and name.
        argv: the worker command (the user's training script ending in ``run_worker``).
        job: model and batch (what the configuration chooser and the planner need).
        policy: the admin's resize policy for the job's partition/account.
        hardware: device and link figures for the chooser's estimates.
        worker_timeout_s: bound of every worker collective and of a resize.
        env: extra environment for every worker.
        recovery: peer copies and periodic checkpoints the workers keep (passed to them),
            from which a loss that no replica covers is rebuilt.
        reattach_wait_s: how long a worker whose link to this coordinator is down (libzmq's
            heartbeats every HEARTBEAT_S keep it up) waits for it before it exits.
        join_timeout_s: how long a launched worker has to say Hello; one that does not, or
            exits before, never joined (see :func:`.observe.never_joined`). A joiner of
            a grow also has it, from its launch, to say Ready (warmed up); one that does not
            is stopped and the resize is replanned without its device.
        model_from_workers: ``job.model`` is provisional (no ``--model``): the first
            layout's workers say the model (:class:`ModelBuilt`) and it is planned with.
        batch_from_workers: likewise ``job``'s batch (no ``--global-batch``).
        micro_batch_given: ``job.micro_batch`` is the user's (``--micro-batch`` without
            ``--global-batch``): the workers' micro batch must be it, the global batch is
            theirs.
        model_label: where ``job.model`` came from, for the one line of a mismatch
            (``--model tiny``).
        give_up_after_s: how long the job waits with nothing training and no node request
            that can be met pending before it ends failed (:mod:`.outlook`).
        order_after_joined: order the old layout of a resize only once every joiner said
            Ready: it trains on while they start and warm up aside (import, connect), and a
            joiner that never gets ready pauses nobody (docs/zero-stall.md). False: at once,
            the old layout waiting in the resize's rendezvous for the joiners to start.
        prepare_while_training: the old layout builds the new world (migration group,
            program, staging in a thread; groups, model, DDP, optimizer at a step boundary)
            while it trains on, and pauses at a later boundary (``Resize``'s field).
        prepare_aside_min_grace_s: under a preemption notice, before any resize of this
            coordinator was prepared beside training (and timed), with less grace left than
            this the old layout does not prepare beside training: it stops and prepares at
            full speed (on shared cores, preparing beside training takes several times as
            long, and the deadline comes first). Once one was timed, the grace must hold
            ``reconcile.ASIDE_MARGIN`` times the longest such preparation and the plan's estimate;
            always as many times ``reconcile.ASIDE_STEPS`` training steps (its stages wait for
            step boundaries).
    """

    job_id: str
    name: str
    argv: tuple[str, ...]
    job: TrainingJob
    policy: EffectivePolicy
    hardware: Hardware
    worker_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)
    recovery: Recovery = field(default_factory=Recovery)
    reattach_wait_s: float = DEFAULT_REATTACH_WAIT_S
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    order_after_joined: bool = True
    prepare_while_training: bool = True
    prepare_aside_min_grace_s: float = 15.0
    model_from_workers: bool = False
    batch_from_workers: bool = False
    micro_batch_given: bool = False
    model_label: str = "--model"
    give_up_after_s: float = outlook.DEFAULT_GIVE_UP_AFTER_S


@dataclass
class Edges:
    """What the coordinator acts through: the backend, the record (``store``, written
    through ``journal``), the control channel, the rendezvous store's ``post`` and
    ``close_vote`` hooks (None: a resize with a death is waited out, the workers find the
    order on the channel), the clock, the progress callback and a test's crash hook."""

    backend: Backend
    store: Any
    channel: Any
    journal: Journal
    topology: ClusterTopology
    clock: Callable[[], float] = time.time
    progress: Callable[[dict[str, Any]], None] = lambda _s: None
    # called at each of loop.KILL_POINTS: a test kills the coordinator there
    crash: Callable[[str], None] = lambda _point: None
    # sets a key in the job's rendezvous store (an order naming the dead, which ends the
    # survivors' step agreement at once)
    post: Callable[[str, bytes], None] | None = None
    # closes a resize's commit vote as abort unless decided, giving what it holds
    close_vote: Callable[[str], bytes] | None = None


@dataclass
class Resizing:
    """The resize in flight (``inflight``) and what resizes leave behind: the highest
    generation ordered (an aborted one included), joiners alive after their resize aborted
    (``idle``), the devices given back once the resize commits, when each committed, the
    longest preparation beside training (less its pause: what a notice's grace must hold to
    prepare aside), the newest generation the store saw decided commit (set on the store's
    thread) and the answers still to come to the resize last committed from its decision."""

    inflight: InflightResize | None = None
    last_generation: int = 0
    idle: set[int] = field(default_factory=set)
    release_later: set[Device] = field(default_factory=set)
    times: list[float] = field(default_factory=list)
    aside_preparation_s: float | None = None
    commit_heard: int = 0
    agreed_heard: int = 0  # the newest generation a step's decision held (the store's thread)
    late: LateAnswers | None = None


@dataclass
class NodeRequest:
    """The job's node requests: how many were made (``count``: the newest one's key), the
    nodes the pending one asks for (``growing``; 0: none pending), when it went out and was
    last looked at, and the partition's usable nodes for this job (when last read, and
    whether a loss since makes it stale)."""

    partition_nodes: int
    count: int = 0
    growing: int = 0
    sent_at: float | None = None
    overdue_checked: float = 0.0
    partition_read_at: float | None = None
    partition_stale: bool = False

    @property
    def key(self) -> str:
        """The key of the newest node request (``grow-<n>``): the backend's, the record's."""
        return request_key(self.count)


@dataclass
class Launches:
    """The workers launched: those that have not said Hello (vrank -> (generation,
    launched at)), the generation each vrank's newest process was launched for, those
    done training, the first reason a worker of each generation gave for exiting on its
    own, the devices failed because a worker died (not lost by the backend), the anchor
    (its devices and allocation) and how often each of its devices was used again."""

    unjoined: dict[int, tuple[int, float]] = field(default_factory=dict)
    launched_in: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    exit_said: dict[int, str] = field(default_factory=dict)
    exit_failed: set[Device] = field(default_factory=set)
    pinned: set[Device] = field(default_factory=set)
    anchor_allocation: str | None = None
    reused: Counter[Device] = field(default_factory=Counter)


@dataclass
class Restart:
    """What a restarted coordinator took up: the first layout's generation (> 0 after a
    restart), whether the layout is a killed coordinator's taken up again and whether any
    of its workers came back, its members found dead (device -> vrank, failed once held
    again; and those vranks), the oldest generation a Hello may train in, the generations
    whose resizes the restart closed aborted, and a layout lost whole and started again
    (its generation and last step: recorded with the next start)."""

    generation: int = 0
    reattached: bool = False
    came_back: bool = False
    dead_at_reattach: dict[Device, int] = field(default_factory=dict)
    found_dead: frozenset[int] = frozenset()
    admit_from: int = 0
    gave_up: frozenset[int] = frozenset()
    rebuilt_into_next: tuple[int, int] | None = None


class Life(Enum):
    """Where the job is in its life: STARTING, then TRAINING once a resize commits (or a
    restart takes a layout up), ENDING at the backend's word; ENDED from any of them. Only a
    start (the first layout, or one started again from a checkpoint) goes back, to
    STARTING."""

    # nothing launched yet, or a layout that a start launched and no resize has committed
    # into: nothing of it may have trained, so a worker of it that never joins ends the job
    STARTING = "starting"
    # a layout reached by a resize, or taken up at a restart
    TRAINING = "training"
    # the backend ended training: the layout is stopped once no resize is in flight, and
    # the job ends finished when every worker has exited
    ENDING = "ending"
    # cancelled, or stopped by what cannot go on (a model that differs, a first-layout
    # worker that never joined): the loop ends at its next look
    ENDED = "ended"


@dataclass
class Phase:
    """Where the job is in its life (:class:`Life`, with why it is ending or ended and, once
    ended, as what), whether the Stop of an ending went out; and what is due for a
    decision: whether one is (``dirty``; or due at the first step), the events recorded
    and not yet decided on, the last decision's reason and Pause, and whether a decision
    waits for the record (said once)."""

    life: Life = Life.STARTING
    why: str | None = None
    ends_as: JobState | None = None
    stop_sent: bool = False
    dirty: bool = True
    dirty_at_first_step: bool = False
    event_ids: list[Any] = field(default_factory=list)
    reason: str = ""
    paused: str | None = None
    held_for_record: bool = False

    def started(self) -> None:
        """A start launched a layout (the first, or one started again)."""
        if self.life in (Life.STARTING, Life.TRAINING):
            self.life = Life.STARTING

    def trains(self) -> None:
        """A resize committed, or a restart took a layout up."""
        if self.life is Life.STARTING:
            self.life = Life.TRAINING

    def end_training(self, why: str) -> None:
        """The backend ended training (its first word stands)."""
        if self.life in (Life.STARTING, Life.TRAINING):
            self.life, self.why = Life.ENDING, why

    def end(self, state: JobState, why: str) -> None:
        """The job ends as ``state`` (failed or cancelled) for ``why`` at the loop's next
        look; the first end stands (a signal handler may call it: one assignment)."""
        if self.life is not Life.ENDED:
            self.life, self.why, self.ends_as = Life.ENDED, why, state

    @property
    def failed(self) -> str | None:
        """Why the job must stop failed; None unless it must."""
        return self.why if self.ends_as is JobState.FAILED else None


@dataclass
class Watch:
    """What the loop watches over time: since when no worker of the layout lives, the
    outlook of a job with nothing training (since when stranded, what was said, when last
    asked), when the last notice came and the reaction times measured, the last step's
    time, and the pauses the new layouts' processes report."""

    dead_since: float | None = None
    stranded_since: float | None = None
    outlook_said: str | None = None
    outlook_at: float = 0.0
    noticed_at: float | None = None
    reaction_s: list[float] = field(default_factory=list)
    step_s: float | None = None
    pauses: PauseTracker = field(default_factory=PauseTracker)
