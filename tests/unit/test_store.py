"""The SQLite store: migrations on open, policies written in short transactions."""
import re
import sqlite3
import threading

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, event

from slurm_etc.policy import PolicyError, ResizePolicy, Scope
from slurm_etc.store import (
    default_db_path,
    get_policy,
    list_policies,
    open_store,
    set_policy,
    unset_policy,
)
from slurm_etc.store.db import MIGRATIONS, head_revision

pytestmark = pytest.mark.unit

GPU = Scope("partition", "gpu")


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "etc.db")
    yield s
    s.close()


def test_migrations_ship_with_the_package():
    assert (MIGRATIONS / "env.py").exists()
    assert (MIGRATIONS / "versions" / "0001_policies.py").exists()


@pytest.fixture
def sql():
    """Every SQL statement any SQLAlchemy engine runs during the test."""
    statements = []

    def record(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    event.listen(Engine, "before_cursor_execute", record)
    yield statements
    event.remove(Engine, "before_cursor_execute", record)


def _migration_writes(statements):
    """Tables created and alembic_version stamps (one per revision applied) among
    ``statements``."""
    created = [m.group(1) for s in statements if (m := re.match(r"\s*CREATE TABLE (\w+)", s))]
    stamps = [s for s in statements if re.match(r"\s*(INSERT INTO|UPDATE) alembic_version", s)]
    return created, stamps


def _check_migrated_once(path, statements):
    revisions = list(ScriptDirectory(str(MIGRATIONS)).walk_revisions())
    created, stamps = _migration_writes(statements)
    assert len(stamps) == len(revisions), stamps  # every revision applied exactly once
    # a batch ALTER on SQLite copies through _alembic_tmp_<table>, once per migration
    # that alters that table
    made = [t for t in created if not t.startswith("_alembic_tmp_")]
    assert len(made) == len(set(made)), created
    with sqlite3.connect(path) as db:
        assert db.execute("select version_num from alembic_version").fetchall() == \
            [(head_revision(),)]
        tables = {name for (name,) in db.execute("select name from sqlite_master where "
                                                 "type = 'table'")
                  if not name.startswith("sqlite_")}
        # each table from one CREATE TABLE; a batch migration (SQLite's ALTER TABLE)
        # rebuilds a table as _alembic_tmp_<name>, renamed to <name>
        assert tables == {name.removeprefix("_alembic_tmp_") for name in created}
        assert db.execute("select count(*) from policies").fetchone() == (0,)


def test_open_creates_the_directory_and_migrates_once(tmp_path, sql):
    path = tmp_path / "a" / "b" / "etc.db"
    open_store(path).close()
    _check_migrated_once(path, sql)
    sql.clear()
    open_store(path).close()  # already at head: nothing to do
    assert _migration_writes(sql) == ([], [])


def test_concurrent_first_opens_migrate_once(tmp_path, sql):
    path = tmp_path / "etc.db"
    errors = []

    def opener():
        try:
            open_store(path).close()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=opener) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    _check_migrated_once(path, sql)


def test_default_path_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_ETC_DB", str(tmp_path / "x.db"))
    assert default_db_path() == tmp_path / "x.db"
    monkeypatch.delenv("SLURM_ETC_DB")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_db_path() == tmp_path / "slurm-etc" / "etc.db"


def test_set_merges_fields_and_records_who(store):
    set_policy(store, GPU, {"min_nodes": 2, "allowed_tp": (2, 4)}, "alice")
    got = set_policy(store, GPU, {"max_nodes": 8}, "bob")
    assert got.policy == ResizePolicy(min_nodes=2, max_nodes=8, allowed_tp=(2, 4))
    assert got.updated_by == "bob"
    assert get_policy(store, GPU).policy == got.policy
    assert get_policy(store, Scope("account", "ml")) is None


def test_an_invalid_change_writes_nothing(store):
    set_policy(store, GPU, {"max_nodes": 4}, "alice")
    with pytest.raises(PolicyError, match=r"partition:gpu: min_nodes \(8\) must not exceed "
                                          r"max_nodes \(4\) \(with the fields already set\)"):
        set_policy(store, GPU, {"min_nodes": 8, "grow": False}, "mallory")
    stored = get_policy(store, GPU)
    assert stored.policy == ResizePolicy(max_nodes=4) and stored.updated_by == "alice"


def test_the_database_rejects_nonsense_from_other_writers(store):
    with sqlite3.connect(store.path) as db, pytest.raises(sqlite3.IntegrityError):
        db.execute("insert into policies (scope_kind, scope_name, min_nodes, updated_at, "
                   "updated_by) values ('partition', 'x', 0, '2026-01-01', 'x')")


def test_unset_fields_then_the_whole_policy(store):
    set_policy(store, GPU, {"min_nodes": 2, "grow": False}, "alice")
    assert unset_policy(store, GPU, ["grow"], "alice").policy == ResizePolicy(min_nodes=2)
    assert unset_policy(store, GPU, ["min_nodes"], "alice") is None
    assert list_policies(store) == []
    with pytest.raises(PolicyError, match="partition:gpu has no policy"):
        unset_policy(store, GPU, None, "alice")


def test_list_orders_partitions_before_accounts(store):
    for scope in (Scope("account", "a"), Scope("partition", "z"), Scope("partition", "b")):
        set_policy(store, scope, {"grow": True}, "root")
    assert [str(p.scope) for p in list_policies(store)] == \
        ["partition:b", "partition:z", "account:a"]
    assert list_policies(store)[0].to_json()["grow"] is True
