"""Peer copies, the pure part: who keeps whose copy (never on the same node) and which step
survivors roll back to after a loss."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_etc.plan import ConfigError
from slurm_etc.plan.lost import peer_buddies, rollback_step


@given(st.lists(st.integers(0, 63), min_size=2, max_size=40, unique=True),
       st.integers(1, 8), st.randoms())
@settings(max_examples=300, deadline=None)
def test_buddy_is_never_on_the_same_node(devices, gpn, rnd):
    nodes = {d // gpn for d in devices}
    if len(nodes) < 2:
        with pytest.raises(ConfigError, match="at least two nodes"):
            peer_buddies(devices, gpn)
        return
    buddies = peer_buddies(devices, gpn)
    assert len(buddies) == len(devices)
    for r, b in enumerate(buddies):
        assert 0 <= b < len(devices) and b != r
        assert devices[b] // gpn != devices[r] // gpn
    # a function of the layout: shuffled input, same assignment per device
    shuffled = list(devices)
    rnd.shuffle(shuffled)
    again = peer_buddies(shuffled, gpn)
    by_device = {devices[r]: devices[b] for r, b in enumerate(buddies)}
    assert {shuffled[r]: shuffled[b] for r, b in enumerate(again)} == by_device


@given(st.integers(2, 8), st.integers(1, 8))
def test_full_nodes_each_keep_exactly_one_copy(nodes, gpn):
    devices = list(range(nodes * gpn))
    assert sorted(peer_buddies(devices, gpn)) == devices


def test_buddies_of_two_nodes_of_two():
    assert peer_buddies((0, 1, 2, 3), 2) == (2, 3, 0, 1)
    assert peer_buddies((0, 1, 2), 1) == (1, 2, 0)


def test_rollback_step_is_the_newest_common_step():
    own = {0: [4, 6], 1: [4, 6]}
    # rank 2 (lost) has a copy of 6 on rank 1; rank 3 (lost) only of 4 on rank 0
    copies = {0: {3: [4]}, 1: {2: [4, 6]}}
    assert rollback_step([2, 3], own, copies) == 4
    assert rollback_step([2], own, copies) == 6
    # a survivor without its own snapshot of 6
    assert rollback_step([2], {0: [4], 1: [4, 6]}, copies) == 4


def test_no_rollback_when_a_lost_rank_has_no_surviving_copy():
    own = {0: [2]}
    # rank 1's copy was on rank 2, which died too
    copies = {0: {2: [2]}}
    assert rollback_step([1, 2], own, copies) is None
    assert rollback_step([1], {}, {}) is None
    # a copy held by a lost rank does not count
    assert rollback_step([1, 2], own, {0: {2: [2]}, 2: {1: [2]}}) is None
