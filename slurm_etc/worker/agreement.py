# mypy: disable-error-code="misc, has-type"
"""The step agreement: at a step boundary every rank of a layout learns the same order (one
rank being told is enough), by a small collective where every rank holds it already and
through the rendezvous store otherwise, and the orders a rank takes from its control seam
meanwhile.

A mixin of :class:`~slurm_etc.worker.trainer.ElasticTrainer`: the orders pending, the
aborted generations and the agreement's attempt are read and written by the resize, the
preparation beside training and the outage handling too (the trainer's shared state).
``slurm_etc/harness/control_ranks.py`` makes the same requests for its simulated ranks
(:func:`agree_slice_s`, :func:`newest_order`)."""
from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from slurm_etc.protocol.rendezvous import GenerationKeys
from slurm_etc.protocol.store import StoreUnreachable, Woken, agree_step, arrive_step

from ..protocol.messages import ENCODER, ORDER_DECODER, Abort, Order, Resize, Stop
from .process import WorkerProcess

if TYPE_CHECKING:
    from .trainer import ElasticTrainer

# A rank waiting for its peers at the step agreement asks again (and looks at its orders)
# this often. The job's store answers at once when the decision is there and when the
# coordinator names the dead (the wake key), so the slice only bounds a wait on another
# store: short slices re-ask N times a second while a 16k-rank job arrives (seconds).
AGREE_SLICE_S = 1.0
# ...and in a large job at least world / AGREE_ASKS_PER_S seconds: the waiting ranks' slices
# together ask the store at most about this many times a second, whatever the job's size
# (at 4,096 ranks, slices of 1 s were more than half of a resize's requests at the store;
# at 16,384 simulated ranks, 1,024 asks a second were 334,169 of a 435 s grow's requests,
# 20 a rank, where the decision and the wake key end every wait at once anyway).
AGREE_ASKS_PER_S = 128


def agree_slice_s(world: int) -> float:
    """How long one slice of a rank's wait at a step's decision lasts in a ``world``-rank
    layout (:data:`AGREE_SLICE_S`, longer past :data:`AGREE_ASKS_PER_S` ranks)."""
    return max(AGREE_SLICE_S, world / AGREE_ASKS_PER_S)


# order_key of a Stop: above every resize's (a Stop is never passed over: newest_order)
STOP_KEY = 1 << 40


def order_key(order: Order | None, store_lost: bool = False) -> int:
    """What a rank holds at a boundary as one number the ranks compare
    (:meth:`StepAgreement._decide_together`): 0 nothing, 1 nothing but its store's
    connection closed (a coordinator died: the store's path waits for its restart), else
    the order's generation, above every resize's for a Stop. Two copies of one order give
    the same number, two orders never do (each resize has a generation of its own, and
    every Stop of a generation stops); the newest order has the highest."""
    if order is None:
        return int(store_lost)
    return (STOP_KEY if isinstance(order, Stop) else 2) + order.generation


def how_decided(lowest: int, highest: int) -> str:
    """How a boundary after an open gate is decided, from the lowest and highest
    :func:`order_key` the layout's ranks hold: ``"held"``, every rank holds the same order,
    or none holds any and no store was lost (each takes its own); ``"given"``, some rank
    holds an order others lack or hold older (the lowest rank holding the highest gives
    it to every rank: one rank told is enough); ``"store"``, none holds an order and some
    rank's store closed (the store's agreement waits for the restarted coordinator)."""
    if lowest == highest != 1:
        return "held"
    return "given" if highest > 1 else "store"


def newest_order(values: Iterable[bytes], generation: int, aborted: Collection[int]
                 ) -> Order | None:
    """The newest order the ranks wrote into a step's agreement (``b"-"``: none) that is
    still ahead of a process at ``generation``: one of its own generation or older was
    carried out already (a copy that came twice is not a second resize), an aborted one is
    over; a Stop is never passed over (its generation may be an aborted resize's)."""
    orders = [o for o in (ORDER_DECODER.decode(v) for v in values if v != b"-")
              if isinstance(o, Stop) or o.generation > generation and o.generation not in aborted]
    stops = [o for o in orders if isinstance(o, Stop)]
    return stops[0] if stops else max(orders, key=lambda o: o.generation) if orders else None


