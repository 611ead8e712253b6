"""A coordinator with nothing training ends the job after a bound unless devices can still
come (issue #43): the pure rules (coordinator/outlook.py) as a table, then the real
Coordinator (SQLite record, control channel) over a hand-driven backend whose only devices
are lost: it fails with one line after the bound, or waits while a request that can be met
is pending, and the record's reason (what `slurm-etc status` shows) says for what."""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from slurm_etc.alloc.chooser import TrainingJob
from slurm_etc.alloc.topology import ClusterTopology, Device
from slurm_etc.coordinator import acting, deciding, observe, restart
from slurm_etc.coordinator.backend import Grant, Loss
from slurm_etc.coordinator.loop import Coordinator
from slurm_etc.coordinator.outlook import (
    DEFAULT_GIVE_UP_AFTER_S,
    GiveUp,
    GoesOn,
    Prospects,
    Stranded,
    Waits,
    outlook,
)
from slurm_etc.local.demo import DEMO_HARDWARE
from slurm_etc.plan.model import PRESETS
from slurm_etc.policy.rules import EffectivePolicy

from .coordinator_harness import RecordingBackend, coordinator_over

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

T0, BOUND = 1_000_000.0, 600.0
IDLE = "paused: no parallel configuration of tiny fits 0 devices"

# (prospects, since, now) -> the outcome's kind and a fragment of its text
CASES: list[tuple[str, Prospects, float | None, float, type, str]] = [
    ("a worker trains", Prospects(busy=True), None, T0, GoesOn, ""),
    ("busy resets a stranded clock", Prospects(busy=True), T0 - 10_000, T0, GoesOn, ""),
    ("a request that can be met: waits",
     Prospects(False, IDLE, request_nodes=2, request_met=True, request_since=T0 - 50),
     None, T0, Waits, "waiting for 2 node(s) requested at"),
    ("... for as long as it takes",
     Prospects(False, IDLE, request_nodes=2, request_met=True), T0 - 10 * BOUND, T0, Waits,
     IDLE),
    ("nothing pending: stranded from now", Prospects(False, IDLE), None, T0, Stranded,
     "no node request that can be met is pending"),
    ("stranded, within the bound", Prospects(False, IDLE), T0 - BOUND + 1, T0, Stranded,
     "fails at"),
    ("stranded past the bound: gives up", Prospects(False, IDLE), T0 - BOUND, T0, GiveUp,
     "nothing to train on for 600 s (--give-up-after 600) and no node request that can be "
     "met is pending: give the job devices"),
    ("a request that cannot be met counts for nothing",
     Prospects(False, IDLE, request_nodes=3, request_met=False), T0 - BOUND, T0, GiveUp,
     "its request for 3 node(s) cannot be met"),
    ("a request Slurm holds for a limit says so",
     Prospects(False, IDLE, request_nodes=2, request_held="QOSMaxNodePerUserLimit"), None, T0,
     Waits, "requested (pending: QOSMaxNodePerUserLimit): paused"),
    ("the line says what would help", Prospects(False, "the job holds no device"),
     T0 - BOUND - 5, T0, GiveUp, "run it again; the job holds no device"),
]


@pytest.mark.parametrize("name, prospects, since, now, kind, text", CASES,
                         ids=[c[0] for c in CASES])
def test_outlook_table(name: str, prospects: Prospects, since: float | None, now: float,
                       kind: type, text: str) -> None:
    got = outlook(prospects, since, now, BOUND)
    assert isinstance(got, kind), got
    said = getattr(got, "what", None) or getattr(got, "line", "")
    assert text in said, said
    assert "\n" not in said


def test_stranded_keeps_its_start_and_ends_at_the_bound() -> None:
    first = outlook(Prospects(False, IDLE), None, T0, BOUND)
    assert isinstance(first, Stranded) and (first.since, first.ends_at) == (T0, T0 + BOUND)
    later = outlook(Prospects(False, IDLE), first.since, T0 + 30, BOUND)
    assert isinstance(later, Stranded) and later.what == first.what  # status: no churn
    assert DEFAULT_GIVE_UP_AFTER_S == 600.0


