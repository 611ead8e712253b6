"""SlurmBackend's event logic over the in-memory FakeSlurmClient (no cluster, no srun):
grants, notices (the member's file, squeue's preempt time), losses, releases, recovery,
errors. The same scenarios run on a real cluster in tests/slurm/test_backend.py."""
from __future__ import annotations

import os
import time
from datetime import datetime, timedelta

import pytest

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator.backend import (
    BackendError,
    Grant,
    LaunchWorkers,
    Loss,
    PreemptNotice,
    ReleaseDevices,
    RequestFailed,
    RequestNodes,
    WorkerSpec,
)
from slurm_etc.slurm import NodeState
from slurm_etc.slurm.backend import SlurmBackend, member_comment, member_job_name
from slurm_etc.slurm.member import write_notice
from slurm_etc.testing.fake_slurm import FakeSlurmClient

pytestmark = pytest.mark.timeout(30)


def d(node, *locals_):
    return tuple(Device(node, i) for i in locals_)


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


def test_anchor_grant_and_member_grant(fake, backend):
    assert backend.poll() == [Grant(fake.anchor, d("n1", 0, 1), None)]
    backend.request(RequestNodes(2, "g1"))
    backend.request(RequestNodes(2, "g1"))  # the same key: nothing more
    assert [c[0] for c in fake.calls].count("sbatch") == 1
    member = backend.members["g1"]
    spec = fake.specs[member]
    assert spec.partition == "scavenge" and spec.nodes == 2 and spec.gpus_per_node == 2
    assert spec.signal == "USR2@120" and spec.signal_batch_only and spec.requeue is False
    assert spec.exclusive and spec.name == member_job_name(fake.anchor)
    assert f"--comment={member_comment('g1')}" in spec.extra
    assert backend.poll() == []  # pending
    fake.start(member, ["n2", "n3"])
    assert backend.poll() == [Grant(member, d("n2", 0, 1) + d("n3", 0, 1), "g1")]
    assert backend.held == {**{x: fake.anchor for x in d("n1", 0, 1)},
                            **{x: member for x in d("n2", 0, 1) + d("n3", 0, 1)}}


def test_notice_from_the_members_file_then_loss(fake, backend, tmp_path):
    backend.poll()
    backend.request(RequestNodes(1, "g1"))
    member = backend.members["g1"]
    # Signalled before the backend saw it running: the notice waits for the grant.
    t_sig = time.time()
    write_notice(tmp_path, member, "0", "USR2", t_sig)
    assert backend.poll() == []
    fake.start(member, ["n4"])
    grant, notice = backend.poll()
    assert isinstance(grant, Grant) and isinstance(notice, PreemptNotice)
    assert notice.allocation == member and notice.devices == d("n4", 0, 1)
    assert notice.deadline == pytest.approx(t_sig + 30 - 5, abs=2)
    fake.preempt(member)  # squeue shows the preempt time too: no second notice
    assert backend.poll() == []
    fake.end(member, "PREEMPTED")
    assert backend.poll() == [Loss(member, d("n4", 0, 1), "preempted")]
    assert backend.poll() == []
    assert all(a == fake.anchor for a in backend.held.values())


def test_notice_from_squeue_when_no_file(fake, backend):
    backend.poll()
    backend.request(RequestNodes(1, "g1"))
    member = backend.members["g1"]
    fake.start(member, ["n2"])
    backend.poll()
    picked = datetime.now() - timedelta(seconds=3)
    fake.preempt(member, picked)
    (notice,) = backend.poll()
    assert isinstance(notice, PreemptNotice)
    assert notice.deadline == pytest.approx(picked.timestamp() + 25, abs=0.01)
    fake.end(member, "COMPLETING")
    assert backend.poll() == [Loss(member, d("n2", 0, 1), "preempted")]


@pytest.mark.parametrize("state,raw", [(NodeState.DOWN, "down*"), (NodeState.DRAINING, "draining"),
                                       (NodeState.FAIL, "fail")])
