"""`slurm-etc status [JOBID]`: elastic jobs, their layouts, generations and migrations.

Without ``--db`` it reads every job snapshot in the state directory (what coordinators
publish from compute nodes after each change); with ``--db`` a SQLite file or a server URL.
A user sees the jobs of their real uid (``os.getuid()``, never $USER); root and Slurm
Operators/Administrators see all. Tests inject ``ctx.obj["uid"]`` and
``ctx.obj["sees_all_jobs"]`` (a callable of the uid), ``ctx.obj["now"]`` and
``ctx.obj["watch_frames"]`` (how many redraws ``--watch`` makes before returning).
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import click
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .. import bounds
from ..store import (
    JobDetail,
    StoreError,
    default_state_dir,
    guard,
    job_detail,
    list_jobs,
    open_store_readonly,
)
from ..store.db import display, redact, sqlite_path, with_password_file
from ..store.guard import ReadLimits, sqlite_heap_limit
from ..store.location import (
    LocationError,
    OpenedFile,
    on_network_fs,
    open_owned,
    open_private_dir,
)
from .errors import UserError
from .params import Number, SafePath
from .params import Text as TextType

SACCTMGR_TIMEOUT_S = 5
SACCTMGR_DIRS = ("/usr/bin", "/usr/local/bin", "/opt/slurm/bin", "/usr/sbin")
ADMIN_LEVELS = ("operator", "administrator")
DEFAULT_WATCH_S = 2.0
# Where output is not a terminal (a log, a pipe, CI) rich would lay tables out in 80
# columns and wrap every row; this many instead (COLUMNS, when set, still wins).
PLAIN_WIDTH = 240


def output_console(*, stderr: bool = False) -> Console:
    """A console for tables: the terminal's width on a terminal, else ``PLAIN_WIDTH``
    columns (one row a line in a log) unless COLUMNS says otherwise."""
    console = Console(stderr=stderr)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(stderr=stderr, width=PLAIN_WIDTH)
    return console


# ---------------------------------------------------------------- who sees what


def slurm_operator(uid: int) -> bool:
    """root, or Slurm's accounting says this uid's user is an Operator or Administrator.

    The user name comes from the password database for the real uid; ``sacctmgr`` is taken
    from the system directories only. Any failure (no sacctmgr, no slurmdbd, a timeout)
    answers no: the user then sees their own jobs.
    """
    if uid == 0:
        return True
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        return False
    sacctmgr = shutil.which("sacctmgr", path=os.pathsep.join(SACCTMGR_DIRS))
    if not sacctmgr:
        return False
    try:
        done = subprocess.run([sacctmgr, "-nP", "show", "user", user,
                               "format=user,adminlevel"], capture_output=True, text=True,
                              timeout=SACCTMGR_TIMEOUT_S, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and parse_adminlevel(done.stdout, user)


def parse_adminlevel(output: str, user: str) -> bool:
    """Whether ``sacctmgr -nP show user U format=user,adminlevel`` names ``user`` as an
    Operator or Administrator (a line for another user counts for nothing)."""
    for line in output.splitlines():
        name, _, level = line.strip().partition("|")
        if name == user and level.strip().lower() in ADMIN_LEVELS:
            return True
    return False


@dataclass
class Viewer:
    """The real uid asking, and whether it may see other users' jobs (asked only once, and
    only when another user's job is there to hide)."""

    uid: int
    check: Callable[[int], bool]
    _all: bool | None = field(default=None, init=False)

    def sees(self, owner_uid: int) -> bool:
        if owner_uid == self.uid:
            return True
        if self._all is None:
            self._all = bool(self.check(self.uid))
        return self._all

    def may_open(self, file_owner: int) -> bool:
        """Whether a file of ``file_owner`` is read at all (the viewer's own; all for root
        and operators): nothing of another user's file is read before this says yes."""
        return self.sees(file_owner)


# ---------------------------------------------------------------- reading


@dataclass
class Found:
    jobs: list[JobDetail]
    where: str
    warnings: list[str]


