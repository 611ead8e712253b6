"""``slurm-etc soak``: a seeded schedule of grants, preemptions, node losses, worker deaths in
resize phases, coordinator crashes, a duplicate coordinator and a full disk, run against one
real job (the coordinator as users start it, ``slurm-etc run``, on the local backend, real
megatron-core workers of the ``tiny`` preset), then checked.

The schedule is drawn by :mod:`.soak_schedule` (pure); the checks are :mod:`.soak_checks`
(pure); this module does the I/O between them:

1. it writes the events script of the schedule and starts ``slurm-etc run`` on it (record
   and state directory on a small tmpfs of its own where it can mount one, for the full-disk
   windows; the workers' phase kills armed through the chaos worker's switch);
2. it plays the soak's own events in order, each once training reached its turn (a script
   event's turn is when the backend fired it, read from the cluster state the backend keeps
   beside the record): SIGKILLs of a worker's process group, of the coordinator (then
   ``slurm-etc run`` again on the same job and record), a second coordinator on the live
   job (it must exit 2 in one line), the disk filled for some steps;
3. once the job ended: the processes of the job still alive (psutil, by a mark in the
   environment every process of the job inherits), the record read back, and the oracle:
   megatron-core's checkpoint-restart through the layouts of the final history
   (:func:`slurm_etc.worker.sequence.checkpoint_losses`: fresh processes per layout, each
   loading the previous layout's checkpoint; none of the coordinator's, the record's, the
   migration's, the peer copies' or the rebuild's code), resized at the steps the record
   says.

The oracle shares with what it checks the trainer's step and the preset model (what is
trained), and megatron-core.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from slurm_etc.coordinator.deciding import HELD_FOR_RECORD
from slurm_etc.errors import InternalError

from .soak_checks import (
    GenerationSeen,
    MigrationSeen,
    RecordSeen,
    Verdict,
    final_history,
    judge,
)
from .soak_schedule import BUDGET, Schedule, SoakEvent, draw_schedule

logger = logging.getLogger(__name__)

# every process of the soak's job inherits this mark (the leak check finds them by it)
MARK = "ETC_SOAK_JOB"  # not SLURM_ETC_*: the preloader drops those
GLOBAL_BATCH = 8
PEER_COPY_EVERY = 2
# periodic checkpoints beside the copies (off the record's small filesystem): what a double
# or triple fault inside one resize (every copy of a shard gone) is rebuilt from, as a site
# that asks for more than single-fault tolerance runs it
CHECKPOINT_EVERY = 20
# how long one event may wait for its turn before the soak gives up on the job
TURN_TIMEOUT_S = 180.0
# how long a duplicate coordinator has to be refused
DUPLICATE_TIMEOUT_S = 60.0
# how long a resize-kill waits for a migration to open
RESIZE_WAIT_S = 60.0
# a full-disk window ends this long after a decision began to wait for the record
RECORD_HOLD_S = 3.0
TMPFS_SIZE = "64m"


@dataclass
class EventDone:
    """What became of one event."""

    event: SoakEvent
    outcome: str = "pending"
    seconds: float | None = None  # since the soak's start
    step: int | None = None  # the highest step heard then

    def to_json(self) -> dict[str, Any]:
        return {**self.event.to_json(), "outcome": self.outcome,
                "seconds": None if self.seconds is None else round(self.seconds, 2),
                "step": self.step}


@dataclass
class SoakRun:
    """The soak's state while it runs (its files, the coordinator, what was heard)."""

    schedule: Schedule
    work: Path
    record_dir: Path
    job: str
    argv: list[str]
    env: dict[str, str]
    say: Callable[[str], None]
    t0: float = field(default_factory=time.monotonic)
    coordinator: subprocess.Popen[bytes] | None = None
    starts: int = 0
    heard: list[tuple[int, float]] = field(default_factory=list)
    offset: int = 0
    problems: list[str] = field(default_factory=list)
    ballast: Path | None = None
    duplicates: list[subprocess.Popen[bytes]] = field(default_factory=list)  # warm, waiting

    @property
    def db(self) -> Path:
        return self.record_dir / "job.db"

    @property
    def max_step(self) -> int:
        return max((s for s, _x in self.heard), default=0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # -- the coordinator --------------------------------------------------------------
    def start(self) -> None:
        self.starts += 1
        log = open(self.work / f"coordinator-{self.starts}.log", "ab")
        try:
            self.coordinator = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL,
                                                stdout=log, stderr=log, start_new_session=True)
        finally:
            log.close()
        self.say(f"coordinator {self.starts} started: pid {self.coordinator.pid}")

    def alive(self) -> bool:
        return self.coordinator is not None and self.coordinator.poll() is None

    def kill_coordinator(self) -> None:
        if self.coordinator is None:
            return
        self.coordinator.send_signal(signal.SIGKILL)
        self.coordinator.wait(30)

    # -- what the job says ------------------------------------------------------------
    def read_progress(self) -> None:
        path = self.work / "progress.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line half written is read next time
        for line in data[:end].splitlines():
            try:
                p = json.loads(line)
                self.heard.append((int(p["step"]), float(p["loss"])))
            except (ValueError, KeyError, TypeError):
                self.problems.append(f"progress line not understood: {line[:200]!r}")
        self.offset += end

    def fired(self) -> int:
        """How many script events the backend fired (from the cluster state it keeps)."""
        try:
            return int(json.loads((self.record_dir / "job.db.cluster.json").read_text())
                       ["fired"])
        except (OSError, ValueError, KeyError, TypeError):
            return -1

    def open_migrations(self) -> int:
        import sqlite3

        try:
            con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=1.0)
            try:
                return int(con.execute("SELECT count(*) FROM migrations WHERE outcome IS NULL"
                                       ).fetchone()[0])
            finally:
                con.close()
        except sqlite3.Error:
            return 0

    def wait(self, until: Callable[[], bool], what: str, timeout_s: float = TURN_TIMEOUT_S,
             *, need_alive: bool = True) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            self.read_progress()
            if until():
                return True
            if need_alive and not self.alive():
                raise SoakStopped(f"the coordinator ended (exit {self.coordinator_rc()}) while "
                                  f"waiting for {what}")
            if time.monotonic() > deadline:
                raise SoakStopped(f"{what}: not within {timeout_s:g} s (step "
                                  f"{self.max_step} heard)")
            time.sleep(0.05)

    def coordinator_rc(self) -> int | None:
        return None if self.coordinator is None else self.coordinator.poll()


