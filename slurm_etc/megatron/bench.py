"""``slurm-etc bench migrate``: both resize paths of one transition side by side on this
machine (in place, and megatron-core's checkpoint save + restart + load), timed part by part.
"""
from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from slurm_etc.pool.local import LocalWorkers

from .checkpoint import megatron_reshards_optimizer
from .experiments import Progress, first as _first, no_progress as _no_progress
from .phases import (PRELOAD, Transition, batch_for, w_build, w_digest, w_load, w_prepare,
                     w_raw_p2p, w_raw_pattern, w_resize, w_save)

logger = logging.getLogger(__name__)

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
