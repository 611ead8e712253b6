"""The lifecycles of slurm_etc.lifecycle in the record: transitions refused by the writer,
states outside the enums refused by the database itself, and the upgrade that added those
checks keeping every row of a record written before it."""
from __future__ import annotations

import os
import sqlite3
from datetime import datetime, timezone

import pytest

from slurm_etc.alloc import Device
from slurm_etc.lifecycle import (
    AllocationRole,
    AllocationState,
    Backend,
    DeviceState,
    JobState,
    sql_in,
)
from slurm_etc.store import (
    RecordError,
    create_job,
    job_detail,
    open_generation,
    open_store,
    record_allocation,
    set_device_state,
    set_job_state,
)

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 3, 12, 0, 0, tzinfo=timezone.utc)


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "etc.db")
    create_job(s, "7", name="n", owner_uid=1, owner_name="a", backend="local", at=T0)
    yield s
    s.close()


# (from, to, allowed): written out by hand, not derived from JOB_TRANSITIONS
MOVES = [
    ("starting", "running", True), ("running", "finished", True),
    ("running", "failed", True), ("running", "cancelled", True),
    ("running", "resizing", True), ("resizing", "running", True),
    ("failed", "running", True), ("cancelled", "running", True),
    ("running", "starting", False), ("finished", "running", False),
    ("finished", "failed", False), ("stopping", "running", False),
    ("failed", "finished", False),
]


def _bring(store, state):
    path = {"starting": [], "running": ["running"], "resizing": ["running", "resizing"],
            "stopping": ["running", "stopping"], "finished": ["running", "finished"],
            "failed": ["running", "failed"], "cancelled": ["running", "cancelled"]}[state]
    for s in path:
        set_job_state(store, "7", s, at=T0)


@pytest.mark.parametrize(("old", "new", "allowed"), MOVES,
                         ids=[f"{a}->{b}" for a, b, _ in MOVES])
def test_a_job_moves_only_along_its_lifecycle(store, old, new, allowed):
    _bring(store, old)
    if allowed:
        set_job_state(store, "7", new, at=T0)
        assert job_detail(store, "7").job.state == new
        return
    with pytest.raises(RecordError, match=f"job 7 .*{old}.*nothing was written"):
        set_job_state(store, "7", new, reason="should not land", at=T0)
    job = job_detail(store, "7").job
    assert (job.state, job.reason) == (old, None)


def test_a_resumed_job_is_no_longer_ended(store):
    _bring(store, "failed")
    assert job_detail(store, "7").job.ended_at is not None
    set_job_state(store, "7", "running", at=T0)
    assert job_detail(store, "7").job.ended_at is None


@pytest.mark.parametrize(("table", "column", "good", "bad"), [
    ("jobs", "state", "running", "runing"), ("jobs", "backend", "slurm", "k8s"),
    ("allocations", "state", "granted", "pending"), ("allocations", "role", "anchor", "boss"),
    ("devices", "state", "held", "busy"),
])
def test_the_database_refuses_a_state_outside_the_lifecycle(store, tmp_path, table, column,
                                                             good, bad):
    record_allocation(store, "7", "100", role="anchor", state="granted", nodes=["n1"], at=T0)
    set_device_state(store, "7", [Device("n1", 0)], "held", allocation="100", at=T0)
    store.close()
    with sqlite3.connect(tmp_path / "etc.db") as db:  # another writer, past store/jobs.py
        db.execute(f"update {table} set {column} = ?", (good,))
        with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
            db.execute(f"update {table} set {column} = ?", (bad,))


def test_the_migration_writes_out_the_enums_values():
    import importlib

    mig = importlib.import_module("slurm_etc.store.migrations.versions.0007_lifecycle_checks")
    enums = {"ck_jobs_state": ("state", JobState), "ck_jobs_backend": ("backend", Backend),
             "ck_allocations_state": ("state", AllocationState),
             "ck_allocations_role": ("role", AllocationRole),
             "ck_devices_state": ("state", DeviceState)}
    written = {name: cond for checks in mig.CHECKS.values() for name, cond in checks}
    assert written == {name: sql_in(col, e) for name, (col, e) in enums.items()}


