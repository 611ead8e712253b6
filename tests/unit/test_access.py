"""Access: who sees which jobs, which files only their owner may read, where the secret is not.

* A real second local user (made with ``useradd`` here, removed after; the tests need root
  and fail, not skip, without it) runs ``slurm-etc status`` in a forked process that has
  really switched uid: it sees its own job and not root's, from a shared state directory
  and from a site database it can read; root sees both.
* The job's record (database, its directory, the published snapshot), its secret and the
  workers' logs are owner-only (0600 files, 0700 directories) under the usual umask 0022.
* A real ``slurm-etc run`` (coordinator and two training workers): while it runs, no process
  on the machine has the secret (raw, hex or base64) in its argv or environment, the workers
  do get the secret file's path, and afterwards neither its output, the logs nor the record
  hold the secret. The scanner is shown to find a planted process that carries it.
"""
from __future__ import annotations

import base64
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_etc.alloc.topology import Device
from slurm_etc.cli.main import cli
from slurm_etc.coordinator.backend import LaunchWorkers, WorkerExited, WorkerSpec
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.script import parse_script
from slurm_etc.protocol.channel import create_secret
from slurm_etc.store import jobs as record
from slurm_etc.store.db import open_store
from tests.unit.second_user import as_user, local_user

pytestmark = pytest.mark.unit

EXE = Path(sys.executable).with_name("slurm-etc")


