"""Coordinator load: a burst of node events on a simulated cluster, with and without
concurrent ``status`` readers.

A simulated cluster (a backend whose ``poll`` hands over the whole burst at once: grants of
single-node allocations, then preemption notices and losses on some of them) delivers
``--events`` node events to the real coordinator (:class:`~slurm_etc.coordinator.loop.
Coordinator`, its real SQLite record in WAL mode, the real control channel). Timed: from
the burst reaching the coordinator until every event is recorded (``_observe_backend``) and
handled (the decision made and every event marked handled). Counted afterwards with plain
``sqlite3`` (not through the store's code): events recorded, events handled, none lost.

Then the same burst again with ``--readers`` processes each reading the job's record in a
loop as ``slurm-etc status`` does (``job_detail`` on a read-only store), and once more while
one reader holds a read transaction open for the whole burst. Per-transaction writer
latency is printed for each case (WAL: readers never block the writer).

``--busy N`` runs N processes spinning on the CPU for the whole bench (a busy machine: on
2 cores, ``--busy 2`` leaves the coordinator about a third of a core, ``--busy 10`` about a
sixth); ``--repeat R`` runs each case R times and prints the median and the worst.

    .venv/bin/python bench/coordinator_load.py [--events 1000] [--readers 4] [--busy 0]
        [--repeat 1] [--json]
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_etc.alloc.topology import ClusterTopology, Device
from slurm_etc.coordinator import deciding, observe
from slurm_etc.coordinator.backend import (
    BackendDefaults,
    BackendEvent,
    Grant,
    LaunchWorkers,
    Loss,
    PreemptNotice,
    ReleaseDevices,
    RequestNodes,
    StopWorkers,
    WorkerState,
)
from slurm_etc.protocol.channel import CoordinatorChannel, create_secret
from slurm_etc.store import jobs as record

if TYPE_CHECKING:  # the coordinator (torch) is imported by the bench, not by its readers
    from slurm_etc.coordinator.job import JobSpec
    from slurm_etc.coordinator.loop import Coordinator

JOB = "load"


class BurstCluster(BackendDefaults):
    """A simulated cluster of ``nodes`` nodes whose first ``poll`` after :meth:`arm` returns
    the whole burst. Actions are counted, not carried out (nothing to run)."""

    def __init__(self, nodes: int, gpus_per_node: int) -> None:
        self.topology = ClusterTopology(gpus_per_node, tuple(f"n{i}" for i in range(nodes)))
        self.gpus = gpus_per_node
        self.pending: list[BackendEvent] = []
        self.actions: list[Any] = []

    def burst(self, events: int, round_: int) -> list[BackendEvent]:
        """``events`` events: 40 % grants (one node each), then notices and losses on the
        granted nodes (30 % each). Allocation ids are unique per ``round_``."""
        grants = max(1, events * 4 // 10)
        out: list[BackendEvent] = []
        for i in range(grants):
            devs = tuple(Device(f"n{i % len(self.topology.nodes)}", k) for k in range(self.gpus))
            out.append(Grant(f"r{round_}a{i}", devs))
        rest = events - grants
        for j in range(rest):  # each grant gets at most one notice and one loss
            g = out[(j // 2) % grants]
            assert isinstance(g, Grant)
            if j % 2 == 0:
                out.append(PreemptNotice(g.allocation, g.devices, time.time() + 600))
            else:
                out.append(Loss(g.allocation, g.devices, "failure"))
        return out[:events]

    def arm(self, events: list[BackendEvent]) -> None:
        self.pending = list(events)

    # Backend protocol
    def poll(self) -> list[BackendEvent]:
        out, self.pending = self.pending, []
        return out

    def on_step(self, step: int) -> None:
        pass

    def request(self, action: RequestNodes) -> None:
        self.actions.append(action)

    def release(self, action: ReleaseDevices) -> None:
        self.actions.append(action)

    def launch(self, action: LaunchWorkers) -> None:
        self.actions.append(action)

    def stop(self, action: StopWorkers) -> None:
        self.actions.append(action)

    def workers(self) -> dict[int, WorkerState]:
        return {}

    def close(self) -> None:
        pass


def reader(db: str, stop: Any, holding: bool, counts: Any, index: int,
           interval: float) -> None:
    """A ``status`` reader: the job's detail over a read-only store, in a loop; or (holding)
    one plain sqlite3 read transaction kept open until told to stop."""
    if holding:
        con = sqlite3.connect(db, isolation_level=None)
        con.execute("BEGIN")
        con.execute("SELECT count(*) FROM events").fetchone()
        counts[index] = 1
        stop.wait()
        con.execute("COMMIT")
        con.close()
        return
    from slurm_etc.store.db import open_store_readonly
    store = open_store_readonly(db)
    n = 0
    while not stop.wait(interval):
        record.job_detail(store, JOB)
        n += 1
        counts[index] = n
    store.close()


def spin(stop: Any) -> None:
    """Background load: burn CPU until told to stop."""
    while not stop.is_set():
        for _ in range(100_000):
            pass


def sqlite_counts(db: str) -> tuple[int, int]:
    """(events recorded, events handled) read with plain sqlite3."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        total, handled = con.execute(
            "SELECT count(*), count(handled_at) FROM events WHERE job_id = ?", (JOB,)
        ).fetchone()
        return int(total), int(handled)
    finally:
        con.close()