# ------------------------------------------------------------ through the real Coordinator

TOPO = ClusterTopology(2, ("n0", "n1"))
ANCHOR = (Device("n0", 0), Device("n0", 1))


def tiny_job(tmp_path: Path, job: str, backend: RecordingBackend) -> Any:
    """The Coordinator of a tiny job over ``backend`` that does not grow (at most 2 nodes)."""
    return coordinator_over(tmp_path, job, backend,
                            training=TrainingJob(PRESETS["tiny"], 8, 1, False),
                            policy=EffectivePolicy(grow=False, max_nodes=2),
                            hardware=DEMO_HARDWARE, backend_name="local")


class LostAnchor(RecordingBackend):
    """The anchor is granted and lost before anything starts; ``can_meet``: the answer to
    ``request_can_be_met`` (None: the default answer, True, as Slurm's)."""

    def __init__(self, can_meet: bool | None) -> None:
        super().__init__(TOPO)
        self.pending = [Grant("a0", ANCHOR), Loss("a0", ANCHOR, "failure")]
        self.can_meet = can_meet

    def request_can_be_met(self, key: str) -> bool:
        return super().request_can_be_met(key) if self.can_meet is None else self.can_meet


def _run(tmp_path: Path, backend: Any, grow: bool, deadline_s: float) -> tuple[str, Any]:
    job = f"outlook-{grow}-{backend.can_meet is not None}"
    with coordinator_over(tmp_path, job, backend,
                          training=TrainingJob(PRESETS["tiny"], 8, 1, False),
                          policy=EffectivePolicy(grow=grow, max_nodes=2),
                          hardware=DEMO_HARDWARE, backend_name="local",
                          give_up_after_s=1.5) as (coordinator, db):
        state = coordinator.run(deadline_s=deadline_s)
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            row = con.execute("SELECT state, reason FROM jobs").fetchone()
        finally:
            con.close()
    return state, row


def test_nothing_to_wait_for_ends_the_job_failed_with_one_line(tmp_path: Path) -> None:
    """No device left and no growth allowed: failed after the bound (not paused forever),
    the reason one line saying why and what would help."""
    state, (recorded, reason) = _run(tmp_path, LostAnchor(None), grow=False, deadline_s=30)
    assert (state, recorded) == ("failed", "failed")
    assert reason.startswith("nothing to train on for ") and "--give-up-after 1.5" in reason
    assert "give the job devices its model fits" in reason
    assert "no parallel configuration" in reason
    assert "\n" not in reason


def test_a_request_that_cannot_be_met_ends_it_too(tmp_path: Path) -> None:
    backend = LostAnchor(False)
    state, (_recorded, reason) = _run(tmp_path, backend, grow=True, deadline_s=30)
    assert state == "failed" and backend.requested, backend.requested
    assert "cannot be met" in reason, reason


def test_a_request_that_can_be_met_keeps_it_waiting_and_status_says_for_what(
        tmp_path: Path) -> None:
    """A pending member request the cluster can grant: the job waits past the bound (the
    run's own deadline ends it here), its recorded reason naming the request."""
    backend = LostAnchor(True)
    state, (recorded, reason) = _run(tmp_path, backend, grow=True, deadline_s=4.0)
    assert state == "timeout" and backend.requested
    assert reason.startswith("no end within")  # the deadline's line, recorded at the end


def test_the_waiting_reason_is_in_the_record_while_it_waits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = LostAnchor(True)
    seen: list[Any] = []
    with coordinator_over(tmp_path, "outlook-status", backend,
                          training=TrainingJob(PRESETS["tiny"], 8, 1, False),
                          policy=EffectivePolicy(grow=True, max_nodes=2),
                          hardware=DEMO_HARDWARE, backend_name="local",
                          give_up_after_s=1.0) as (coordinator, db):
        real = deciding.check_outlook

        def spy(c: Coordinator) -> str | None:
            out = real(c)
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                seen.append(con.execute("SELECT state, reason FROM jobs").fetchone())
            finally:
                con.close()
            return out

        monkeypatch.setattr(deciding, "check_outlook", spy)
        assert coordinator.run(deadline_s=3.5) == "timeout"
    waiting = [r for s, r in seen if s == "running" and r]
    assert waiting and waiting[-1].startswith("waiting for 1 node(s) requested at"), seen
    assert "no parallel configuration" in waiting[-1]


