"""A coordinator SIGKILLed after a few periodic checkpoints, its workers killed too (a
restarted coordinator reattaches live workers: tests/dist/test_coordinator_restart.py; the
checkpoint is for when none is alive), started again on the same record: the restarted job
resumes from the newest complete checkpoint, never writes a step below it, never deletes it
before a newer one is complete, and finishes. Before: every restarted worker began at step 0,
the first periodic save deleted the newest checkpoint (`step-48` gone, `step-3` kept), and
the killed coordinator's workers trained on beside the new ones.

Real components: the coordinator (run_job, SQLite record, control channel, local backend),
the preset trainer's worker processes, megatron-core checkpoints. Oracles: the checkpoint
directory watched from here every 20 ms, /proc, the record read with plain sqlite3, the
progress stream and the workers' logs."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

DRIVER = Path(__file__).with_name("checkpoint_restart_driver.py")
STEPS, EVERY, KILL_AFTER = 15, 3, 6
# How long the killed workers' checkpoint helpers (their process group) may live on.
ORPHAN_BOUND_S = 5.0


def _steps(ckpt: Path) -> set[int]:
    try:
        names = os.listdir(ckpt)
    except OSError:
        return set()
    return {int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit()}


def _workers_of(job: str) -> list[int]:
    mark = f"SLURM_ETC_JOB={job}".encode()
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                status = Path(f"/proc/{pid}/status").read_text()
                if "\nState:\tZ" not in status:
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def _driver(tmp: Path, job: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(DRIVER), str(tmp), job, str(STEPS),
                             str(EVERY)], env=env, stdout=subprocess.PIPE,
                            stderr=open(tmp / f"driver-{time.monotonic_ns()}.log", "w"),
                            text=True)


def test_restart_resumes_from_the_newest_checkpoint(tmp_path: Path) -> None:
    job = f"ckrestart-{os.getpid()}"
    ckpt = tmp_path / "ckpt"
    first = _driver(tmp_path, job)
    try:
        deadline = time.monotonic() + 600
        while max(_steps(ckpt), default=0) < KILL_AFTER:
            assert first.poll() is None, "the first coordinator ended on its own"
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    for pid in _workers_of(job):  # the workers die too: nothing is left to reattach
        try:  # a worker leads its process group: its checkpoint helpers go with it
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # not a group leader (a helper): its worker's group takes it
    killed_at = time.monotonic()
    while _workers_of(job) and time.monotonic() - killed_at < ORPHAN_BOUND_S + 30:
        time.sleep(0.1)
    orphans_for = time.monotonic() - killed_at
    left = _workers_of(job)
    for pid in left:  # do not leave them behind whatever the verdict
        os.kill(pid, signal.SIGKILL)
    print(f"the killed workers' processes lived {orphans_for:.1f} s after them")
    assert not left and orphans_for < ORPHAN_BOUND_S, \
        f"processes {left} of the killed workers lived {orphans_for:.1f} s"

    newest = max(_steps(ckpt))  # complete: a half-written one is step-N.partial
    at_kill = _steps(ckpt)
    seen: list[set[int]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(_steps(ckpt))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    second = _driver(tmp_path, job)
    try:
        out, _ = second.communicate(timeout=600)
    finally:
        stop.set()
        watcher.join()
        if second.poll() is None:
            second.kill()
    logs = "".join(p.read_text() for p in tmp_path.glob("driver-*.log"))
    assert second.returncode == 0, logs[-3000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"state": "finished", "step": STEPS}

    # the newest checkpoint is never gone, and nothing below it is written again
    assert all(max(s, default=-1) >= newest for s in seen), \
        [sorted(s) for s in seen if max(s, default=-1) < newest][:3]
    written = set().union(*seen) - at_kill
    assert all(s > newest for s in written), (sorted(written), newest)
    final = _steps(ckpt)
    assert max(final) == STEPS - STEPS % EVERY and len(final) <= 2, sorted(final)

    # the restarted coordinator's steps start after the checkpoint's
    runs: dict[int, list[int]] = {}
    for line in (tmp_path / "progress.jsonl").read_text().splitlines():
        p = json.loads(line)
        runs.setdefault(p["run"], []).append(p["step"])
    assert len(runs) == 2 and second.pid in runs, runs.keys()
    assert min(runs[second.pid]) == newest + 1, (newest, runs[second.pid][:5])
    con = sqlite3.connect(f"file:{tmp_path / 'job.db'}?mode=ro", uri=True)
    try:
        first_step = con.execute("SELECT first_step FROM generations ORDER BY number DESC "
                                 "LIMIT 1").fetchone()[0]
        state = con.execute("SELECT state FROM jobs").fetchone()[0]
    finally:
        con.close()
    assert (first_step, state) == (newest, "finished")
    worker_logs = "".join(p.read_text() for p in tmp_path.glob(f"workers-{second.pid}/*.log"))
    assert f"from step {newest}" in worker_logs, worker_logs[-2000:]


def test_orphaned_workers_exit_within_their_reattach_wait(tmp_path: Path) -> None:
    """Workers whose coordinator was SIGKILLed and never restarted (started behind a shell
    here) hear no heartbeat, hold, and exit within the reattach wait (8 s here) plus a step;
    before, they trained on until their collective timeout."""
    job = f"orphans-{os.getpid()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen([sys.executable, str(DRIVER), str(tmp_path), job, "200", "0",
                               "orphans"], env=env, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "driver.log", "w"))
    progress = tmp_path / "progress.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not progress.exists() or len(progress.read_text().splitlines()) < 3:
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no training step"
            time.sleep(0.1)
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
    finally:
        if driver.poll() is None:
            driver.kill()
    killed_at = time.monotonic()
    assert _workers_of(job), "no orphaned worker to watch (the wrapper did not orphan them)"
    while _workers_of(job) and time.monotonic() - killed_at < 120:
        time.sleep(0.2)
    lived = time.monotonic() - killed_at
    left = _workers_of(job)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    print(f"orphaned workers lived {lived:.1f} s after the coordinator")
    assert not left and lived < 8.0 + 12.0, f"workers {left} lived {lived:.1f} s"
    logs = "".join(p.read_text() for p in tmp_path.glob("workers-*/*.log"))
    assert "no word from the coordinator" in logs, logs[-2000:]
