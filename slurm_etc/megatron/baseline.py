"""The checkpoint baseline, and the experiments that hold the in-place resize against it.

How users resize a megatron-core job today: save a distributed checkpoint in the old
configuration (``dist_checkpointing.save``, ``torch_dist``), stop the processes, start fresh
ones in the new configuration (cold ``import megatron.core`` included), build the model and
optimizer, ``dist_checkpointing.load``. This module runs that path on local processes, timed
part by part, next to the in-place path (:func:`slurm_etc.megatron.state.resize_in_place`):

* The processes: :class:`~slurm_etc.worker.local.LocalWorkers`, N local processes joined by
  a ``TCPStore`` the parent hosts; each phase starts the ``gloo`` default group it needs (old
  layout, migration group, new layout) from that store, as the job's coordinator would.
* :func:`save_checkpoint` / :func:`load_checkpoint`: megatron's checkpoint of model and
  optimizer (DistributedOptimizer: ``dp_reshardable``), plus step and RNG. Durability:
  megatron fsyncs its ``.distcp`` data files and torch's writer the ``.metadata`` file; the
  rest (``common.pt``, sharded-object files, ``metadata.json``) and the directories are not
  synced, so :func:`save_checkpoint` fsyncs them (timed separately).
* Worker-side phases (``w_*``), run on every worker with :meth:`LocalWorkers.run`; they
  keep the live training states in ``ctx.objects`` (``"state"``: the current layout's;
  ``"loaded"``: one built from a checkpoint).
* :func:`verify_transition`: ``slurm-etc verify`` (migrate, then compare every tensor with
  megatron's checkpoint resharding and with the global-gather oracle).
* :func:`bench_migrate`: ``slurm-etc bench migrate`` (both paths side by side).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from slurm_etc.plan import Layout, ParallelConfig, Topology, default_pool, plan_migration
from slurm_etc.plan.catalog import build_catalog
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import ModelDesc
from slurm_etc.worker.local import LocalWorkers, WorkerContext

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

# Modules a worker imports at start-up: the cost of a cold start is paid there, not inside
# the first build.
PRELOAD = ("megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing", "slurm_etc.megatron.state",
           "slurm_etc.migrate.executor")
DIST_OPT_SHARDING = "dp_reshardable"
ORACLE_CHECKPOINT = "megatron-checkpoint"
ORACLE_GATHER = "global-gather"
ORACLE_INSTALL = "install-roundtrip"


def _no_progress(message: str) -> None:
    pass


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


# -- checkpoint path ------------------------------------------------------------------------

def _checkpoint_state_dict(state: Any, *, loading: bool, optimizer: bool) -> dict:
    model_sd = state.model_sharded_state_dict()
    out = {"model": model_sd}
    if optimizer:
        if loading and state.config.distributed_optimizer:
            # megatron's DistributedOptimizer.state_dict() needs an initialised Adam state
            # (it reads the common step); a fresh optimizer has none before its first step.
            for sub in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
                if not sub.optimizer.state:
                    sub._init_optimizer_states_with_dummy_values()
        out["optimizer"] = state.optimizer.sharded_state_dict(
            model_sd, is_loading=loading,
            metadata={"distrib_optim_sharding_type": DIST_OPT_SHARDING})
    return out


def _fsync_tree(directory: str) -> int:
    """fsync every file and directory under ``directory``; returns the bytes in files."""
    total = 0
    for root, dirs, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return total


def save_checkpoint(state: Any, directory: str, *, fsync: bool = True) -> dict:
    """megatron ``dist_checkpointing.save`` of model, optimizer, step and RNG; then durable.

    Collective over the state's default group. Step and rank 0's CPU RNG state travel as
    common state. Returns seconds of the save and of the extra fsync, and the bytes on
    disk (rank 0).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from .state import optimizer_step

    os.makedirs(directory, exist_ok=True)
    dist.barrier()
    t0 = time.perf_counter()
    sd = _checkpoint_state_dict(state, loading=False, optimizer=True)
    # Common state must be equal on every rank (megatron validates it; rank 0 writes it):
    # the checkpoint keeps rank 0's generator, as Megatron-LM does when it cannot reshard
    # per-rank RNG states.
    rng = torch.get_rng_state()
    dist.broadcast(rng, src=0)
    sd["resume"] = {"step": optimizer_step(state), "rng_state": rng}
    dist_checkpointing.save(sd, directory)
    t1 = time.perf_counter()
    nbytes = 0
    if fsync:
        dist.barrier()
        if dist.get_rank() == 0:
            nbytes = _fsync_tree(directory)
        dist.barrier()
    t2 = time.perf_counter()
    return {"save": t1 - t0, "fsync": t2 - t1, "seconds": t2 - t0, "bytes": nbytes}


