"""Requests that can be met (decide, pure): never more nodes than the policy's max_nodes and
the partition's nodes minus what the job keeps; a granted node that fits no valid layout now
is kept while a request makes it useful, instead of released and asked for again; a request
pending past its patience is withdrawn and asked again smaller. Each says why."""
import pytest

from slurm_etc.coordinator import deciding
from slurm_etc.policy import JobView, Release, RequestGrow, decide
from slurm_etc.policy.decide import WithdrawRequest
from slurm_etc.policy.rules import EffectivePolicy
from tests.unit.grow_harness import HW, JOB, TOPO, fake_cost, growing_from_one_node, node, of, on

pytestmark = pytest.mark.unit


def test_no_request_beyond_the_partition_nodes_minus_what_is_kept():
    vranks, layout = on(node("n1", "n2"))
    snap = dict(now=10.0, job=JOB, hardware=HW, topology=TOPO, held=node("n1", "n2"),
                layout=layout, vranks=vranks, pinned=node("n1"))
    unbounded = of(decide(JobView(**snap), EffectivePolicy(max_nodes=8),
                          cost=fake_cost), RequestGrow)
    assert unbounded and unbounded[0].nodes == 2  # 2 + 2 nodes: pp=4
    full = decide(JobView(**snap, partition_nodes=2), EffectivePolicy(max_nodes=8),
                  cost=fake_cost)
    assert not of(full, RequestGrow)  # the partition has no node more: nothing pends forever
    three = decide(JobView(**snap, partition_nodes=3), EffectivePolicy(max_nodes=8),
                   cost=fake_cost)
    assert not of(three, RequestGrow)  # one node more fits no valid layout: not asked
    capped = decide(JobView(**snap, partition_nodes=4), EffectivePolicy(max_nodes=3),
                    cost=fake_cost)
    assert not of(capped, RequestGrow)


def test_a_granted_node_that_fits_no_layout_is_kept_while_a_request_makes_it_useful():
    vranks, layout = on(node("n1", "n2"))
    held = node("n1", "n2", "n3")  # a grant of n3: 6 devices fit no valid layout
    snap = JobView(10.0, JOB, HW, TOPO, held, layout, vranks, pinned=node("n1"),
                    partition_nodes=4)
    d = decide(snap, EffectivePolicy(max_nodes=4), cost=fake_cost)
    assert not of(d, Release), d.lines()  # before: n3 released ...
    (grow,) = of(d, RequestGrow)
    assert grow.nodes == 1, d.lines()  # ... and 2 more asked for: churn, never growing
    assert "with the 1 granted node(s) kept (n3) that fit no valid layout now" in grow.reason
    # while that request pends, n3 stays
    pending = JobView(20.0, JOB, HW, TOPO, held, layout, vranks, pinned=node("n1"),
                       partition_nodes=4, growing=1, request_age_s=10.0)
    d = decide(pending, EffectivePolicy(max_nodes=4), cost=fake_cost)
    assert not of(d, Release) and not of(d, RequestGrow), d.lines()
    # no request could use it (max_nodes 3): released, as before
    d = decide(snap, EffectivePolicy(max_nodes=3), cost=fake_cost)
    assert [set(r.devices) for r in of(d, Release)] == [node("n3")], d.lines()
    assert not of(d, RequestGrow)


def test_a_request_pending_past_its_patience_is_withdrawn_and_asked_again_smaller():
    vranks, layout = on(node("n1"))
    base = dict(now=500.0, job=JOB, hardware=HW, topology=TOPO, held=node("n1"),
                layout=layout, vranks=vranks, pinned=node("n1"), partition_nodes=4,
                growing=3)
    young = decide(JobView(**base, request_age_s=100.0), EffectivePolicy(max_nodes=4),
                   cost=fake_cost)
    assert not of(young, WithdrawRequest) and not of(young, RequestGrow)
    old = decide(JobView(**base, request_age_s=400.0), EffectivePolicy(max_nodes=4),
                 cost=fake_cost)
    (withdraw,) = of(old, WithdrawRequest)
    (grow,) = of(old, RequestGrow)
    assert withdraw.nodes == 3 and grow.nodes < 3, old.lines()
    assert "pending for 400 s (more than 300 s); asking for fewer" in str(withdraw)
    # a one-node request has nothing smaller: it stays
    one = decide(JobView(**{**base, "growing": 1}, request_age_s=400.0),
                 EffectivePolicy(max_nodes=4), cost=fake_cost)
    assert not of(one, WithdrawRequest)


# ---- the coordinator carries them out -------------------------------------------------

def test_coordinator_withdraws_an_old_request_and_asks_again_smaller(tmp_path,
                                                                     recording_backend):
    import time

    backend = recording_backend(TOPO)
    with growing_from_one_node(tmp_path, "withdraw", backend,
                               EffectivePolicy(grow=True, max_nodes=4), 10.0) as c:
        assert not deciding.request_overdue(c)  # young: not decided again
        c.request.sent_at = time.monotonic() - 400.0
        assert deciding.request_overdue(c)
        snap = deciding.snapshot(c)
        assert snap.partition_nodes == 4 and snap.request_age_s >= 400.0
        deciding.decide_now(c)
        assert [w.key for w in backend.withdrawn] == ["grow-1"]
        assert len(backend.requested) == 1 and backend.requested[0].key == "grow-2"
        assert backend.requested[0].nodes < 3 and c.request.growing == backend.requested[0].nodes
