"""``slurm-etc verify``: an in-place resize of a real trained megatron-core state, every
tensor checked bit for bit against references that share no code with the resize (see
docs/verify.md).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

from slurm_etc.megatron.checkpoint import megatron_reshards_optimizer
from slurm_etc.plan.errors import ConfigError
from slurm_etc.pool.local import LocalWorkers

from .experiments import Progress
from .experiments import first as _first
from .experiments import no_progress as _no_progress
from .phases import (
    PRELOAD,
    Transition,
    batch_for,
    w_build,
    w_drop,
    w_load,
    w_prepare,
    w_resize,
    w_save,
)
from .reference import (
    assemble,
    compare_globals,
    compare_ranks,
    expected_rng_sources,
    w_megatron_view,
    w_seed_rng,
    w_train_steps,
)

if TYPE_CHECKING:
    from slurm_etc.megatron.state import Relabel

logger = logging.getLogger(__name__)

ORACLE_GATHER = "megatron-gather"
ORACLE_CHECKPOINT = "megatron-checkpoint"
AFTER_STEPS = 3
# Where megatron cannot load the optimizer, the losses after the resize are compared with
# the old layout trained on: the same arithmetic reduced in another order (tp splits the
# matmuls, dp the gradient all-reduce, pp nothing), so they agree to rounding, not to the
# bit. Relative tolerance per parameter dtype; measured differences are far below it
# (docs/verify.md).
LOSS_RTOL = {"fp32": 1e-6, "bf16": 1e-4}


def verify_transition(tr: Transition, *, workers: LocalWorkers | None = None,
                      seed: int = 1234, steps: int = 2, after_steps: int = AFTER_STEPS,
                      corrupt: bool = False, relabel: Relabel | None = None,
                      progress: Progress = _no_progress, workdir: str | None = None,
                      log_level: int = logging.WARNING) -> dict:
    """Migrate a real trained megatron-core state in place and check it against references.

    Builds ``tr.model`` under ``tr.old`` (seeded, ``steps`` Adam steps; every rank's CPU
    generator then gets a state of its own), reads it through megatron-core and torch
    (:mod:`.reference`: model ``sharded_state_dict()``, the optimizer's own state by
    parameter, the DistributedOptimizer's own dp gather), saves megatron's checkpoint,
    resizes in place, reads the new layout the same way, and checks:

    * ``megatron-gather``: every full tensor of the new layout (every element, every
      replica) equals the old layout's, bit for bit: parameters, fp32 main parameters,
      Adam moments;
    * ``megatron-checkpoint``: every shard of every new rank equals the one megatron's own
      ``dist_checkpointing`` loaded into a state built for the new layout (the model always;
      the optimizer where megatron reshards it, see :func:`megatron_reshards_optimizer`);
    * the Adam step of every parameter of every rank is ``steps`` (and the checkpoint's);
    * each new rank's CPU generator is the one its source old rank had, the source chosen
      from megatron's coordinates (and, where the checkpoint holds that generator, equal to
      what the checkpoint restored);
    * ``after_steps`` more training steps with optimizer updates on the migrated state give
      the losses of the checkpoint-loaded state (bit-equal), or, where megatron cannot load
      the optimizer, of the old layout rebuilt and trained on (within ``LOSS_RTOL``).

    ``corrupt`` flips one bit in the copy of new rank 0's state the comparison reads: a
    self-test of the comparator, not of the migration. ``relabel`` (a
    :data:`slurm_etc.megatron.state.Relabel`, e.g. from :mod:`slurm_etc.testing.plants`)
    plants a bug in the migration itself: every old rank reads its shards through it.

    Every layout the executor's catalog describes goes this way: dp, tp, pp, the experts of
    a mixture of experts over ep, virtual pipeline chunks (vpp), joiners and leavers, the
    distributed optimizer, bf16 mixed precision.

    Returns the report ``slurm-etc verify --json`` prints.
    """
    plan = tr.plan()
    own = workers is None
    if workers is None:
        progress(f"starting {tr.processes} worker processes (cold import of megatron-core)")
        pool = LocalWorkers(tr.processes, preload=PRELOAD, log_level=log_level)
        pool.start()
    elif workers.size < tr.processes:
        raise ConfigError(f"{tr} needs {tr.processes} processes, the pool has {workers.size}")
    else:
        pool = workers
    tag = f"verify-{os.getpid()}-{time.monotonic_ns()}"
    seq = min(tr.model.seq_length, 64)
    gb = batch_for(tr.old, tr.new)
    train = dict(seed=seed, seq=seq, global_batch=gb)
    with_optimizer = megatron_reshards_optimizer(tr.old, tr.new)
    tmp = tempfile.mkdtemp(prefix="slurm-etc-verify-", dir=workdir)
    t_start = time.perf_counter()
    try:
        old_views, new_views, loaded_views, losses = _migrate_and_load(
            pool, tr, plan, tmp, tag, train, seed=seed, steps=steps, after_steps=after_steps,
            with_optimizer=with_optimizer, relabel=relabel, progress=progress)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if own:
            pool.close()
    seconds = time.perf_counter() - t_start

    progress("comparing every tensor")
    if corrupt and new_views and new_views[0] is not None:
        shards = dict(new_views[0]["shards"])
        first_key = min(shards)
        shards[first_key] = shards[first_key].copy()
        shards[first_key].reshape(-1)[:1] ^= 1
        new_views[0] = {**new_views[0], "shards": shards}
    return _report(tr, plan, steps, with_optimizer, old_views, new_views, loaded_views,
                   losses, seconds)


def _migrate_and_load(pool: LocalWorkers, tr: Transition, plan, tmp: str, tag: str,
                      train: dict, *, seed: int, steps: int, after_steps: int,
                      with_optimizer: bool, relabel: Relabel | None,
                      progress: Progress) -> tuple:
    """Build and train the old layout, read it, save megatron's checkpoint, resize in place,
    read the new layout, load the checkpoint into a state built for the new layout and read
    it, and train on: (old views, new views, loaded views, losses by state)."""
    losses: dict[str, list[float]] = {}
    progress(f"building {tr.model.name} under {tr.old} and training {steps} step(s)")
    pool.run(w_build, tr.model, tr.old, tag=tag, steps=steps, **train)
    pool.run(w_seed_rng, seed)
    progress("reading the old layout through megatron-core")
    old_views = pool.run(w_megatron_view)[:tr.old.world]
    progress("saving megatron's checkpoint of the old layout (the reference)")
    pool.run(w_save, os.path.join(tmp, "ckpt"), fsync=False)
    progress(f"migrating in place to {tr.new} ({plan.moved_bytes / 2**20:.1f} MiB move)")
    pool.run(w_prepare, tr, tag=f"{tag}/resize", staging_bytes=None, relabel=relabel)
    pool.run(w_resize, keep_bits=False)
    by_device = pool.run(w_megatron_view)
    new_views = [by_device[d] for d in plan.new.devices]
    progress("loading the checkpoint into a state built for the new layout"
             + ("" if with_optimizer else " (model only: megatron cannot reshard this "
                                           "distributed optimizer)"))
    pool.run(w_load, tr.model, tr.new, os.path.join(tmp, "ckpt"),
             optimizer=with_optimizer)
    by_device = pool.run(w_megatron_view, "loaded", model_only=not with_optimizer)
    loaded_views = [by_device[d] for d in plan.new.devices]
    if after_steps:
        progress(f"{after_steps} training steps on the migrated state"
                 + (" and on the checkpoint-loaded one" if with_optimizer else ""))
        losses["migrated"] = _first(pool.run(w_train_steps, "state", first_step=steps,
                                             count=after_steps, **train))
        if with_optimizer:
            losses["checkpoint"] = _first(pool.run(
                w_train_steps, "loaded", first_step=steps, count=after_steps, **train))
    pool.run(w_drop)
    if after_steps and not with_optimizer:
        progress(f"reference: the old layout rebuilt and trained {after_steps} steps on")
        ref = _first(pool.run(w_build, tr.model, tr.old, tag=f"{tag}/reference",
                              steps=steps + after_steps, **train))
        losses["old_layout"] = ref["losses"][steps:]
        pool.run(w_drop)
    return old_views, new_views, loaded_views, losses


def _report(tr, plan, steps, with_optimizer, old_views, new_views, loaded_views, losses,
            seconds) -> dict:
    old = assemble(old_views, "old layout")
    new = assemble(new_views, "new layout")
    mismatches, by_gather = compare_globals(old, new_views, new, ORACLE_GATHER)
    keys = None if with_optimizer else {k for k in new.tensors if not k.startswith("optimizer.")}
    ckpt_mismatches, by_checkpoint = compare_ranks(new_views, loaded_views, ORACLE_CHECKPOINT,
                                                   keys=keys)
    mismatches += ckpt_mismatches
    step = _step_check(steps, with_optimizer, old_views, new_views, loaded_views)
    rng = _rng_check(with_optimizer, old_views, new_views, loaded_views)
    loss = _loss_check(tr, losses)
    per_tensor, by_oracle = _per_tensor(old, new, by_gather, by_checkpoint)
    unchecked = [t["tensor"] for t in per_tensor if ORACLE_GATHER not in t["oracles"]]
    verified = (not mismatches and not old.problems and not unchecked and step["ok"]
                and rng["ok"] and loss["ok"])
    return {
        "model": tr.model.name, "from": str(tr.old), "to": str(tr.new),
        "processes": tr.processes,
        "tensors": len(per_tensor),
        "shards": sum(t["shards"] for t in per_tensor),
        "bytes": sum(t["bytes"] for t in per_tensor),
        "moved_bytes": plan.moved_bytes,
        "mismatches": len(mismatches) + len(old.problems),
        "verified": verified,
        "first_mismatch": mismatches[0] if mismatches else None,
        "mismatches_by_oracle": {o: sum(1 for m in mismatches if m.get("oracle") == o)
                                 for o in sorted({m.get("oracle", "") for m in mismatches})},
        "old_state_problems": old.problems,
        "unchecked_tensors": unchecked,
        "oracles": {k: len(v) for k, v in by_oracle.items()},
        "oracle_tensors": by_oracle,
        "per_tensor": per_tensor,
        "coverage": {"old_shards": old.shards, "new_shards": new.shards,
                     "checkpoint_shards": sum(e["shards"] for e in by_checkpoint.values())},
        "optimizer_oracle": ORACLE_CHECKPOINT if with_optimizer else ORACLE_GATHER,
        "step": step,
        "rng_installed": rng["ok"],
        "rng": rng,
        "loss_after": loss,
        "seconds": seconds,
    }

def _step_check(steps, with_optimizer, old_views, new_views, loaded_views) -> dict:
    """Every parameter's Adam step on every rank, read from torch's optimizer state: ``steps``
    everywhere, and the checkpoint's where it holds the optimizer."""
    def steps_of(views):
        return [v["steps"] for v in views if v is not None]

    step_ok = (all(s == [float(steps)] for s in steps_of(old_views) + steps_of(new_views))
               and (not with_optimizer or all(
                   a is not None and b is not None and a["steps"] == b["steps"]
                   for a, b in zip(new_views, loaded_views))))
    return {"expected": steps,
            **{side: sorted({int(x) if float(x).is_integer() else x
                             for s in steps_of(views) for x in s})
               for side, views in (("old", old_views), ("migrated", new_views),
                                   ("checkpoint", loaded_views if with_optimizer else []))},
            "ok": step_ok}


def _rng_check(with_optimizer, old_views, new_views, loaded_views) -> dict:
    """Each new rank continues its source's generator (source from megatron coordinates)."""
    sources = expected_rng_sources(old_views, new_views)
    rng_wrong = [r for r, src in sources.items() if new_views[r]["rng"] != old_views[src]["rng"]]
    # megatron's checkpoint holds old rank 0's generator (common state) and restores it
    by_ckpt = [r for r, src in sources.items() if with_optimizer and src == 0]
    rng_wrong += [r for r in by_ckpt
                  if new_views[r]["rng"] != loaded_views[r]["rng"] and r not in rng_wrong]
    return {"ok": not rng_wrong, "sources": sources, "wrong_ranks": sorted(rng_wrong),
            "checked_against_checkpoint": by_ckpt}


def _loss_check(tr, losses) -> dict:
    """The losses of the steps after the resize against the checkpoint-loaded state's
    (bit-equal) or the old layout's (within ``LOSS_RTOL``)."""
    finite = all(math.isfinite(x) for v in losses.values() for x in v)
    loss = {**losses, "steps": len(losses.get("migrated", []))}
    if "checkpoint" in losses:
        loss.update(compared_with="checkpoint", tolerance=0.0,
                    ok=finite and losses["checkpoint"] == losses["migrated"])
    elif "old_layout" in losses:
        rtol = LOSS_RTOL[tr.model.param_dtype]
        diffs = [abs(a - b) / abs(b) for a, b in zip(losses["migrated"], losses["old_layout"])]
        loss.update(compared_with="old-layout", tolerance=rtol,
                    max_relative_difference=max(diffs, default=0.0),
                    ok=finite and len(diffs) == len(losses["migrated"])
                    and all(d <= rtol for d in diffs))
    else:
        loss.update(compared_with=None, ok=finite)
    return loss


def _per_tensor(old, new, by_gather, by_checkpoint) -> tuple[list[dict], dict[str, list[str]]]:
    """One entry per tensor (shards, bytes, the oracles that checked it), and the tensors
    each oracle checked."""
    per_tensor = []
    by_oracle: dict[str, list[str]] = {}
    for key in sorted(set(old.tensors) | set(new.tensors)):
        oracles = [o for o, seen in ((ORACLE_GATHER, by_gather), (ORACLE_CHECKPOINT,
                                                                 by_checkpoint)) if key in seen]
        entry = by_gather.get(key, {"shards": 0, "bytes": 0})
        per_tensor.append({"tensor": key, "shards": entry["shards"], "bytes": entry["bytes"],
                           "oracles": oracles})
        for o in oracles:
            by_oracle.setdefault(o, []).append(key)
    return per_tensor, by_oracle
