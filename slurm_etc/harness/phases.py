"""Worker-side phases of the experiments (``w_*``), run on every local worker.

Each runs on every worker of a :class:`~slurm_etc.pool.local.LocalWorkers` pool with its
``WorkerContext``, and keeps the live training states in ``ctx.objects`` (``"state"``: the
current layout's; ``"loaded"``: one built from a checkpoint). A :class:`Transition` is one
resize on local processes; the phases build a state, prepare and run the in-place resize,
save and load megatron's checkpoint, train a step, and measure raw gloo point-to-point.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from slurm_etc.megatron.checkpoint import load_checkpoint, save_checkpoint
from slurm_etc.plan import (
    Layout,
    ParallelConfig,
    Topology,
    default_pool,
    plan_migration,
)
from slurm_etc.plan.catalog import build_catalog
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import ModelDesc
from slurm_etc.pool.local import WorkerContext

# Modules a worker imports at start-up: the cost of a cold start is paid there, not inside
# the first build.
PRELOAD = ("megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing", "slurm_etc.megatron.resize",
           "slurm_etc.migrate.executor")


# -- transitions ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Transition:
    """A resize of ``model`` from ``old`` to ``new`` on local processes (one "node").

    Old rank ``r`` runs on device (worker) ``r``; the planner places the new ranks on devices
    ``0 .. processes-1``, keeping the most bytes in place.
    """

    model: ModelDesc
    old: ParallelConfig
    new: ParallelConfig

    def __post_init__(self) -> None:
        if self.old.distributed_optimizer != self.new.distributed_optimizer:
            raise ConfigError("the distributed optimizer must be on in both configurations or "
                              "in neither")
        self.old.validate_for(self.model)
        self.new.validate_for(self.model)

    @property
    def processes(self) -> int:
        return max(self.old.world, self.new.world)

    def plan(self):
        return _plan(self)

    def __str__(self) -> str:
        return f"{self.model.name}: {self.old} -> {self.new}"


@lru_cache(maxsize=32)
def _plan(tr: Transition):
    topo = Topology(gpus_per_node=tr.processes)
    old = Layout(tr.old, tuple(range(tr.old.world)))
    return plan_migration(tr.model, old, tr.new, default_pool(old, tr.new, topo), topo,
                          keep_tp_in_node=False)


def batch_for(*configs: ParallelConfig, at_least: int = 8) -> int:
    """A global batch (micro-batch 1) that every configuration's dp divides."""
    gb = math.lcm(*(c.dp for c in configs))
    return gb * -(-at_least // gb)


# -- worker phases -----------------------------------------------------------------------

def w_build(ctx: WorkerContext, model: ModelDesc, config: ParallelConfig, *, tag: str,
            seed: int, steps: int, seq: int, global_batch: int) -> dict | None:
    """Workers ``0 .. world-1``: start the old layout's group, build and train the state."""
    from slurm_etc.megatron import build, cpu_compat

    if ctx.index >= config.world:
        return None
    t0 = time.perf_counter()
    cpu_compat.install()
    ctx.init_group(f"{tag}/old", ctx.index, config.world)
    state = build.build_training_state(model, config, seed=seed, steps=steps, micro_batch=1,
                                       seq=seq, global_batch=global_batch)
    ctx.objects["state"] = state
    from slurm_etc.megatron.state import optimizer_step

    return {"losses": list(state.losses), "step": optimizer_step(state),
            "rng": _rng_digest(), "seconds": time.perf_counter() - t0}


def _rng_digest() -> str:
    import torch

    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()


def w_shard_bits(ctx: WorkerContext, name: str = "state", *, model_only: bool = False
                 ) -> dict | None:
    """This worker's shards of a live state as raw bits (see ``state.shard_bits``)."""
    from slurm_etc.megatron.state import local_shards

    from .oracles import shard_bits

    state = ctx.objects.get(name)
    if state is None:
        return None
    catalog = build_catalog(state.model_desc, state.config)
    return shard_bits(local_shards(state, catalog, model_only=model_only))


def w_digest(ctx: WorkerContext, name: str = "state") -> dict | None:
    """sha1 of every shard of a live state (compare states without moving them)."""
    bits = w_shard_bits(ctx, name)
    if bits is None:
        return None
    return {key: hashlib.sha1(value.tobytes()).hexdigest() for key, value in bits.items()}


def w_save(ctx: WorkerContext, directory: str, *, fsync: bool = True) -> dict | None:
    """Ranks with a state: megatron's checkpoint save (``checkpoint.save_checkpoint``).

    ``pause`` (entry) and ``saved`` (return) are ``time.time()``: the checkpoint path's
    downtime is a wall-clock span across processes, as the in-place path's is. The ranks
    first meet in a barrier on their training group, as a training step's last collective
    leaves them (the pool hands the call to each process at a different moment; that
    skew is the harness's, not the checkpoint's).
    """
    import torch.distributed as dist

    state = ctx.objects.get("state")
    if state is None:
        return None
    if dist.is_initialized():
        dist.barrier()
    pause = time.time()
    out = save_checkpoint(state, directory, fsync=fsync)
    return {**out, "pause": pause, "saved": time.time()}


def w_prepare(ctx: WorkerContext, tr: Transition, *, tag: str,
              staging_bytes: int | None, world: bool = True, relabel: Any = None
              ) -> dict | None:
    """Every worker of old ∪ new, before the pause: ``resize.prepare_resize`` (``world``:
    the new layout's groups, model and optimizer built now, the migration's destinations,
    and the old state that stays on the process moved into them; ``relabel``: a planted
    bug, see ``state.Relabel``)."""
    from slurm_etc.megatron import cpu_compat
    from slurm_etc.megatron.resize import prepare_resize
    from slurm_etc.migrate.executor import MigrationOptions

    plan = tr.plan()
    if ctx.index not in set(plan.old.devices) | set(plan.new.devices):
        return None
    options = MigrationOptions(timeout_s=ctx.timeout_s)
    if staging_bytes:
        options = dataclasses.replace(options, staging_bytes=staging_bytes)
    cpu_compat.install()
    prepared = prepare_resize(plan, ctx.index, ctx.store, tag=tag, options=options,
                              group_timeout_s=ctx.timeout_s, world=world,
                              state=ctx.objects.get("state") if world else None,
                              relabel=relabel)
    ctx.objects["prepared"] = prepared
    return {"seconds": prepared.seconds}


def w_resize(ctx: WorkerContext, *, keep_bits: bool, corrupt: bool = False,
             faults: Any = None) -> dict | None:
    """Every worker of old ∪ new after ``w_prepare``: the pause (``state.resize_in_place``).

    ``corrupt`` flips the lowest bit of the first element of new rank 0's first migrated
    shard as reported (a self-test of the comparison, see ``slurm-etc verify --corrupt``).
    On ``MigrationAborted`` (raised) the old state stays the worker's state.
    """
    import torch

    from slurm_etc.megatron import cpu_compat
    from slurm_etc.megatron.resize import resize_in_place
    from slurm_etc.megatron.state import local_shards
    from slurm_etc.migrate.executor import MigrationAborted

    from .oracles import compare_shards, shard_bits

    prepared = ctx.objects.pop("prepared", None)
    if prepared is None:
        return None
    plan = prepared.plan
    cpu_compat.install()
    state = ctx.objects.pop("state", None)
    # Every participant (old ranks and joiners) meets first on the migration group, as a
    # training step's last collective leaves the old ranks and as joiners wait for the
    # pause: the pool hands the call to each process at a different moment, and that skew
    # is the harness's, not the resize's (the checkpoint path's save starts the same way).
    prepared.group.transport().allgather(torch.zeros(8, dtype=torch.uint8), ctx.timeout_s)
    try:
        out = resize_in_place(prepared, state, keep_shards=keep_bits, faults=faults)
    except MigrationAborted:
        if state is not None:
            ctx.objects["state"] = state  # the old layout trains on
        raise
    del state, prepared
    result: dict[str, Any] = {"stats": out.stats, "seconds": out.seconds,
                              "new_rank": plan.new.devices.index(ctx.index)
                              if out.state is not None else None}
    if out.state is not None and out.resume is not None:
        ctx.objects["state"] = out.state
        result["step"] = out.resume.step
        result["rng_installed"] = bytes(torch.get_rng_state().numpy().tobytes()) == out.resume.rng
        result["rng"] = _rng_digest()
    if keep_bits and out.state is not None:
        migrated = shard_bits(out.new_shards)
        installed = shard_bits(local_shards(out.state, plan.catalog))
        if corrupt and result["new_rank"] == 0:
            first = migrated[min(migrated)]
            first.reshape(-1)[:1] ^= 1
        result["bits"] = migrated
        result["roundtrip"] = compare_shards(installed, migrated)
    return result


def w_load(ctx: WorkerContext, model: ModelDesc, config: ParallelConfig, directory: str, *,
           optimizer: bool, name: str = "loaded", tag: str | None = None) -> dict | None:
    """Ranks of ``config``: build empty views and load the checkpoint into them.

    With ``tag`` the worker starts the group first (fresh processes); otherwise it uses the
    default group it is in (after a resize), skipping workers outside ``config``.
    ``begin`` (entry) and ``ready`` (loaded) are ``time.time()``, for wall-clock spans.
    """
    begin = time.time()
    import torch.distributed as dist

    from slurm_etc.megatron import cpu_compat
    from slurm_etc.megatron.state import build_empty_state, optimizer_step

    cpu_compat.install()
    t0 = time.perf_counter()
    if tag is not None:
        if ctx.index >= config.world:
            return None
        ctx.init_group(f"{tag}/new", ctx.index, config.world)
    elif not dist.is_initialized() or "state" not in ctx.objects:
        return None
    t1 = time.perf_counter()
    state = build_empty_state(model, config)
    t2 = time.perf_counter()
    timing = load_checkpoint(state, directory, optimizer=optimizer)
    ctx.objects[name] = state
    return {"group": t1 - t0, "build": t2 - t1, "load": timing["seconds"],
            "step": optimizer_step(state) if optimizer else None,
            "begin": begin, "ready": time.time()}


def w_train_step(ctx: WorkerContext, name: str, *, seed: int, seq: int,
                 global_batch: int) -> float | None:
    """One training step of a live state (the step index is its Adam step); its loss."""
    from slurm_etc.megatron import build
    from slurm_etc.megatron.state import optimizer_step

    state = ctx.objects.get(name)
    if state is None:
        return None
    return build._train_step(state, seed=seed, step=optimizer_step(state), micro_batch=1,
                             seq=seq, global_batch=global_batch)


def w_drop(ctx: WorkerContext) -> None:
    ctx.drop()


def w_raw_p2p(ctx: WorkerContext, nbytes: int, *, tag: str, repeats: int = 3) -> dict | None:
    """Workers 0 and 1: gloo ``batch_isend_irecv`` of one contiguous tensor, 0 -> 1.

    ``gibps``: best of ``repeats`` into a reused (warm) buffer; ``fresh_gibps``: into a
    newly allocated one, whose pages are first touched by the receive (what a migration
    does, as its new state is new memory).
    """
    import torch
    import torch.distributed as dist

    ctx.drop()
    if ctx.index > 1:
        return None
    ctx.init_group(f"{tag}/p2p", ctx.index, 2)
    peer = 1 - ctx.index
    op = dist.isend if ctx.index == 0 else dist.irecv

    def once(buf: torch.Tensor, tag_: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for work in dist.batch_isend_irecv([dist.P2POp(op, buf, peer, tag=tag_)]):
            work.wait()
        return time.perf_counter() - t0

    buf = torch.full((nbytes,), ctx.index + 1, dtype=torch.uint8)
    best = min(once(buf, i) for i in range(repeats))
    ok = bool((buf == 1).all())
    del buf
    fresh = torch.empty(nbytes, dtype=torch.uint8) if ctx.index == 1 else \
        torch.full((nbytes,), 1, dtype=torch.uint8)
    fresh_s = once(fresh, repeats)
    del fresh
    ctx.drop()
    return {"seconds": best, "bytes": nbytes, "gibps": nbytes / best / 2**30,
            "fresh_seconds": fresh_s, "fresh_gibps": nbytes / fresh_s / 2**30, "ok": ok}


def w_raw_pattern(ctx: WorkerContext, tr: Transition, *, tag: str,
                  repeats: int = 1) -> dict | None:
    """Every participant: the plan's own messages as plain contiguous buffers, the data
    phase's wire floor (``slurm_etc.migrate.pattern.raw_pattern``: same pairs, sizes and
    rounds, whole messages, warm buffers, no packing, no local copies, no votes), on a
    migration group connected as the resize's is. ``seconds``: this rank's first run from
    the common start to its last operation done (the bench takes the slowest rank, as for
    the data phase, which runs once too)."""
    import torch.distributed as dist

    from slurm_etc.migrate.group import connect_migration_group
    from slurm_etc.migrate.pattern import raw_pattern

    ctx.drop()
    plan = tr.plan()
    if ctx.index not in plan.participants:
        return None
    group = connect_migration_group(plan, ctx.index, dist.PrefixStore(f"{tag}/pattern",
                                                                      ctx.store),
                                    timeout_s=ctx.timeout_s)
    try:
        runs = raw_pattern(plan, group.transport(), ctx.index, repeats=repeats,
                           timeout_s=ctx.timeout_s)
    finally:
        group.destroy()
    return {"seconds": runs[0], "runs": runs}
