# mypy: disable-error-code="misc, has-type"
"""A coordinator or a peer gone: the worker holds at a step boundary while the coordinator
is silent, reattaches to a restarted one (the same job and record), gives up a resize the
coordinator gave up, and after a failed collective waits for the order that names the dead.

A mixin of :class:`~slurm_etc.worker.trainer.ElasticTrainer`: these steps change the
orders pending, the aborted generations and the preparation beside training (the
trainer's shared state)."""
from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from slurm_etc.migrate import device
from slurm_etc.protocol.store import StoreUnreachable

from ..protocol.messages import HOLD_AFTER_S, ModelBuilt, Order, Resize, Stop
from .process import CoordinatorLost, WorkerProcess

if TYPE_CHECKING:
    from .trainer import ElasticTrainer

logger = logging.getLogger(__name__)

# A worker whose coordinator died says Hello this often until a restarted one answers.
REJOIN_S = 1.0
# A worker waiting for the order naming its dead peers takes the coordinator for dead once
# its link has been down this long (a killed coordinator's closes at once), and holds for
# the restarted one.
LINK_LOST_S = 2.0


class OutageHandling:
    """What :class:`~slurm_etc.worker.trainer.ElasticTrainer` does when its coordinator or
    a peer goes away."""

    # trainer fields these steps set to another type than mypy would infer from them here
    # (ElasticTrainer.__init__ sets them first)
    _pending: Order | None

    def _superseded(self: ElasticTrainer, generation: int) -> str | None:
        """Why the resize to ``generation`` this process carries out is over: the
        coordinator aborted it, or ordered a newer one (or the job's end); None while it
        stands. Asked between the slices of a rendezvous wait."""
        self._drain_orders(self._proc())
        if generation in self._abort_told:
            return f"the coordinator aborted the resize to generation {generation}"
        pending = self._pending
        if isinstance(pending, Stop):
            return "the coordinator stopped the job"
        if isinstance(pending, Resize) and pending.generation > generation:
            return f"the coordinator ordered generation {pending.generation} in its place"
        return None

    def _coordinator_died(self: ElasticTrainer, err: StoreUnreachable, order: Resize | None) -> str:
        """The rendezvous store stopped answering (its coordinator died) outside a step's
        agreement: in the resize to ``order`` before this rank's commit vote (planning,
        connecting the migration group, publishing the trainer state: a vote that lost the
        store raises :class:`CommitUnknown` instead), or in a resize prepared beside
        training. Nothing is committed anywhere without this rank's vote, so the resize is
        given up here as an abort (the restarted coordinator records it so), and this rank
        holds in its old layout for the restarted coordinator (:meth:`_await_restart`),
        which takes it up and orders what comes next. A joiner has nothing to keep: the
        error stands (it exits; the restarted coordinator stops what it does not take)."""
        prep = self._preparing
        given_up = {o.generation for o in (order, prep.order if prep else None) if o}
        if prep is not None:
            self._drop_preparation()
        # (the attempt stays: the restarted coordinator's store holds no agreement of this
        # step, and a peer that waited at the boundary meanwhile did not count one)
        self._aborted |= given_up
        if self.layout is None:
            raise err
        self._log("the coordinator died in the resize to generation %s before this "
                  "process's commit vote: given up here, the old layout %s kept",
                  ", ".join(map(str, sorted(given_up))) or "(none)", self.layout.config)
        self._await_restart(err)
        return "stay"

    def _recover(self: ElasticTrainer, err: RuntimeError) -> Order:
        """A collective failed (a peer died, e.g. its node failed). The step did not
        complete anywhere it failed, so this rank's state is the last step's. Wait for the
        coordinator's resize that names the dead; without one within the timeout, the
        original error stands. The training groups stay registered until the resize has
        read this rank's shards (megatron's sharded_state_dict asks them for tp/pp ranks),
        but their connections close at once (:func:`~slurm_etc.migrate.device.leave_groups`):
        a surviving peer blocked on this rank in another collective of the step fails now,
        not at the group's timeout (it would wait for this rank's part for minutes, and this
        rank for it in the resize)."""
        proc = self._proc()
        if self.resumption.failed_at is None:  # the first failure: the step in flight ended there
            self.resumption.failed_at = time.time()
            prep = self._preparing
            kept = (prep.prepared.world if prep is not None and prep.prepared is not None
                    else None)
            closed = device.leave_groups(kept.groups if kept is not None else (),
                                         base=self._base_sockets,
                                         spare_ports=self._coordinator_ports(proc),
                                         keep_sockets=kept.sockets if kept is not None else ())
            logger.debug("left the failed groups: %d closed", closed)
        self._log("a collective failed after step %d at unix %.6f (%s); waiting for the "
                  "coordinator", self.step, self.resumption.failed_at,
                  str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
        deadline = time.monotonic() + proc.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self._take_orders()
            if isinstance(self._pending, Stop) or self._names_the_dead(self._pending):
                order, self._pending = self._pending, None
                if order is not None:
                    return order
            if (silent := self._silence()) is not None and silent > LINK_LOST_S:
                # the coordinator died too: its order comes from the restarted one
                self._await_restart(StoreUnreachable(
                    f"the coordinator's link is down for {silent:.1f} s"))
                deadline = time.monotonic() + proc.timeout_s
                continue
            # Block on the channel, not a sleep: the order is taken the moment it comes
            # (a 50 ms sleep here was a third of a loss's recovery).
            if (order := proc.control.wait(min(left, 0.5))) is not None:
                self._consider(order)
        raise err

    def _silence(self: ElasticTrainer) -> float | None:
        """Seconds since the coordinator was last heard of (its heartbeats, orders); None
        where that is not known (a control seam without a clock, no reattach wait)."""
        proc = self._proc()
        heard = getattr(proc.control, "heard_at", None)
        if heard is None or not proc.reattach_wait_s:
            return None
        return time.monotonic() - heard

    def _check_coordinator(self: ElasticTrainer) -> None:
        silent = self._silence()
        wait = self._proc().reattach_wait_s
        if silent is not None and wait is not None and silent > wait:
            raise CoordinatorLost(f"no word from the coordinator for {silent:.0f} s (it waits "
                                  f"{wait:.0f} s for a reattach): exiting at step {self.step}")

    def _hold_while_silent(self: ElasticTrainer) -> None:
        """At a step boundary: while the coordinator is silent (killed, or stuck), train
        no step (none it could record); go on when it speaks again, exit past the
        reattach wait (CoordinatorLost from _take_orders)."""
        proc = self._proc()
        silent = self._silence()
        hold = min(HOLD_AFTER_S, (proc.reattach_wait_s or 0.0) / 2)
        if silent is None or silent < hold:
            return
        self._log("no word from the coordinator for %.0f s: holding at step %d (exiting "
                  "after %.0f s of silence)", silent, self.step, proc.reattach_wait_s)
        while (silent := self._silence()) is not None and silent >= hold:
            time.sleep(0.1)
            self._take_orders()
        self._log("the coordinator speaks again: training on")

    def _await_restart(self: ElasticTrainer, err: StoreUnreachable) -> None:
        """The rendezvous store stopped answering at a step boundary: its coordinator died
        (SIGKILL, a crash). Train no step (none could be agreed on or recorded) and say
        Hello every REJOIN_S until a coordinator restarted on the job's record answers
        (it binds the address this worker's channel connects to); then point the store at
        the one it hosts and forget the orders of the coordinator before (a restart aborts
        every resize not begun: the record says so; what it orders meanwhile is kept).
        Past the reattach wait of silence, or told to stop, CoordinatorLost (the worker
        exits)."""
        proc = self._proc()
        rejoin = getattr(proc.control, "rejoin", None)
        if rejoin is None:
            raise err
        t0 = time.monotonic()
        # the orders of the coordinator before: a restart aborts every resize not begun
        if isinstance(self._pending, Resize):
            self._aborted.add(self._pending.generation)
        self._pending = None
        self._log("the rendezvous store stopped answering at step %d: holding for a "
                  "restarted coordinator (exiting after %.0f s of silence)", self.step,
                  proc.reattach_wait_s or 0.0)
        next_hello = 0.0
        while True:
            if time.monotonic() >= next_hello:
                rejoin(self.step, self.generation)
                next_hello = time.monotonic() + REJOIN_S
            time.sleep(0.05)
            self._take_orders()  # CoordinatorLost past the reattach wait
            if isinstance(self._pending, Stop):
                raise CoordinatorLost(f"the restarted coordinator does not take this process "
                                      f"up ({self._pending.reason}): exiting at step "
                                      f"{self.step}")
            welcome = getattr(proc.control, "rendezvous", None)
            if welcome is not None:
                break
        repoint = getattr(proc.store, "repoint", None)
        if repoint is not None:
            repoint(welcome.store_host, welcome.store_port)
        if self._published:  # what the new ranks of the last resize read after its commit
            proc.store.multi_set(list(self._published), list(self._published.values()))
        self._rejoined = True
        if self._model_said is not None:  # what the restarted coordinator may plan with
            proc.control.report(ModelBuilt(proc.job, self.generation, proc.vrank,
                                           self._model_said, self._provider_takes_vp_stage()))
        self._log("reattached to the coordinator at step %d after %.1f s; training on",
                  self.step, time.monotonic() - t0)

    @staticmethod
    def _coordinator_ports(proc: WorkerProcess) -> set[int]:
        """The ports of the coordinator's channel and store (as they are now: a restarted
        coordinator's store may have moved), whose connections a rank leaving its groups
        keeps."""
        ports = {getattr(proc.store, "port", None)}
        address = getattr(proc.control, "address", None)
        if isinstance(address, str) and ":" in address:
            with contextlib.suppress(ValueError):
                ports.add(int(address.rsplit(":", 1)[1]))
        return {p for p in ports if isinstance(p, int)}
