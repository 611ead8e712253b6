"""Table tests of the loop's own decisions (coordinator/verdicts.py): no sockets, no record,
no backend; each row an input and what the verdict must be."""
from __future__ import annotations

import pytest

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator import verdicts as v
from slurm_etc.coordinator.backend import WorkerState
from slurm_etc.plan import Layout, ParallelConfig
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.protocol.messages import ENCODER, LayoutSpec, Resize, Stop
from slurm_etc.protocol.rendezvous import GenerationKeys

D0, D1, D2, D3 = (Device(f"n{i // 2}", i % 2) for i in range(4))
LAYOUT = Layout(ParallelConfig(dp=2), (0, 1))


def _w(vrank: int, code: int | None = None) -> WorkerState:
    return WorkerState(vrank, 1, D0, 100 + vrank, returncode=code)


@pytest.mark.parametrize(("layout", "done", "want"), [
    (None, set(), False),
    (LAYOUT, set(), False),
    (LAYOUT, {0}, False),
    (LAYOUT, {0, 1}, True),
    (LAYOUT, {0, 2}, False),  # as many done, not the layout's
    (LAYOUT, {0, 1, 5}, True),
])
def test_finished(layout, done, want):
    assert v.finished(layout, done) is want


@pytest.mark.parametrize(("gen", "last", "want"), [(3, 3, 4), (3, 7, 8), (9, 2, 10)])
def test_stop_generation_is_past_every_order(gen, last, want):
    assert v.stop_generation(gen, last) == want


@pytest.mark.parametrize(("workers", "found_dead", "want"), [
    ({0: _w(0), 1: _w(1)}, (), True),
    ({0: _w(0, 1), 1: _w(1, 0)}, (), False),
    ({0: _w(0, 1)}, (), True),  # vrank 1 never reported: it may be starting
    ({0: _w(0, 1)}, (1,), False),  # ... unless a restart found it dead
    ({0: _w(0, -9), 1: _w(1)}, (), True),
])
def test_anyone_left(workers, found_dead, want):
    assert v.anyone_left(LAYOUT, workers, found_dead) is want


def _none_left(**kw):
    args = dict(generation=4, step=30, members=2, reattached=False, came_back=False,
                newest=None, exits=[_w(0, 1), _w(1, 0)], said=None)
    return v.none_left(**{**args, **kw})


def test_none_left_table():
    got = _none_left(reattached=True)
    assert isinstance(got, v.StartAgain) and "none of the 2 worker(s) of generation 4" in got.why
    got = _none_left(reattached=True, came_back=True, newest=20)
    assert isinstance(got, v.StartAgain) and "checkpoint of step 20" in got.why
    got = _none_left(newest=None)
    assert isinstance(got, v.Stop)
    assert "(vrank 0: 1, vrank 1: 0) at step 30 and nothing is pending" in got.line
    got = _none_left(said="rebuilt state failed its check")
    assert isinstance(got, v.Stop) and got.line.endswith(": rebuilt state failed its check")


@pytest.mark.parametrize(("policy", "cluster", "nodes", "want"), [
    (EffectivePolicy(), 4, 3, None),
    (EffectivePolicy(), 4, 4, "exceed the cluster's 4 nodes"),
    (EffectivePolicy(grow=False), 4, 1, "does not allow growing"),
    (EffectivePolicy(max_nodes=3), 8, 3, "exceed the policy's max_nodes 3"),
    (EffectivePolicy(min_nodes=2, max_nodes=4), 8, 2, None),
])
def test_refuse_restored(policy, cluster, nodes, want):
    got = v.refuse_restored(policy, cluster, nodes)
    assert got is None if want is None else want in got


@pytest.mark.parametrize(("kw", "want"), [
    (dict(usable_nodes=None, age_s=10, since_last_look_s=1e9), None),
    (dict(usable_nodes=5, age_s=10, since_last_look_s=1e9), v.UNFIT),  # 3 > 5 - 3
    (dict(usable_nodes=6, age_s=10, since_last_look_s=1e9), None),
    (dict(usable_nodes=None, age_s=300, since_last_look_s=1e9), v.PAST_PATIENCE),
    (dict(usable_nodes=None, age_s=300, since_last_look_s=30), None),  # looked just now
    (dict(usable_nodes=5, age_s=300, since_last_look_s=30), v.UNFIT),
])
def test_request_overdue(kw, want):
    assert v.request_overdue(nodes=3, keeps=3, patience_s=300, **kw) == want


def test_anchor_again_table():
    pinned = [D0, D1, D2]
    assert v.anchor_again(pinned, {D1, D2}, {D2}, {}) == [D1]  # D2 is its dead vrank's
    assert v.anchor_again(pinned, {D1}, set(), {D1: v.MAX_REUSES}) == []
    assert v.anchor_again(pinned, {D1, D3}, set(), {D1: v.MAX_REUSES - 1}) == [D1]
    assert v.anchor_again(pinned, set(), set(), {}) == []


@pytest.mark.parametrize(("first", "in_layout", "in_resize", "fatal", "dead"), [
    (True, True, False, True, False),  # the first layout: the job stops
    (True, False, True, False, True),  # a joiner while the first layout trains
    (False, True, False, False, True),
    (False, False, True, False, True),
    (False, False, False, False, False),  # nothing waits for it
])
def test_never_joined(first, in_layout, in_resize, fatal, dead):
    got = v.never_joined(3, "exited with 0", True, first_layout=first,
                         in_layout=in_layout, in_resize=in_resize)
    assert (got.fatal, got.dead) == (fatal, dead)
    assert got.why.startswith("vrank 3 exited with 0 before joining the job: TRAIN_CMD")
    unclean = v.never_joined(3, "exited with 1", False, first_layout=first,
                             in_layout=in_layout, in_resize=in_resize)
    assert "its log says why" in unclean.why


@pytest.mark.parametrize(("step", "trained", "want"), [
    (-1, 0, True),  # just started
    (12, 5, True),
    (12, 4, False),  # trains in a generation before this coordinator's
    (12, 6, False),  # its resize was closed aborted at the restart
    (-1, 6, True),
])
def test_admits(step, trained, want):
    assert v.admits(step=step, trained=trained, gave_up={6}, admit_from=5) is want


OLD = GenerationKeys("j", 2)  # the old layout's generation; the order opens 3


def _order(generation: int) -> bytes:
    return ENCODER.encode(Resize("j", generation, LayoutSpec.make("dp=2,tp=1,pp=1", (0, 1)),
                                 LayoutSpec.make("dp=3,tp=1,pp=1", (0, 1, 2))))


@pytest.mark.parametrize("key, value, expected", [
    (OLD.agreement(0, 7, "decided"), _order(3), True),
    (OLD.agreement(1, 7, "decided"), _order(3), True),  # the attempt after an abort
    (OLD.agreement(0, 7, "decided"), b"-", False),  # no order at that step
    (OLD.agreement(0, 7, "decided"), _order(4), False),  # another order
    (OLD.agreement(0, 7, "decided"), ENCODER.encode(Stop("j", 9)), False),
    (OLD.agreement(0, 7, 1), _order(3), False),  # a rank's own key, not the decision
    (GenerationKeys("j", 1).agreement(0, 7, "decided"), _order(3), False),  # not the old one's
    (GenerationKeys("j", 21).agreement(0, 7, "decided"), _order(3), False),
    (OLD.agreement(0, 7, "decided"), b"\x93garbage", False),
])
def test_a_step_decision_holding_the_order_is_told_apart(key: str, value: bytes,
                                                         expected: bool) -> None:
    assert v.step_decided_the_order(key, value, OLD.prefix, 3) is expected
