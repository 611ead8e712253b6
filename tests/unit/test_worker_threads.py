"""Every worker the coordinator starts gets OMP_NUM_THREADS = its share of its node's cores
(torchrun's convention: cores // workers on the node, at least 1) unless the user set it;
without it CPU workers oversubscribe the cores (a 36-step CPU job: 4 min 15 s instead of
24 s). The local backend is checked with a real process; the Slurm backend by what it hands
to srun (the step's payload)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator.backend import LaunchWorkers, WorkerSpec
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.script import script_from_options
from slurm_etc.protocol import env as envvars
from slurm_etc.slurm import backend as slurm_backend
from slurm_etc.slurm.backend import SlurmBackend
from slurm_etc.slurm.task import decode_payload
from slurm_etc.testing.fake_slurm import FakeSlurmClient

PRINT_THREADS = ("import os, sys; open(sys.argv[1], 'w').write("
                 "os.environ.get('OMP_NUM_THREADS', 'unset'))")


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def test_thread_share_is_cores_over_workers_at_least_one():
    assert envvars.thread_share({}, 16, 4) == {"OMP_NUM_THREADS": "4"}
    assert envvars.thread_share({}, 2, 8) == {"OMP_NUM_THREADS": "1"}
    assert envvars.thread_share({"OMP_NUM_THREADS": "3"}, 16, 4) == {}


def _launch_local(tmp_path: Path, monkeypatch, user: str | None) -> str:
    if user is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user)
    out = tmp_path / "threads.txt"
    backend = LocalBackend(script_from_options(2, 2, initial_nodes=2))
    try:
        backend.poll()
        backend.launch(LaunchWorkers(0, (WorkerSpec(0, Device("n0", 0)),),
                                     (sys.executable, "-c", PRINT_THREADS, str(out)), {}))
        until = time.monotonic() + 30
        while not backend.poll() and time.monotonic() < until:
            time.sleep(0.05)
    finally:
        backend.close()
    return out.read_text()


def test_local_worker_sees_its_share_of_the_cores(tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO", "slurm_etc")
    # 2 simulated nodes x 2 devices, all on this machine: 4 workers share its cores
    assert _launch_local(tmp_path, monkeypatch, None) == str(max(1, _cores() // 4))
    assert sum("workers get OMP_NUM_THREADS" in r.getMessage() for r in caplog.records) == 1


def test_local_worker_keeps_the_users_value(tmp_path, monkeypatch):
    assert _launch_local(tmp_path, monkeypatch, "3") == "3"


@pytest.fixture
def fake():
    f = FakeSlurmClient(grace_time=30)
    f.anchor = f.add_job("anchor", nodes=["n1"], gpus_per_node=2)
    return f


def _srun_payload(fake, tmp_path, monkeypatch, environ: dict[str, str]) -> dict:
    """The payload of the srun step the Slurm backend starts for two workers on n1."""
    started: list[list[str]] = []

    class Srun:  # stands in for srun: records its argv, ends at once
        def __init__(self, argv, **_kw):
            started.append(list(argv))
            self.stdin = open(os.devnull, "wb")
            self.stdout = subprocess.Popen(["true"], stdout=subprocess.PIPE).stdout
            self.pid = 0
            self.returncode = 0

        def poll(self):
            return 0

        def wait(self, *_a, **_k):
            return 0

        def kill(self):
            pass

        def send_signal(self, _sig):
            pass

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    b = SlurmBackend(tmp_path, anchor_job=fake.anchor, client=fake, poll_interval_s=0,
                     steady_poll_s=0, notice_margin_s=5)
    try:
        b.poll()
        monkeypatch.setattr(slurm_backend.subprocess, "Popen", Srun)
        try:
            b.launch(LaunchWorkers(0, (WorkerSpec(0, Device("n1", 0)),
                                       WorkerSpec(1, Device("n1", 1))), ("train",), {}))
        except Exception:  # noqa: BLE001 - only the argv matters here
            pass
    finally:
        monkeypatch.undo()
        b.close()
    (argv,) = [a for a in started if "slurm_etc.slurm.task" in a]
    return decode_payload(argv[-1])


def test_srun_payload_gives_each_task_its_share(fake, tmp_path, monkeypatch):
    # 16 CPUs on the node (Slurm's count), 2 workers (one per GPU): 8 threads each
    payload = _srun_payload(fake, tmp_path, monkeypatch, {"SLURM_CPUS_ON_NODE": "16"})
    assert [t["env"].get("OMP_NUM_THREADS") for t in payload["tasks"]] == ["8", "8"]


def test_srun_payload_keeps_the_users_value(fake, tmp_path, monkeypatch):
    payload = _srun_payload(fake, tmp_path, monkeypatch,
                            {"SLURM_CPUS_ON_NODE": "16", "OMP_NUM_THREADS": "5"})
    # not set per task: srun passes the coordinator's environment (with the user's 5) on
    assert [t["env"].get("OMP_NUM_THREADS") for t in payload["tasks"]] == [None, None]