def run_round(coordinator: Coordinator, cluster: BurstCluster, events: int,
              round_: int, db: str) -> dict[str, Any]:
    before, _ = sqlite_counts(db)
    burst = cluster.burst(events, round_)
    cluster.arm(burst)
    latencies: list[float] = []
    store = coordinator.io.store
    original = store.transaction

    def timed(*args: Any, **kwargs: Any) -> Any:
        cm = original(*args, **kwargs)
        if not kwargs.get("write"):
            return cm
        return _Timed(cm, latencies)

    store.transaction = timed  # type: ignore[method-assign]
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        observe.observe_backend(coordinator)
        t_recorded = time.perf_counter() - t0
        deciding.decide_now(coordinator)
        t_handled = time.perf_counter() - t0
        cpu = time.process_time() - c0
    finally:
        store.transaction = original  # type: ignore[method-assign]
    after, handled = sqlite_counts(db)
    latencies.sort()
    return {"events": len(burst), "recorded": after - before, "handled_total": handled,
            "recorded_s": t_recorded, "handled_s": t_handled, "cpu_s": cpu,
            "write_tx": len(latencies),
            "write_median_ms": 1e3 * statistics.median(latencies),
            "write_p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))],
            "write_max_ms": 1e3 * latencies[-1]}


class _Timed:
    def __init__(self, cm: Any, out: list[float]) -> None:
        self.cm, self.out = cm, out

    def __enter__(self) -> Any:
        self.t0 = time.perf_counter()
        return self.cm.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.cm.__exit__(*exc)
        finally:
            self.out.append(time.perf_counter() - self.t0)


