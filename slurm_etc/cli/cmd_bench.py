"""`slurm-etc bench migrate`: the in-place resize against megatron's checkpoint path;
`slurm-etc bench control`: the control path at N simulated ranks (slurm_etc/harness/control.py).

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
from .errors import UserError
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


def _ranks_list(text: str) -> list[int]:
    """``256,1024`` as ranks, each a multiple of 8 of at least 16 within the devices bound
    (one line naming the part that is wrong, exit 2)."""
    out = []
    for part in text.split(","):
        part = part.strip().replace("_", "")
        try:
            n = int(part, 10)
        except ValueError:
            raise UserError(f"--ranks: {part!r} is not a number of ranks (e.g. "
                            "--ranks 256,1024)") from None
        problem = bounds.DEVICES.problem(n)
        if problem is not None:
            raise UserError(f"--ranks: {problem}")
        if n < 16 or n % 8:
            raise UserError(f"--ranks: {n} is not a multiple of 8 of at least 16 (N/8 "
                            "simulated nodes of 8 devices)")
        out.append(n)
    return out


@bench.command("control")
@click.option("--ranks", "ranks_spec", required=True, type=Text(bounds.LINE_CHARS),
              help="Simulated ranks, one run each: N[,N...] (multiples of 8).")
@click.option("--step-s", default=0.05, show_default=True,
              type=Number(bounds.SECONDS, low=0.001),
              help="A simulated training step's length (a sleep).")
@click.option("--warm-steps", default=3, show_default=True,
              type=Number(bounds.STEPS, low=1),
              help="Steps trained before the steady window opens (the first ones join).")
@click.option("--steady-steps", default=10, show_default=True,
              type=Number(bounds.STEPS, low=2),
              help="Steps in the steady window (at least --steady-s long).")
@click.option("--steady-s", default=6.0, show_default=True, type=Number(bounds.SECONDS),
              help="The steady window's least length (it holds heartbeats).")
@click.option("--resizes/--no-resizes", default=True, show_default=True,
              help="After the steady window: a grow by an eighth of the nodes, a preemption "
                   "shrink and a node loss.")
@click.option("--ranks-per-host", default=512, show_default=True,
              type=Number(bounds.PROCESSES, low=8),
              help="Simulated ranks (greenlets) per host process.")
@click.option("--timeout-s", default=600.0, show_default=True,
              type=Number(bounds.SECONDS, low=10),
              help="Each run's deadline (the coordinator's).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def control(ranks_spec, step_s, warm_steps, steady_steps, steady_s, resizes, ranks_per_host,
            timeout_s, as_json):
    """The control path at N ranks: the real coordinator, simulated ranks.

    \b
    Real: the coordinator (reconcile loop, policy, vrank allocator, planner), its SQLite
    record, the control channel (CURVE, signed envelopes), the rendezvous store it hosts,
    heartbeats; each simulated rank holds its own channel connection (its store requests
    ride it) and says, through the worker-side classes, what a worker says (Hello,
    ModelBuilt, Progress from rank 0, Ready, Resized, Resumed, Exited), with the trainer's
    exact per-step agreement.
    Simulated: the cluster (N/8 nodes of 8 devices and an eighth more for the grow; its
    grant, preemption notice and node loss come at scripted steps), the ranks' processes
    (greenlets, --ranks-per-host per process, one zmq context each), training (a step is a
    sleep of --step-s) and every collective among ranks (the step's all-reduce, the
    migration's groups and data phase, the new world): skipped, costing nothing. A resize's
    ranks still publish and read the trainer state and take the commit decision through the
    store. Resizes are not prepared beside training.

    \b
    Printed per run: step_control_ms (a rank's median control time per step boundary:
    orders read, agreement, Progress; on this machine's shared cores it includes waiting
    for the CPU other ranks use), coordinator_cpu_s_per_s (the coordinator process's CPU
    seconds per wall second in the steady window), coordinator_messages_per_step (channel
    reports in and messages out, store requests and replies), resize_control_s (each
    resize's critical path as on a cluster: the slowest rank's own part, from its step
    boundary to the migration group's barrier that stands for the rendezvous and data
    phase, then the barrier's end to the commit; resizes.* has both parts and the
    earliest boundary's span), coordinator_rss_mib (its process's peak) and record_bytes
    (the SQLite record). With two sizes or more, a power law fitted to each and
    extrapolated to 131,072 ranks. A size this machine cannot hold (one connection per
    rank at the coordinator, its open-file limit) is refused in one line before anything
    runs."""
    from ..harness.control import (
        ControlBench,
        ControlBenchError,
        descriptor_problem,
        fit_power,
        run_control,
    )

    ranks = _ranks_list(ranks_spec)
    try:
        benches = [ControlBench(n, step_s=step_s, warm_steps=warm_steps,
                                steady_steps=steady_steps,
                                steady_min_s=steady_s, resizes=resizes,
                                ranks_per_host=ranks_per_host, timeout_s=timeout_s)
                   for n in ranks]
    except ControlBenchError as err:
        raise UserError(str(err)) from None
    for b in benches:  # all refused before any runs: a size that cannot run costs nothing
        problem = descriptor_problem(b)
        if problem is not None:
            raise UserError(f"bench control: {problem}")
    show = progress_printer(not as_json)
    level = logging.getLogger().getEffectiveLevel()
    runs: list[dict] = []
    failed = []
    for b in benches:
        show(f"{b.ranks} ranks: starting ({b.hosts} host process(es))")
        try:
            runs.append(run_control(b, log_level=level))
            show(f"{b.ranks} ranks: {runs[-1]['state']} after {runs[-1]['wall_s']:.0f} s")
        except ControlBenchError as err:  # said in the output; the next size still runs
            runs.append({"ranks": b.ranks, "state": "failed", "error": str(err)[:600]})
            failed.append(f"{b.ranks} ranks: {str(err)[:300]}")
            show(failed[-1])
    out: dict = {"runs": runs}
    measured = [r for r in runs if "error" not in r]
    if len(measured) > 1:
        out["fit"] = {key: fit_power(measured, key) for key in (
            "step_control_ms", "coordinator_cpu_s_per_s", "coordinator_messages_per_step",
            "coordinator_rss_mib", "record_bytes")}
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        _render_control(out, Console())
    if failed:
        raise run_failed(RuntimeError(f"bench control: {len(failed)} of {len(runs)} run(s) "
                                      f"failed; {failed[0]}"))


def _render_control(out: dict, console: Console) -> None:
    t = Table(title="bench control: the real coordinator, simulated ranks (step control: "
                    "a rank's median; resizes: order to commit)")
    for col in ("ranks", "step ctl ms", "coord. CPU s/s", "msgs / step", "grow s",
                "shrink s", "loss s", "peak RSS MiB", "record", "job"):
        t.add_column(col, justify="right")
    for r in out["runs"]:
        if "error" in r:
            t.add_row(f"{r['ranks']:,}", *["-"] * 8, "failed")
            continue
        rs = r["resize_control_s"]
        t.add_row(f"{r['ranks']:,}", _fmt(r["step_control_ms"]),
                  _fmt(r["coordinator_cpu_s_per_s"]),
                  f"{r['coordinator_messages_per_step']:,.0f}",
                  *(_fmt(rs.get(k)) for k in ("grow", "shrink", "loss")),
                  _fmt(r["coordinator_rss_mib"], "", 0), human_bytes(r["record_bytes"]),
                  r["state"])
    console.print(t)
    for r in out["runs"]:
        if "error" in r:
            console.print(f"{r['ranks']:,} ranks: {r['error']}")
        for phase, d in r.get("resizes", {}).items():
            if d["outcome"] != "committed":
                console.print(f"{r['ranks']:,} ranks, {phase}: {d['outcome']}"
                              + (f": {d['error']}" if d["error"] else ""))
        for p in r.get("problems", []):
            console.print(f"{r['ranks']:,} ranks: {p}")
    for key, f in out.get("fit", {}).items():
        if f:
            console.print(f"{key} ~ ranks^{f['exponent']} (fitted): at 131,072 ranks "
                          f"{f['at_131072']:,.4g}")