def test_node_lost(fake, backend, state, raw):
    backend.poll()
    backend.request(RequestNodes(2, "g1"))
    member = backend.members["g1"]
    fake.start(member, ["n2", "n3"])
    backend.poll()
    fake.set_state("n3", state, raw, "broken")
    assert backend.poll() == [Loss(member, d("n3", 0, 1), "failure")]
    fake.end(member, "NODE_FAIL")
    assert backend.poll() == [Loss(member, d("n2", 0, 1), "failure")]


def test_member_cancelled_by_someone_is_a_failure(fake, backend):
    backend.poll()
    backend.request(RequestNodes(1, "g1"))
    member = backend.members["g1"]
    fake.start(member, ["n2"])
    backend.poll()
    fake.end(member, "CANCELLED")
    assert backend.poll() == [Loss(member, d("n2", 0, 1), "failure")]


def test_release(fake, backend):
    backend.poll()
    backend.request(RequestNodes(3, "g1"))
    member = backend.members["g1"]
    fake.start(member, ["n2", "n3", "n4"])
    backend.poll()
    # The anchor is never released; a node's single GPU frees nothing in Slurm.
    backend.release(ReleaseDevices(d("n1", 0) + d("n2", 1)))
    assert Device("n1", 0) in backend.held and Device("n2", 1) not in backend.held
    assert not [c for c in fake.calls if c[0] in ("scontrol-resize", "scancel")]
    # The middle node: Slurm would drop the last one, so it stays allocated (idle).
    backend.release(ReleaseDevices(d("n3", 0, 1)))
    assert not [c for c in fake.calls if c[0] == "scontrol-resize"]
    # The last node: now n3 and n4 are a tail; NumNodes=1 frees both, n2 remains.
    backend.release(ReleaseDevices(d("n4", 0, 1)))
    assert ("scontrol-resize", member, "1") in fake.calls
    assert fake.job(member).nodes == ("n2",)
    assert backend.poll() == []  # a shrink we asked for is no loss
    # The rest: scancel.
    backend.release(ReleaseDevices(d("n2", 0)))
    assert ("scancel", member) in fake.calls
    assert backend.poll() == []
    assert set(backend.held.values()) == {fake.anchor}
    backend.release(ReleaseDevices(d("n2", 0)))  # released twice: nothing


def test_recovery_of_members_by_comment(fake, backend, tmp_path):
    backend.poll()
    backend.request(RequestNodes(1, "gen 2=grow"))
    member = backend.members["gen 2=grow"]
    fake.start(member, ["n3"])
    fake.add_job("someone-else")
    again = SlurmBackend(tmp_path, anchor_job=fake.anchor, client=fake, poll_interval_s=0,
                         steady_poll_s=0)
    assert again.members == {"gen 2=grow": member}
    assert again.poll() == [Grant(fake.anchor, d("n1", 0, 1)),
                            Grant(member, d("n3", 0, 1), "gen 2=grow")]
    again.request(RequestNodes(1, "gen 2=grow"))
    assert [c[0] for c in fake.calls].count("sbatch") == 1


def test_slurm_errors(fake, backend, tmp_path, caplog):
    backend.poll()
    fake.fail = "slurm_load_jobs error: Unable to contact slurm controller"
    assert backend.poll() == []  # a failed query is logged and retried, not raised
    assert "query failed" in caplog.text
    with pytest.raises(BackendError, match=r"^request 'g1' \(1 node\(s\)\) failed: `sbatch .*"
                                           r"Unable to contact slurm controller$"):
        backend.request(RequestNodes(1, "g1"))
    fake.fail = None
    with pytest.raises(BackendError, match="anchor job 999 is not running"):
        SlurmBackend(tmp_path, anchor_job="999", client=fake)
    with pytest.raises(BackendError, match="does not hold n2:0"):
        backend.launch(LaunchWorkers(1, (WorkerSpec(0, Device("n2", 0)),), ("true",)))
    assert "g1" not in backend.members


