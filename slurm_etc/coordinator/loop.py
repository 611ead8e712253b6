"""The coordinator of one elastic job: a reconcile loop from resource events to resizes.

Observed state comes from the backend (grants, preemption notices, losses, worker exits) and
from the workers over the control channel (progress, resize outcomes, exits); desired state
from :func:`slurm_etc.policy.decide` under the job's policy. One generation at a time:

* every event is a row in the store before it is acted on; every decision is logged with its
  one-line reason when the reason changes;
* a first start launches the workers of the first layout (their layout in their
  environment); a resize plans the migration (the workers plan the same and check the
  digest), launches the processes that join, and orders every worker of old ∪ new to move
  at the next step boundary; devices leave the job (released, or their notice honoured)
  only once the migration committed;
* a preemption notice starts the resize at once (its reaction time is measured), and the
  plan's estimate is held against the grace: a resize that cannot finish in time is logged
  and recorded as such;
* a loss without grace tells the planner which old devices are dead; where every shard they
  held has a surviving replica the resize proceeds in memory. Where some has none (dp=1,
  distributed-optimizer shards) and the job keeps peer copies or periodic checkpoints
  (:class:`~slurm_etc.protocol.recovery.Recovery`), the resize is ordered anyway, planned
  as if the lost ranks were there: the workers roll back to the newest peer copies (a
  survivor stands in for each lost rank) or load the last checkpoint, and the steps trained
  since are recorded as lost and trained again. Otherwise the job stops with one line
  saying so.
* with nothing training and nothing that can come (no device the model fits, every worker
  gone, no node request the cluster can still grant), the job ends failed after
  ``give_up_after_s`` with one line saying why and what would help; while a request that
  can be met is pending it waits, and the job's reason in the record (``status``) says for
  what (:mod:`.outlook`).
"""
from __future__ import annotations

import gc
import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.alloc.topology import ClusterTopology, Device, format_devices
from slurm_etc.lifecycle import JobState, ProcessOutcome, ResizeOutcome
from slurm_etc.migrate.decision import ABORT, COMMIT
from slurm_etc.plan import Layout, Topology
from slurm_etc.policy.decide import (
    JobView,
    Notice,
    Pause,
    Release,
    RequestGrow,
    ResizeDecision,
    WithdrawRequest,
    decide,
)
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.protocol.env import (
    DEFAULT_REATTACH_WAIT_S,
    GPUS_PER_NODE,
    LAYOUT,
    REATTACH_WAIT,
    TIMEOUT,
)
from slurm_etc.protocol.messages import (
    ENCODER,
    Abort,
    CopiesChosen,
    Exited,
    Hello,
    ModelBuilt,
    ModelReport,
    Progress,
    Ready,
    Resized,
    Resumed,
    Stop,
    format_layout,
)
from slurm_etc.protocol.recovery import RESUME_FROM, Recovery, newest_checkpoint
from slurm_etc.protocol.rendezvous import GenerationKeys, commit_decision
from slurm_etc.store import jobs as record
from slurm_etc.store.jobs import PEER_COPIES_EVENT

from . import devices, job_model, outlook, reconcile, resume, verdicts
from .backend import (
    Backend,
    BackendError,
    CancelRequest,
    EndTraining,
    Grant,
    LaunchWorkers,
    Loss,
    PreemptNotice,
    ReleaseDevices,
    RequestFailed,
    RequestNodes,
    StopWorkers,
    WorkerExited,
    WorkerSpec,
    perform,
    request_key,
)
from .journal import Journal
from .pause import MeasuredPause, PauseTracker
from .reconcile import InflightResize, JobStopped

logger = logging.getLogger(__name__)

POLL_S = 0.02
# At the end, how long a record that fell behind (a full disk) is given to catch up.
END_CATCH_UP_S = 10.0
# Every worker of the layout gone and nothing pending for this long: the job has failed.
DEAD_GRACE_S = 1.0
# said once when a decision waits for the record to catch up (record, then act)
HELD_FOR_RECORD = "decisions wait for the job record"
# How long a launched worker has to say Hello (slurm-etc run --join-timeout): a cold import of
# torch and megatron-core takes seconds; a script that never calls run_worker never says it.
DEFAULT_JOIN_TIMEOUT_S = 300.0
# The partition's usable nodes are read again at a decision this long after the last read
# (at once after a loss): one sinfo a minute at most, while a node DOWN that this job does
# not hold raises no event.
PARTITION_REREAD_S = 60.0
# How often the loop asks whether a job with nothing training has anything to wait for.
OUTLOOK_EVERY_S = 1.0
# where the crash hook is called (a test's SIGKILL: slurm_etc.testing.hooks): events
# polled and not recorded; recorded and not acted on; a node request sent (recorded before
# it); a resize ordered and its outcome not recorded; its commit recorded and not acted on
# (old generation not closed, new one not opened, nothing released)
KILL_POINTS = ("before-record", "after-record", "after-request", "after-order",
               "after-commit-record")
# reached only with workers that vote (a resize's commit decision recorded, no rank told)
VOTE_KILL_POINTS = ("after-commit-decided",)


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
            exits before, never joined (see :meth:`Coordinator._never_joined`). A joiner of
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


