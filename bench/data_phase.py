"""The executor's data phase against the plan's raw message pattern, where the time goes.

Local processes build a real megatron-core state under the old layout (as ``slurm-etc bench
migrate`` does), connect the migration group and prepare the destinations once, then run,
interleaved ``--repeat`` times on the same processes and the same migration group:

* the executor's data phase (``execute_migration`` into the prepared destinations, the old
  state that stays on a process placed in them first unless ``--no-place``; the old state
  is only read, so it can run again) with its per-rank parts: local copies, packing,
  unpacking, waits on the wire, votes (the commit vote after the data phase apart);
* the plan's raw message pattern (``slurm_etc.migrate.pattern.raw_pattern``: same messages,
  peers, rounds and chunks, warm contiguous buffers, nothing else).

Printed per repeat: the slowest rank's data phase and raw pattern and their ratio; then the
median and each rank's parts in the median run. With ``--profile RANK`` that rank's data
phase also runs under cProfile once (top functions by internal time).

``--diagnose`` takes work out of the data phase to measure what it costs (the new state is
then wrong: a measurement only, never a migration):

* ``no-local``: the local copies are skipped;
* ``scratch``: no local copies, and every operation sends from / receives into one scratch
  buffer per rank instead of the shards (no packing, no unpacking, not the shards' memory):
  the executor's message pattern, votes and steps on the wire alone.

    .venv/bin/python bench/data_phase.py --model small --from dp=1,tp=2,pp=2 \\
        --to dp=2,tp=1,pp=2 [--distributed-optimizer] [--repeat 5] [--profile 0] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from slurm_etc.harness.phases import PRELOAD, Transition, batch_for, w_build
from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import PRESETS
from slurm_etc.pool.local import LocalWorkers

PARTS = ("local_seconds", "pack_seconds", "unpack_seconds", "wait_seconds", "vote_seconds",
         "commit_seconds")


def w_setup(ctx, tr: Transition, tag: str, staging_bytes: int | None = None,
            place: bool = True) -> dict | None:
    """Every participant: migration group, program, destinations, the old state that
    stays placed in them (as prepare_resize)."""
    import torch.distributed as dist

    from slurm_etc.megatron.placement import place_staying_state
    from slurm_etc.megatron.state import local_shards
    from slurm_etc.migrate.executor import (
        MigrationOptions,
        agree,
        allocate_destinations,
        allocate_staging,
    )
    from slurm_etc.migrate.group import connect_migration_group
    from slurm_etc.migrate.program import compile_program

    plan = tr.plan()
    if ctx.index not in plan.participants:
        return None
    options = MigrationOptions(timeout_s=ctx.timeout_s, measure_memory=False,
                               **({"staging_bytes": staging_bytes} if staging_bytes else {}))
    group = connect_migration_group(plan, ctx.index, dist.PrefixStore(tag, ctx.store),
                                    timeout_s=ctx.timeout_s)
    program = compile_program(plan, ctx.index, options.staging_bytes, options.direct_min_bytes)
    program.warm()  # as prepare_resize
    agree(group.transport(), program, ctx.timeout_s)  # as prepare_resize: no gate in the pause
    state = ctx.objects.get("state")
    destinations = allocate_destinations(program, options)
    placed = 0
    if place and state is not None:  # as prepare_resize(state=...)
        placed = place_staying_state(state, plan.catalog, program, destinations).bytes
    ctx.objects["data"] = {
        "group": group, "program": program, "options": options,
        "destinations": destinations,
        "staging": allocate_staging(program, options, group.transport()),
        "old": local_shards(state, plan.catalog) if state is not None else []}
    return {"steps": len(program.steps), "kept": len(program.kept), "placed": placed}


def w_data(ctx, tr: Transition, profile: bool = False) -> dict | None:
    """One data phase on the prepared group and destinations; this rank's stats."""
    from slurm_etc.migrate.executor import execute_migration

    d = ctx.objects.get("data")
    if d is None:
        return None
    plan = tr.plan()
    import torch

    # the ranks start together, as after the pause's step/RNG allgather (and as the raw
    # pattern does): the dispatch's skew is not the data phase's
    transport = d["group"].transport()
    transport.allgather(torch.zeros(8, dtype=torch.uint8), ctx.timeout_s)
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    result = execute_migration(plan, transport, ctx.index, d["old"],
                               options=d["options"], program=d["program"],
                               destinations=d["destinations"], staging=d["staging"],
                               agreed=True)
    out = result.stats.as_dict()
    if prof is not None:
        import io
        import pstats

        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        out["profile"] = text.getvalue()
    return out


def w_diagnose(ctx, mode: str) -> None:
    """Take work out of this worker's data phase (see ``--diagnose``; a measurement only)."""
    import torch

    from slurm_etc.migrate import executor

    executor._Run.local_copies = lambda self: None
    if mode != "scratch":
        return
    scratch: dict[str, torch.Tensor] = {}

    def buffer(kind: str, nbytes: int) -> torch.Tensor:
        if kind not in scratch or scratch[kind].numel() < nbytes:
            scratch[kind] = torch.ones(nbytes, dtype=torch.uint8)
        return scratch[kind]

    def pack(self, side, step, buf):
        c0, c1 = self.prog.chunk(side, step)
        b = buffer("send", c1 - c0)
        return [b[a - c0:e - c0] for a, e, _ in self.prog.ops(side, step)]

    def receive_into(self, side, step, buf):
        c0, c1 = self.prog.chunk(side, step)
        b = buffer("receive", c1 - c0)
        return [(b[a - c0:e - c0], a, e, False) for a, e, _ in self.prog.ops(side, step)]

    executor._Run.pack = pack
    executor._Run.receive_into = receive_into


