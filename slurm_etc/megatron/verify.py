"""``slurm-etc verify``: an in-place resize of a real trained megatron-core state, every
tensor checked bit for bit against independent references (see docs/verify.md).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time

from slurm_etc.plan.errors import ConfigError
from slurm_etc.pool.local import LocalWorkers

from .checkpoint import megatron_reshards_optimizer
from .experiments import Progress, first as _first, no_progress as _no_progress
from .phases import (PRELOAD, Transition, batch_for, w_build, w_drop, w_load, w_prepare,
                     w_resize, w_save, w_shard_bits, w_train_step)

logger = logging.getLogger(__name__)

ORACLE_CHECKPOINT = "megatron-checkpoint"
ORACLE_GATHER = "global-gather"
ORACLE_INSTALL = "install-roundtrip"

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
    from .oracles import assemble_globals, compare_shards, expected_shards
    from .state import rng_source

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