def test_the_anchors_devices_whose_workers_died_are_used_again_when_nothing_fits(
        tmp_path: Path) -> None:
    """Soak seed 201: the anchor's workers killed, the other nodes lost or released: the job
    had nothing to train on and failed, though the anchor's node was up. Devices whose worker
    died (not lost by the backend) are used again when nothing else fits, at most
    MAX_REUSES times each; a device the backend reported lost never is."""
    from slurm_etc.coordinator import devices
    from slurm_etc.coordinator.verdicts import MAX_REUSES

    backend = RecordingBackend(TOPO)
    backend.pending = [Grant("a0", ANCHOR)]
    with tiny_job(tmp_path, "reuse", backend) as (c, _db):
        observe.observe_backend(c)
        assert c.launches.pinned == set(ANCHOR) and c.launches.anchor_allocation == "a0"
        for _ in range(MAX_REUSES):
            c.holdings = devices.failed(c.holdings, ANCHOR, T0)
            c.launches.exit_failed |= set(ANCHOR)
            assert deciding.reuse_anchor(c)
            assert not set(ANCHOR) & c.lost and set(ANCHOR) <= set(c.held)
        c.holdings = devices.failed(c.holdings, ANCHOR, T0)
        c.launches.exit_failed |= set(ANCHOR)
        assert not deciding.reuse_anchor(c) and set(ANCHOR) <= c.lost  # kept out past the cap
        c.launches.reused.clear()
        backend.pending = [Loss("a0", ANCHOR, "failure")]
        observe.observe_backend(c)
        assert not deciding.reuse_anchor(c)  # lost by the backend: never taken back


def test_the_exit_of_a_vranks_older_process_is_not_the_death_of_its_newer_one(
        tmp_path: Path) -> None:
    """Soak seed 101: idle joiners of an aborted resize (launched for generation 3) were
    killed while their vranks were launched again for generation 4; the old processes' exits,
    polled after the new launch, were taken for the new joiners' deaths and the retry
    launched vrank 2 where its new process already ran: the job stopped."""
    from slurm_etc.coordinator.backend import WorkerExited

    backend = RecordingBackend(TOPO)
    with tiny_job(tmp_path, "stale-exit", backend) as (c, _db):
        acting.record_launch(c, 4, [2])
        c.launches.exit_failed.clear()
        backend.pending = [WorkerExited(2, 3, Device("n1", 0), -9, False)]
        observe.observe_backend(c)
        assert not c.launches.exit_failed and not c.lost  # the old process: nothing died
        backend.pending = [WorkerExited(2, 4, Device("n1", 0), -9, False)]
        observe.observe_backend(c)
        assert c.launches.launched_in == {2: 4}  # the newest process's own exit is still seen


