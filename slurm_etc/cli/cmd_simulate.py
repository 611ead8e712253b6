"""`slurm-etc simulate`: replay a trace with the compact allocator and a naive one."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from .. import bounds
from ..sim import TraceError, load_trace, simulate, synthetic_trace
from ..sim.report import comparison, plot, rows
from ..sim.synthetic import check_size
from .errors import UserError
from .params import Number, SafePath


@click.command("simulate")
@click.option("--trace", "trace_path", type=SafePath(dir_okay=False),
              help="Replay this trace file (format: docs/allocator.md).")
@click.option("--synthetic", is_flag=True, help="Generate a synthetic trace instead.")
@click.option("--sacct", "sacct_path", type=SafePath(dir_okay=False, allow_dash=True),
              help="Replay your site's history: `sacct -a -X -P --format=JobID,State,Submit,"
                   "Start,End,NNodes,AllocTRES` output ('-': stdin); what happened, and the "
                   "same GPU jobs with --jobs elastic jobs beside them (docs/simulate-history.md). "
                   "--nodes/--gpus-per-node: the cluster (default: the history's peak).")
@click.option("--nodes", default=256, show_default=True, type=Number(bounds.NODES, low=2),
              help="Synthetic: cluster nodes.")
@click.option("--gpus-per-node", default=8, show_default=True,
              type=Number(bounds.GPUS_PER_NODE),
              help="Synthetic: devices per node.")
@click.option("--jobs", default=6, show_default=True, type=Number(bounds.SIM_JOBS),
              help="Synthetic: elastic jobs.")
@click.option("--hours", default=24.0, show_default=True, type=Number(bounds.HOURS),
              help="Synthetic: simulated hours.")
@click.option("--rigid-load", default=0.85, show_default=True,
              type=Number(bounds.LOAD),
              help="Synthetic: rigid jobs' offered load, as a fraction of the cluster.")
@click.option("--seed", default=0, show_default=True, type=Number(bounds.SEED),
              help="Synthetic: seed.")
@click.option("--save-trace", type=SafePath(dir_okay=False),
              help="Write the (synthetic) trace replayed to this file.")
@click.option("--plot", "plot_path", type=SafePath(dir_okay=False),
              help="Write a PNG of occupancy and fragmentation over time.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def simulate_cmd(ctx: click.Context, trace_path: str | None, synthetic: bool,
                 sacct_path: str | None, nodes: int, gpus_per_node: int,
                 jobs: int, hours: float, rigid_load: float, seed: int,
                 save_trace: str | None, plot_path: str | None, as_json: bool) -> None:
    """Replay grants, preemptions and failures on a simulated cluster, with slurm-etc's
    compact allocator and with a naive one (first-fit ranks, no compaction, identity
    placement), and compare occupancy, fragmentation, resizes and bytes migrated."""
    if sum((bool(trace_path), synthetic, bool(sacct_path))) != 1:
        raise UserError("give exactly one of --trace FILE, --synthetic or --sacct FILE")
    happened = None
    if sacct_path:
        given = ctx.get_parameter_source("nodes") is not click.core.ParameterSource.DEFAULT
        trace, happened, source = _history(sacct_path, nodes if given else None,
                                           gpus_per_node, jobs, seed)
    elif trace_path:
        try:
            trace = load_trace(trace_path)
        except TraceError as exc:
            raise UserError(str(exc)) from None
        source = f"trace {trace_path}"
    else:
        try:  # the expected events (nodes x GPUs x hours, jobs x hours) before any is drawn
            check_size(nodes, gpus_per_node, jobs, hours, rigid_load)
        except bounds.BoundError as exc:
            raise UserError(str(exc)) from None
        trace = synthetic_trace(nodes=nodes, gpus_per_node=gpus_per_node, jobs=jobs,
                                hours=hours, seed=seed, rigid_load=rigid_load)
        source = (f"synthetic: {nodes} nodes x {gpus_per_node} GPUs, {jobs} elastic jobs, "
                  f"{hours:g} h, rigid load {rigid_load:g}, seed {seed}")
    if save_trace:
        Path(save_trace).write_text(json.dumps(trace.to_json(), indent=1) + "\n")
    start = time.perf_counter()
    compact = simulate(trace, "compact")
    naive = simulate(trace, "naive")
    elapsed = time.perf_counter() - start
    result = {"source": source, "events": len(trace.events), "sim_seconds": elapsed,
              **comparison(compact, naive)}
    if happened is not None:
        result = {**happened, **result, "elastic_gpu_hours": _elastic_gpu_hours(compact)}
    if plot_path:
        plot(compact, naive, plot_path, source)
        result["plot"] = plot_path
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    if happened is not None:
        Console().print(_happened_table(result))
    table = Table(title=f"{source}: {len(trace.events)} events")
    table.add_column("", style="bold")
    table.add_column("slurm-etc (compact)", justify="right")
    table.add_column("naive (first-fit)", justify="right")
    for label, a, b in rows(result):
        table.add_row(label, a, b)
    console = Console()
    console.print(table)
    console.print(_headline(result))
    click.echo(f"simulated both allocators in {elapsed:.1f} s"
               + (f"; plot written to {plot_path}" if plot_path else ""), err=True)


def _history(path: str, nodes: int | None, gpus_per_node: int, jobs: int, seed: int
             ) -> tuple[Any, dict, str]:
    """The history's trace, what happened, and the source line."""
    import math
    import sys

    from ..sim.history import (
        HistoryError,
        history_trace,
        peak_gpus,
        read_history,
        what_happened,
    )
    from ..sim.trace import ClusterSpec

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read it ({getattr(err, 'strerror', None) or err})"
                        ) from None
    try:
        history = read_history(text, "stdin" if path == "-" else path)
    except HistoryError as err:
        raise UserError(str(err)) from None
    if not history.gpu_jobs:
        raise UserError(f"{path}: no GPU job ran in it ({history.cpu_jobs} CPU jobs, "
                        f"{history.never_ran} that never ran): nothing to replay")
    peak = peak_gpus(history)
    if nodes is None:
        nodes = max(2, math.ceil(peak / gpus_per_node))
    cluster = ClusterSpec(nodes, gpus_per_node)
    try:
        bounds.check_product("the history's cluster", {"nodes": nodes,
                                                       "gpus_per_node": gpus_per_node},
                             bounds.DEVICES)
        bounds.SIM_SECONDS.check("the history's span", max(j.end for j in history.gpu_jobs))
    except bounds.BoundError as exc:
        raise UserError(str(exc)) from None
    happened = what_happened(history, nodes * gpus_per_node)
    source = (f"history {path}: {happened['jobs']} GPU jobs over {happened['hours']:.1f} h on "
              f"{nodes} nodes x {gpus_per_node} GPUs (peak {peak} GPUs held), {jobs} elastic "
              "jobs beside them")
    return history_trace(history, cluster, jobs, seed), happened, source


