"""The pure allocation observer (slurm_etc/slurm/observe.py) on real Slurm output: the
squeue/scontrol/sinfo captures of tests/fixtures/slurm/ (tests/slurm/make_fixtures.py), parsed
here, so that Slurm's state names go through the table in slurm/model.py. The states no
capture holds (PREEMPTED, REQUEUED, NODE_FAIL, SIGNALING) are the captured member's squeue row
with its state field replaced. A wrong entry planted in the table is caught."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator.backend import Grant, Loss, PreemptNotice, RequestFailed
from slurm_etc.lifecycle import AllocationState
from slurm_etc.slurm import NodeState, SlurmJobState, model
from slurm_etc.slurm.model import JobInfo
from slurm_etc.slurm.observe import (
    AllocationView,
    CancelAllocation,
    KillWorkersOn,
    Observation,
    observe_allocation,
    observe_nodes,
    preempt_notice,
)
from slurm_etc.slurm.parsers import parse_scontrol_jobs, parse_sinfo_nodes, parse_squeue

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
VERSIONS = sorted(d.name for d in FIXTURES.iterdir() if re.fullmatch(r"\d+\.\d+.*", d.name))
GRACE_S, MARGIN_S = 30.0, 5.0
# squeue_grace.out: member 22 picked for preemption at this time (squeue prints local time)
PICKED = datetime(2026, 11, 30, 21, 25, 56).timestamp()

REQUESTED, GRANTED, PREEMPTING, LOST = (AllocationState.REQUESTED, AllocationState.GRANTED,
                                        AllocationState.PREEMPTING, AllocationState.LOST)


def devs(*nodes: str) -> tuple[Device, ...]:
    return tuple(Device(n, i) for n in nodes for i in (0, 1))


class Captured:
    """One Slurm version's captures, parsed when asked (after any planted table entry)."""

    def __init__(self, version: str) -> None:
        self.dir = FIXTURES / version

    def squeue(self, name: str, job_id: str) -> JobInfo | None:
        jobs = {j.job_id: j for j in parse_squeue((self.dir / f"{name}.out").read_text())}
        return jobs.get(job_id)

    def scontrol(self, name: str, job_id: str) -> JobInfo:
        (job,) = [j for j in parse_scontrol_jobs((self.dir / f"{name}.out").read_text())
                  if j.job_id == job_id]
        return job

    def member_as(self, slurm_state: str) -> JobInfo:
        """The running member's squeue row (job 22 on n4) with Slurm's state replaced."""
        (row,) = [line for line in (self.dir / "squeue_running.out").read_text().splitlines()
                  if line.startswith("22|")]
        (job,) = parse_squeue(row.replace("|RUNNING|", f"|{slurm_state}|", 1))
        return job


def member(state: AllocationState, job_id: str = "22", *, noticed: bool = False
           ) -> AllocationView:
    """A member on n4 (requested: nothing yet)."""
    if state is REQUESTED:
        return AllocationView(job_id, "grow-1")
    return AllocationView(job_id, "grow-1", state, ("n4",), noticed, devs("n4"))


ANCHOR = AllocationView("21", None, GRANTED, ("n1", "n2"), held=devs("n1", "n2"))


@dataclass(frozen=True)
class Case:
    name: str
    view: AllocationView
    job: Callable[[Captured], JobInfo | None]
    state: AllocationState
    events: tuple = ()
    actions: tuple = ()


def lost(view: AllocationView, cause: str, why: str, *, cancel: bool = False) -> dict:
    actions: tuple = (KillWorkersOn(view.job_id, view.held, why),)
    if cancel:
        actions += (CancelAllocation(view.job_id,
                                     "requeued although submitted with --no-requeue"),)
    return dict(state=LOST, events=(Loss(view.job_id, view.held, cause),), actions=actions)


