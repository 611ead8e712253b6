"""The partition's usable nodes are re-read, not only counted once at start: nodes that go
DOWN or DRAIN later can no longer come, so no request asks for them and a pending request
that they made unmeetable is withdrawn at once. The Slurm backend counts them through its
client (here the in-memory FakeSlurmClient); the coordinator re-reads the count after a loss
and otherwise at most every PARTITION_REREAD_S, and feeds it to the pure decision."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator import deciding, observe
from slurm_etc.coordinator import deciding as coordinator_deciding
from slurm_etc.coordinator import loop as coordinator_loop
from slurm_etc.coordinator.backend import Loss
from slurm_etc.policy import JobView, RequestGrow, decide
from slurm_etc.policy.decide import WithdrawRequest
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.slurm.backend import SlurmBackend
from slurm_etc.slurm.model import NodeState
from slurm_etc.testing.fake_slurm import FakeSlurmClient
from tests.unit.coordinator_harness import RecordingBackend
from tests.unit.grow_harness import HW, JOB, TOPO, fake_cost, growing_from_one_node, node, of, on

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


# ---- the Slurm backend counts them ----------------------------------------------------

def test_slurm_backend_counts_the_nodes_a_request_can_still_get(tmp_path: Path) -> None:
    fake = FakeSlurmClient(nodes=("n1", "n2", "n3", "n4", "n5"))
    fake.anchor = fake.add_job("anchor", nodes=["n1"], gpus_per_node=2)
    backend = SlurmBackend(tmp_path, anchor_job=fake.anchor, client=fake, poll_interval_s=0,
                           steady_poll_s=0, notice_margin_s=5)
    try:
        backend.poll()
        assert len(backend.topology.nodes) == 5 and backend.usable_nodes() == 5
        fake.set_state("n3", NodeState.DOWN, "down", "Not responding")
        fake.set_state("n4", NodeState.DRAINED, "drained", "maintenance")
        assert backend.usable_nodes() == 3  # n1 (held), n2, n5
        # a node the job holds counts whatever its state: it is not asked for again
        fake.set_state("n1", NodeState.DRAINING, "draining", "maintenance")
        assert backend.usable_nodes() == 3
        fake.fail = "slurm_load_node error: Socket timed out"
        assert backend.usable_nodes() is None  # not known now: the last count stays
    finally:
        fake.fail = None
        backend.close()


# ---- the decision (pure): fed the count -----------------------------------------------

def _pending(partition_nodes: int, growing: int, age_s: float = 10.0) -> JobView:
    vranks, layout = on(node("n1"))
    return JobView(now=500.0, job=JOB, hardware=HW, topology=TOPO, held=node("n1"),
                    layout=layout, vranks=vranks, pinned=node("n1"),
                    partition_nodes=partition_nodes, growing=growing, request_age_s=age_s)


def test_a_young_request_that_can_no_longer_be_met_is_withdrawn_at_once() -> None:
    met = decide(_pending(4, 3), EffectivePolicy(max_nodes=4), cost=fake_cost)
    assert not of(met, WithdrawRequest), met.lines()  # 3 more of 4: can come
    # two nodes went DOWN: the partition has 2 usable nodes, the job holds 1
    gone = decide(_pending(2, 3), EffectivePolicy(max_nodes=4), cost=fake_cost)
    (withdraw,) = of(gone, WithdrawRequest)
    assert withdraw.nodes == 3
    assert ("the partition has 1 usable node(s) beyond the 1 this job keeps" in
            str(withdraw)), gone.lines()
    asked = of(gone, RequestGrow)
    assert all(g.nodes <= 1 for g in asked), gone.lines()
    # none left at all: withdrawn, nothing asked (it would pend forever)
    none = decide(_pending(1, 1), EffectivePolicy(max_nodes=4), cost=fake_cost)
    assert of(none, WithdrawRequest) and not of(none, RequestGrow), none.lines()


# ---- the coordinator re-reads the count -----------------------------------------------

class CountingBackend(RecordingBackend):
    """The recording backend, with the partition's usable node count a test sets."""

    def __init__(self) -> None:
        super().__init__(TOPO)
        self.usable: int | None = 4
        self.reads = 0

    def usable_nodes(self) -> int | None:
        self.reads += 1
        return self.usable


