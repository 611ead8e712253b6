"""coordinator/resume.py, called directly: what a restarted coordinator takes up from the
record (no SQLite, no processes; tests/dist/test_coordinator_restart.py kills and restarts a
real coordinator over real workers)."""
from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator.resume import (
    Reattach,
    Refuse,
    launched,
    open_generation,
    reattach,
)
from slurm_etc.plan.config import ParallelConfig
from slurm_etc.store.jobs import (
    EventInfo,
    GenerationInfo,
    JobDetail,
    MigrationInfo,
    VrankInfo,
)

T0 = datetime(2026, 12, 5, tzinfo=timezone.utc)


def gen(number: int, layout: str = "dp=2,tp=1,pp=1", *, ended: bool = False,
        first: int | None = 1, last: int | None = 30) -> GenerationInfo:
    return GenerationInfo(number, layout, 2, T0, T0 if ended else None, 30, first, last, 2.5,
                          "resized" if ended else None)


def launch(vrank: int, generation: int, pid: int, device: str = "n0:0",
           i: int = 0) -> EventInfo:
    payload = {"summary": "-", "vrank": vrank, "generation": generation, "device": device,
               "pid": pid, "start": 77}
    return EventInfo(i, "launch", "coordinator", payload, None, T0, T0, "launched", None)


def migration(to: int, outcome: str) -> MigrationInfo:
    return MigrationInfo(1, to - 1, to, "d", 0, 0, 0, 0, 0, None, None, None, outcome, None,
                         T0, T0, None)


def detail(*, generations=None, migrations=(), events=()) -> JobDetail:
    generations = generations or (gen(1, ended=True), gen(2))
    vranks = (VrankInfo(2, 0, 0, "n0", 0), VrankInfo(2, 1, 1, "n0", 1),
              VrankInfo(2, 5, None, "n2", 1))  # vrank 5: idle in generation 2
    return JobDetail(job=None, vranks=vranks,  # type: ignore[arg-type]  # not read
                     generations=tuple(generations), migrations=tuple(migrations),
                     events=tuple(events))


LAUNCHES = (launch(0, 1, 100, "n0:0"), launch(1, 1, 101, "n0:1"), launch(1, 2, 111, "n0:1"),
            launch(0, 2, 110, "n0:0"), launch(4, 3, 140, "n2:0"))


def test_a_vranks_newest_launch_is_the_worker_and_a_bad_one_is_skipped():
    events = (*LAUNCHES, replace(launch(3, 2, 130), payload={"pid": 9, "device": "nocolon"}),
              replace(launch(6, 2, 160), kind="grant"),
              replace(launch(7, 2, 170), payload={"pid": "170", "vrank": 7}))
    workers = launched(events)
    assert sorted(workers) == [0, 1, 4]
    assert (workers[1].pid, workers[1].generation, workers[1].device) == (111, 2, Device("n0", 1))
    assert workers[0].start == 77


def test_the_open_generation_is_taken_up_whole_with_its_step_and_the_others_stop():
    d = detail(events=LAUNCHES)
    g = open_generation(d)
    assert g is not None and g.number == 2
    got = reattach(d, g, launched(d.events), {0, 1, 4})
    assert isinstance(got, Reattach)
    assert got.generation == 2 and got.layout.config == ParallelConfig(2, 1, 1)
    assert got.layout.devices == (0, 1) and got.vranks == {0: Device("n0", 0), 1: Device("n0", 1)}
    assert (got.step, got.loss) == (30, 2.5)
    assert got.idle == {4}  # the aborted resize's joiner: stopped


def test_a_dead_member_a_commit_not_acted_on_or_a_newer_process_refuses():
    d = detail(events=LAUNCHES)
    g = open_generation(d)
    workers = launched(d.events)
    assert reattach(d, g, workers, {4}) == Refuse(2, (0, 1))  # no member alive
    moved = detail(events=LAUNCHES, migrations=[migration(3, "committed")])
    assert reattach(moved, g, workers, {0, 1}) == Refuse(2, ())
    assert isinstance(reattach(detail(events=LAUNCHES, migrations=[migration(3, "aborted")]),
                               g, workers, {0, 1}), Reattach)  # an abort moved nobody
    newer = {**workers, 1: replace(workers[1], generation=3)}  # vrank 1 went on to 3
    assert reattach(d, g, newer, {0, 1}) == Refuse(2, ())


def test_a_dead_member_is_a_loss_the_live_ones_are_taken_up():
    """Issue #43: workers found dead are a loss (rebuild, replay), never a restart from
    step 1 while a member lives."""
    d = detail(events=LAUNCHES)
    g = open_generation(d)
    got = reattach(d, g, launched(d.events), {0, 4})
    assert isinstance(got, Reattach)
    assert got.layout.devices == (0, 1) and got.dead == {1} and got.idle == {4}
    assert (got.step, got.vranks[1]) == (30, Device("n0", 1))  # its device: failed
    whole = reattach(d, g, launched(d.events), {0, 1})
    assert isinstance(whole, Reattach) and whole.dead == frozenset()


def test_distributed_optimizer_layouts_and_no_open_generation():
    d = detail(generations=[gen(1, ended=True), gen(2, "dp=2,tp=1,pp=1,dist-opt")],
               events=LAUNCHES)
    got = reattach(d, open_generation(d), launched(d.events), {0, 1})
    assert isinstance(got, Reattach) and got.layout.config.distributed_optimizer
    assert open_generation(detail(generations=[gen(1, ended=True), gen(2, ended=True)])) is None
    first = detail(generations=[gen(2, first=12, last=None)], events=LAUNCHES)
    got = reattach(first, open_generation(first), launched(first.events), {0, 1})
    assert isinstance(got, Reattach) and got.step == 12  # nothing trained since it opened
