"""`slurm-etc soak`: a seeded schedule of resizes under faults run against one real job, then
checked against megatron-core's checkpoint-restart (slurm_etc/harness/soak.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from .. import bounds
from .params import Number, SafePath


@click.command("soak")
@click.option("--seed", envvar="SLURM_ETC_SOAK_SEED", type=Number(bounds.SEED), default=0,
              show_default=True, help="The schedule's seed: the same seed, the same schedule.")
@click.option("--events", envvar="SLURM_ETC_SOAK_EVENTS", type=Number(bounds.SOAK_EVENTS),
              default=12, show_default=True,
              help="How many events the schedule has (each a few seconds to a minute of a "
                   "real job on this machine).")
@click.option("--work-dir", envvar="SLURM_ETC_SOAK_WORK_DIR",
              type=SafePath(file_okay=False, path_type=Path),
              help="Where the soak's files go (record, logs, schedule). Default: a temporary "
                   "directory, removed when the soak passes.")
@click.option("--keep", envvar="SLURM_ETC_SOAK_KEEP", is_flag=True,
              help="Keep the files of a soak that passed.")
@click.option("--no-oracle", "no_oracle", envvar="SLURM_ETC_SOAK_NO_ORACLE", is_flag=True,
              help="Skip the checkpoint-restart replay (losses unchecked: faster).")
@click.option("--json", "as_json", envvar="SLURM_ETC_SOAK_JSON", is_flag=True,
              help="The report as JSON on stdout.")
def soak(seed: int, events: int, work_dir: Path | None, keep: bool, no_oracle: bool,
         as_json: bool) -> None:
    """Run a seeded schedule of EVENTS events (grants, preemption notices of 0 s to
    minutes, node losses, workers killed in each resize phase and in steady training,
    coordinator SIGKILLs and restarts, a duplicate coordinator, a full-disk window) against
    one job of the tiny preset on the local backend (`slurm-etc run`, real workers), then
    check: every step in the final history once, every loss bit-equal to megatron-core's
    checkpoint-restart through the recorded layouts, no process of the job left, the record
    consistent. Exit 0 when every check passes, 1 when one fails.

    \b
    slurm-etc soak --seed 1 --events 40 --json
    """
    from ..harness.soak import run_soak

    err = Console(stderr=True)

    def say(msg: str) -> None:  # diagnostics: on stderr, with --json too
        err.print(f"[dim]soak:[/dim] {msg}", highlight=False, soft_wrap=True)

    report = run_soak(seed, events, work_dir=work_dir, keep=keep, say=say,
                      oracle=not no_oracle)
    if as_json:
        click.echo(json.dumps(report))
    else:
        render(report, Console())
    sys.exit(0 if report["ok"] else 1)


def render(r: dict, console: Console) -> None:
    t = Table(title=f"soak seed {r['seed']}: {r['events']} events, {r['steps']} steps, "
                    f"{r['seconds']:.0f} s")
    for col in ("#", "kind", "what", "outcome", "step"):
        t.add_column(col, justify="right" if col in ("#", "step") else "left")
    for e in r["schedule"]:
        what = {"preempt": f"grace {e.get('grace_s', 0):g} s",
                "phase-kill": f"{e.get('phase')} of gen {e.get('generation')}",
                "coordinator-kill": f"restart after {e.get('delay_s', 0):g} s",
                "full-disk": f"{e.get('steps')} steps"}.get(e["kind"], "")
        t.add_row(str(e["index"]), e["kind"], what, e["outcome"],
                  "" if e["step"] is None else str(e["step"]))
    console.print(t)
    s = Table(title="checks")
    s.add_column("check")
    s.add_column("result", justify="right")
    s.add_column("", justify="left")
    div = r["diverged_steps"]
    rows = [
        ("steps trained twice unrecorded", len(r["steps_twice"]), r["steps_twice"][:10]),
        ("steps missing", len(r["steps_missing"]), r["steps_missing"][:10]),
        ("diverged steps (vs checkpoint-restart)", "not run" if div is None else div,
         r["diverged"][:10]),
        ("leaked processes", r["leaked_processes"], r["leaked_pids"][:10]),
        ("record consistent", "yes" if r["record_consistent"] else "NO",
         r["record_problems"][:3]),
    ]
    for name, value, detail in rows:
        s.add_row(name, str(value), ", ".join(map(str, detail)) if detail else "")
    console.print(s)
    console.print(f"resizes committed {r['resizes_committed']}, aborted "
                  f"{r['resizes_aborted']}; steps rebuilt and trained again "
                  f"{r['steps_rebuilt']}; coordinator starts {r['coordinator_starts']}; "
                  f"phase kills hit {r['phase_kills_hit']}; duplicates refused "
                  f"{r['duplicates_refused']}; steps unheard {r['unheard_steps']}")
    for p in r["problems"]:
        console.print(f"[red]problem:[/red] {p}", highlight=False)
    for n in r["notes"]:
        console.print(f"note: {n}", highlight=False)
    if r["work_dir"]:
        console.print(f"files: {r['work_dir']}", highlight=False)
    console.print("result: " + ("[green]OK[/green]" if r["ok"] else "[red]FAILED[/red]"))