class SoakStopped(InternalError, RuntimeError):
    """The job cannot go on through the schedule (one line: why)."""


def job_processes(job: str, db: Path | None = None, logs: Path | None = None) -> list[int]:
    """Live (not zombie) processes of ``job``: those carrying the soak's mark (the
    coordinators and whatever keeps its environment), the workers the record says were
    launched (pid and start time: a worker forked from the preloader has its process title
    written over its environment), the preloaders the coordinators' logs name (``logs``:
    the soak's directory)."""
    import psutil  # type: ignore[import-untyped]

    out = set()
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(MARK) == job:
                out.add(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    if db is not None:
        out |= {pid for _v, pid in launched(db).values()}
    if logs is not None:
        import re

        for log in logs.glob("coordinator-*.log"):
            for m in re.finditer(r"preloaded process \(pid (\d+)", log.read_text(errors="replace")):
                pid = int(m.group(1))
                try:
                    p = psutil.Process(pid)
                    if p.status() != psutil.STATUS_ZOMBIE and \
                            "slurm_etc.local.preload" in " ".join(p.cmdline()):
                        out.add(pid)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
    return sorted(out)


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22);
    None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else int(fields[19])


def launched(db: Path) -> dict[int, tuple[str, int]]:
    """vrank -> (device, pid) of the newest launch of each vrank the record has, whose
    process still runs (same pid and start time)."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2.0)
        try:
            rows = con.execute("SELECT json_extract(payload, '$.vrank'), "
                               "json_extract(payload, '$.device'), "
                               "json_extract(payload, '$.pid'), json_extract(payload, "
                               "'$.start') FROM events WHERE kind = 'launch' ORDER BY id"
                               ).fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return {}
    newest = {int(v): (str(d), int(pid), start) for v, d, pid, start in rows
              if v is not None and pid is not None}
    return {v: (d, pid) for v, (d, pid, start) in sorted(newest.items())
            if start is not None and _start_ticks(pid) == int(start)}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def mount_tmpfs(where: Path) -> bool:
    """A small tmpfs of the soak's own at ``where`` (root only); whether it is mounted."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0700",
                          "tmpfs", str(where)], capture_output=True, text=True)
    return got.returncode == 0


