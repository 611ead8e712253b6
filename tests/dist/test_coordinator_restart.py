"""Coordinator killed (SIGKILL) at each kill point, then restarted on the same job and
database: nothing recorded is lost or doubled, no node request is sent twice, the job ends.

The coordinator is the real one (run_job: SQLite record, control channel, local backend);
the workers are stand-ins (bench/fake_worker.py) so that one case takes seconds. In these
cases the killed coordinator's workers are killed here (as if they had died with it), so the
restarted one finds none alive and launches the first layout again.

``test_killed_mid_training_reattaches_the_live_workers``: real training (megatron-core
``tiny`` on two processes), the coordinator SIGKILLed mid-training and started again; its
workers live on, are reattached, and train on from their step.
``test_killed_after_a_grow_reattaches_the_joiners_too``: the same after the job grew from 2
to 4 workers (the joiners on devices granted after the start, every worker forked from the
preloader, as under ``slurm-etc run``): all four are reattached.
``test_a_worker_dead_at_the_restart_is_a_loss_not_a_start_again``: one of those joiners
SIGKILLed while the coordinator is away: the three others are reattached and the layout
resizes around the dead one.

Oracles, sharing no code with the coordinator: the record read with plain sqlite3, the
backend's own log of every request and release (tests/dist/restart_driver.py), /proc, the
workers' own logs, and an uninterrupted run's losses."""
from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_etc.coordinator.loop import KILL_POINTS
from slurm_etc.testing.hooks import COORDINATOR_INJECT

DRIVER = Path(__file__).with_name("restart_driver.py")
REATTACH_DRIVER = Path(__file__).with_name("reattach_driver.py")
STEPS, KILL_AT = 40, 15


def _run(tmp: Path, job: str, inject: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != COORDINATOR_INJECT}
    if inject:
        env[COORDINATOR_INJECT] = inject
    return subprocess.run([sys.executable, str(DRIVER), str(tmp), job], env=env,
                          capture_output=True, text=True, timeout=300)


def _workers_of(job: str) -> list[int]:
    """Live (not zombie) processes whose environment names this test's job."""
    mark = f"SLURM_ETC_JOB={job}".encode()
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") and \
                    "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text():
                pids.append(int(pid))
        except OSError:
            continue
    return sorted(pids)


def _reattach_run(out: Path, job: str, *extra: str, inject: str | None = None
                  ) -> subprocess.Popen[str]:
    out.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(COORDINATOR_INJECT, None)
    if inject:
        env[COORDINATOR_INJECT] = inject
    return subprocess.Popen([sys.executable, str(REATTACH_DRIVER), str(out), job, str(STEPS),
                             *extra], env=env, stdout=subprocess.PIPE, text=True,
                            stderr=open(out / f"driver-{time.monotonic_ns()}.log", "w"))


def _heard(out: Path) -> list[dict]:
    path = out / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] \
        if path.exists() else []


