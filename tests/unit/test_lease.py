"""One coordinator per job (issue #43): the lease in the job's record. A second coordinator
on a live job is refused in one line (exit 2) and writes nothing; the lease goes with its
holder however that ends (SIGKILL included)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.alloc.topology import ClusterTopology
from slurm_etc.coordinator.job import JobSpec
from slurm_etc.coordinator.run import run_job
from slurm_etc.plan.model import PRESETS
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.store import jobs as record
from slurm_etc.store.lease import LeaseHeld, take_lease

pytestmark = pytest.mark.unit

SLURM_ETC = os.path.join(os.path.dirname(sys.executable), "slurm-etc")
HOLD = textwrap.dedent("""
    import sys, time
    from slurm_etc.store import jobs as record
    from slurm_etc.store.lease import take_lease
    store = record.open_job_store(sys.argv[2], db=sys.argv[1], state_dir=sys.argv[3])
    lease = take_lease(store, sys.argv[2])
    print("held", flush=True)
    time.sleep(600)
""")


def _open(tmp_path, job="lease-1"):
    return record.open_job_store(job, db=str(tmp_path / "job.db"),
                                 state_dir=str(tmp_path / "state"))


def _holder(tmp_path, job="lease-1"):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "job.db"), job,
                             str(tmp_path / "state")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_until_the_first_releases(tmp_path):
    store = _open(tmp_path)
    try:
        lease = take_lease(store, "lease-1")
        with pytest.raises(LeaseHeld) as err:
            take_lease(store, "lease-1")  # even in the same process: one holder
        line = str(err.value)
        assert "\n" not in line and line.startswith("job lease-1 already has a coordinator")
        assert f"pid {os.getpid()} on " in line and line.endswith("nothing was written")
        assert err.value.exit_code == 2
        lease.release()
        take_lease(store, "lease-1").release()
        other = take_lease(store, "another-job")  # a lease per job, not per record
        other.release()
    finally:
        store.close()


def test_a_holder_killed_leaves_the_lease_free(tmp_path):
    _open(tmp_path).close()
    proc = _holder(tmp_path)
    store = _open(tmp_path)
    try:
        with pytest.raises(LeaseHeld, match=f"pid {proc.pid} on "):
            take_lease(store, "lease-1")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        take_lease(store, "lease-1").release()
    finally:
        store.close()
        if proc.poll() is None:
            proc.kill()


class NoBackend:
    """A backend the refused coordinator must never use."""

    def __getattr__(self, name):
        raise AssertionError(f"the refused coordinator used its backend ({name})")


def test_a_second_coordinator_touches_nothing(tmp_path):
    proc = _holder(tmp_path, "lease-2")
    try:
        spec = JobSpec("lease-2", "t", ("true",), TrainingJob(PRESETS["tiny"], 8, 1, False),
                       EffectivePolicy(), Hardware(gpus_per_node=2))
        with pytest.raises(LeaseHeld, match=f"pid {proc.pid} on "):
            run_job(spec, NoBackend(), ClusterTopology(2, ("n0",)),
                    db=str(tmp_path / "job.db"), state_dir=str(tmp_path / "state"),
                    secret_dir=tmp_path / "secret")
        assert not (tmp_path / "secret").exists()
        store = _open(tmp_path, "lease-2")
        try:
            assert record.job_detail(store, "lease-2") is None  # no job was written
        finally:
            store.close()
    finally:
        proc.kill()
        proc.wait(30)


def test_the_command_line_refuses_in_one_line_with_exit_2(tmp_path):
    proc = _holder(tmp_path, "lease-3")
    try:
        t0 = time.monotonic()
        run = subprocess.run([SLURM_ETC, "run", "--job-id", "lease-3", "--db",
                              str(tmp_path / "job.db"), "--state-dir", str(tmp_path / "state"),
                              "--nodes", "1", "--gpus-per-node", "1", "--", "true"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2, run.stderr
        lines = [x for x in run.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and "job lease-3 already has a coordinator (pid " in lines[0], \
            run.stderr
        assert "Traceback" not in run.stderr
        assert time.monotonic() - t0 < 60
    finally:
        proc.kill()
        proc.wait(30)
