"""Load: a burst of 1,000 node events reaches the real coordinator (real SQLite record, WAL)
and none is lost or doubled; a reader holding a read transaction in another process does not
block the writer. Counts are read back with plain sqlite3, not through the store's code.
No timing is asserted here (bench/coordinator_load.py prints the figures; its smoke run is
the last test)."""
from __future__ import annotations

import json
import multiprocessing as mp
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.alloc.topology import ClusterTopology, Device
from slurm_etc.coordinator import deciding, observe
from slurm_etc.coordinator.backend import Grant, Loss, PreemptNotice
from slurm_etc.plan import load_model
from slurm_etc.policy.rules import EffectivePolicy
from tests.unit.coordinator_harness import HandDrivenBackend, coordinator_over

JOB = "burst"
ROOT = Path(__file__).resolve().parents[2]


class Burst(HandDrivenBackend):
    """A simulated cluster handing over one burst of events per ``arm``; actions ignored."""

    def __init__(self, nodes: int = 400, gpus: int = 8) -> None:
        super().__init__(ClusterTopology(gpus, tuple(f"n{i}" for i in range(nodes))))
        self.gpus = gpus

    def events(self, n: int, tag: str) -> list[Any]:
        out: list[Any] = []
        grants = n * 2 // 5
        for i in range(grants):
            out.append(Grant(f"{tag}{i}", tuple(Device(f"n{i}", k) for k in range(self.gpus))))
        for j in range(n - grants):
            g = out[j // 2]
            out.append(PreemptNotice(g.allocation, g.devices, time.time() + 900) if j % 2 == 0
                       else Loss(g.allocation, g.devices))
        return out


@pytest.fixture
def coordinator(tmp_path: Path) -> Any:
    cluster = Burst()
    with coordinator_over(tmp_path, JOB, cluster,
                          training=TrainingJob(load_model("llama-7b"), 512, 1, True),
                          policy=EffectivePolicy(grow=False), hardware=Hardware(gpus_per_node=8),
                          backend_name="local") as (c, db):
        yield c, cluster, db


def counts(db: str) -> tuple[int, int, int]:
    """(rows, distinct keys, handled) of the job's events, read with plain sqlite3."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute("SELECT count(*), count(DISTINCT dedup_key), count(handled_at) "
                           "FROM events WHERE job_id = ?", (JOB,)).fetchone()
    finally:
        con.close()


def in_order(db: str) -> list[tuple[str, str]]:
    """(kind, allocation) of the job's events in the order they were recorded."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return [tuple(r) for r in con.execute(
            "SELECT kind, json_extract(payload, '$.allocation') FROM events "
            "WHERE job_id = ? ORDER BY id", (JOB,))]
    finally:
        con.close()


def test_burst_of_1000_recorded_once_and_handled(coordinator: Any) -> None:
    c, cluster, db = coordinator
    burst = cluster.events(1000, "a")
    assert len({(type(e), e.allocation) for e in burst}) == 1000  # 1000 distinct events
    cluster.pending = burst
    observe.observe_backend(c)
    assert counts(db)[:2] == (1000, 1000)  # recorded before any is acted on
    kinds = {Grant: "grant", PreemptNotice: "preempt-notice", Loss: "loss"}
    assert in_order(db) == [(kinds[type(e)], e.allocation) for e in burst]
    deciding.decide_now(c)
    assert counts(db) == (1000, 1000, 1000)
    # the same burst reported again (a restarted coordinator re-reading the cluster) adds
    # nothing; a new one adds exactly its events
    cluster.pending = burst
    observe.observe_backend(c)
    deciding.decide_now(c)
    assert counts(db) == (1000, 1000, 1000)
    cluster.pending = cluster.events(10, "b")
    observe.observe_backend(c)
    assert counts(db)[:2] == (1010, 1010)


def test_count_oracle_catches_a_lost_row(coordinator: Any) -> None:
    """Planted bug: one recorded event deleted behind the store's back; the count says so."""
    c, cluster, db = coordinator
    cluster.pending = cluster.events(50, "a")
    observe.observe_backend(c)
    con = sqlite3.connect(db)
    con.execute("DELETE FROM events WHERE id = (SELECT max(id) FROM events)")
    con.commit()
    con.close()
    assert counts(db)[0] == 49


def _hold(db: str, started: Any, release: Any, seen: Any) -> None:
    con = sqlite3.connect(db, isolation_level=None, timeout=0.1)
    con.execute("BEGIN")
    seen[0] = con.execute("SELECT count(*) FROM events").fetchone()[0]
    started.set()
    release.wait(120)
    seen[1] = con.execute("SELECT count(*) FROM events").fetchone()[0]  # same snapshot
    con.execute("COMMIT")
    seen[2] = con.execute("SELECT count(*) FROM events").fetchone()[0]
    con.close()


def _hold_while_writing(db: str, write: Any) -> tuple[bool, list[int], Any]:
    ctx = mp.get_context("spawn")
    started, release = ctx.Event(), ctx.Event()
    seen = ctx.Array("l", [-1, -1, -1])
    proc = ctx.Process(target=_hold, args=(db, started, release, seen))
    proc.start()
    error: list[BaseException] = []
    try:
        assert started.wait(120)

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                error.append(exc)

        writer = threading.Thread(target=run, daemon=True)
        writer.start()
        writer.join(120)  # a liveness bound, not a timing: a blocked writer never returns
        finished = not writer.is_alive() and not error
    finally:
        release.set()
        proc.join(60)
    return finished, list(seen), error


def test_reader_holding_a_transaction_does_not_block_the_writer(coordinator: Any) -> None:
    c, cluster, db = coordinator
    cluster.pending = cluster.events(20, "a")
    observe.observe_backend(c)

    def burst() -> None:
        cluster.pending = cluster.events(1000, "b")
        observe.observe_backend(c)
        deciding.decide_now(c)

    finished, seen, error = _hold_while_writing(db, burst)
    assert finished, error
    assert seen == [20, 20, 1020]  # the reader kept its snapshot, then saw every row
    assert counts(db) == (1020, 1020, 1020)


def test_hold_check_catches_a_rollback_journal(tmp_path: Path) -> None:
    """Planted bug: the same record without WAL (a rollback journal); a reader holding a
    read transaction then blocks the writer's commit, and the check above reports it."""
    db = str(tmp_path / "plain.db")
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE events (id INTEGER PRIMARY KEY)")
    con.commit()
    con.close()

    def write() -> None:
        w = sqlite3.connect(db, timeout=0.5)
        try:
            w.execute("INSERT INTO events DEFAULT VALUES")
            w.commit()
        finally:
            w.close()

    finished, _seen, error = _hold_while_writing(db, write)
    assert not finished
    assert "locked" in str(error[0])


def test_bench_smoke() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "coordinator_load.py"),
                          "--events", "300", "--readers", "1", "--json"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"]
    for r in result["rounds"].values():
        assert (r["events"], r["recorded"], r["handled_total"]) == (300, 300, 300)
