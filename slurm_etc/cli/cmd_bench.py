"""`slurm-etc bench migrate`: the in-place resize against megatron's checkpoint path.

Both paths run side by side in one invocation on this machine (local processes, gloo on
127.0.0.1): downtime of each as a wall-clock span (first rank paused to last rank ready),
the checkpoint path's save / stop / cold start / build + load parts, its cold start both
per process core (the ratio's) and all at once, the data phase's throughput against raw
gloo point-to-point measured on the same processes, and each migrating rank's peak memory
against its new state plus the staging budget. See docs/verify.md for what each number
means.
"""
from __future__ import annotations

import json
import logging

import click
from rich.console import Console
from rich.table import Table

from .. import bounds
from .cmd_plan import human_bytes
from .cmd_verify import progress_printer, run_failed, transition_from_options
from .params import Layout, Number, Text

TARGETS = {
    "pause_le_data_plus_150ms": "in-place downtime <= data phase + 0.15 s",
    "ratio_ge_25": "downtime ratio >= 25x",
    "data_ge_80pct_raw_pattern": "data phase >= 80% of the plan's raw message pattern",
    "peak_le_bound_plus_10pct": "peak memory <= new state + staging budget + 10%",
}


def _fmt(x, unit="", digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


# What the resize's phase names stand for; a phase not named here is shown by its key.
PHASE_LABELS = {
    "resume": "step/RNG",
    "migrate": "data phase",
    "train_group": "training group",
    "rebuild": "model/optimizer",
    "install": "install",
    "switch": "switch",
    "group": "migration group",
    "allocate": "destinations allocated and touched",
}


def phase_label(name: str) -> str:
    return PHASE_LABELS.get(name, name.replace("_", " "))


def phases_line(parts: dict) -> str:
    """``step/RNG 0.02s, data phase 0.19s, ...`` in the order the phases ran."""
    return ", ".join(f"{phase_label(k)} {_fmt(v, 's')}" for k, v in parts.items())


def render(s: dict, console: Console) -> None:
    t = Table(title=f"bench migrate {s['model']}: {s['from']} -> {s['to']} "
                    f"({s['processes']} processes, {s['repeat']} repeat(s), medians)")
    t.add_column("", style="bold")
    t.add_column("value", justify="right")
    t.add_column("", justify="left")
    p, e = s["checkpoint_parts"], s["etc_parts"]
    t.add_row("training state", human_bytes(s["state_bytes"]),
              f"moved {human_bytes(s['moved_bytes'])}, kept {human_bytes(s['kept_bytes'])}")
    t.add_row("in-place downtime (etc_seconds)", _fmt(s["etc_seconds"], " s"),
              phases_line(e))
    pre = s["prepare_parts"]
    # no total: a part may hold others (prepare_world holds the world_* parts)
    t.add_row("  prepared before the pause", "", f"{phases_line(pre)} (training continues)")
    t.add_row("checkpoint downtime", _fmt(s["checkpoint_seconds"], " s"),
              f"pause -> ready: save {_fmt(p['save'], 's')}, stop {_fmt(p['stop'], 's')}, "
              f"cold start {_fmt(p['cold_start'], 's')} (per process core), build + load "
              f"{_fmt(p['build_load'], 's')}")
    t.add_row("  cold start, per process core", _fmt(p["cold_start"], " s"),
              "slowest of the fresh processes started one at a time ("
              + ", ".join(_fmt(x, "s") for x in p["cold_start_each"]) + ")")
    t.add_row("  cold start, all at once", _fmt(p["cold_start_all_at_once"], " s"),
              f"{s['processes']} fresh processes started together on "
              f"{_cpus(s)} cores")
    t.add_row("  save", _fmt(p["save"], " s"),
              f"of which extra fsync {_fmt(p['extra_fsync'], 's', 3)}; first save "
              f"{_fmt(p['save_first'], 's')}; {human_bytes(p['checkpoint_bytes'])} on disk")
    t.add_row("ratio", _fmt(s["ratio"], "x", 1),
              "checkpoint / in place, cold start per process core (a node with a core per "
              "process)")
    t.add_row("ratio, cold start all at once", _fmt(s["ratio_all_at_once"], "x", 1),
              f"checkpoint downtime {_fmt(s['checkpoint_seconds_all_at_once'], ' s')}, "
              "measured in one span")
    t.add_row("data phase", _fmt(s["data_seconds"], " s"),
              f"{_fmt(s['achieved_gibps'], ' GiB/s')} moved / data seconds")
    t.add_row("raw gloo p2p (warm buffer)", _fmt(s["raw_p2p_gibps"], " GiB/s"),
              f"data / raw {_fmt(s['data_over_raw_p2p'], '', 2)}")
    t.add_row("raw gloo p2p (fresh memory)", _fmt(s["raw_p2p_fresh_gibps"], " GiB/s"),
              f"data / raw {_fmt(s['data_over_raw_p2p_fresh'], '', 2)}")
    t.add_row("raw plan pattern", _fmt(s["raw_pattern_seconds"], " s"),
              f"raw pattern / data {_fmt(s['data_over_raw_pattern'], '', 2)}")
    t.add_row("peak memory / bound (max rank)", _fmt(s["peak_over_bound_max"], "", 2),
              "bound = new state + staging budget")
    if not s["checkpoint_complete"]:
        t.add_row("checkpoint path", "[yellow]model only[/yellow]",
                  "megatron cannot reshard this distributed optimizer: a lower bound")
    if s["same_state"] is not None:
        t.add_row("both paths give the same state", "yes" if s["same_state"] else "NO", "")
    for key, label in TARGETS.items():
        met = s["targets"][key]
        t.add_row(label, "-" if met is None else ("[green]met[/green]" if met
                                                  else "[red]missed[/red]"), "")
    console.print(t)
    console.print(_load(s))
    ranks = Table(title="per migrating rank (last repeat)")
    for col in ("device", "new rank", "sent", "received", "data s", "GiB/s", "peak growth",
                "bound", "peak/bound"):
        ranks.add_column(col, justify="right")
    for r in s["runs"][-1]["etc"]["per_rank"]:
        ranks.add_row(str(r["device"]), str(r["new_rank"]), human_bytes(r["sent_bytes"]),
                      human_bytes(r["received_bytes"]), _fmt(r["data_seconds"], "", 3),
                      _fmt(r["throughput_gibps"]),
                      human_bytes(r["memory_peak_delta"] or 0), human_bytes(r["memory_bound"]),
                      _fmt(r["peak_over_bound"]))
    console.print(ranks)


def _cpus(s: dict) -> str:
    load = s.get("load_average")
    return str(load["cpus"]) if load else "this machine's"


def _load(s: dict) -> str:
    load = s.get("load_average")
    if not load:
        return "-"
    return (f"load average {' '.join(f'{x:.2f}' for x in load['before'])} before, "
            f"{' '.join(f'{x:.2f}' for x in load['after'])} after, {load['cpus']} cores")


@click.group()
def bench() -> None:
    """Benchmarks on this machine."""


@bench.command("migrate")
@click.option("--model", "model_spec", required=True, type=Text(bounds.PATH_CHARS),
              help="Preset (tiny, small, ...) or a JSON model description file.")
@click.option("--from", "from_spec", required=True, type=Layout(),
              help="Current layout, e.g. dp=1,tp=2,pp=2.")
@click.option("--to", "to_spec", required=True, type=Layout(),
              help="Next layout, e.g. dp=2,tp=1,pp=2.")
@click.option("--distributed-optimizer", is_flag=True, help="ZeRO-1 optimizer over dp.")
@click.option("--param-dtype", type=click.Choice(["fp32", "bf16"]), default=None,
              help="Override the model's parameter dtype (bf16: mixed precision).")
@click.option("--repeat", default=1, show_default=True, type=Number(bounds.REPEAT),
              help="Run both paths this many times; medians are reported.")
@click.option("--steps", default=1, show_default=True, type=Number(bounds.STEPS, low=1),
              help="Adam steps before the resize.")
@click.option("--staging-mb", default=None, type=Number(bounds.MIB),
              help="Executor staging budget per rank (MiB); default: the executor's.")
@click.option("--p2p-mb", default=256, show_default=True, type=Number(bounds.MIB),
              help="Size of the raw point-to-point probe (MiB).")
@click.option("--max-processes", default=8, show_default=True,
              type=Number(bounds.PROCESSES),
              help="Refuse transitions that need more local processes.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def migrate(model_spec, from_spec, to_spec, distributed_optimizer, param_dtype, repeat, steps,
            staging_mb, p2p_mb, max_processes, as_json):
    """Downtime of an in-place resize vs. checkpoint-and-restart, side by side."""
    tr = transition_from_options(model_spec, from_spec, to_spec, distributed_optimizer,
                                 param_dtype, max_processes)
    from ..harness.bench import bench_migrate
    from ..harness.experiments import json_default
    from ..pool.local import WorkerFailed

    level = logging.getLogger().getEffectiveLevel()
    try:
        summary = bench_migrate(tr, repeat=repeat, steps=steps,
                                staging_bytes=staging_mb << 20 if staging_mb else None,
                                p2p_bytes=p2p_mb << 20, progress=progress_printer(),
                                log_level=level)
    except WorkerFailed as exc:
        logging.getLogger(__name__).info("worker failure: %s", exc)
        raise run_failed(exc) from None
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=json_default))
    else:
        render(summary, Console())