class Coordinator:
    """One job's reconcile loop (see the module doc). ``run`` returns the job's end state."""

    def __init__(self, spec: JobSpec, backend: Backend, store: Any, channel: Any,
                 topology: ClusterTopology, *, clock: Callable[[], float] = time.time,
                 progress: Callable[[dict[str, Any]], None] | None = None,
                 crash: Callable[[str], None] | None = None,
                 post: Callable[[str, bytes], None] | None = None,
                 close_vote: Callable[[str], bytes] | None = None) -> None:
        self.spec, self.backend, self.store, self.channel = spec, backend, store, channel
        # sets a key in the job's rendezvous store (an order naming the dead, which ends
        # the survivors' step agreement at once); None: the workers find it on the channel
        self.post = post
        # closes a resize's commit vote as abort unless decided, giving what it holds (the
        # rendezvous store's compare-and-set); None: a resize with a death is waited out
        self.close_vote = close_vote
        # called at each of KILL_POINTS: a test kills the coordinator there; by default
        # nothing happens
        self.crash = crash or (lambda _point: None)
        self.journal = Journal(store)
        self.topology = topology
        self.clock = clock
        self.progress = progress or (lambda _s: None)
        # what the job holds (layout, generation, vranks, devices, notices, losses, the
        # last step): one state, replaced whole by the pure functions of reconcile.py and
        # devices.py (read through the properties below)
        self.holdings = reconcile.Holdings.nothing()
        self.pinned: set[Device] = set()
        self.last_generation = 0  # the highest generation ordered (an aborted one included)
        self.idle: set[int] = set()  # joiners alive after their resize aborted
        self.inflight: InflightResize | None = None
        self.release_later: set[Device] = set()
        self.resize_times: list[float] = []
        self.growing = 0
        self.requests = 0
        self.request_sent_at: float | None = None  # when the pending request went out
        self._overdue_checked = 0.0
        # the partition's nodes this job can hold (_partition_nodes), and when last read
        self.partition_nodes = len(topology.nodes)
        self._partition_read_at: float | None = None
        self._partition_stale = False  # a loss since: read again at the next decision
        self.done: set[int] = set()
        # generation -> the first reason a worker of it gave for exiting on its own (the
        # line the job fails with when every worker of it is gone)
        self.exit_said: dict[int, str] = {}
        self.dirty = True
        self.dirty_at_first_step = False
        self.reason = ""
        self.reaction_s: list[float] = []
        # the longest a resize prepared beside training took from its order to its commit,
        # less its pause (None: none yet): what a notice's grace must hold to prepare aside
        self.aside_preparation_s: float | None = None
        self.step_s: float | None = None  # the last step's time (rank 0's): None before one
        self._noticed_at: float | None = None
        # ids of events recorded and not yet decided on (a Deferred while the record is
        # behind: see journal.py)
        self._event_ids: list[Any] = []
        self.restart_generation = 0  # the first layout's generation (after a restart: > 0)
        self.cancelled: str | None = None  # why the job was cancelled (a signal)
        # why the backend ended training (EndTraining), and whether the Stop went out
        self.ending: str | None = None
        self._stop_sent = False
        self._dead_since: float | None = None  # since when no worker of the layout lives
        # the outlook of a job with nothing training (outlook.py): since when it is
        # stranded, what the record's reason says of it, when it was last asked
        self._stranded_since: float | None = None
        self._outlook_said: str | None = None
        self._outlook_at = 0.0
        self.paused: str | None = None  # the last decision's Pause reason (none: None)
        # launched workers that have not said Hello yet: vrank -> (generation, launched at)
        self.unjoined: dict[int, tuple[int, float]] = {}
        self.first_layout = False  # the layout is the first one launched (nothing committed)
        self.fatal: str | None = None  # why the job must stop, found while observing
        # the model and the batch planned with, each with who said it, that every worker's
        # ModelBuilt must match; None: not known yet (the first ModelBuilt says it)
        self.known = job_model.Known.given(
            spec.job, model_from_workers=spec.model_from_workers,
            batch_from_workers=spec.batch_from_workers,
            micro_batch_given=spec.micro_batch_given, model_label=spec.model_label)
        self.pauses = PauseTracker()  # the gaps the new layouts' processes report
        # the newest generation whose commit vote the store saw decided commit (set on the
        # store's thread by commit_decided; the loop settles that resize from it)
        self.commit_heard = 0
        # the answers still to come to the resize last committed from its decision
        self.late: reconcile.LateAnswers | None = None
        self.reattached = False  # the layout is a killed coordinator's, taken up again
        # its members found dead at the restart: failed once the backend holds their
        # devices again (a grant whole again would otherwise clear the failure)
        self.dead_at_reattach: dict[Device, int] = {}
        self.found_dead: frozenset[int] = frozenset()  # those vranks (no process to watch)
        # whether a worker of the reattached layout said Hello to this coordinator, and the
        # devices failed because a worker died (not lost by the backend): a reattached
        # layout none of whose workers came back starts again (_start_again)
        self.came_back = False
        self.exit_failed: set[Device] = set()
        # the anchor's allocation, and how often each of its devices was used again after
        # its worker died (_reuse_anchor)
        self.anchor_allocation: str | None = None
        # the generation each vrank's newest process was launched for (an exit of an older
        # one is not news of the one that runs)
        self.launched_in: dict[int, int] = {}
        # a layout lost whole and started again from a checkpoint: (its generation, the
        # step it reached), recorded with the next start (_record_rebuild)
        self.rebuilt_into_next: tuple[int, int] | None = None
        self._held_for_record = False  # a decision waits for the record (said once)
        self.reused: Counter[Device] = Counter()
        # a worker that lost its coordinator and says Hello again is taken up only if it
        # trains in this generation or a later one (not a killed coordinator's worker when
        # the job started again without them)
        self.admit_from = 0
        # generations of resizes the restart closed as aborted: a worker that trains in one
        # heard a commit the record never had (a full disk), and is not taken up
        self.gave_up: frozenset[int] = frozenset()
        channel.admit = self._admits

    # -- what the job holds (self.holdings), by name ---------------------------------------

    @property
    def layout(self) -> Layout | None:
        return self.holdings.layout

    @property
    def generation(self) -> int:
        return self.holdings.generation

    @property
    def vranks(self) -> Mapping[int, Device]:
        return self.holdings.vranks

    @property
    def held(self) -> Mapping[Device, str]:
        return self.holdings.held

    @property
    def notices(self) -> Mapping[Device, tuple[float, str]]:
        return self.holdings.notices

    @property
    def lost(self) -> frozenset[Device]:
        return self.holdings.lost

    @property
    def leaving(self) -> frozenset[int]:
        """Vranks whose process left the job at a commit and may not have exited yet."""
        return self.holdings.leaving

    @property
    def step(self) -> int:
        return self.holdings.step

    @property
    def loss(self) -> float | None:
        return self.holdings.loss

    # -- the loop -------------------------------------------------------------------------

    def run(self, *, deadline_s: float | None = None) -> str:
        """Reconcile until the workers finished training, the job failed, or
        ``deadline_s`` passed. Returns ``finished``, ``failed`` or ``timeout``."""
        t_end = None if deadline_s is None else time.monotonic() + deadline_s
        self._recover()
        # the imports' ~115k objects out of the cyclic collector's sight (once a process): a
        # full collection of them takes ~0.12 s on 2 cores, and the collector starts one
        # whenever enough allocations came, between a notice and its order as anywhere
        if not gc.get_freeze_count():
            gc.collect()
            gc.freeze()
        record.set_job_state(self.store, self.spec.job_id, JobState.RUNNING)
        try:
            while True:
                if self.cancelled is not None:
                    return self._end(JobState.CANCELLED, self.cancelled)
                self.journal.retry()
                # status tells a live coordinator from a lost one by this (at most 1/30 s)
                record.heartbeat(self.store, self.spec.job_id)
                # the workers first: a step they report can fire a scripted cluster's events
                # (a loss kills its workers at once), polled and decided in this pass
                self._observe_workers()
                self._observe_backend()
                self._join_deadlines()
                if self.fatal is not None:
                    raise JobStopped(self.fatal)
                if verdicts.finished(self.layout, self.done):
                    if self.inflight is not None:
                        self._finished_first(self.inflight)
                    return self._end(JobState.FINISHED, f"trained to step {self.step}")
                dead = self._nothing_left() or self._outlook()
                if dead is not None:
                    logger.error("job %s stops: %s", self.spec.job_id, dead)
                    return self._end(JobState.FAILED, dead)
                if self.inflight is not None:
                    self._settle()
                elif self.ending is not None:
                    self._stop_training()
                elif (self.dirty or self._request_overdue()) and self._record_holds():
                    self._decide()
                if t_end is not None and time.monotonic() > t_end:
                    return self._end(JobState.FAILED, f"no end within {deadline_s:.0f} s",
                                     "timeout")
        except (JobStopped, BackendError) as err:  # the backend refused an action: one line
            logger.error("job %s stops: %s", self.spec.job_id, err)
            return self._end(JobState.FAILED, str(err))

    def _record_holds(self) -> bool:
        """Whether the record holds everything so far, so that a decision may act (record,
        then act). While a full disk keeps it behind, nothing is launched, resized,
        released or requested: a coordinator killed then would restart on a record that
        does not know what it did (soak seeds 101, 104, 107, 202: workers launched
        unrecorded ran on beside the ones a restart launched again). Training goes on in
        the layout it has; the decision is taken once the record caught up."""
        if not self.journal.behind:
            self._held_for_record = False
            return True
        self.journal.retry(hurry=True)
        if not self.journal.behind:
            self._held_for_record = False
            return True
        if not self._held_for_record:
            self._held_for_record = True
            logger.warning("%s (%d write(s) behind: %s): nothing is launched, resized or "
                           "released that it could not hold; generation %d trains on",
                           HELD_FOR_RECORD, self.journal.behind, self.journal.last_error,
                           self.generation)
        return False

    @property
    def _request_key(self) -> str:
        """The key of the newest node request (``grow-<n>``): the backend's, the record's."""
        return request_key(self.requests)

    @property
    def _stop_generation(self) -> int:
        return verdicts.stop_generation(self.generation, self.last_generation)

    def _stop_training(self) -> None:
        """The backend ended training and no resize is in flight: Stop the layout's
        workers (once); each finishes its step and exits, and the job ends finished when
        all have (as at ``train_steps``)."""
        if self._stop_sent or self.layout is None:
            return
        self._stop_sent = True
        live = set(self.layout.devices) - self.done
        logger.info("job %s: training ends at the backend's word (%s)", self.spec.job_id,
                    self.ending)
        self.channel.broadcast(Stop(self.spec.job_id, self._stop_generation,
                                    self.ending or ""), live)

    def cancel(self, reason: str) -> None:
        """End the job as ``cancelled`` with ``reason`` at the loop's next turn (a signal
        handler calls it: nothing is cut short in the middle of a record write or an
        action)."""
        self.cancelled = reason

    def _nothing_left(self) -> str | None:
        """Why the job cannot go on when every worker of the layout has exited and nothing
        is pending (no resize in flight, no node request open, no event waiting for its
        decision) for DEAD_GRACE_S (a worker's last report may trail its exit); None
        while anything is alive or pending. A vrank the backend never reported is not
        counted as dead. With a checkpoint the first layout starts again from it instead
        (an open node request then waits no longer)."""
        if self.layout is None or self.inflight is not None or self._event_ids:
            self._dead_since = None
            return None
        workers = self.backend.workers()
        if verdicts.anyone_left(self.layout, workers, self.found_dead) or (
                # a node request may bring devices; a checkpoint brings the state back now
                # (the directory listed only once every worker is gone)
                self.growing and newest_checkpoint(self.spec.recovery.checkpoint_dir) is None):
            self._dead_since = None
            return None
        now = time.monotonic()
        if self._dead_since is None:
            self._dead_since = now
        if now - self._dead_since < DEAD_GRACE_S:
            return None
        got = verdicts.none_left(
            generation=self.generation, step=self.step, members=len(self.layout.devices),
            reattached=self.reattached, came_back=self.came_back,
            newest=newest_checkpoint(self.spec.recovery.checkpoint_dir),
            exits=[w for w in map(workers.get, self.layout.devices) if w is not None],
            said=self.exit_said.get(self.generation))
        if isinstance(got, verdicts.Stop):
            return got.line
        self._start_again(got.why)
        return None

    def _outlook(self) -> str | None:
        """Whether a job with nothing training has anything left to wait for (asked every
        OUTLOOK_EVERY_S, :func:`outlook.outlook`): what it waits for, or since when it is
        stranded, goes into the record's reason (``status``) when it changes; the line the
        job fails with once stranded past ``give_up_after_s``, else None."""
        now = time.monotonic()
        if now < self._outlook_at + OUTLOOK_EVERY_S:
            return None
        self._outlook_at = now
        wall = self.clock()
        got = outlook.outlook(self._prospects(wall), self._stranded_since, wall,
                              self.spec.give_up_after_s)
        said: str | None
        match got:
            case outlook.GiveUp():
                return got.line
            case outlook.Stranded():
                self._stranded_since = got.since
                said = got.what
            case outlook.Waits():
                self._stranded_since = None
                said = got.what
            case _:
                self._stranded_since = None
                said = None
        if said != self._outlook_said:
            if said is not None:
                logger.warning("job %s: %s", self.spec.job_id, said)
            elif self._outlook_said is not None:
                logger.info("job %s: training again", self.spec.job_id)
            self._outlook_said = said
            self.journal.write(record.set_job_state, self.spec.job_id, JobState.RUNNING,
                               reason=None if said is None else said[:250])
        return None

    def _prospects(self, wall: float) -> outlook.Prospects:
        """What the job could go on with now (the inputs of :func:`outlook.outlook`). A
        layout's worker the backend never reported counts as alive (it may be starting);
        the loop over the layout ends at its first live worker."""
        training = self.layout is not None and verdicts.anyone_left(
            self.layout, self.backend.workers(), self.found_dead)
        if training or self.inflight is not None or self._event_ids or \
                self.ending is not None:
            return outlook.Prospects(busy=True)
        if not self.held:
            why = "the job holds no device"
        elif self.paused is not None:
            why = f"paused: {self.paused}"
        elif self.layout is not None:
            why = f"every worker of generation {self.generation} exited"
        else:
            why = "no layout started on the devices held"
        key = self._request_key
        since = (None if self.request_sent_at is None
                 else wall - (time.monotonic() - self.request_sent_at))
        met = self.backend.request_can_be_met(key) if self.growing else True
        return outlook.Prospects(busy=False, idle_why=why, request_nodes=self.growing,
                                 request_met=met, request_since=since,
                                 request_held=self.backend.pending_reasons.get(key) or "")

    def _recover(self) -> None:
        """Resume from the record (a coordinator restarted on the same job and database):
        a migration that was in flight is closed as aborted, once (its workers are
        restarted, nothing of it was committed); events recorded and not handled are
        handled by the first decision; generation numbers and request keys continue after
        the recorded ones (no duplicate request, no generation recorded twice); a node
        request recorded and not yet answered (no grant, no failure) is sent again with its
        own key (a backend that has it does nothing: a Slurm member still pending or running
        is not submitted twice) and the job counts as growing until it is answered. Where
        every worker of the open generation still runs, they are reattached and train on
        from their step (:meth:`_reattach`); else the first layout is launched again, from
        the newest checkpoint if there is one."""
        rolled = self._roll_forward()
        got = record.recover(self.store, self.spec.job_id)
        self._seed_decisions([t for _f, t in rolled], got.aborted)
        self._event_ids += list(got.pending_events)
        self.requests = max(self.requests, got.requests)
        if got.requests:
            self._resend_open_request(got.open_request)
        if got.last_generation >= 0 and self._reattach(got):
            # a worker still in the vote of a resize rolled forward trains in the
            # generation before it until it hears the decision
            self.admit_from = min([self.generation, *(f for f, _t in rolled)])
            return
        if got.last_generation >= 0:
            self.rebuilt_into_next = self._trained_last()
            self.restart_generation = got.last_generation + 1
            self.admit_from = self.restart_generation
            self.last_generation = max(self.last_generation, self.restart_generation)
            logger.warning("coordinator restarted: resuming job %s after generation %d (%d "
                           "events pending, %d migrations aborted); workers start again",
                           self.spec.job_id, got.last_generation, len(got.pending_events),
                           len(got.aborted))

    def _trained_last(self) -> tuple[int, int] | None:
        """The newest generation that trained a step, and its last step recorded: what a
        restart that finds no worker to reattach starts again from (the way through the
        checkpoint is recorded with the next start, the steps since it lost)."""
        detail = record.job_detail(self.store, self.spec.job_id)
        ran = [g for g in detail.generations if g.last_step] if detail else []
        if not ran:
            return None
        g = max(ran, key=lambda g: g.number)
        return g.number, int(g.last_step or 0)

    def _roll_forward(self) -> list[tuple[int, int]]:
        """Resizes the killed coordinator saw decided commit (:meth:`commit_decided`) and
        did not record committed: recorded so now, the old generation closed, the new one
        opened on the layout recorded with the decision, from the old one's last step (its
        workers train in it: :meth:`_reattach` takes them up). Returns each one's
        generations (from, to)."""
        detail = record.job_detail(self.store, self.spec.job_id)
        if detail is None:
            return []
        # by the generation it opens (the migration's id may not have been written yet when
        # the decision was: a record catching up after a full disk)
        still_open = {m.to_generation: m for m in detail.migrations if m.outcome is None}
        gens = {g.number: g for g in detail.generations}
        rolled = []
        for e in detail.events:
            p = e.payload
            if e.kind != "commit-decided" or not isinstance(p, dict) or \
                    p.get("generation") not in still_open:
                continue
            m = still_open.pop(p["generation"])
            old = gens.get(m.from_generation)
            step = max(old.last_step or 0, old.first_step or 0) if old is not None else 0
            self.journal.write(record.record_migration_finish, m.id,
                               outcome=ResizeOutcome.COMMITTED)
            if old is not None and old.ended_at is None:
                self.journal.write(record.close_generation, self.spec.job_id, old.number,
                                   reason="resized (committed before the coordinator's "
                                          "restart)", last_step=old.last_step,
                                   last_loss=old.last_loss)
            vranks = {int(v): Device.parse(d) for v, d in p["vranks"].items()}
            self.journal.write(record.open_generation, self.spec.job_id, m.to_generation,
                               p["layout"], [int(v) for v in p["ranks"]], vranks,
                               first_step=step)
            logger.warning("coordinator restarted: the resize to generation %d was decided "
                           "commit before the kill: recorded committed (%s from step %d)",
                           m.to_generation, p["layout"], step)
            rolled.append((m.from_generation, m.to_generation))
        return rolled

    def _seed_decisions(self, committed: Iterable[int], aborted: Iterable[Any]) -> None:
        """This coordinator's store starts empty: the commit decision of each resize the
        restart settled is set again, so that a worker whose vote lost the store finds it
        there once reattached. The aborted ones' generations are remembered: a worker that
        trains in one is not taken up (:meth:`_admits`)."""
        detail = record.job_detail(self.store, self.spec.job_id)
        to_gen = {m.id: m.to_generation for m in detail.migrations} if detail else {}
        self.gave_up = frozenset(to_gen[m] for m in aborted if m in to_gen)
        if self.post is None:
            return
        decided = [(g, COMMIT) for g in committed] + [(g, ABORT) for g in self.gave_up]
        for gen, value in decided:
            self.post(commit_decision(GenerationKeys(self.spec.job_id, gen).prefix), value)

    def _reattach(self, got: record.ResumePoint) -> bool:
        """Take up the workers of the killed coordinator: the processes recorded at their
        launch (:meth:`_record_launch`) that the backend finds still running, the same ones
        (pid and start time). Where some worker of the open generation is alive: the
        layout, vranks and step come from the record, the workers say Hello again to this
        coordinator (it binds the address they look at, see run.py) and train on from the
        step they are at; nothing is relaunched, no step is trained twice. Its members found
        dead are a loss: their devices count as failed (once held again) and the first
        decision resizes around them, as after a node lost without grace (from a replica,
        or rebuilt from peer copies or a checkpoint, the lost steps trained again). A resize in
        flight at the kill was closed as aborted by the recovery (its commit vote goes
        through the rendezvous store, which died with the coordinator): its joiners that
        live are stopped, and the workers drop its order when they reattach. With no
        worker of the layout alive, or a commit past the open generation recorded and not
        acted on (the workers left the layout the record has), every live one is stopped
        and False is returned: the first layout starts again (from the newest checkpoint).
        A backend that adopts nothing (:class:`BackendDefaults`) reattaches nothing."""
        detail = record.job_detail(self.store, self.spec.job_id)
        if detail is None:
            return False
        open_gen = resume.open_generation(detail)
        if open_gen is None:
            return False
        workers = resume.launched(detail.events)
        self.launched_in = {v: w.generation for v, w in workers.items()}
        alive = set(self.backend.adopt(list(workers.values())))
        if not alive:
            return False
        got_up = resume.reattach(detail, open_gen, workers, alive)
        if isinstance(got_up, resume.Refuse):
            perform(self.backend, StopWorkers(tuple(sorted(alive)), 5.0,
                                              "the layout cannot be reattached whole"))
            logger.warning("coordinator restarted: generation %d cannot be taken up (%s); "
                           "stopping the %d live worker(s) and starting again",
                           got_up.generation,
                           f"none of its vranks {', '.join(map(str, got_up.missing))} alive"
                           if got_up.missing else "its workers moved on past the record",
                           len(alive))
            return False
        gen, members, config = got_up.generation, got_up.layout.devices, got_up.layout.config
        self.holdings = replace(self.holdings, layout=got_up.layout, generation=gen,
                                vranks=got_up.vranks, step=got_up.step, loss=got_up.loss)
        self.last_generation = max(self.last_generation, got.last_generation)
        self.channel.generation = gen
        self.reattached = True
        # joiners of the aborted resize: nothing takes them in
        self.idle = set(got_up.idle)
        live = [v for v in members if v not in got_up.dead]
        self._await_hello(live, gen)
        self.dead_at_reattach = {got_up.vranks[v]: v for v in got_up.dead}
        self.found_dead = got_up.dead
        summary = (f"reattached {len(live)} live worker(s) of generation {gen} "
                   f"({config}) at step {self.step}")
        if got_up.dead:
            summary += (f"; vrank(s) {', '.join(map(str, sorted(got_up.dead)))} dead: lost, "
                        "the layout resizes around them")
        eid = self.journal.write(record.record_event, self.spec.job_id, "reattach",
                                 source="coordinator",
                                 key=f"reattach:g{gen}:{os.getpid()}:{time.time():.3f}",
                                 payload={"summary": summary, "vranks": live,
                                          "dead": sorted(got_up.dead)})
        self.journal.write(record.mark_event_handled, eid, "reattached")
        logger.warning("coordinator restarted: %s (%d events pending, %d migrations aborted)",
                       summary, len(got.pending_events), len(got.aborted))
        return True

    def _admits(self, hello: Hello) -> bool:
        """Whether the sender of ``hello`` is taken for the vrank it names: one just started
        (``step`` < 0), or one that lost its coordinator and trains in a generation this
        coordinator runs."""
        if verdicts.admits(step=hello.step, trained=hello.trained, gave_up=self.gave_up,
                           admit_from=self.admit_from):
            return True
        if hello.trained in self.gave_up:
            logger.warning("vrank %d trains in generation %d, whose resize the record does "
                           "not hold committed (its commit was not written before the kill): "
                           "not taken up", hello.vrank, hello.trained)
        return False

    def _resend_open_request(self, request: record.OpenRequest | None) -> None:
        if request is None or request.key != self._request_key:
            return
        key, nodes = request.key, request.nodes
        refusal = verdicts.refuse_restored(self.spec.policy, len(self.topology.nodes), nodes)
        if refusal is not None:
            # recorded as answered: no later restart sends it either
            eid = self.journal.write(record.record_event, self.spec.job_id, "request-failed",
                                     source="coordinator", key=f"request-refused:{key}",
                                     payload={"request": key, "summary": refusal[:200]})
            self.journal.write(record.mark_event_handled, eid, "dropped at a restart")
            logger.warning("coordinator restarted: request %s is still open but %s; dropped",
                           key, refusal)
            return
        self.growing = int(nodes)
        logger.warning("coordinator restarted: request %s (%d node(s)) is still open; sent "
                       "again under its own key", key, self.growing)
        perform(self.backend, RequestNodes(self.growing, key, "open at a coordinator restart"))

    def _end(self, state: JobState, reason: str, result: str | None = None) -> str:
        reason = reason[:250]
        if self.layout is not None:
            live = set(self.layout.devices) - self.done
            if live:
                self.channel.broadcast(Stop(self.spec.job_id, self._stop_generation, reason),
                                       live)
            try:
                self.journal.write(record.close_generation, self.spec.job_id, self.generation,
                                        reason=reason, last_step=self.step,
                                        last_loss=self.loss)
            except record.RecordError:
                pass  # never opened: its launch was refused
        self._record_pauses(self.pauses.flush())
        fl = self.inflight
        if fl is not None and not fl.decided:  # the job ends inside a resize: no commit
            self.inflight = None
            self._perform(reconcile.RecordFinish(fl.migration_id, ResizeOutcome.ABORTED,
                                                 time.monotonic() - fl.started,
                                                 error=f"the job ended: {reason}"[:250]))
        self.journal.write(record.set_job_state, self.spec.job_id, state, reason=reason)
        self.journal.catch_up(END_CATCH_UP_S)
        logger.info("job %s %s: %s", self.spec.job_id, state, reason)
        return result or state

    # -- observing ------------------------------------------------------------------------

    def _observe_backend(self) -> None:
        # one poll's events are recorded in one transaction (a burst of a thousand node
        # events is one commit), before any of them is acted on (in _decide)
        seen: list[record.Observed] = []
        for event in self.backend.poll():
            now = self.clock()
            match event:
                case Grant():
                    self.holdings = devices.grant(self.holdings, event.devices,
                                                  event.allocation)
                    if not self.pinned and event.request is None and (
                            self.layout is None or self.reattached):
                        self.pinned = set(event.devices)  # the anchor
                        self.anchor_allocation = event.allocation
                    if event.request == self._request_key:
                        self.growing = 0  # the current request is met (not an older one
                        # a restarted backend announces again with what it holds)
                    seen.append(self._observed(
                        "grant", event, f"{len(event.devices)} devices "
                        f"({', '.join(event.nodes)})", state="granted",
                        role="anchor" if set(event.devices) <= self.pinned else "member"))
                case PreemptNotice():
                    self.holdings = devices.notice(self.holdings, event.devices,
                                                   event.deadline)
                    self._noticed_at = time.perf_counter()
                    seen.append(self._observed(
                        "preempt-notice", event, f"{len(event.devices)} devices, "
                        f"{event.deadline - now:.0f} s of grace", state="preempting",
                        deadline=event.deadline))
                case Loss():
                    self._partition_stale = True  # a node DOWN may take others with it
                    self.exit_failed -= set(event.devices)  # lost, not only their workers
                    self.holdings = devices.loss(self.holdings, event.devices,
                                                 event.allocation, event.cause, now)
                    self._lost_in_flight(event.devices)
                    seen.append(self._observed("loss", event, f"{len(event.devices)} devices "
                                               f"({event.cause})", state="lost"))
                case EndTraining():
                    self.ending = self.ending or event.reason
                    continue  # the job's end says it (nothing for a decision)
                case RequestFailed():
                    if event.request == self._request_key:
                        self.growing = 0  # the current request is over: ask again if need be
                    seen.append(self._observed(
                        "request-failed", event, f"request {event.request} ended without a "
                        f"grant ({event.reason})"))
                case WorkerExited():
                    if event.generation < self.launched_in.get(event.vrank, event.generation):
                        # a process its vrank was launched again after (an idle joiner's,
                        # killed): not the death of the one that runs now (soak seed 101)
                        continue
                    self.idle.discard(event.vrank)
                    self.holdings = replace(self.holdings,
                                            leaving=self.leaving - {event.vrank})
                    unjoined = self._unjoined(event.vrank, event.generation)
                    if unjoined and not event.stopped:
                        # any code, 0 included: a script that never calls run_worker
                        seen.append(self._observed(
                            "worker-exit", event, f"vrank {event.vrank} exited with "
                            f"{event.returncode} before joining the job"))
                        self._never_joined(event.vrank, event.device,
                                           f"exited with {event.returncode}",
                                           event.returncode == 0)
                    elif event.returncode != 0 and not event.stopped and \
                            event.vrank not in self.done:
                        seen.append(self._observed(
                            "worker-exit", event, f"vrank {event.vrank} exited with "
                            f"{event.returncode}"))
                        self._worker_died(event, now)
            self.dirty = True
        if self.dead_at_reattach:
            self._reattached_dead()
        if any(o.kind in ("preempt-notice", "loss") for o in seen):
            for effect in reconcile.supersede(self.inflight, time.monotonic()):
                self._perform(effect)
        if seen:
            self.crash("before-record")
            ids = self.journal.write(record.record_observed, self.spec.job_id, seen)
            self._event_ids += ids if isinstance(ids, list) else [ids]  # or a Deferred
            for o in seen:
                logger.info("event: %s %s", o.kind, o.payload["summary"])

    def _reattached_dead(self) -> None:
        """Members of the reattached layout found dead at the restart, on devices the
        backend holds again: failed now, a loss the next decision resizes around."""
        held = [d for d in self.dead_at_reattach if d in self.held]
        if not held:
            return
        for d in held:
            logger.warning("vrank %d of generation %d was found dead at the restart: %s "
                           "counts as failed", self.dead_at_reattach.pop(d), self.generation, d)
        self.holdings = devices.failed(self.holdings, held, self.clock())
        self.exit_failed |= set(held)
        self.dirty = True

    def _start_again(self, why: str) -> None:
        """The reattached layout's workers are all gone and none came back to this
        coordinator (e.g. blocked in a collective on a dead peer past their reattach
        wait): nothing of their state survives, so the first layout starts again from the
        newest checkpoint, as after a restart that found none alive. The devices failed
        only because their workers died are whole again."""
        gen = self.generation
        logger.warning("%s; starting again", why)
        self.journal.write(record.close_generation, self.spec.job_id, gen, reason=why[:250],
                           last_step=self.step, last_loss=self.loss)
        # _start records the way through the checkpoint, with the steps lost
        self.rebuilt_into_next = (gen, self.step)
        whole = self.exit_failed
        self.holdings = replace(self.holdings, layout=None, vranks={}, step=0, loss=None,
                                lost=self.lost - whole, leaving=frozenset(),
                                notices={d: n for d, n in self.notices.items()
                                         if d not in whole})
        self.restart_generation = max(gen, self.last_generation) + 1
        self.last_generation = self.admit_from = self.restart_generation
        # joiners of a resize given up are stopped, not forgotten: the first layout's launch
        # waits for them to end (soak seed 101: launched over one, the job stopped)
        self._stop_idle("the job starts again")
        self.reattached, self.found_dead, self.exit_failed = False, frozenset(), set()
        self.dead_at_reattach, self.unjoined = {}, {}
        self._dead_since = None
        self.dirty = True

    def _worker_died(self, event: WorkerExited, now: float) -> None:
        """A worker of the layout or of the resize in flight died unexplained (no loss, no
        stop): its device counts as failed, as after a loss without notice: the resize in
        flight settles without it, and the next one plans with the surviving devices."""
        fl = self.inflight
        in_layout = self.layout is not None and event.vrank in self.layout.devices
        if fl is not None and event.vrank in fl.participants:
            self.inflight = reconcile.died(fl, event.vrank)
        elif not in_layout:
            return
        self.holdings = devices.failed(self.holdings, [event.device], now)
        self.exit_failed.add(event.device)

    def _lost_in_flight(self, lost: Iterable[Device]) -> None:
        """Participants of the resize in flight on lost devices are dead to it, as after an
        unexplained death: it settles without them (the survivors' vote is closed, the
        resize retried without them). Their exit is the loss's, not news of its own (soak
        seed 201: a notice of 0.5 s ran out inside the shrink it ordered; the survivors
        waited 120 s for the killed, aborted, and the job stopped)."""
        fl = self.inflight
        if fl is None:
            return
        gone = set(lost)
        dead = [v for v in fl.participants if v not in fl.dead
                and (fl.vranks.get(v) or self.vranks.get(v)) in gone]
        for v in dead:
            fl = reconcile.died(fl, v)
        self.inflight = fl

    def _unjoined(self, vrank: int, generation: int) -> bool:
        """Whether the process of ``vrank`` launched for ``generation`` ended (or is given
        up) without having said Hello; it is no longer waited for."""
        if self.unjoined.get(vrank, (None,))[0] != generation:
            return False
        del self.unjoined[vrank]
        return True

    def _join_deadlines(self) -> None:
        """Give up the launched workers late past the join timeout (reconcile.overdue)."""
        for effect in reconcile.overdue(self.inflight, self.unjoined, time.monotonic(),
                                        self.spec.join_timeout_s, self.spec.order_after_joined):
            self._perform(effect)

    def _never_ready(self, whys: Mapping[int, str]) -> None:
        """Joiners that said Hello but not Ready in time: stopped, dead on failed devices;
        the resize (its old layout never ordered) is replanned without them (_settle)."""
        fl = self.inflight
        assert fl is not None
        perform(self.backend, StopWorkers(tuple(sorted(whys)), 5.0, "it was never ready"))
        for v, why in whys.items():
            fl = reconcile.died(fl, v, why)
        self.inflight = fl
        self.holdings = devices.failed(self.holdings, [fl.vranks[v] for v in whys],
                                       self.clock())

    def _silent(self, vranks: Iterable[int], what: str) -> None:
        """Launched workers that never said Hello in time: each one still running is
        stopped and handled as one that exited before joining."""
        workers = self.backend.workers()
        for v in vranks:
            self._unjoined(v, self.unjoined[v][0])
            w = workers.get(v)
            if w is None:
                continue
            perform(self.backend, StopWorkers((v,), 5.0, "it never said hello"))
            self._never_joined(v, w.device, what, False)

    def _supersede(self, why: str) -> None:
        """Give up the grow in flight whose joiners warm up (its end already recorded)."""
        fl = self.inflight
        assert fl is not None
        logger.warning("resize to generation %d: %s", fl.order.generation, why)
        for v in fl.joiners:
            self.unjoined.pop(v, None)
        # stopped by the next decision (or its resize, before it launches its own joiners)
        self.idle = set(fl.joiners - fl.dead)
        self.inflight = None
        self.dirty = True

    def _never_joined(self, vrank: int, device: Device, what: str, clean: bool) -> None:
        """A worker that never said Hello (it exited, or stayed silent past the join
        timeout). One of the first layout: nothing has trained and nothing would, so the job
        stops with one line saying what to change. A joiner of the resize in flight: it
        counts as dead on a failed device, and the resize, whose old layout is ordered only
        once every joiner said Hello, ends without having paused anyone (see _settle)."""
        fl = self.inflight
        in_resize = fl is not None and vrank in fl.participants
        got = verdicts.never_joined(
            vrank, what, clean, first_layout=self.first_layout, in_resize=in_resize,
            in_layout=self.layout is not None and vrank in self.layout.devices)
        if got.fatal:
            self.fatal = self.fatal or got.why
            return
        if in_resize:
            self.inflight = reconcile.died(fl, vrank, got.why)
        if got.dead:
            self.holdings = devices.failed(self.holdings, [device], self.clock())
            self.exit_failed.add(device)

    def _observed(self, kind: str, event: Any, summary: str, *, state: str | None = None,
                  role: str = "member", deadline: float | None = None) -> record.Observed:
        devices = [str(d) for d in getattr(event, "devices", ())]
        if isinstance(event, WorkerExited):
            devices = [str(event.device)]
        allocation = getattr(event, "allocation", None)
        payload = {"summary": summary, "allocation": allocation, "devices": devices}
        if isinstance(event, (Grant, RequestFailed)):
            payload["request"] = event.request  # a restart finds requests still open
        return record.Observed(kind, event_key(kind, event), payload, _dt(deadline),
                               allocation if state else None, state, role,
                               getattr(event, "nodes", None) if state else None)

    def _observe_workers(self) -> None:
        deadline = time.monotonic() + POLL_S
        while (got := self.channel.recv(max(0.0, deadline - time.monotonic()))) is not None:
            vrank, report = got
            match report:
                case Progress():
                    fl = self.inflight
                    if fl is not None and fl.rebuild and \
                            report.generation == fl.order.generation:
                        self.inflight = reconcile.replayed(fl, report)
                    elif self._progress(report):
                        return  # the backend heard of the step: its events polled now
                case Resized():
                    fl = self.inflight
                    if fl and report.generation == fl.order.generation:
                        self.inflight = reconcile.answered(fl, vrank, report)
                        if self.inflight.reports[vrank] is not report:
                            self._answered_after_commit(vrank, report)
                    elif self.late is not None and report.generation == self.late.generation:
                        self._late_answer(vrank, report)
                case Resumed():
                    self._record_pauses(self.pauses.add(report))
                case Exited():
                    if report.reason == "done" or (report.reason == "stopped"
                                                   and self._stop_sent):
                        self.done.add(vrank)
                    elif report.reason not in ("stopped", "left"):
                        self.exit_said.setdefault(report.generation, report.reason)
                case CopiesChosen():
                    self._copies_chosen(report)
                case ModelBuilt():
                    self._model_built(vrank, report.model)
                    self._chunks_said(report.chunks)
                case Hello():
                    if self.unjoined.get(vrank, (report.generation + 1,))[0] <= \
                            report.generation:  # not a Hello of a process before it
                        del self.unjoined[vrank]
                        self.came_back = True
                    self._tell_joiner(vrank)
                    self._order_when_joined()
                case Ready():
                    fl = self.inflight
                    if fl is not None and report.generation == fl.order.generation and \
                            vrank in fl.joiners:
                        self.inflight = reconcile.became_ready(fl, vrank)
                        logger.info("vrank %d ready for generation %d after %.2f s of warm-up",
                                    vrank, report.generation, report.seconds)
                        self._order_when_joined()

    @staticmethod
    def _answered_after_commit(vrank: int, report: Resized) -> None:
        logger.error("vrank %d answered %s to generation %d after it committed (%s): its "
                     "commit stands", vrank, report.outcome, report.generation, report.error)

    def _late_answer(self, vrank: int, report: Resized) -> None:
        """An answer to the resize committed from its decision before it came: the
        longest data phase is recorded once the last came (reconcile.late_answer)."""
        late = self.late
        assert late is not None
        if report.outcome == ProcessOutcome.ABORTED:
            self._answered_after_commit(vrank, report)
        self.late, longest = reconcile.late_answer(late, report)
        if longest is not None:
            self.journal.write(record.record_migration_data, late.migration_id,
                               data_seconds=longest)

    def _flush_late(self) -> None:
        """Record the longest data phase heard of the last resize committed from its
        decision where it grew and some answers never came (a participant died since)."""
        late, self.late = self.late, None
        if late is not None and late.longest > late.recorded:
            self.journal.write(record.record_migration_data, late.migration_id,
                               data_seconds=late.longest)

    def _copies_chosen(self, got: CopiesChosen) -> None:
        """The workers chose the peer-copy interval ("auto"): said once, and recorded
        (``status`` shows it)."""
        logger.info("job %s: %s", self.spec.job_id, got.line)
        eid = self.journal.write(
            record.record_event, self.spec.job_id, PEER_COPIES_EVENT, source="workers",
            key=f"{PEER_COPIES_EVENT}:g{got.generation}",
            payload={"every": got.every, "checkpoint_every": got.checkpoint_every,
                     "copy_seconds": round(got.copy_seconds, 6),
                     "step_seconds": round(got.step_seconds, 6),
                     "held_bytes": got.held_bytes, "host_bytes": got.host_bytes,
                     "generation": got.generation, "line": got.line})
        self.journal.write(record.mark_event_handled, eid, "chosen")

    def _model_built(self, vrank: int, got: ModelReport) -> None:
        """A worker built its model: the job plans with it, or stops (job_model.model_built)."""
        heard = job_model.model_built(self.known, self.spec.job, vrank, got)
        if heard.fatal is not None:
            self.fatal = self.fatal or heard.fatal
        elif heard.known is not self.known:
            self.known = heard.known
            self.spec = replace(self.spec, job=heard.job)
            logger.info("planning with the model of vrank %d: %s", vrank,
                        job_model.describe_job(heard.job))
            self.dirty = True

    def _chunks_said(self, chunks: bool) -> None:
        """A worker's script builds virtual pipeline chunks: vpp layouts may be chosen."""
        job = job_model.chunks_said(self.spec.job, chunks)
        if job is not self.spec.job and not self.fatal:
            self.spec = replace(self.spec, job=job)
            self.dirty = True

    def _progress(self, report: Progress) -> bool:
        """A step reported: recorded and shown; whether the backend was told of it. A step
        of a layout whose commit is not settled here yet is shown, not the job's step yet
        (the commit's switch step is the old layout's last: soak seed 102)."""
        if report.generation > self.generation:
            self._show_progress(report)
            return False
        if report.step <= self.step:
            return False
        self.holdings = replace(self.holdings, step=report.step, loss=report.loss)
        if report.ended > report.started > 0:
            self.step_s = report.ended - report.started
        if self.dirty_at_first_step:
            self.dirty, self.dirty_at_first_step = True, False
        told = self._report_step(report.step)
        if report.generation == self.generation:  # else not committed yet
            self.journal.write(record.record_progress, self.spec.job_id,
                                   report.generation, last_step=report.step,
                                   last_loss=report.loss)
        self._show_progress(report)
        return told

    def _show_progress(self, report: Progress) -> None:
        self.progress({"step": report.step, "loss": report.loss,
                       "lr": report.lr, "layout": report.layout,
                       "generation": report.generation, "started": report.started,
                       "ended": report.ended})

    def _record_pauses(self, pauses: list[tuple[Any, MeasuredPause]]) -> None:
        """Write the pauses measured at the step boundaries into their migrations."""
        for mid, p in pauses:
            self.journal.write(record.record_migration_pause, mid, pause_seconds=p.seconds,
                               paused_at=datetime.fromtimestamp(p.paused_at, timezone.utc),
                               resumed_at=datetime.fromtimestamp(p.resumed_at, timezone.utc),
                               preparation_seconds=p.preparation_seconds,
                               processes=p.processes, stall_seconds=p.stall_seconds,
                               interrupted_seconds=p.interrupted_seconds)
            stall = (f"; before it, training stopped {p.stall_seconds:.3f} s at one step "
                     f"boundary (vrank {p.stall_vrank}: the new world built)"
                     if p.stall_vrank is not None else "")
            cut = (f" ({p.interrupted_seconds:.3f} s of it the step in flight, lost with the "
                   f"node; recovery {p.seconds - p.interrupted_seconds:.3f} s)"
                   if p.interrupted_seconds > 0 else "")
            logger.info("migration %s: training paused %.3f s%s (the widest gap between "
                        "steps, vrank %d, over %d processes) after %.2f s of preparation%s",
                        mid, p.seconds, cut, p.vrank, p.processes, p.preparation_seconds,
                        stall)

    def _report_step(self, step: int) -> bool:
        """Tell the backend the job's step (returns whether it was told), only when settled
        (no resize in flight, no event waiting for a decision): a scripted cluster's next
        group of events then fires after the group before was decided and its resize
        settled, whatever the timing (the
        events script's documented semantics; a loss during a migration is the faults
        issue's case)."""
        if self.inflight is None and not self._event_ids:
            self.backend.on_step(step)
            return True
        return False

    # -- deciding -------------------------------------------------------------------------

    def _snapshot(self) -> JobView:
        layout_vranks = ({v: self.vranks[v] for v in self.layout.devices}
                         if self.layout is not None else {})
        by_deadline: dict[tuple[float, str], set[Device]] = {}
        for d, key in self.notices.items():
            if d in self.held:
                by_deadline.setdefault(key, set()).add(d)
        return JobView(
            now=self.clock(), job=self.spec.job, hardware=self.spec.hardware,
            topology=self.topology, held=frozenset(self.held), layout=self.layout,
            vranks=layout_vranks,
            notices=tuple(Notice(frozenset(ds), deadline, cause)
                          for (deadline, cause), ds in sorted(by_deadline.items())),
            resizes=tuple(self.resize_times), growing=self.growing,
            pinned=frozenset(self.pinned), partition_nodes=self._partition_nodes(),
            request_age_s=(None if not self.growing or self.request_sent_at is None
                           else time.monotonic() - self.request_sent_at))

    def _partition_nodes(self) -> int:
        """The nodes this job can hold now: re-read through the backend (``usable_nodes``:
        the Slurm backend counts those not DOWN/DRAIN, with the job's own) after a loss was
        observed and otherwise at most every PARTITION_REREAD_S, since nodes of the
        partition that go down later raise no event of this job; the last count where the
        backend cannot say (a scripted cluster: all of its nodes)."""
        self._reread_partition()
        return self.partition_nodes

    def _reread_partition(self) -> bool:
        """Ask the backend for the count when it is due; True when it gave one (None: it
        cannot say, now or ever, and the last count stays)."""
        now = time.monotonic()
        if not (self._partition_stale or self._partition_read_at is None
                or now >= self._partition_read_at + PARTITION_REREAD_S):
            return False
        self._partition_read_at, self._partition_stale = now, False
        count = self.backend.usable_nodes()
        if count is not None and count != self.partition_nodes:
            logger.info("the partition has %d usable node(s) for this job (was %d)",
                        count, self.partition_nodes)
            self.partition_nodes = count
        return count is not None

    def _request_overdue(self) -> bool:
        """Decide again about the pending request: it waited past the policy's patience
        (once a minute at most), or a fresh count of the partition's usable nodes (at most
        every PARTITION_REREAD_S) no longer meets it. Either way it may be withdrawn and
        asked again smaller."""
        if not self.growing or self.request_sent_at is None:
            return False
        now = time.monotonic()
        usable = self.partition_nodes if self._reread_partition() else None
        why = verdicts.request_overdue(
            nodes=self.growing, usable_nodes=usable,
            keeps=len({d.node for d in self.held if d not in self.release_later}),
            age_s=now - self.request_sent_at, patience_s=self.spec.policy.patience_s,
            since_last_look_s=now - self._overdue_checked)
        if why == verdicts.PAST_PATIENCE:
            self._overdue_checked = now
        return why is not None

    def _decide(self) -> None:
        self.dirty = False
        if self._event_ids:
            self.crash("after-record")
        if not self.held:
            return
        if not self.known.complete and self.layout is not None:
            self.dirty = True  # decided once the workers said their model (_model_built)
            return
        decision = decide(self._snapshot(), self.spec.policy)
        if any(isinstance(a, Pause) for a in decision.actions) and not any(
                isinstance(a, ResizeDecision) for a in decision.actions) and \
                self._reuse_anchor():
            decision = decide(self._snapshot(), self.spec.policy)
        was_paused, self.paused = self.paused, None
        text = " | ".join(decision.lines())
        if text != self.reason:
            self.reason = text
            for line in decision.lines():
                logger.info("decision: %s", line)
        for action in decision.actions:
            match action:
                case ResizeDecision():
                    if self.layout is None:
                        self._start(action)
                    elif self.step < 1 and not action.forced:
                        # the optimizer has no state to move before the first step: a grant
                        # that came while the first workers were starting waits for it
                        self.dirty_at_first_step = True
                    else:
                        self._resize(action)
                case Release():
                    self.release_later |= set(action.devices)
                case WithdrawRequest():
                    if self.growing:
                        perform(self.backend, CancelRequest(self._request_key,
                                                            action.reason))
                        self.growing, self.request_sent_at = 0, None
                        self.journal.write(
                            record.record_event, self.spec.job_id, "request-withdrawn",
                            source="coordinator", key=f"withdraw:{self._request_key}",
                            payload={"nodes": action.nodes, "summary": action.reason[:200]})
                case RequestGrow():
                    if not self.growing:
                        self.requests += 1
                        self.growing = action.nodes
                        request = RequestNodes(action.nodes, self._request_key,
                                               action.reason)
                        # recorded before it is sent: a restarted coordinator's keys
                        # continue after it (a duplicate key would be the same request)
                        eid = self.journal.write(
                            record.record_event, self.spec.job_id, "request", source="coordinator",
                            key=f"request:{request.key}",
                            payload={"nodes": request.nodes, "summary": request.reason[:200]})
                        perform(self.backend, request)
                        self.request_sent_at = time.monotonic()
                        self.crash("after-request")
                        self.journal.write(record.mark_event_handled, eid, "sent")
                case Pause():
                    if was_paused != action.reason:  # said once, not at every decision
                        logger.warning("paused: %s", action.reason)
                    self.paused = action.reason
        if self.inflight is None:
            self._stop_idle("no resize takes them in")
            self._release_now()
        self.journal.write(record.mark_events_handled, list(self._event_ids),
                           decision.reason[:200])
        self._event_ids.clear()

    def _reuse_anchor(self) -> bool:
        """Nothing fits the usable devices: the anchor's devices whose workers died (their
        process, not a loss the backend reported: the anchor is the job's own allocation and
        its node is up) are used again, each at most :data:`verdicts.MAX_REUSES` times (a device
        whose workers keep dying stays out). Whether any was."""
        in_layout = ({self.vranks[v] for v in self.layout.devices}
                     if self.layout is not None else set())
        # a device of the layout stays its dead vrank's (whose state is gone) until a
        # resize or a start again moves the layout off it
        again = verdicts.anchor_again(self.pinned, self.exit_failed, in_layout, self.reused)
        if not again or self.anchor_allocation is None:
            return False
        self.reused.update(again)
        self.exit_failed -= set(again)
        self.holdings = devices.grant(self.holdings, again, self.anchor_allocation)
        logger.warning("nothing fits the usable devices: the anchor's %s, whose workers died, "
                       "are used again (at most %d times each)", format_devices(again),
                       verdicts.MAX_REUSES)
        return True

    def _release_now(self) -> None:
        if self.journal.behind:  # record, then act: given back once the record holds it
            self.dirty = True
            return
        free = devices.to_release(self.holdings, self.release_later, self.pinned)
        self.release_later.clear()
        if not free:
            return
        # recorded before the backend gives them back: a coordinator killed between the two
        # is told by its backend what the job still holds (a grant), never the reverse
        self.journal.write(record.set_device_state, self.spec.job_id, sorted(free), "released")
        perform(self.backend, ReleaseDevices(tuple(sorted(free)), "not in the layout"))
        self.holdings = devices.released(self.holdings, free)

    # -- acting ---------------------------------------------------------------------------

    def _worker_env(self) -> dict[str, str]:
        return {**self.spec.env, **self.spec.recovery.env(), **self.channel.worker_env(),
                GPUS_PER_NODE: str(self.topology.gpus_per_node),
                TIMEOUT: str(self.spec.worker_timeout_s),
                REATTACH_WAIT: str(self.spec.reattach_wait_s)}

    def _start(self, action: ResizeDecision) -> None:
        from slurm_etc.alloc.vranks import identity_layout

        layout = identity_layout(action.config, action.allocation.pool)
        gen = self.restart_generation
        self.holdings = replace(self.holdings, layout=layout, generation=gen,
                                vranks=dict(action.allocation.vranks))
        self.channel.generation = gen
        workers = tuple(WorkerSpec(v, self.vranks[v]) for v in layout.devices)
        env = {**self._worker_env(), LAYOUT: format_layout(layout)}
        # The first layout trains on from the newest complete checkpoint (after a restart
        # that found no whole layout alive to reattach, nothing else holds the state): every
        # worker loads the same one, and no step below it is trained or written again.
        # (a directory without --checkpoint-every: where peer copies that do not fit host
        # memory fall back to periodic checkpoints)
        where = self.spec.recovery.checkpoint_dir
        newest = newest_checkpoint(where)
        if where is not None and newest is not None:
            env[RESUME_FROM] = os.path.join(where, f"step-{newest}")
            self.holdings = replace(self.holdings, step=max(self.step, newest))
            logger.warning("generation %d resumes from the checkpoint of step %d (%s)", gen,
                           newest, env[RESUME_FROM])
        # recorded before the launch (record, then act): a coordinator killed after it finds
        # the generation without all its workers alive and starts the layout again (_reattach)
        self.journal.write(record.open_generation, self.spec.job_id, gen, str(layout.config),
                           layout.devices, self.vranks, first_step=self.step)
        if self.rebuilt_into_next is not None:
            self._record_rebuild(gen, newest)
        self._clear_leaving({w.vrank: w.device for w in workers})
        perform(self.backend, LaunchWorkers(gen, workers, self.spec.argv, env))
        self._record_launch(gen, layout.devices)
        self.first_layout = True
        self._await_hello(layout.devices, gen)
        logger.info("generation %d: %s on vranks %s", gen, layout.config, list(layout.devices))

    def _clear_leaving(self, launches: Mapping[int, Device]) -> None:
        """Processes that left the job at the last commit and are still exiting (tearing
        their groups down) where ``launches`` (vrank -> device) start new ones, under the
        same vrank or on the same device: they have nothing left to do and stop; the
        backend's launch waits for them to end (else it takes the launch for a retry of that
        process and starts nothing, or refuses a device another vrank runs on: soak seed
        107, a shrink onto the device a leaving vrank still ran on stopped the job)."""
        if not self.leaving or not launches:
            return
        where = {v: w.device for v, w in self.backend.workers().items()
                 if v in self.leaving and w.running}
        taken = set(launches.values())
        stop = {v for v in self.leaving if v in launches or where.get(v) in taken}
        if stop:
            perform(self.backend, StopWorkers(tuple(sorted(stop)), 2.0,
                                              "its vrank or device joins again"))
            self.holdings = replace(self.holdings, leaving=self.leaving - stop)

    def _record_rebuild(self, gen: int, newest: int | None) -> None:
        """A layout lost whole, started again from the checkpoint of step ``newest`` (None:
        from step 1): the record holds it as a migration into ``gen`` that rebuilt the state
        from the checkpoint, with the steps trained since lost (trained again)."""
        base = newest or 0
        old, last = self.rebuilt_into_next or (gen - 1, base)
        self.rebuilt_into_next = None
        lost = (base + 1, last) if last > base else None
        mid = self.journal.write(record.record_migration_start, self.spec.job_id,
                                 from_generation=old, to_generation=gen, plan_digest="",
                                 moved_bytes=0, kept_bytes=0, lower_bound_bytes=0,
                                 messages=0, rounds=0)
        self.journal.write(record.record_migration_finish, mid,
                           outcome=ResizeOutcome.COMMITTED, measured_seconds=0.0,
                           lost_steps=lost,
                           rebuilt_from=None if newest is None else "checkpoint")
        if lost is not None:
            logger.warning("steps %d-%d lost with generation %d (%s); training them again",
                           lost[0], lost[1], old, "no checkpoint: from the start"
                           if newest is None else f"rebuilt from the checkpoint of step "
                                                  f"{newest}")

    def _resize(self, action: ResizeDecision) -> None:
        decided_at = time.time()  # wall clock, as the workers' step times
        if self.layout is None:
            return
        old = self.layout
        if all(self.vranks[v] in self.lost for v in old.devices):
            self._none_left(old)
            return
        gen = max(self.generation, self.last_generation) + 1
        got = reconcile.order_resize(
            self.holdings, job_id=self.spec.job_id, generation=gen, config=action.config,
            pool=action.allocation.vranks, deadline=action.deadline, reason=action.reason,
            now=self.clock(), model=self.spec.job.model,
            topology=Topology(self.topology.gpus_per_node, self.spec.hardware.intra_node_gbps,
                              self.spec.hardware.inter_node_gbps),
            gpus_per_node=self.topology.gpus_per_node,
            can_rebuild=self.spec.recovery.enabled,
            prepare_while_training=self.spec.prepare_while_training,
            longest_aside_s=self.aside_preparation_s,
            first_aside_grace_s=self.spec.prepare_aside_min_grace_s, step_s=self.step_s)
        order, plan, lost = got.order, got.plan, got.order.lost
        if got.rebuild:
            logger.warning("devices %s failed holding state no replica holds: rebuilding it "
                           "from peer copies or the last checkpoint (the steps since are "
                           "lost and trained again)", format_devices(self.vranks[v] for v in lost))
        self.last_generation = gen
        new = plan.new
        joiners, vranks = set(got.joiners), dict(got.vranks)
        # joiners of an aborted resize stop; the retry starts its joiners afresh
        self._stop_idle("resize retried")
        left = got.grace_left
        if self.spec.prepare_while_training and not order.prepare_while_training and not lost:
            logger.info("generation %d: %.1f s of grace left (< %.1f s): the old layout "
                        "prepares at full speed, not beside training", gen, left,
                        got.aside_needs)
        if left is not None and not lost and plan.est_seconds > left:
            logger.warning("the migration's estimate (%.1f s) exceeds the %.1f s of grace left",
                           plan.est_seconds, left)
        mid = self.journal.write(
            record.record_migration_start, self.spec.job_id, from_generation=self.generation,
            to_generation=gen, plan_digest=order.plan_digest, moved_bytes=plan.moved_bytes,
            kept_bytes=plan.kept_bytes, lower_bound_bytes=plan.lower_bound_moved_bytes,
            messages=len(plan.messages), rounds=plan.rounds,
            estimated_seconds=plan.est_seconds)
        self.inflight = InflightResize(order, plan, mid, got.participants, got.joiners,
                                       got.vranks, frozenset(self.release_later),
                                       time.monotonic(),
                                       stayers=frozenset(set(old.devices) - set(lost)),
                                       rebuild=got.rebuild, decided_at=decided_at,
                                       step_at_launch=self.step)
        self.channel.generation = gen
        self._clear_leaving({v: vranks[v] for v in joiners})
        if joiners:
            workers = tuple(WorkerSpec(v, vranks[v]) for v in sorted(joiners))
            perform(self.backend, LaunchWorkers(gen, workers, self.spec.argv,
                                                self._worker_env()))
            self._record_launch(gen, joiners)
            self._await_hello(joiners, gen)
        # The old layout is ordered (and pauses at its next step boundary) only once every
        # joiner said Ready: it trains on while they import torch and megatron-core and
        # warm up (seconds on a busy node), and a joiner that never gets ready (a script
        # that does not end in run_worker, a crash at import) pauses nobody.
        self._order_when_joined()
        self.crash("after-order")
        logger.info("generation %d: resize %s -> %s (%s), moving %.1f MiB (lower bound "
                    "%.1f MiB) in %d messages, %d rounds", gen, old.config, new.config,
                    action.reason, plan.moved_bytes / 2**20,
                    plan.lower_bound_moved_bytes / 2**20, len(plan.messages), plan.rounds)

    def _none_left(self, old: Layout) -> None:
        """Every vrank of the layout is lost (with its peer copies): no resize can move
        anything, nobody is left to publish the layout's catalog to joiners. The first
        layout starts again from the newest checkpoint; without one the state is gone and
        the job stops with one line (soak seed 101: a rebuild ordered to joiners alone
        waited for the dead)."""
        devices_text = format_devices(self.vranks[v] for v in old.devices)
        newest = newest_checkpoint(self.spec.recovery.checkpoint_dir)
        if newest is None:
            raise JobStopped(f"every device of generation {self.generation} is lost "
                             f"({devices_text}) and no checkpoint holds its state: nothing "
                             "is left to train on (periodic checkpoints: slurm-etc run "
                             "--checkpoint-every M --checkpoint-dir D)")
        self._start_again(f"every device of generation {self.generation} is lost "
                          f"({devices_text}): the first layout again, from the checkpoint "
                          f"of step {newest}")

    def _order_stayers(self) -> None:
        """Send the order to the workers of the old layout (the pause starts at their next
        step boundary)."""
        fl = self.inflight
        assert fl is not None
        missed = self.channel.broadcast(fl.order, set(fl.stayers))
        self.inflight = fl = reconcile.ordered(fl, fl.stayers - set(missed), time.monotonic())
        if fl.order.lost and self.post is not None:
            # the survivors wait at a step boundary for votes the dead never give: the
            # order in the store ends that wait the moment it is there
            self.post(GenerationKeys(self.spec.job_id, self.generation).lost,
                      ENCODER.encode(fl.order))
        if fl.joiners:
            logger.info("generation %d: old layout ordered %.2f s after the joiners' launch, "
                        "steps %d..%d trained meanwhile", fl.order.generation,
                        fl.sent_at - fl.started, fl.step_at_launch, self.step)
        if self._noticed_at is not None:
            self.reaction_s.append(time.perf_counter() - self._noticed_at)
            self._noticed_at = None

    def _record_launch(self, generation: int, vranks: Iterable[int]) -> None:
        """Record each launched worker's process (pid and start time, as the backend knows
        them): a coordinator restarted on this record finds those still alive and
        reattaches them (:meth:`_reattach`)."""
        vranks = sorted(vranks)
        self.launched_in.update((v, generation) for v in vranks)
        workers = self.backend.workers()
        launched = [w for w in (workers.get(v) for v in vranks)
                    if w is not None and w.generation == generation]
        if not launched:
            return
        # one transaction for the whole launch (thousands of workers), one to close them
        ids = self.journal.write(record.record_observed, self.spec.job_id, [
            record.Observed("launch", f"launch:g{generation}:v{w.vrank}:{w.pid}:{w.start}",
                            {"summary": f"vrank {w.vrank} on {w.device}: pid {w.pid}",
                             "vrank": w.vrank, "generation": generation,
                             "device": str(w.device), "pid": w.pid, "start": w.start})
            for w in launched], source="coordinator")
        self.journal.write(record.mark_events_handled, ids if isinstance(ids, list) else [ids],
                           "launched")

    def _await_hello(self, vranks: Iterable[int], generation: int) -> None:
        now = time.monotonic()
        for v in vranks:
            self.unjoined[v] = (generation, now)

    def _order_when_joined(self) -> None:
        """Order the old layout once every joiner of the resize in flight said Ready."""
        if reconcile.may_order(self.inflight, self.spec.order_after_joined):
            self._order_stayers()

    def _tell_joiner(self, vrank: int) -> None:
        """A worker said hello: it gets the resize in flight if it has not had it — a joiner,
        or a worker of the old layout still starting when the order went out (on Slurm a
        member can be granted before the first layout's processes finished importing)."""
        fl = self.inflight
        if fl is not None and reconcile.owes_order(fl, vrank) and \
                self.channel.send(vrank, fl.order):
            self.inflight = reconcile.told(fl, vrank)

    def _settle(self) -> None:
        fl = self.inflight
        assert fl is not None
        if self.commit_heard == fl.order.generation and not fl.decided:
            self.inflight = fl = reconcile.decided_commit(fl)
        now = time.monotonic()
        settled = reconcile.settle(fl, now, self.spec.worker_timeout_s)
        if settled.resend:
            self.channel.broadcast(fl.order, set(settled.resend))
            self.inflight = fl = reconcile.ordered(fl, (), now)
        outcome = settled.outcome
        if isinstance(outcome, reconcile.CloseVote):
            outcome = self._close_vote(fl, outcome)
        if isinstance(outcome, reconcile.Wait | reconcile.CloseVote):
            return
        wall = now - fl.started
        if isinstance(outcome, reconcile.Abort):
            self._aborted(fl, wall, outcome)
            return
        pause, lost_steps = outcome.pause_s, outcome.lost_steps
        self.aside_preparation_s = reconcile.longest_aside(self.aside_preparation_s, fl, now,
                                                           pause)
        after, effects = reconcile.commit(self.holdings, fl, outcome, wall)
        self._flush_late()
        self.late = reconcile.late_answers(fl, outcome)
        if lost_steps is not None:  # rolled back: the steps after the copy are trained again
            logger.warning("steps %d-%d lost with devices %s (rebuilt from %s of step %d); "
                           "training them again", lost_steps[0], lost_steps[1],
                           format_devices(fl.vranks[v] for v in fl.order.lost),
                           outcome.rebuilt_from, lost_steps[0] - 1)
        for effect in effects:
            if isinstance(effect, reconcile.ReleaseLater):  # what is held changes first
                self.holdings = after
                self.first_layout = False
                self.resize_times.append(self.clock())
                self.inflight = None
                if self._noticed_at is not None:  # a notice that came meanwhile waited
                    self._noticed_at = time.perf_counter()
            self._perform(effect)
        new = fl.order.new.layout()
        for report in fl.early:
            self._progress(report)
        self._record_pauses(self.pauses.committed(self.generation, fl.migration_id,
                                                  new.devices, fl.decided_at))
        self._report_step(self.step)
        self.dirty = True
        logger.info("generation %d committed: %s on vranks %s, pause %.3f s, resize %.2f s",
                    self.generation, new.config, list(new.devices), pause, wall)

    def commit_decided(self, key: str, value: bytes) -> None:
        """The rendezvous store's hook, on its thread, before any rank hears of it: the
        resize in flight was decided commit (its key's first value). Recorded at once, with
        the new layout, so that a coordinator killed before it records the commit itself
        rolls the resize forward at its restart (:meth:`_roll_forward`) rather than back:
        the workers that heard the decision train in the new layout. A record that cannot
        be written (a full disk) is one warning: the restart then aborts the resize."""
        fl = self.inflight
        if value != COMMIT or fl is None or key != commit_decision(
                GenerationKeys(self.spec.job_id, fl.order.generation).prefix):
            return
        new = fl.order.new.layout()
        payload = {"generation": fl.order.generation,
                   "layout": str(new.config), "ranks": list(new.devices),
                   "vranks": {str(v): str(fl.vranks[v]) for v in new.devices},
                   "rebuild": fl.rebuild}
        try:
            eid = record.record_event(self.store, self.spec.job_id, "commit-decided",
                                      source="coordinator",
                                      key=f"commit-decided:g{fl.order.generation}",
                                      payload=payload)
            record.mark_event_handled(self.store, eid, "recorded before the workers heard")
            self.crash("after-commit-decided")
        except Exception as err:  # noqa: BLE001 - on the store's thread: never raised there
            logger.warning("resize to generation %d: its commit decision is not recorded "
                           "(%s): a coordinator restarted before its commit is recorded "
                           "would abort it", fl.order.generation, str(err)[:200])
        # the loop commits the resize at its next turn (reconcile.settle: every rank follows
        # this decision), not after an answer from each rank
        self.commit_heard = max(self.commit_heard, fl.order.generation)

    def _close_vote(self, fl: InflightResize, close: reconcile.CloseVote
                    ) -> reconcile.Wait | reconcile.Abort:
        """A participant died: the commit vote closed as abort where no rank decided it
        (an abort, decided again without the dead at once: the survivors wait for that
        order only their own timeout), else waited out (it holds commit: the survivors
        install the new layout and the dead is a loss of it)."""
        key = commit_decision(GenerationKeys(self.spec.job_id, fl.order.generation).prefix)
        held = self.close_vote(key) if self.close_vote is not None else b""
        if held != ABORT:
            self.inflight = reconcile.vote_looked_at(fl)
            return reconcile.Wait()
        told = set(fl.told) - set(fl.dead)
        if told:  # a worker that has not taken the order up yet drops it
            self.channel.broadcast(Abort(self.spec.job_id, fl.order.generation, close.why),
                                   told)
        return reconcile.Abort(close.why, retry=True)

    def _perform(self, effect: reconcile.Effect) -> None:
        """Carry out one effect of a reconcile decision (records through the journal;
        a coordinator killed after one resumes from the record)."""
        job = self.spec.job_id
        match effect:
            case reconcile.RecordFinish():
                self.journal.write(record.record_migration_finish, effect.migration_id,
                                   outcome=effect.outcome,
                                   measured_seconds=effect.measured_seconds,
                                   pause_seconds=effect.pause_seconds, error=effect.error,
                                   lost_steps=effect.lost_steps,
                                   rebuilt_from=effect.rebuilt_from,
                                   data_seconds=effect.data_seconds)
                if effect.outcome == ResizeOutcome.COMMITTED:
                    self.crash("after-commit-record")
            case reconcile.CloseGeneration():
                self.journal.write(record.close_generation, job, effect.generation,
                                   reason=effect.reason, last_step=effect.last_step,
                                   last_loss=effect.last_loss)
            case reconcile.OpenGeneration():
                self.journal.write(record.open_generation, job, effect.generation,
                                   str(effect.layout.config), effect.layout.devices,
                                   effect.vranks, first_step=effect.first_step)
            case reconcile.ReleaseLater():
                self.release_later |= effect.devices
                self._release_now()
            case reconcile.StopIdle():
                self._stop_idle(effect.why)
            case reconcile.NeverJoined():
                self._silent(effect.vranks, effect.what)
            case reconcile.NeverReady():
                self._never_ready(effect.whys)
            case reconcile.Supersede():
                self._supersede(effect.why)

    def _finished_first(self, fl: InflightResize) -> None:
        """Training ended before the old layout took up the resize in flight: it is moot."""
        self._perform(reconcile.RecordFinish(fl.migration_id, ResizeOutcome.ABORTED,
                                             time.monotonic() - fl.started,
                                             error="training finished before the resize began"))
        perform(self.backend, StopWorkers(tuple(sorted(fl.joiners)), 5.0, "training finished"))
        self.inflight = None

    def _aborted(self, fl: InflightResize, wall: float, abort: reconcile.Abort) -> None:
        """Record the abort, keep the old layout, and decide again (``abort.retry``) or
        stop the job (reconcile.settle's rules)."""
        logger.error("resize to generation %d aborted: %s", fl.order.generation, abort.why)
        self.inflight = None
        self.idle = {v for v in fl.joiners - fl.dead}
        for effect in reconcile.abort(fl, abort, wall):
            self._perform(effect)
        if not abort.retry:
            raise JobStopped(f"resize to generation {fl.order.generation} aborted: {abort.why}")
        logger.info("retrying without the dead: vrank(s) %s",
                    ", ".join(str(v) for v in sorted(fl.dead)))
        self.dirty = True

    def _stop_idle(self, why: str) -> None:
        if self.idle:
            perform(self.backend, StopWorkers(tuple(sorted(self.idle)), 5.0, why))
        self.idle = set()


def event_key(kind: str, event: Any) -> str:
    """An event's identity in the record: the same event reported again (a restarted
    coordinator's backend re-reads what it holds) is recorded once."""
    if isinstance(event, WorkerExited):
        return f"{kind}:g{event.generation}:v{event.vrank}:{event.device}"
    digest = hashlib.sha1(",".join(str(d) for d in event.devices).encode()).hexdigest()[:12]
    when = f":{event.deadline:.0f}" if isinstance(event, PreemptNotice) else ""
    return f"{kind}:{event.allocation[:64]}{when}:{digest}"


def _dt(t: float | None) -> Any:
    from datetime import UTC, datetime

    return None if t is None else datetime.fromtimestamp(t, UTC)


def owner() -> tuple[int, str]:
    """The real uid and its name (never the environment)."""
    import pwd

    uid = os.getuid()
    try:
        return uid, pwd.getpwuid(uid).pw_name
    except KeyError:
        return uid, str(uid)
