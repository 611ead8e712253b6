"""SlurmBackend withdraws a pending member (CancelRequest: scancel), over the in-memory
FakeSlurmClient; its end comes back as RequestFailed; a granted member is never withdrawn."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator.backend import (
    BackendError,
    CancelRequest,
    Grant,
    LaunchWorkers,
    RequestFailed,
    RequestNodes,
    WorkerSpec,
    WorkerState,
)
from slurm_etc.slurm import backend as slurm_backend
from slurm_etc.slurm.backend import SlurmBackend
from slurm_etc.testing.fake_slurm import FakeSlurmClient

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def fake():
    f = FakeSlurmClient(grace_time=30)
    f.anchor = f.add_job("anchor", nodes=["n1"], gpus_per_node=2)
    return f


@pytest.fixture
def backend(fake, tmp_path):
    b = SlurmBackend(tmp_path, anchor_job=fake.anchor, client=fake, poll_interval_s=0,
                     steady_poll_s=0, notice_margin_s=5)
    yield b
    b.close()


def test_pending_member_is_cancelled_and_its_request_fails(fake, backend):
    backend.poll()
    backend.request(RequestNodes(3, "grow-1"))
    member = backend.members["grow-1"]
    assert backend.poll() == []  # pending
    backend.cancel_request(CancelRequest("grow-1", "pending for 400 s"))
    assert ("scancel", member) in [tuple(c[:2]) for c in fake.calls], fake.calls
    (failed,) = backend.poll()
    assert isinstance(failed, RequestFailed) and failed.request == "grow-1"


def test_granted_member_is_not_withdrawn(fake, backend):
    backend.poll()
    backend.request(RequestNodes(1, "grow-1"))
    member = backend.members["grow-1"]
    fake.start(member, ["n2"])
    assert isinstance(backend.poll()[0], Grant)
    before = len(fake.calls)
    backend.cancel_request(CancelRequest("grow-1"))
    backend.cancel_request(CancelRequest("grow-9"))  # unknown: nothing
    assert not any(c[0] == "scancel" for c in fake.calls[before:]), fake.calls[before:]


def test_retry_waits_for_a_stopping_worker_on_a_device_it_reuses(fake, backend, monkeypatch):
    """The launch collision of a retry after an abort: the aborted joiner (vrank 4 on n1:0)
    is being stopped when the retry launches vrank 2 on n1:0. The launch waits (bounded) for
    it to end, instead of failing with "vrank 4 runs there"."""
    backend.poll()
    started: list = []
    monkeypatch.setattr(backend, "_start_step",
                        lambda action, job_id, node, tasks: started.append(
                            (node, [t.vrank for t in tasks])))
    step = SimpleNamespace(done=False, allocation=fake.anchor, node="n1", step_id="0")
    joiner = backend._workers.add(WorkerState(4, 1, Device("n1", 0), 1, stopping=True),
                                  slurm_backend._Task(step))  # type: ignore[arg-type]
    threading.Timer(0.5, lambda: setattr(joiner, "reported", True)).start()
    backend.launch(LaunchWorkers(2, (WorkerSpec(2, Device("n1", 0)),), ("true",)))
    assert started == [("n1", [2])]
    # one that does not end within the bound: the same one line as before, after the wait
    monkeypatch.setattr(slurm_backend, "STOPPING_WAIT_S", 0.3)
    stuck = backend._workers.add(WorkerState(5, 1, Device("n1", 1), 1, stopping=True),
                                 slurm_backend._Task(step))  # type: ignore[arg-type]
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="launch of vrank 3 on n1:1: vrank 5 runs there"):
        backend.launch(LaunchWorkers(2, (WorkerSpec(3, Device("n1", 1)),), ("true",)))
    assert time.monotonic() - t0 >= 0.3
    stuck.reported = True