def test_coordinator_rereads_the_count_after_a_loss_and_at_a_bounded_rate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.coordinator_harness import coordinator_over

    backend = CountingBackend()
    vranks, layout = on(node("n1", "n2"))
    with coordinator_over(tmp_path, "usable", backend, training=JOB,
                          policy=EffectivePolicy(grow=True, max_nodes=4),
                          hardware=HW, backend_name="local") as (c, _db):
        c.holdings = replace(c.holdings, held={**{d: "a0" for d in node("n1")},
                                               **{d: "a1" for d in node("n2")}},
                             layout=layout, vranks=dict(vranks), step=5)
        c.launches.pinned = set(node("n1"))
        assert deciding.snapshot(c).partition_nodes == 4 and backend.reads == 1
        backend.usable = 3  # n4 DOWN: no event, this job did not hold it
        assert deciding.snapshot(c).partition_nodes == 4 and backend.reads == 1  # not yet re-read
        # a loss: re-read at the decision that handles it
        backend.usable = 2
        backend.pending = [Loss("a1", tuple(node("n2")), "failure")]
        observe.observe_backend(c)
        assert deciding.snapshot(c).partition_nodes == 2 and backend.reads == 2
        assert deciding.snapshot(c).partition_nodes == 2 and backend.reads == 2
        # no loss: again once PARTITION_REREAD_S passed
        backend.usable = 3
        real = time.monotonic
        monkeypatch.setattr(coordinator_loop.time, "monotonic",
                            lambda: real() + coordinator_deciding.PARTITION_REREAD_S + 1)
        assert deciding.snapshot(c).partition_nodes == 3 and backend.reads == 3
        backend.usable = None  # Slurm did not answer: the last count stays
        monkeypatch.setattr(coordinator_loop.time, "monotonic",
                            lambda: real() + 2 * coordinator_deciding.PARTITION_REREAD_S + 2)
        assert deciding.snapshot(c).partition_nodes == 3 and backend.reads == 4


def test_coordinator_without_a_count_uses_the_topology(tmp_path: Path,
                                                       recording_backend: Any) -> None:
    from tests.unit.coordinator_harness import coordinator_over

    # usable_nodes unknown (None): a scripted cluster's nodes all stay
    backend = recording_backend(TOPO)
    with coordinator_over(tmp_path, "topo", backend, training=JOB,
                          policy=EffectivePolicy(grow=True, max_nodes=4),
                          hardware=HW, backend_name="local") as (c, _db):
        c.holdings = replace(c.holdings, held={d: "a0" for d in node("n1")})
        assert deciding.snapshot(c).partition_nodes == len(TOPO.nodes) == 4
        assert Device("n1", 0) in c.held


def test_a_node_down_beyond_the_job_withdraws_its_pending_request_within_a_reread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No event comes when a node this job does not hold goes DOWN: the periodic re-read
    finds the pending request unmeetable and decides again (withdrawn, asked within the
    usable nodes), instead of waiting out the patience."""
    backend = CountingBackend()
    with growing_from_one_node(tmp_path, "downbeyond", backend,
                               EffectivePolicy(grow=True, max_nodes=4), 5.0) as c:
        assert not deciding.request_overdue(c) and backend.reads == 1  # 3 more of 4: can come
        assert not deciding.request_overdue(c) and backend.reads == 1  # not read again at once
        backend.usable = 2  # n3, n4 DOWN
        real = time.monotonic
        monkeypatch.setattr(coordinator_loop.time, "monotonic",
                            lambda: real() + coordinator_deciding.PARTITION_REREAD_S + 1)
        assert deciding.request_overdue(c) and backend.reads == 2
        deciding.decide_now(c)
        assert [w.key for w in backend.withdrawn] == ["grow-1"]
        assert all(r.nodes <= 1 for r in backend.requested), backend.requested
        assert not deciding.request_overdue(c)  # decided: not again and again


def test_a_backend_that_cannot_count_never_makes_a_request_unmeetable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recording_backend: Any) -> None:
    """The default ``usable_nodes`` (None: a scripted cluster) is asked when due, and no
    answer is no fresh count: a request larger than the last count allows is left to its
    patience, as a backend with no count at all always left it."""
    backend = recording_backend(TOPO)
    with growing_from_one_node(tmp_path, "nocount", backend,
                               EffectivePolicy(grow=True, max_nodes=4), 5.0) as c:
        c.request.partition_nodes = 2  # 3 more nodes of 2, kept n1: more than the count allows
        real = time.monotonic
        monkeypatch.setattr(coordinator_loop.time, "monotonic",
                            lambda: real() + coordinator_deciding.PARTITION_REREAD_S + 1)
        assert not deciding.request_overdue(c) and c.request.partition_nodes == 2
        assert backend.withdrawn == []


def test_nodes_being_released_do_not_make_a_pending_request_unmeetable() -> None:
    """A node the job releases (it fits no layout) is held until the release is carried out;
    a request sized on what the job keeps must not look unmeetable meanwhile (withdrawn and
    asked again: churn)."""
    vranks, layout = on(node("n1", "n2"))
    snap = JobView(now=500.0, job=JOB, hardware=HW, topology=TOPO,
                    held=node("n1", "n2", "n3"), layout=layout, vranks=vranks,
                    pinned=node("n1"), partition_nodes=4, growing=2, request_age_s=10.0)
    d = decide(snap, EffectivePolicy(max_nodes=3), cost=fake_cost)
    assert not of(d, WithdrawRequest), d.lines()