def _record_at_0006(path):
    from alembic import command

    from slurm_etc.store.db import alembic_config

    command.upgrade(alembic_config(f"sqlite:///{path}"), "0006_preparation_stall")
    with sqlite3.connect(path) as db:
        db.executescript("""
            insert into jobs (job_id, name, owner_uid, owner_name, state, backend,
                              created_at, updated_at) values
                ('7', 'n', 1, 'a', 'running', 'slurm', '2026-12-01', '2026-12-01');
            insert into allocations (id, job_id, backend_id, role, state, nodes,
                                     requested_at) values
                (1, '7', '100', 'anchor', 'granted', 'n1', '2026-12-01');
            insert into devices (id, job_id, node, local_index, state, allocation_id,
                                 updated_at) values
                (1, '7', 'n1', 0, 'held', 1, '2026-12-01'),
                (2, '7', 'n1', 1, 'held', 1, '2026-12-01');
            """)


def _counts(path):
    with sqlite3.connect(path) as db:
        return {t: db.execute(f"select count(*) from {t}").fetchone()[0]
                for t in ("jobs", "allocations", "devices")} | {
            "allocated": db.execute("select count(*) from devices where allocation_id = 1"
                                    ).fetchone()[0]}


def test_the_upgrade_keeps_every_row_of_an_older_record(tmp_path):
    path = tmp_path / "old.db"
    _record_at_0006(path)
    before = _counts(path)
    assert before == {"jobs": 1, "allocations": 1, "devices": 2, "allocated": 2}
    store = open_store(path)  # upgrades to head
    open_generation(store, "7", 0, "dp=2,tp=1,pp=1", [0, 1],
                    {0: Device("n1", 0), 1: Device("n1", 1)}, at=T0)
    store.close()
    assert _counts(path) == before
    with sqlite3.connect(path) as db:
        ddl = db.execute("select sql from sqlite_master where name = 'jobs'").fetchone()[0]
    assert "ck_jobs_state" in ddl


def test_planted_an_upgrade_with_foreign_keys_on_loses_the_children(tmp_path):
    """The check above is able to fail: the same upgrade run with foreign keys on (the
    store's setting for every other connection) drops the rebuilt parent's children."""
    from alembic import command
    from sqlalchemy import create_engine, event

    from slurm_etc.store.db import alembic_config

    path = tmp_path / "old.db"
    _record_at_0006(path)
    engine = create_engine(f"sqlite:///{path}")
    event.listen(engine, "connect", lambda c, _r: c.execute("PRAGMA foreign_keys=ON"))
    cfg = alembic_config(f"sqlite:///{path}")
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    engine.dispose()
    assert _counts(path) != {"jobs": 1, "allocations": 1, "devices": 2, "allocated": 2}


def test_run_on_a_finished_job_is_one_line_and_starts_nothing(tmp_path, monkeypatch):
    """`slurm-etc run` on the record of a job that finished: refused before a secret, a
    channel or a worker exists; the record is unchanged."""
    from click.testing import CliRunner

    from slurm_etc.cli.main import cli

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    db = tmp_path / "job.db"
    s = open_store(db)
    create_job(s, "7", name="n", owner_uid=os.getuid(), owner_name="a", backend="local",
               at=T0)  # its owner runs it again
    _bring(s, "finished")
    s.close()
    def row():
        s = open_store(db)
        try:
            j = job_detail(s, "7").job
            return (j.state, j.reason, j.ended_at, j.coordinator)
        finally:
            s.close()
    before = row()
    res = CliRunner().invoke(cli, ["run", "--model", "tiny", "--global-batch", "8",
                                   "--nodes", "1", "--gpus-per-node", "2", "--job-id", "7",
                                   "--db", str(db), "--state-dir", str(tmp_path / "st"),
                                   "--", "true"])
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines()[-1].endswith(
        "job 7 is finished; a finished job is not started or changed again: run it under a "
        "new job id; nothing was written"), res.output
    assert "Traceback" not in res.output
    assert row() == before
    assert not any((tmp_path / "home").rglob("*")), "a secret or a file was written"