def load_checkpoint(state: Any, directory: str, *, optimizer: bool = True) -> dict:
    """megatron ``dist_checkpointing.load`` into ``state`` (built for any configuration
    megatron can reshard to: any for the model and the non-distributed optimizer; only dp
    changes for the DistributedOptimizer). Restores step and RNG when ``optimizer``."""
    import torch
    from megatron.core import dist_checkpointing

    from .state import set_optimizer_step

    t0 = time.perf_counter()
    sd = _checkpoint_state_dict(state, loading=True, optimizer=optimizer)
    loaded = dist_checkpointing.load(sd, directory)
    state.gpt.load_state_dict(loaded["model"])
    if optimizer:
        # the DistributedOptimizer copies into fp32 main params that are views of the model's
        # leaf parameters, which autograd refuses outside no_grad
        with torch.no_grad():
            state.optimizer.load_state_dict(loaded["optimizer"])
        # With torch's Adam, the DistributedOptimizer's dp_reshardable load copies each
        # parameter's *current* step over the loaded one (the step travels as a local
        # non-persistent object), so a fresh optimizer would resume at its dummy step.
        set_optimizer_step(state, loaded["resume"]["step"])
        torch.set_rng_state(loaded["resume"]["rng_state"])
    return {"seconds": time.perf_counter() - t0}


# -- worker-side phases (run on every worker) -----------------------------------------------

def w_build(ctx: WorkerContext, model: ModelDesc, config: ParallelConfig, *, tag: str,
            seed: int, steps: int, seq: int, global_batch: int) -> dict | None:
    """Workers ``0 .. world-1``: start the old layout's group, build and train the state."""
    from . import build, cpu_compat

    if ctx.index >= config.world:
        return None
    t0 = time.perf_counter()
    cpu_compat.install()
    ctx.init_group(f"{tag}/old", ctx.index, config.world)
    state = build.build_training_state(model, config, seed=seed, steps=steps, micro_batch=1,
                                       seq=seq, global_batch=global_batch)
    ctx.objects["state"] = state
    from .state import optimizer_step

    return {"losses": list(state.losses), "step": optimizer_step(state),
            "rng": _rng_digest(), "seconds": time.perf_counter() - t0}


def _rng_digest() -> str:
    import torch

    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()


def w_shard_bits(ctx: WorkerContext, name: str = "state", *, model_only: bool = False
                 ) -> dict | None:
    """This worker's shards of a live state as raw bits (see ``state.shard_bits``)."""
    from .state import local_shards, shard_bits

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
    state = ctx.objects.get("state")
    return None if state is None else save_checkpoint(state, directory, fsync=fsync)


