"""Records only their owner wrote (issue 21, findings 3, 4, 7, 8).

* A snapshot planted in the shared state directory by a real second user (made with
  ``useradd`` here), claiming to be a victim's job with an open request for 999,999 nodes,
  is not adopted: the victim (another real user, and root through the real coordinator)
  starts its job under its own name, and nothing is sent in its name.
* ``status`` reads a file whose ``jobs`` is a recursive view in seconds, under a memory
  limit (a subprocess with RLIMIT_AS), says one line about it and lists the good jobs.
* The owner of a snapshot is that of the descriptor read: a swap of the file right after
  its owner was checked changes nothing.
* A job whose coordinator stopped writing is ``lost``, with the age of its last update;
  job names with terminal escapes are shown escaped; no password in any error; a password
  file; the site's policy file and a stricter-only ``--policy-db``; file modes.
"""
from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.store import jobs as record
from slurm_etc.store.db import open_store
from slurm_etc.store.location import snapshot_path
from tests.unit.second_user import as_user, local_user

pytestmark = pytest.mark.unit

JOB = "73001"  # a Slurm job id: predictable, so anyone can plant it first
T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def attacker() -> Iterator[pwd.struct_passwd]:
    with local_user(f"etcatk{os.getpid() % 100000}") as user:
        yield user


