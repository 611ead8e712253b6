"""An in-place resize of a live megatron-core training state, one process's side.

:func:`prepare_resize` does what needs no pause, while the old layout still trains (the
migration group, this process's program, destination tensors with their pages touched);
:func:`resize_in_place` is the pause: shards -> step and RNG -> execute -> commit -> new
training group -> new model/optimizer -> install. See docs/verify.md.

Both are collective over the plan's participants (``plan.participants``: old ∪ new devices
minus the devices the plan lists as ``lost``). After a loss without grace the dead processes
call nothing: the survivors connect, exchange step and RNG, migrate and commit among
themselves (docs/migrate.md, "Devices lost without notice").
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from slurm_etc.migrate.collector import collector_paused
from slurm_etc.migrate.device import MemoryNeed, check_fits, current, end_world, free_bytes
from slurm_etc.migrate.shards import LocalShard
from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.plan import MigrationPlan
from slurm_etc.protocol.rendezvous import (
    commit_decision,
    installing,
    migration_group_prefix,
    train_group_prefix,
)

from ..errors import InternalError
from .build import TrainingState
from .placement import Placed, give_back, place_staying_state

if TYPE_CHECKING:
    from torch.distributed import Store

    from slurm_etc.migrate.executor import MigrationOptions, MigrationResult, MigrationStats
    from slurm_etc.migrate.faults import FaultInjector
    from slurm_etc.migrate.group import MigrationGroup
    from slurm_etc.migrate.memory import PeakMemory
    from slurm_etc.migrate.program import Program

    from .world import PreparedWorld
from .state import (
    Destinations,
    Relabel,
    ResumeState,
    build_empty_state,
    exchange_resume_state,
    finish_install,
    install_shards,
    local_shards,
    receive_into,
    resume_state,
)


@dataclass
class PreparedResize:
    """One process's side of a resize, connected and allocated before the pause.

    Attributes:
        plan: the MigrationPlan.
        device: this process's device.
        store, tag: the rendezvous store and this resize's key prefix (the new training
            group starts from them).
        group: the migration group (gloo backends of its own, outside the training groups).
        program: this process's part of the plan.
        destinations: the new shards' tensors, pages touched (empty on a departing process).
        staging: the executor's send and receive staging buffers, pages touched.
        options: the executor's options.
        memory: peak memory measurement, started here, stopped at the commit (with a
            prepared world: when the new layout is installed, after the switch).
        group_timeout_s: timeout of the migration and new training groups.
        seconds: wall time of the preparation steps (``group``, ``allocate``,
            ``prepare_world``: the new world in all, of which ``world_group`` (its
            all-ranks group), ``world_megatron_groups``, ``world_build``; 0 without one).
        world: the new layout's prepared world (:class:`.world.PreparedWorld`; None on a
            departing process or without ``world=True``).
        receive: where the migration writes into the prepared world's state
            (:class:`.state.Destinations`).
        placed: the old tensors that now live in the prepared world's memory
            (:mod:`.placement`; given back if the resize aborts).
        relabel: rewrites the old state's pieces before its shards are cut from them, in
            the placement and in the pause alike (a planted bug; None in real runs).
    """

    plan: MigrationPlan
    device: int
    store: Store
    tag: str
    group: MigrationGroup
    program: Program
    destinations: list[torch.Tensor | None]
    options: MigrationOptions
    memory: PeakMemory
    group_timeout_s: float
    seconds: dict = field(default_factory=dict)
    world: PreparedWorld | None = None
    receive: Destinations | None = None
    staging: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    placed: Placed | None = None
    relabel: Relabel | None = None


def prepare_resize(plan: MigrationPlan, device: int, store: Store, *, tag: str,
                   options: MigrationOptions | None = None,
                   group_timeout_s: float = 300.0, prefault: bool = True, world: bool = False,
                   build_new: Callable[[ParallelConfig], TrainingState] | None = None,
                   state: TrainingState | None = None,
                   relabel: Relabel | None = None) -> PreparedResize:
    """What an in-place resize can do while the old layout still trains (collective over
    ``plan.participants``: old ∪ new minus lost devices): connect the migration group from
    ``store`` (keys under ``tag``; the training groups stay untouched), compile this
    process's part of the plan, and prepare where the new shards arrive, pages touched
    (``prefault``). Nothing of the training state is read: training may go on until the
    pause. Memory is measured from here on: what is prepared is the new state the
    two-phase migration holds beside the old one.

    Where the new shards arrive:

    * ``world=True``: in the new layout's own model and optimizer. Every new rank starts
      the new layout's process groups from ``store`` and builds its model, DDP and
      optimizer beside the old ones (:func:`.world.prepare_world`; collective over the new
      ranks); their parameters, main parameters, Adam moments and the
      DistributedOptimizer's flat parameter buffer are the executor's destinations. The
      prepared world costs the new state's memory plus DDP's gradient buffers (allocated
      and zeroed here, not in the pause: releasing them until the switch cost 0.03-0.04 s
      of pause on ``small`` to give them back).
    * otherwise: fresh tensors (``allocate_destinations``); the pause builds the new layout
      after the commit and installs them (``resize_in_place(build_new=...)``).

    Args:
        build_new: with ``world=True``, builds the empty model and optimizer of the new
            layout (runs with the new world's default group and megatron globals in place;
            default: :func:`.build.build_modules` of the catalog's model, no initial
            weights drawn).
        state: with ``world=True`` on a process of both layouts, its live old state: the
            part that stays on this process moves into the prepared world now
            (:func:`.placement.place_staying_state`; the old layout may train on, in that
            memory), so the pause copies none of it. Without it nothing of the training
            state is read here.
        relabel: rewrites the old state's pieces (what this process tells the plan it
            holds) before its shards are cut from them, here and in the pause: where tests
            plant bugs (:mod:`slurm_etc.testing.plants`); None in real runs.
    """
    if build_new is not None and world and device not in plan.new.devices:
        raise ValueError("build_new given to a process outside the new layout")
    prepared = _connect(plan, device, store, tag, options, group_timeout_s, prefault)
    prepared.relabel = relabel
    if world and device in plan.new.devices:
        prepare_new_world(prepared, build_new=build_new, state=state, prefault=prefault)
    else:
        _allocate(prepared, prefault)
    return prepared


def _connect(plan: MigrationPlan, device: int, store: Store, tag: str,
             options: MigrationOptions | None,
             group_timeout_s: float, prefault: bool) -> PreparedResize:
    """The migration group, the program, the staging buffers (no destinations yet)."""
    import torch.distributed as dist

    from slurm_etc.migrate.executor import (
        MigrationOptions,
        agree,
        allocate_staging,
    )
    from slurm_etc.migrate.group import connect_migration_group
    from slurm_etc.migrate.memory import PeakMemory
    from slurm_etc.migrate.program import compile_program

    if device in getattr(plan, "lost", ()):
        raise ValueError(f"device {device} is lost in this plan (lost devices {plan.lost}): "
                         "a lost device takes no part in the resize")
    options = options or MigrationOptions()
    seconds: dict[str, float] = {}
    memory = PeakMemory(current().device)
    if options.measure_memory:
        memory.start()
    t = time.perf_counter()
    group = connect_migration_group(plan, device,
                                    dist.PrefixStore(migration_group_prefix(tag), store),
                                    timeout_s=group_timeout_s)
    seconds["group"] = time.perf_counter() - t
    t = time.perf_counter()
    program = compile_program(plan, device, options.staging_bytes, options.direct_min_bytes)
    try:
        check_fits_beside(program, options, current().device)
    except BaseException:
        group.destroy()
        raise
    program.warm()  # every step's operations worked out now, not in the pause
    # every rank's program checked against the others' now, so the pause's data phase puts
    # its first step on the wire with its first vote (no gate round trip in the pause)
    try:
        agree(group.transport(), program, group_timeout_s)
        staging = allocate_staging(program, options, group.transport(), prefault=prefault)
    except BaseException:
        group.destroy()
        raise
    seconds["allocate"] = time.perf_counter() - t
    # the same keys on every participant (0 where nothing is built)
    seconds.update(prepare_world=0.0, world_group=0.0, world_megatron_groups=0.0,
                   world_build=0.0, place=0.0)
    return PreparedResize(plan, device, store, tag, group, program, [], options, memory,
                          group_timeout_s, seconds, staging=staging)


def check_fits_beside(program: Program, options: MigrationOptions,
                      device: torch.device) -> None:
    """Refuse before anything is allocated (one line, :class:`.device.DeviceMemoryError`) a
    resize whose new shards, gradient buffers and staging exceed what ``device`` has free
    beside the old state; nothing is checked on the CPU."""
    from slurm_etc.migrate.executor import staging_bytes

    free = free_bytes(device)
    if free is None:
        return
    check_fits(memory_need(program, staging_bytes(program, options), free), str(device))


def memory_need(program: Program, staging: int, free: int) -> MemoryNeed:
    """What ``program`` allocates on its device before the old state is released: every new
    shard not kept whole from the old state, gradient buffers the size of the new
    parameters (megatron's DDP allocates them with the model), and ``staging``."""
    destinations = sum(sp.numel * sp.itemsize for j, sp in enumerate(program.new_specs)
                       if j not in program.kept)
    grads = sum(sp.numel * sp.itemsize for sp in program.new_specs
                if not sp.state_key.startswith("optimizer."))  # the model's own tensors
    return MemoryNeed(destinations=destinations, grads=grads, staging=staging, free=free)


def _allocate(prepared: PreparedResize, prefault: bool) -> None:
    """Fresh destination tensors (no prepared world: a departing process, or world=False)."""
    from slurm_etc.migrate.executor import allocate_destinations

    t = time.perf_counter()
    prepared.destinations = allocate_destinations(prepared.program, prepared.options,
                                                  prefault=prefault)
    prepared.seconds["allocate"] += time.perf_counter() - t


def prepare_transfer(plan: MigrationPlan, device: int, store: Store, *, tag: str,
                     options: MigrationOptions | None = None,
                     group_timeout_s: float = 300.0, prefault: bool = True) -> PreparedResize:
    """The part of :func:`prepare_resize` that touches no global state (the migration
    group's own gloo backends, the program, the staging buffers; on a process outside the
    new layout its destinations too): it may run in a thread of its own while the old
    layout trains, its collectives on the migration group only. A process of the new
    layout then calls :func:`prepare_new_world` on its main thread, at a step boundary."""
    prepared = _connect(plan, device, store, tag, options, group_timeout_s, prefault)
    if device not in plan.new.devices:
        _allocate(prepared, prefault)
    return prepared


def prepare_new_world(prepared: PreparedResize, *, build_new: Callable[[ParallelConfig],
                      TrainingState] | None = None, state: TrainingState | None = None,
                      prefault: bool = True) -> None:
    """On a process of the new layout, after :func:`prepare_transfer` (or inside
    :func:`prepare_resize`): start the new layout's groups, build its model, DDP and
    optimizer beside the live ones, make their tensors the destinations, and move the
    staying old state into them (see :func:`prepare_resize`, ``world=True``):
    :func:`start_new_world`, then :func:`finish_new_world`. Collective over the new
    layout's ranks; swaps torch's default group and megatron's globals while it builds, so
    it runs on the thread that trains, between steps. The migration group is destroyed if
    it fails."""
    start_new_world(prepared)
    finish_new_world(prepared, build_new=build_new, state=state, prefault=prefault)


def start_new_world(prepared: PreparedResize) -> None:
    """The new layout's groups (``W`` and megatron's), no model yet: the first of the two
    step boundaries a resize prepared while training builds its world at (the old layout
    trains a step between). Collective over the new layout's ranks."""
    import torch.distributed as dist

    from .world import start_world

    t = time.perf_counter()
    try:
        prepared.world = start_world(prepared.plan.new.config,
                                     prepared.plan.new.devices.index(prepared.device),
                                     dist.PrefixStore(train_group_prefix(prepared.tag),
                                                      prepared.store),
                                     name=prepared.tag, timeout_s=prepared.group_timeout_s)
    except BaseException:
        prepared.group.destroy()
        raise
    prepared.seconds["prepare_world"] = time.perf_counter() - t


def finish_new_world(prepared: PreparedResize, *, build_new: Callable[[ParallelConfig],
                     TrainingState] | None = None, state: TrainingState | None = None,
                     prefault: bool = True) -> None:
    """After :func:`start_new_world`: the new layout's model, DDP and optimizer in its
    world, the executor's destinations inside them, and the staying old state moved in.
    Collective over the new layout's ranks; the world and the migration group are dropped
    if it fails."""
    from . import build
    from .world import build_world

    plan, program, seconds, new_world = (prepared.plan, prepared.program, prepared.seconds,
                                         prepared.world)
    if new_world is None:
        raise RuntimeError("finish_new_world before start_new_world")
    model = plan.catalog.model
    builder = build_new or (lambda c: build.build_modules(model, c, seed=None))
    t = time.perf_counter()
    try:
        build_world(new_world, builder)
        with new_world.active():
            receive = receive_into(new_world.state, plan.catalog, program.new_specs,
                                   program.kept, prefault=prefault)
    except BaseException:
        new_world.drop()
        prepared.world = None
        prepared.group.destroy()
        raise
    seconds["prepare_world"] = seconds.get("prepare_world", 0.0) + time.perf_counter() - t
    seconds.update({f"world_{k}": v for k, v in new_world.seconds.items()})
    prepared.receive = receive
    prepared.destinations = receive.tensors
    if state is not None and program.old_rank is not None:
        t = time.perf_counter()
        prepared.placed = _place(state, plan, program, receive, new_world, prepared.group,
                                 prepared.relabel)
        seconds["place"] = time.perf_counter() - t


def _place(state: TrainingState, plan: MigrationPlan, program: Program, receive: Destinations,
           new_world: PreparedWorld, group: MigrationGroup, relabel: Relabel | None) -> Placed:
    """The old state that stays here, moved into the prepared world (all of it given back,
    the world and the group dropped, if that fails)."""
    views = [None if j in receive.alias else (t if t is not None else receive.copy.get(j))
             for j, t in enumerate(receive.tensors)]
    try:
        return place_staying_state(state, plan.catalog, program, views, relabel=relabel)
    except BaseException:
        new_world.drop()
        group.destroy()
        raise


@dataclass
class ResizeOutcome:
    """One process's side of an in-place resize.

    Attributes:
        state: the new TrainingState (None on a departing process).
        resume: the step and RNG state installed (None when departing).
        stats: the executor's MigrationStats as a dict (memory: from the preparation to the
            commit).
        seconds: wall time of each phase on this process (``pause`` is when it started,
            ``ready`` when it finished, both ``time.time()``): ``resume`` (shards read, step
            and RNG exchanged), ``migrate`` (the executor: data phase, votes, commit), then
            with a prepared world ``switch`` (make it live, kept shards, step/RNG, gradient
            buffers), else ``train_group``, ``rebuild`` and ``install``.
    """

    state: TrainingState | None
    resume: ResumeState | None
    new_shards: list[LocalShard]
    stats: dict
    seconds: dict = field(default_factory=dict)


class InstallInterrupted(InternalError, RuntimeError):
    """The migration committed but a new rank died before the new layout was installed: the
    survivors hold their new shards uninstalled (``shards``, ``resume``) and move them on in
    the next resize (``resize_in_place(held=...)``), which names the dead as lost.

    Attributes:
        generation_tag: the committed resize's tag.
        new_rank: this process's rank in the committed layout.
        shards: this rank's new shards as received (the committed state).
        resume: this rank's step and RNG in the committed layout.
    """

    def __init__(self, message: str, tag: str, new_rank: int, shards: list[LocalShard],
                 resume: ResumeState | None) -> None:
        super().__init__(message)
        self.tag, self.new_rank, self.shards, self.resume = tag, new_rank, shards, resume


# a full pass of Python's garbage collector costs 0.5 s here: none runs in the pause
@collector_paused()
def resize_in_place(prepared: PreparedResize, state: TrainingState | None, *,
                    keep_shards: bool = False, faults: FaultInjector | None = None,
                    build_new: Callable[[ParallelConfig], TrainingState] | None = None,
                    held: tuple[list[LocalShard], ResumeState] | None = None,
                    install_wait: Callable[[float], bool] | None = None,
                    store_lost: Callable[[Any], None] | None = None
                    ) -> ResizeOutcome:
    """Move this process's training state from ``plan.old`` to ``plan.new``: the pause.

    Every participant (``plan.participants``: old ∪ new minus lost devices) calls it at the
    same step boundary after :func:`prepare_resize`: surviving old ranks with their
    ``state`` (built under ``plan.old.config`` in the current default group), joining
    processes with None. Phases: read the shards (views) and ResumeState; exchange step and
    RNG; run the executor into the prepared destinations (two-phase: raises
    ``MigrationAborted`` everywhere if anything failed, the old state and its training
    groups untouched, training can go on); drop the old training groups and state; on new
    ranks start the new training group, build the new model and optimizer around the
    received tensors (adopted where megatron allows, else copied).

    Args:
        prepared: this process's :func:`prepare_resize`.
        state: this process's TrainingState under ``plan.old.config``, or None.
        keep_shards: keep a copy of the executor's new shards, as received, in the outcome
            (verification); otherwise they live on only inside the installed state.
        faults: a ``FaultInjector`` for the executor (tests).
        build_new: builds the empty model and optimizer of the new layout inside its new
            default group (default: :func:`build_empty_state` of the catalog's model; the
            elastic trainer passes the user's providers).
        held: instead of ``state``, the shards and resume state of a committed migration
            that was never installed (:class:`InstallInterrupted`).
        install_wait: before the new training group starts, every new rank waits in the
            store for all the others; this is called with the seconds waited so far while
            some are missing, and returning True (e.g. an order names a new rank as dead)
            raises :class:`InstallInterrupted`. Without it the group's start waits (up to
            ``group_timeout_s``).
        store_lost: called when the store stopped answering the commit decision (its
            coordinator died); it returns once the store answers again (the restarted
            coordinator's, which holds every decision its record holds), and the decision
            is asked again. Without it the store's error stands.

    Raises:
        MigrationAborted: on every process if any failed; ``state`` and its training groups
            are untouched and the job can train on in the old layout.
    """
    plan = prepared.plan
    if prepared.world is not None and build_new is not None:
        raise ValueError("the new layout was built by prepare_resize(world=True): pass "
                         "build_new there, not to resize_in_place")
    seconds: dict[str, float] = {"pause": time.time()}
    result, new_resume = _migrate(prepared, state, held, faults, store_lost, seconds)
    stats = result.stats
    # committed: the old layout is gone (its shards went with _migrate's frame)
    del state, held
    if faults is not None:
        faults.die_if(plan.participants.index(prepared.device), "after-commit")
    if prepared.world is not None:
        return _switch(prepared, result, new_resume, seconds, keep_shards=keep_shards,
                       install_wait=install_wait)
    _memory_stats(stats, prepared.memory)
    return _build_new_layout(prepared, result, new_resume, seconds, keep_shards=keep_shards,
                             build_new=build_new, install_wait=install_wait)


def _migrate(prepared: PreparedResize, state: TrainingState | None,
             held: tuple[list[LocalShard], ResumeState] | None, faults: FaultInjector | None,
             store_lost: Callable[[Any], None] | None, seconds: dict[str, float]
             ) -> tuple[MigrationResult, ResumeState | None]:
    """The data phase: read the old shards and ResumeState, exchange step and RNG, run the
    executor into the prepared destinations; then the migration group is shut (committed)
    or aborted, and on an abort what was prepared for the new layout is given back."""
    from slurm_etc.migrate.decision import CommitDecision, shared_over
    from slurm_etc.migrate.executor import execute_migration

    from .world import retire_backends

    plan, device, options = prepared.plan, prepared.device, prepared.options
    t = time.perf_counter()
    catalog = plan.catalog
    resume: ResumeState | None
    committed = False
    try:
        if held is not None:
            old_shards, resume = list(held[0]), held[1]
        else:
            old_shards = (local_shards(state, catalog, relabel=prepared.relabel)
                          if state is not None else [])
            resume = resume_state(state) if state is not None else None
        prepared.group.warm_up()  # NCCL's communicator: on this thread, not a preparation's
        transport = prepared.group.transport()
        decision = CommitDecision(prepared.store, commit_decision(prepared.tag),
                                  store_lost=store_lost,
                                  share=shared_over(transport, options.vote_timeout),
                                  proposer=prepared.program.group_rank == 0)
        new_resume = exchange_resume_state(plan, transport, device, resume)
        seconds["resume"] = time.perf_counter() - t
        t = time.perf_counter()
        result = execute_migration(plan, transport, device, old_shards,
                                   options=dataclasses.replace(options, measure_memory=False),
                                   program=prepared.program,
                                   destinations=prepared.destinations, faults=faults,
                                   staging=prepared.staging, commit=decision, agreed=True)
        result.stats.group_data_seconds = decision.longest_data_s
        result.stats.answers_for_group = decision.proposer and \
            decision.longest_data_s is not None
        committed = True
    finally:
        prepared.destinations, prepared.staging = [], None
        if committed and prepared.group.members is None:  # backends of its own: shut
            # down beside the new layout's first steps, not dropped in the pause
            retire_backends(prepared.group.data, prepared.group.control)
        if committed:
            prepared.group.destroy()
        else:
            prepared.group.abort()  # NCCL: a failed group is aborted, never destroyed
        if not committed and prepared.placed is not None:
            give_back(prepared.placed)  # memory of its own again, outside the new world
        if not committed and prepared.world is not None:
            prepared.world.drop()  # the old layout trains on
            prepared.world = prepared.receive = None
        if options.measure_memory and (prepared.world is None or not committed):
            prepared.memory.stop()
    seconds["migrate"] = time.perf_counter() - t
    return result, new_resume


def _build_new_layout(prepared: PreparedResize, result: MigrationResult,
                      new_resume: ResumeState | None, seconds: dict[str, float], *,
                      keep_shards: bool,
                      build_new: Callable[[ParallelConfig], TrainingState] | None,
                      install_wait: Callable[[float], bool] | None) -> ResizeOutcome:
    """After the commit, without a prepared world: drop the old training groups; on a new
    rank start the new training group, build the new model and optimizer and install the
    received shards in them."""
    import torch.distributed as dist

    plan, catalog, stats = prepared.plan, prepared.plan.catalog, result.stats
    t = time.perf_counter()
    _drop_training_groups()
    new_state = None
    if result.new_rank is not None:
        cfg = plan.new.config
        if install_wait is not None:
            _wait_for_new_ranks(prepared, result, new_resume, install_wait)
        dist.init_process_group(current().world_backend,
                                store=dist.PrefixStore(train_group_prefix(prepared.tag),
                                                       prepared.store),
                                rank=result.new_rank, world_size=cfg.world,
                                timeout=_timedelta(prepared.group_timeout_s))
        seconds["train_group"] = time.perf_counter() - t
        t = time.perf_counter()
        new_state = (build_new(cfg) if build_new is not None
                     else build_empty_state(catalog.model, cfg))
        seconds["rebuild"] = time.perf_counter() - t
        # verification keeps what arrived apart from what install adopts or copies
        kept = ([LocalShard(sh.state_key, sh.lo, sh.hi, sh.s, sh.tensor.clone())
                 for sh in result.new_shards] if keep_shards else [])
        t = time.perf_counter()
        installed = install_shards(new_state, catalog, result.new_shards, new_resume)
        seconds["install"] = time.perf_counter() - t
    else:
        kept, installed = [], {}
    result.new_shards = []
    seconds["ready"] = time.time()
    return ResizeOutcome(new_state, new_resume, kept, {**stats.as_dict(), **installed},
                         seconds)


def _switch(prepared: PreparedResize, result: MigrationResult, resume: ResumeState | None,
            seconds: dict, *, keep_shards: bool, install_wait: Callable[[float], bool] | None
            ) -> ResizeOutcome:
    """After the commit, with a prepared world: the migration already wrote the new shards
    into the new layout's model and optimizer. Make that world the live one (the old
    groups retired), adopt or copy the kept shards, set step and RNG."""
    world, receive = prepared.world, prepared.receive
    prepared.world = prepared.receive = None
    assert world is not None and receive is not None
    if install_wait is not None:
        try:
            _wait_for_new_ranks(prepared, result, resume, install_wait)
        except InstallInterrupted:
            world.drop()
            _drop_training_groups()
            raise
    # verification keeps what arrived apart from what install adopts or copies
    kept = ([LocalShard(sh.state_key, sh.lo, sh.hi, sh.s, sh.tensor.clone())
             for sh in result.new_shards] if keep_shards else [])
    t = time.perf_counter()
    world.switch()
    state = world.state
    installed = finish_install(state, receive, result.new_shards, resume)
    result.new_shards = []
    seconds["switch"] = time.perf_counter() - t
    seconds["ready"] = time.time()
    if prepared.options.measure_memory:
        prepared.memory.stop()
    stats = result.stats
    _memory_stats(stats, prepared.memory)
    installed["received_into_state_bytes"] = receive.bytes
    return ResizeOutcome(state, resume, kept, {**stats.as_dict(), **installed}, seconds)


def _memory_stats(stats: MigrationStats, memory: PeakMemory) -> None:
    stats.memory_base, stats.memory_peak = memory.base, memory.peak
    stats.memory_peak_delta, stats.memory_reset = memory.peak_delta, memory.reset


def _wait_for_new_ranks(prepared: PreparedResize, result: MigrationResult,
                        resume: ResumeState | None, install_wait: Callable[[float], bool]) -> None:
    """Every new rank checks in under the resize's tag before the new training group starts
    (a gloo group's start would wait for a dead rank until its timeout)."""
    store, tag, world = prepared.store, prepared.tag, prepared.plan.new.config.world
    rank = result.new_rank
    assert rank is not None  # a prepared world is a new rank's
    keys = [installing(tag, r) for r in range(world)]
    store.set(keys[rank], "1")
    t0 = time.monotonic()
    while not store.check(keys):
        waited = time.monotonic() - t0
        if install_wait(waited):
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise InstallInterrupted(
                f"the migration to {prepared.plan.new.config} committed, but new rank(s) "
                f"{missing} never came to install it", tag, rank,
                result.new_shards, resume)
        if waited > prepared.group_timeout_s:
            return  # the group's start reports who is missing
        time.sleep(0.005)


def _drop_training_groups() -> None:
    """Destroy every process group of this process (the default group included) and reset
    megatron's parallel state, in one go: cheaper than ``build.teardown`` (no per-group
    destroy, no garbage collection), for the moment when downtime counts."""
    from megatron.core import parallel_state

    end_world()  # NCCL: aborted, all groups at once (a peer may be dead)
    parallel_state.destroy_model_parallel()


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)