def one_round(events: int, round_: int, readers: int, holding: bool, cluster: BurstCluster,
              spec: JobSpec, tmp: str, ctx: Any, interval: float) -> dict[str, Any]:
    """One burst into a fresh coordinator and record, with ``readers`` reading meanwhile."""
    db = f"{tmp}/job.db"
    store = record.open_job_store(JOB, db=db, state_dir=f"{tmp}/state")
    record.create_job(store, JOB, name="load", owner_uid=0, owner_name="bench",
                      backend="local")
    channel = CoordinatorChannel(JOB, create_secret(JOB, Path(tmp) / "secrets"), "127.0.0.1")
    from slurm_etc.coordinator.loop import Coordinator

    coordinator = Coordinator(spec, cluster, store, channel, cluster.topology)
    stop = ctx.Event()
    counts = ctx.Array("l", max(readers, 1))
    procs = [ctx.Process(target=reader, args=(db, stop, holding, counts, i,
                                                        interval))
             for i in range(readers)]
    try:
        for proc in procs:
            proc.start()
        t_wait = time.monotonic() + 60
        while readers and min(counts[:readers]) == 0 and time.monotonic() < t_wait:
            time.sleep(0.05)  # readers are reading (or holding) before the burst
        out = run_round(coordinator, cluster, events, round_, db)
    finally:
        stop.set()
        for proc in procs:
            proc.join(30)
        channel.close()
        store.close()
    out["reads"] = sum(counts[:readers]) if not holding else 0
    return out


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run of a case (by handled time), with the median and worst times."""
    ordered = sorted(runs, key=lambda r: r["handled_s"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    for key in ("recorded_s", "handled_s", "cpu_s"):
        values = [r[key] for r in runs]
        out[f"{key}_median"] = statistics.median(values)
        out[f"{key}_worst"] = max(values)
    out["runs"] = len(runs)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--events", type=int, default=1000)
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--read-interval", type=float, default=0.01,
                   help="seconds between one status reader's reads (0: back to back)")
    p.add_argument("--busy", type=int, default=0,
                   help="processes spinning on the CPU meanwhile (a busy machine)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each case (median and worst printed)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.events < 1 or args.readers < 0 or args.nodes < 1 or args.gpus_per_node < 1 \
            or args.busy < 0 or args.repeat < 1:
        p.error("--events, --nodes, --gpus-per-node and --repeat must be >= 1, "
                "--readers and --busy >= 0")
    logging.basicConfig(level=logging.ERROR)
    from slurm_etc.alloc.chooser import Hardware, TrainingJob
    from slurm_etc.coordinator.job import JobSpec
    from slurm_etc.plan import load_model
    from slurm_etc.policy.rules import EffectivePolicy

    cluster = BurstCluster(args.nodes, args.gpus_per_node)
    spec = JobSpec(JOB, "bench", (sys.executable, "-c", "pass"),
                   TrainingJob(load_model("llama-7b"), 512, 1, True),
                   EffectivePolicy(grow=False), Hardware(gpus_per_node=args.gpus_per_node))
    results: dict[str, Any] = {}
    ctx = mp.get_context("spawn")
    stop_busy = ctx.Event()
    busy = [ctx.Process(target=spin, args=(stop_busy,), daemon=True) for _ in range(args.busy)]
    for proc in busy:
        proc.start()
    cases = [("no readers", 0, False), (f"{args.readers} status readers", args.readers, False),
             ("a reader holding a read transaction", 1, True)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in cases}
    try:
        for rep in range(args.repeat):
            for i, (name, readers, holding) in enumerate(cases):
                with tempfile.TemporaryDirectory(prefix="etc-load-") as tmp:
                    runs[name].append(one_round(args.events, rep * len(cases) + i, readers,
                                                holding, cluster, spec, tmp, ctx,
                                                args.read_interval))
        load = os.getloadavg()
    finally:
        stop_busy.set()
        for proc in busy:
            proc.join(10)
    for name, rs in runs.items():
        results[name] = summary(rs)
    ok = all(r["recorded"] == r["events"] for rs in runs.values() for r in rs)
    if args.json:
        print(json.dumps({"ok": ok, "rounds": results, "loadavg": load, "busy": args.busy}))
    else:
        for name, r in results.items():
            print(f"{name:>36}: {r['events']} events recorded in {r['recorded_s']:.3f} s, "
                  f"handled in {r['handled_s']:.3f} s (CPU {r['cpu_s']:.3f} s); "
                  f"{r['recorded']} rows "
                  f"(lost {r['events'] - r['recorded']}); {r['write_tx']} write "
                  f"transactions: median {r['write_median_ms']:.2f} ms, p99 "
                  f"{r['write_p99_ms']:.2f} ms, max {r['write_max_ms']:.2f} ms"
                  + (f"; {r['reads']} status reads in the round (from before the burst "
                     "to after it)" if r["reads"] else ""))
        if args.repeat > 1:
            for name, r in results.items():
                print(f"{name:>36}: over {args.repeat} runs: recorded median "
                      f"{r['recorded_s_median']:.3f} s (worst {r['recorded_s_worst']:.3f}), "
                      f"handled median {r['handled_s_median']:.3f} s (worst "
                      f"{r['handled_s_worst']:.3f}), CPU median {r['cpu_s_median']:.3f} s")
        print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores"
              f" ({args.busy} busy processes of the bench's own)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
