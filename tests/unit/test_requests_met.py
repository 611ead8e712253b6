"""Requests that can be met (decide, pure): never more nodes than the policy's max_nodes and
the partition's nodes minus what the job keeps; a granted node that fits no valid layout now
is kept while a request makes it useful, instead of released and asked for again; a request
pending past its patience is withdrawn and asked again smaller. Each says why."""
from contextlib import contextmanager
from dataclasses import replace

import pytest

from slurm_etc.alloc import ClusterTopology, Device, Hardware, TrainingJob, identity_layout
from slurm_etc.plan import PRESETS
from slurm_etc.policy import JobView, Release, RequestGrow, ResizeDecision, decide
from slurm_etc.policy.decide import WithdrawRequest
from slurm_etc.policy.rules import EffectivePolicy

pytestmark = pytest.mark.unit

# the cluster: 4 nodes of 2 devices; a 4-layer GPT, global batch 16: 6 devices (3
# nodes) fit no valid layout (dp | 16, pp | 4, tp in a node), 2, 4 and 8 do, each faster
TOPO = ClusterTopology(2, ("n1", "n2", "n3", "n4"))
JOB = TrainingJob(replace(PRESETS["gpt-1.3b"], num_layers=4, name="four-layers"),
                  global_batch=16)
HW = Hardware(gpus_per_node=2)


def node(*names):
    return frozenset(Device(n, i) for n in names for i in range(2))


def fake_cost(layout, config, allocation):
    return len(set(allocation.vranks) ^ set(layout.devices))


ANCHOR = node("n1")


def on(held, pinned=ANCHOR):
    d = decide(JobView(0.0, JOB, HW, TOPO, held, pinned=pinned), EffectivePolicy(grow=False),
               cost=fake_cost)
    resize = next(a for a in d.actions if isinstance(a, ResizeDecision))
    return resize.allocation.vranks, identity_layout(resize.config, resize.allocation.pool)


def of(decision, kind):
    return [a for a in decision.actions if isinstance(a, kind)]


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

class Requests:
    """A hand-driven backend that records requests and withdrawals."""

    def __init__(self) -> None:
        from tests.unit.coordinator_harness import HandDrivenBackend

        self.inner = HandDrivenBackend(TOPO)
        self.topology = TOPO
        self.requested: list = []
        self.withdrawn: list = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def request(self, action) -> None:
        self.requested.append(action)

    def cancel_request(self, action) -> None:
        self.withdrawn.append(action)


@contextmanager
def growing_from_one_node(tmp_path, job: str, backend, policy: EffectivePolicy,
                          sent_ago_s: float):
    """A coordinator over ``backend`` training on n1's devices, with a request for three
    more nodes pending for ``sent_ago_s`` seconds; yields it."""
    import time

    from tests.unit.coordinator_harness import coordinator_over

    vranks, layout = on(node("n1"))
    with coordinator_over(tmp_path, job, backend, training=JOB, policy=policy,
                          hardware=HW, backend_name="local") as (c, _db):
        c.holdings = replace(c.holdings, held={d: "a0" for d in node("n1")},
                             layout=layout, vranks=dict(vranks), step=5)
        c.pinned = set(node("n1"))
        c.requests, c.growing = 1, 3
        c.request_sent_at = time.monotonic() - sent_ago_s
        yield c


def test_coordinator_withdraws_an_old_request_and_asks_again_smaller(tmp_path):
    import time

    backend = Requests()
    with growing_from_one_node(tmp_path, "withdraw", backend,
                               EffectivePolicy(grow=True, max_nodes=4), 10.0) as c:
        assert not c._request_overdue()  # young: not decided again
        c.request_sent_at = time.monotonic() - 400.0
        assert c._request_overdue()
        snap = c._snapshot()
        assert snap.partition_nodes == 4 and snap.request_age_s >= 400.0
        c._decide()
        assert [w.key for w in backend.withdrawn] == ["grow-1"]
        assert len(backend.requested) == 1 and backend.requested[0].key == "grow-2"
        assert backend.requested[0].nodes < 3 and c.growing == backend.requested[0].nodes
