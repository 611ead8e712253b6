"""The one supervisor both backends share (slurm_etc/coordinator/supervisor.py), over a
mechanism that only records what it was asked: stop -> grace -> kill -> backstop -> report,
a kill at once, reports held back, and the blocking close. The real mechanisms are
exercised by tests/unit/test_local_backend.py (processes) and tests/slurm/test_backend.py
(srun steps)."""
from __future__ import annotations

import pytest

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator.backend import WorkerExited, WorkerState
from slurm_etc.coordinator.supervisor import Supervised, WorkerSupervisor

pytestmark = pytest.mark.unit


class Recorder:
    """A mechanism: workers end when the test says (``ends``), or when killed if
    ``dies_on_kill``; every hook call is recorded."""

    def __init__(self, dies_on_kill: bool = True) -> None:
        self.ends: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.dies_on_kill = dies_on_kill

    def do_exit_status(self, w: Supervised[str]) -> int | None:
        return self.ends.get(w.vrank)

    def do_stop(self, w: Supervised[str]) -> None:
        self.calls.append(("stop", w.vrank))

    def do_kill(self, w: Supervised[str]) -> None:
        self.calls.append(("kill", w.vrank))
        if self.dies_on_kill:
            self.ends[w.vrank] = -9

    def do_backstop(self, w: Supervised[str]) -> None:
        self.calls.append(("backstop", w.vrank))

    def do_ended(self, w: Supervised[str]) -> None:
        self.calls.append(("ended", w.vrank))

    def do_describe(self, w: Supervised[str]) -> str:
        return w.handle


def supervised(mech: Recorder, *vranks: int, backstop_s: float | None = None
               ) -> WorkerSupervisor[str]:
    sup: WorkerSupervisor[str] = WorkerSupervisor(mech, name="[test]", backstop_s=backstop_s)
    for v in vranks:
        sup.add(WorkerState(v, 1, Device("n0", v), 100 + v), f"pid {100 + v}")
    return sup


def test_stop_then_kill_when_the_grace_runs_out_then_report_once() -> None:
    mech = Recorder()
    sup = supervised(mech, 0, 1)
    sup.stop((0, 1, 7), now=10.0, grace_s=5.0, reason="shrink")  # 7: unknown, ignored
    assert mech.calls == [("stop", 0), ("stop", 1)]
    assert all(s.stopping for s in sup.states().values())
    mech.ends[0] = 0  # vrank 0 stops in time
    assert sup.sweep(12.0) == [WorkerExited(0, 1, Device("n0", 0), 0, True)]
    sup.stop((1,), now=12.0, grace_s=60.0)  # a longer grace never postpones the kill
    assert sup.sweep(14.9) == []
    assert sup.sweep(15.0) == []  # the kill is sent here ...
    assert sup.sweep(15.1) == [WorkerExited(1, 1, Device("n0", 1), -9, True)]  # ... and seen
    assert mech.calls == [("stop", 0), ("stop", 1), ("ended", 0), ("kill", 1), ("ended", 1)]
    assert sup.sweep(100.0) == [] and sup.states()[1].returncode == -9
    sup.stop((0, 1), now=100.0, grace_s=1.0)  # ended: nothing is sent
    assert mech.calls[-1] == ("ended", 1)


def test_an_ignored_kill_reaches_the_backstop_once() -> None:
    mech = Recorder(dies_on_kill=False)
    sup = supervised(mech, 3, backstop_s=5.0)
    sup.stop((3,), now=0.0, grace_s=1.0)
    sup.sweep(1.0)
    sup.sweep(5.9)
    sup.sweep(6.0)
    sup.sweep(60.0)
    assert mech.calls == [("stop", 3), ("kill", 3), ("backstop", 3)]


def test_a_kill_at_once_counts_as_stopped_even_for_an_exit_not_reported_yet() -> None:
    mech = Recorder()
    sup = supervised(mech, 0, 1)
    mech.ends[1] = -15  # ended on its own, not reported yet, when its device is lost
    for v in (0, 1):
        w = sup.get(v)
        assert w is not None
        sup.kill(w, 5.0, "n0 lost")
    assert mech.calls == [("kill", 0)]  # an ended one is not killed again
    assert sup.sweep(5.0) == [WorkerExited(0, 1, Device("n0", 0), -9, True),
                              WorkerExited(1, 1, Device("n0", 1), -15, True)]


def test_an_exit_nobody_asked_for_and_one_held_back() -> None:
    mech = Recorder()
    sup = supervised(mech, 0, 1)
    mech.ends.update({0: 1, 1: -15})
    held = {1}
    assert sup.sweep(1.0, hold=lambda w: w.vrank in held) == [
        WorkerExited(0, 1, Device("n0", 0), 1, False)]
    held.clear()
    assert sup.sweep(2.0, hold=lambda w: w.vrank in held) == [
        WorkerExited(1, 1, Device("n0", 1), -15, False)]


def test_a_worker_launched_again_replaces_the_one_before() -> None:
    mech = Recorder()
    sup = supervised(mech, 0)
    mech.ends[0] = 0
    assert len(sup.sweep(1.0)) == 1
    del mech.ends[0]
    sup.add(WorkerState(0, 2, Device("n0", 1), 200), "pid 200")
    assert sup.states()[0].generation == 2 and sup.states()[0].running
    assert [w.vrank for w in sup.all() if sup.alive(w)] == [0]


def test_close_stops_waits_kills_and_returns_what_survived() -> None:
    mech = Recorder()
    sup = supervised(mech, 0, 1, 2)
    mech.ends[2] = 0  # ended already: left alone
    refreshed = []
    survivors = sup.close(now=1000.0, grace_s=0.1, linger_s=0.1,
                          refresh=lambda: refreshed.append(1))
    assert survivors == [] and refreshed
    assert mech.calls == [("stop", 0), ("stop", 1), ("kill", 0), ("kill", 1)]
    stubborn = Recorder(dies_on_kill=False)
    sup = supervised(stubborn, 4, backstop_s=0.05)
    (left,) = sup.close(now=0.0, grace_s=0.05, linger_s=0.2)
    assert left.vrank == 4
    assert stubborn.calls == [("stop", 4), ("kill", 4), ("backstop", 4)]
