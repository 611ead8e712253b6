"""Peer copies' cost: host memory of the snapshots and step time, refresh every N steps.

Two local processes, each a node of its own (``gpus_per_node=1``), train a preset with the
distributed optimizer (dp=2: each rank holds the only copy of its optimizer shard) through
the real ElasticTrainer, once per setting of ``peer_copy_every`` (off, 4, 1 by default), in
the same worker processes, one after the other. Printed side by side:

* state: bytes of the rank's training state (params, fp32 main params, Adam moments);
* host memory: bytes the rank's snapshots and peer copies hold after a refresh step (peak,
  two snapshots of each while the previous exchange is not known done everywhere) and after
  a step without refresh (steady); and their ratio to the state;
* step time: median wall time of a step (refresh included where due), the lowest over
  ``--repeat`` interleaved runs (this machine is shared), and the overhead against ``off``.

    .venv/bin/python bench/redundancy_overhead.py [--model tiny] [--steps 12] \\
        [--every 0,4,1] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from slurm_etc.plan import Layout, ParallelConfig, Topology
from slurm_etc.plan.model import PRESETS
from slurm_etc.pool.local import LocalWorkers
from slurm_etc.worker.sequence import PRELOAD

WARMUP = 2  # steps left out of the timing (first-step allocations)


def w_measure(ctx, model_name: str, every: int, steps: int, job: str) -> dict:
    from slurm_etc.megatron.state import local_shards
    from slurm_etc.worker.gpt import preset_trainer
    from slurm_etc.worker.scripted import ScriptedControl
    from slurm_etc.worker.trainer import WorkerProcess

    trainer = preset_trainer(PRESETS[model_name], distributed_optimizer=True, global_batch=8,
                             train_steps=steps)
    trainer.peer_copy_every = every
    marks: list[float] = []
    memory: dict[int, int] = {}
    after = trainer._after_step

    def timed_after_step() -> None:
        after()
        marks.append(time.perf_counter())
        if trainer.peers is not None:
            memory[trainer.step] = trainer.peers.host_bytes()

    trainer._after_step = timed_after_step  # type: ignore[method-assign]
    control = ScriptedControl([], ctx.index, clock=lambda: trainer.step)
    proc = WorkerProcess(job, ctx.index, ctx.store, control,
                         layout=Layout(ParallelConfig(2, 1, 1, distributed_optimizer=True),
                                       (0, 1)),
                         topology=Topology(gpus_per_node=1), keep_tp_in_node=False,
                         timeout_s=ctx.timeout_s)
    trainer.run(proc)
    state = sum(sh.tensor.numel() * sh.tensor.element_size()
                for sh in local_shards(trainer.state, trainer.catalog))
    trainer.close()
    times = [b - a for a, b in zip(marks[WARMUP:], marks[WARMUP + 1:])]
    refresh = [b for s, b in memory.items() if every and s % every == 0]
    steady = [b for s, b in memory.items() if every and s % every != 0]
    return {"state_bytes": state, "step_s": statistics.median(times),
            "peak_bytes": max(refresh, default=0),
            "steady_bytes": max(steady, default=max(refresh, default=0))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", default="0,4,1", help="settings of peer_copy_every (0: off)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved runs of each setting")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    try:
        settings = [int(x) for x in args.every.split(",")]
    except ValueError:
        print(f"--every {args.every!r}: expected integers separated by commas, e.g. 0,4,1",
              file=sys.stderr)
        return 2
    if args.steps < WARMUP + 2 or args.repeat < 1 or any(e < 0 for e in settings):
        print(f"--steps must be >= {WARMUP + 2}, --repeat >= 1 and --every values >= 0",
              file=sys.stderr)
        return 2
    # the workers import this file by its module name (bench/ is on the path they get)
    from redundancy_overhead import w_measure as measure

    rows: dict[int, dict] = {}
    with LocalWorkers(2, preload=PRELOAD) as workers:
        for rep in range(args.repeat):  # settings interleaved: load spikes hit them alike
            for every in settings:
                job = f"bench-redundancy-{os.getpid()}-{rep}-{every}"
                out = workers.run(measure, args.model, every, args.steps, job)
                rank = max(out, key=lambda r: r["state_bytes"])
                row = {"every": every, **rank, "step_s": max(r["step_s"] for r in out)}
                if every not in rows or row["step_s"] < rows[every]["step_s"]:
                    rows[every] = row
    rows_list = [rows[e] for e in dict.fromkeys(settings)]
    base = next((r["step_s"] for r in rows_list if r["every"] == 0), None)
    for r in rows_list:
        r["memory_over_state"] = r["peak_bytes"] / r["state_bytes"]
        r["steady_over_state"] = r["steady_bytes"] / r["state_bytes"]
        r["step_overhead"] = (r["step_s"] / base - 1.0) if base else None
    if args.json:
        print(json.dumps({"model": args.model, "steps": args.steps, "repeat": args.repeat,
                          "rows": rows_list}, indent=2))
        return 0
    print(f"peer copies, {args.model}, dp=2 dist-opt on 2 one-device nodes, {args.steps} steps "
          f"(median step after {WARMUP}, the lowest of {args.repeat} interleaved runs); "
          "bytes per rank (the larger rank)")
    print(f"{'refresh':>8} {'state MiB':>10} {'peak MiB':>9} {'x state':>8} {'steady MiB':>11} "
          f"{'x state':>8} {'step ms':>8} {'overhead':>9}")
    for r in rows_list:
        label = "off" if r["every"] == 0 else f"every {r['every']}"
        over = "-" if r["step_overhead"] is None or r["every"] == 0 else \
            f"{100 * r['step_overhead']:+.1f}%"
        print(f"{label:>8} {r['state_bytes'] / 2**20:10.2f} {r['peak_bytes'] / 2**20:9.2f} "
              f"{r['memory_over_state']:8.2f} {r['steady_bytes'] / 2**20:11.2f} "
              f"{r['steady_over_state']:8.2f} {1e3 * r['step_s']:8.1f} {over:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