def _finish(proc: subprocess.Popen[str], out: Path, job: str) -> dict:
    try:
        stdout, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()  # its workers outlive it: they go too
            for pid in _workers_of(job):
                os.kill(pid, signal.SIGKILL)
    logs = "".join(p.read_text() for p in sorted(out.glob("driver-*.log")))
    assert proc.returncode == 0, logs[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.timeout(1200)  # two real trainings and a restart, on a loaded machine
def test_killed_mid_training_reattaches_the_live_workers(tmp_path: Path) -> None:
    """SIGKILL the coordinator at step KILL_AT of STEPS and start it again on the same job
    and record: the workers it launched are still alive, are reattached (no process is
    launched again, no generation opened again), and the job finishes; each worker trains
    every step once, and every loss heard is bit-equal to an uninterrupted run's."""
    ref_job = f"reattach-ref-{os.getpid()}"
    ref = _finish(_reattach_run(tmp_path / "ref", ref_job), tmp_path / "ref", ref_job)
    assert ref == {"state": "finished", "step": STEPS}
    reference = {p["step"]: p["loss"] for p in _heard(tmp_path / "ref")}
    assert sorted(reference) == list(range(1, STEPS + 1))

    out, job = tmp_path / "run", f"reattach-{os.getpid()}"
    first = _reattach_run(out, job)
    try:
        deadline = time.monotonic() + 600
        while max((p["step"] for p in _heard(out)), default=0) < KILL_AT:
            assert first.poll() is None, "the first coordinator ended on its own"
            assert time.monotonic() < deadline, "no training step"
            time.sleep(0.05)
        workers = _workers_of(job)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    killed_step = max(p["step"] for p in _heard(out))
    try:
        time.sleep(2.0)
        # the workers outlive a SIGKILLed coordinator (they hold for the reattach wait)
        assert len(workers) == 2 and _workers_of(job) == workers, (workers, _workers_of(job))
        result = _finish(_reattach_run(out, job), out, job)
        assert not _workers_of(job), "workers left after the job finished"
    finally:
        for pid in _workers_of(job):
            os.kill(pid, signal.SIGKILL)
    assert result == {"state": "finished", "step": STEPS}

    # every step trained once by each worker, from 1 to STEPS (no step trained twice, none
    # skipped), by the same two processes (the worker logs are appended)
    logs = sorted((out / "workers").glob("*.log"))
    assert len(logs) == 2, logs
    for log in logs:
        text = log.read_text()
        steps = [int(m) for m in re.findall(r"\] step (\d+) loss", text)] or \
            [int(m) for m in re.findall(r" step (\d+) loss ", text)]
        assert steps == list(range(1, STEPS + 1)), (log.name, steps)
        assert text.count("training dp=") == 1, text[-2000:]  # started once
        assert "reattached to the coordinator" in text, text[-2000:]

    # the losses heard, by both coordinators, are the uninterrupted run's bit for bit
    heard = _heard(out)
    runs: dict[int, list[dict]] = {}
    for p in heard:
        runs.setdefault(p["run"], []).append(p)
    assert len(runs) == 2, runs.keys()
    before, after = runs.values()
    assert max(p["step"] for p in before) == killed_step
    assert min(p["step"] for p in after) > killed_step  # nothing heard twice
    assert max(p["step"] for p in after) == STEPS
    assert all(p["loss"] == reference[p["step"]] for p in heard), \
        [(p["step"], p["loss"], reference[p["step"]]) for p in heard
         if p["loss"] != reference[p["step"]]][:5]
    # at most the steps whose report was in the killed coordinator's socket are unheard
    assert len({p["step"] for p in heard}) >= STEPS - 2

    con = sqlite3.connect(f"file:{out / 'job.db'}?mode=ro", uri=True)
    try:
        gens = con.execute("SELECT number, last_step FROM generations").fetchall()
        launches = con.execute("SELECT count(*) FROM events WHERE kind = 'launch'"
                               ).fetchone()[0]
        reattached = con.execute("SELECT json_extract(payload, '$.summary') FROM events "
                                 "WHERE kind = 'reattach'").fetchall()
        state = con.execute("SELECT state FROM jobs").fetchone()[0]
    finally:
        con.close()
    assert gens == [(0, STEPS)], gens  # one generation, trained to the end
    assert launches == 2, launches  # nothing launched again
    assert len(reattached) == 1 and "reattached 2 live worker(s) of generation 0" in \
        reattached[0][0], reattached
    assert state == "finished"


def _launched(db: Path) -> dict[int, tuple[int, int]]:
    """vrank -> (generation, pid) of every worker the record says was launched."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT json_extract(payload, '$.vrank'), json_extract(payload, "
                           "'$.generation'), json_extract(payload, '$.pid') FROM events "
                           "WHERE kind = 'launch' ORDER BY id").fetchall()
    finally:
        con.close()
    return {v: (g, pid) for v, g, pid in rows}


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


GROW_AT, GROWN_KILL_AT = 5, 20


def _holding(out: Path, vranks: int) -> bool:
    """Whether every worker's log says it holds for a restarted coordinator (at a step
    boundary, not inside a collective)."""
    logs = list((out / "workers").glob("gen*-vrank*.log"))
    return len(logs) == vranks and all("holding for a restarted coordinator" in log.read_text()
                                        for log in logs)


def _open_resize_from(db: Path, generation: int) -> bool:
    """Whether the record holds a migration from ``generation`` not yet finished."""
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)
        try:
            return bool(con.execute("SELECT count(*) FROM migrations WHERE from_generation = ? "
                                    "AND outcome IS NULL", (generation,)).fetchone()[0])
        finally:
            con.close()
    except sqlite3.Error:
        return False


def grow_kill_restart(tmp: Path, *plant: str, lose: int | None = None,
                      in_resize: bool = False) -> None:
    """Grow 2 -> 4 at step GROW_AT, SIGKILL the coordinator once generation 1 trained to
    GROWN_KILL_AT, start it again on the same record: every worker reattached, training goes
    on from the step it reached (``plant``: the driver's planted bug). ``lose``: that
    vrank's process group is SIGKILLed too while the coordinator is away (once every worker
    holds): the three others are reattached and the layout resizes around it.
    ``in_resize``: that vrank is SIGKILLed first, and the coordinator once the resize
    around it is ordered (its workers inside it, or waiting for it): the same ending."""
    out, job = tmp / "run", f"grown-{os.getpid()}-{len(plant)}-{lose}-{in_resize}"
    extra = (str(GROW_AT), "preload", *plant)
    first = _reattach_run(out, job, *extra)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while not any(p["generation"] >= 1 and p["step"] >= GROWN_KILL_AT
                      for p in _heard(out)):
            assert first.poll() is None, "the first coordinator ended on its own"
            assert time.monotonic() < deadline, "no training step after the grow"
            time.sleep(0.05)
        launched = _launched(out / "job.db")
        if in_resize:
            assert lose is not None
            os.killpg(launched[lose][1], signal.SIGKILL)
            until = time.monotonic() + 120
            while not _open_resize_from(out / "job.db", 1):
                assert first.poll() is None and time.monotonic() < until, \
                    "no resize ordered around the dead worker"
                time.sleep(0.01)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        killed_step = max(p["step"] for p in _heard(out))
        pids = [pid for v, (_g, pid) in launched.items() if not in_resize or v != lose]
        assert {v: g for v, (g, _p) in launched.items()} == {0: 0, 1: 0, 2: 1, 3: 1}, launched
        time.sleep(2.0)
        assert all(_alive(pid) for pid in pids), "a worker died with its coordinator"
        if lose is not None and not in_resize:
            until = time.monotonic() + 60
            while not _holding(out, 4):
                assert time.monotonic() < until, "the workers do not hold"
                time.sleep(0.1)
            os.killpg(launched[lose][1], signal.SIGKILL)
            time.sleep(0.5)
        second = _reattach_run(out, job, *extra)
        try:
            stdout, _ = second.communicate(timeout=600)
        finally:
            if second.poll() is None:
                second.kill()
        logs = "".join(p.read_text() for p in sorted(out.glob("driver-*.log")))
        assert second.returncode == 0, logs[-4000:]
        assert json.loads(stdout.strip().splitlines()[-1]) == \
            {"state": "finished", "step": STEPS}
    finally:
        if first.poll() is None:
            first.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    restarted = logs[logs.rfind("coordinator restarted"):].splitlines()[0]
    if lose is not None:
        assert "reattached 3 live worker(s) of generation 1" in restarted, restarted
        assert f"vrank(s) {lose} dead: lost" in restarted, restarted
    else:
        assert "reattached 4 live worker(s) of generation 1" in restarted, restarted
    # the restarted coordinator heard only steps after the kill (nothing trained again)
    runs: dict[int, list[int]] = {}
    for p in _heard(out):
        runs.setdefault(p["run"], []).append(p["step"])
    assert len(runs) == 2, runs.keys()
    before, after = runs.values()
    assert max(before) == killed_step and min(after) > killed_step, (before, after)
    assert max(after) == STEPS
    # each of the four processes trained its steps once, none again after the restart
    for log in sorted((out / "workers").glob("gen*-vrank*.log")):
        text = log.read_text()
        steps = [int(m) for m in re.findall(r"\] step (\d+) loss", text)]
        if lose is not None and log.name.endswith(f"vrank{lose}.log"):
            assert steps == list(range(steps[0], steps[-1] + 1)) and steps[-1] <= killed_step + 2
            continue
        if lose is not None and log.name.startswith("gen1-"):
            # the other joiner: left the job at the resize around the dead one, or trains on
            assert steps == list(range(steps[0], steps[-1] + 1)), (log.name, steps)
        else:
            assert steps == list(range(steps[0], STEPS + 1)), (log.name, steps[:3], steps[-3:])
        assert "reattached to the coordinator" in text, (log.name, text[-2000:])
    con = sqlite3.connect(f"file:{out / 'job.db'}?mode=ro", uri=True)
    try:
        gens = con.execute("SELECT number, last_step FROM generations").fetchall()
        launches = con.execute("SELECT count(*) FROM events WHERE kind = 'launch'"
                               ).fetchone()[0]
        grants = con.execute("SELECT count(*) FROM events WHERE kind = 'grant'").fetchone()[0]
    finally:
        con.close()
    assert launches == 4 and grants == 2, (launches, grants)  # nothing launched or granted again
    if lose is None:
        assert gens == [(0, gens[0][1]), (1, STEPS)], gens  # no generation opened again
        return
    # the loss: one resize from generation 1 around the dead vrank, committed, and the
    # layout after it trains to the end (nothing started again from step 1)
    con = sqlite3.connect(f"file:{out / 'job.db'}?mode=ro", uri=True)
    try:
        resizes = con.execute("SELECT from_generation, to_generation, outcome FROM migrations "
                              "WHERE from_generation >= 1").fetchall()
        first = con.execute("SELECT first_step FROM generations WHERE number = 2").fetchone()
    finally:
        con.close()
    if in_resize:  # the one in flight at the kill aborted, then done again, committed
        assert resizes == [(1, 2, "aborted"), (1, 3, "committed")], resizes
        first = con_first(out / "job.db", 3)
        assert gens[-1] == (3, STEPS) and first is not None and first >= killed_step, \
            (gens, first)
        return
    assert resizes == [(1, 2, "committed")], resizes
    assert gens[-1] == (2, STEPS) and first is not None and first[0] >= killed_step, (gens, first)


def con_first(db: Path, generation: int) -> int | None:
    """The first step the record gives ``generation``."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = con.execute("SELECT first_step FROM generations WHERE number = ?",
                          (generation,)).fetchone()
    finally:
        con.close()
    return None if row is None else row[0]


