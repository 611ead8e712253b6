"""`slurm-etc status`: snapshots in the state directory or a --db, owner filtering with an
injected uid, one-line errors, JSON contract, --watch."""
import json
import os
import sqlite3
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.store import (
    close_generation,
    create_job,
    mark_event_handled,
    open_generation,
    open_job_store,
    open_store,
    record_allocation,
    record_event,
    record_migration_finish,
    record_migration_start,
    record_progress,
    set_job_state,
)
from tests.unit.record_helpers import two_per_node

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)
ME = os.getuid()
OTHER = ME + 1000
NOW = {"now": lambda: T0 + timedelta(minutes=10)}


def _fill(store, job_id, uid, name, resized=True):
    """A job that trained on dp=2,pp=2, was granted two nodes and resized to dp=4,pp=2."""
    create_job(store, job_id, name=f"gpt-{job_id}", owner_uid=uid, owner_name=name,
               backend="slurm", model="gpt-small", partition="gpu", coordinator="n001:5555",
               at=T0)
    record_allocation(store, job_id, job_id, role="anchor", state="granted",
                      nodes=["n001", "n002"], at=T0)
    open_generation(store, job_id, 0, "dp=2,tp=1,pp=2", [0, 1, 2, 3], two_per_node(4),
                    first_step=0, at=T0)
    set_job_state(store, job_id, "running", at=T0)
    if not resized:
        record_progress(store, job_id, 0, last_step=10, last_loss=3.0, at=T0)
        return
    grant = record_event(store, job_id, "grant", source="slurm:squeue", key="g",
                         payload={"allocation": "x"}, at=T0 + timedelta(minutes=2))
    m = record_migration_start(store, job_id, from_generation=0, to_generation=1,
                               plan_digest="sha256:1", moved_bytes=3 << 30,
                               kept_bytes=1 << 30, lower_bound_bytes=2 << 30, messages=8,
                               rounds=2, estimated_seconds=1.0, event_id=grant,
                               at=T0 + timedelta(minutes=2))
    close_generation(store, job_id, 0, reason="resized to dp=4,tp=1,pp=2", last_step=199,
                     last_loss=2.75, at=T0 + timedelta(minutes=2, seconds=2))
    open_generation(store, job_id, 1, "dp=4,tp=1,pp=2", list(range(8)), two_per_node(8),
                    first_step=200, at=T0 + timedelta(minutes=2, seconds=2))
    record_migration_finish(store, m, outcome="committed", measured_seconds=1.5,
                            pause_seconds=0.75, at=T0 + timedelta(minutes=2, seconds=2))
    mark_event_handled(store, grant, "resized to generation 1")
    record_event(store, job_id, "preempt-notice", source="slurm:signal", key="p",
                 payload={"signal": "USR2"}, deadline=T0 + timedelta(minutes=11),
                 at=T0 + timedelta(minutes=9))


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A state directory with one snapshot of mine, published by a coordinator."""
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    monkeypatch.delenv("SLURM_ETC_DB", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    state = tmp_path / "state"
    store = open_job_store("101", state_dir=state)
    _fill(store, "101", ME, "me")
    store.close()
    return state


@pytest.fixture
def site_db(tmp_path):
    """One SQLite file holding a job of mine and one of another user."""
    path = tmp_path / "site.db"
    store = open_store(path)
    _fill(store, "201", ME, "me", resized=False)
    _fill(store, "202", OTHER, "other")
    store.close()
    return path


def run(args, obj=None, **kw):
    return CliRunner().invoke(cli, ["status", *args], obj={**NOW, **(obj or {})}, **kw)


def test_json_of_the_snapshots_in_the_state_directory(env):
    r = run(["--state-dir", str(env), "--json"], {"uid": ME})
    assert r.exit_code == 0, r.output
    (job,) = json.loads(r.stdout)["jobs"]
    assert {"job_id", "name", "owner", "state", "layout", "generation", "generations",
            "migrations", "events", "vranks"} <= job.keys()
    assert (job["job_id"], job["owner"], job["state"]) == ("101", "me", "running")
    assert (job["layout"], job["generation"]) == ("dp=4,tp=1,pp=2", 1)
    (m,) = job["migrations"]
    assert (m["moved_bytes"], m["lower_bound_bytes"], m["pause_seconds"], m["outcome"]) == \
        (3 << 30, 2 << 30, 0.75, "committed")
    assert m["ratio_to_lower_bound"] == 1.5
    assert [g["steps"] for g in job["generations"]] == [200, 0]
    assert job["generations"][0]["duration_seconds"] == 122.0
    assert len(job["vranks"]) == 8 and job["vranks"][7]["node"] == "n004"
    assert [e["kind"] for e in job["events"] if e["pending"]] == ["preempt-notice"]


def test_tables_for_all_jobs_and_for_one(env):
    r = run(["--state-dir", str(env)], {"uid": ME}, env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    assert "101" in r.stdout and "dp=4,tp=1,pp=2" in r.stdout and "running" in r.stdout
    r = run(["101", "--state-dir", str(env)], {"uid": ME}, env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    for text in ("generation 1", "devices and vranks per node", "n004", "generations",
                 "resized to dp=4,tp=1,pp=2", "migrations", "3.00 GiB", "2.00 GiB", "1.500",
                 "0.75", "committed", "pending events", "preempt-notice", "in 1m 00s"):
        assert text in r.stdout, text


def test_state_dir_from_the_environment(env):
    r = run(["--json"], {"uid": ME}, env={"SLURM_ETC_STATE_DIR": str(env)})
    assert [j["job_id"] for j in json.loads(r.stdout)["jobs"]] == ["101"]


def test_users_see_their_own_jobs_only(site_db):
    asked = []

    def nobody(uid):
        asked.append(uid)
        return False

    r = run(["--db", str(site_db), "--json"], {"uid": ME, "sees_all_jobs": nobody})
    assert [j["job_id"] for j in json.loads(r.stdout)["jobs"]] == ["201"]
    assert asked == [ME]  # asked once, for the real uid
    r = run(["--db", str(site_db), "--json"], {"uid": ME, "sees_all_jobs": lambda uid: True})
    assert sorted(j["job_id"] for j in json.loads(r.stdout)["jobs"]) == ["201", "202"]
    r = run(["202", "--db", str(site_db)], {"uid": ME, "sees_all_jobs": nobody})
    assert r.exit_code == 2
    assert r.stderr.strip() == f"slurm-etc: error: no job 202 of yours in {site_db}"


def test_the_admin_check_is_not_run_when_every_job_is_mine(env):
    def boom(uid):
        raise AssertionError("asked")

    r = run(["--state-dir", str(env), "--json"], {"uid": ME, "sees_all_jobs": boom})
    assert r.exit_code == 0, r.output


def test_the_identity_is_the_real_uid_not_the_environment(site_db):
    r = run(["--db", str(site_db), "--json"], {"sees_all_jobs": lambda uid: False},
            env={"USER": "other", "LOGNAME": "other"})
    assert [j["job_id"] for j in json.loads(r.stdout)["jobs"]] == ["201"]


def test_unknown_job_is_one_line_and_exit_2(env):
    r = run(["999", "--state-dir", str(env)], {"uid": ME})
    assert r.exit_code == 2
    assert r.stderr == f"slurm-etc: error: no job 999 of yours in the state directory {env}\n"
    assert "Traceback" not in r.output


def test_no_jobs_is_not_an_error(tmp_path):
    r = run(["--state-dir", str(tmp_path / "none")], {"uid": ME})
    assert r.exit_code == 0 and "no jobs of yours" in r.stderr
    r = run(["--state-dir", str(tmp_path / "none"), "--json"], {"uid": ME})
    assert json.loads(r.stdout) == {"jobs": []}


@pytest.mark.parametrize("kind", ["text", "foreign", "missing", "url"])
def test_a_bad_db_is_one_line_and_nothing_is_written(tmp_path, kind):
    path = tmp_path / "x.db"
    if kind == "text":
        path.write_text("not a database")
    elif kind == "foreign":
        with sqlite3.connect(path) as db:
            db.execute("create table t (x)")
    target = "nosuch+driver://u:secret@h/db" if kind == "url" else str(path)
    before = path.read_bytes() if path.exists() else None
    r = run(["--db", target], {"uid": ME})
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("slurm-etc: error: ") and r.stderr.count("\n") == 1
    assert "Traceback" not in r.output and "secret" not in r.output
    assert (path.read_bytes() if path.exists() else None) == before


def test_a_bad_snapshot_is_skipped_with_a_warning(env):
    (env / str(ME) / "junk.db").write_text("garbage")
    r = run(["--state-dir", str(env), "--json"], {"uid": ME})
    assert r.exit_code == 0
    assert [j["job_id"] for j in json.loads(r.stdout)["jobs"]] == ["101"]
    assert f"slurm-etc: warning: skipped {ME}/junk.db: " in r.stderr


def test_the_newest_snapshot_of_a_job_wins(env, tmp_path):
    old = tmp_path / "old.db"
    store = open_store(old)
    create_job(store, "101", name="stale", owner_uid=ME, owner_name="me", backend="slurm",
               at=T0 - timedelta(days=1))
    store.close()
    os.replace(old, env / str(ME) / "101-copy.db")
    r = run(["--state-dir", str(env), "--json"], {"uid": ME})
    (job,) = json.loads(r.stdout)["jobs"]
    assert job["name"] == "gpt-101"


def test_a_snapshot_cannot_speak_for_another_user(env):
    if os.getuid() != 0:
        pytest.fail("this test needs root (to give a file to another uid); CI runs as root")
    snap = env / str(ME) / "101.db"
    os.chown(snap, OTHER + 1, -1)  # written by someone else, claiming to be my job
    r = run(["--state-dir", str(env), "--json"], {"uid": ME, "sees_all_jobs": lambda u: True})
    assert json.loads(r.stdout) == {"jobs": []}


def test_watch_redraws_and_refuses_json(env):
    renders = []

    def now():
        renders.append(1)
        return T0

    r = run(["101", "--state-dir", str(env), "--watch", "0.2"],
            {"uid": ME, "watch_frames": 2, "now": now})
    assert r.exit_code == 0, r.output
    assert len(renders) == 3 and "generations" in r.stdout  # first view and two redraws
    r = run(["--state-dir", str(env), "--watch", "--json"], {"uid": ME})
    assert r.exit_code == 2 and "--watch" in r.stderr


def test_parse_adminlevel_reads_only_the_users_line():
    from slurm_etc.cli.cmd_status import parse_adminlevel  # after cli.main: it registers

    assert parse_adminlevel("alice|Administrator\n", "alice")
    assert parse_adminlevel("alice|Operator", "alice")
    assert not parse_adminlevel("alice|None\n", "alice")
    assert not parse_adminlevel("root|Administrator\n", "alice")
    assert not parse_adminlevel("", "alice")


def test_sorted_as_asked(site_db):
    # 201 is mine and never resized; 202 another user's with one committed resize
    r = run(["--db", str(site_db), "--json", "--sort", "resizes"],
            {"uid": ME, "sees_all_jobs": lambda uid: True})
    assert r.exit_code == 0, r.output
    assert [j["job_id"] for j in json.loads(r.stdout)["jobs"]] == ["202", "201"]
    r = run(["--db", str(site_db), "--json", "--sort", "job"],
            {"uid": ME, "sees_all_jobs": lambda uid: True})
    assert [j["job_id"] for j in json.loads(r.stdout)["jobs"]] == ["201", "202"]
    r = run(["--db", str(site_db), "--sort", "size"], {"uid": ME})
    assert r.exit_code == 2 and "'size' is not one of" in r.output


def test_watch_into_a_pipe_prints_each_view_whole(env):
    # CliRunner's output is no terminal: no cursor movement, a stamp line before each redraw
    r = run(["101", "--state-dir", str(env), "--watch", "0.2"], {"uid": ME, "watch_frames": 2})
    assert r.exit_code == 0, r.output
    assert "\x1b[" not in r.stdout
    assert r.stdout.count("--- 2026-11-30T12:10:00+00:00 ---") == 2
    assert r.stdout.count("generations") == 3  # the first view and two redraws, whole
