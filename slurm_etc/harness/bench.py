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

from slurm_etc.megatron.checkpoint import megatron_reshards_optimizer
from slurm_etc.plan.plan import MigrationPlan
from slurm_etc.pool.local import LocalWorkers

from .experiments import Progress
from .experiments import first as _first
from .experiments import no_progress as _no_progress
from .phases import (
    PRELOAD,
    Transition,
    batch_for,
    w_build,
    w_digest,
    w_load,
    w_prepare,
    w_raw_p2p,
    w_raw_pattern,
    w_resize,
    w_save,
)

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
      start (cold import), build the new layout and load, twice: started all at once, and
      one at a time (see ``COLD_STARTS`` and :func:`checkpoint_spans`).

    Both downtimes are wall-clock spans over processes, from the first rank's pause to the
    last new rank ready to train. The ratio uses the checkpoint path's per-process-core
    cold start (``ratio_cold_start``); ``ratio_all_at_once`` is the one with the fresh
    processes sharing this machine's cores. ``load_average`` (1/5/15 min, before and
    after) says how busy the machine was.

    The in-place repeats run first, then the checkpoint repeats: on this machine, writing a
    few hundred MiB of files slows every first-touch page fault for seconds afterwards
    (12x measured), which would bill the checkpoint's side effect to the in-place path that
    follows it. Both new states are compared by digest where megatron can reshard the
    optimizer.
    """
    load_before = os.getloadavg()
    plan = tr.plan()
    gb = batch_for(tr.old, tr.new)
    seq = min(tr.model.seq_length, 64)
    common: dict[str, Any] = {"seed": seed, "steps": steps, "seq": seq, "gb": gb,
                              "progress": progress, "log_level": log_level}
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
    summary = _bench_summary(tr, plan, runs)
    summary["load_average"] = {"before": list(load_before), "after": list(os.getloadavg()),
                               "cpus": os.cpu_count()}
    return summary


def _bench_in_place(tr: Transition, plan: MigrationPlan, *, seed: int, steps: int, seq: int,
                    gb: int, staging_bytes: int | None, p2p_bytes: int, progress: Progress,
                    tag: str,
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


# The two ways the checkpoint path's fresh processes are started, in the order they run.
# ``per_process_core`` starts them one at a time and counts the slowest: what a node with a
# core per process pays (its processes start side by side without sharing a core); the
# ratio uses it. ``all_at_once`` starts them together on this machine's cores, as a plain
# restart here does.
COLD_STARTS = ("all_at_once", "per_process_core")


def _bench_checkpoint(tr: Transition, plan: MigrationPlan, *, seed: int, steps: int, seq: int,
                      gb: int, progress: Progress, workdir: str | None, digests: Any, tag: str,
                      log_level: int) -> dict:
    """One run of the checkpoint path: save, stop, fresh processes, build, load.

    The fresh processes are started twice from the same checkpoint, first all at once, then
    one at a time (see ``COLD_STARTS``); each set builds the new layout and loads.
    """
    tag = f"{tag}-{os.getpid()}-{time.monotonic_ns()}"
    tmp = tempfile.mkdtemp(prefix="slurm-etc-bench-", dir=workdir)
    compare = megatron_reshards_optimizer(tr.old, tr.new)
    out: dict[str, Any] = {}
    try:
        progress(f"checkpoint: starting {tr.old.world} processes (the running job)")
        job = LocalWorkers(tr.old.world, preload=PRELOAD, log_level=log_level)
        saved: list[dict] = []
        try:
            job.start()
            progress(f"checkpoint: building the same state under {tr.old}")
            job.run(w_build, tr.model, tr.old, tag=f"{tag}/old", seed=seed, steps=steps,
                    seq=seq, global_batch=gb)
            progress("checkpoint: warm-up save (starts megatron's writer Manager)")
            first = [r for r in job.run(w_save, os.path.join(tmp, "warmup")) if r]
            out["save_first_seconds"] = max(r["seconds"] for r in first)
            shutil.rmtree(os.path.join(tmp, "warmup"), ignore_errors=True)
            progress("checkpoint: pause, timed save (fsynced)")
            saved = [r for r in job.run(w_save, os.path.join(tmp, "ckpt")) if r]
        finally:
            progress("checkpoint: stopping the job's processes")
            job.close()
            stopped = time.time()
        out["save"] = {"pause": min(r["pause"] for r in saved),
                       "saved": max(r["saved"] for r in saved), "stopped": stopped,
                       "megatron_save": max(r["save"] for r in saved),
                       "extra_fsync": max(r["fsync"] for r in saved),
                       "bytes": sum(r["bytes"] for r in saved)}
        for how in COLD_STARTS:
            alone = how == "per_process_core"
            progress(f"checkpoint: starting {tr.new.world} fresh processes "
                     f"{'one at a time' if alone else 'all at once'} (cold import)")
            fresh = LocalWorkers(tr.new.world, preload=PRELOAD, log_level=log_level,
                                 cold=True)
            try:
                fresh.start(one_at_a_time=alone)
                progress("checkpoint: build the new layout and load")
                loaded = [r for r in fresh.run(w_load, tr.model, tr.new,
                                               os.path.join(tmp, "ckpt"), optimizer=compare,
                                               name="state", tag=f"{tag}/fresh-{how}") if r]
                out[how] = {"start_seconds": fresh.start_seconds,
                            "start_each": list(fresh.start_seconds_each),
                            "begin": min(r["begin"] for r in loaded),
                            "ready": max(r["ready"] for r in loaded),
                            **{k: max(r[k] for r in loaded) for k in ("group", "build",
                                                                       "load")}}
                if compare and digests is not None:
                    same = _same_digests(plan, digests, fresh.run(w_digest))
                    out["same_state"] = out.get("same_state", True) and same
            finally:
                fresh.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out.update(checkpoint_spans(out["save"], out["all_at_once"], out["per_process_core"]))
    return out


def checkpoint_spans(save: dict, all_at_once: dict, per_process_core: dict) -> dict:
    """The checkpoint path's downtime as wall-clock spans (``time.time()`` of every process).

    ``save``: ``pause`` (first rank entered the save), ``saved`` (last rank done),
    ``stopped`` (the last old process exited); each cold start: ``start_seconds`` (the
    whole start-up), ``start_each`` (per process, spawn to ready), ``begin`` (first new rank
    starts its group) and ``ready`` (last new rank loaded).

    * ``seconds_all_at_once`` = last new rank ready - first rank paused, measured in one
      piece: the fresh processes were started all at once right after the stop.
    * ``seconds`` (per process core) = the same span with its cold start replaced by the
      slowest of the processes started one at a time: (first pause -> last old process
      exited) + max(start_each) + (first new rank begins -> last loaded), the last part
      measured on those processes. The parent's hand-offs between the parts (``handoffs``
      in the all-at-once span, milliseconds) are left out.
    """
    to_stopped = save["stopped"] - save["pause"]
    per_core = max(per_process_core["start_each"])
    build_load = per_process_core["ready"] - per_process_core["begin"]
    measured = all_at_once["ready"] - save["pause"]
    build_load_all = all_at_once["ready"] - all_at_once["begin"]
    composed_all = to_stopped + all_at_once["start_seconds"] + build_load_all
    return {
        "checkpoint_seconds": to_stopped + per_core + build_load,
        "checkpoint_seconds_all_at_once": measured,
        "spans": {
            "save": save["saved"] - save["pause"],
            "stop": save["stopped"] - save["saved"],
            "cold_start": per_core,
            "build_load": build_load,
            "cold_start_all_at_once": all_at_once["start_seconds"],
            "build_load_all_at_once": build_load_all,
            "handoffs_all_at_once": measured - composed_all,
        },
    }


def _same_digests(plan: MigrationPlan, etc: Sequence[dict | None],
                  fresh: Sequence[dict | None]) -> bool:
    """The in-place state of new rank r (on its device) equals the checkpoint-loaded one of
    new rank r (fresh worker r)."""
    for new_rank, device in enumerate(plan.new.devices):
        if etc[device] != fresh[new_rank]:
            return False
    return True


# Wall-clock marks in a resize's ``seconds`` (``time.time()``); every other key is the
# duration of one phase of the pause, in the order the resize ran them.
_CLOCK_MARKS = ("pause", "ready")


def pause_phases(seconds: Sequence[dict]) -> list[str]:
    """The phase names in these resizes' ``seconds``, in first-seen order: read from the
    outcome rather than listed here, so a phase the resize gains shows up in the report."""
    names: list[str] = []
    for s in seconds:
        names += [k for k in s if k not in _CLOCK_MARKS and k not in names]
    return names


def _etc_numbers(plan: MigrationPlan, resized: Sequence[dict | None]) -> dict:
    parts = [r for r in resized if r]
    stats = [r["stats"] for r in parts]
    names = pause_phases([r["seconds"] for r in parts])
    phase = {name: max(r["seconds"].get(name, 0.0) for r in parts) for name in names}
    data = max(s["data_seconds"] for s in stats)
    moved = plan.moved_bytes
    per_rank = [{"device": i, "new_rank": r.get("new_rank"),
                 "sent_bytes": r["stats"]["sent_bytes"],
                 "received_bytes": r["stats"]["received_bytes"],
                 "data_seconds": r["stats"]["data_seconds"],
                 **{k: r["stats"].get(k) for k in ("local_seconds", "wait_seconds",
                                                   "vote_seconds", "commit_seconds",
                                                   "pack_seconds", "unpack_seconds",
                                                   "direct_bytes", "local_bytes",
                                                   "in_place_bytes")},
                 "throughput_gibps": r["stats"]["throughput_gibps"],
                 "new_state_bytes": r["stats"]["new_state_bytes"],
                 "staging_budget": r["stats"]["staging_budget"],
                 "staging_bytes": r["stats"]["staging_bytes"],
                 "memory_peak_delta": r["stats"]["memory_peak_delta"],
                 "memory_bound": r["stats"]["memory_bound"],
                 "peak_over_bound": r["stats"]["peak_over_bound"],
                 "memory_reset": r["stats"]["memory_reset"],
                 "phases": {k: r["seconds"][k] for k in names if k in r["seconds"]},
                 "span": r["seconds"]["ready"] - r["seconds"]["pause"]}
                for i, r in enumerate(resized) if r]
    # the job is down until the last new rank is ready; a departing process's own
    # clean-up after the commit (dropping its groups) is no one's downtime
    staying = [r for r in parts if r.get("new_rank") is not None] or parts
    seconds = (max(r["seconds"]["ready"] for r in staying)
               - min(r["seconds"]["pause"] for r in parts))
    return {"seconds": seconds, "phases": phase, "data_seconds": data,
            "moved_bytes": moved, "achieved_gibps": moved / data / 2**30 if data else None,
            "per_rank": per_rank}


def _bench_summary(tr: Transition, plan: MigrationPlan, runs: list[dict]) -> dict:
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    etc = med([r["etc"]["seconds"] for r in runs])
    ckpt = med([r["checkpoint_seconds"] for r in runs])
    ckpt_all = med([r["checkpoint_seconds_all_at_once"] for r in runs])
    raw = med([r["raw_p2p"]["gibps"] for r in runs])
    raw_fresh = med([r["raw_p2p"]["fresh_gibps"] for r in runs])
    achieved = med([r["etc"]["achieved_gibps"] for r in runs])
    pattern = med([r["raw_pattern"] for r in runs])
    data = med([r["etc"]["data_seconds"] for r in runs])
    peaks = [p["peak_over_bound"] for r in runs for p in r["etc"]["per_rank"]
             if p["peak_over_bound"] is not None]
    spans = {name: med([r["spans"][name] for r in runs]) for name in runs[0]["spans"]}
    per_core = [r["per_process_core"] for r in runs]
    return {
        "model": tr.model.name, "from": str(tr.old), "to": str(tr.new),
        "processes": tr.processes, "repeat": len(runs),
        "state_bytes": plan.catalog.total_bytes, "moved_bytes": plan.moved_bytes,
        "kept_bytes": plan.kept_bytes, "messages": len(plan.messages), "rounds": plan.rounds,
        "etc_seconds": etc,
        "checkpoint_seconds": ckpt,
        "checkpoint_seconds_all_at_once": ckpt_all,
        "checkpoint_parts": {
            **spans,
            "cold_start_each": [med(list(v)) for v in zip(*(c["start_each"] for c in per_core))],
            "cold_start_each_all_at_once": [
                med(list(v)) for v in zip(*(r["all_at_once"]["start_each"] for r in runs))],
            "cold_start_one_at_a_time_total": med([c["start_seconds"] for c in per_core]),
            **{name: med([c[name] for c in per_core]) for name in ("group", "build", "load")},
            "megatron_save": med([r["save"]["megatron_save"] for r in runs]),
            "extra_fsync": med([r["save"]["extra_fsync"] for r in runs]),
            "save_first": med([r["save_first_seconds"] for r in runs]),
            "checkpoint_bytes": runs[0]["save"]["bytes"],
        },
        "etc_parts": {name: med([r["etc"]["phases"].get(name) for r in runs])
                      for name in pause_phases([r["etc"]["phases"] for r in runs])},
        "prepare_parts": {name: med([r["prepare"][name] for r in runs])
                          for name in runs[0]["prepare"]},
        "ratio": ckpt / etc if etc else None,
        "ratio_all_at_once": ckpt_all / etc if etc else None,
        "ratio_cold_start": "per_process_core",
        "ratios": [r["checkpoint_seconds"] / r["etc"]["seconds"] for r in runs],
        "ratios_all_at_once": [r["checkpoint_seconds_all_at_once"] / r["etc"]["seconds"]
                               for r in runs],
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
        # the pause issue's targets: the pause holds the data phase and little else, the
        # data phase runs at the speed of the plan's own raw message pattern
        "targets": {
            "pause_le_data_plus_150ms": (etc <= data + 0.15) if etc and data else None,
            "ratio_ge_25": (ckpt / etc >= 25) if etc else None,
            "data_ge_80pct_raw_pattern": (pattern / data >= 0.8) if pattern and data else None,
            "peak_le_bound_plus_10pct": (max(peaks) <= 1.1) if peaks else None,
        },
        "runs": runs,
    }