CASES = [
    # pending
    Case("pending for resources stays requested", member(REQUESTED, "23"),
         lambda c: c.squeue("squeue_running", "23"), REQUESTED),
    Case("held by its user stays requested", member(REQUESTED, "24"),
         lambda c: c.squeue("squeue_running", "24"), REQUESTED),
    Case("requeued while requested is pending: stays requested", member(REQUESTED),
         lambda c: c.scontrol("scontrol_job_requeued", "22"), REQUESTED),
    # running: the grant
    Case("running: granted", member(REQUESTED), lambda c: c.squeue("squeue_running", "22"),
         GRANTED, (Grant("22", devs("n4"), "grow-1"),)),
    Case("running and already picked for preemption: granted, then noticed",
         member(REQUESTED), lambda c: c.squeue("squeue_grace", "22"), PREEMPTING,
         (Grant("22", devs("n4"), "grow-1"),
          PreemptNotice("22", devs("n4"), PICKED + GRACE_S - MARGIN_S))),
    Case("the anchor running: nothing new", ANCHOR, lambda c: c.squeue("squeue_running", "21"),
         GRANTED),
    # the preemption notice
    Case("picked for preemption: a notice, deadline = preempt time + grace - margin",
         member(GRANTED), lambda c: c.squeue("squeue_grace", "22"), PREEMPTING,
         (PreemptNotice("22", devs("n4"), PICKED + GRACE_S - MARGIN_S),)),
    Case("in its grace: no second notice", member(PREEMPTING, noticed=True),
         lambda c: c.squeue("squeue_grace", "22"), PREEMPTING),
    Case("SIGNALING (the notice being delivered) still runs", member(GRANTED),
         lambda c: c.member_as("SIGNALING"), GRANTED),
    # preempted / requeued
    Case("preempted after its notice", member(PREEMPTING, noticed=True),
         lambda c: c.member_as("PREEMPTED"), **lost(member(GRANTED), "preempted",
                                                    "job 22 is PREEMPTED")),
    Case("preempted without a notice is a preemption too", member(GRANTED),
         lambda c: c.member_as("PREEMPTED"), **lost(member(GRANTED), "preempted",
                                                    "job 22 is PREEMPTED")),
    Case("REQUEUED is a preemption", member(GRANTED), lambda c: c.member_as("REQUEUED"),
         **lost(member(GRANTED), "preempted", "job 22 is REQUEUED")),
    Case("requeued after its notice (pending again): lost, and cancelled",
         member(PREEMPTING, noticed=True), lambda c: c.squeue("squeue_requeued", "22"),
         **lost(member(GRANTED), "preempted", "job 22 is PENDING", cancel=True)),
    Case("pending again with no notice seen: a failure, cancelled", member(GRANTED),
         lambda c: c.squeue("squeue_requeued", "22"),
         **lost(member(GRANTED), "failure", "job 22 is PENDING", cancel=True)),
    # node failure
    Case("NODE_FAIL is a failure even after a notice", member(PREEMPTING, noticed=True),
         lambda c: c.member_as("NODE_FAIL"), **lost(member(GRANTED), "failure",
                                                    "job 22 is NODE_FAIL")),
    # cancelled / completed
    Case("cancelled by someone: a failure", member(GRANTED, "16"),
         lambda c: c.scontrol("scontrol_jobs_all", "16"),
         **lost(member(GRANTED, "16"), "failure", "job 16 is CANCELLED")),
    Case("cancelled in its grace: the preemption", member(PREEMPTING, "16", noticed=True),
         lambda c: c.scontrol("scontrol_jobs_all", "16"),
         **lost(member(GRANTED, "16"), "preempted", "job 16 is CANCELLED")),
    Case("completed: a failure, even noticed", member(PREEMPTING, "20", noticed=True),
         lambda c: c.squeue("squeue_running", "20"),
         **lost(member(GRANTED, "20"), "failure", "job 20 is COMPLETED")),
    Case("completed before it ran: its request failed", member(REQUESTED, "20"),
         lambda c: c.squeue("squeue_running", "20"), LOST,
         (RequestFailed("grow-1", "20", "COMPLETED"),)),
    Case("cancelled while pending: its request failed", member(REQUESTED, "17"),
         lambda c: c.scontrol("scontrol_jobs_all", "17"), LOST,
         (RequestFailed("grow-1", "17", "CANCELLED"),)),
    # a vanished job (squeue: "Invalid job id specified", no row)
    Case("gone while pending: its request failed", member(REQUESTED, "999999"),
         lambda c: c.squeue("squeue_unknown", "999999"), LOST,
         (RequestFailed("grow-1", "999999", "gone"),)),
    Case("gone in its grace: the preemption", member(PREEMPTING, "999999", noticed=True),
         lambda c: c.squeue("squeue_unknown", "999999"),
         **lost(member(GRANTED, "999999"), "preempted", "job 999999 is gone")),
    Case("the anchor gone: a failure, never cancelled", ANCHOR,
         lambda c: c.squeue("squeue_unknown", "21"), **lost(ANCHOR, "failure",
                                                            "job 21 is gone")),
    # shrunk by someone else
    Case("a node the job no longer has: a failure of its devices",
         AllocationView("21", None, GRANTED, ("n1", "n2", "n3"), held=devs("n1", "n2", "n3")),
         lambda c: c.squeue("squeue_running", "21"), GRANTED,
         (Loss("21", devs("n3"), "failure"),),
         (KillWorkersOn("21", devs("n3"), "job 21 no longer holds n3"),)),
    # gone already
    Case("a released member is not observed again",
         AllocationView("22", "grow-1", AllocationState.RELEASED, ("n4",)),
         lambda c: c.member_as("CANCELLED"), AllocationState.RELEASED),
]


def mismatches(captured: Captured) -> list[str]:
    """Every case whose observation is not the expected one, in one line each."""
    out = []
    for case in CASES:
        obs = observe_allocation(case.view, case.job(captured), gpus_per_node=2,
                                 grace_s=GRACE_S, notice_margin_s=MARGIN_S)
        got = (obs.allocation.state, obs.events, obs.actions)
        if got != (case.state, case.events, case.actions):
            out.append(f"{case.name}: got {got}")
    return out


