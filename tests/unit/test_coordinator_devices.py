"""coordinator/devices.py: what a backend's events make of the devices the job holds,
called directly on Holdings (no record, no backend, no processes)."""
from __future__ import annotations

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator import devices
from slurm_etc.coordinator.reconcile import Holdings
from slurm_etc.plan import Layout, ParallelConfig

N1 = [Device("n1", 0), Device("n1", 1)]
N2 = [Device("n2", 0), Device("n2", 1)]


def holding(**kw) -> Holdings:
    """dp=2 on n1 (the anchor's allocation "a0"), n2 held by member "a1"."""
    base = dict(layout=Layout(ParallelConfig(2, 1, 1), (0, 1)), generation=1,
                vranks={0: N1[0], 1: N1[1]}, held={**{d: "a0" for d in N1},
                                                    **{d: "a1" for d in N2}},
                notices={}, lost=frozenset(), leaving=frozenset(), step=9, loss=2.0)
    base.update(kw)
    return Holdings(**base)


def test_a_grant_makes_its_devices_whole_again_under_the_new_allocation():
    before = holding(lost=frozenset({N2[0]}), notices={N2[0]: (5.0, "failure"),
                                                       N2[1]: (8.0, "preemption")})
    after = devices.grant(before, N2, "a2")
    assert all(after.held[d] == "a2" for d in N2) and after.held[N1[0]] == "a0"
    assert after.lost == frozenset() and after.notices == {}
    assert before.held[N2[0]] == "a1"  # pure: the holdings given are untouched


def test_a_notice_sets_the_deadline_and_a_loss_takes_only_its_allocations_devices():
    noticed = devices.notice(holding(), N2, 30.0)
    assert noticed.notices == {d: (30.0, "preemption") for d in N2} and not noticed.lost
    # n2:0 granted again to another allocation before the old one's loss arrived
    regranted = devices.grant(noticed, [N2[0]], "a2")
    gone = devices.loss(regranted, N2, "a1", "failure", 12.0)
    assert gone.lost == {N2[1]} and gone.notices == {N2[1]: (12.0, "failure")}
    preempted = devices.loss(holding(), N2, "a1", "preempted", 12.0)
    assert preempted.notices == {d: (12.0, "preemption") for d in N2}


def test_a_failed_worker_counts_its_device_lost_by_failure():
    got = devices.failed(holding(), [N1[1]], 7.0)
    assert got.lost == {N1[1]} and got.notices == {N1[1]: (7.0, "failure")}


def test_release_gives_back_set_aside_and_noticed_devices_outside_layout_and_anchor():
    noticed = devices.notice(holding(), [N2[1]], 30.0)
    # n2:0 set aside at a commit, n2:1 under notice: both go; the layout's n1 stays even
    # under notice or set aside, and so does the anchor
    noticed = devices.notice(noticed, [N1[0]], 30.0)
    free = devices.to_release(noticed, {N2[0], N1[1]}, anchor=set())
    assert free == {N2[0], N2[1]}
    assert devices.to_release(noticed, {N2[0]}, anchor={N2[0]}) == {N2[1]}
    # not held (released before): nothing to give back
    assert devices.to_release(devices.released(noticed, N2), N2, anchor=set()) == set()
    after = devices.released(noticed, free)
    assert set(after.held) == set(N1) and set(after.notices) == {N1[0]}