def _details(store_target: str | Path, viewer: Viewer, job_id: str | None,
             immutable: bool, file_owner: int | None, limits: ReadLimits | None,
             name: str | None = None) -> list[JobDetail]:
    store = open_store_readonly(store_target, immutable=immutable, limits=limits, name=name)
    try:
        out = []
        # A snapshot speaks only for the user who wrote it (owner of the descriptor read):
        # a file of uid A claiming a job of uid B is nobody's, root's included.
        for job in list_jobs(store, owner_uid=file_owner):
            if job_id is not None and job.job_id != job_id:
                continue
            if not viewer.sees(job.owner_uid):
                continue
            detail = job_detail(store, job.job_id)
            if detail is not None:
                out.append(detail)
        return out
    finally:
        store.close()


def gather(db: str | None, state_dir: Path, viewer: Viewer, job_id: str | None,
           limits: ReadLimits | None = None) -> Found:
    """The jobs this viewer may see, from ``db`` or from the snapshots in ``state_dir``.

    Snapshots are read from ``<state dir>/<uid>/`` directories: the viewer's own, and
    (root, Slurm operators) every other one it can open. Each file is opened without
    following symlinks; its owner is that of the descriptor (``fstat``), and a file of
    another user is closed unread unless the viewer sees all jobs. The bytes read through
    that descriptor are copied into a private file, whose schema is checked before any
    query, and read under a deadline and SQLite's heap limit: one bad file is one warning
    line and is skipped.

    Raises:
        UserError: ``db`` cannot be read or is not ours.
    """
    limits = limits or ReadLimits()
    if db:
        shown = display(db)
        target: str | Path = db
        immutable = False
        sqlite = sqlite_path(db)
        if sqlite is not None:
            target = sqlite
            immutable = sqlite.is_file() and on_network_fs(sqlite)
        try:
            with sqlite_heap_limit(limits.heap_bytes):
                jobs = _details(target, viewer, job_id, immutable, None,
                                limits if sqlite is not None else None, shown)
        except StoreError as exc:
            raise UserError(redact(str(exc), db)) from None
        except MemoryError:
            raise UserError(f"{shown}: "
                            f"{guard.interrupted_reason('out of memory', limits)}") from None
        return Found(jobs, shown, [])
    warnings: list[str] = []
    newest: dict[str, JobDetail] = {}
    with tempfile.TemporaryDirectory(prefix="slurm-etc-status-") as scratch, \
            sqlite_heap_limit(limits.heap_bytes):
        copy = Path(scratch) / "snapshot.db"
        for label, opened in _snapshots(state_dir, viewer, limits, warnings):
            try:
                try:
                    with open(copy, "wb") as out:
                        opened.read_into(out, limits.max_bytes)
                finally:
                    opened.close()
                found = _details(copy, viewer, job_id, True, opened.owner, limits, label)
            except (StoreError, LocationError, OSError) as exc:
                warnings.append(f"skipped {label}: {guard.interrupted_reason(str(exc), limits)}")
                continue
            except MemoryError:  # SQLite past its heap limit (Python's sqlite3 says so)
                warnings.append(f"skipped {label}: "
                                f"{guard.interrupted_reason('out of memory', limits)}")
                continue
            finally:
                copy.unlink(missing_ok=True)
            for detail in found:
                seen = newest.get(detail.job.job_id)
                if seen is None or detail.job.updated_at > seen.job.updated_at:
                    newest[detail.job.job_id] = detail
    jobs = sorted(newest.values(), key=lambda d: (d.job.ended_at is not None,
                                                  -d.job.created_at.timestamp(),
                                                  d.job.job_id))
    return Found(jobs, f"the state directory {state_dir}", warnings)


