# mypy: disable-error-code="misc, has-type"
"""A resize prepared while the old layout trains: the migration group, program and staging
buffers in a thread, then the new world's groups and its model, DDP and optimizer at two
step boundaries, then the pause (:meth:`~.resizing.ResizeSteps._pause`).

The preparation's own state is a :class:`Preparation`; the steps are a mixin of
:class:`~slurm_etc.worker.trainer.ElasticTrainer`, as they read its orders, swap its
catalog and record through it."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slurm_etc.lifecycle import ProcessOutcome
from slurm_etc.plan import MigrationPlan
from slurm_etc.plan.catalog import Catalog
from slurm_etc.protocol.rendezvous import GenerationKeys

from ..protocol.messages import Resize

if TYPE_CHECKING:
    import threading

    from slurm_etc.megatron.resize import PreparedResize
    from slurm_etc.migrate.executor import MigrationOptions

    from .trainer import ElasticTrainer

# Step times kept to compare the old layout's steps while a resize is prepared with before.
STEP_TIMES_KEPT = 64


@dataclass
class Preparation:
    """A resize prepared while the old layout trains: the transfer (``thread``), then the
    new world's groups (``stage`` "groups") and its model (``stage`` "world") at two step
    boundaries, then the pause."""

    order: Resize
    plan: MigrationPlan
    started: float
    thread: threading.Thread | None = None
    prepared: PreparedResize | None = None
    error: BaseException | None = None
    stage: str = "transfer"
    new_catalog: Catalog | None = None
    prepared_s: float = 0.0
    world_s: float = 0.0


def prepared_everywhere(failed: bool, done: bool) -> tuple[bool, bool]:
    """Whether some rank of the old layout failed to prepare the resize, and whether some
    rank's preparation still runs: one small all-reduce over the layout's world at a step
    boundary (on the step's device, as the gate's), O(1) a rank. (It was a store request
    naming every rank's key: ranks x ranks keys at the coordinator a boundary.) The
    preparation's own collectives run on the migration group's backends, never on this
    one. A peer dead since fails it as it fails the step's own all-reduce."""
    import torch
    import torch.distributed as dist

    from slurm_etc.migrate import device

    counts = torch.tensor([int(failed), int(not (done or failed))], dtype=torch.int64,
                          device=device.current().device)
    dist.all_reduce(counts)
    return bool(counts[0] > 0), bool(counts[1] > 0)


class PreparationSteps:
    """The preparation's part of :class:`~slurm_etc.worker.trainer.ElasticTrainer`."""

    # trainer fields these steps set to another type than mypy would infer from them here
    # (ElasticTrainer.__init__ sets them first)
    _preparing: Preparation | None

    def _start_preparation(self: ElasticTrainer, order: Resize, plan: MigrationPlan,
                           options: MigrationOptions) -> None:
        """Start preparing the resize beside training: the migration group, the program
        and the staging buffers in a thread (collectives on the migration group's own gloo
        backends only: none on a group the training thread uses); the new world is built
        at a later step boundary (:meth:`_advance_preparation`)."""
        import threading

        from slurm_etc.megatron.resize import prepare_transfer

        proc = self._proc()
        prep = Preparation(order, plan, time.perf_counter())
        self.resumption.stalled = 0.0  # this resize's, not an aborted one's before it

        def transfer() -> None:
            try:
                tag = GenerationKeys(proc.job, order.generation).prefix
                prep.prepared = prepare_transfer(plan, proc.vrank, proc.store, tag=tag,
                                                 options=options,
                                                 group_timeout_s=proc.timeout_s)
            except BaseException as err:  # reported at the next step boundary
                prep.error = err
        prep.thread = threading.Thread(target=transfer, name="slurm-etc-prepare",
                                       daemon=True)
        prep.thread.start()
        self._preparing = prep
        # the old layout agrees again at this step: not on the keys that carried the order
        self._attempt += 1
        self._log("preparing the resize to generation %d while training", order.generation)

    def _advance_preparation(self: ElasticTrainer, last: bool) -> str:
        """At a step boundary with a resize being prepared: every rank of the old layout
        says whether its transfer preparation is done (:func:`prepared_everywhere`). Once all
        are, the new world is built (the new layout's ranks: groups, model, DDP, optimizer,
        staying state moved in) and the old layout trains one more step; at the boundary
        after it, the pause. ``last``: no step is left to train, so each stage runs at once.
        Returns "left" when this process left the job in the pause, else "stay"."""
        prep, proc, layout = self._preparing, self._proc(), self.layout
        if prep is None or layout is None:
            raise RuntimeError("no resize is being prepared in a live layout")
        if prep.stage == "world":
            return self._finish_preparation(prep)
        if prep.stage == "groups":
            self._build_new_world(prep)
            return self._finish_preparation(prep) if last else "stay"
        if last and prep.thread is not None:
            prep.thread.join(proc.timeout_s)
        done = prep.thread is not None and not prep.thread.is_alive()
        try:
            failed, waiting = prepared_everywhere(prep.error is not None, done)
        except RuntimeError:  # a peer died: the resize naming it follows
            self._drop_preparation()
            raise
        if failed:
            why = str(prep.error) if prep.error is not None else "a peer failed to prepare"
            self._drop_preparation()
            self._aborted.add(prep.order.generation)
            self._attempt += 1
            self._log("resize to generation %d aborted while preparing: %s",
                      prep.order.generation, why[:300])
            self._record(prep.order, ProcessOutcome.ABORTED, 0, 0.0, 0.0, why)
            return "stay"
        if waiting:
            return "stay"
        prep.prepared_s = time.perf_counter() - prep.started
        self._start_new_world(prep)
        if last:
            self._build_new_world(prep)
            return self._finish_preparation(prep)
        return "stay"

    def _start_new_world(self: ElasticTrainer, prep: Preparation) -> None:
        """The new world's groups beside the live ones, at a step boundary (it swaps torch's
        default group and megatron's globals: not in a thread); its model, DDP and
        optimizer come at the next boundary (:meth:`_build_new_world`), so that training
        stops for each half, not for the whole. Every rank of the old layout takes the
        stages at the same steps; a leaving one has nothing to build."""
        from slurm_etc.megatron.resize import start_new_world

        prep.stage = "groups"
        if self._proc().vrank not in prep.order.new.devices:
            return
        t, wall = time.perf_counter(), time.time()
        assert prep.prepared is not None  # the transfer's preparation came first
        try:
            start_new_world(prep.prepared)
        except BaseException:
            self._preparing = None  # its migration group is destroyed
            raise
        took = time.perf_counter() - t
        prep.world_s += took
        assert prep.prepared.world is not None
        parts = prep.prepared.world.seconds
        self._log("built the new world of generation %d at a step boundary: %.3f s (training "
                  "stopped; unix %.3f to %.3f): part 1 of 2: group %.3f, megatron's groups "
                  "%.3f", prep.order.generation, took, wall, wall + took,
                  parts.get("group", 0.0), parts.get("megatron_groups", 0.0))

    def _build_new_world(self: ElasticTrainer, prep: Preparation) -> None:
        """The new world's model, DDP and optimizer, at the step boundary after its groups
        (:meth:`_start_new_world`), and the staying state moved in. The old layout trains
        on in it afterwards (its staying tensors now live in the new memory)."""
        from slurm_etc.megatron.resize import finish_new_world

        proc = self._proc()
        prep.stage = "world"
        if proc.vrank not in prep.order.new.devices:
            return
        t, wall = time.perf_counter(), time.time()
        catalog = self.catalog  # _build sets the new one: the old layout trains on with this
        assert prep.prepared is not None  # the transfer's preparation came first
        try:
            finish_new_world(prep.prepared, build_new=lambda cfg: self._build(cfg, empty=True),
                             state=self.state)
        except BaseException:
            self._preparing = None  # its migration group is destroyed
            raise
        finally:
            prep.new_catalog, self.catalog = self.catalog, catalog
        took = time.perf_counter() - t
        prep.world_s += took
        # training stops for each half: the widest gap is reported as the resize's stall
        parts = prep.prepared.seconds
        self._log("built the new world of generation %d at a step boundary: %.3f s (training "
                  "stopped; unix %.3f to %.3f): part 2 of 2: model + DDP + optimizer %.3f, "
                  "staying state placed %.3f", prep.order.generation, took, wall,
                  wall + took, parts.get("world_build", 0.0), parts.get("place", 0.0))

    def _finish_preparation(self: ElasticTrainer, prep: Preparation) -> str:
        """The pause of a resize prepared while training."""
        self._preparing = None
        catalog = self.catalog
        if prep.new_catalog is not None:
            self.catalog = prep.new_catalog
        during = [t for t, p in self.step_times if p]
        before = [t for t, p in self.step_times if not p]
        self._log("resize to generation %d prepared while training: transfer %.3f s, new "
                  "world %.3f s; %d step(s) trained meanwhile, %.3f s each against %.3f s "
                  "before", prep.order.generation, prep.prepared_s, prep.world_s, len(during),
                  sum(during) / max(1, len(during)), sum(before) / max(1, len(before)))
        self.step_times.clear()
        assert prep.prepared is not None  # finished: its transfer was prepared
        return self._pause(prep.order, prep.plan, prep.prepared, catalog,
                           time.perf_counter(), time.time())

    def _drop_preparation(self: ElasticTrainer) -> None:
        """Give up the resize being prepared (its transfer's group, its new world)."""
        from slurm_etc.megatron.placement import give_back

        prep, self._preparing = self._preparing, None
        if prep is None:
            return
        if prep.thread is not None:
            # a rendezvous wait of the preparation (a dead peer's key never comes) ends
            # within a slice, not at the worker timeout
            store = self._proc().store
            interruptible = hasattr(store, "interrupt")
            if interruptible:
                before = store.interrupt
                store.interrupt = lambda: (f"the resize to generation "
                                           f"{prep.order.generation} is given up")
            try:
                prep.thread.join(self._proc().timeout_s)
            finally:
                if interruptible:
                    store.interrupt = before
        prepared = prep.prepared
        if prepared is None:
            return
        if prepared.placed is not None:
            give_back(prepared.placed)
        if prepared.world is not None:
            prepared.world.drop()
        prepared.group.destroy()
