# mypy: disable-error-code="misc, has-type"
"""The resize on a worker: a joiner's first order and warm-up, the plan checked against the
coordinator's, the new world prepared where the order was agreed (or beside training:
:mod:`.preparation`), the pause (data phase, commit vote, switch), a committed layout held
when a new rank died before installing, and a refusal every rank computes alike.

A mixin of :class:`~slurm_etc.worker.trainer.ElasticTrainer`: a resize replaces the
trainer's layout, generation, state and catalog (its whole state)."""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from slurm_etc.lifecycle import ProcessOutcome
from slurm_etc.megatron.resize import InstallInterrupted
from slurm_etc.plan import Layout, MigrationPlan, ParallelConfig, Topology, plan_migration
from slurm_etc.plan.catalog import Catalog, build_catalog
from slurm_etc.plan.errors import ConfigError, StateLostError
from slurm_etc.plan.fingerprint import plan_digest
from slurm_etc.plan.model import ModelDesc
from slurm_etc.protocol.rendezvous import GenerationKeys
from slurm_etc.protocol.store import StoreUnreachable
from slurm_etc.protocol.values import decode_value

from ..protocol.messages import Ready, Resize, Stop
from .building import freeze_heap
from .extras import surviving_rng_source
from .process import CommitUnknown, WorkerProcess

if TYPE_CHECKING:
    from slurm_etc.megatron.resize import PreparedResize

    from .trainer import ElasticTrainer

# A new rank that waits this long for its peers to install a committed layout reports the
# commit at once: the coordinator can then settle it and name a peer that died meanwhile.
EARLY_COMMIT_REPORT_S = 2.0
# The phases of resize_in_place that the worker's "resized" line shows, in their order.
PAUSE_PARTS = ("resume", "migrate", "train_group", "rebuild", "install", "switch")