def fill(where: Path) -> Path:
    """Write zeros into ``where`` until its filesystem is full; the file written (unbuffered:
    a buffered file's close would try the last chunk again and raise)."""
    ballast = where / "ballast"
    chunk = b"\0" * 65536
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                ballast.unlink(missing_ok=True)
                raise
    return ballast


def listing(where: Path, most: int = 8) -> str:
    """The largest files under ``where`` with their sizes (one line)."""
    sizes = []
    for p in where.rglob("*"):
        try:
            if p.is_file():
                sizes.append((p.stat().st_size, str(p.relative_to(where))))
        except OSError:
            continue
    sizes.sort(reverse=True)
    return ", ".join(f"{name} {size:,} B" for size, name in sizes[:most]) + \
        (f" and {len(sizes) - most} more" if len(sizes) > most else "")


def lease_released(db: Path) -> bool:
    """Whether nobody holds the job's lease: the record's ``.lease`` file can be locked
    (read with flock directly, not through the lease's own code)."""
    path = db.with_name(db.name + ".lease")
    if not path.exists():
        return True
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def read_record(db: Path, job: str) -> RecordSeen:
    """The record as the checks read it."""
    from slurm_etc.store import jobs as record
    from slurm_etc.store.db import open_store_readonly

    store = open_store_readonly(db)
    try:
        detail = record.job_detail(store, job)
    finally:
        store.close()
    if detail is None:
        return RecordSeen("absent", (), (), lease_released(db))
    gens = tuple(GenerationSeen(g.number, g.layout, g.first_step, g.last_step,
                                g.ended_at is not None) for g in detail.generations)
    migs = tuple(MigrationSeen(m.id, m.from_generation, m.to_generation, m.outcome,
                               m.lost_steps) for m in detail.migrations)
    return RecordSeen(detail.job.state, gens, migs, lease_released(db))


def oracle_losses(record: RecordSeen, *, say: Callable[[str], None]) -> tuple[dict[int, float],
                                                                           list[str]]:
    """step -> loss of megatron-core's checkpoint-restart through the final history's
    layouts (consecutive stints of one layout merged: a restart into the same layout is the
    same arithmetic), and the layouts it went through."""
    from slurm_etc.plan import ParallelConfig
    from slurm_etc.plan.model import PRESETS
    from slurm_etc.worker.sequence import ResizeSequence, checkpoint_losses

    history = final_history(record)
    configs: list[ParallelConfig] = []
    ends: list[int] = []
    for _g, layout, _first, last in history.segments:
        cfg = ParallelConfig.parse(layout)
        if configs and configs[-1] == cfg:
            ends[-1] = last
        else:
            configs.append(cfg)
            ends.append(last)
    if not configs:
        return {}, []
    say(f"oracle: checkpoint-restart through {len(configs)} layout(s) to step {ends[-1]}")
    seq = ResizeSequence(PRESETS["tiny"], tuple(configs), steps=1, global_batch=GLOBAL_BATCH,
                         ends=tuple(ends), total_steps=BUDGET)
    ref = checkpoint_losses(seq)
    return {s: float(r["loss"]) for s, r in ref.items()}, [str(c) for c in configs]