@pytest.fixture(params=VERSIONS)
def captured(request: pytest.FixtureRequest) -> Captured:
    return Captured(request.param)


def test_every_case_on_real_slurm_output(captured: Captured) -> None:
    assert mismatches(captured) == []


@pytest.mark.parametrize("slurm_name,wrong", [
    ("PREEMPTED", SlurmJobState.FAILED),
    ("PENDING", SlurmJobState.RUNNING),
    ("NODE_FAIL", SlurmJobState.CANCELLED),
    ("CANCELLED", SlurmJobState.PREEMPTED),
    ("COMPLETED", SlurmJobState.RUNNING),
    ("REQUEUED", SlurmJobState.PENDING),
])
def test_a_planted_wrong_mapping_is_caught(captured: Captured, monkeypatch: pytest.MonkeyPatch,
                                           slurm_name: str, wrong: SlurmJobState) -> None:
    monkeypatch.setitem(model.SLURM_JOB_STATES, slurm_name, wrong)  # type: ignore[arg-type]
    assert mismatches(captured), f"{slurm_name} -> {wrong} went unnoticed"


def test_the_new_view_follows_the_events(captured: Captured) -> None:
    """What the backend keeps is what the events say: held devices, nodes, noticed."""
    granted = observe_allocation(member(REQUESTED), captured.squeue("squeue_grace", "22"),
                                 gpus_per_node=2, grace_s=GRACE_S, notice_margin_s=MARGIN_S)
    assert granted.allocation == AllocationView("22", "grow-1", PREEMPTING, ("n4",), True,
                                                devs("n4"))
    gone = observe_allocation(granted.allocation, captured.member_as("PREEMPTED"),
                              gpus_per_node=2, grace_s=GRACE_S, notice_margin_s=MARGIN_S)
    assert gone.allocation == AllocationView("22", "grow-1", LOST, ("n4",), True, ())
    shrunk = observe_allocation(
        AllocationView("21", None, GRANTED, ("n1", "n2", "n3"), held=devs("n1", "n2", "n3")),
        captured.squeue("squeue_running", "21"), gpus_per_node=2, grace_s=None,
        notice_margin_s=MARGIN_S)
    assert shrunk.allocation.nodes == ("n1", "n2")
    assert shrunk.allocation.held == devs("n1", "n2")


def test_a_notice_from_the_members_signal_file() -> None:
    """The same notice when the member's batch shell wrote its signal file; never for the
    anchor, twice, or before the grant; the deadline is never before the signal."""
    obs = preempt_notice(member(GRANTED), 1000.0, grace_s=GRACE_S, notice_margin_s=MARGIN_S)
    assert obs == Observation(member(PREEMPTING, noticed=True),
                              (PreemptNotice("22", devs("n4"), 1025.0),))
    short = preempt_notice(member(GRANTED), 1000.0, grace_s=2.0, notice_margin_s=MARGIN_S)
    assert short.events == (PreemptNotice("22", devs("n4"), 1000.0),)
    for view in (ANCHOR, member(PREEMPTING, noticed=True), member(REQUESTED)):
        assert preempt_notice(view, 1000.0, grace_s=GRACE_S,
                              notice_margin_s=MARGIN_S) == Observation(view)


NODES_HELD = {**dict.fromkeys(devs("n1", "n2"), "21"), **dict.fromkeys(devs("n3"), "22"),
              **dict.fromkeys(devs("n4"), "30")}
NODE_LOSSES = (
    (Loss("21", devs("n2"), "failure"), Loss("22", devs("n3"), "failure")),
    (KillWorkersOn("21", devs("n2"), "node n2 is draining (fixture: maintenance window)"),
     KillWorkersOn("22", devs("n3"), "node n3 is down (fixture: node lost)")))


def node_losses(captured: Captured) -> tuple:
    """sinfo_down_drain.out (n1 mixed, n2 draining, n3 down, n4 allocated) observed."""
    nodes = parse_sinfo_nodes((captured.dir / "sinfo_down_drain.out").read_text())
    return observe_nodes(NODES_HELD, nodes)


def test_nodes_down_or_draining_lose_their_devices(captured: Captured) -> None:
    assert node_losses(captured) == NODE_LOSSES
    assert observe_nodes({}, parse_sinfo_nodes(
        (captured.dir / "sinfo_down_drain.out").read_text())) == ((), ())


@pytest.mark.parametrize("sinfo_name,wrong", [("down", NodeState.IDLE),
                                              ("draining", NodeState.MIXED)])
def test_a_planted_wrong_node_mapping_is_caught(captured: Captured,
                                                monkeypatch: pytest.MonkeyPatch,
                                                sinfo_name: str, wrong: NodeState) -> None:
    monkeypatch.setitem(model.SLURM_NODE_STATES, sinfo_name, wrong)  # type: ignore[arg-type]
    assert node_losses(captured) != NODE_LOSSES
