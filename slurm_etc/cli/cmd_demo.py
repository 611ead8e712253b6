"""`slurm-etc demo`: the README's first command (see slurm_etc/local/demo.py)."""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import click
from rich.live import Live
from rich.logging import RichHandler
from rich.table import Table

from .. import bounds
from ..migrate.faults import KILL_PHASES, KillSpec
from ..plan import load_model
from ..protocol.recovery import AUTO, AUTO_WORD, Recovery
from .params import Number, NumberOrWord, SafePath, Text


def _line(timeline, started: float) -> Table:
    t = Table.grid(padding=(0, 2))
    if timeline.steps:
        s = timeline.steps[-1]
        t.add_row(f"[bold]step {s.step}[/bold]", f"loss {s.loss:.4f}",
                  f"generation {s.generation}", s.layout, f"{time.time() - started:.0f} s")
    else:
        t.add_row("starting workers (cold import of megatron-core) ...",
                  f"{time.time() - started:.0f} s")
    return t


def resizes_table(detail, timeline) -> Table:
    """Each resize: what happened, its data phase beside the pause measured at the step
    boundaries, the preparation the old layout trained through, and the loss either side."""
    from .cmd_status import _seconds, _table, in_flight_text, pause_text

    sizes = {g.number: g.world_size for g in detail.generations}
    reasons = {g.number: g.end_reason or "-" for g in detail.generations}
    losses = {s.step: s.loss for s in timeline.steps}
    t = _table("resizes (seconds; pause: the widest gap between steps over the processes; "
               "in flight: of it, the step a lost node interrupted; stall: the widest gap "
               "before it, while the new world was built)",
               "<gen|>devices|>moved|>data|>pause|>in flight|>stall|>prep|>loss before/after|"
               "~why")
    for m in detail.migrations:
        if m.outcome != "committed":
            continue
        before = [g.last_step for g in detail.generations if g.number == m.from_generation]
        step = before[0] if before and before[0] is not None else None
        around = ("-" if step is None or step not in losses or step + 1 not in losses
                  else f"{losses[step]:.3f}/{losses[step + 1]:.3f}")
        t.add_row(f"{m.from_generation}->{m.to_generation}",
                  f"{sizes.get(m.from_generation, '?')}->{sizes.get(m.to_generation, '?')}",
                  f"{m.moved_bytes / 2**20:.1f} MiB", _seconds(m.data_seconds), pause_text(m),
                  in_flight_text(m), _seconds(m.stall_seconds),
                  _seconds(m.preparation_seconds), around, reasons.get(m.from_generation, "-"))
    return t


@click.command()
@click.option("--db", type=SafePath(dir_okay=False),
              help="Where the job's record goes (default: ./slurm-etc-demo/demo.db).")
@click.option("--out", "out_dir", type=SafePath(file_okay=False, path_type=Path),
              default=Path("slurm-etc-demo"), show_default=True,
              help="Directory for the record, worker logs and the timeline PNG.")
@click.option("--model", "model_spec", default="tiny", show_default=True,
              type=Text(bounds.PATH_CHARS))
@click.option("--steps", type=Number(bounds.STEPS, low=12), default=200, show_default=True,
              help="Steps trained while no resize is in flight: the events come at 1/5, "
                   "2/5, 3/5 and 4/5 of them, training ends at the last. The old layout "
                   "also trains on through each grow's warm-up (a hundred steps or more "
                   "here), which these do not count; the workers train at most "
                   "5 x this in all.")
@click.option("--inject", metavar="WHERE", type=Text(),
              help="Kill a worker (SIGKILL) at this phase of the first resize: "
                   f"{', '.join(KILL_PHASES)} (optionally @VRANK[,GENERATION]). The resize "
                   "aborts (or, after the commit, completes) and is retried without it.")
@click.option("--peer-copy-every", type=NumberOrWord(bounds.STEPS, AUTO_WORD, AUTO),
              default=AUTO_WORD, show_default=True, metavar="auto|N",
              help="Peer copies, as `slurm-etc run --peer-copy-every`: auto (the workers "
                   "choose the interval: about 2% of step time), N steps, 0: off.")
