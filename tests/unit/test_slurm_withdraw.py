"""SlurmBackend withdraws a pending member (CancelRequest: scancel), over the in-memory
FakeSlurmClient; its end comes back as RequestFailed; a granted member is never withdrawn."""
from __future__ import annotations

import pytest

from slurm_etc.coordinator.backend import CancelRequest, Grant, RequestFailed, RequestNodes
from slurm_etc.slurm.backend import SlurmBackend
from slurm_etc.slurm.fake import FakeSlurmClient

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def fake():
    f = FakeSlurmClient(grace_time=30)
    f.anchor = f.add_job("anchor", nodes=["n1"], gpus_per_node=2)
    return f


@pytest.fixture
def backend(fake, tmp_path):
    b = SlurmBackend(tmp_path, anchor_job=fake.anchor, client=fake, poll_interval_s=0,
                     notice_margin_s=5)
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
