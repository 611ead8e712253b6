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

import functools
import gc
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from slurm_etc.alloc.topology import ClusterTopology, Device
from slurm_etc.lifecycle import JobState, ResizeOutcome
from slurm_etc.migrate.decision import COMMIT
from slurm_etc.plan import Layout
from slurm_etc.protocol.messages import Stop
from slurm_etc.protocol.rendezvous import GenerationKeys, commit_decision
from slurm_etc.store import jobs as record

from . import acting, deciding, job_model, observe, reconcile, restart, verdicts
from .backend import Backend, BackendError
from .job import Edges, JobSpec, Launches, Life, NodeRequest, Phase, Resizing, Restart, Watch
from .journal import Journal
from .reconcile import JobStopped

logger = logging.getLogger(__name__)

# At the end, how long a record that fell behind (a full disk) is given to catch up.
END_CATCH_UP_S = 10.0
# where the crash hook is called (a test's SIGKILL: slurm_etc.testing.hooks): events
# polled and not recorded; recorded and not acted on; a node request sent (recorded before
# it); a resize ordered and its outcome not recorded; its commit recorded and not acted on
# (old generation not closed, new one not opened, nothing released)
KILL_POINTS = ("before-record", "after-record", "after-request", "after-order",
               "after-commit-record")
# reached only with workers that vote (a resize's commit decision recorded, no rank told)
VOTE_KILL_POINTS = ("after-commit-decided",)


