"""Peer copies' cost: host memory of the snapshots and step time, refresh every N steps.

Two local processes, each a node of its own (``gpus_per_node=1``), train a preset with the
distributed optimizer (dp=2: each rank holds the only copy of its optimizer shard) through
the real ElasticTrainer, once per setting of ``peer_copy_every`` (off, auto: the default,
chosen by the workers, 4, 1), in the same worker processes, one after the other. Printed
side by side:

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
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slurm_etc.plan import Layout, ParallelConfig, Topology
from slurm_etc.plan.model import PRESETS
from slurm_etc.pool.local import LocalWorkers
from slurm_etc.worker.sequence import PRELOAD

WARMUP = 2  # steps left out of the timing (first-step allocations)
AUTO = -1  # slurm_etc.protocol.recovery.AUTO
REPO = Path(__file__).resolve().parents[1]
_STEP_LINE = re.compile(r"\] step (\d+) loss \S+ lr \S+ consumed \d+ started ([0-9.]+) "
                        r"ended ([0-9.]+)")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from slurm_etc.cli.main import main; main()", *args]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def run_path(every: str, steps: int, warmup: int, model: str, where: Path) -> dict:
    """One `slurm-etc run` job (local backend, two one-device nodes): its median step time
    after ``warmup`` steps and the interval the workers chose."""
    where.mkdir(parents=True, exist_ok=True)
    progress, db = where / "progress.jsonl", where / "job.db"
    worker = [sys.executable, "-m", "slurm_etc.worker.preset_worker", "--model", model,
              "--global-batch", "8", "--train-steps", str(steps), "--distributed-optimizer"]
    job = f"bench-run-{os.getpid()}-{where.name}"
    # the second node granted at step 1: the job grows onto both (dp=2: with the cpu
    # profile the chooser finds it faster; with h100 figures a model this small stays on one)
    events = where / "cluster.json"
    events.write_text(json.dumps({"nodes": 2, "gpus_per_node": 1, "initial_nodes": 1,
                                  "events": [{"at_step": 1, "grant": ["n1"],
                                              "reason": "a second node"}]}))
    done = subprocess.run(
        _cli("run", "--events", str(events), "--hardware", "cpu",
             "--model", model, "--global-batch", "8", "--distributed-optimizer",
             "--job-id", job, "--db", str(db),
             "--state-dir", str(where / "state"), "--progress", str(progress),
             "--peer-copy-every", every, "--", *worker),
        capture_output=True, text=True, timeout=1200, env=_env(), cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"slurm-etc run --peer-copy-every {every} failed: "
                           f"{done.stderr[-1500:]}")
    seen, last = {}, -1
    for line in progress.read_text().splitlines():
        p = json.loads(line)
        seen[p["step"]] = (p["generation"], p["ended"] - p["started"])
        last = max(last, p["generation"])
    first = min(s for s, (g, _t) in seen.items() if g == last)  # the two-node layout's
    times = [t for s, (g, t) in sorted(seen.items()) if g == last and s > first + warmup]
    shown = subprocess.run(_cli("status", job, "--db", str(db), "--json"), capture_output=True,
                           text=True, timeout=300, env=_env(), check=True)
    (detail,) = json.loads(shown.stdout)["jobs"]
    return {"step_s": statistics.median(times), "steps": len(times),
            "chosen": (detail.get("peer_copies") or {}).get("line")}


def demo_path(every: str, steps: int, where: Path) -> dict:
    """One `slurm-etc demo`: the median of every step its workers logged, and the line
    saying the interval chosen (from its record)."""
    done = subprocess.run(_cli("demo", "--steps", str(steps), "--out", str(where),
                               "--peer-copy-every", every),
                          capture_output=True, text=True, timeout=1800, env=_env(), cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"slurm-etc demo --peer-copy-every {every} failed: "
                           f"{done.stderr[-1500:]}")
    times = [float(m.group(3)) - float(m.group(2))
             for log in sorted((where / "workers").glob("gen*.log"))
             for m in _STEP_LINE.finditer(log.read_text())]
    job = re.search(r"slurm-etc status (\S+) --db", done.stdout)
    chosen = None
    if job:
        shown = subprocess.run(_cli("status", job.group(1), "--db", str(where / "demo.db"),
                                    "--json"), capture_output=True, text=True, timeout=300,
                               env=_env(), check=True)
        (detail,) = json.loads(shown.stdout)["jobs"]
        chosen = (detail.get("peer_copies") or {}).get("line")
    return {"step_s": statistics.median(times), "steps": len(times), "chosen": chosen}


def paths(args: argparse.Namespace) -> list[dict]:
    """The user's paths, auto against off, interleaved ``--repeat`` times; the lowest median
    of each (this machine is shared)."""
    rows: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-redundancy-") as tmp:
        for rep in range(args.repeat):
            for path in args.paths:
                if path == "trainer":
                    continue
                for every in ("auto", "0"):
                    where = Path(tmp) / f"{path}-{every}-{rep}"
                    got = (run_path(every, args.run_steps, args.run_warmup, args.model, where)
                           if path == "run" else demo_path(every, args.demo_steps, where))
                    key = (path, every)
                    if key not in rows or got["step_s"] < rows[key]["step_s"]:
                        rows[key] = {"path": path, "every": every, **got}
    out = []
    for path in args.paths:
        if path == "trainer":
            continue
        off = rows[(path, "0")]["step_s"]
        for every in ("0", "auto"):
            r = rows[(path, every)]
            r["step_overhead"] = None if every == "0" else r["step_s"] / off - 1.0
            out.append(r)
    return out


def w_measure(ctx, model_name: str, every: int, steps: int, job: str) -> dict:
    from slurm_etc.megatron.state import local_shards
    from slurm_etc.worker.gpt import preset_trainer
    from slurm_etc.worker.scripted import ScriptedControl
    from slurm_etc.worker.trainer import WorkerProcess

    trainer = preset_trainer(PRESETS[model_name], distributed_optimizer=True, global_batch=8,
                             train_steps=steps)
    trainer.peer_copy_every = every
    chosen: list = []
    marks: list[float] = []
    memory: dict[int, int] = {}
    after = trainer._after_step

    def timed_after_step() -> None:
        after()
        marks.append(time.perf_counter())
        if trainer.peers is not None:
            memory[trainer.step] = trainer.peers.host_bytes()
        if trainer.copy_interval is not None and not chosen:
            chosen.append(trainer.copy_interval.every)

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
    period = chosen[0] if every == AUTO and chosen else every
    refresh = [b for s, b in memory.items() if period > 0 and s % period == 0]
    steady = [b for s, b in memory.items() if period > 0 and s % period != 0]
    if every == AUTO:  # the copies taken to choose count too
        refresh = refresh or list(memory.values())
    return {"state_bytes": state, "step_s": statistics.median(times),
            "peak_bytes": max(refresh, default=0),
            "steady_bytes": max(steady, default=max(refresh, default=0)),
            "chosen_every": period if every == AUTO else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", default="0,auto,4,1",
                   help="settings of peer_copy_every (0: off; auto: the default)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved runs of each setting")
    p.add_argument("--paths", default="trainer",
                   help="trainer (the loop above), run (slurm-etc run), demo (slurm-etc "
                        "demo), comma-separated")
    p.add_argument("--run-steps", type=int, default=60)
    p.add_argument("--run-warmup", type=int, default=10)
    p.add_argument("--demo-steps", type=int, default=40)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    try:
        settings = [AUTO if x.strip() == "auto" else int(x) for x in args.every.split(",")]
    except ValueError:
        print(f"--every {args.every!r}: expected integers or auto separated by commas, e.g. "
              "0,auto,4,1", file=sys.stderr)
        return 2
    args.paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not set(args.paths) <= {"trainer", "run", "demo"}:
        print(f"--paths {','.join(args.paths)}: trainer, run or demo", file=sys.stderr)
        return 2
    if args.steps < WARMUP + 2 or args.repeat < 1 or any(e < AUTO for e in settings):
        print(f"--steps must be >= {WARMUP + 2}, --repeat >= 1 and --every values >= 0",
              file=sys.stderr)
        return 2
    if "trainer" not in args.paths:
        settings = []
    rows_list = trainer_rows(args, settings) if settings else []
    path_rows = paths(args)
    if args.json:
        print(json.dumps({"model": args.model, "steps": args.steps, "repeat": args.repeat,
                          "rows": rows_list, "paths": path_rows}, indent=2))
        return 0
    if rows_list:
        print_trainer_rows(args, rows_list)
    if path_rows:
        print(f"\npeer copies by default (auto) against off, {args.model}, through the user's "
              f"paths (the lowest median step time of {args.repeat} interleaved runs)")
        print(f"{'path':>6} {'copies':>7} {'step ms':>8} {'overhead':>9} {'steps':>6}  chosen")
        for r in path_rows:
            over = "-" if r["step_overhead"] is None else f"{100 * r['step_overhead']:+.1f}%"
            print(f"{r['path']:>6} {('off' if r['every'] == '0' else r['every']):>7} "
                  f"{1e3 * r['step_s']:8.1f} {over:>9} {r['steps']:>6}  {r['chosen'] or '-'}")
    return 0


def trainer_rows(args: argparse.Namespace, settings: list[int]) -> list[dict]:
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
    return rows_list


def print_trainer_rows(args: argparse.Namespace, rows_list: list[dict]) -> None:
    print(f"peer copies, {args.model}, dp=2 dist-opt on 2 one-device nodes, {args.steps} steps "
          f"(median step after {WARMUP}, the lowest of {args.repeat} interleaved runs); "
          "bytes per rank (the larger rank)")
    print(f"{'refresh':>8} {'state MiB':>10} {'peak MiB':>9} {'x state':>8} {'steady MiB':>11} "
          f"{'x state':>8} {'step ms':>8} {'overhead':>9}")
    for r in rows_list:
        label = ("off" if r["every"] == 0 else f"auto={r['chosen_every']}"
                 if r["every"] == AUTO else f"every {r['every']}")
        over = "-" if r["step_overhead"] is None or r["every"] == 0 else \
            f"{100 * r['step_overhead']:+.1f}%"
        print(f"{label:>8} {r['state_bytes'] / 2**20:10.2f} {r['peak_bytes'] / 2**20:9.2f} "
              f"{r['memory_over_state']:8.2f} {r['steady_bytes'] / 2**20:11.2f} "
              f"{r['steady_over_state']:8.2f} {1e3 * r['step_s']:8.1f} {over:>9}")


if __name__ == "__main__":
    sys.exit(main())