def w_prepare(ctx: WorkerContext, tr: Transition, *, tag: str,
              staging_bytes: int | None) -> dict | None:
    """Every worker of old ∪ new, before the pause: ``state.prepare_resize``."""
    from slurm_etc.migrate.executor import MigrationOptions

    from .state import prepare_resize

    plan = tr.plan()
    if ctx.index not in set(plan.old.devices) | set(plan.new.devices):
        return None
    options = MigrationOptions(**({"staging_bytes": staging_bytes} if staging_bytes else {}),
                               timeout_s=ctx.timeout_s)
    prepared = prepare_resize(plan, ctx.index, ctx.store, tag=tag, options=options,
                              group_timeout_s=ctx.timeout_s)
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

    from slurm_etc.migrate.executor import MigrationAborted

    from . import cpu_compat
    from .state import compare_shards, local_shards, resize_in_place, shard_bits

    prepared = ctx.objects.pop("prepared", None)
    if prepared is None:
        return None
    plan = prepared.plan
    cpu_compat.install()
    state = ctx.objects.pop("state", None)
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
    if out.state is not None:
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
    """
    import torch.distributed as dist

    from . import cpu_compat
    from .state import build_empty_state, optimizer_step

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
            "step": optimizer_step(state) if optimizer else None}


def w_train_step(ctx: WorkerContext, name: str, *, seed: int, seq: int,
                 global_batch: int) -> float | None:
    """One training step of a live state (the step index is its Adam step); its loss."""
    from . import build
    from .state import optimizer_step

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
                  repeats: int = 2) -> dict | None:
    """Every worker of old ∪ new: the plan's messages as plain contiguous buffers (same
    pairs, same rounds, ``batch_isend_irecv``, no packing, no votes): the wire floor."""
    import torch
    import torch.distributed as dist

    ctx.drop()
    plan = tr.plan()
    devices = sorted(set(plan.old.devices) | set(plan.new.devices))
    if ctx.index not in devices:
        return None
    ctx.init_group(f"{tag}/pattern", devices.index(ctx.index), len(devices))
    m = plan.messages
    mine = [(int(m.round[k]), int(m.src[k]), int(m.dst[k]), int(m.nbytes[k]))
            for k in range(len(m)) if ctx.index in (int(m.src[k]), int(m.dst[k]))]
    size = max((n for *_, n in mine), default=0)
    send, recv = torch.ones(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
    rounds = int(m.round.max()) + 1 if len(m) else 0
    best = math.inf
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for r in range(rounds):
            ops = []
            for rr, src, dst, n in mine:
                if rr != r:
                    continue
                if src == ctx.index:
                    ops.append(dist.P2POp(dist.isend, send[:n], devices.index(dst), tag=r))
                else:
                    ops.append(dist.P2POp(dist.irecv, recv[:n], devices.index(src), tag=r))
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    del send, recv
    ctx.drop()
    return {"seconds": best}


# -- verify ---------------------------------------------------------------------------------

def megatron_reshards_optimizer(old: ParallelConfig, new: ParallelConfig) -> bool:
    """Whether megatron-core's checkpoint path can reshard the optimizer state on CPU:
    always for the non-distributed optimizer; for the DistributedOptimizer only its
    ``dp_reshardable`` format works here, which allows dp changes alone (``fully_reshardable``
    warns of zero-padded data on save and fails to load with torch's Adam: KeyError 'step')."""
    if not old.distributed_optimizer:
        return True
    return old.tp == new.tp and old.pp == new.pp


def verify_transition(tr: Transition, *, workers: LocalWorkers | None = None,
                      seed: int = 1234, steps: int = 2, train_after: bool = True,
                      corrupt: bool = False, progress: Progress = _no_progress,
                      workdir: str | None = None, log_level: int = logging.WARNING) -> dict:
    """Migrate a real trained megatron-core state and check every tensor bit for bit.

    Builds ``tr.model`` under ``tr.old`` (seeded, ``steps`` Adam steps), saves megatron's
    checkpoint of it, resizes in place with the executor, then compares each new rank's
    migrated shards with

    * ``megatron-checkpoint``: the same state loaded by megatron's ``dist_checkpointing``
      into views built for ``tr.new`` (model always; optimizer where megatron reshards it,
      see :func:`megatron_reshards_optimizer`), read back through the adapter;
    * ``global-gather``: every tensor's full global value put together from the old ranks'
      shards (replicas must agree), cut into the new layout's regions;
    * ``install-roundtrip``: the migrated shards installed into the new views, read back.

    Returns the report ``slurm-etc verify --json`` prints (``verified`` False on any
    mismatch, ``first_mismatch`` naming the tensor and region).
    """
    from .state import assemble_globals, compare_shards, expected_shards, rng_source

    plan = tr.plan()
    catalog = plan.catalog
    own = workers is None
    if own:
        progress(f"starting {tr.processes} worker processes (cold import of megatron-core)")
        workers = LocalWorkers(tr.processes, preload=PRELOAD, log_level=log_level)
        workers.start()
    elif workers.size < tr.processes:
        raise ConfigError(f"{tr} needs {tr.processes} processes, the pool has {workers.size}")
    tag = f"verify-{os.getpid()}-{time.monotonic_ns()}"
    seq = min(tr.model.seq_length, 64)
    gb = batch_for(tr.old, tr.new)
    tmp = tempfile.mkdtemp(prefix="slurm-etc-verify-", dir=workdir)
    t_start = time.perf_counter()
    try:
        progress(f"building {tr.model.name} under {tr.old} and training {steps} step(s)")
        built = workers.run(w_build, tr.model, tr.old, tag=tag, seed=seed, steps=steps,
                            seq=seq, global_batch=gb)
        old_bits = workers.run(w_shard_bits)[:tr.old.world]
        progress("saving megatron's checkpoint of the old layout (the reference)")
        workers.run(w_save, os.path.join(tmp, "ckpt"), fsync=False)
        progress(f"migrating in place to {tr.new} ({plan.moved_bytes / 2**20:.1f} MiB move)")
        workers.run(w_prepare, tr, tag=f"{tag}/resize", staging_bytes=None)
        resized = workers.run(w_resize, keep_bits=True, corrupt=corrupt)
        with_optimizer = megatron_reshards_optimizer(tr.old, tr.new)
        progress("loading the checkpoint into views built for the new layout"
                 + ("" if with_optimizer else " (model only: megatron cannot reshard this "
                                               "distributed optimizer)"))
        loaded = workers.run(w_load, tr.model, tr.new, os.path.join(tmp, "ckpt"),
                             optimizer=with_optimizer)
        loaded_bits = workers.run(w_shard_bits, "loaded", model_only=not with_optimizer)
        losses = {}
        if train_after:
            progress("one training step on the migrated state (and on the loaded one)")
            losses["migrated"] = _first(workers.run(w_train_step, "state", seed=seed, seq=seq,
                                                    global_batch=gb))
            if with_optimizer:
                losses["checkpoint"] = _first(workers.run(w_train_step, "loaded", seed=seed,
                                                          seq=seq, global_batch=gb))
        workers.run(w_drop)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if own:
            workers.close()
    seconds = time.perf_counter() - t_start

    progress("comparing every tensor")
    gathered = assemble_globals(catalog, old_bits)
    per_tensor: dict[str, dict] = {}
    mismatches: list[dict] = []
    shards = nbytes = 0
    for new_rank, device in enumerate(plan.new.devices):
        got = resized[device]["bits"]
        checks = [(ORACLE_GATHER, expected_shards(catalog, tr.new, new_rank, gathered)),
                  (ORACLE_CHECKPOINT, loaded_bits[device])]
        for oracle, want in checks:
            subset = {k: got[k] for k in want if k in got} if oracle == ORACLE_CHECKPOINT \
                else got
            for m in compare_shards(subset, want, limit=1000):
                mismatches.append({"oracle": oracle, "new_rank": new_rank, **m})
        for m in resized[device]["roundtrip"]:
            mismatches.append({"oracle": ORACLE_INSTALL, "new_rank": new_rank, **m})
        for key, bits in got.items():
            entry = per_tensor.setdefault(key[0], {"shards": 0, "bytes": 0, "oracles": set()})
            entry["shards"] += 1
            entry["bytes"] += bits.nbytes
            entry["oracles"].update([ORACLE_GATHER, ORACLE_INSTALL])
            if key in loaded_bits[device]:
                entry["oracles"].add(ORACLE_CHECKPOINT)
            shards += 1
            nbytes += bits.nbytes
    old_problems = gathered.problems
    steps_seen = {"old": sorted({b["step"] for b in built if b}),
                  "migrated": sorted({r["step"] for r in resized if r and "step" in r}),
                  "checkpoint": sorted({x["step"] for x in loaded if x and x["step"] is not None})}
    step_ok = (len(steps_seen["old"]) == 1 and steps_seen["migrated"] == steps_seen["old"]
               and steps_seen["checkpoint"] in ([], steps_seen["old"]))
    # each new rank continues the generator of its rng_source old rank
    rng_ok = all(
        resized[device]["rng_installed"] and resized[device]["rng"]
        == built[rng_source(tr.old, tr.new, new_rank, tr.model.num_layers)]["rng"]
        for new_rank, device in enumerate(plan.new.devices))
    loss_ok = "checkpoint" not in losses or losses["checkpoint"] == losses["migrated"]
    verified = (not mismatches and not old_problems and step_ok and rng_ok and loss_ok
                and all(math.isfinite(x) for x in losses.values()))
    by_oracle: dict[str, list[str]] = {}
    for key, entry in sorted(per_tensor.items()):
        for oracle in sorted(entry["oracles"]):
            by_oracle.setdefault(oracle, []).append(key)
    return {
        "model": tr.model.name, "from": str(tr.old), "to": str(tr.new),
        "processes": tr.processes,
        "tensors": len(per_tensor), "shards": shards, "bytes": nbytes,
        "moved_bytes": plan.moved_bytes,
        "mismatches": len(mismatches) + len(old_problems),
        "verified": verified,
        "first_mismatch": mismatches[0] if mismatches else None,
        "old_state_problems": old_problems,
        "oracles": {k: len(v) for k, v in by_oracle.items()},
        "oracle_tensors": by_oracle,
        "per_tensor": [{"tensor": key, "shards": e["shards"], "bytes": e["bytes"],
                        "oracles": sorted(e["oracles"])} for key, e in sorted(per_tensor.items())],
        "optimizer_oracle": ORACLE_CHECKPOINT if with_optimizer else ORACLE_GATHER,
        "step": {**steps_seen, "ok": step_ok},
        "rng_installed": rng_ok,
        "loss_after": {**losses, "ok": loss_ok},
        "seconds": seconds,
    }


def _first(values: Sequence[Any]) -> Any:
    return next((v for v in values if v is not None), None)


# -- bench ----------------------------------------------------------------------------------

RAW_P2P_BYTES = 256 << 20


def bench_migrate(tr: Transition, *, repeat: int = 1, seed: int = 1234, steps: int = 1,
                  staging_bytes: int | None = None, p2p_bytes: int = RAW_P2P_BYTES,
                  progress: Progress = _no_progress, workdir: str | None = None,
                  log_level: int = logging.WARNING) -> dict:
    """Both resize paths of one transition, side by side on this machine, ``repeat`` times.

    Each path runs on its own processes, from the same old state (seeded: bit for bit the
    same, trained ``steps`` steps):

    * in place: ``tr.processes`` workers build the old state and resize
      (``etc_seconds``: from the pause at the step boundary to the new model and optimizer
      views being ready on every new rank); raw gloo throughput is then measured on the same
      processes (one pair, and the plan's message pattern);
    * checkpoint: ``tr.old.world`` workers build the same state; megatron saves a warm-up
      checkpoint (its first save starts a multiprocessing Manager: ``save_first_seconds``),
      then the timed one (fsynced); the processes stop; ``tr.new.world`` fresh processes
      start (cold import), build the new layout and load.

    The in-place repeats run first, then the checkpoint repeats: on this machine, writing a
    few hundred MiB of files slows every first-touch page fault for seconds afterwards
    (12x measured), which would bill the checkpoint's side effect to the in-place path that
    follows it. Both new states are compared by digest where megatron can reshard the
    optimizer.
    """
    plan = tr.plan()
    gb = batch_for(tr.old, tr.new)
    seq = min(tr.model.seq_length, 64)
    common = dict(seed=seed, steps=steps, seq=seq, gb=gb, progress=progress,
                  log_level=log_level)
    in_place, digests = [], None
    for i in range(repeat):
        progress(f"in place, repeat {i + 1}/{repeat}")
        run, digest = _bench_in_place(tr, plan, staging_bytes=staging_bytes,
                                      p2p_bytes=p2p_bytes, tag=f"bench-a{i}", **common)
        in_place.append(run)
        digests = digests or digest
    runs = []
    for i in range(repeat):
        progress(f"checkpoint, repeat {i + 1}/{repeat}")
        run = _bench_checkpoint(tr, plan, workdir=workdir, digests=digests,
                                tag=f"bench-b{i}", **common)
        runs.append({**in_place[i], **run})
    return _bench_summary(tr, plan, runs)


def _span(results: Sequence[dict | None], start: str = "pause", end: str = "ready") -> float:
    rs = [r["seconds"] for r in results if r]
    return max(r[end] for r in rs) - min(r[start] for r in rs)


def _bench_in_place(tr: Transition, plan: Any, *, seed: int, steps: int, seq: int, gb: int,
                    staging_bytes: int | None, p2p_bytes: int, progress: Progress, tag: str,
                    log_level: int) -> tuple[dict, Sequence[dict | None] | None]:
    """One run of the in-place path; returns its numbers and the new state's digests."""
    tag = f"{tag}-{os.getpid()}-{time.monotonic_ns()}"
    out: dict[str, Any] = {}
    progress(f"in place: starting {tr.processes} processes (the running job)")
    job = LocalWorkers(tr.processes, preload=PRELOAD, log_level=log_level)
    try:
        out["job_start_seconds"] = job.start()
        progress(f"in place: building {tr.model.name} under {tr.old}, {steps} training "
                 "step(s)")
        job.run(w_build, tr.model, tr.old, tag=f"{tag}/old", seed=seed, steps=steps, seq=seq,
                global_batch=gb)
        progress(f"in place: prepare the resize to {tr.new} while training (migration "
                 "group, program, destination memory)")
        prepared = [r for r in job.run(w_prepare, tr, tag=f"{tag}/resize",
                                       staging_bytes=staging_bytes) if r]
        out["prepare"] = {k: max(r["seconds"][k] for r in prepared)
                          for k in prepared[0]["seconds"]}
        progress(f"in place: pause at the step boundary, resize to {tr.new}")
        resized = job.run(w_resize, keep_bits=False)
        out["etc"] = _etc_numbers(plan, resized)
        digests = (job.run(w_digest) if megatron_reshards_optimizer(tr.old, tr.new)
                   else None)
        progress(f"raw gloo point-to-point ({p2p_bytes >> 20} MiB) and the plan's message "
                 "pattern, same processes")
        out["raw_p2p"] = _first(job.run(w_raw_p2p, p2p_bytes, tag=f"{tag}/raw"))
        out["raw_pattern"] = max(r["seconds"] for r in
                                 job.run(w_raw_pattern, tr, tag=f"{tag}/pattern") if r)
    finally:
        job.close()
    return out, digests


def _bench_checkpoint(tr: Transition, plan: Any, *, seed: int, steps: int, seq: int, gb: int,
                      progress: Progress, workdir: str | None, digests: Any, tag: str,
                      log_level: int) -> dict:
    """One run of the checkpoint path: save, stop, fresh processes, build, load."""
    tag = f"{tag}-{os.getpid()}-{time.monotonic_ns()}"
    tmp = tempfile.mkdtemp(prefix="slurm-etc-bench-", dir=workdir)
    compare = megatron_reshards_optimizer(tr.old, tr.new)
    out: dict[str, Any] = {}
    try:
        progress(f"checkpoint: starting {tr.old.world} processes (the running job)")
        job = LocalWorkers(tr.old.world, preload=PRELOAD, log_level=log_level)
        try:
            job.start()
            progress(f"checkpoint: building the same state under {tr.old}")
            job.run(w_build, tr.model, tr.old, tag=f"{tag}/old", seed=seed, steps=steps,
                    seq=seq, global_batch=gb)
            progress("checkpoint: warm-up save (starts megatron's writer Manager)")
            first = [r for r in job.run(w_save, os.path.join(tmp, "warmup")) if r]
            out["save_first_seconds"] = max(r["seconds"] for r in first)
            shutil.rmtree(os.path.join(tmp, "warmup"), ignore_errors=True)
            progress("checkpoint: timed save, fsynced")
            saved = [r for r in job.run(w_save, os.path.join(tmp, "ckpt")) if r]
            out["save"] = {"seconds": max(r["seconds"] for r in saved),
                           "megatron_save": max(r["save"] for r in saved),
                           "extra_fsync": max(r["fsync"] for r in saved),
                           "bytes": sum(r["bytes"] for r in saved)}
        finally:
            progress("checkpoint: stopping the job's processes")
            out["stop_seconds"] = job.close()
        progress(f"checkpoint: starting {tr.new.world} fresh processes (cold import)")
        fresh = LocalWorkers(tr.new.world, preload=PRELOAD, log_level=log_level)
        try:
            out["fresh_start_seconds"] = fresh.start()
            progress("checkpoint: build the new layout and load")
            loaded = [r for r in fresh.run(w_load, tr.model, tr.new,
                                           os.path.join(tmp, "ckpt"), optimizer=compare,
                                           name="state", tag=f"{tag}/fresh") if r]
            out["fresh_build"] = max(r["group"] + r["build"] for r in loaded)
            out["load_seconds"] = max(r["load"] for r in loaded)
            if compare and digests is not None:
                out["same_state"] = _same_digests(plan, digests, fresh.run(w_digest))
        finally:
            fresh.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["restart_seconds"] = (out["stop_seconds"] + out["fresh_start_seconds"]
                              + out["fresh_build"])
    out["checkpoint_seconds"] = (out["save"]["seconds"] + out["restart_seconds"]
                                 + out["load_seconds"])
    return out


def _same_digests(plan: Any, etc: Sequence[dict | None], fresh: Sequence[dict | None]) -> bool:
    """The in-place state of new rank r (on its device) equals the checkpoint-loaded one of
    new rank r (fresh worker r)."""
    for new_rank, device in enumerate(plan.new.devices):
        if etc[device] != fresh[new_rank]:
            return False
    return True


_PAUSE_PHASES = ("resume", "migrate", "train_group", "rebuild", "install")


def _etc_numbers(plan: Any, resized: Sequence[dict | None]) -> dict:
    parts = [r for r in resized if r]
    stats = [r["stats"] for r in parts]
    phase = {name: max(r["seconds"].get(name, 0.0) for r in parts) for name in _PAUSE_PHASES}
    data = max(s["data_seconds"] for s in stats)
    moved = plan.moved_bytes
    per_rank = [{"device": i, "new_rank": r.get("new_rank"),
                 "sent_bytes": r["stats"]["sent_bytes"],
                 "received_bytes": r["stats"]["received_bytes"],
                 "data_seconds": r["stats"]["data_seconds"],
                 **{k: r["stats"].get(k) for k in ("local_seconds", "wait_seconds",
                                                   "vote_seconds", "pack_seconds",
                                                   "unpack_seconds", "direct_bytes")},
                 "throughput_gibps": r["stats"]["throughput_gibps"],
                 "new_state_bytes": r["stats"]["new_state_bytes"],
                 "staging_budget": r["stats"]["staging_budget"],
                 "staging_bytes": r["stats"]["staging_bytes"],
                 "memory_peak_delta": r["stats"]["memory_peak_delta"],
                 "memory_bound": r["stats"]["memory_bound"],
                 "peak_over_bound": r["stats"]["peak_over_bound"],
                 "memory_reset": r["stats"]["memory_reset"],
                 "phases": {k: r["seconds"][k] for k in _PAUSE_PHASES if k in r["seconds"]},
                 "span": r["seconds"]["ready"] - r["seconds"]["pause"]}
                for i, r in enumerate(resized) if r]
    return {"seconds": _span(parts), "phases": phase, "data_seconds": data,
            "moved_bytes": moved, "achieved_gibps": moved / data / 2**30 if data else None,
            "per_rank": per_rank}


def _bench_summary(tr: Transition, plan: Any, runs: list[dict]) -> dict:
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    etc = med([r["etc"]["seconds"] for r in runs])
    ckpt = med([r["checkpoint_seconds"] for r in runs])
    raw = med([r["raw_p2p"]["gibps"] for r in runs])
    raw_fresh = med([r["raw_p2p"]["fresh_gibps"] for r in runs])
    achieved = med([r["etc"]["achieved_gibps"] for r in runs])
    pattern = med([r["raw_pattern"] for r in runs])
    data = med([r["etc"]["data_seconds"] for r in runs])
    peaks = [p["peak_over_bound"] for r in runs for p in r["etc"]["per_rank"]
             if p["peak_over_bound"] is not None]
    return {
        "model": tr.model.name, "from": str(tr.old), "to": str(tr.new),
        "processes": tr.processes, "repeat": len(runs),
        "state_bytes": plan.catalog.total_bytes, "moved_bytes": plan.moved_bytes,
        "kept_bytes": plan.kept_bytes, "messages": len(plan.messages), "rounds": plan.rounds,
        "etc_seconds": etc,
        "checkpoint_seconds": ckpt,
        "checkpoint_parts": {
            "save": med([r["save"]["seconds"] for r in runs]),
            "restart": med([r["restart_seconds"] for r in runs]),
            "load": med([r["load_seconds"] for r in runs]),
            "stop": med([r["stop_seconds"] for r in runs]),
            "fresh_start": med([r["fresh_start_seconds"] for r in runs]),
            "fresh_build": med([r["fresh_build"] for r in runs]),
            "extra_fsync": med([r["save"]["extra_fsync"] for r in runs]),
            "save_first": med([r["save_first_seconds"] for r in runs]),
            "checkpoint_bytes": runs[0]["save"]["bytes"],
        },
        "etc_parts": {name: med([r["etc"]["phases"][name] for r in runs])
                      for name in runs[0]["etc"]["phases"]},
        "prepare_parts": {name: med([r["prepare"][name] for r in runs])
                          for name in runs[0]["prepare"]},
        "ratio": ckpt / etc if etc else None,
        "data_seconds": data,
        "achieved_gibps": achieved,
        "raw_p2p_gibps": raw,
        "raw_p2p_fresh_gibps": raw_fresh,
        "data_over_raw_p2p": achieved / raw if achieved and raw else None,
        "data_over_raw_p2p_fresh": achieved / raw_fresh if achieved and raw_fresh else None,
        "raw_pattern_seconds": pattern,
        "data_over_raw_pattern": pattern / data if pattern and data else None,
        "peak_over_bound_max": max(peaks) if peaks else None,
        "same_state": all(r.get("same_state", True) for r in runs)
        if any("same_state" in r for r in runs) else None,
        # megatron cannot reshard this DistributedOptimizer on CPU (see
        # megatron_reshards_optimizer): the checkpoint path then loads the model only, and
        # its downtime is a lower bound
        "checkpoint_complete": megatron_reshards_optimizer(tr.old, tr.new),
        "targets": {
            "ratio_ge_10": (ckpt / etc >= 10) if etc else None,
            "throughput_ge_80pct_raw": (achieved / raw >= 0.8) if achieved and raw else None,
            "peak_le_bound_plus_10pct": (max(peaks) <= 1.1) if peaks else None,
        },
        "runs": runs,
    }


def json_default(value: Any) -> Any:
    """For ``json.dumps``: tuples and sets as lists."""
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