def _elastic_gpu_hours(result: Any) -> float:
    """GPU-hours the elastic jobs held in a simulation (its time series of held devices)."""
    return float(result.summary.get("elastic_gpu_hours", 0.0))


def _happened_table(r: dict) -> Table:
    def hours(x: float) -> str:  # a short history's GPU-hours still show
        return f"{x:,.1f}" if x >= 10 else f"{x:.3f}"

    t = Table(title="what happened (the history as sacct gave it)")
    t.add_column("", style="bold")
    t.add_column("", justify="right")
    for label, value in (
            ("GPU jobs that ran", f"{r['jobs']:,}"),
            ("CPU jobs, steps skipped, never ran",
             f"{r['cpu_jobs']:,}, {r['steps_skipped']:,}, {r['never_ran']:,}"),
            ("GPU-hours used / idle",
             f"{hours(r['gpu_hours_used'])} / {hours(r['gpu_hours_idle'])}"),
            ("GPU utilization", f"{r['utilization']:.0%}"),
            ("preempted jobs (their GPU-hours)",
             f"{r['preempted_jobs']:,} ({hours(r['preempted_gpu_hours'])})"),
            ("queue wait median / p90", f"{r['queue_wait_median_s'] / 60:,.1f} / "
                                        f"{r['queue_wait_p90_s'] / 60:,.1f} min"),
            ("replayed: elastic jobs' GPU-hours (slurm-etc's allocator)",
             hours(r['elastic_gpu_hours']))):
        t.add_row(label, value)
    return t


def _headline(r: dict) -> str:
    def pct(x):
        return "n/a" if x is None else f"{x:.0%}"
    return (f"occupancy {r['occupancy_gain_pp']:+.1f} points; partially used nodes "
            f"{pct(r['partial_nodes_ratio'])} and idle devices held "
            f"{pct(r['idle_held_ratio'])} of naive's; bytes migrated "
            f"{pct(r['moved_bytes_ratio'])} of naive's")