def soak_command(job: str, work: Path, record_dir: Path) -> list[str]:
    """The coordinator as users start it: ``slurm-etc run`` on the soak's events script."""
    worker = [sys.executable, "-m", "slurm_etc.testing.worker", "--model", "tiny",
              "--global-batch", str(GLOBAL_BATCH), "--train-steps", str(BUDGET),
              "--data", "seeded"]
    return [sys.executable, "-c", "from slurm_etc.cli.main import main; main()", "run",
            "--events", str(work / "events.json"), "--job-id", job,
            "--db", str(record_dir / "job.db"), "--state-dir", str(record_dir / "state"),
            "--model", "tiny", "--global-batch", str(GLOBAL_BATCH), "--hardware", "cpu",
            "--peer-copy-every", str(PEER_COPY_EVERY),
            "--checkpoint-every", str(CHECKPOINT_EVERY), "--checkpoint-dir",
            str(work / "checkpoints"), "--timeout", "60",
            "--join-timeout", "180", "--give-up-after", "60", "--reattach-wait", "90",
            "--progress", str(work / "progress.jsonl"), "--", *worker]


@dataclass
class Observed:
    """What the soak saw of one job: the schedule and what became of each event, the losses
    heard, the processes of the job alive at its end and its record; what the checks
    judge (:func:`check`)."""

    schedule: Schedule
    done: list[EventDone]
    heard: list[tuple[int, float]]
    leaked: list[int]
    record: RecordSeen
    problems: list[str]
    coordinator_starts: int
    seconds: float
    work: Path


def observe(seed: int, events: int, *, work: Path,
            say: Callable[[str], None] | None = None) -> Observed:
    """Draw the schedule of ``seed`` and run it against one job whose files go to
    ``work`` (see the module doc)."""
    from slurm_etc.testing.hooks import INJECT_ENV

    say = say or (lambda _m: None)
    t0 = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    record_dir = work / "record"
    record_dir.mkdir(exist_ok=True)
    tmpfs = mount_tmpfs(record_dir)
    schedule = draw_schedule(seed, events, full_disk=tmpfs)
    job = f"soak-{seed}-{os.getpid()}"
    (work / "events.json").write_text(json.dumps(schedule.script()))
    (work / "schedule.json").write_text(json.dumps(schedule.to_json(), indent=1))
    here = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, MARK: job, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop(INJECT_ENV, None)
    if schedule.kill_specs():
        env[INJECT_ENV] = schedule.kill_specs()
    run = SoakRun(schedule, work, record_dir, job, soak_command(job, work, record_dir), env, say)
    done = [EventDone(e) for e in schedule.events]
    stopped: str | None = None
    rc: int | None = None
    try:
        run.start()
        try:
            _play(run, done)
            run.wait(lambda: not run.alive(), "the job's end", need_alive=False)
        except SoakStopped as err:
            stopped = str(err)
            say(f"stopped: {stopped}")
        finally:
            _free(run)
            for second in run.duplicates:  # never let go: the job ended before its turn
                second.kill()
                second.communicate()
            if run.coordinator is not None and run.alive():
                # the schedule stopped: the job is ended as a user would
                run.coordinator.terminate()
                try:
                    run.coordinator.wait(60)
                except subprocess.TimeoutExpired:
                    run.kill_coordinator()
            rc = run.coordinator_rc()
            run.read_progress()
        time.sleep(2.0)  # the coordinator stops its workers on the way out
        leaked = job_processes(job, run.db, work)
        for pid in leaked:  # reported, then cleaned up
            _kill_group(pid)
        record = read_record(run.db, job)
    finally:
        if tmpfs:
            (work / "record-files.txt").write_text(listing(record_dir, most=100) + "\n")
            # the record is read; a copy outlives the tmpfs for whoever looks later
            for p in record_dir.glob("job.db*"):
                if p.is_file():
                    shutil.copy2(p, work / p.name)
            subprocess.run(["umount", "-l", str(record_dir)], check=False)
    problems = list(run.problems)
    if stopped:
        problems.append(f"the schedule did not play out: {stopped}")
    elif rc != 0:
        problems.append(f"the last coordinator exited {rc}")
    for d in done:
        if d.outcome.startswith("FAILED"):
            problems.append(f"event {d.event.index} ({d.event.kind}): {d.outcome}")
    # a phase kill hit: a worker killed itself at its phase, and the record has a resize to
    # its generation (the kill hook's line names no generation)
    hits = _phase_hits(work)
    resized = {m.to_generation for m in record.migrations}
    for d in done:
        if d.event.kind == "phase-kill":
            hit = hits.get(d.event.phase, 0) and d.event.generation in resized
            d.outcome = "hit" if hit else "not hit (no such resize, or nobody did that phase)"
    return Observed(schedule, done, run.heard, leaked, record, problems, run.starts,
                    time.monotonic() - t0, work)