@pytest.mark.timeout(1200)  # two real trainings and a restart, on a loaded machine
def test_killed_inside_the_resize_around_a_dead_worker_trains_no_step_twice(
        tmp_path: Path) -> None:
    """Issue #43 (soak seed 102): a grown job loses vrank 3, and the coordinator is SIGKILLed
    once the resize around it is ordered. The live workers, inside that resize or waiting
    for it, give it up (nothing commits without their vote) and hold for the restarted
    coordinator instead of exiting; it reattaches the three, aborts the resize in the
    record and orders it again: training goes on from the step reached. Before: the
    workers died of the store's closed connection in the resize, and the job trained
    again from step 1."""
    grow_kill_restart(tmp_path, lose=3, in_resize=True)


@pytest.mark.timeout(900)  # a real training grown and restarted, on a loaded machine
def test_killed_after_a_grow_reattaches_the_joiners_too(tmp_path: Path) -> None:
    """Issue #43: SIGKILL the coordinator of a job that grew from 2 to 4 workers (the joiners
    on devices granted after the start) and start it again on the same job and record: the
    local backend takes up the cluster the killed one left (the grant held again), all four
    workers are reattached, and training goes on from the step it reached, not from step 1.
    With the kept cluster not taken up (the driver's ``forget`` plant) the joiners' devices
    are not held, vranks 2 and 3 are not adopted, and the job starts again: caught."""
    grow_kill_restart(tmp_path)