def _snapshots(state_dir: Path, viewer: Viewer, limits: ReadLimits,
               warnings: list[str]) -> Iterator[tuple[str, OpenedFile]]:
    """Every snapshot the viewer may read, opened (its descriptor checked), with its name
    as shown (``<uid>/<job>.db``). The viewer's own directory comes first; a directory in
    the viewer's name that is not the viewer's alone is ignored with a warning."""
    try:
        names = os.listdir(state_dir)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UserError(f"cannot read the state directory {state_dir}: {exc.strerror}") from None
    mine = str(viewer.uid)
    for name in sorted((n for n in names if n.isdigit()), key=lambda n: (n != mine, int(n))):
        try:
            dir_fd = open_private_dir(state_dir / name, create=False, uid=int(name))
        except (FileNotFoundError, PermissionError):
            continue  # gone, or another user's private directory: nothing to say
        except LocationError as exc:
            if name == mine:
                warnings.append(f"ignored {printable(name)}/: {printable(str(exc))}")
            continue
        try:
            for entry in sorted(os.listdir(dir_fd)):
                if not entry.endswith(".db") or entry.startswith("."):
                    continue
                label = printable(f"{name}/{entry}")
                try:
                    opened = open_owned(entry, dir_fd=dir_fd, max_bytes=limits.max_bytes,
                                        allowed=viewer.may_open)
                except (FileNotFoundError, PermissionError):
                    continue  # gone, or not ours to read: nothing to say
                except LocationError as exc:
                    warnings.append(f"skipped {label}: {printable(str(exc))}")
                    continue
                if opened is not None:
                    yield label, opened
        finally:
            os.close(dir_fd)


# ---------------------------------------------------------------- rendering


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    days, h = divmod(hours, 24)
    if days:
        return f"{days}d {h:02d}h"
    return f"{h}h {m:02d}m" if hours else f"{m}m {s:02d}s"


def _when(t: datetime | None) -> str:
    return "-" if t is None else f"{t:%Y-%m-%d %H:%M:%S}"


def _short_when(t: datetime | None) -> str:
    return "-" if t is None else f"{t:%m-%d %H:%M:%S}"


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (escape sequences, carriage
    returns, bidirectional overrides, ...) written as its Python escape (``\\x1b``): the
    record's strings come from users and reach other users' terminals (root and operators
    see every job)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class _PlainTable(Table):
    """A table whose text cells are shown as they are: the record's free text (an error
    quoting gloo's ``[/path/pair.cc:553]``, a job name) is never read as rich markup, and
    control characters in it are shown escaped."""

    def add_row(self, *renderables: RenderableType | None, **kwargs: Any) -> None:
        super().add_row(*(Text(printable(c)) if isinstance(c, str) else c
                          for c in renderables), **kwargs)


def _table(title: str, columns: str) -> Table:
    """A compact table. Columns: ``<name`` left, ``>name`` right (neither wraps), ``~name``
    left and wrapping (free text takes what space is left)."""
    t = _PlainTable(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
              pad_edge=False, collapse_padding=True, padding=(0, 1))
    for spec in columns.split("|"):
        kind, name = spec[0], spec[1:]
        t.add_column(name, justify="right" if kind == ">" else "left", no_wrap=kind != "~",
                     overflow="fold" if kind == "~" else "ellipsis",
                     min_width=max(len(name), 6) if kind == "~" else None)
    return t


def _seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def pause_text(m: Any) -> str:
    """A migration's pause: measured at the step boundaries, or (in brackets) the workers'
    own timing of the resize while not every process has reported its gap."""
    if m.pause_seconds is None:
        return "-"
    return _seconds(m.pause_seconds) if m.pause_measured else f"({m.pause_seconds:.2f})"


def in_flight_text(m: Any) -> str:
    """Of a migration's measured pause, the step in flight that a loss interrupted (``-``:
    none, or not measured)."""
    cut = m.interrupted_seconds
    return "-" if not cut or not m.pause_measured else _seconds(cut)


def _state(d: JobDetail, now: datetime, long: bool = False) -> str:
    """The state shown: ``lost (7m 12s)`` in a table (``lost (no update for 7m 12s, was
    running)`` with ``long``) when the coordinator stopped writing an active job's record."""
    if d.job.shown_state(now) != "lost":
        return d.job.state
    age = _duration(d.job.last_update_age(now))
    return f"lost (no update for {age}, was {d.job.state})" if long else f"lost ({age})"


def _owner(d: JobDetail) -> str:
    return f"{d.job.owner_name} ({d.job.owner_uid})"


