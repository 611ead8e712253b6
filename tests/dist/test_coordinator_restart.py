"""Coordinator killed (SIGKILL) at each kill point, then restarted on the same job and
database: nothing recorded is lost or doubled, no node request is sent twice, the job ends.

The coordinator is the real one (run_job: SQLite record, control channel, local backend);
the workers are stand-ins (bench/fake_worker.py) so that one case takes seconds. The
restarted coordinator does not reattach the killed one's workers: they are killed here (they
are orphans) and the restarted one launches the first layout again.

Oracles, sharing no code with the coordinator: the record read with plain sqlite3 and the
backend's own log of every request and release (tests/dist/restart_driver.py)."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_etc.coordinator.loop import COORDINATOR_INJECT, KILL_POINTS

DRIVER = Path(__file__).with_name("restart_driver.py")


def _run(tmp: Path, job: str, inject: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != COORDINATOR_INJECT}
    if inject:
        env[COORDINATOR_INJECT] = inject
    return subprocess.run([sys.executable, str(DRIVER), str(tmp), job], env=env,
                          capture_output=True, text=True, timeout=300)


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
                            "outcome = 'committed'").fetchall()
    last_world = con.execute("SELECT world_size FROM generations ORDER BY number DESC LIMIT 1"
                             ).fetchone()[0]
    con.close()
    assert after[:len(before)] == before  # nothing recorded before the kill is lost
    assert aborted == in_flight  # the migration in flight is closed once, as aborted
    assert committed[:len(committed_before)] == committed_before  # a commit stays one
    if point == "after-commit-record":
        # killed after writing the commit: it stays committed (not re-run, not aborted);
        # the restarted coordinator starts the first layout again and grows once more
        assert in_flight == 0 and len(committed_before) == 1 and len(committed) == 2
    elif point == "after-request":
        # the open request is sent again at the restart, before the first layout starts:
        # granted at once here, the job starts on both nodes (no migration) or grows once
        assert committed_before == [] and len(committed) <= 1
    else:
        assert committed_before == [] and len(committed) == 1  # the grow happened once
    assert last_world == 4  # on both nodes at the end
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