@pytest.mark.timeout(900)  # as above
def test_a_worker_dead_at_the_restart_is_a_loss_not_a_start_again(tmp_path: Path) -> None:
    """Issue #43: the same grown job, and one of its joiners (vrank 3) SIGKILLed while the
    coordinator is away: the restarted coordinator reattaches the three that live, counts
    vrank 3's device as failed, and the first decision resizes around it (a dp replica holds
    its shards) as after a node lost without grace; training goes on from the step reached,
    never from step 1. Before: "vrank(s) 3 of generation 1 are not alive; stopping the 3
    live worker(s) and starting again"."""
    grow_kill_restart(tmp_path, lose=3)


def _kill_orphans(job: str) -> int:
    """SIGKILL the workers a killed coordinator left (found by their SLURM_ETC_JOB, which
    names this test's job only)."""
    mark = f"SLURM_ETC_JOB={job}".encode()
    killed = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark in environ:
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    time.sleep(0.5)
    return killed


def problems(db: Path, actions: list[dict]) -> list[str]:
    """What is lost or doubled, from the record (plain sqlite3) and the backend's log."""
    out = []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows, keys, handled = con.execute(
            "SELECT count(*), count(DISTINCT dedup_key), count(handled_at) FROM events"
        ).fetchone()
        if rows != keys:
            out.append(f"{rows} events for {keys} keys")
        if handled != rows:
            out.append(f"{rows - handled} events never handled")
        for alloc, n in con.execute(
                "SELECT json_extract(payload, '$.allocation'), count(*) FROM events "
                "WHERE kind = 'grant' GROUP BY 1"):
            if n != 1:
                out.append(f"grant of {alloc} recorded {n} times")
        for key, n in con.execute(
                "SELECT json_extract(payload, '$.request'), count(*) FROM events WHERE "
                "kind = 'grant' AND json_extract(payload, '$.request') IS NOT NULL GROUP BY 1"):
            if n != 1:
                out.append(f"request {key} granted {n} times")
        grants = con.execute("SELECT count(*) FROM events WHERE kind = 'grant'").fetchone()[0]
        allocs = con.execute("SELECT count(DISTINCT backend_id), count(*) FROM allocations"
                             ).fetchone()
        if allocs[0] != allocs[1] or allocs[1] != grants:
            out.append(f"{allocs[1]} allocation rows, {allocs[0]} distinct, {grants} grants")
        unfinished = con.execute("SELECT count(*) FROM migrations WHERE outcome IS NULL"
                                 ).fetchone()[0]
        if unfinished:
            out.append(f"{unfinished} migrations never finished")
        for gen, n in con.execute("SELECT to_generation, count(*) FROM migrations WHERE "
                                  "outcome = 'committed' GROUP BY 1"):
            if n != 1:
                out.append(f"generation {gen} committed {n} times")
        for gen, n in con.execute("SELECT number, count(*) FROM generations GROUP BY 1 "
                                  "HAVING count(*) > 1"):
            out.append(f"generation {gen} opened {n} times")
        for gen, in con.execute("SELECT g.number FROM generations g JOIN migrations m "
                                "ON m.to_generation = g.number AND m.outcome = 'aborted'"):
            out.append(f"generation {gen} opened though its migration aborted")
        state = con.execute("SELECT state FROM jobs").fetchone()[0]
        if state != "finished":
            out.append(f"job {state}")
    finally:
        con.close()
    # a key is one request: a restarted coordinator may send an open request again under
    # its key (the backend that has it does nothing), one coordinator never twice
    requested = [(a.get("run"), a["request"]) for a in actions if "request" in a]
    if len(set(requested)) != len(requested):
        out.append(f"request keys sent twice by one coordinator: {requested}")
    released = [d for a in actions if "release" in a for d in a["release"]]
    if len(set(released)) != len(released):
        out.append(f"devices released twice: {released}")
    return out