def w_pattern(ctx, tr: Transition, chunked: bool = False) -> float | None:
    """The plan's raw pattern once on the same migration group (whole messages, or in the
    executor's chunks); this rank's seconds."""
    from slurm_etc.migrate.pattern import raw_pattern

    d = ctx.objects.get("data")
    if d is None:
        return None
    return raw_pattern(tr.plan(), d["group"].transport(), ctx.index,
                       chunk_bytes=d["program"].chunk_bytes if chunked else None,
                       timeout_s=ctx.timeout_s)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=sorted(PRESETS))
    ap.add_argument("--from", dest="old", required=True)
    ap.add_argument("--to", dest="new", required=True)
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", type=int, default=None, metavar="DEVICE")
    ap.add_argument("--staging-mb", type=int, default=None,
                    help="executor staging budget per rank (MiB); default: the executor's")
    ap.add_argument("--no-place", action="store_true",
                    help="leave the old state that stays where it is (the data phase copies "
                         "it locally)")
    ap.add_argument("--diagnose", choices=("no-local", "scratch"), default=None,
                    help="take the local copies (no-local), or also packing, unpacking and "
                         "the shards' memory (scratch), out of the data phase to measure "
                         "what they cost; the new state is then wrong")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        old = ParallelConfig.parse(args.old, args.distributed_optimizer)
        new = ParallelConfig.parse(args.new, args.distributed_optimizer)
        tr = Transition(PRESETS[args.model], old, new)
    except (ConfigError, ValueError) as exc:
        print(f"bad input: {exc}", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print("--repeat must be at least 1", file=sys.stderr)
        return 2
    # the workers import this file by its module name (bench/ is on the path they get)
    from data_phase import w_data as data
    from data_phase import w_diagnose as diagnose
    from data_phase import w_pattern as pattern
    from data_phase import w_setup as setup

    load = [os.getloadavg()[0]]
    tag = f"bench-data-{os.getpid()}-{time.monotonic_ns()}"
    gb = batch_for(tr.old, tr.new)
    runs = []
    with LocalWorkers(tr.processes, preload=PRELOAD) as job:
        job.run(w_build, tr.model, tr.old, tag=f"{tag}/old", seed=1234, steps=1,
                seq=min(tr.model.seq_length, 64), global_batch=gb)
        job.run(setup, tr, f"{tag}/migrate",
                staging_bytes=args.staging_mb << 20 if args.staging_mb else None,
                place=not args.no_place)
        if args.diagnose:
            job.run(diagnose, args.diagnose)
        job.run(data, tr)  # warm-up: first use of the pairs and destinations
        job.run(pattern, tr)
        for _ in range(args.repeat):
            stats = [s for s in job.run(data, tr) if s]
            raw = max(s for s in job.run(pattern, tr) if s is not None)
            chunked = max(s for s in job.run(pattern, tr, chunked=True) if s is not None)
            runs.append({"data": max(s["data_seconds"] for s in stats), "raw": raw,
                         "raw_chunked": chunked, "ranks": stats})
        profile = None
        if args.profile is not None:
            out = job.run(data, tr, profile=True) if args.profile < tr.processes else []
            profile = (out[args.profile] or {}).get("profile")
    load.append(os.getloadavg()[0])
    plan = tr.plan()
    med = sorted(runs, key=lambda r: r["data"])[len(runs) // 2]
    summary = {
        "transition": str(tr), "diagnose": args.diagnose, "moved_bytes": plan.moved_bytes,
        "messages": len(plan.messages),
        "rounds": plan.rounds, "load_1min": load,
        "data_seconds": statistics.median(r["data"] for r in runs),
        "raw_pattern_seconds": statistics.median(r["raw"] for r in runs),
        "raw_pattern_chunked_seconds": statistics.median(r["raw_chunked"] for r in runs),
        "ratios": [r["raw"] / r["data"] for r in runs],
        "median_run_ranks": [{k: r.get(k) for k in ("data_seconds", *PARTS, "sent_bytes",
                                                      "received_bytes", "local_bytes",
                                                      "kept_whole_bytes", "in_place_bytes",
                                                      "direct_bytes",
                                                      "steps")}
                             for r in med["ranks"]],
    }
    summary["data_over_raw_pattern"] = (summary["raw_pattern_seconds"]
                                        / summary["data_seconds"])
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"{summary['transition']}: moved {plan.moved_bytes / 2**20:.1f} MiB in "
              f"{len(plan.messages)} messages, {plan.rounds} rounds; load {load[0]:.1f} -> "
              f"{load[1]:.1f}" + (f"; DIAGNOSE {args.diagnose}: the new state is not "
                                   "built" if args.diagnose else ""))
        for r in runs:
            print(f"  data {r['data']:.4f} s  raw pattern {r['raw']:.4f} s  "
                  f"ratio {r['raw'] / r['data']:.2f}  (raw pattern in the executor's chunks "
                  f"{r['raw_chunked']:.4f} s)")
        print(f"median: data {summary['data_seconds']:.4f} s, raw pattern "
              f"{summary['raw_pattern_seconds']:.4f} s, data_over_raw_pattern "
              f"{summary['data_over_raw_pattern']:.2f}")
        print("median run, per rank: data | local pack unpack wait vote commit | sent recv "
              "local kept in-place direct (MiB)")
        for r in summary["median_run_ranks"]:
            mib = [r[k] / 2**20 for k in ("sent_bytes", "received_bytes", "local_bytes",
                                          "kept_whole_bytes", "in_place_bytes",
                                          "direct_bytes")]
            print(f"  {r['data_seconds']:.4f} | " + " ".join(f"{r[k]:.4f}" for k in PARTS)
                  + " | " + " ".join(f"{x:.1f}" for x in mib))
        if profile:
            print(profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
