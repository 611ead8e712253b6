"""SIGTERM (scancel, the time limit) and SIGINT end the job through the clean close of any
other end: workers stopped, the backend closed, and the record ends ``cancelled`` with the
signal as its reason (before, SystemExit went past the loop's end and the record said
``running``)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.alloc.topology import ClusterTopology
from slurm_etc.coordinator.job import JobSpec
from slurm_etc.coordinator.run import run_job
from slurm_etc.plan.model import PRESETS
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.store import jobs as record
from slurm_etc.store.db import open_store_readonly
from tests.unit.coordinator_harness import HandDrivenBackend

SLURM_ETC = os.path.join(os.path.dirname(sys.executable), "slurm-etc")


class SignalOnPoll(HandDrivenBackend):
    """A backend that sends the coordinator ``signum`` at its first poll and notes that it
    was closed."""

    def __init__(self, signum: int) -> None:
        super().__init__(ClusterTopology(2, ("n0",)))
        self.signum = signum
        self.closed = 0
        self.polls = 0

    def poll(self):
        self.polls += 1
        if self.polls == 1:
            os.kill(os.getpid(), self.signum)
        return []

    def close(self):
        self.closed += 1


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_record_cancelled(tmp_path, signum):
    backend = SignalOnPoll(signum)
    spec = JobSpec("term-1", "t", ("true",), TrainingJob(PRESETS["tiny"], 8, 1, False),
                   EffectivePolicy(), Hardware(gpus_per_node=2))
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    out = run_job(spec, backend, ClusterTopology(2, ("n0",)), db=str(tmp_path / "job.db"),
                  state_dir=str(tmp_path / "state"), secret_dir=tmp_path / "secret")
    assert out["state"] == "cancelled" and out["signal"] == signum, out
    assert backend.closed == 1
    assert {s: signal.getsignal(s) for s in before} == before
    store = open_store_readonly(tmp_path / "job.db")
    try:
        detail = record.job_detail(store, "term-1")
    finally:
        store.close()
    assert detail is not None and detail.job.state == "cancelled", detail.job
    assert signal.Signals(signum).name in (detail.job.reason or ""), detail.job.reason
    assert detail.job.ended_at is not None


def test_sigterm_to_slurm_etc_run_cancels_and_status_says_so(tmp_path):
    """The real command: `slurm-etc run` with workers that never join, SIGTERM once the
    record says running; exit 128+15, and `slurm-etc status` shows the job cancelled."""
    db, states = tmp_path / "job.db", tmp_path / "state"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [SLURM_ETC, "run", "--model", "tiny",
         "--global-batch", "8", "--nodes", "1", "--job-id", "term-cli", "--db", str(db),
         "--state-dir", str(states), "--hardware", "cpu", "--",
         sys.executable, "-c", "import time; time.sleep(600)"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if db.exists():
                store = open_store_readonly(db)
                try:
                    d = record.job_detail(store, "term-cli")
                finally:
                    store.close()
                if d is not None and d.job.state == "running" and d.generations:
                    break
            time.sleep(0.2)
        else:
            pytest.fail("the job never ran")
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    status = subprocess.run([SLURM_ETC, "status", "term-cli",
                             "--db", str(db), "--json"], capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0, status.stderr
    (job,) = json.loads(status.stdout)["jobs"]
    assert job["state"] == "cancelled", job
    assert "SIGTERM" in job["reason"], job