@pytest.mark.parametrize("point", KILL_POINTS)
def test_killed_and_restarted(tmp_path: Path, point: str) -> None:
    job = f"restart-{point}-{os.getpid()}"
    first = _run(tmp_path, job, point)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert f"{COORDINATOR_INJECT}={point}" in first.stderr
    _kill_orphans(job)
    con = sqlite3.connect(tmp_path / "job.db")
    before = con.execute("SELECT kind, dedup_key FROM events ORDER BY id").fetchall()
    in_flight = con.execute("SELECT count(*) FROM migrations WHERE outcome IS NULL"
                            ).fetchone()[0]
    committed_before = con.execute("SELECT id, to_generation FROM migrations WHERE "
                                   "outcome = 'committed'").fetchall()
    con.close()
    second = _run(tmp_path, job, None)
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads(second.stdout.strip().splitlines()[-1])["state"] == "finished"
    actions = [json.loads(line) for line in
               (tmp_path / "actions.jsonl").read_text().splitlines()]
    assert problems(tmp_path / "job.db", actions) == []
    con = sqlite3.connect(tmp_path / "job.db")
    after = con.execute("SELECT kind, dedup_key FROM events ORDER BY id").fetchall()
    aborted = con.execute("SELECT count(*) FROM migrations WHERE outcome = 'aborted' AND "
                          "error = 'coordinator restarted'").fetchone()[0]
    committed = con.execute("SELECT id, to_generation FROM migrations WHERE "
                            "outcome = 'committed' AND lost_first_step IS NULL").fetchall()
    # a restart with no worker left to take up (killed here) starts again from step 1 (no
    # checkpoint): recorded as a migration into the new generation with every step lost
    restarts = con.execute("SELECT lost_first_step, rebuilt_from FROM migrations WHERE "
                           "outcome = 'committed' AND lost_first_step IS NOT NULL").fetchall()
    last_world = con.execute("SELECT world_size FROM generations ORDER BY number DESC LIMIT 1"
                             ).fetchone()[0]
    con.close()
    assert after[:len(before)] == before  # nothing recorded before the kill is lost
    assert aborted == in_flight  # the migration in flight is closed once, as aborted
    assert committed[:len(committed_before)] == committed_before  # a commit stays one
    if point == "after-commit-record":
        # killed after writing the commit: it stays committed (not re-run, not aborted);
        # the restarted coordinator's backend still holds the granted node (the local
        # cluster kept beside the record), so the first layout starts again on both nodes:
        # no second grow (before the cluster was kept, it grew once more)
        assert in_flight == 0 and len(committed_before) == 1 and len(committed) == 1
    elif point == "after-order":
        # the grow in flight is closed as aborted; its node is still held, and the first
        # layout starts again on both nodes (no migration)
        assert committed_before == [] and committed == []
    elif point == "after-request":
        # the open request is sent again at the restart, before the first layout starts:
        # granted at once here, the job starts on both nodes (no migration) or grows once
        assert committed_before == [] and len(committed) <= 1
    else:
        assert committed_before == [] and len(committed) == 1  # the grow happened once
    assert last_world == 4  # on both nodes at the end
    assert restarts in ([], [(1, None)]), restarts
    if point == "after-order":
        assert in_flight == 1


