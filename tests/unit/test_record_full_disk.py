"""A full disk under the job's record (ENOSPC for real: a 4 MiB tmpfs holding the record and
the state directory) while a job trains: the workers keep training, the coordinator warns
once, the record catches up when space returns and ends ``finished``. A disk full at the
start: one line, a non-zero exit, no traceback. Before: the coordinator died with a
traceback, its workers with it, and the snapshot said ``running`` forever.

The real coordinator (run_job: SQLite record, control channel, local backend) with stand-in
workers that speak the real protocol (bench/fake_worker.py), so one case takes seconds."""
from __future__ import annotations

import errno
import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.coordinator.deciding import HELD_FOR_RECORD
from slurm_etc.coordinator.job import JobSpec
from slurm_etc.coordinator.run import run_job
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.script import script_from_options
from slurm_etc.plan import load_model
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.store.location import snapshot_path

FAKE = Path(__file__).resolve().parents[2] / "bench" / "fake_worker.py"
SLURM_ETC = os.path.join(os.path.dirname(sys.executable), "slurm-etc")
STEPS, FULL_AT, FREE_AT = 80, 15, 50


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs (root only: skipped elsewhere), unmounted after the test."""
    where = tmp_path / "fs"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if got.returncode != 0:  # root that cannot mount: a broken machine, not a reason to skip
        pytest.fail(f"cannot mount a 4 MiB tmpfs as root: {got.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(where: Path) -> Path:
    """Write zeros into ``where`` until the filesystem is full."""
    ballast = where / "ballast"
    with open(ballast, "wb") as f:
        chunk = b"\0" * 65536
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    return ballast


def full_between(where: Path, ballast: list[Path]) -> Any:
    """A progress callback that fills ``where`` at step FULL_AT and frees it at FREE_AT (the
    ballast file kept in ``ballast``)."""
    def progress(p: dict) -> None:
        if p["step"] >= FULL_AT and not ballast:
            ballast.append(fill(where))
        elif p["step"] >= FREE_AT and ballast and ballast[0].exists():
            ballast[0].unlink()
    return progress


def test_training_goes_on_through_a_full_disk_and_the_record_catches_up(small_fs, caplog):
    job = "full-disk"
    spec = JobSpec(job, "t", (sys.executable, str(FAKE)),
                   TrainingJob(load_model("small"), 16, 1, True), EffectivePolicy(grow=False),
                   Hardware(gpus_per_node=2), worker_timeout_s=30.0,
                   env={"FAKE_STEPS": str(STEPS), "FAKE_STEP_S": "0.05"})
    backend = LocalBackend(script_from_options(1, 2), log_dir=small_fs.parent / "workers")
    db, states = small_fs / "job.db", small_fs / "state"
    seen: list[int] = []
    ballast: list[Path] = []

    fill_and_free = full_between(small_fs, ballast)

    def progress(p: dict) -> None:
        seen.append(p["step"])
        fill_and_free(p)

    caplog.set_level(logging.INFO)
    out = run_job(spec, backend, backend.topology, db=str(db), state_dir=str(states),
                  secret_dir=small_fs.parent / "keys", deadline_s=120, progress=progress)
    assert out["state"] == "finished" and out["step"] == STEPS, out
    assert ballast and not ballast[0].exists()
    # training went on while the disk was full: every step was heard of
    assert seen == list(range(1, STEPS + 1)), seen
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING
              and "cannot be written" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    disk = [r for r in caplog.records if r.levelno >= logging.WARNING
            and ("disk is full" in r.getMessage() or "No space" in r.getMessage())]
    # the record's, the snapshot's and the local cluster's state file's: one each
    assert len(disk) <= 3, [r.getMessage()[:120] for r in disk]
    assert any("caught up" in r.getMessage() for r in caplog.records)
    for path in (db, snapshot_path(states, job)):  # the record and its published snapshot
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            state, = con.execute("SELECT state FROM jobs").fetchone()
            last, = con.execute("SELECT max(last_step) FROM generations").fetchone()
        finally:
            con.close()
        assert (state, last) == ("finished", STEPS), path


def test_a_full_state_directory_warns_once_and_publishes_when_space_returns(small_fs,
                                                                          caplog):
    """The record on a disk with room, the shared state directory full: the snapshot cannot
    be published after each commit; one warning for the outage (not one per step), and the
    snapshot is published again, ``finished``, once space returns."""
    job = "full-state"
    spec = JobSpec(job, "t", (sys.executable, str(FAKE)),
                   TrainingJob(load_model("small"), 16, 1, True), EffectivePolicy(grow=False),
                   Hardware(gpus_per_node=2), worker_timeout_s=30.0,
                   env={"FAKE_STEPS": str(STEPS), "FAKE_STEP_S": "0.05"})
    backend = LocalBackend(script_from_options(1, 2), log_dir=small_fs.parent / "workers")
    db, states = small_fs.parent / "job.db", small_fs / "state"
    ballast: list[Path] = []
    progress = full_between(small_fs, ballast)

    caplog.set_level(logging.INFO)
    out = run_job(spec, backend, backend.topology, db=str(db), state_dir=str(states),
                  secret_dir=small_fs.parent / "keys", deadline_s=120, progress=progress)
    assert out["state"] == "finished", out
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    failed = [m for m in warned if "cannot publish" in m]
    assert len(failed) == 1, failed[:3]
    assert any("published" in m and "again" in m for m in warned), warned
    con = sqlite3.connect(f"file:{snapshot_path(states, job)}?mode=ro", uri=True)
    try:
        assert con.execute("SELECT state FROM jobs").fetchone() == ("finished",)
    finally:
        con.close()


def test_a_full_disk_at_the_start_is_one_line(small_fs):
    fill(small_fs)
    got = subprocess.run([SLURM_ETC, "run", "--model", "tiny", "--global-batch", "8",
                          "--nodes", "1", "--job-id", "full-start", "--db",
                          str(small_fs / "job.db"), "--state-dir", str(small_fs / "state"),
                          "--hardware", "cpu", "--", "true"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert got.returncode != 0
    lines = [x for x in got.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in got.stderr, got.stderr[-2000:]
    assert lines[0].startswith("slurm-etc: error:") and "full" in lines[0], lines


def test_a_grant_on_a_full_disk_is_launched_once_the_record_holds_it(small_fs, caplog):
    """Record, then act (soak seeds 101, 104, 107, 202): a decision taken while the record
    cannot be written launched workers the record never heard of; a coordinator killed then
    restarted on a record without them and launched the layout again beside them. Now a
    grant that comes on a full disk waits for the record: its joiner is launched after the
    record caught up, and the record names the process (a restart would take it up)."""
    job, grant_at = "full-disk-grant", FULL_AT + 10
    spec = JobSpec(job, "t", (sys.executable, str(FAKE)),
                   TrainingJob(load_model("small"), 16, 1, True),
                   EffectivePolicy(grow=True, max_nodes=2), Hardware(gpus_per_node=1),
                   worker_timeout_s=30.0,
                   env={"FAKE_STEPS": str(STEPS), "FAKE_STEP_S": "0.05"})
    backend = LocalBackend(script_from_options(2, 1, 1, [{"at_step": grant_at, "grant": 1}]),
                           log_dir=small_fs.parent / "workers")
    db = small_fs / "job.db"
    ballast: list[Path] = []
    progress = full_between(small_fs, ballast)

    caplog.set_level(logging.INFO)
    out = run_job(spec, backend, backend.topology, db=str(db), state_dir=str(small_fs / "st"),
                  secret_dir=small_fs.parent / "keys", deadline_s=120, progress=progress)
    assert out["state"] == "finished", out
    said = [r.getMessage() for r in caplog.records]
    held = [i for i, m in enumerate(said) if m.startswith(HELD_FOR_RECORD)]
    caught = next(i for i, m in enumerate(said) if "caught up" in m)
    launched = next(i for i, m in enumerate(said) if "launched vrank 1" in m)
    assert len(held) == 1 and held[0] < caught < launched, said[held[0] if held else 0:][:12]
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        kinds = [k for k, in con.execute("SELECT kind FROM events ORDER BY id")]
    finally:
        con.close()
    assert kinds.count("launch") == 2, kinds  # the first worker's and the joiner's