def jobs_table(jobs: list[JobDetail], now: datetime) -> Table:
    """One row per job."""
    t = _table("elastic jobs", "<job|<name|<owner|<state|>gen|<layout|>devs|>resizes|"
                               ">pending|>age")
    for d in jobs:
        j = d.job
        committed = sum(1 for m in d.migrations if m.outcome == "committed")
        t.add_row(j.job_id, j.name, j.owner_name, _state(d, now),
                  "-" if j.generation is None else str(j.generation), j.layout or "-",
                  str(j.world_size), str(committed),
                  str(j.pending_events),
                  _duration(((j.ended_at or now) - j.created_at).total_seconds()))
    return t


def job_view(d: JobDetail, now: datetime) -> RenderableType:
    """Everything about one job: header, devices and vranks per node, generations,
    migrations, pending events."""
    gen = "-" if d.job.generation is None else str(d.job.generation)
    parts: list[RenderableType] = [_job_head(d, now), _devices_table(d, gen),
                                   _generations_table(d, now)]
    if d.migrations:
        parts += _migrations_parts(d)
    parts.append(_pending_part(d, now))
    return Group(*parts)


def _job_head(d: JobDetail, now: datetime) -> Text:
    """The job's lines: id, name, owner, state, layout, where it runs, when, peer copies."""
    j = d.job
    p = printable
    head = Text()
    head.append(f"job {p(j.job_id)}", style="bold")
    head.append(f"  {p(j.name)}  owner {p(_owner(d))}  state ")
    head.append(_state(d, now, long=True), style="bold")
    if j.reason:
        head.append(f" ({p(j.reason)})")
    head.append("\n")
    gen = "-" if j.generation is None else str(j.generation)
    head.append(f"generation {gen}  layout {p(j.layout or '-')} on {j.world_size} devices, "
                f"{len(j.nodes)} nodes\n")
    head.append(f"backend {p(j.backend)}  partition {p(j.partition or '-')}  account "
                f"{p(j.account or '-')}  model {p(j.model or '-')}  coordinator "
                f"{p(j.coordinator or '-')}\n")
    head.append(f"created {_when(j.created_at)} UTC  updated {_when(j.updated_at)} UTC"
                + (f"  ended {_when(j.ended_at)} UTC" if j.ended_at else ""))
    copies = d.peer_copies
    if copies is not None and copies.get("line"):
        head.append(f"\n{p(str(copies['line']))}")
    return head


def _devices_table(d: JobDetail, gen: str) -> Table:
    """The devices per node, each with its state, vrank, rank and allocation."""
    placed = {(v.node, v.local_index): v for v in d.vranks}
    nodes = _table(f"devices and vranks per node (generation {gen})",
                   "<node|>device|<state|>vrank|>rank|~allocation")
    for dev in d.devices:
        v = placed.get((dev.node, dev.local_index))
        nodes.add_row(dev.node, str(dev.local_index), dev.state,
                      "-" if v is None else str(v.vrank),
                      "-" if v is None else ("idle" if v.rank is None else str(v.rank)),
                      dev.allocation or "-")
    return nodes


def _generations_table(d: JobDetail, now: datetime) -> Table:
    """One row per generation: layout, when it started, how long, the steps and last loss,
    why it ended."""
    gens = _table("generations", ">gen|<layout|>devs|>started|>took|>steps|>span|>loss|"
                                 "~ended because")
    for g in d.generations:
        span = ("-" if g.first_step is None and g.last_step is None
                else f"{g.first_step if g.first_step is not None else '?'}.."
                     f"{g.last_step if g.last_step is not None else '?'}")
        gens.add_row(str(g.number), g.layout, str(g.world_size), f"{g.started_at:%H:%M:%S}",
                     _duration(g.duration_seconds(now)), str(g.steps), span,
                     "-" if g.last_loss is None else f"{g.last_loss:.4g}",
                     g.end_reason or ("training" if g.ended_at is None else "-"))
    return gens