def check(seen: Observed, oracle: Mapping[int, float] | None,
          layouts: Sequence[str] = ()) -> dict[str, Any]:
    """Every check over what was seen; the report (``oracle`` None: losses not checked)."""
    verdict = judge(seen.record, seen.heard, oracle or {}, seen.leaked, seen.problems)
    if oracle is None:
        verdict = replace(verdict, diverged=())
    return _report(seen, verdict, layouts, oracle is not None)


def run_soak(seed: int, events: int, *, work_dir: Path | None = None, keep: bool = False,
             say: Callable[[str], None] | None = None, oracle: bool = True) -> dict[str, Any]:
    """Draw the schedule of ``seed``, run it, check it; the report ``--json`` prints.

    ``work_dir``: where the soak's files go (default: a new temporary directory, removed
    at the end unless ``keep`` or the soak failed). ``oracle``: run the checkpoint-restart
    replay (off: the losses are not checked, ``diverged_steps`` is None)."""
    say = say or (lambda _m: None)
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix=f"slurm-etc-soak-{seed}-"))
    seen = observe(seed, events, work=work, say=say)
    ref: dict[int, float] | None = None
    layouts: list[str] = []
    if oracle and seen.record.state != "absent":
        try:
            ref, layouts = oracle_losses(seen.record, say=say)
        except Exception as err:  # noqa: BLE001 -- reported as the soak's failure
            seen.problems.append(f"the oracle did not run: {err.__class__.__name__}: {err}")
            ref = {}
    report = check(seen, ref, layouts)
    report["seconds"] = round(seen.seconds, 1)
    report["work_dir"] = str(work)
    if not keep and report["ok"] and not work_dir:
        shutil.rmtree(work, ignore_errors=True)
        report["work_dir"] = None
    return report


def _phase_hits(work: Path) -> dict[str, int]:
    """phase -> how many workers killed themselves there (the kill hook's log lines; they
    do not name the generation)."""
    import re

    out: dict[str, int] = {}
    for log in work.glob("coordinator-*.log"):
        for m in re.finditer(r"killing itself \(SIGKILL\) at (\S+)",
                             log.read_text(errors="replace")):
            out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


def _play(run: SoakRun, done: list[EventDone]) -> None:
    """Carry out the schedule's events in order (see the module doc)."""
    base = 0  # the step heard when the last script event fired
    script_no = 0
    run.wait(partial(_reached, run, 1), "the first training step")
    # the duplicates warm up from the start (each imports for seconds, then waits its turn)
    run.duplicates = [start_duplicate(run) for d in done if d.event.kind == "duplicate"]
    for d in done:
        e = d.event
        if e.kind == "phase-kill":
            d.outcome = "armed"
            continue
        if e.by == "script":
            script_no += 1
            n = script_no
            run.wait(partial(_fired, run, n), f"script event {e.index} ({e.kind})")
            base = run.max_step
            d.outcome, d.seconds, d.step = "fired", run.elapsed(), base
            run.say(f"{e.describe()}: fired at step {base}")
            continue
        run.wait(partial(_reached, run, base + e.at_step), f"the turn of event {e.index}")
        d.seconds, d.step = run.elapsed(), run.max_step
        d.outcome = _act(run, e)
        run.say(f"{e.describe()}: {d.outcome} (step {d.step})")