def test_a_layout_lost_whole_starts_again_from_the_checkpoint_or_stops(tmp_path: Path) -> None:
    """Soak seed 101: the node holding the whole layout lost; the resize ordered to joiners
    alone waited for the dead to publish the catalog. Now the first layout starts again from
    the newest checkpoint, or, with none, the job stops saying the state is gone."""
    from dataclasses import replace as _replace

    from slurm_etc.alloc.vranks import identity_layout
    from slurm_etc.coordinator import devices
    from slurm_etc.coordinator.reconcile import JobStopped
    from slurm_etc.plan.config import ParallelConfig
    from slurm_etc.store import jobs as record

    backend = RecordingBackend(TOPO)
    backend.pending = [Grant("a0", ANCHOR)]
    with tiny_job(tmp_path, "lost-whole", backend) as (c, _db):
        observe.observe_backend(c)
        layout = identity_layout(ParallelConfig.parse("dp=2,tp=1,pp=1"), (0, 1))
        c.holdings = _replace(c.holdings, layout=layout, generation=3,
                              vranks={0: ANCHOR[0], 1: ANCHOR[1]}, step=12)
        record.open_generation(c.io.store, "lost-whole", 3, "dp=2,tp=1,pp=1", (0, 1),
                               {0: ANCHOR[0], 1: ANCHOR[1]}, first_step=0)
        c.holdings = devices.loss(c.holdings, ANCHOR, "a0", "failure", T0)
        with pytest.raises(JobStopped, match="no checkpoint holds its state"):
            acting.resize(c, None)  # type: ignore[arg-type]  # decided before the action is read
        (tmp_path / "ck" / "step-10").mkdir(parents=True)
        c.spec = _replace(c.spec, recovery=_replace(c.spec.recovery,
                                                    checkpoint_dir=str(tmp_path / "ck")))
        c.resize.idle = {5}  # a joiner of a resize given up, launched on a device the start reuses
        acting.resize(c, None)  # type: ignore[arg-type]
        assert c.layout is None and c.restart.generation == 4 and c.phase.dirty
        # soak seed 101: forgotten, it still ran where the first layout launched (job stopped)
        assert [a.vranks for a in backend.stopped] == [(5,)] and not c.resize.idle
        assert c.restart.rebuilt_into_next == (3, 12)
        # the start records the way through the checkpoint: steps 11-12 lost, trained again
        restart.record_rebuild(c, 4, 10)
        con = sqlite3.connect(f"file:{_db}?mode=ro", uri=True)
        try:
            row = con.execute("SELECT from_generation, to_generation, outcome, lost_first_step, "
                              "lost_last_step, rebuilt_from FROM migrations").fetchall()
        finally:
            con.close()
        assert row == [(3, 4, "committed", 11, 12, "checkpoint")], row


def test_a_restart_with_no_worker_to_take_up_records_the_steps_it_trains_again(
        tmp_path: Path) -> None:
    """Soak seed 101: a coordinator restarted with no worker of the open generation alive
    starts the first layout again from the newest checkpoint; the record had no migration
    into that generation and no lost steps (the history had steps trained twice, and the
    generation entered by no committed migration). Now the start records the way through
    the checkpoint from the last generation that trained, with the steps since lost."""
    from slurm_etc.store import jobs as record

    backend = RecordingBackend(TOPO)
    with tiny_job(tmp_path, "restart-rebuild", backend) as (c, db):
        record.open_generation(c.io.store, "restart-rebuild", 0, "dp=2,tp=1,pp=1", (0, 1),
                               {0: ANCHOR[0], 1: ANCHOR[1]}, first_step=0)
        record.record_progress(c.io.store, "restart-rebuild", 0, last_step=17)
        record.open_generation(c.io.store, "restart-rebuild", 1, "dp=1,tp=1,pp=1", (0,),
                               {0: ANCHOR[0]}, first_step=17)  # opened, trained nothing
        restart.recover(c)
        assert c.restart.rebuilt_into_next == (0, 17) and c.restart.generation == 2
        restart.record_rebuild(c, 2, 10)
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT from_generation, to_generation, outcome, "
                               "lost_first_step, lost_last_step, rebuilt_from "
                               "FROM migrations").fetchall()
        finally:
            con.close()
        assert rows == [(0, 2, "committed", 11, 17, "checkpoint")], rows
        c.restart.rebuilt_into_next = (2, 5)
        restart.record_rebuild(c, 3, None)  # no checkpoint: from the start, every step lost
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            last = con.execute("SELECT lost_first_step, lost_last_step, rebuilt_from FROM "
                               "migrations ORDER BY id DESC LIMIT 1").fetchone()
        finally:
            con.close()
        assert last == (1, 5, None), last