class ResizeSteps:
    """The resize's part of :class:`~slurm_etc.worker.trainer.ElasticTrainer`."""

    # trainer fields these steps set to another type than mypy would infer from them here
    # (ElasticTrainer.__init__ sets them first)
    layout: Layout | None
    _held: tuple[list, Any] | None
    _gate: tuple[int, int, bool] | None

    def _first_order(self: ElasticTrainer, proc: WorkerProcess) -> Resize | Stop:
        """A joining process waits for the resize that brings it in."""
        deadline = time.monotonic() + proc.timeout_s
        while time.monotonic() < deadline:
            self._check_coordinator()
            order = proc.control.wait(min(1.0, deadline - time.monotonic()))
            if isinstance(order, Stop) or isinstance(order, Resize) and \
                    order.generation > self.generation and \
                    order.generation not in self._aborted and proc.vrank in order.new.devices:
                return order
        raise TimeoutError(f"vrank {proc.vrank} of job {proc.job} got no order to join within "
                           f"{proc.timeout_s:.0f} s")

    def _warm_up(self: ElasticTrainer, order: Resize) -> None:
        """A joiner, before the old layout is ordered: do aside what needs no peer (import
        what building the new layout, the migration and the schedule use; the data set is
        open already), then say Ready. The coordinator orders the old layout only once every
        joiner did, so the old layout trains through all of this. The new layout's groups,
        model, DDP and optimizer need the stayers in the rendezvous: they are built there
        (docs/zero-stall.md)."""
        import importlib

        proc = self._proc()
        t0 = time.perf_counter()
        for name in ("megatron.core.models.gpt", "megatron.core.optimizer",
                     "megatron.core.distributed", "megatron.core.pipeline_parallel",
                     "megatron.core.optimizer_param_scheduler", "slurm_etc.megatron.resize",
                     "slurm_etc.megatron.world", "slurm_etc.migrate.executor",
                     "slurm_etc.migrate.group", "slurm_etc.migrate.program"):
            importlib.import_module(name)
        freeze_heap()
        seconds = time.perf_counter() - t0
        proc.control.report(Ready(proc.job, order.generation, proc.vrank, seconds))
        self._log("ready for generation %d (warm-up %.2f s)", order.generation, seconds)

    def _resize(self: ElasticTrainer, order: Resize) -> str:
        """Move to ``order.new``; "left" if this process is not part of it, else "stay"."""
        from slurm_etc.megatron.resize import prepare_resize
        from slurm_etc.migrate.executor import MigrationOptions

        proc = self._proc()
        if self._preparing is not None:  # a newer order (one naming the dead) supersedes it
            self._drop_preparation()
        old, new = order.old.layout(), order.new.layout()
        gen = order.generation
        self._lost = frozenset(order.lost)
        keys = GenerationKeys(proc.job, gen)
        if self.layout is not None and old != self.layout:
            return self._refuse(order, f"order's old layout {old.config} on {old.devices} is "
                                       f"not the current {self.layout.config}")
        try:
            self._check_layout(new.config)
            plan = self._plan(order, keys, old, new)
        except StateLostError as err:
            rebuilt = self._rebuild_lost(order, keys, old, new, err)
            if isinstance(rebuilt, str):
                return rebuilt
            plan = rebuilt
        except ConfigError as err:
            return self._refuse(order, str(err))
        t0 = time.perf_counter()
        began = time.time()
        options = MigrationOptions(timeout_s=proc.timeout_s)
        if self._prepares_while_training(order):
            self._start_preparation(order, plan, options)
            return "stay"
        # The new layout's world (its groups, and the user's model, DDP and optimizer built
        # empty) is prepared first and the migration writes straight into it, the old state
        # that stays on this process moved in already (megatron/placement.py); the pause
        # then holds the data phase and the switch (see megatron/resize.py). Here (a
        # joiner, a loss without notice, a committed layout held) it is prepared where the
        # order was agreed; a process of a live old layout prepares while it trains.
        catalog = self.catalog  # _build sets the new one; an abort puts this back
        build_new = ((lambda cfg: self._build(cfg, empty=True))
                     if proc.vrank in new.devices else None)
        try:
            prepared = prepare_resize(plan, proc.vrank, proc.store, tag=keys.prefix,
                                      options=options, group_timeout_s=proc.timeout_s, world=True,
                                      build_new=build_new, state=self.state)
        except BaseException:
            self.catalog = catalog
            raise
        return self._pause(order, plan, prepared, catalog, t0, began)

    def _pause(self: ElasticTrainer, order: Resize, plan: MigrationPlan, prepared: PreparedResize,
               catalog: Catalog | None,
               t0: float, began: float) -> str:
        """The resize's pause on this process, its preparation done: the data phase, the
        commit vote, the switch; "left" if this process is not in the new layout."""
        from slurm_etc.megatron.resize import resize_in_place
        from slurm_etc.migrate.executor import MigrationAborted
        from slurm_etc.migrate.transport import TransportError

        proc = self._proc()
        old, new = order.old.layout(), order.new.layout()
        gen = order.generation
        keys = GenerationKeys(proc.job, gen)
        t_publish = time.perf_counter()
        self._published = self._publish_extras(keys, old)
        published_s = time.perf_counter() - t_publish

        faults = self._kill.injector(plan, proc.vrank, gen) if self._kill else None
        early = _EarlyReport()
        held, self._held = self._held, None
        try:
            out = resize_in_place(prepared, self.state, faults=faults, held=held,
                                  install_wait=lambda waited: self._install_wait(
                                      order, new, waited, early),
                                  store_lost=self._await_restart)
        except (MigrationAborted, TransportError) as err:
            # TransportError: a peer died in the step and RNG exchange before the data phase
            # (soak seed 203: a preempted node's workers killed in the pause): nothing
            # moved, nothing voted, the old state is whole
            self.catalog = catalog
            self._aborted.add(gen)
            self._attempt += 1
            self._held = held
            self._log("resize to generation %d aborted, old layout kept: %s", gen,
                      str(err)[:300])
            self._record(order, ProcessOutcome.ABORTED, 0, 0.0, 0.0, str(err))
            return "stay"
        except InstallInterrupted as err:
            self._hold(err, order, old, new, plan)
            return "stay"
        except StoreUnreachable as err:  # at the vote's decision or after it
            raise CommitUnknown(f"the coordinator died while the resize to generation {gen} "
                                f"decided its commit ({err}): this process cannot know the "
                                "decision and exits; the restarted coordinator resizes "
                                "around it") from err
        pause = out.seconds["ready"] - began
        self.state = out.state
        self.generation, self._attempt = gen, 0
        if out.state is None:
            self.layout = None
            self._record(order, ProcessOutcome.LEFT, plan.moved_bytes, pause,
                         out.stats.get("data_seconds", 0.0), "", out.stats)
            return "left"
        self.layout = new
        t_adopt = time.perf_counter()
        self._adopt_extras(keys, old, new, plan)
        adopted_s = time.perf_counter() - t_adopt
        if not early.sent or out.stats.get("answers_for_group"):
            self._record(order, ProcessOutcome.COMMITTED, plan.moved_bytes, pause,
                         out.stats.get("data_seconds", 0.0), "", out.stats)
        if gen in self._expected_fp:  # committed (nothing else holds the state): checked
            self._check_rebuilt(keys, new, self._expected_fp.pop(gen))
        parts = ", ".join(f"{k} {out.seconds[k]:.3f}" for k in PAUSE_PARTS if k in out.seconds)
        ready = ", ".join(f"{k} {v:.3f}" for k, v in prepared.seconds.items())
        self._log("resized %s -> %s: moved %.1f MiB (lower bound %.1f MiB), pause %.3f s, "
                  "total %.3f s (trainer state published %.3f, %s, data %.3f, trainer state "
                  "adopted %.3f; prepared: %s)", old.config, new.config,
                  plan.moved_bytes / 2**20, plan.lower_bound_moved_bytes / 2**20, pause,
                  time.perf_counter() - t0, published_s, parts,
                  out.stats.get("data_seconds", 0.0), adopted_s, ready)
        # every rank of the new layout installed it (the install wait): its first boundary
        # decides by the layout's collectives, as after an open gate, not in the store
        self._gate = (self.generation, self.step, True)
        return "stay"

    def _prepares_while_training(self: ElasticTrainer, order: Resize) -> bool:
        """Whether this process prepares the resize while its old layout trains on: the
        order asks for it, this process is in a live old layout (not a joiner), nobody is
        lost (the old layout cannot train without them), and no committed layout is
        held."""
        proc = self._proc()
        return (order.prepare_while_training and self.layout is not None
                and self.state is not None and not order.lost and self._held is None
                and proc.vrank in order.old.devices)

    def _install_wait(self: ElasticTrainer, order: Resize, new: Layout, waited: float,
                      early: "_EarlyReport") -> bool:
        """Committed, waiting for the other new ranks to install: report the commit if the
        wait is long (the coordinator settles it), and give up when an order names one of
        the new layout's devices as dead."""
        if waited > EARLY_COMMIT_REPORT_S and not early.sent:
            early.sent = True
            self._record(order, ProcessOutcome.COMMITTED, 0, 0.0, 0.0, "")
        self._take_orders()
        p = self._pending
        return isinstance(p, Resize) and bool(p.lost) and p.old.layout() == new

    def _hold(self: ElasticTrainer, err: InstallInterrupted, order: Resize, old: Layout,
              new: Layout, plan: MigrationPlan) -> None:
        """The migration committed but a new rank died before installing: keep this rank's
        committed shards for the resize that names the dead (no training meanwhile)."""
        proc = self._proc()
        keys = GenerationKeys(proc.job, order.generation)
        self._log("resize to generation %d committed, not installed: %s", order.generation,
                  err)
        trainer = decode_value(proc.store.get(keys.trainer))
        src = surviving_rng_source(old, new, new.devices.index(proc.vrank), plan, self._lost)
        rng = decode_value(proc.store.get(keys.rng(src)))
        self._held = (err.shards, err.resume)
        self._held_extras = (trainer, rng)
        self.state = None  # its training groups are gone since the commit
        self.layout, self.generation, self._attempt = new, order.generation, 0
        self.catalog = build_catalog(plan.catalog.model, new.config)

    def _plan(self: ElasticTrainer, order: Resize, keys: GenerationKeys, old: Layout,
              new: Layout) -> MigrationPlan:
        catalog = self._catalog_for(keys, old)
        proc = self._proc()
        topology = (dataclasses.replace(proc.topology, gpus_per_node=order.gpus_per_node)
                    if order.gpus_per_node else proc.topology)
        plan = cached_plan(catalog, old, new.config, tuple(sorted(order.pool or new.devices)),
                     topology, proc.keep_tp_in_node, tuple(sorted(order.lost)))
        if tuple(plan.new.devices) != tuple(new.devices):
            raise ConfigError(f"the plan places the new ranks on {list(plan.new.devices)}, the "
                              f"order on {list(new.devices)} (planner versions differ?)")
        if order.plan_digest and order.plan_digest != plan_digest(plan):
            raise ConfigError("this worker's plan differs from the coordinator's "
                              f"({plan_digest(plan)[:12]} != {order.plan_digest[:12]})")
        return plan

    def _catalog_for(self: ElasticTrainer, keys: GenerationKeys, old: Layout) -> Catalog:
        """The live model's catalog. Old rank 0 publishes its ModelDesc under the resize's
        keys; a joining process, which has built nothing yet, plans from it (and checks it
        against its own model once built)."""
        proc = self._proc()
        if self.catalog is not None:
            if proc.vrank == self._publisher(old):
                proc.store.set(keys.model, json.dumps(self.catalog.model.to_json()))
            return self.catalog
        desc = ModelDesc.from_json(json.loads(proc.store.get(keys.model)), self.name)
        return build_catalog(desc, old.config)

    def _publisher(self: ElasticTrainer, old: Layout) -> int:
        """The old vrank that publishes what every old rank holds alike: the lowest
        surviving one."""
        return next(v for v in old.devices if v not in self._lost)

    def _refuse(self: ElasticTrainer, order: Resize, why: str) -> str:
        """Every rank computes the same refusal: nothing moves, the old layout trains on."""
        self._log("resize to generation %d refused: %s", order.generation, why)
        self._attempt += 1
        self._record(order, ProcessOutcome.ABORTED, 0, 0.0, 0.0, why)
        if self.layout is None:
            raise ConfigError(why)
        return "stay"


@lru_cache(maxsize=16)
def cached_plan(catalog: Catalog, old: Layout, new_config: ParallelConfig, pool: tuple[int, ...],
          topology: Topology, keep_tp_in_node: bool, lost: tuple[int, ...] = ()
          ) -> MigrationPlan:
    return plan_migration(catalog.model, old, new_config, pool, topology,
                          keep_tp_in_node=keep_tp_in_node, catalog=catalog,
                          **({"lost": lost} if lost else {}))


@dataclass
class _EarlyReport:
    sent: bool = False