def _migrations_parts(d: JobDetail) -> list[RenderableType]:
    """The migrations' table (bytes moved against the lower bound; seconds) and its key."""
    mig = _table("migrations (bytes moved against the lower bound; seconds)",
                 "<gen|>moved|>bound|>ratio|>kept|>msgs/rounds|>est|>took|>data|>pause|"
                 ">in flight|>stall|>prep|~outcome")
    for m in d.migrations:
        ratio = m.ratio_to_lower_bound
        outcome = m.outcome or "running"
        if m.error:
            outcome += f": {m.error}"
        if m.lost_steps is not None:  # a node lost without grace, no replica of it
            first, last = m.lost_steps
            outcome += (f"; lost steps {first}-{last} (rebuilt from "
                        f"{m.rebuilt_from or '?'} of step {first - 1}, trained again)")
        mig.add_row(f"{m.from_generation}->{m.to_generation}", _bytes(m.moved_bytes),
                    _bytes(m.lower_bound_bytes), "-" if ratio is None else f"{ratio:.3f}",
                    _bytes(m.kept_bytes), f"{m.messages}/{m.rounds}",
                    _seconds(m.estimated_seconds), _seconds(m.measured_seconds),
                    _seconds(m.data_seconds), pause_text(m), in_flight_text(m),
                    _seconds(m.stall_seconds), _seconds(m.preparation_seconds), outcome)
    return [mig, Text("pause: the widest gap over the processes between the end of the "
                      "last step in the old layout and the start of the first in the new "
                      "one (in brackets: the workers' timing, until every process reported "
                      "it); in flight: of the pause, the step a lost node interrupted "
                      "(its work lost with the node; the rest is the recovery); stall: the "
                      "widest gap between two old-layout steps before it, while the resize "
                      "was prepared (the boundary that built the new world); prep: "
                      "decision to pause, the old layout training on",
                      style="dim")]


def _pending_part(d: JobDetail, now: datetime) -> RenderableType:
    """The pending events' table, or a line saying there are none."""
    pending = d.pending_events
    if pending:
        ev = _table("pending events", ">id|<kind|<source|>received UTC|<deadline|~payload")
        for e in pending:
            if e.deadline is None:
                left = "-"
            elif e.deadline > now:
                left = f"in {_duration((e.deadline - now).total_seconds())}"
            else:
                left = f"passed {_short_when(e.deadline)}"
            ev.add_row(str(e.id), e.kind, e.source, _short_when(e.received_at), left,
                       "-" if e.payload is None else json.dumps(e.payload, sort_keys=True))
        return ev
    return Text("no pending events", style="dim")


def render(found: Found, job_id: str | None, now: datetime) -> RenderableType:
    if job_id is not None:
        return job_view(found.jobs[0], now)
    if not found.jobs:
        return Text(f"no jobs of yours in {found.where}", style="dim")
    return jobs_table(found.jobs, now)


# ---------------------------------------------------------------- command


SORT_KEYS: dict[str, Callable[[JobDetail], Any]] = {
    "job": lambda d: d.job.job_id,
    "name": lambda d: (d.job.name, d.job.job_id),
    "owner": lambda d: (d.job.owner_name, d.job.job_id),
    "state": lambda d: (d.job.state, d.job.job_id),
    "age": lambda d: (-d.job.updated_at.timestamp(), d.job.job_id),
    "devices": lambda d: (-d.job.world_size, d.job.job_id),
    "resizes": lambda d: (-sum(m.outcome == "committed" for m in d.migrations), d.job.job_id),
}


@click.command("status")
@click.argument("job_id", required=False, metavar="[JOBID]", type=TextType())
@click.option("--db", "db", envvar="SLURM_ETC_DB", metavar="PATH|URL|@FILE",
              type=TextType(bounds.PATH_CHARS),
              help="Read this database (SQLite file, mysql+pymysql://... or "
                   "postgresql://..., or @FILE: the URL kept in an owner-only file) "
                   "instead of the state directory's snapshots.")
@click.option("--state-dir", type=SafePath(file_okay=False, path_type=Path),
              envvar="SLURM_ETC_STATE_DIR",
              help="Where coordinators publish job snapshots (default: $SLURM_ETC_STATE_DIR "
                   "or ~/.local/share/slurm-etc/jobs).")