def _fired(run: SoakRun, n: int) -> bool:
    return run.fired() >= n


def _reached(run: SoakRun, step: int) -> bool:
    return run.max_step >= step


def _act(run: SoakRun, e: SoakEvent) -> str:
    if e.kind == "worker-kill":
        return _kill_worker(run, e)
    if e.kind == "resize-kill":
        deadline = time.monotonic() + RESIZE_WAIT_S
        while time.monotonic() < deadline and run.alive():
            if run.open_migrations():
                return "during a resize: " + _kill_worker(run, e)
            time.sleep(0.02)
        return "not hit (no migration opened)"
    if e.kind == "coordinator-kill":
        step = run.max_step
        run.kill_coordinator()
        time.sleep(e.delay_s)
        run.start()
        # the next event waits for the restarted one to train on (a full disk at its start
        # is one line and exit 2, as documented: not what this event is about)
        run.wait(partial(_reached, run, step + 1), "a step after the coordinator's restart")
        return f"killed at step {step}, restarted, training again at step {run.max_step}"
    if e.kind == "duplicate":
        return _duplicate(run)
    if e.kind == "full-disk":
        try:
            run.ballast = fill(run.record_dir)
        except OSError as err:  # full before the soak filled it: say what fills it
            taken = listing(run.record_dir)
            run.problems.append(f"the record's filesystem was full before the soak filled it "
                                f"({err.strerror}): {taken}")
            return f"FAILED: already full ({taken})"
        start = run.max_step
        held = _HeldForRecord(run.work / f"coordinator-{run.starts}.log")
        try:
            run.wait(lambda: _reached(run, start + e.steps) or held(),
                     f"{e.steps} steps on a full disk", timeout_s=120)
        finally:
            _free(run)
        if held.since is not None:  # a decision (a loss, a notice) waited for the record
            return (f"full from step {start}; a decision waited for the record at step "
                    f"{run.max_step} (record, then act), freed after {RECORD_HOLD_S:g} s")
        return f"full from step {start} to {run.max_step}"
    raise ValueError(f"not a soak event: {e.kind}")


