"""The job record: schema by migration, repository API, idempotent repeats, snapshots,
network-filesystem refusal, databases that are not ours, readers beside the writer."""
import logging
import os
import shutil
import sqlite3
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from slurm_etc.alloc import Device
from slurm_etc.store import (
    RecordError,
    StoreError,
    close_generation,
    create_job,
    job_detail,
    list_jobs,
    location,
    mark_event_handled,
    open_generation,
    open_job_store,
    open_store,
    open_store_readonly,
    pending_events,
    record_allocation,
    record_event,
    record_migration_finish,
    record_migration_start,
    record_progress,
    set_coordinator,
    set_device_state,
    set_job_state,
    update_allocation,
)
from slurm_etc.store.db import head_revision
from slurm_etc.store.location import (
    LocationError,
    check_job_id,
    check_writable_location,
    default_local_db,
    default_state_dir,
    filesystem_type,
    is_network_fs,
    network_fs_refusal,
    parse_mountinfo,
    private_dir,
)
from slurm_etc.store.models import Base

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)
JOB = "4242"
UID = str(os.getuid())  # snapshots live in <state dir>/<uid>/

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 27 0:27 / /tmp rw,relatime shared:5 - tmpfs tmpfs rw
40 27 0:40 / /home rw,relatime shared:9 - nfs4 fs1:/export/home rw,vers=4.2
41 27 0:41 / /scratch rw - lustre 10.0.0.1@o2ib:/scratch rw,flock
42 27 0:42 / /gpfs/proj rw master:3 - gpfs proj rw
43 27 0:43 / /mnt/my\\040share rw - cifs //srv/share rw
44 27 0:44 / /mnt/remote rw - fuse.sshfs me@host: rw
45 27 0:45 / /var/lib/containers rw - fuse.fuse-overlayfs fuse-overlayfs rw
46 40 0:46 / /home/alice/local rw - ext4 /dev/vdb rw
47 27 0:47 / /tmp rw - nfs nfs:/tmp rw
garbage line
"""


# ---------------------------------------------------------------- where it lives (pure)


def test_mountinfo_is_parsed_with_escapes_and_optional_fields():
    mounts = parse_mountinfo(MOUNTINFO)
    assert ("/home", "nfs4") in mounts and ("/gpfs/proj", "gpfs") in mounts
    assert ("/mnt/my share", "cifs") in mounts
    assert len(mounts) == 11  # the garbage line is skipped


@pytest.mark.parametrize("path,fstype", [
    ("/", "ext4"), ("/var/tmp/x.db", "ext4"), ("/home/alice/x.db", "nfs4"),
    ("/home2/x.db", "ext4"),  # a prefix of the name is not a parent directory
    ("/home/alice/local/jobs/x.db", "ext4"),  # a local disk mounted below the NFS home
    ("/scratch/u/x.db", "lustre"), ("/gpfs/proj/x.db", "gpfs"),
    ("/mnt/my share/x.db", "cifs"), ("/mnt/remote/x.db", "fuse.sshfs"),
    ("/tmp/x.db", "nfs"),  # the later mount at the same point shadows the earlier one
])
def test_filesystem_type_takes_the_deepest_latest_mount(path, fstype):
    assert filesystem_type(path, MOUNTINFO) == fstype


def test_network_filesystems_are_named():
    for fstype in ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "fuse.sshfs", "beegfs",
                   "ceph", "fuse.juicefs"):
        assert is_network_fs(fstype), fstype
    for fstype in ("ext4", "xfs", "tmpfs", "btrfs", "zfs", "overlay",
                   "fuse.fuse-overlayfs", "fuseblk", None, ""):
        assert not is_network_fs(fstype), fstype


def test_refusal_says_why_and_what_to_use():
    assert network_fs_refusal("/var/tmp/slurm-etc/1.db", MOUNTINFO) is None
    why = network_fs_refusal("/home/alice/.local/share/slurm-etc/1.db", MOUNTINFO)
    assert why is not None and "\n" not in why
    assert "network filesystem (nfs4)" in why and "WAL" in why
    assert "node-local disk" in why and "mysql+pymysql://" in why
    assert "lustre" in network_fs_refusal("/scratch/1.db", MOUNTINFO)


def test_check_writable_location_resolves_symlinks(tmp_path):
    real = tmp_path / "nfsdir"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    mounts = f"27 1 254:0 / / rw - ext4 /dev/vda rw\n50 27 0:50 / {real} rw - nfs4 s:/e rw\n"
    with pytest.raises(LocationError, match="nfs4"):
        check_writable_location(link / "sub" / "x.db", mounts)
    check_writable_location(tmp_path / "x.db", mounts)


def test_default_locations(monkeypatch):
    env = {"SLURM_TMPDIR": "/local/job7"}
    assert default_local_db("7", env) == Path("/local/job7/slurm-etc/7.db")
    assert default_local_db("7", {"TMPDIR": "/scratch-local"}, uid=1000) == \
        Path("/scratch-local/slurm-etc-1000/jobs/7.db")
    assert default_state_dir({"SLURM_ETC_STATE_DIR": "/shared/etc"}) == Path("/shared/etc")
    assert default_state_dir({"XDG_DATA_HOME": "/h/a/.data"}) == \
        Path("/h/a/.data/slurm-etc/jobs")


@pytest.mark.parametrize("bad", ["", ".hidden", "-x", "a/b", "../x", "x" * 65, "a b"])
def test_job_ids_must_be_file_names(bad):
    with pytest.raises(LocationError, match="invalid job id"):
        check_job_id(bad)
    assert check_job_id("1234_5.array-1") == "1234_5.array-1"


def test_private_dir_refuses_a_symlink_or_a_stranger(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "trap").symlink_to(target)
    with pytest.raises(LocationError, match="not a directory"):
        private_dir(tmp_path / "trap")
    made = private_dir(tmp_path / "a" / "b")
    assert made.stat().st_mode & 0o777 == 0o700
    if os.getuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 4242, -1)
        with pytest.raises(LocationError, match="belongs to uid 4242"):
            private_dir(theirs)


# ---------------------------------------------------------------- the schema


def test_models_match_the_migrations(tmp_path):
    store = open_store(tmp_path / "etc.db")
    try:
        with store.engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        store.close()
    assert head_revision() == "0008_interrupted_step"


@pytest.mark.parametrize("url,stamp", [
    ("mysql+pymysql://u@h/db", "created_at DATETIME(6) NOT NULL"),
    ("mariadb+pymysql://u@h/db", "created_at DATETIME(6) NOT NULL"),
    ("postgresql://u@h/db", "created_at TIMESTAMP WITH TIME ZONE NOT NULL"),
])
def test_the_migrations_compile_for_server_databases(url, stamp):
    import io

    from alembic import command

    from slurm_etc.store.db import alembic_config

    cfg = alembic_config(url)
    cfg.output_buffer = io.StringIO()
    command.upgrade(cfg, "head", sql=True)  # offline: DDL for the dialect, no server
    ddl = cfg.output_buffer.getvalue()
    for table in ("jobs", "allocations", "devices", "generations", "vranks", "events",
                  "migrations", "policies"):
        assert f"CREATE TABLE {table} " in ddl, table
    assert stamp in ddl and "moved_bytes BIGINT NOT NULL" in ddl
    assert "'0008_interrupted_step'" in ddl and "request_patience_s INTEGER" in ddl
    assert "stall_seconds" in ddl and "interrupted_seconds" in ddl


def test_a_policies_only_database_is_upgraded_and_keeps_its_policies(tmp_path):
    from alembic import command

    from slurm_etc.store.db import alembic_config

    path = tmp_path / "old.db"
    command.upgrade(alembic_config(f"sqlite:///{path}"), "0001_policies")
    with sqlite3.connect(path) as db:
        db.execute("insert into policies (scope_kind, scope_name, min_nodes, updated_at, "
                   "updated_by) values ('partition', 'gpu', 2, '2026-01-01', 'root')")
    old = open_store_readonly(path)
    assert list_jobs(old) == [] and job_detail(old, "1") is None  # nothing read-only can do
    old.close()
    store = open_store(path)
    create_job(store, "1", name="n", owner_uid=1, owner_name="a", backend="local")
    assert [j.job_id for j in list_jobs(store)] == ["1"]
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("select count(*) from policies").fetchone() == (1,)


# ---------------------------------------------------------------- the record


@pytest.fixture
def store(tmp_path):
    s = open_job_store(JOB, db=tmp_path / "local" / f"{JOB}.db", state_dir=tmp_path / "state")
    yield s
    s.close()


def _job(store, job_id=JOB, uid=1000, name="alice"):
    create_job(store, job_id, name="gpt-small", owner_uid=uid, owner_name=name,
               backend="slurm", model="gpt-small", partition="gpu", account="ml",
               coordinator="n001:5555", at=T0)


def _devices(n, per_node=2):
    return {v: Device(f"n{v // per_node + 1:03d}", v % per_node) for v in range(n)}


def test_a_resize_is_recorded_end_to_end(store):
    _job(store)
    record_allocation(store, JOB, "4242", role="anchor", partition="gpu", state="granted",
                      nodes=["n001", "n002"], at=T0)
    open_generation(store, JOB, 0, "dp=2,tp=1,pp=2", [0, 1, 2, 3], _devices(4), first_step=0,
                    at=T0)
    set_job_state(store, JOB, "running", at=T0)
    record_progress(store, JOB, 0, last_step=99, last_loss=2.5, at=T0 + timedelta(minutes=5))

    record_allocation(store, JOB, "4243", partition="scavenge", state="granted",
                      nodes=["n003", "n004"], at=T0 + timedelta(minutes=6))
    grant = record_event(store, JOB, "grant", source="slurm:squeue",
                         payload={"allocation": "4243", "nodes": ["n003", "n004"]},
                         key="grant:4243", at=T0 + timedelta(minutes=6))
    set_job_state(store, JOB, "resizing", reason="grant of 4243", at=T0 + timedelta(minutes=6))
    mig = record_migration_start(store, JOB, from_generation=0, to_generation=1,
                                 plan_digest="sha256:ab12", moved_bytes=3 << 30,
                                 kept_bytes=5 << 30, lower_bound_bytes=2 << 30, messages=12,
                                 rounds=3, estimated_seconds=1.25, event_id=grant,
                                 at=T0 + timedelta(minutes=6, seconds=1))
    close_generation(store, JOB, 0, reason="resized to dp=4,tp=1,pp=2", last_step=120,
                     last_loss=2.4, at=T0 + timedelta(minutes=6, seconds=2))
    open_generation(store, JOB, 1, "dp=4,tp=1,pp=2", list(range(8)), _devices(8),
                    first_step=121, at=T0 + timedelta(minutes=6, seconds=4))
    record_migration_finish(store, mig, outcome="committed", measured_seconds=1.5,
                            pause_seconds=0.8, at=T0 + timedelta(minutes=6, seconds=4))
    mark_event_handled(store, grant, "resized to generation 1",
                       at=T0 + timedelta(minutes=6, seconds=4))
    set_job_state(store, JOB, "running", at=T0 + timedelta(minutes=6, seconds=4))
    notice = record_event(store, JOB, "preempt-notice", source="slurm:signal",
                          payload={"allocation": "4243", "signal": "USR2"},
                          deadline=T0 + timedelta(minutes=9), key="preempt:4243:USR2",
                          at=T0 + timedelta(minutes=8))

    d = job_detail(store, JOB)
    j = d.job
    assert (j.state, j.generation, j.layout, j.world_size) == ("running", 1, "dp=4,tp=1,pp=2", 8)
    assert j.nodes == ("n001", "n002", "n003", "n004")
    assert j.reason is None and j.pending_events == 1 and j.migrations == 1
    assert j.created_at == T0 and j.created_at.tzinfo is not None
    assert j.updated_at == T0 + timedelta(minutes=8)  # every write moves it: newest snapshot
    assert [g.number for g in d.generations] == [0, 1]
    g0 = d.generations[0]
    assert (g0.steps, g0.first_step, g0.last_step, g0.last_loss) == (121, 0, 120, 2.4)
    assert g0.duration_seconds(T0) == 362.0 and g0.end_reason.startswith("resized")
    assert d.generations[1].ended_at is None
    assert [(v.vrank, v.rank, v.node, v.local_index) for v in d.vranks][:3] == \
        [(0, 0, "n001", 0), (1, 1, "n001", 1), (2, 2, "n002", 0)]
    assert {dev.allocation for dev in d.devices if dev.node in ("n003", "n004")} == {"4243"}
    assert {dev.allocation for dev in d.devices if dev.node in ("n001", "n002")} == {"4242"}
    (m,) = d.migrations
    assert (m.moved_bytes, m.lower_bound_bytes, m.outcome, m.pause_seconds) == \
        (3 << 30, 2 << 30, "committed", 0.8)
    assert m.ratio_to_lower_bound == 1.5 and m.event_id == grant
    assert [e.id for e in d.pending_events] == [notice]
    assert [e.id for e in pending_events(store, JOB)] == [notice]
    assert d.pending_events[0].deadline == T0 + timedelta(minutes=9)
    assert d.events[0].payload == {"allocation": "4243", "nodes": ["n003", "n004"]}

    out = d.to_json(now=T0 + timedelta(minutes=10))
    assert {"job_id", "name", "owner", "state", "layout", "generation", "generations",
            "migrations", "events", "vranks", "devices", "allocations"} <= out.keys()
    assert out["owner"] == "alice" and out["layout"] == "dp=4,tp=1,pp=2"
    assert out["generations"][1]["duration_seconds"] == 236.0
    assert out["migrations"][0]["ratio_to_lower_bound"] == 1.5
    assert out["migrations"][0]["pause_seconds"] == 0.8
    assert out["events"][1]["pending"] is True


def test_repeats_of_a_restarted_coordinator_are_no_ops(store):
    _job(store)
    _job(store)  # same owner and backend: nothing new
    with pytest.raises(RecordError, match="owned by uid 1000"):
        _job(store, uid=1001)
    e1 = record_event(store, JOB, "loss", source="slurm:squeue", key="loss:n002", at=T0)
    e2 = record_event(store, JOB, "loss", source="slurm:squeue", key="loss:n002",
                      at=T0 + timedelta(seconds=5))
    assert e1 == e2
    e3 = record_event(store, JOB, "loss", source="slurm:squeue", at=T0)
    e4 = record_event(store, JOB, "loss", source="slurm:squeue", at=T0)
    assert len({e1, e3, e4}) == 3  # without a key every recording is an event
    mark_event_handled(store, e1, "shrunk", at=T0)
    mark_event_handled(store, e1, "something else", at=T0 + timedelta(seconds=1))
    assert job_detail(store, JOB).events[0].outcome == "shrunk"

    devs = _devices(4)
    g = open_generation(store, JOB, 0, "dp=4", [0, 1, 2, 3], devs, at=T0)
    assert open_generation(store, JOB, 0, "dp=4", [0, 1, 2, 3], devs, at=T0) == g
    with pytest.raises(RecordError, match="generation 0 already"):
        open_generation(store, JOB, 0, "dp=2,tp=2", [0, 1, 2, 3], devs, at=T0)
    close_generation(store, JOB, 0, reason="first", at=T0 + timedelta(seconds=1))
    close_generation(store, JOB, 0, reason="second", at=T0 + timedelta(seconds=2))
    assert job_detail(store, JOB).generations[0].end_reason == "first"

    kw = dict(from_generation=0, to_generation=1, plan_digest="d", moved_bytes=1,
              kept_bytes=2, lower_bound_bytes=1, messages=1, rounds=1)
    m = record_migration_start(store, JOB, **kw)
    assert record_migration_start(store, JOB, **kw) == m
    record_migration_finish(store, m, outcome="aborted", error="rank 3 timed out")
    record_migration_finish(store, m, outcome="aborted")
    with pytest.raises(RecordError, match="is aborted already"):
        record_migration_finish(store, m, outcome="committed")
    retry = record_migration_start(store, JOB, **kw)  # after an abort a retry is new
    assert retry != m
    assert [x.error for x in job_detail(store, JOB).migrations] == ["rank 3 timed out", None]


def test_devices_follow_generations_and_allocations(store):
    _job(store)
    record_allocation(store, JOB, "A", role="anchor", state="granted", nodes=["n001"], at=T0)
    record_allocation(store, JOB, "B", state="granted", nodes=["n002"], at=T0)
    open_generation(store, JOB, 0, "dp=4", [0, 1, 2, 3], _devices(4), at=T0)
    update_allocation(store, JOB, "B", state="preempting", at=T0 + timedelta(seconds=1))
    update_allocation(store, JOB, "B", state="lost", at=T0 + timedelta(seconds=30))
    update_allocation(store, JOB, "B", state="lost", at=T0 + timedelta(seconds=40))
    d = job_detail(store, JOB)
    assert {(x.node, x.state) for x in d.devices} == {("n001", "held"), ("n002", "lost")}
    b = next(a for a in d.allocations if a.backend_id == "B")
    assert b.lost_at == T0 + timedelta(seconds=30) and b.granted_at == T0
    open_generation(store, JOB, 1, "dp=2", [0, 1], _devices(2), at=T0 + timedelta(seconds=31))
    set_device_state(store, JOB, [Device("n009", 0)], "leaving", allocation="A")
    d = job_detail(store, JOB)
    assert ("n009", 0, "leaving", "A") in {(x.node, x.local_index, x.state, x.allocation)
                                           for x in d.devices}
    assert d.generations[0].end_reason == "superseded by generation 1"
    assert [v.rank for v in d.vranks] == [0, 1]


def test_invalid_calls_write_nothing_and_say_why(store):
    with pytest.raises(RecordError, match="no job '9'"):
        record_event(store, "9", "grant", source="x")
    _job(store)
    with pytest.raises(RecordError, match="unknown state 'runing'"):
        set_job_state(store, JOB, "runing")
    with pytest.raises(RecordError, match="vranks \\[7\\] have no device"):
        open_generation(store, JOB, 0, "dp=2", [0, 7], _devices(2))
    with pytest.raises(RecordError, match="two ranks on one vrank"):
        open_generation(store, JOB, 0, "dp=2", [1, 1], _devices(2))
    with pytest.raises(RecordError, match="not JSON-serialisable"):
        record_event(store, JOB, "grant", source="x", payload={"x": object()})
    with pytest.raises(RecordError, match="moved_bytes must be a non-negative"):
        record_migration_start(store, JOB, from_generation=0, to_generation=1, plan_digest="",
                               moved_bytes=-1, kept_bytes=0, lower_bound_bytes=0, messages=0,
                               rounds=0)
    with pytest.raises(RecordError, match="no migration 99"):
        record_migration_finish(store, 99, outcome="committed")
    d = job_detail(store, JOB)
    assert d.generations == () and d.events == () and d.migrations == ()


def test_list_jobs_filters_by_owner(tmp_path):
    store = open_store(tmp_path / "site.db")
    _job(store, "1", uid=1000)
    _job(store, "2", uid=1001, name="bob")
    set_coordinator(store, "2", None)
    assert [j.job_id for j in list_jobs(store, owner_uid=1000)] == ["1"]
    assert sorted(j.job_id for j in list_jobs(store)) == ["1", "2"]
    store.close()


# ---------------------------------------------------------------- snapshots and files


def test_commits_are_published_off_the_writers_path_and_coalesce(tmp_path):
    store = open_job_store(JOB, db=tmp_path / "l" / "j.db", state_dir=tmp_path / "s")
    try:
        _job(store)
        started = time.monotonic()
        for i in range(20):
            record_event(store, JOB, "grant", source="test", key=f"k{i}")
        writing = time.monotonic() - started
        store.flush()
        publisher = store.after_commit[0]
        assert publisher.failures == 0 and publisher._attempted == 21
        reader = open_store_readonly(tmp_path / "s" / UID / f"{JOB}.db", immutable=True)
        assert len(job_detail(reader, JOB).events) == 20  # the last commit is published
        reader.close()
        assert writing < 20 * 0.5
    finally:
        store.close()


def test_copies_of_a_large_record_take_a_tenth_of_the_time_and_a_flush_waits_for_none(
        tmp_path, monkeypatch):
    """A commit every 10 ms for 1.25 s while a copy takes 0.1 s: back to back the copies
    would hold the publishing thread the whole time (~12 of them); spaced 9 x their time
    apart they hold it at most a tenth (2, at most 3 copies), and a flush publishes the
    last commit at once, without waiting out the 0.9 s gap."""
    from slurm_etc.store import snapshot

    copies: list[float] = []

    def slow_copy(db, dest):  # the copy of a 16,384-rank job's 12.8 MB record, roughly
        copies.append(time.monotonic())
        time.sleep(0.1)

    monkeypatch.setattr(snapshot, "publish_snapshot", slow_copy)
    publisher = snapshot.Publisher(tmp_path / "j.db", tmp_path / "s" / "j.db")
    try:
        began = time.monotonic()
        while time.monotonic() - began < 1.25:  # copies at ~0 and ~1.0 s, each 0.1 s
            publisher()
            time.sleep(0.01)
        during = len(copies)
        asked = time.monotonic()
        assert publisher.flush(10.0)
        # one copy (0.1 s), not the rest of the gap after the copy at ~1.0 s (to ~2.0 s)
        assert time.monotonic() - asked < 0.45
        assert 1 <= during <= 3, copies
    finally:
        publisher.close()


def test_every_commit_publishes_an_atomic_owner_only_snapshot(tmp_path):
    state = tmp_path / "state"
    local = tmp_path / "local" / "jobs"
    store = open_job_store(JOB, db=local / f"{JOB}.db", state_dir=state)
    try:
        _job(store)
        store.flush()
        snap = state / UID / f"{JOB}.db"
        assert snap.stat().st_mode & 0o777 == 0o600
        assert state.stat().st_mode & 0o777 == 0o700
        assert (state / UID).stat().st_mode & 0o777 == 0o700
        assert (local / f"{JOB}.db").stat().st_mode & 0o777 == 0o600
        assert local.stat().st_mode & 0o777 == 0o700
        header = snap.read_bytes()[:20]
        assert header[18:20] == b"\x01\x01"  # rollback journal: no WAL needed to read it
        with sqlite3.connect(local / f"{JOB}.db") as db:
            assert db.execute("pragma journal_mode").fetchone() == ("wal",)
        record_event(store, JOB, "grant", source="test")
        store.flush()
        reader = open_store_readonly(snap, immutable=True)
        assert len(job_detail(reader, JOB).events) == 1
        reader.close()
        assert [p.name for p in (state / UID).iterdir()] == [f"{JOB}.db"]  # no temp left
    finally:
        store.close()


def test_a_restarted_coordinator_resumes_from_the_snapshot(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node1"))
    state = tmp_path / "state"
    store = open_job_store(JOB, state_dir=state)
    _job(store, uid=os.getuid())  # a coordinator records its own uid as the owner
    e = record_event(store, JOB, "grant", source="test", key="k")
    store.close()
    assert (tmp_path / "node1" / f"slurm-etc-{os.getuid()}" / "jobs" / f"{JOB}.db").exists()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node2"))  # another node: no local file
    again = open_job_store(JOB, state_dir=state)
    try:
        assert record_event(again, JOB, "grant", source="test", key="k") == e
        assert [x.id for x in pending_events(again, JOB)] == [e]
    finally:
        again.close()


def test_a_failed_publish_never_fails_the_write(tmp_path, caplog):
    state = tmp_path / "state"
    store = open_job_store(JOB, db=tmp_path / "l" / "j.db", state_dir=state)
    try:
        shutil.rmtree(state)
        state.write_text("in the way")
        with caplog.at_level(logging.WARNING):
            _job(store)
            store.flush()
        assert "cannot" in caplog.text and "retried on the next change" in caplog.text
        assert [j.job_id for j in list_jobs(store)] == [JOB]
        state.unlink()
        set_job_state(store, JOB, "running")
        store.flush()
        assert (state / UID / f"{JOB}.db").exists()
    finally:
        store.close()


def test_a_sqlite_file_on_a_network_filesystem_is_refused(tmp_path, monkeypatch):
    mounts = f"27 1 254:0 / / rw - ext4 /dev/vda rw\n50 27 0:50 / {tmp_path} rw - lustre x rw\n"
    monkeypatch.setattr(location, "_mountinfo", lambda: mounts)
    with pytest.raises(StoreError) as err:
        open_job_store(JOB, db=tmp_path / "home" / "j.db", state_dir=tmp_path / "s")
    assert "network filesystem (lustre)" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "home").exists()  # nothing written
    state = tmp_path / "s2"
    (state / UID).mkdir(parents=True, mode=0o700)
    (state / UID / f"{JOB}.db").write_bytes(b"")  # a snapshot to restore from: still refused
    with pytest.raises(StoreError, match="lustre"):
        open_job_store(JOB, db=tmp_path / "home" / "j.db", state_dir=state)
    assert not (tmp_path / "home").exists()


def _foreign_sqlite(path):
    with sqlite3.connect(path) as db:
        db.execute("create table t (x)")
        db.execute("insert into t values (1)")


def test_a_database_that_is_not_ours_is_refused_untouched(tmp_path):
    text = tmp_path / "notes.db"
    text.write_text("hello, not a database\n" * 10)
    other = tmp_path / "other.db"
    _foreign_sqlite(other)
    newer = tmp_path / "newer.db"
    store = open_store(newer)
    store.close()
    with sqlite3.connect(newer) as db:
        db.execute("update alembic_version set version_num = '0099_future'")
    for path, why in ((text, "not an SQLite database"),
                      (other, "not a slurm-etc database"),
                      (newer, "schema revision '0099_future'")):
        before = path.read_bytes()
        for opener in (lambda p: open_store(p), lambda p: open_store_readonly(p),
                       lambda p: open_job_store(JOB, db=p, state_dir=tmp_path / "s")):
            with pytest.raises(StoreError, match=why):
                opener(path)
        assert path.read_bytes() == before
    assert not (tmp_path / "s" / UID / f"{JOB}.db").exists()


def test_readers_never_block_the_writer(tmp_path):
    store = open_job_store(JOB, db=tmp_path / "l" / "j.db", state_dir=tmp_path / "s")
    _job(store)
    reader = sqlite3.connect(tmp_path / "l" / "j.db", timeout=0.1)
    reader.isolation_level = None
    reader.execute("BEGIN")
    (seen,) = reader.execute("select count(*) from events").fetchone()  # holds a snapshot
    started = time.monotonic()
    for i in range(5):
        record_event(store, JOB, "grant", source="test", key=f"k{i}")
    took = time.monotonic() - started
    assert took < 5.0  # a blocked writer would wait out its 10 s busy timeout
    assert reader.execute("select count(*) from events").fetchone() == (seen,)
    reader.execute("COMMIT")
    assert reader.execute("select count(*) from events").fetchone() == (seen + 5,)
    reader.close()

    errors: list[BaseException] = []
    stop = threading.Event()

    def read_loop():
        ro = open_store_readonly(tmp_path / "l" / "j.db")
        try:
            while not stop.is_set():
                job_detail(ro, JOB)
                list_jobs(ro)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            ro.close()

    threads = [threading.Thread(target=read_loop) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(20):
            record_event(store, JOB, "loss", source="test", key=f"l{i}")
    finally:
        stop.set()
        for t in threads:
            t.join()
        store.close()
    assert not errors


def test_a_db_in_an_existing_shared_directory_leaves_its_mode_alone(tmp_path):
    """``--db /tmp/x.db`` must not make /tmp owner-only (the file itself is 0600)."""
    import os
    import stat

    from slurm_etc.store import jobs

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    store = jobs.open_job_store("shared-dir-job", db=shared / "job.db", publish=False)
    store.close()
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777
    assert stat.S_IMODE(os.stat(shared / "job.db").st_mode) & 0o077 == 0