def test_devices_are_given_back_only_once_the_record_holds_it(tmp_path: Path) -> None:
    """Record, then act: a release is recorded before the backend gives the devices back
    (a restarted coordinator is told by its backend what the job still holds, never the
    reverse). While a full disk keeps the record behind, the devices wait; given back once
    it caught up."""
    from slurm_etc.coordinator.journal import _Write

    other = (Device("n1", 0), Device("n1", 1))
    backend = RecordingBackend(TOPO)
    backend.pending = [Grant("a0", ANCHOR), Grant("a1", other)]
    with tiny_job(tmp_path, "release-behind", backend) as (c, _db):
        observe.observe_backend(c)
        c.io.journal.queue.append(_Write(lambda store: None, (), {}))  # one write waiting
        c.resize.release_later |= set(other)
        c.phase.dirty = False
        deciding.release_now(c)
        assert backend.released == [] and c.phase.dirty and set(other) <= c.resize.release_later
        c.io.journal.retry(hurry=True)  # the disk has room again: the write goes through
        deciding.release_now(c)
        assert [a.devices for a in backend.released] == [other]


def test_a_launch_stops_a_leaving_process_on_its_vrank_or_its_device(tmp_path: Path) -> None:
    """Soak seed 107: a shrink onto n0:1, where vrank 1 (left the layout at the last commit)
    was still exiting, launched vrank 0 there; the backend refused ("vrank 1 runs there") and
    the job stopped. A leaving process on a launch's device or vrank is stopped first (the
    backend's launch waits for it to end); one elsewhere exits on its own."""
    from dataclasses import replace as _replace

    from slurm_etc.coordinator.backend import WorkerState

    class Running(RecordingBackend):
        def workers(self) -> dict:
            return {1: WorkerState(1, 2, ANCHOR[1], 101), 2: WorkerState(2, 2, ANCHOR[0], 102),
                    3: WorkerState(3, 2, Device("n1", 0), 103)}

    backend = Running(TOPO)
    with tiny_job(tmp_path, "leaving", backend) as (c, _db):
        c.holdings = _replace(c.holdings, leaving=frozenset({1, 3, 4}))
        acting.clear_leaving(c, {0: ANCHOR[1], 4: Device("n1", 1)})  # n0:1 where 1 runs; vrank 4
        assert [a.vranks for a in backend.stopped] == [(1, 4)]
        assert c.leaving == {3}  # on a device nobody takes: it exits on its own


def test_a_worker_in_a_generation_the_restart_aborted_is_not_taken_up(tmp_path: Path) -> None:
    """Soak seed 101: a shrink committed by its workers while a full disk kept the record
    behind, then the coordinator killed: the restart closed the migration as aborted and
    took the workers (training in the new layout) up as the old layout's: the history and
    the replay diverged. A worker that trains in a generation whose resize the restart
    closed as aborted is not taken up (told to stop; the job goes on from what survives)."""
    from slurm_etc.protocol.messages import Hello
    from slurm_etc.store import jobs as record

    backend = RecordingBackend(TOPO)
    with tiny_job(tmp_path, "gave-up", backend) as (c, _db):
        record.open_generation(c.io.store, "gave-up", 0, "dp=2,tp=1,pp=1", (0, 1),
                               {0: ANCHOR[0], 1: ANCHOR[1]}, first_step=0)
        record.record_progress(c.io.store, "gave-up", 0, last_step=45)
        record.record_migration_start(c.io.store, "gave-up", from_generation=0, to_generation=1,
                                      plan_digest="", moved_bytes=0, kept_bytes=0,
                                      lower_bound_bytes=0, messages=0, rounds=0)
        restart.recover(c)
        assert c.restart.gave_up == {1}
        c.restart.admit_from = 0  # as _reattach leaves it, taking generation 0's live workers up
        assert not restart.admits(c, Hello("gave-up", 1, 0, "h", 1, step=48, trained=1))
        assert restart.admits(c, Hello("gave-up", 0, 0, "h", 1, step=45, trained=0))
        assert restart.admits(c, Hello("gave-up", 2, 0, "h", 1))  # a worker just started