def test_oracle_catches_doubles(tmp_path: Path) -> None:
    """Planted bugs: a grant recorded twice, an unfinished migration, a request key sent
    twice, a device released twice, a generation opened twice, a generation opened whose
    migration aborted: each is reported."""
    db = tmp_path / "planted.db"
    con = sqlite3.connect(db)
    con.executescript("""
        CREATE TABLE events (id INTEGER PRIMARY KEY, dedup_key TEXT, kind TEXT, payload TEXT,
                             handled_at TEXT);
        CREATE TABLE allocations (backend_id TEXT);
        CREATE TABLE migrations (to_generation INT, outcome TEXT);
        CREATE TABLE jobs (state TEXT);
        CREATE TABLE generations (number INT);
        INSERT INTO generations VALUES (0), (1), (1);
        INSERT INTO events VALUES (1, 'grant:a0:x', 'grant', '{"allocation": "a0"}', 't'),
                                  (2, 'grant:a0:y', 'grant', '{"allocation": "a0"}', 't'),
                                  (3, 'grant:a1:z', 'grant',
                                   '{"allocation": "a1", "request": "grow-1"}', 't'),
                                  (4, 'grant:a2:z', 'grant',
                                   '{"allocation": "a2", "request": "grow-1"}', 't');
        INSERT INTO allocations VALUES ('a0');
        INSERT INTO migrations VALUES (1, 'committed'), (2, NULL), (0, 'aborted');
        INSERT INTO jobs VALUES ('finished');
    """)
    con.commit()
    con.close()
    found = problems(db, [{"request": "grow-1", "run": 1}, {"request": "grow-1", "run": 1},
                          {"release": ["n1:0"]}, {"release": ["n1:0"]}])
    assert any("grant of a0 recorded 2 times" in p for p in found)
    assert any("1 migrations never finished" in p for p in found)
    assert any("request keys sent twice" in p for p in found)
    assert any("devices released twice" in p for p in found)
    assert any("allocation rows" in p for p in found)
    assert any("generation 1 opened 2 times" in p for p in found)
    assert any("request grow-1 granted 2 times" in p for p in found)
    assert any("generation 0 opened though its migration aborted" in p for p in found)


