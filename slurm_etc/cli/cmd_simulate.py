"""`slurm-etc simulate`: replay a trace with the compact allocator and a naive one."""
from __future__ import annotations

import json
import time
from pathlib import Path

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
def simulate_cmd(trace_path: str | None, synthetic: bool, nodes: int, gpus_per_node: int,
                 jobs: int, hours: float, rigid_load: float, seed: int,
                 save_trace: str | None, plot_path: str | None, as_json: bool) -> None:
    """Replay grants, preemptions and failures on a simulated cluster, with slurm-etc's
    compact allocator and with a naive one (first-fit ranks, no compaction, identity
    placement), and compare occupancy, fragmentation, resizes and bytes migrated."""
    if bool(trace_path) == synthetic:
        raise UserError("give exactly one of --trace FILE or --synthetic")
    if trace_path:
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
    if plot_path:
        plot(compact, naive, plot_path, source)
        result["plot"] = plot_path
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
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


def _headline(r: dict) -> str:
    def pct(x):
        return "n/a" if x is None else f"{x:.0%}"
    return (f"occupancy {r['occupancy_gain_pp']:+.1f} points; partially used nodes "
            f"{pct(r['partial_nodes_ratio'])} and idle devices held "
            f"{pct(r['idle_held_ratio'])} of naive's; bytes migrated "
            f"{pct(r['moved_bytes_ratio'])} of naive's")
