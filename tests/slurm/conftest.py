"""The real-Slurm tier: a local cluster from scripts/slurm-local.sh.

The session fixture uses a cluster that is already up (whatever its settings), or brings
one up — installing the Debian packages on a fresh machine, which needs root — with a short
GraceTime so the preemption test stays quick, and takes it down at the end of the session.
One test session at a time uses the cluster (a lock file beside the cluster directory):
several people run `make test` on one machine, and these tests set nodes DOWN and preempt.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_etc.slurm import BatchSpec, CliSlurmClient, SlurmRunner

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm-local.sh"
# GraceTime of `scavenge` when this session starts the cluster. Slurm checks grace expiry on
# a ~30 s timer, so a member is requeued 10-40 s after it is picked; the signal arrives at once.
TEST_GRACE_S = 10


@dataclass
class Cluster:
    conf: str
    started_here: bool
    client: CliSlurmClient
    up_seconds: float | None


def _cluster_dir() -> Path:
    return Path(os.environ.get("SLURM_ETC_CLUSTER_DIR", "/tmp/slurm-etc-cluster"))


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def cluster():
    lock_path = Path(str(_cluster_dir()) + ".tests.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(lock_path, "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    started, up_seconds = False, None
    try:
        if _run("status", timeout=60).returncode != 0:
            t0 = time.monotonic()
            res = _run("up", "--grace-time", str(TEST_GRACE_S))
            up_seconds = time.monotonic() - t0
            if res.returncode != 0:
                pytest.fail("could not start the local Slurm cluster with "
                            f"`{SCRIPT} up` (exit {res.returncode}): "
                            f"{res.stderr.strip()[-1500:]}", pytrace=False)
            started = True
        env = _run("env", timeout=60).stdout.strip()
        conf = env.split("SLURM_CONF=", 1)[1].strip()
        saved = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = conf
        try:
            yield Cluster(conf, started, CliSlurmClient(SlurmRunner(timeout=30)), up_seconds)
        finally:
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved
    finally:
        try:
            if started:
                res = _run("down", timeout=180)
                if res.returncode != 0:
                    print(f"slurm-local.sh down failed: {res.stderr}")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()


@pytest.fixture
def client(cluster):
    return cluster.client


@pytest.fixture
def jobs(client):
    """Job ids a test submits: cancelled when it ends, whatever happened."""
    submitted: list[str] = []
    yield submitted
    for job_id in submitted:
        subprocess.run(["scancel", job_id], capture_output=True)


@pytest.fixture
def anchor(client, jobs, tmp_path) -> str:
    """A running 1-node anchor job on n1 (main), as the elastic job's batch script has."""
    from .test_client import running, wait_for, wait_free

    wait_free(client, ["n1"])
    job = client.submit(BatchSpec(script="#!/bin/sh\nsleep 600\n", name="anchor",
                                partition="main", nodes=1, gpus_per_node=2, exclusive=True,
                                nodelist=("n1",), output=str(tmp_path / "anchor-%j.out")))
    jobs.append(job)
    wait_for(running(client, job), "anchor RUNNING")
    return job