@click.pass_context
def demo(ctx, db, out_dir, model_spec, steps, inject, peer_copy_every):
    """Train a small GPT through a grow, a preemption and a node loss on local processes,
    with the coordinator, its SQLite record and in-place resizes; then show the record."""
    if inject is not None:
        try:
            KillSpec.parse(inject)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--inject") from None
    from ..coordinator.run import run_job
    from ..local.backend import LocalBackend
    from ..local.demo import DEMO_BUDGET, Timeline, demo_script, demo_spec
    from ..store import jobs as record
    from ..store.db import open_store_readonly
    from .cmd_status import output_console

    model = load_model(model_spec)
    db_path = _fresh_record(db, out_dir)
    job_id = f"demo-{os.getpid()}"
    console = output_console(stderr=True)
    root = logging.getLogger("slurm_etc")
    handler = _log_to(root, console)
    timeline = Timeline()
    started = time.time()
    backend = LocalBackend(demo_script(steps, settled_steps=True, parts=5, end=True),
                           log_dir=out_dir / "workers", preload=True)
    try:
        with Live(_line(timeline, started), console=console, refresh_per_second=2) as live:
            def progress(p: dict) -> None:
                timeline.progress(p)
                live.update(_line(timeline, started))

            budget = min(steps * DEMO_BUDGET, int(bounds.STEPS.high))
            spec = demo_spec(job_id, model, budget, inject=inject, data="text")
            spec = replace(spec, recovery=Recovery(peer_copy_every))
            out = run_job(spec, backend, backend.topology,
                          db=str(db_path), state_dir=str(out_dir / "state"),
                          progress=progress)
    finally:
        root.removeHandler(handler)
        root.propagate = True
    store = open_store_readonly(db_path)
    try:
        detail = record.job_detail(store, job_id)
    finally:
        store.close()
    if detail is None:
        raise click.ClickException(f"the demo's record {db_path} has no job {job_id}")
    _show(ctx, job_id, out, detail, timeline, out_dir, db_path, backend.unfired)


def _fresh_record(db: str | None, out_dir: Path) -> Path:
    """The record's path, fresh: a file the user named must not exist; the demo's own
    record and worker logs of its last run are removed."""
    db_path = Path(db) if db else out_dir / "demo.db"
    if db and db_path.exists():
        # never replace a file the user named (it could be their policy database)
        raise click.UsageError(f"--db {db} already exists; the demo writes a fresh record: "
                               "give a new path or remove that file yourself")
    out_dir.mkdir(parents=True, exist_ok=True)
    if db_path.exists():
        db_path.unlink()  # the demo's own record of its last run: each demo is a fresh job
    # and so are its workers' logs (appended to, they would mix the last run's lines in)
    for old_log in (out_dir / "workers").glob("*.log"):
        if old_log.name == "preload.log" or old_log.name.startswith("gen"):
            old_log.unlink()
    return db_path


def _log_to(root: logging.Logger, console) -> logging.Handler:
    """Send the package's log to ``console`` (one plain line a record where it is not a
    terminal), INFO and up, the channel's WARNING and up; returns the handler added."""
    handler: logging.Handler = RichHandler(console=console, show_path=False,
                                           show_level=False)
    if not console.is_terminal:  # a log or CI: one plain line per record
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False
    logging.getLogger("slurm_etc.protocol.channel").setLevel(logging.WARNING)
    return handler


def _show(ctx, job_id: str, out: dict, detail, timeline, out_dir: Path, db_path: Path,
          unfired) -> None:
    """The record's view, the resizes, the timeline PNG and the outcome in a few lines;
    exit 1 where the job did not finish or the demo's events did not all happen."""
    from datetime import UTC, datetime

    from ..local.demo import DEMO_BUDGET, timeline_png
    from .cmd_status import job_view, output_console

    shown = output_console()
    shown.print(job_view(detail, datetime.now(UTC)))
    shown.print(resizes_table(detail, timeline))
    png = out_dir / "timeline.png"
    timeline_png(png, detail, timeline)
    reaction = ", ".join(f"{x * 1000:.0f} ms" for x in out["reaction_s"]) or "-"
    click.echo(f"job {job_id}: {out['state']} at step {out['step']}, generation "
               f"{out['generation']}; reaction to the preemption notice: {reaction}")
    click.echo(f"timeline: {png}   record: {db_path}   worker logs: {out_dir / 'workers'}")
    click.echo(f"see it again: slurm-etc status {job_id} --db {db_path}")
    if unfired:  # the budget ran out first: the run did not show what it says
        click.echo(f"the demo's events did not all happen: training ended at step "
                   f"{out['step']} (the workers' budget, {DEMO_BUDGET} x --steps) before "
                   f"{'; '.join(str(e) for e in unfired)}; the warm-ups took that "
                   f"long: give --steps more", err=True)
    if out["state"] != "finished" or unfired:
        ctx.exit(1)
