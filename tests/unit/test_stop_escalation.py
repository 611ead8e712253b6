"""The stop -> grace -> kill (-> backstop) deadlines both backends share."""
from __future__ import annotations

import pytest

from slurm_etc.coordinator.supervisor import StopEscalation

pytestmark = pytest.mark.unit


def test_a_stop_is_killed_when_its_grace_runs_out():
    e = StopEscalation()
    assert e.stop(now=10.0, grace_s=5.0)
    assert e.due(14.9) is None
    assert e.due(15.0) == "kill"
    e.killed(15.0)
    assert e.due(1e9) is None  # no backstop given: nothing more is owed


def test_a_later_longer_stop_never_postpones_the_kill():
    e = StopEscalation()
    assert e.stop(10.0, 5.0)
    assert not e.stop(12.0, 30.0)  # not sent again: the earlier deadline stands
    assert e.due(15.0) == "kill"


def test_a_shorter_stop_brings_the_kill_forward():
    e = StopEscalation()
    assert e.stop(10.0, 30.0)
    assert e.stop(11.0, 1.0)
    assert e.due(12.0) == "kill"


def test_an_ignored_kill_reaches_the_backstop_once():
    e = StopEscalation()
    e.killed(100.0, backstop_s=20.0)
    assert e.due(119.0) is None
    assert e.due(120.0) == "backstop"
    assert e.due(121.0) is None


def test_a_stop_after_a_kill_starts_a_new_grace():
    e = StopEscalation()
    e.killed(0.0)
    assert e.stop(1.0, 2.0)
    assert e.due(3.0) == "kill"