@pytest.fixture(scope="module")
def second_user() -> Iterator[pwd.struct_passwd]:
    with local_user(f"etcuser{os.getpid() % 100000}") as user:
        yield user


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another user can reach (pytest's tmp_path is root's own)."""
    path = Path(tempfile.mkdtemp(prefix="slurm-etc-access-", dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _job_db(path: Path, jobs: list[tuple[str, int, str]], mode: int, owner: int) -> None:
    store = open_store(path)
    try:
        for job_id, uid, name in jobs:
            record.create_job(store, job_id, name=f"train-{job_id}", owner_uid=uid,
                              owner_name=name, backend="local", model="tiny")
    finally:
        store.close()
    os.chmod(path, mode)
    os.chown(path, owner, -1)


def _status(args: list[str]) -> dict[str, Any]:
    r = CliRunner().invoke(cli, ["status", *args])
    return {"exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}


def _ids(out: dict[str, Any]) -> list[str]:
    assert out["exit_code"] == 0, out
    return sorted(j["job_id"] for j in json.loads(out["stdout"])["jobs"])


def test_status_shows_a_second_user_only_their_jobs(second_user: pwd.struct_passwd,
                                                     shared_dir: Path) -> None:
    me, you = (0, "root"), (second_user.pw_uid, second_user.pw_name)
    states = shared_dir / "jobs"  # a site-wide state directory, like /tmp: sticky, open
    states.mkdir()
    os.chmod(states, 0o1777)
    for uid in (me[0], you[0]):  # each user's snapshots in a directory of their own
        (states / str(uid)).mkdir(mode=0o700)
        os.chown(states / str(uid), uid, -1)
    _job_db(states / "0" / "101.db", [("101", *me)], 0o600, 0)  # root's snapshot: private
    _job_db(states / str(you[0]) / "202.db", [("202", *you)], 0o600, you[0])  # the user's
    site = shared_dir / "site.db"  # a site database both may read (as a MariaDB would be)
    _job_db(site, [("101", *me), ("202", *you), ("303", *me)], 0o644, 0)
    # Slurm says the user is no operator (a stand-in sacctmgr in a trusted directory; it
    # logs whom it was asked about)
    sbin = shared_dir / "sbin"
    sbin.mkdir()
    asked = shared_dir / "asked.log"
    asked.touch()
    os.chmod(asked, 0o666)
    (sbin / "sacctmgr").write_text(f'#!/bin/sh\necho "$4" >> {asked}\necho "$4|None"\n')
    os.chmod(sbin, 0o755)
    os.chmod(sbin / "sacctmgr", 0o755)

    queries = {"state": ["--state-dir", str(states), "--json"],
               "site": ["--db", str(site), "--json"],
               "root's job": ["101", "--db", str(site)]}
    as_root = {k: _status(v) for k, v in queries.items()}  # also loads what the child runs
    assert _ids(as_root["state"]) == ["101", "202"]
    assert _ids(as_root["site"]) == ["101", "202", "303"]
    assert as_root["root's job"]["exit_code"] == 0

    def look() -> dict[str, Any]:
        from slurm_etc.cli import cmd_status  # loaded by main's import

        cmd_status.SACCTMGR_DIRS = (str(sbin),)
        return {k: _status(v) for k, v in queries.items()}

    seen = as_user(second_user, look)
    assert _ids(seen["state"]) == ["202"]
    assert seen["state"]["stderr"] == ""  # root's private snapshot is not even mentioned
    assert _ids(seen["site"]) == ["202"]
    assert seen["root's job"]["exit_code"] == 2
    assert seen["root's job"]["stderr"].strip() == (
        f"slurm-etc: error: no job 101 of yours in {site}")
    assert asked.read_text().split() == [second_user.pw_name] * 2  # asked as itself


def test_status_checker_would_see_a_leak(second_user: pwd.struct_passwd,
                                         shared_dir: Path) -> None:
    """The same check, planted bug: a viewer told it sees all jobs does see root's."""
    site = shared_dir / "site.db"
    _job_db(site, [("101", 0, "root"), ("202", second_user.pw_uid, second_user.pw_name)],
            0o644, 0)
    _status(["--db", str(site), "--json"])

    def look() -> dict[str, Any]:
        from slurm_etc.cli import cmd_status

        cmd_status.SACCTMGR_DIRS = ()
        r = CliRunner().invoke(cli, ["status", "--db", str(site), "--json"],
                               obj={"sees_all_jobs": lambda uid: True})
        return {"exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}

    assert _ids(as_user(second_user, look)) == ["101", "202"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_record_secret_and_logs_are_owner_only(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        env = {"TMPDIR": str(tmp_path / "tmp"), "SLURM_TMPDIR": ""}
        (tmp_path / "tmp").mkdir()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            store = record.open_job_store("acc-7", state_dir=tmp_path / "state")
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        try:
            record.create_job(store, "acc-7", name="x", owner_uid=0, owner_name="root",
                              backend="local")
            store.flush()
        finally:
            store.close()
        db = tmp_path / "tmp" / f"slurm-etc-{os.getuid()}" / "jobs" / "acc-7.db"
        assert _mode(db) == 0o600 and _mode(db.parent) == 0o700
        assert _mode(db.parent.parent) == 0o700
        snapshot = tmp_path / "state" / str(os.getuid()) / "acc-7.db"
        assert _mode(snapshot) == 0o600 and _mode(snapshot.parent) == 0o700
        assert _mode(snapshot.parent.parent) == 0o700

        secret = create_secret("acc-7", tmp_path / "secrets")
        assert _mode(secret.path) == 0o600 and _mode(secret.path.parent) == 0o700

        backend = LocalBackend(parse_script(json.dumps({"nodes": 1, "gpus_per_node": 1})),
                               log_dir=tmp_path / "run" / "workers")
        try:
            backend.poll()
            backend.launch(LaunchWorkers(0, (WorkerSpec(0, Device("n0", 0)),),
                                         (sys.executable, "-c", "print('hi')")))
            deadline = time.monotonic() + 30
            while not any(isinstance(e, WorkerExited) for e in backend.poll()):
                assert time.monotonic() < deadline
                time.sleep(0.02)
        finally:
            backend.close()
        log = tmp_path / "run" / "workers" / "gen0-vrank0.log"
        assert log.read_text() == "hi\n"
        assert _mode(log) == 0o600 and _mode(log.parent) == 0o700
    finally:
        os.umask(old)


# ------------------------------------------------------------------ the secret stays secret


def _forms(key: bytes) -> list[bytes]:
    return [key, key.hex().encode(), key.hex().upper().encode(), base64.b64encode(key),
            base64.urlsafe_b64encode(key), base64.b64encode(key).rstrip(b"=")]


def _scan_processes(forms: list[bytes]) -> tuple[list[str], list[bytes]]:
    """Processes whose argv or environment holds one of ``forms``; every argv seen."""
    leaks, argvs = [], []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{entry.name}/{part}", "rb") as f:
                    data = f.read()
            except OSError:
                continue  # gone, or a kernel thread
            if part == "cmdline":
                argvs.append(data)
            if any(form in data for form in forms):
                leaks.append(f"pid {entry.name} {part}: {data[:200]!r}")
    return leaks, argvs


def test_the_scanner_finds_a_planted_secret() -> None:
    key = os.urandom(32)
    for form in (key.hex(), base64.b64encode(key).decode()):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", form])
        try:
            time.sleep(0.2)
            leaks, _ = _scan_processes(_forms(key))
            assert any(f"pid {proc.pid} cmdline" in leak for leak in leaks), leaks
        finally:
            proc.kill()
            proc.wait()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            env={**os.environ, "LEAK": key.hex()})
    try:
        time.sleep(0.2)
        leaks, _ = _scan_processes(_forms(key))
        assert any(f"pid {proc.pid} environ" in leak for leak in leaks), leaks
    finally:
        proc.kill()
        proc.wait()


def test_no_secret_in_argv_environment_logs_or_record(tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmp"),
           "SLURM_ETC_STATE_DIR": str(tmp_path / "state"), "SLURM_TMPDIR": "",
           "SLURM_JOB_ID": ""}
    (tmp_path / "tmp").mkdir()
    key_file = tmp_path / "home" / ".slurm-etc" / "secrets" / "acc-run.key"
    out, err = open(tmp_path / "out.json", "wb"), open(tmp_path / "err.txt", "wb")
    run = subprocess.Popen(
        [str(EXE), "-v", "run", "--nodes", "1", "--gpus-per-node", "2", "--model", "tiny",
         "--global-batch", "8", "--job-id", "acc-run", "--json", "--",
         sys.executable, "-m", "slurm_etc.worker.preset_worker", "--model", "tiny",
         "--global-batch", "8", "--train-steps", "4"],
        env=env, stdout=out, stderr=err)
    leaks: list[str] = []
    workers_seen: set[bytes] = set()
    scans = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal scans
        while not key_file.exists() and not stop.is_set():
            time.sleep(0.02)
        if stop.is_set():
            return
        forms = _forms(key_file.read_bytes())
        while not stop.is_set():
            found, argvs = _scan_processes(forms)
            leaks.extend(found)
            workers_seen.update(a for a in argvs if b"slurm_etc.worker.preset_worker" in a)
            scans += 1
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert run.wait(timeout=300) == 0, (tmp_path / "err.txt").read_text()[-3000:]
    finally:
        stop.set()
        watcher.join(timeout=10)
        if run.poll() is None:
            run.kill()
            run.wait()
        out.close()
        err.close()
    assert json.loads((tmp_path / "out.json").read_text())["state"] == "finished"
    key = key_file.read_bytes()
    assert len(key) == 32 and _mode(key_file) == 0o600
    assert scans >= 3 and len(workers_seen) >= 1, (scans, workers_seen)
    assert leaks == []
    # everything the run wrote: its output, verbose log, the record and its snapshot
    written = [tmp_path / "out.json", tmp_path / "err.txt",
               *[p for p in (tmp_path / "tmp").rglob("*") if p.is_file()],
               *[p for p in (tmp_path / "state").rglob("*") if p.is_file()]]
    assert any(p.suffix == ".db" for p in written)
    assert b"vrank 0" in (tmp_path / "err.txt").read_bytes()  # the workers' log lines
    for path in written:
        data = path.read_bytes()
        assert not any(form in data for form in _forms(key)), f"the secret is in {path}"
    assert str(key_file).encode() not in (tmp_path / "out.json").read_bytes()
