"""The experiments that hold the in-place resize against megatron-core's checkpoint path.

* :func:`verify_transition`: ``slurm-etc verify`` (migrate in place, then compare every
  tensor with megatron's checkpoint resharding and with the global-gather oracle).
* :func:`bench_migrate`: ``slurm-etc bench migrate`` (both paths side by side, timed part by
  part).

Both run on local processes (:class:`~slurm_etc.worker.local.LocalWorkers`, joined by a
``TCPStore`` the parent hosts; each phase starts the ``gloo`` groups it needs from it, as the
job's coordinator would) through the worker phases of :mod:`.phases`.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from slurm_etc.plan.errors import ConfigError
from slurm_etc.worker.local import LocalWorkers

from .checkpoint import megatron_reshards_optimizer
from .phases import (PRELOAD, Transition, batch_for, w_build, w_digest, w_drop, w_load,
                     w_prepare, w_raw_p2p, w_raw_pattern, w_resize, w_save, w_shard_bits,
                     w_train_step)

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

ORACLE_CHECKPOINT = "megatron-checkpoint"
ORACLE_GATHER = "global-gather"
ORACLE_INSTALL = "install-roundtrip"


def _no_progress(message: str) -> None:
    pass


# -- verify ---------------------------------------------------------------------------------


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