def test_anchor_gpus_from_the_node_and_topology(tmp_path):
    fake = FakeSlurmClient(gpus=4)
    anchor = fake.add_job("anchor", nodes=["n2"])  # no TresPerNode: the node's GRES
    b = SlurmBackend(tmp_path, anchor_job=anchor, client=fake)
    assert b.gpus_per_node == 4 and b.poll() == [Grant(anchor, d("n2", 0, 1, 2, 3))]
    assert b.topology.nodes == ("n1", "n2", "n3", "n4") and b.topology.gpus_per_node == 4


def _running_member(fake, backend, nodes):
    backend.poll()
    backend.request(RequestNodes(len(nodes), "g1"))
    member = backend.members["g1"]
    fake.start(member, nodes)
    backend.poll()
    return member


def test_node_down_sigterm_is_no_notice(fake, backend, tmp_path):
    """Slurm SIGTERMs the batch shell of a job whose node went DOWN: the member's SIGTERM
    file comes with the loss, and must not first announce a preemption."""
    member = _running_member(fake, backend, ["n2"])
    fake.set_state("n2", NodeState.DOWN, "down*", "lost")
    write_notice(tmp_path, member, "0", "TERM", time.time())
    events = backend.poll() + backend.poll() + backend.poll()
    assert events == [Loss(member, d("n2", 0, 1), "failure")], events


def test_cancel_sigterm_is_no_notice(fake, backend, tmp_path):
    """A member cancelled by someone: SIGTERM file first, then squeue shows it CANCELLED."""
    member = _running_member(fake, backend, ["n2"])
    write_notice(tmp_path, member, "0", "TERM", time.time())
    assert backend.poll() == []  # waits for the next query
    fake.end(member, "CANCELLED")
    assert backend.poll() + backend.poll() == [Loss(member, d("n2", 0, 1), "failure")]


def test_sigterm_of_a_member_still_running_is_a_notice(fake, backend, tmp_path):
    """A site without preempt_send_user_signal (USR2 configured): SIGTERM at the start of
    the grace is the notice once a query shows the member still running whole."""
    member = _running_member(fake, backend, ["n2"])
    path = write_notice(tmp_path, member, "0", "TERM", time.time())
    t_sig = time.time() - 4
    os.utime(path, (t_sig, t_sig))
    assert backend.poll() == []
    (notice,) = backend.poll()
    assert notice == PreemptNotice(member, d("n2", 0, 1), pytest.approx(t_sig + 25, abs=0.01))
    assert backend.poll() == []


def test_sigterm_is_the_notice_where_configured(fake, tmp_path):
    b = SlurmBackend(tmp_path, anchor_job=fake.anchor, client=fake, poll_interval_s=0,
                     steady_poll_s=0, notice_margin_s=5, notice_signal="TERM")
    try:
        member = _running_member(fake, b, ["n3"])
        write_notice(tmp_path, member, "0", "TERM", time.time())
        (notice,) = b.poll()
        assert isinstance(notice, PreemptNotice) and notice.devices == d("n3", 0, 1)
    finally:
        b.close()


@pytest.mark.parametrize("how", ["CANCELLED", "FAILED", "gone"])
def test_member_ending_while_pending_fails_its_request(fake, backend, how):
    """A member that never ran (cancelled by an admin, refused, purged) ends its request, so
    that the coordinator can ask again; it is no loss (nothing was held)."""
    backend.poll()
    backend.request(RequestNodes(1, "grow-1"))
    member = backend.members["grow-1"]
    assert backend.poll() == []  # pending
    if how == "gone":
        del fake._jobs[member]
    else:
        fake.end(member, how)
    (failed,) = backend.poll()
    assert failed == RequestFailed("grow-1", member, how)
    assert backend.poll() == []
    backend.request(RequestNodes(1, "grow-2"))
    assert [c[0] for c in fake.calls].count("sbatch") == 2
    assert backend.members["grow-2"] != member