class _HeldForRecord:
    """Whether the coordinator (its log from now on) has said for RECORD_HOLD_S that a
    decision waits for the record: training cannot go on past it while the disk is full (a
    loss's survivors wait for their order), so the window ends there."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.since: float | None = None
        self.mark = log.stat().st_size if log.exists() else 0

    def __call__(self) -> bool:
        if self.since is None:
            try:
                with open(self.log, "rb") as f:
                    f.seek(self.mark)
                    said = HELD_FOR_RECORD.encode() in f.read()
            except OSError:
                return False
            if said:
                self.since = time.monotonic()
        return self.since is not None and time.monotonic() - self.since >= RECORD_HOLD_S


def _free(run: SoakRun) -> None:
    if run.ballast is not None:
        run.ballast.unlink(missing_ok=True)
        run.ballast = None


def _kill_worker(run: SoakRun, e: SoakEvent) -> str:
    """SIGKILL one worker's process group, where the job's workers run on two nodes or more
    (on one node nothing outside it holds a copy of its state: a kill there loses the job
    by design, with no checkpoint)."""
    workers = launched(run.db)
    nodes = {device.split(":")[0] for device, _pid in workers.values()}
    if len(nodes) < 2:
        return f"skipped: the workers run on {len(nodes)} node(s)"
    vranks = sorted(workers)
    vrank = vranks[e.pick % len(vranks)]
    device, pid = workers[vrank]
    _kill_group(pid)
    return f"killed vrank {vrank} on {device} (pid {pid}; {len(vranks)} workers)"


def start_duplicate(run: SoakRun) -> subprocess.Popen[bytes]:
    """A second ``slurm-etc run`` on the job, its imports done, waiting for a line on its
    stdin to go on (a cold start takes seconds on a loaded machine, in which the job would
    train through the schedule's next events)."""
    warm = ("import sys; import slurm_etc.cli.main, slurm_etc.cli.cmd_run, "
            "slurm_etc.coordinator.run, slurm_etc.local.backend, slurm_etc.store.jobs; "
            "sys.stdin.readline(); from slurm_etc.cli.main import main; main()")
    argv = [run.argv[0], "-c", warm, *run.argv[3:]]
    return subprocess.Popen(argv, env=run.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _duplicate(run: SoakRun) -> str:
    """A second coordinator on the live job: refused (exit 2, one line) while the first
    lives on."""
    second = run.duplicates.pop(0) if run.duplicates else start_duplicate(run)
    t = time.monotonic()
    try:
        _out, err = second.communicate(b"go\n", timeout=DUPLICATE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        second.kill()
        second.communicate()
        run.problems.append(f"a duplicate coordinator still ran after {DUPLICATE_TIMEOUT_S:g} s")
        return "FAILED: not refused in time"
    took = time.monotonic() - t
    lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
    if not run.alive():
        return f"not tested: the job's coordinator had ended ({lines[-1:]})"
    if second.returncode != 2 or len(lines) != 1 or "already has a coordinator" not in lines[0]:
        run.problems.append(f"a duplicate coordinator was not refused in one line: exit "
                            f"{second.returncode}, stderr {lines[-3:]}")
        return f"FAILED: exit {second.returncode}"
    # nothing touched: the lease still names the live coordinator
    holder = ""
    try:
        holder = (run.db.with_name(run.db.name + ".lease")).read_text(errors="replace")
    except OSError:
        pass
    if run.coordinator is not None and f"pid {run.coordinator.pid} " not in holder:
        run.problems.append(f"after a duplicate coordinator the lease names {holder.strip()!r}, "
                            f"not the live coordinator (pid {run.coordinator.pid})")
        return "FAILED: the lease changed hands"
    return f"refused in {took:.1f} s (exit 2, one line; the lease still the live one's)"


def _report(seen: Observed, verdict: Verdict, layouts: Sequence[str],
            oracle: bool) -> dict[str, Any]:
    record, done = seen.record, seen.done
    outcomes = [m.outcome for m in record.migrations]
    return {
        "ok": verdict.ok, "seed": seen.schedule.seed, "events": len(seen.schedule.events),
        # carried out (a phase kill: armed; skipped kills count): the schedule can stop early
        "events_played": sum(d.outcome != "pending" for d in done),
        "events_by_kind": seen.schedule.counts(),
        "resizes_committed": outcomes.count("committed"),
        "resizes_aborted": outcomes.count("aborted"),
        "diverged_steps": len(verdict.diverged) if oracle else None,
        "diverged": list(verdict.diverged[:20]),
        "steps": final_history(record).last, "steps_twice": list(verdict.steps_twice),
        "steps_missing": list(verdict.steps_missing),
        "steps_rebuilt": sum(b - a + 1 for m in record.migrations if m.lost_steps
                             for a, b in [m.lost_steps]),
        "unheard_steps": len(verdict.unheard),
        "leaked_processes": len(verdict.leaked), "leaked_pids": list(verdict.leaked),
        "record_consistent": not verdict.record, "record_problems": list(verdict.record),
        "job_state": record.state, "generations": len(record.generations),
        "coordinator_starts": seen.coordinator_starts,
        "phase_kills_hit": sum(d.outcome == "hit" for d in done),
        "duplicates_refused": sum(d.outcome.startswith("refused") for d in done),
        "oracle_layouts": list(layouts),
        "problems": list(verdict.other),
        "seconds": round(seen.seconds, 1),
        "schedule": [d.to_json() for d in done],
        "notes": list(seen.schedule.notes),
    }
