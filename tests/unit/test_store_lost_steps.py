"""Steps lost with a node (migration 0003_lost_steps): recorded with the committed migration
that rebuilt the lost state, shown by status, refused when they make no sense (by the API and
by the schema's own checks), and absent without harm from a record written before them."""
import sqlite3
from datetime import datetime, timezone

import pytest

from slurm_etc.store import (
    RecordError,
    create_job,
    job_detail,
    open_store,
    open_store_readonly,
    record_migration_finish,
    record_migration_start,
)

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 1, 3, 0, 0, tzinfo=timezone.utc)


def _migration(store, job="7", to=1):
    create_job(store, job, name="n", owner_uid=1, owner_name="a", backend="local", at=T0)
    return record_migration_start(store, job, from_generation=to - 1, to_generation=to,
                                  plan_digest=f"d{to}", moved_bytes=10, kept_bytes=5,
                                  lower_bound_bytes=10, messages=1, rounds=1, at=T0)


def test_lost_steps_and_their_source_are_recorded_and_shown(tmp_path):
    store = open_store(tmp_path / "etc.db")
    try:
        mid = _migration(store)
        record_migration_finish(store, mid, outcome="committed", measured_seconds=2.0,
                                lost_steps=(5, 7), rebuilt_from="peer-copies", at=T0)
        (m,) = job_detail(store, "7").migrations
        assert (m.lost_steps, m.rebuilt_from) == ((5, 7), "peer-copies")
        shown = job_detail(store, "7").to_json(now=T0)["migrations"][0]
        assert shown["lost_steps"] == [5, 7] and shown["rebuilt_from"] == "peer-copies"
        # a repeat (a restarted coordinator) changes nothing
        record_migration_finish(store, mid, outcome="committed", lost_steps=(1, 1))
        assert job_detail(store, "7").migrations[0].lost_steps == (5, 7)
    finally:
        store.close()


@pytest.mark.parametrize("kwargs,says", [
    ({"outcome": "committed", "lost_steps": (0, 3)}, "1 <= first <= last"),
    ({"outcome": "committed", "lost_steps": (6, 5)}, "1 <= first <= last"),
    ({"outcome": "committed", "lost_steps": (5, "7")}, "1 <= first <= last"),
    ({"outcome": "committed", "rebuilt_from": "tape"}, "unknown rebuilt_from 'tape'"),
    ({"outcome": "aborted", "lost_steps": (5, 5)}, "rebuilt nothing"),
])
def test_nonsense_is_refused_and_nothing_written(tmp_path, kwargs, says):
    store = open_store(tmp_path / "etc.db")
    try:
        mid = _migration(store)
        with pytest.raises(RecordError, match=says):
            record_migration_finish(store, mid, **kwargs)
        (m,) = job_detail(store, "7").migrations
        assert (m.outcome, m.lost_steps, m.rebuilt_from) == (None, None, None)
    finally:
        store.close()


@pytest.mark.parametrize("first,last,source", [
    (6, 5, "NULL"), (0, 0, "NULL"), (3, None, "NULL"), (None, 3, "NULL"),
    (None, None, "'tape'")])
def test_the_schema_refuses_what_the_api_refuses(tmp_path, first, last, source):
    """Another writer (plain sqlite3) cannot store nonsense either: the migration's checks."""
    path = tmp_path / "etc.db"
    store = open_store(path)
    mid = _migration(store)
    store.close()
    with sqlite3.connect(path) as db, pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        db.execute(f"update migrations set lost_first_step = ?, lost_last_step = ?, "
                   f"rebuilt_from = {source} where id = ?", (first, last, mid))


def test_a_record_from_before_the_columns_reads_as_nothing_lost_and_upgrades(tmp_path):
    from alembic import command

    from slurm_etc.store.db import alembic_config

    path = tmp_path / "old.db"
    command.upgrade(alembic_config(f"sqlite:///{path}"), "0002_jobs")
    with sqlite3.connect(path) as db:
        db.execute("insert into jobs (job_id, name, owner_uid, owner_name, state, backend, "
                   "created_at, updated_at) values ('7', 'n', 1, 'a', 'finished', 'local', "
                   "'2026-12-01 03:00:00', '2026-12-01 03:00:00')")
        db.execute("insert into migrations (job_id, from_generation, to_generation, "
                   "plan_digest, moved_bytes, kept_bytes, lower_bound_bytes, messages, "
                   "rounds, outcome, started_at) values ('7', 0, 1, 'd', 1, 0, 1, 1, 1, "
                   "'committed', '2026-12-01 03:00:00')")
    old = open_store_readonly(path)  # status reading an older job's snapshot
    try:
        (m,) = job_detail(old, "7").migrations
        assert (m.outcome, m.lost_steps, m.rebuilt_from) == ("committed", None, None)
    finally:
        old.close()
    store = open_store(path)  # a writer brings it to the head, the row kept
    try:
        (m,) = job_detail(store, "7").migrations
        assert (m.outcome, m.moved_bytes, m.lost_steps) == ("committed", 1, None)
    finally:
        store.close()


def test_status_shows_the_lost_steps(tmp_path):
    import json
    import os
    from datetime import timedelta

    from click.testing import CliRunner

    from slurm_etc.cli.main import cli

    path = tmp_path / "etc.db"
    store = open_store(path)
    create_job(store, "7", name="n", owner_uid=os.getuid(), owner_name="me",
               backend="local", at=T0)
    mid = record_migration_start(store, "7", from_generation=0, to_generation=1,
                                 plan_digest="d", moved_bytes=10, kept_bytes=5,
                                 lower_bound_bytes=10, messages=1, rounds=1, at=T0)
    record_migration_finish(store, mid, outcome="committed", lost_steps=(5, 6),
                            rebuilt_from="checkpoint", at=T0)
    store.close()
    obj = {"now": lambda: T0 + timedelta(minutes=1), "uid": os.getuid()}
    shown = CliRunner().invoke(cli, ["status", "7", "--db", str(path)], obj=obj)
    assert shown.exit_code == 0, shown.output
    words = " ".join(shown.output.split())  # the table wraps the cell
    assert "lost steps 5-6 (rebuilt from checkpoint of step 4, trained again)" in words
    as_json = CliRunner().invoke(cli, ["status", "7", "--db", str(path), "--json"], obj=obj)
    (m,) = json.loads(as_json.stdout)["jobs"][0]["migrations"]
    assert (m["lost_steps"], m["rebuilt_from"]) == ([5, 6], "checkpoint")
