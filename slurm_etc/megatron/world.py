"""A second megatron-core parallel world, built beside the live one before a resize's pause.

An in-place resize needs the new layout's process groups and its model, DDP and optimizer.
Built after the commit they sit inside the pause (starting a gloo group for every megatron
group, building the modules: 0.15-0.3 s for ``small``). :func:`prepare_world` builds them
before the pause, while the old layout's groups and model stay live and untouched;
:func:`PreparedWorld.switch` makes the prepared world the live one (no communication);
:func:`PreparedWorld.drop` throws it away (an aborted resize: the old layout trains on).

How: the new layout's all-ranks group ``W`` is started from the resize's rendezvous store
(its own key prefix), so processes joining the job, which share no group with the old
layout, take part. During the build ``W`` is made torch's default group and megatron's
``parallel_state`` globals are swapped for empty ones, so ``initialize_model_parallel``
creates the new layout's groups inside ``W`` (``dist.new_group``: collective over ``W``
only) and the model, DDP and optimizer are built by the unchanged megatron code (or the
user's providers), reading the new world's globals throughout. Afterwards the old default
group and the old globals are put back; the new ones are kept in the
:class:`PreparedWorld` until :meth:`~PreparedWorld.switch`. This way megatron-core's
internal reads of global parallel state (cross entropy's tp group, replica ids in
``sharded_state_dict``, the embedding group of ``finalize_model_grads``, the optimizer's
default-group calls, the schedules' p2p communicator; see ../shared/NOTES.md "A second
megatron world") all see the new world, with no ``pg_collection`` to thread through.

Private torch APIs used (torch 2.13; ``tests/unit/test_world_private_api.py`` fails if they
change):

* ``distributed_c10d._new_process_group_helper``: starts ``W`` from a store as a full
  ``ProcessGroup`` (with its gloo backend registered, which the DistributedOptimizer's
  coalesced reduce-scatter needs) without a default group (a joining process has none);
  it also registers ``W`` in torch's group registry (megatron looks groups up by name).
* ``distributed_c10d._world`` (``default_pg``, ``pg_map``, ``pg_group_ranks``,
  ``group_count``) and ``_update_default_pg``: make ``W`` the default group during the
  build and at the switch; ``group_count`` names the groups ``new_group`` creates, and must
  be equal on every new rank (it keys their rendezvous), so it is set to a value derived
  from the resize's tag.

megatron-core's ``parallel_state`` globals (every module-level name starting with ``_``
and not a function, class or module) are saved and restored as a whole: no list of names
to keep in step with megatron.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import logging
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from slurm_etc.migrate.connections import opened_during
from slurm_etc.migrate.device import current, end_group
from slurm_etc.plan.config import ParallelConfig

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _pristine_parallel_state() -> dict[str, Any]:
    """megatron's ``parallel_state`` globals as the module defines them (a fresh copy of the
    module, executed once: the values before any ``initialize_model_parallel``)."""
    from megatron.core import parallel_state

    spec = importlib.util.spec_from_file_location("megatron.core._slurm_etc_pristine",
                                                  parallel_state.__file__)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {parallel_state.__file__}")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    return _globals_of(fresh)


def _is_state(name: str, value: Any) -> bool:
    return (name.startswith("_") and not name.startswith("__")
            and not isinstance(value, (types.FunctionType, types.ModuleType, type))
            and not callable(value))


def _globals_of(module: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if _is_state(k, v)}


def megatron_globals() -> dict[str, Any]:
    """The current megatron ``parallel_state`` globals (shallow copies of dicts/lists)."""
    from megatron.core import parallel_state

    return {k: (v.copy() if isinstance(v, (dict, list)) else v)
            for k, v in _globals_of(parallel_state).items()}


def set_megatron_globals(values: dict[str, Any]) -> None:
    """Put megatron's ``parallel_state`` globals to ``values`` (every name :func:`megatron_globals`
    lists; names missing from ``values`` get the module's initial value)."""
    from megatron.core import parallel_state

    pristine = _pristine_parallel_state()
    for name in _globals_of(parallel_state).keys() | pristine.keys():
        value = values[name] if name in values else pristine.get(name)
        setattr(parallel_state, name, value.copy() if isinstance(value, (dict, list))
                else value)


def _group_count_base(tag: str) -> int:
    """Start of the names ``new_group`` gives the new world's groups: equal on every new
    rank, far from the small counters of the groups a process already has."""
    return 10**6 * (1 + int(hashlib.sha1(tag.encode()).hexdigest()[:6], 16))