@pytest.fixture(scope="module")
def victim() -> Iterator[pwd.struct_passwd]:
    with local_user(f"etcvic{os.getpid() % 100000}") as user:
        yield user


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user can reach, with a shared sticky state directory (like a
    site's /scratch/slurm-etc: mode 1777)."""
    path = Path(tempfile.mkdtemp(prefix="slurm-etc-rec-", dir="/tmp"))
    os.chmod(path, 0o755)
    (path / "state").mkdir()
    os.chmod(path / "state", 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _plant(state: Path, job: str, victim_uid: int) -> list[str]:
    """Run as the attacker: a record claiming to be ``victim_uid``'s job with an open
    request for 999,999 nodes, planted where the victim's snapshot of ``job`` would be:
    flat in the state directory and in a ``<state>/<victim uid>/`` made first."""
    planted = []
    for where in (state / f"{job}.db", state / str(victim_uid) / f"{job}.db"):
        where.parent.mkdir(mode=0o755, exist_ok=True)
        store = open_store(where)
        try:
            record.create_job(store, job, name="planted", owner_uid=victim_uid,
                              owner_name="victim", backend="local", at=T0)
            record.record_event(store, job, "request", source="coordinator",
                                key="request:grow-1",
                                payload={"nodes": 999_999, "summary": "planted"}, at=T0)
        finally:
            store.close()
        os.chmod(where, 0o644)
        planted.append(str(where))
    return planted


def _start_as_victim(state: Path, node: Path) -> dict[str, Any]:
    """Run as the victim: what a coordinator does at its start, on a fresh node."""
    os.environ["TMPDIR"] = str(node)
    os.environ.pop("SLURM_TMPDIR", None)
    store = record.open_job_store(JOB, state_dir=state)
    try:
        record.create_job(store, JOB, name="mine", owner_uid=os.getuid(),
                          owner_name=pwd.getpwuid(os.getuid()).pw_name, backend="local")
        got = record.recover(store, JOB)
        detail = record.job_detail(store, JOB)
        assert detail is not None
        return {"requests": got.requests, "pending": len(got.pending_events),
                "events": [e.kind for e in detail.events], "name": detail.job.name,
                "owner": detail.job.owner_uid}
    finally:
        store.close()


def test_a_snapshot_planted_by_another_user_is_not_adopted(attacker, victim, shared):
    state = shared / "state"
    node = shared / "node"
    node.mkdir(mode=0o777)
    os.chmod(node, 0o1777)
    planted = as_user(attacker, lambda: _plant(state, JOB, victim.pw_uid))
    assert all(os.stat(p).st_uid == attacker.pw_uid for p in planted)
    started = as_user(victim, lambda: _start_as_victim(state, node))
    # the job starts under its own name, owner and record: nothing of the planted one
    assert started == {"requests": 0, "pending": 0, "events": [], "name": "mine",
                       "owner": victim.pw_uid}
    # the planted files are left as they were (not the victim's to touch)
    assert all(os.stat(p).st_uid == attacker.pw_uid for p in planted)


def test_the_real_coordinator_sends_nothing_in_a_planted_records_name(attacker, shared,
                                                                       monkeypatch,
                                                                       recording_backend):
    """The victim is root here, running the real coordinator's recovery: the planted open
    request is not sent again (before: RequestNodes(999999) in root's name)."""
    from slurm_etc.alloc.chooser import TrainingJob
    from slurm_etc.alloc.hardware import PROFILES
    from slurm_etc.alloc.topology import ClusterTopology
    from slurm_etc.coordinator import restart
    from slurm_etc.coordinator.job import JobSpec
    from slurm_etc.coordinator.loop import Coordinator
    from slurm_etc.plan import load_model
    from slurm_etc.policy.rules import EffectivePolicy
    from slurm_etc.protocol.channel import CoordinatorChannel, create_secret

    state = shared / "state"
    as_user(attacker, lambda: _plant(state, JOB, 0))
    monkeypatch.setenv("TMPDIR", str(shared / "root-node"))
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    store = record.open_job_store(JOB, state_dir=state)
    channel = CoordinatorChannel(JOB, create_secret(JOB, shared / "keys"), "127.0.0.1")
    try:
        record.create_job(store, JOB, name="mine", owner_uid=0, owner_name="root",
                          backend="local")
        backend = recording_backend(ClusterTopology.uniform(1, 1))
        spec = JobSpec(JOB, "mine", (sys.executable, "-c", "pass"),
                       TrainingJob(load_model("tiny"), 8, 1, False), EffectivePolicy(),
                       PROFILES["cpu"])
        restart.recover(Coordinator(spec, backend, store, channel, backend.topology))
        assert backend.requested == []
        detail = record.job_detail(store, JOB)
        assert detail is not None and detail.job.name == "mine" and detail.events == ()
    finally:
        channel.close()
        store.close()


def test_a_users_directory_made_by_someone_else_blocks_nothing(attacker, shared, caplog,
                                                                monkeypatch):
    """``<state>/0/`` made first by the attacker: root's job runs, its record is kept on
    node-local disk and is not published there (one warning)."""
    state = shared / "state"
    as_user(attacker, lambda: (state / "0").mkdir(mode=0o777) or os.chmod(state / "0", 0o777))
    monkeypatch.setenv("TMPDIR", str(shared / "root-node"))
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    store = record.open_job_store(JOB, state_dir=state)
    try:
        record.create_job(store, JOB, name="mine", owner_uid=0, owner_name="root",
                          backend="local")
        store.flush()
    finally:
        store.close()
    assert os.listdir(state / "0") == []
    assert f"belongs to uid {attacker.pw_uid}" in caplog.text


# ---------------------------------------------------------------- status: bounded reads


def _recursive_view(path: Path, uid: int) -> None:
    """A file of our schema whose ``jobs`` is a recursive view without end (finding 4)."""
    store = open_store(path)
    store.close()
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("PRAGMA foreign_keys=OFF")
        db.execute("DROP TABLE jobs")
        db.execute(f"""CREATE VIEW jobs AS WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL
            SELECT n + 1 FROM r) SELECT 'j' || n AS job_id, printf('%.1000c', 'x') AS name,
            {uid} AS owner_uid, 'x' AS owner_name, 'running' AS state, NULL AS reason,
            'local' AS backend, NULL AS model, NULL AS partition_name, NULL AS account,
            NULL AS coordinator, NULL AS generation, '2026-12-01 12:00:00' AS created_at,
            '2026-12-01 12:00:00' AS updated_at, NULL AS ended_at FROM r""")
    with sqlite3.connect(path) as db:
        db.execute("VACUUM")


def test_status_reads_a_recursive_view_in_seconds_under_a_memory_limit(tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    state = tmp_path / "state"
    good = record.open_job_store("101", state_dir=state)
    record.create_job(good, "101", name="good", owner_uid=os.getuid(), owner_name="me",
                      backend="local")
    good.close()
    mine = snapshot_path(state, "101").parent
    evil = mine / "evil.db"
    _recursive_view(evil, os.getuid())
    assert evil.stat().st_size < 200 << 10
    limit = 1 << 30  # the finding: 1.4 GB, then MemoryError
    code = ("import resource, sys\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))\n"
            "from slurm_etc.cli.main import main\n"
            "sys.argv = ['slurm-etc', 'status', '--state-dir', sys.argv[1], '--json']\n"
            "main()\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code, str(state)], capture_output=True,
                          text=True, timeout=120)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-2000:]
    assert [j["job_id"] for j in json.loads(done.stdout)["jobs"]] == ["101"]
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "evil.db" in lines[0] and "view" in lines[0], lines
    assert "MemoryError" not in done.stderr and "Traceback" not in done.stderr
    assert took < 30, took


def test_the_owner_is_that_of_the_descriptor_read(tmp_path, monkeypatch):
    """The file is swapped for a forged one (another owner, claiming my job) right after
    its owner was checked: what is shown is still my file's content. Before, the owner
    came from stat() of the path and the file was opened again by path (13 of 300 won)."""
    if os.getuid() != 0:
        pytest.fail("this test needs root (to give a file to another uid); CI runs as root")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    state = tmp_path / "state"
    store = record.open_job_store("101", state_dir=state)
    record.create_job(store, "101", name="mine", owner_uid=os.getuid(), owner_name="me",
                      backend="local", at=T0)
    store.close()
    path = snapshot_path(state, "101")
    forged = tmp_path / "forged.db"
    fs = open_store(forged)
    record.create_job(fs, "101", name="forged", owner_uid=os.getuid(), owner_name="me",
                      backend="local", at=T0 + timedelta(hours=1))
    fs.close()
    os.chown(forged, 4242, -1)
    mine_size = path.stat().st_size
    swapped = []

    def swap_after(original):
        def wrapper(*args, **kwargs):
            st = original(*args, **kwargs)
            if not swapped and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() \
                    and st.st_size == mine_size:
                os.replace(forged, path)  # the attacker wins the race every time
                swapped.append(args[0])
            return st
        return wrapper

    for name in ("stat", "lstat", "fstat"):
        monkeypatch.setattr(os, name, swap_after(getattr(os, name)))
    r = CliRunner().invoke(cli, ["status", "--state-dir", str(state), "--json"],
                           obj={"sees_all_jobs": lambda uid: False})
    monkeypatch.undo()
    assert swapped, "the file was never checked"
    assert r.exit_code == 0, r.output
    assert [j["name"] for j in json.loads(r.stdout)["jobs"]] == ["mine"]


def test_a_file_swapped_in_a_loop_never_speaks_for_me(tmp_path, monkeypatch):
    """The finding's race, run for real: another thread swaps my snapshot and a forged one
    (another owner, claiming my job) as fast as it can while status reads 100 times."""
    import threading

    from slurm_etc.cli.cmd_status import Viewer, gather

    if os.getuid() != 0:
        pytest.fail("this test needs root (to give a file to another uid); CI runs as root")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    state = tmp_path / "state"
    store = record.open_job_store("101", state_dir=state)
    record.create_job(store, "101", name="mine", owner_uid=os.getuid(), owner_name="me",
                      backend="local", at=T0)
    store.close()
    path = snapshot_path(state, "101")
    mine, forged = tmp_path / "mine.db", tmp_path / "forged.db"
    shutil.copy(path, mine)
    fs = open_store(forged)
    record.create_job(fs, "101", name="forged", owner_uid=os.getuid(), owner_name="me",
                      backend="local", at=T0 + timedelta(hours=1))
    fs.close()
    os.chown(forged, 4242, -1)
    stop, swaps = threading.Event(), [0]

    def swap() -> None:
        while not stop.is_set():
            for source in (mine, forged):
                tmp = path.with_name(".swap")
                os.link(source, tmp)
                os.replace(tmp, path)
                swaps[0] += 1

    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    shown: dict[str, int] = {}
    try:
        for _ in range(100):
            for d in gather(None, state, Viewer(os.getuid(), lambda uid: False), None).jobs:
                shown[d.job.name] = shown.get(d.job.name, 0) + 1
    finally:
        stop.set()
        thread.join()
    assert swaps[0] > 100 and "forged" not in shown and shown.get("mine", 0) > 0, shown


def test_another_users_snapshot_is_not_opened_unless_the_viewer_sees_all(tmp_path,
                                                                          monkeypatch):
    if os.getuid() != 0:
        pytest.fail("this test needs root (to give a file to another uid); CI runs as root")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    state = tmp_path / "state"
    other = state / "4242"
    other.mkdir(parents=True)
    _recursive_view(other / "x.db", 4242)  # would cost time if it were read
    os.chown(other, 4242, -1)
    os.chown(other / "x.db", 4242, -1)
    asked = []
    r = CliRunner().invoke(cli, ["status", "--state-dir", str(state), "--json"],
                           obj={"sees_all_jobs": lambda uid: asked.append(uid) or False})
    assert r.exit_code == 0 and json.loads(r.stdout) == {"jobs": []}
    assert r.stderr == "" and asked == [os.getuid()]  # closed unread, nothing said


# ---------------------------------------------------------------- lost, output, secrets


def _job(tmp_path: Path, monkeypatch, name: str = "train", updated: datetime = T0) -> Path:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    state = tmp_path / "state"
    store = record.open_job_store("101", state_dir=state)
    try:
        record.create_job(store, "101", name=name, owner_uid=os.getuid(), owner_name="me",
                          backend="local", at=T0)
        record.set_job_state(store, "101", "running", at=updated)
    finally:
        store.close()
    return state


def test_a_job_whose_coordinator_stopped_writing_is_lost(tmp_path, monkeypatch):
    state = _job(tmp_path, monkeypatch)
    late = {"now": lambda: T0 + timedelta(minutes=7, seconds=12)}
    r = CliRunner().invoke(cli, ["status", "--state-dir", str(state), "--json"], obj=late)
    (job,) = json.loads(r.stdout)["jobs"]
    assert (job["state"], job["recorded_state"], job["last_update_age_seconds"]) == \
        ("lost", "running", 432.0)
    r = CliRunner().invoke(cli, ["status", "--state-dir", str(state)], obj=late,
                           env={"COLUMNS": "80"})
    assert " lost (7m 12s) " in r.stdout
    r = CliRunner().invoke(cli, ["status", "101", "--state-dir", str(state)], obj=late,
                           env={"COLUMNS": "200"})
    assert "state lost (no update for 7m 12s, was running)" in r.stdout
    soon = {"now": lambda: T0 + timedelta(seconds=30)}
    r = CliRunner().invoke(cli, ["status", "--state-dir", str(state), "--json"], obj=soon)
    assert json.loads(r.stdout)["jobs"][0]["state"] == "running"


def test_a_live_coordinator_beats_at_most_every_interval(tmp_path):
    store = record.open_job_store("7", db=tmp_path / "j.db", publish=False)
    try:
        record.create_job(store, "7", name="t", owner_uid=0, owner_name="t",
                          backend="local", at=T0)
        assert record.heartbeat(store, "7", every_s=60, at=T0 + timedelta(minutes=5))
        assert not record.heartbeat(store, "7", every_s=60, at=T0 + timedelta(minutes=6))
        (job,) = record.list_jobs(store)
        assert job.updated_at == T0 + timedelta(minutes=5)
        assert job.shown_state(T0 + timedelta(minutes=6)) == "starting"
        assert job.shown_state(T0 + timedelta(minutes=5) +
                               timedelta(seconds=record.LOST_AFTER_S + 1)) == "lost"
    finally:
        store.close()


def test_job_names_with_terminal_escapes_are_shown_escaped(tmp_path, monkeypatch):
    evil = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\r\u202egnp.exe"
    state = _job(tmp_path, monkeypatch, name=evil, updated=datetime.now(timezone.utc))
    for args in (["--state-dir", str(state)], ["101", "--state-dir", str(state)]):
        r = CliRunner().invoke(cli, ["status", *args], obj={}, env={"COLUMNS": "250"})
        assert r.exit_code == 0, r.output
        assert "\x1b" not in r.stdout and "\x07" not in r.stdout and "\r" not in r.stdout
        assert "\u202e" not in r.stdout
        assert "\\x1b]0;pwned\\x07" in r.stdout and "\\u202e" in r.stdout
    r = CliRunner().invoke(cli, ["status", "--state-dir", str(state), "--json"], obj={})
    assert "\x1b" not in r.stdout and json.loads(r.stdout)["jobs"][0]["name"] == evil


def test_no_password_is_shown_in_any_error(tmp_path):
    site = tmp_path / "site.db"
    open_store(site).close()
    secret = "s3cr3t-pw"
    for url, why in ((f"sqlite://user:{secret}@/{site}", "no job 999 of yours in "),
                     (f"mysql+pymysql://user:{secret}@127.0.0.1:1/db", "cannot"),
                     (f"nosuch+driver://user:{secret}@h/db", "unknown database kind"),
                     (f"mysql+pymysql://user:{secret}@[::1/db", "")):
        r = CliRunner().invoke(cli, ["status", "999", "--db", url], obj={})
        assert r.exit_code == 2, (url, r.output)
        assert secret not in r.output and r.stderr.count("\n") == 1, r.stderr
        assert why in r.stderr and "Traceback" not in r.output


def test_a_password_file_keeps_the_password_out_of_argv(tmp_path):
    site = tmp_path / "site.db"
    open_store(site).close()
    secret = "s3cr3t-pw"
    url_file = tmp_path / "url"
    url_file.write_text(f"sqlite://user:{secret}@/{site}\n")
    os.chmod(url_file, 0o644)
    exe = Path(sys.executable).with_name("slurm-etc")
    argv = [str(exe), "status", "999", "--db", f"@{url_file}"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "owner-only" in r.stderr and secret not in r.stderr
    os.chmod(url_file, 0o600)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"slurm-etc: error: no job 999 of yours in @{url_file}"
    assert secret not in " ".join(argv)
    pw = tmp_path / "pw"
    pw.write_text(secret + "\n")
    os.chmod(pw, 0o600)
    r = subprocess.run([str(exe), "status", "--db", "mysql+pymysql://user@127.0.0.1:1/db",
                        "--db-password-file", str(pw)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and secret not in r.stderr and r.stderr.count("\n") == 1
    assert "127.0.0.1" in r.stderr  # it tried the server, with the password from the file


# ---------------------------------------------------------------- policies and modes


def _site_policy(path: Path, **fields: str) -> None:
    from slurm_etc.policy.rules import Scope
    from slurm_etc.store.policies import set_policy

    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o755)
    store = open_store(path, file_mode=0o644)
    try:
        set_policy(store, Scope("partition", "gpu"),
                   {k: int(v) if v.isdigit() else v for k, v in fields.items()}, "root")
    finally:
        store.close()


def test_a_users_policy_db_can_only_make_the_sites_stricter(tmp_path):
    from slurm_etc.coordinator.policy_lookup import job_policy

    site = tmp_path / "etc" / "policies.db"
    _site_policy(site, max_nodes="4", min_nodes="2")
    own = tmp_path / "mine.db"
    _site_policy(own, max_nodes="64", min_nodes="1", max_resizes_per_hour="3")
    got = job_policy("gpu", None, str(own), site=site)
    assert (got.max_nodes, got.min_nodes, got.max_resizes_per_hour) == (4, 2, 3)
    assert job_policy("gpu", None, site=site).max_nodes == 4
    # the site's file must be root's alone: one a user could write binds nobody
    os.chmod(site, 0o666)
    from slurm_etc.plan.errors import ConfigError

    with pytest.raises(ConfigError, match="writable by nobody else"):
        job_policy("gpu", None, site=site)


def test_a_site_policy_a_user_cannot_read_is_an_error_not_no_policy(victim, shared):
    from slurm_etc.coordinator.policy_lookup import job_policy
    from slurm_etc.plan.errors import ConfigError

    site = shared / "etc" / "policies.db"
    _site_policy(site, max_nodes="4")
    os.chmod(site.parent, 0o700)  # a root umask of 077: nobody else may look

    def look() -> str:
        try:
            return f"read: max_nodes {job_policy('gpu', None, site=site).max_nodes}"
        except ConfigError as exc:
            return str(exc)

    assert "cannot read the site's policies" in as_user(victim, look)


def _hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _as_namespace_root(work: Any) -> Any:
    """``work()`` after ``unshare -r``: a new user namespace in which the caller is uid 0
    (what anyone can do on a kernel that allows unprivileged user namespaces)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE (setuid cleared it): /proc/self is ours
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                       ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return work()


def test_a_user_namespace_root_cannot_write_the_sites_policies(victim, shared):
    """Under ``unshare -r`` the admin check sees uid 0 and says root; the kernel still
    refuses to write a file of the real root: the file permission is the boundary."""
    site = shared / "etc" / "policies.db"
    _site_policy(site, max_nodes="4")
    before = _hash(site)
    CliRunner().invoke(cli, ["policy", "show"], obj={"site_policy_db": str(site)})  # loads

    def attempt() -> dict[str, Any]:
        r = CliRunner().invoke(cli, ["policy", "set", "--partition", "gpu", "max_nodes=999"],
                               obj={"site_policy_db": str(site)})
        return {"uid": os.getuid(), "exit_code": r.exit_code, "stderr": r.stderr,
                "exception": repr(r.exception)}

    out = as_user(victim, lambda: _as_namespace_root(attempt))
    assert out["uid"] == 0  # "root" as far as the process can tell
    assert out["exit_code"] == 2, out
    lines = out["stderr"].strip().splitlines()
    assert len(lines) == 1 and "permission denied" not in lines[0], out  # the check passed
    assert "readonly database" in lines[0] or "unable to open" in lines[0], out
    assert _hash(site) == before and os.stat(site).st_uid == 0


def test_new_databases_are_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        db = tmp_path / "new" / "etc.db"
        r = CliRunner().invoke(cli, ["policy", "--db", str(db), "set", "--partition", "gpu",
                                     "max_nodes=4"], obj={"admin_check": _admin})
        assert r.exit_code == 0, r.output
        assert stat.S_IMODE(db.stat().st_mode) == 0o600
        site = tmp_path / "jobs.db"
        open_store(site).close()
        assert stat.S_IMODE(site.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def _admin():
    from slurm_etc.policy.admin import AdminVerdict

    return AdminVerdict(True, "root", "root")


def test_recovery_names_the_open_request_for_its_checks(tmp_path):
    """What a restarted coordinator needs to check an open request again (policy, cluster)
    before resending it: its key and size, from the record."""
    store = record.open_job_store("9", db=tmp_path / "j.db", publish=False)
    try:
        record.create_job(store, "9", name="t", owner_uid=0, owner_name="t", backend="local")
        assert record.recover(store, "9").open_request is None
        record.record_event(store, "9", "request", source="coordinator", key="request:grow-1",
                            payload={"nodes": 3, "summary": "grow to 4 nodes"}, at=T0)
        got = record.recover(store, "9").open_request
        assert got == record.OpenRequest("grow-1", 3, "grow to 4 nodes", T0)
        record.record_event(store, "9", "grant", source="local", key="grant:m1",
                            payload={"request": "grow-1"})
        assert record.recover(store, "9").open_request is None
    finally:
        store.close()


@pytest.mark.parametrize("limits, said", [
    ({"seconds": 0.0}, "reading it took longer than 0 s (stopped)"),
    ({"heap_bytes": 64 << 10}, "more than 0.0625 MiB (stopped)"),
    ({"max_bytes": 1024}, "more than the 1024 a job record may have")])
def test_each_file_is_read_within_its_bounds(tmp_path, monkeypatch, limits, said):
    """Time (SQLite's progress handler), SQLite's memory (hard heap limit) and size: a file
    past one is one line and skipped; the bounds are restored afterwards."""
    import sqlite3

    from slurm_etc.cli.cmd_status import Viewer, gather
    from slurm_etc.store.guard import ReadLimits

    state = _job(tmp_path, monkeypatch)
    snap = snapshot_path(state, "101")
    with sqlite3.connect(snap) as db:  # enough rows to take time
        db.executemany("INSERT INTO jobs (job_id, name, owner_uid, owner_name, state, backend,"
                       " created_at, updated_at) VALUES (?, 'x', ?, 'x', 'running', "
                       "'local', '2026-12-01', '2026-12-01')",
                       [(f"x{i}", os.getuid()) for i in range(3_000)])
    found = gather(None, state, Viewer(os.getuid(), lambda uid: False), None,
                   ReadLimits(**limits))
    assert found.jobs == [] and len(found.warnings) == 1, found.warnings
    assert found.warnings[0].startswith(f"skipped {os.getuid()}/101.db: ")
    assert said in found.warnings[0]
    with sqlite3.connect(":memory:") as db:
        assert db.execute("PRAGMA hard_heap_limit").fetchone() == (0,)
    with sqlite3.connect(snap) as db:
        db.execute("DELETE FROM jobs WHERE job_id LIKE 'x%'")
    found = gather(None, state, Viewer(os.getuid(), lambda uid: False), None)
    assert found.warnings == [] and [d.job.job_id for d in found.jobs] == ["101"]


def test_a_recursive_view_given_with_db_is_one_line(tmp_path):
    """The same file named with --db (a site's database that someone could write): one
    line, exit 2, in seconds; the file is left as it was."""
    evil = tmp_path / "site.db"
    _recursive_view(evil, os.getuid())
    before = _hash(evil)
    started = time.monotonic()
    r = CliRunner().invoke(cli, ["status", "--db", str(evil), "--json"], obj={})
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert r.stderr.startswith(f"slurm-etc: error: {evil} is not a slurm-etc database: "
                               "it has a view 'jobs'")
    assert time.monotonic() - started < 10 and _hash(evil) == before