@pytest.mark.timeout(1200)  # a real training grown and restarted, on a loaded machine
def test_killed_once_the_commit_is_decided_rolls_the_resize_forward(tmp_path: Path) -> None:
    """Issue #43 (soak seed 209): the coordinator SIGKILLed as the grow 2 -> 4 is decided
    commit (recorded, no rank told yet). The workers, whose vote lost the store, hold for
    the restarted coordinator and ask the decision again; it finds the decision in the
    record, records the resize committed (not aborted: "the record said generation 7 trained
    on while the workers trained generation 8"), sets the decision in its store, and takes
    the four workers up in the new generation: none relaunched, no step trained twice."""
    out, job = tmp_path / "run", f"decided-{os.getpid()}"
    extra = (str(GROW_AT), "preload")
    first = _reattach_run(out, job, *extra, inject="after-commit-decided")
    pids: list[int] = []
    try:
        first.wait(600)
        assert first.returncode == -signal.SIGKILL, "the coordinator was not killed"
        pids = [pid for _g, pid in _launched(out / "job.db").values()]
        killed_step = max(p["step"] for p in _heard(out))
        result = _finish(_reattach_run(out, job, *extra), out, job)
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert result == {"state": "finished", "step": STEPS}
    logs = "".join(p.read_text() for p in sorted(out.glob("driver-*.log")))
    assert "the resize to generation 1 was decided commit before the kill" in logs, logs[-3000:]
    assert "reattached 4 live worker(s) of generation 1" in logs, logs[-3000:]
    con = sqlite3.connect(f"file:{out / 'job.db'}?mode=ro", uri=True)
    try:
        migrations = con.execute("SELECT from_generation, to_generation, outcome FROM "
                                 "migrations").fetchall()
        gens = con.execute("SELECT number, first_step, last_step FROM generations").fetchall()
        launches = con.execute("SELECT count(*) FROM events WHERE kind = 'launch'"
                               ).fetchone()[0]
    finally:
        con.close()
    assert migrations == [(0, 1, "committed")], migrations
    assert [g[0] for g in gens] == [0, 1] and gens[-1][2] == STEPS, gens
    assert launches == 4, launches  # nothing launched again
    for log in sorted((out / "workers").glob("gen*-vrank*.log")):
        text = log.read_text()
        steps = [int(m) for m in re.findall(r"\] step (\d+) loss", text)]
        assert steps == list(range(steps[0], STEPS + 1)), (log.name, steps[:3], steps[-3:])
        assert steps[0] <= killed_step + 1 or log.name.startswith("gen1-"), log.name