@dataclass
class PreparedWorld:
    """The new layout's process groups, megatron globals and training state, built and idle.

    Attributes:
        config: the new layout's parallel configuration.
        rank: this process's rank in it.
        group: ``W``, every new rank (the default group after :meth:`switch`).
        groups: every process group of the new world on this process (``W`` included).
        megatron: megatron's ``parallel_state`` globals of the new world.
        group_count: torch's group counter after the build (equal on every new rank).
        state: what ``build`` returned (the new TrainingState).
        seconds: ``group`` (start ``W``), ``megatron_groups`` (``initialize_model_parallel``),
            ``build``.
    """

    config: ParallelConfig
    rank: int
    group: Any
    groups: list[Any]
    megatron: dict[str, Any]
    group_count: int
    state: Any = None
    seconds: dict = field(default_factory=dict)
    # the TCP connections its groups opened (gloo): kept open when the live world's groups
    # are left after a failed collective (migrate/connections.py)
    sockets: set[int] = field(default_factory=set)

    def switch(self) -> None:
        """Make this world the live one: ``W`` becomes the default group and megatron's
        globals the new world's; every other process group of this process (the old
        default group, megatron's old groups) is unregistered from torch and retired: its
        backends are shut down later: on a thread of their own once the new layout trains
        (:func:`retire_in_background`, the trainer after its first step), else by the next
        :func:`start_world` (about 2 ms per gloo group, kept out of the pause). Local, no
        communication."""
        world = c10d._world
        mine = {id(g) for g in self.groups}
        c10d._update_default_pg(self.group)
        for g in [g for g in list(world.pg_map) if id(g) not in mine]:
            _retire(g)
        world.group_count = max(world.group_count, self.group_count)
        set_megatron_globals(self.megatron)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside: the default group and megatron's globals are this world's (e.g. to read
        its model's ``sharded_state_dict()``, whose replica ids come from the globals);
        afterwards whatever was live before."""
        world = c10d._world
        saved = (world.default_pg, world.group_count, megatron_globals())
        c10d._update_default_pg(self.group)
        set_megatron_globals(self.megatron)
        try:
            yield
        finally:
            _restore(*saved)

    def drop(self) -> None:
        """Throw the prepared world away (an aborted resize): its state, its groups."""
        self.state = None
        for g in self.groups:
            if g in c10d._world.pg_map:
                dist.destroy_process_group(g)
        self.groups, self.megatron = [], {}


def start_world_group(size: int, rank: int, store: Any, *, name: str,
                      timeout_s: float = 300.0) -> Any:
    """A ``ProcessGroup`` of ``size`` ranks from ``store`` (gloo; on a GPU gloo and NCCL:
    :mod:`slurm_etc.migrate.device`), registered with torch (its ranks are its own: the
    default group it becomes at a switch), whether or not this process has a default group.
    Collective over its ranks."""
    group, _store = c10d._new_process_group_helper(
        size, rank, [], current().world_backend, store,
        group_name=c10d.GroupName(f"slurm-etc:{name}:world"),
        timeout=timedelta(seconds=timeout_s), group_desc=f"slurm-etc world {name}")
    c10d._world.pg_group_ranks[group] = {r: r for r in range(size)}
    return group


# Old groups unregistered at a switch, shut down later (outside the pause) on a thread of
# their own, so that neither the pause nor a later step boundary waits for it.
_RETIRED: list[Any] = []
_RETIRING: threading.Thread | None = None


def _retire(pg: Any) -> None:
    """Unregister ``pg`` from torch, as ``destroy_process_group`` does, without shutting its
    backends down yet (see :func:`shutdown_retired`)."""
    world = c10d._world
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks,
                  world.pg_backend_config, world.pg_coalesce_state):
        table.pop(pg, None)
    tag = world.pg_to_tag.pop(pg, None)
    for key in (tag, ""):
        if key is not None and pg in world.tags_to_pg.get(key, []):
            world.tags_to_pg[key].remove(pg)
    c10d._unregister_process_group(pg.group_name)
    _RETIRED.append(pg)


def retire_backends(*backends: Any) -> None:
    """Keep ``backends`` (process groups of their own, e.g. a resize's migration group) for
    :func:`shutdown_retired` instead of dropping them: a gloo backend's destructor takes
    about 20 ms (two of them were 0.08-0.1 s of pause on 2 cores, as the resize returned)."""
    _RETIRED.extend(b for b in backends if b is not None)


def shutdown_retired() -> int:
    """Shut down the backends of the groups retired by earlier switches (after the thread
    doing it, if one runs); how many this call shut down."""
    wait_retired()
    return _shut_down_retired()


def _shut_down_retired() -> int:
    n = 0
    while _RETIRED:
        end_group(_RETIRED.pop())
        n += 1
    return n


def retire_in_background() -> None:
    """Shut the retired groups down on a daemon thread, beside training (about 2 ms per gloo
    group: megatron's dozens of groups cost 0.05-0.1 s on 2 cores, which the step boundary
    that built the next world used to wait for; started inside the pause, it slowed the
    switch and the first step's start instead); :func:`wait_retired` joins it, and so does
    the interpreter's exit."""
    global _RETIRING
    wait_retired()
    if _RETIRED:
        _RETIRING = threading.Thread(target=_shut_down_retired, name="slurm-etc-retire-groups",
                                     daemon=True)
        _RETIRING.start()


def wait_retired() -> None:
    """Join the thread shutting retired groups down, if one runs."""
    global _RETIRING
    if _RETIRING is not None:
        _RETIRING.join()
        _RETIRING = None


atexit.register(wait_retired)


def prepare_world(config: ParallelConfig, rank: int, store: Any, *, name: str,
                  build: Callable[[ParallelConfig], Any], timeout_s: float = 300.0
                  ) -> PreparedWorld:
    """Start the new layout's groups from ``store`` and build its training state beside the
    live world (see the module docstring): :func:`start_world`, then :func:`build_world`.

    Collective over the new layout's ranks (every one calls it with its ``rank``); the
    process's current default group, megatron globals, models and CPU generator are left as
    they were.

    Args:
        config: the new layout's parallel configuration.
        rank: this process's rank in it.
        store: the rendezvous store (a prefix of its own for this world).
        name: unique name of this world (e.g. the resize's tag): names its groups.
        build: builds the training state under ``config`` in the new world (the default
            group and megatron's globals are the new world's while it runs).
        timeout_s: default timeout of the new world's groups.
    """
    prepared = start_world(config, rank, store, name=name, timeout_s=timeout_s)
    build_world(prepared, build)
    return prepared


def start_world(config: ParallelConfig, rank: int, store: Any, *, name: str,
                timeout_s: float = 300.0) -> PreparedWorld:
    """The first half of :func:`prepare_world`: ``W`` and megatron's groups of the new
    layout (``initialize_model_parallel`` inside ``W``), no training state yet. The live
    world is put back before it returns, so the old layout can train a step before
    :func:`build_world` (a resize prepared while training splits the build across two step
    boundaries this way). Collective over the new layout's ranks."""
    from .build import initialize_parallel_state

    shutdown_retired()
    world = c10d._world
    saved_default, saved_count = world.default_pg, world.group_count
    saved_megatron = megatron_globals()
    before = {id(g) for g in world.pg_map}
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    with opened_during() as sockets:
        group = start_world_group(config.world, rank, store, name=name, timeout_s=timeout_s)
    seconds["group"] = time.perf_counter() - t
    try:
        c10d._update_default_pg(group)
        world.group_count = _group_count_base(name)
        set_megatron_globals({})
        t = time.perf_counter()
        # every degree (ep, vpp, cp too): a MoE layout's experts are cut by its ep group
        with opened_during() as more:
            initialize_parallel_state(config, timeout_s)
        seconds["megatron_groups"] = time.perf_counter() - t
        groups = [g for g in world.pg_map if id(g) not in before]
        prepared = PreparedWorld(config, rank, group, groups, megatron_globals(),
                                 world.group_count, None, seconds, sockets | more)
    except BaseException:
        new = [g for g in list(world.pg_map) if id(g) not in before]
        _restore(saved_default, saved_count, saved_megatron)
        for g in new:
            dist.destroy_process_group(g)
        raise
    _restore(saved_default, saved_count, saved_megatron)
    return prepared


def build_world(prepared: PreparedWorld, build: Callable[[ParallelConfig], Any]) -> None:
    """The second half of :func:`prepare_world`: ``build`` runs with the started world's
    default group, globals and group counter in place (groups it creates, e.g. the
    DistributedOptimizer's, join ``prepared.groups``); ``prepared.state`` is what it
    returns. The live world and the CPU generator are put back; if ``build`` fails the
    prepared world is dropped. Collective over the new layout's ranks."""
    world = c10d._world
    saved = (world.default_pg, world.group_count, megatron_globals())
    before = {id(g) for g in world.pg_map}
    t = time.perf_counter()
    try:
        c10d._update_default_pg(prepared.group)
        world.group_count = prepared.group_count
        set_megatron_globals(prepared.megatron)
        rng = torch.get_rng_state()  # the old layout's generator goes on untouched
        try:
            with opened_during() as sockets:
                prepared.state = build(prepared.config)
            prepared.sockets |= sockets
        finally:
            torch.set_rng_state(rng)
        prepared.groups += [g for g in world.pg_map if id(g) not in before]
        prepared.megatron = megatron_globals()
        prepared.group_count = world.group_count
    except BaseException:
        prepared.groups += [g for g in list(world.pg_map) if id(g) not in before]
        _restore(*saved)
        prepared.drop()
        raise
    prepared.seconds["build"] = time.perf_counter() - t
    _restore(*saved)


def _restore(default: Any, count: int, megatron: dict[str, Any]) -> None:
    c10d._update_default_pg(default)
    c10d._world.group_count = count
    set_megatron_globals(megatron)