class StepAgreement:
    """The step agreement's part of :class:`~slurm_etc.worker.trainer.ElasticTrainer`."""

    # trainer fields these steps set to another type than mypy would infer from them here
    # (ElasticTrainer.__init__ sets them first)
    _pending: Order | None
    _gate: tuple[int, int, bool] | None

    def _holds_an_order(self: ElasticTrainer) -> bool:
        """Whether this rank needs the store's agreement at the next boundary: an order is
        pending (one of its own generation or older is done), or its store's connection
        closed. Reads the channel without the silence check (an exception here, on some
        ranks only, would split them)."""
        proc = self.proc
        if proc is None:
            return False
        self._drain_orders(proc)
        if isinstance(self._pending, Resize | Abort) and \
                self._pending.generation <= self.generation:
            self._pending = None
        disconnected = getattr(proc.store, "disconnected", None)
        return self._pending is not None or bool(disconnected and disconnected())

    def _take_orders(self: ElasticTrainer) -> None:
        """Drain the control seam into ``_pending`` (the newest order; an Abort cancels the
        pending resize of its generation). Raises CoordinatorLost once the coordinator has
        been silent past the reattach wait."""
        proc = self._proc()
        try:
            self._drain_orders(proc)
        finally:
            self._check_coordinator()  # after the drain: what just came counts as heard

    def _drain_orders(self: ElasticTrainer, proc: WorkerProcess) -> None:
        while (order := proc.control.poll()) is not None:
            self._consider(order)

    def _consider(self: ElasticTrainer, order: Order) -> None:
        """Keep ``order`` in ``_pending`` if it is the newest that applies (a Stop always
        does: its generation may be one whose resize aborted here)."""
        if isinstance(order, Stop):
            self._pending = order
            return
        if order.generation <= self.generation or order.generation in self._aborted:
            return
        prep = self._preparing
        if prep is not None and order.generation == prep.order.generation:
            if isinstance(order, Abort) and prep.stage == "transfer":
                # every rank gives it up together, at the next preparation agreement
                prep.error = RuntimeError(f"aborted by the coordinator: {order.reason}")
            return  # else the same order again (resent): it is being prepared
        if isinstance(order, Abort):
            self._abort_told.add(order.generation)
            if self._pending is not None and self._pending.generation == order.generation:
                self._log("resize to generation %d aborted by the coordinator: %s",
                          order.generation, order.reason)
                self._pending = None
            return
        if self._pending is None or order.generation >= self._pending.generation:
            self._pending = order

    def _agree(self: ElasticTrainer) -> Order | None:
        """At a step boundary, every rank of the layout learns the same order, one that a
        rank holds (one rank being told is enough), or that there is none.

        Nothing is asked while the last step's gate (its loss all-reduce) said no rank holds
        an order. After an open gate, small collectives decide (:meth:`_decide_together`):
        every rank holds the same order, or one rank holding the newest gives it to all;
        rank 0 alone writes a decided order to the store; so at the first boundary of a
        layout every rank installed in a resize (its gate counts as open). At a layout's
        first boundary otherwise (its world may not be built, as where a committed layout
        is held, or the job's first) and where no rank holds an order but a store closed,
        every rank agrees through the store:
        O(1) requests a rank (:meth:`_arrive`: the first order proposed is the decision).
        Through the store rather than a collective there: a peer that died never arrives,
        and the coordinator's resize naming the dead ends the wait on every survivor, which
        no blocked collective could."""
        proc = self._proc()
        layout = self.layout
        if layout is None:
            raise RuntimeError("agreement without a layout")
        self._take_orders()
        if isinstance(self._pending, Resize | Abort) and \
                self._pending.generation <= self.generation:
            # its own copy, come by the channel while this process carried out the order a
            # peer's agreement told it of: done already, not a new order to agree on
            self._pending = None
        gate, self._gate = self._gate, None
        if gate == (self.generation, self.step, False):
            # no rank held an order when the step ended (one come since is agreed on at the
            # next boundary: it joins that step's gate); nothing asked of the store
            return None
        rank = layout.devices.index(proc.vrank)
        names = GenerationKeys(proc.job, self.generation)
        decided = names.agreement(self._attempt, self.step, "decided")
        if gate == (self.generation, self.step, True):
            together, order = self._decide_together()
            if together:
                # every rank holds the order (the coordinator told them all, the common
                # case), one gave it to all, or none holds any: nothing asked of the store
                if rank == 0:
                    self._say_decided(decided, order)
                return self._took(order)
        own = names.agreement(self._attempt, self.step, rank)
        # every peer read the key of step - 2 before the step after it could start
        stale = names.agreement(self._attempt, self.step - 2, rank) if self.step >= 2 else ""
        arrive = (decided, names.agreement(self._attempt, self.step, "arrived"),
                  layout.config.world)
        self._agreeing = (own, stale)
        values = self._arrive(*arrive)
        deadline = time.monotonic() + proc.timeout_s
        # the store answers when the decision is there (one round trip); each slice, orders
        # are looked at
        while values is None:
            if self._rejoined:
                # reattached to a restarted coordinator: its store is new, and this rank
                # arrives there once with what it holds now (the new coordinator's order)
                self._rejoined = False
                deadline = time.monotonic() + proc.timeout_s
                if (values := self._arrive(*arrive)) is not None:
                    break
            self._take_orders()
            if self._names_the_dead(self._pending):
                order, self._pending = self._pending, None
                return order
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks of {layout.config} did not reach step {self.step} "
                                   f"within {proc.timeout_s:.0f} s")
            values = self._agree_slice(own, b"-", stale, [decided])
        return self._took(newest_order(values, self.generation, self._aborted))

    def _took(self: ElasticTrainer, order: Order | None) -> Order | None:
        """``order`` decided at this boundary: the one held is done with unless it is newer
        (another rank's proposal came first in the store: it opens the next boundary's
        gate, where it is decided)."""
        held = self._pending
        if held is None or (order is not None and held.generation <= order.generation) \
                or (not isinstance(held, Stop) and held.generation in self._aborted):
            self._pending = None
        return order

    def _decide_together(self: ElasticTrainer) -> tuple[bool, Order | None]:
        """At an open gate (every rank of the layout read it: all come here together), the
        boundary's decision by small collectives over the layout's world, on the step's
        device as the gate's (:func:`how_decided`): one all-reduce of the key of the order
        each holds; where they differ, one more to find the lowest rank holding the newest
        and a broadcast of its bytes (:meth:`_given`). (True, the order or None) decided;
        (False, None) for the store's agreement, where no rank holds an order and some
        rank's store closed. A peer dead since the gate fails these as it fails the step's
        own all-reduce (gloo: the closed connection; NCCL: the watchdog)."""
        import torch
        import torch.distributed as dist

        from slurm_etc.migrate import device

        disconnected = getattr(self._proc().store, "disconnected", None)
        key = order_key(self._pending, bool(disconnected and disconnected()))
        extremes = torch.tensor([key, -key], dtype=torch.int64,
                                device=device.current().device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        highest = int(extremes[0])
        how = how_decided(-int(extremes[1]), highest)
        if how == "store":
            return False, None
        if how == "held":
            return True, self._pending
        return True, self._given(key == highest)

    def _given(self: ElasticTrainer, holder: bool) -> Order | None:
        """The newest order some ranks hold, from the lowest of them to every rank of the
        layout (``holder``: this rank holds it): an all-reduce of (-rank, size) over the
        holders, then a broadcast of its bytes. Taken by the rules of a store's decision
        (:func:`newest_order`: one carried out or aborted here is over)."""
        import torch
        import torch.distributed as dist

        from slurm_etc.migrate import device

        on = device.current().device
        mine = ENCODER.encode(self._pending) if holder else b""
        rank, world = dist.get_rank(), dist.get_world_size()
        head = torch.tensor([-rank if holder else -world, len(mine)], dtype=torch.int64,
                            device=on)
        dist.all_reduce(head, op=dist.ReduceOp.MAX)
        source, size = -int(head[0]), int(head[1])
        data = torch.zeros(size, dtype=torch.uint8, device=on)
        if rank == source:
            data.copy_(torch.frombuffer(bytearray(mine), dtype=torch.uint8))
        dist.broadcast(data, source)
        return newest_order([data.cpu().numpy().tobytes()], self.generation, self._aborted)

    def _say_decided(self: ElasticTrainer, decided: str, order: Order | None) -> None:
        """Rank 0 of an agreement decided without the store writes its decision there all
        the same (one request a job): the coordinator's hook learns from it that the layout
        holds the order and sends it no more copies. A store that stopped answering is
        passed over: the hook only saves messages, and the order is carried out either way
        (raising here, on one rank only, would split the layout)."""
        if order is None:
            return
        try:
            self._proc().store.compare_set(decided, "", ENCODER.encode(order))
        except StoreUnreachable as err:
            self._log("the step's decision not written to the store (%s): the coordinator "
                      "may send the order again", err)

    def _arrive(self: ElasticTrainer, decided: str, arrived: str, world: int) -> list[bytes] | None:
        """This rank's part of a step's decision and the first slice of its wait
        (:meth:`_vote`), one request whatever the job's size (:func:`arrive_step`): it
        proposes the order it holds (the first proposal is the decision: compare-and-set),
        then counts itself in; the last rank in closes the decision with "no order" where
        nobody proposed one. A store that stopped answering (its coordinator died) is waited
        out and the part done again on the restarted one."""
        own, stale = self._agreeing
        while True:
            proposal = b"" if self._pending is None else ENCODER.encode(self._pending)
            try:
                return self._vote(own, b"-", stale, [decided],
                                  arrive=(decided, arrived, world, proposal))
            except StoreUnreachable as err:
                self._await_restart(err)
                self._rejoined = False

    def _agree_slice(self: ElasticTrainer, own: str, mine: bytes, stale: str, keys: list[str]
                     ) -> list[bytes] | None:
        """One slice of the step's agreement; a store that stopped answering (its
        coordinator died) is waited out in :meth:`_await_restart` and the slice is None."""
        try:
            return self._vote(own, mine, stale, keys)
        except StoreUnreachable as err:
            self._await_restart(err)
            return None

    def _vote(self: ElasticTrainer, own: str, mine: bytes, stale: str, keys: list[str], *,
              arrive: tuple[str, str, int, bytes] | None = None) -> list[bytes] | None:
        """Every rank's vote of ``keys`` (this rank's ``mine`` under ``own``), or None after
        a slice, or at once when the coordinator posts an order naming devices of this
        layout as lost (it is then in ``_pending``): a dead peer never votes, and the
        survivors learn of the loss without waiting out the slice. ``arrive`` (decided,
        arrived, world, proposal): this rank arrives at the decision in the same request
        (:func:`arrive_step`; ``mine`` is then "-")."""
        proc = self._proc()
        wake = GenerationKeys(proc.job, self.generation).lost
        slice_s = agree_slice_s(self.layout.config.world if self.layout is not None else 1)
        if arrive is not None:
            got = arrive_step(proc.store, *arrive, own, stale, slice_s, wake=wake,
                              seen=self._woken_by)
        else:
            got = agree_step(proc.store, own, mine, stale, keys, slice_s, wake=wake,
                             seen=self._woken_by)
        if isinstance(got, Woken):
            self._woken_by = got.value
            self._consider(ORDER_DECODER.decode(got.value))
            return None
        return got

    def _names_the_dead(self: ElasticTrainer, order: Order | None) -> bool:
        """A resize away from this layout that names some of its devices as lost."""
        return (isinstance(order, Resize) and bool(order.lost) and self.layout is not None
                and order.old.layout() == self.layout)