class Coordinator:
    """One job's reconcile loop (see the module doc). ``run`` returns the job's end state."""

    def __init__(self, spec: JobSpec, backend: Backend, store: Any, channel: Any,
                 topology: ClusterTopology, *, clock: Callable[[], float] = time.time,
                 progress: Callable[[dict[str, Any]], None] | None = None,
                 crash: Callable[[str], None] | None = None,
                 post: Callable[[str, bytes], None] | None = None,
                 close_vote: Callable[[str], bytes] | None = None) -> None:
        self.spec = spec
        self.io = Edges(backend, store, channel, Journal(store), topology, clock,
                        progress or (lambda _s: None), crash or (lambda _point: None), post,
                        close_vote)
        self.holdings = reconcile.Holdings.nothing()
        self.resize = Resizing()
        self.request = NodeRequest(partition_nodes=len(topology.nodes))
        self.launches = Launches()
        self.restart = Restart()
        self.phase = Phase()
        self.watch = Watch()
        # the model and the batch planned with, each with who said it, that every worker's
        # ModelBuilt must match; None: not known yet (the first ModelBuilt says it)
        self.known = job_model.Known.given(
            spec.job, model_from_workers=spec.model_from_workers,
            batch_from_workers=spec.batch_from_workers,
            micro_batch_given=spec.micro_batch_given, model_label=spec.model_label)
        channel.admit = functools.partial(restart.admits, self)

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

    def run(self, *, deadline_s: float | None = None) -> str:
        """Reconcile until the workers finished training, the job failed, or
        ``deadline_s`` passed. Returns ``finished``, ``failed`` or ``timeout``."""
        t_end = None if deadline_s is None else time.monotonic() + deadline_s
        restart.recover(self)
        # the imports' ~115k objects out of the cyclic collector's sight (once a process): a
        # full collection of them takes ~0.12 s on 2 cores, and the collector starts one
        # whenever enough allocations came, between a notice and its order as anywhere
        if not gc.get_freeze_count():
            gc.collect()
            gc.freeze()
        record.set_job_state(self.io.store, self.spec.job_id, JobState.RUNNING)
        try:
            while True:
                if (ended := self._ended()) is not None:
                    return ended
                self.io.journal.retry()
                # status tells a live coordinator from a lost one by this (at most 1/30 s)
                record.heartbeat(self.io.store, self.spec.job_id)
                # the workers first: a step they report can fire a scripted cluster's events
                # (a loss kills its workers at once), polled and decided in this pass
                observe.observe_workers(self)
                observe.observe_backend(self)
                observe.join_deadlines(self)
                if (ended := self._ended()) is not None:
                    return ended
                if verdicts.finished(self.layout, self.launches.done):
                    if self.resize.inflight is not None:
                        acting.finished_first(self, self.resize.inflight)
                    return self._end(JobState.FINISHED, f"trained to step {self.step}")
                dead = deciding.nothing_left(self) or deciding.check_outlook(self)
                if dead is not None:
                    logger.error("job %s stops: %s", self.spec.job_id, dead)
                    return self._end(JobState.FAILED, dead)
                if self.resize.inflight is not None:
                    acting.settle(self)
                elif self.phase.life is Life.ENDING:
                    deciding.stop_training(self)
                elif (self.phase.dirty or deciding.request_overdue(self)) and \
                        deciding.record_holds(self):
                    deciding.decide_now(self)
                if t_end is not None and time.monotonic() > t_end:
                    return self._end(JobState.FAILED, f"no end within {deadline_s:.0f} s",
                                     "timeout")
        except (JobStopped, BackendError) as err:  # the backend refused an action: one line
            logger.error("job %s stops: %s", self.spec.job_id, err)
            return self._end(JobState.FAILED, str(err))

    @property
    def _stop_generation(self) -> int:
        return verdicts.stop_generation(self.generation, self.resize.last_generation)

    def cancel(self, reason: str) -> None:
        """End the job as ``cancelled`` with ``reason`` at the loop's next turn (a signal
        handler calls it: nothing is cut short in the middle of a record write or an
        action)."""
        self.phase.end(JobState.CANCELLED, reason)

    def _ended(self) -> str | None:
        """The job's end where it was cancelled or must stop (``Life.ENDED``), else None."""
        if self.phase.life is not Life.ENDED:
            return None
        if self.phase.failed is not None:
            raise JobStopped(self.phase.failed)
        return self._end(self.phase.ends_as or JobState.CANCELLED, self.phase.why or "")

    def _end(self, state: JobState, reason: str, result: str | None = None) -> str:
        reason = reason[:250]
        if self.layout is not None:
            live = set(self.layout.devices) - self.launches.done
            if live:
                self.io.channel.broadcast(Stop(self.spec.job_id, self._stop_generation, reason),
                                          live)
            try:
                self.io.journal.write(record.close_generation, self.spec.job_id, self.generation,
                                      reason=reason, last_step=self.step,
                                      last_loss=self.loss)
            except record.RecordError:
                pass  # never opened: its launch was refused
        observe.record_pauses(self, self.watch.pauses.flush())
        fl = self.resize.inflight
        if fl is not None and not fl.decided:  # the job ends inside a resize: no commit
            self.resize.inflight = None
            acting.perform_effect(self, reconcile.RecordFinish(
                fl.migration_id, ResizeOutcome.ABORTED,
                time.monotonic() - fl.started,
                error=f"the job ended: {reason}"[:250]))
        self.io.journal.write(record.set_job_state, self.spec.job_id, state, reason=reason)
        self.io.journal.catch_up(END_CATCH_UP_S)
        logger.info("job %s %s: %s", self.spec.job_id, state, reason)
        return result or state

    def commit_decided(self, key: str, value: bytes) -> None:
        """The rendezvous store's hook, on its thread, before any rank hears of it: the
        resize in flight was decided commit (its key's first value). Recorded at once, with
        the new layout, so that a coordinator killed before it records the commit itself
        rolls the resize forward at its restart (:func:`.restart.roll_forward`) rather than back:
        the workers that heard the decision train in the new layout. A record that cannot
        be written (a full disk) is one warning: the restart then aborts the resize.

        Also a step's decision in the old layout that holds the order: the loop no longer
        sends it again to that layout's ranks (:func:`.verdicts.step_decided_the_order`)."""
        fl = self.resize.inflight
        if fl is not None and verdicts.step_decided_the_order(
                key, value, GenerationKeys(self.spec.job_id, self.generation).prefix,
                fl.order.generation):
            self.resize.agreed_heard = max(self.resize.agreed_heard, fl.order.generation)
            return
        if value != COMMIT or fl is None or key != commit_decision(
                GenerationKeys(self.spec.job_id, fl.order.generation).prefix):
            return
        new = fl.order.new.layout()
        payload = {"generation": fl.order.generation,
                   "layout": str(new.config), "ranks": list(new.devices),
                   "vranks": {str(v): str(fl.vranks[v]) for v in new.devices},
                   "rebuild": fl.rebuild}
        try:
            eid = record.record_event(self.io.store, self.spec.job_id, "commit-decided",
                                      source="coordinator",
                                      key=f"commit-decided:g{fl.order.generation}",
                                      payload=payload)
            record.mark_event_handled(self.io.store, eid, "recorded before the workers heard")
            self.io.crash("after-commit-decided")
        except Exception as err:  # noqa: BLE001 - on the store's thread: never raised there
            logger.warning("resize to generation %d: its commit decision is not recorded "
                           "(%s): a coordinator restarted before its commit is recorded "
                           "would abort it", fl.order.generation, str(err)[:200])
        # the loop commits the resize at its next turn (reconcile.settle: every rank follows
        # this decision), not after an answer from each rank
        self.resize.commit_heard = max(self.resize.commit_heard, fl.order.generation)


def owner() -> tuple[int, str]:
    """The real uid and its name (never the environment)."""
    import pwd

    uid = os.getuid()
    try:
        return uid, pwd.getpwuid(uid).pw_name
    except KeyError:
        return uid, str(uid)