@click.option("--db-password-file", type=SafePath(dir_okay=False, path_type=Path),
              envvar="SLURM_ETC_DB_PASSWORD_FILE",
              help="Read the password of the --db URL from this owner-only file (so it is "
                   "in neither argv nor the environment); or give --db @FILE, a file "
                   "holding the whole URL.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--sort", type=click.Choice(sorted(SORT_KEYS)), default="job", show_default=True,
              help="Order of the jobs (newest updates first for age; most first for "
                   "devices and resizes).")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "openmetrics"]),
              default="table", show_default=True,
              help="openmetrics: the jobs as Prometheus metrics (slurm_etc_*), e.g. for "
                   "node_exporter's textfile collector; json: as --json.")
@click.option("--watch", type=Number(bounds.WATCH_S), is_flag=False,
              flag_value=DEFAULT_WATCH_S, default=None, metavar="[SECONDS]",
              help=f"Redraw every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C.")
@click.pass_context
def status(ctx: click.Context, job_id: str | None, db: str | None, state_dir: Path | None,
           db_password_file: Path | None, as_json: bool, sort: str, fmt: str,
           watch: float | None) -> None:
    """Elastic jobs: layout and generation, devices and vranks per node, generations,
    migrations (bytes moved against the lower bound, pause), pending events. Without JOBID,
    one line per job; you see your own jobs (root and Slurm operators see all)."""
    as_json = as_json or fmt == "json"
    if watch is not None and (as_json or fmt == "openmetrics"):
        raise UserError("--watch redraws tables; leave it out to get --json or "
                        "--format openmetrics once")
    obj = ctx.obj or {}
    viewer = Viewer(obj.get("uid", os.getuid()), obj.get("sees_all_jobs", slurm_operator))
    clock: Callable[[], datetime] = obj.get("now", lambda: datetime.now(timezone.utc))
    states = state_dir.expanduser() if state_dir else default_state_dir()
    if db_password_file is not None:
        if not db:
            raise UserError("--db-password-file needs --db URL")
        try:
            db = with_password_file(db, db_password_file)
        except StoreError as exc:
            raise UserError(redact(str(exc), db)) from None

    def look() -> Found:
        found = gather(db, states, viewer, job_id)
        if job_id is not None and not found.jobs:
            raise UserError(f"no job {job_id} of yours in {found.where}")
        found.jobs.sort(key=SORT_KEYS[sort])
        return found

    found = look()
    _warn(found.warnings)
    if as_json:
        now = clock()
        click.echo(json.dumps({"jobs": [d.to_json(now) for d in found.jobs]}, indent=2))
        return
    if fmt == "openmetrics":
        from ..metrics import openmetrics

        click.echo(openmetrics(found.jobs, clock()), nl=False)
        return
    console = output_console()
    if watch is None:
        if job_id is None and not found.jobs:
            click.echo(f"no jobs of yours in {found.where}", err=True)
            return
        console.print(render(found, job_id, clock()))
        return
    frames = obj.get("watch_frames")
    if not console.is_terminal:  # a pipe or a log: each view whole, after a stamp line
        console.print(render(found, job_id, clock()))
        for _ in _count(frames):
            time.sleep(watch)
            now = clock()
            try:
                view: RenderableType = render(look(), job_id, now)
            except UserError as exc:
                view = Text(exc.format_message())
            console.print(f"--- {now.isoformat(timespec='seconds')} ---")
            console.print(view)
        return
    with Live(render(found, job_id, clock()), console=console, auto_refresh=False) as live:
        try:
            for _ in _count(frames):
                time.sleep(watch)
                try:
                    view = render(look(), job_id, clock())
                except UserError as exc:
                    view = Text(exc.format_message(), style="red")
                live.update(view, refresh=True)
        except KeyboardInterrupt:
            pass


def _count(limit: int | None) -> Iterable[int]:
    i = 0
    while limit is None or i < limit:
        yield i
        i += 1


def _warn(warnings: list[str]) -> None:
    for w in warnings:
        click.echo(f"slurm-etc: warning: {printable(w)}", err=True)