def test_participants_on_lost_devices_are_dead_to_the_resize_in_flight(tmp_path: Path) -> None:
    """Soak seed 201: a 0.5 s notice ran out inside the shrink it ordered; the leaving
    ranks were killed with their devices (an explained exit, not a death), the resize never
    counted them dead, the survivors waited 120 s, aborted, and the job stopped. A loss
    now marks the resize's participants on the lost devices dead (it settles without them:
    the vote closed, the resize retried)."""
    from slurm_etc.coordinator.reconcile import InflightResize
    from slurm_etc.protocol.messages import LayoutSpec, Resize

    other = (Device("n1", 0), Device("n1", 1))
    backend = RecordingBackend(TOPO)
    backend.pending = [Grant("a0", ANCHOR), Grant("a1", other)]
    with tiny_job(tmp_path, "lost-in-flight", backend) as (c, _db):
        observe.observe_backend(c)
        order = Resize("lost-in-flight", 2, LayoutSpec.make("dp=4,tp=1,pp=1", (0, 1, 2, 3)),
                       LayoutSpec.make("dp=2,tp=1,pp=1", (0, 1)))
        c.resize.inflight = InflightResize(
            order=order, plan=None, migration_id=1, participants=frozenset({0, 1, 2, 3}),
            joiners=frozenset(), vranks={0: ANCHOR[0], 1: ANCHOR[1], 2: other[0], 3: other[1]},
            release=frozenset(), started=0.0)
        backend.pending = [Loss("a1", other, "preempted")]
        observe.observe_backend(c)
        assert set(c.resize.inflight.dead) == {2, 3}


def test_a_step_of_a_layout_not_committed_here_is_shown_not_counted(tmp_path: Path) -> None:
    """Soak seed 102: the new layout's first steps, heard before its commit was settled
    here, advanced the job's step; the commit then recorded the switch at them, two steps
    late. They are shown (heard) but the job's step stays the old layout's last."""
    from dataclasses import replace as _replace

    from slurm_etc.protocol.messages import Progress

    backend = RecordingBackend(TOPO)
    shown: list[dict] = []
    with tiny_job(tmp_path, "uncommitted", backend) as (c, _db):
        from slurm_etc.store import jobs as record

        c.io.progress = shown.append
        record.open_generation(c.io.store, "uncommitted", 9, "dp=4,tp=1,pp=1", (0,),
                               {0: ANCHOR[0]}, first_step=80)
        c.holdings = _replace(c.holdings, generation=9, step=94)
        observe.progress(c, Progress("uncommitted", 10, 0, 95, 5.5, 1e-3, 0, "dp=2,tp=1,pp=1"))
        assert c.step == 94 and [p["step"] for p in shown] == [95]
        observe.progress(c, Progress("uncommitted", 9, 0, 95, 5.5, 1e-3, 0, "dp=4,tp=1,pp=1"))
        assert c.step == 95


def test_a_job_that_ends_inside_a_resize_closes_its_migration_aborted(tmp_path: Path) -> None:
    """Soak seed 104: the job stopped (a launch refused) with a resize in flight, and the
    record kept its migration open for ever. Its end closes it aborted."""
    from slurm_etc.coordinator.reconcile import InflightResize
    from slurm_etc.lifecycle import JobState
    from slurm_etc.protocol.messages import LayoutSpec, Resize
    from slurm_etc.store import jobs as record

    backend = RecordingBackend(TOPO)
    with tiny_job(tmp_path, "ends-inside", backend) as (c, db):
        mid = record.record_migration_start(c.io.store, "ends-inside", from_generation=0,
                                            to_generation=1, plan_digest="", moved_bytes=0,
                                            kept_bytes=0, lower_bound_bytes=0, messages=0,
                                            rounds=0)
        order = Resize("ends-inside", 1, LayoutSpec.make("dp=1,tp=1,pp=1", (0,)),
                       LayoutSpec.make("dp=2,tp=1,pp=1", (0, 1)))
        c.resize.inflight = InflightResize(order=order, plan=None, migration_id=mid,
                                    participants=frozenset({0, 1}), joiners=frozenset({1}),
                                    vranks={0: ANCHOR[0], 1: ANCHOR[1]}, release=frozenset(),
                                    started=0.0)
        c._end(JobState.FAILED, "launch refused")
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            got = con.execute("SELECT outcome, error FROM migrations").fetchall()
        finally:
            con.close()
        assert got == [("aborted", "the job ended: launch refused")], got
