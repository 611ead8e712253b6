"""coordinator/reconcile.py: the planning and the settlement of a resize, called directly (no
SQLite, no zmq, no processes)."""
from __future__ import annotations

import tracemalloc
from dataclasses import replace

import pytest

from slurm_etc.coordinator.reconcile import (
    ORDER_COPIES,
    RESEND_MAX_S,
    RESEND_S,
    STAYER_RESENDS_FROM,
    Abort,
    CloseVote,
    Commit,
    InflightResize,
    JobStopped,
    NeverJoined,
    NeverReady,
    RecordFinish,
    Replays,
    Supersede,
    VrankMap,
    VrankSet,
    Wait,
    agreed,
    answered,
    became_ready,
    decided_commit,
    died,
    first_told,
    late_answer,
    late_answers,
    late_to_be_ready,
    late_to_join,
    longest_aside,
    may_order,
    ordered,
    overdue,
    owes_order,
    plan_resize,
    rebuilt,
    replayed,
    resent,
    settle,
    supersede,
    told,
    vote_looked_at,
    warming_up,
)
from slurm_etc.plan import PRESETS, Layout, ParallelConfig, Topology
from slurm_etc.protocol.messages import LayoutSpec, Resize, Resized

TIMEOUT = 60.0
ORDER = Resize("j", 2, LayoutSpec.make("dp=2,tp=1,pp=1", (0, 1)),
               LayoutSpec.make("dp=3,tp=1,pp=1", (0, 1, 2)))


def resize(*, joiners=(2,), started=100.0, sent_at=101.0, **kw) -> InflightResize:
    """A grow dp 2 -> 3: vranks 0, 1 stay, 2 joins; the order went out at ``sent_at``."""
    fl = InflightResize(order=ORDER, plan=None, migration_id=7,
                        participants=frozenset({0, 1, 2}), joiners=frozenset(joiners),
                        vranks={}, release=frozenset(), started=started,
                        told=frozenset({0, 1, 2}), stayers=frozenset({0, 1}), sent_at=sent_at)
    return replace(fl, **kw)


def said(vrank: int, outcome: str = "committed", **kw) -> Resized:
    return Resized("j", 2, vrank, outcome, 9, **kw)  # type: ignore[arg-type]


def answers(fl: InflightResize, *reports: Resized) -> InflightResize:
    for r in reports:
        fl = answered(fl, r.vrank, r)
    return fl


def test_waits_until_every_live_participant_answered():
    fl = answers(resize(), said(0), said(1))
    assert settle(fl, 102.0, TIMEOUT).outcome == Wait()
    fl = died(fl, 2)  # the silent one died: the others' answers settle it
    assert isinstance(settle(fl, 102.0, TIMEOUT).outcome, Commit)


def test_commit_takes_the_longest_pause_of_the_old_layout_and_data_phase():
    fl = answers(resize(), said(0, pause_seconds=0.1, data_seconds=0.02),
                 said(1, pause_seconds=0.3, data_seconds=0.01), said(2, pause_seconds=0.2))
    assert settle(fl, 102.0, TIMEOUT).outcome == Commit(0.3, 0.02, None, None, 9)
    # a joiner's pause counts from its own order (it waited for the old layout): not
    # training stopped, so not the resize's pause (what a notice's grace is weighed by)
    fl = answered(fl, 2, said(2, pause_seconds=3.4))
    assert settle(fl, 102.0, TIMEOUT).outcome == Commit(0.3, 0.02, None, None, 9)


def test_a_commit_decided_at_the_store_settles_without_the_answers():
    # every rank voted after its data phase and follows the store's decision: the resize is
    # committed with the answers in so far (issue #42: not one Resized a rank waited for)
    fl = answers(resize(), said(0, data_seconds=0.02))
    assert settle(fl, 102.0, TIMEOUT).outcome == Wait()
    got = settle(decided_commit(fl), 102.0, TIMEOUT)
    assert got.outcome == Commit(0.0, 0.02, None, None, 9) and got.resend == frozenset()
    # a participant dead after the decision does not hold it (the vote holds commit)
    assert settle(decided_commit(died(fl, 2)), 102.0, TIMEOUT).outcome == \
        Commit(0.0, 0.02, None, None, 9)
    # a rebuild waits for the answers: the steps it lost and where from are the workers'
    rebuild = decided_commit(resize(rebuild=True))
    assert settle(rebuild, 102.0, TIMEOUT).outcome == Wait()


def test_the_late_answers_record_the_longest_data_phase_once():
    fl = answers(resize(), said(0, data_seconds=0.02))
    late = late_answers(fl, Commit(0.0, 0.02, None, None))
    assert late is not None and late.waiting == 2
    late, write = late_answer(late, said(1, data_seconds=0.5))
    assert late is not None and write is None  # one still to come: nothing written
    late, write = late_answer(late, said(2, data_seconds=0.1))
    assert late is None and write == 0.5
    # nothing longer than what was recorded: nothing to write
    again = late_answers(fl, Commit(0.0, 0.9, None, None))
    assert again is not None
    for v in (1, 2):
        again, write = late_answer(again, said(v, data_seconds=0.1))  # type: ignore[arg-type]
    assert again is None and write is None
    # every participant answered (or died) at the commit: nothing late
    assert late_answers(answers(fl, said(1), said(2)), Commit(0.0, 0.0, None, None)) is None


def test_the_proposers_answer_for_its_group_settles_and_ends_the_late_answers():
    """The commit decision's share reached every rank: the group's proposer answers for
    all (``for_group``, with the longest data phase), nobody else answers (issue #42)."""
    whole = said(0, data_seconds=0.7, for_group=True)
    fl = answers(resize(), whole)
    assert settle(fl, 102.0, TIMEOUT).outcome == Commit(0.0, 0.7, None, None, 9)
    # not a rebuild: it waits for every survivor's answer (the steps it lost are each
    # one's word), whoever says it answers for the group
    rebuild = answers(resize(rebuild=True), whole)
    assert settle(rebuild, 102.0, TIMEOUT).outcome == Wait()
    got = settle(answers(rebuild, said(1), said(2)), 102.0, TIMEOUT).outcome
    assert isinstance(got, Commit) and got.data_s == 0.7
    # decided before it came: it is the last late answer, whoever had not answered
    early = answers(resize(), said(1, data_seconds=0.02))
    late = late_answers(early, Commit(0.0, 0.02, None, None))
    assert late is not None and late.waiting == 2
    assert late_answer(late, whole) == (None, 0.7)
    assert late_answers(fl, Commit(0.0, 0.7, None, None)) is None
    # only a commit stands for the group; one rank's own answers do not
    assert settle(answers(resize(), said(0, "aborted", for_group=True)), 102.0,
                  TIMEOUT).outcome == Wait()
    assert settle(answers(resize(), said(0)), 102.0, TIMEOUT).outcome == Wait()


def test_order_is_resent_to_the_told_that_neither_answered_nor_died():
    fl = answers(resize(dead=frozenset({1})), said(0))
    assert settle(fl, 101.0 + RESEND_S - 0.1, TIMEOUT).resend == frozenset()
    got = settle(vote_looked_at(fl), 101.0 + RESEND_S + 0.1, TIMEOUT)
    assert got.resend == {2} and got.outcome == Wait()
    # never sent (joiners still warming up): nothing to send again
    assert settle(resize(sent_at=0.0), 500.0, 1000.0).resend == frozenset()


def test_the_old_layout_gets_it_again_late_and_never_once_a_step_decided_it():
    """One rank of the old layout told is enough: the first resends go to the joiner (2)
    alone, which waits for the order on its channel; from the STAYER_RESENDS_FROM-th on
    (a copy refreshed inside the replay window) the old layout's too, until a step's
    decision holds the order."""
    fl = resize()
    late = 101.0 + RESEND_S + 0.1
    assert settle(fl, late, TIMEOUT).resend == {2}
    for _ in range(STAYER_RESENDS_FROM):
        fl = resent(fl, fl.sent_at)
    late = fl.sent_at + RESEND_MAX_S + 0.1
    assert settle(fl, late, TIMEOUT).resend == {0, 1, 2}
    assert settle(agreed(fl), late, TIMEOUT).resend == {2}
    assert settle(agreed(answers(fl, said(2))), late, TIMEOUT).resend == frozenset()


def _grow_on_nodes(nodes: int, per_node: int, lost=(), leaving=()) -> InflightResize:
    """A dp grow of a layout on ``nodes`` nodes of ``per_node`` (vranks in node order,
    ``leaving`` not in the new layout) by one node."""
    from slurm_etc.alloc.topology import Device

    old = [v for v in range(nodes * per_node) if v not in lost]
    new = [v for v in old if v not in leaving] + list(range(nodes * per_node,
                                                             (nodes + 1) * per_node))
    vranks = {v: Device(f"n{v // per_node}", v % per_node) for v in range(len(old) + per_node
                                                                          + len(lost))}
    order = Resize("j", 2, LayoutSpec.make(f"dp={nodes * per_node},tp=1,pp=1",
                                           range(nodes * per_node)),
                   LayoutSpec.make(f"dp={len(new)},tp=1,pp=1", new), lost=tuple(lost))
    return InflightResize(order=order, plan=None, migration_id=7,
                          participants=frozenset(old) | frozenset(new),
                          joiners=frozenset(new) - frozenset(old), vranks=vranks,
                          release=frozenset(), started=100.0, stayers=frozenset(old))


def test_a_planned_order_goes_to_a_few_ranks_of_the_old_layout_one_a_node():
    """One rank told is enough (the step's collectives give the order to the rest): a
    planned resize's order goes to ORDER_COPIES ranks on as many nodes, those staying
    first; one naming the dead goes to every survivor (each waits for it alone)."""
    fl = _grow_on_nodes(2048, 8)
    chosen = first_told(fl)
    assert chosen == {0, 8, 16, 24}
    assert len({fl.vranks[v].node for v in chosen}) == ORDER_COPIES
    # leaving ranks (a shrink's, under notice) are told only where too few stay
    leaving = _grow_on_nodes(4, 8, leaving=range(0, 24))
    assert first_told(leaving) == {24, 0, 8, 16}
    assert first_told(_grow_on_nodes(8, 8, leaving=range(0, 16))) == {16, 24, 32, 40}
    # a loss: every survivor
    lost = _grow_on_nodes(16, 8, lost=(3,))
    assert first_told(lost) == lost.stayers and len(lost.stayers) == 127
    # a small layout: all of it
    assert first_told(_grow_on_nodes(1, 2)) == {0, 1}


def test_resends_come_twice_as_late_each_time_up_to_the_bound():
    """5 s, then 10, 20, 40, then every 60 s (half the workers' replay window): an
    unanswered order is not sent every 5 s for the whole of a long resize."""
    fl = vote_looked_at(answers(resize(dead=frozenset({1})), said(0)))
    now, gaps = fl.sent_at, []
    for _ in range(800):  # 400 s in steps of 0.5
        now += 0.5
        if settle(fl, now, 1000.0).resend:
            gaps.append(now - fl.sent_at)
            fl = resent(fl, now)
    assert [int(g) for g in gaps] == [5, 10, 20, 40, 60, 60, 60, 60, 60], gaps
    assert RESEND_MAX_S <= 60.0  # a copy is refreshed well inside the 120 s replay window


def test_an_abort_with_somebody_dead_is_retried_and_without_stops_the_job():
    fl = died(answers(resize(), said(0, "aborted", error="peer 2 died"), said(1)), 2)
    assert settle(fl, 102.0, TIMEOUT).outcome == Abort("peer 2 died", retry=True)
    fl = answers(resize(), said(0, "aborted", error="refused: bad plan"), said(1), said(2))
    assert settle(fl, 102.0, TIMEOUT).outcome == Abort("refused: bad plan", retry=False)


def test_silence_past_twice_the_worker_timeout_aborts_naming_the_silent():
    fl = answers(resize(), said(0))
    assert settle(fl, 100.0 + 2 * TIMEOUT - 1, TIMEOUT).outcome == Wait()
    assert settle(fl, 100.0 + 2 * TIMEOUT + 1, TIMEOUT).outcome == Abort(
        "no answer from 1, 2", retry=False)


def test_a_joiner_dead_before_the_old_layout_was_ordered_retries_at_once():
    fl = died(resize(sent_at=0.0), 2, "vrank 2 exited with 1 before Ready")
    assert settle(fl, 102.0, TIMEOUT).outcome == Abort("vrank 2 exited with 1 before Ready",
                                                       retry=True)
    fl = replace(fl, never_joined={})
    assert settle(fl, 102.0, TIMEOUT).outcome == Abort(
        "vrank(s) 2 died before the old layout was ordered", retry=True)
    # once the old layout was ordered, the vote is closed (CloseVote), or the others'
    # answers settle it where it holds commit
    fl = ordered(fl, (), 101.0)
    assert settle(fl, 102.0, TIMEOUT).outcome == CloseVote("vrank(s) 2 died in the resize")
    assert settle(vote_looked_at(fl), 102.0, TIMEOUT).outcome == Wait()


def test_a_death_after_the_order_closes_the_vote_at_once_not_after_the_wait():
    # soak seed 201: the survivors wait for the order naming the dead only their own
    # timeout; the coordinator's 2 x timeout wait outlived them and lost the job
    fl = answers(died(resize(joiners=()), 0), said(2))
    assert settle(fl, 102.0, TIMEOUT).outcome == CloseVote("vrank(s) 0 died in the resize")
    looked = vote_looked_at(fl)  # the vote held commit: the answers settle it
    assert settle(looked, 102.0, TIMEOUT).outcome == Wait()
    assert isinstance(settle(answers(looked, said(1)), 102.0, TIMEOUT).outcome, Commit)
    # every live participant answered: settled as before, the vote not asked
    assert isinstance(settle(answers(fl, said(1)), 102.0, TIMEOUT).outcome, Commit)
    # nobody dead: waited out
    assert settle(answers(resize(), said(0)), 102.0, TIMEOUT).outcome == Wait()


def test_the_coordinator_records_what_the_new_layout_reported():
    """Only a rebuild records lost steps; from committed reports (a departed or aborted one
    says nothing); workers that disagree give the widest span, logged."""
    def fl(rebuild, *reports):
        return answers(resize(rebuild=rebuild), *reports)

    assert rebuilt(fl(False, said(0, lost_steps=(9, 9), rebuilt_from="peer-copies"))) == (
        None, None)
    assert rebuilt(fl(True, said(0, lost_steps=(9, 9), rebuilt_from="peer-copies"),
                      said(1, "left"),
                      said(2, "aborted", lost_steps=(1, 2), rebuilt_from="checkpoint"))) == (
        (9, 9), "peer-copies")
    assert rebuilt(fl(True, said(0, rebuilt_from="checkpoint"))) == (None, "checkpoint")
    assert rebuilt(fl(True, said(0, lost_steps=(9, 9), rebuilt_from="peer-copies"),
                      said(1, lost_steps=(7, 9), rebuilt_from="peer-copies"))) == (
        (7, 9), "peer-copies")
    got = settle(fl(True, said(0, lost_steps=(7, 9), rebuilt_from="checkpoint"), said(1),
                    said(2)), 102.0, TIMEOUT).outcome
    assert got == Commit(0.0, 0.0, (7, 9), "checkpoint", 9)


TOPO = Topology(gpus_per_node=4)


def test_a_loss_with_a_surviving_replica_plans_around_it():
    old = Layout(ParallelConfig(2, 1, 2), (0, 1, 2, 3))
    plan, rebuild = plan_resize(PRESETS["tiny"], old, ParallelConfig(1, 1, 2), [0, 1], TOPO,
                                lost=[3], lost_devices="n0:3", can_rebuild=False)
    assert not rebuild and plan.new.config == ParallelConfig(1, 1, 2)
    assert 3 not in set(plan.messages.src.tolist())


def test_state_only_the_lost_held_is_rebuilt_or_stops_the_job():
    """dp=1: the lost device's layers have no replica. With peer copies or checkpoints the
    plan is the full one (a survivor stands in for the lost rank); without, the job stops
    naming the devices and the flags that would have kept it."""
    old = Layout(ParallelConfig(1, 1, 2), (0, 1))
    plan, rebuild = plan_resize(PRESETS["tiny"], old, ParallelConfig(1, 1, 1), [0], TOPO,
                                lost=[1], lost_devices="n0:1", can_rebuild=True)
    assert rebuild and plan.new.devices == (0,)
    assert 1 in set(plan.messages.src.tolist())  # planned as if rank 1 were there
    with pytest.raises(JobStopped, match=r"devices n0:1 failed .* --peer-copy-every N"):
        plan_resize(PRESETS["tiny"], old, ParallelConfig(1, 1, 1), [0], TOPO, lost=[1],
                    lost_devices="n0:1", can_rebuild=False)


def test_joiners_are_given_up_past_the_join_timeout_of_their_launch():
    unjoined = {2: (1, 100.0), 3: (1, 130.0)}  # vrank -> (generation, launched at)
    assert late_to_join(unjoined, 150.0, 60.0) == []
    assert late_to_join(unjoined, 161.0, 60.0) == [2]
    assert late_to_join(unjoined, 191.0, 60.0) == [2, 3]


def test_the_join_timeout_looks_at_the_oldest_launch_only_while_none_is_late():
    class Counted(dict):  # counts the entries read
        read = 0

        def items(self):
            for item in super().items():
                Counted.read += 1
                yield item

    unjoined = Counted({v: (1, 100.0 + v) for v in range(10_000)})  # launch order
    assert late_to_join(unjoined, 150.0, 60.0) == [] and Counted.read == 1
    Counted.read = 0
    assert late_to_join(unjoined, 162.5, 60.0) == [0, 1, 2] and Counted.read == 4


def test_hello_without_ready_is_late_only_while_the_old_layout_is_not_ordered():
    fl = became_ready(resize(joiners=(2, 3), sent_at=0.0), 3)
    assert late_to_be_ready(fl, set(), 159.0, 60.0, True) == []  # within the timeout
    assert late_to_be_ready(fl, set(), 161.0, 60.0, True) == [2]
    assert late_to_be_ready(fl, {2}, 161.0, 60.0, True) == []  # no Hello yet: late_to_join's
    assert late_to_be_ready(fl, set(), 161.0, 60.0, False) == []  # ordered at once: no wait
    fl = ordered(fl, (), 150.0)  # ordered: the settlement's business now
    assert late_to_be_ready(fl, set(), 161.0, 60.0, True) == []
    assert late_to_be_ready(None, set(), 161.0, 60.0, True) == []


def test_only_a_grow_not_yet_ordered_is_warming_up():
    assert warming_up(resize(sent_at=0.0))
    assert not warming_up(resize(sent_at=101.0))  # ordered: somebody may be paused
    assert not warming_up(resize(joiners=(), sent_at=0.0))  # a shrink has no joiner
    assert not warming_up(None)



def test_overdue_gives_up_the_unready_then_the_silent_with_the_line_saying_why():
    fl = became_ready(resize(joiners=(2, 3), sent_at=0.0), 3)
    unjoined = {4: (2, 90.0)}  # launched for the next generation at 90, never said Hello
    assert overdue(fl, unjoined, 149.0, 60.0, True) == []
    got = overdue(fl, unjoined, 161.0, 60.0, True)
    assert got == [
        NeverReady({2: "vrank 2 said hello but was not ready within 60 s of its launch "
                       "(slurm-etc run --join-timeout): its log says why"}),
        NeverJoined((4,), "did not say hello within 60 s of its launch (slurm-etc run "
                          "--join-timeout)")]
    assert overdue(None, {}, 1e9, 60.0, True) == []


def test_a_notice_supersedes_only_a_grow_still_warming_up_recording_it_first():
    got = supersede(resize(sent_at=0.0), 130.0)
    assert [type(e) for e in got] == [RecordFinish, Supersede]
    finish = got[0]
    assert isinstance(finish, RecordFinish) and finish.migration_id == 7
    assert finish.outcome == "aborted" and finish.measured_seconds == 30.0
    assert finish.error == got[1].why  # type: ignore[union-attr]
    assert supersede(resize(sent_at=101.0), 130.0) == []  # ordered: it settles
    assert supersede(None, 130.0) == []

# -- what a settled resize changes, and the effects in their order --------------------------

def _holdings(**kw):
    from slurm_etc.alloc.topology import Device
    from slurm_etc.coordinator.reconcile import Holdings

    d = [Device("n1", 0), Device("n1", 1), Device("n2", 0)]
    base = dict(layout=ORDER.old.layout(), generation=1, vranks={0: d[0], 1: d[1]},
                held={d[0]: "a0", d[1]: "a0", d[2]: "a1"}, notices={}, lost=frozenset(),
                leaving=frozenset(), step=40, loss=2.5)
    base.update(kw)
    return Holdings(**base), d


def test_a_commit_records_first_then_opens_the_new_generation_then_releases():
    from slurm_etc.coordinator.reconcile import (
        CloseGeneration,
        OpenGeneration,
        RecordFinish,
        ReleaseLater,
        commit,
    )
    from slurm_etc.lifecycle import ResizeOutcome

    held, d = _holdings()
    fl = resize(vranks={0: d[0], 1: d[1], 2: d[2]}, release=frozenset({d[1]}))
    done = Commit(0.05, 0.01, None, None)
    after, effects = commit(held, fl, done, 1.5)
    assert [type(e) for e in effects] == [RecordFinish, CloseGeneration, OpenGeneration,
                                          ReleaseLater]
    assert effects[0] == RecordFinish(7, ResizeOutcome.COMMITTED, 1.5, 0.05, 0.01)
    assert effects[1] == CloseGeneration(1, "resized", 40, 2.5)
    assert effects[2] == OpenGeneration(2, ORDER.new.layout(), {0: d[0], 1: d[1], 2: d[2]}, 40)
    assert effects[3] == ReleaseLater(frozenset({d[1]}))
    assert after.layout == ORDER.new.layout() and after.generation == 2
    assert after.step == 40 and after.loss == 2.5 and after.leaving == frozenset()
    assert held.generation == 1  # the input is not changed
    # soak seed 102: the new layout's steps 41-42 heard before the commit: the switch is
    # where the ranks said they took the state (40), not the step heard last
    ahead = replace(held, step=42, loss=2.1)
    after, effects = commit(ahead, fl, replace(done, switch_step=40), 1.5)
    assert effects[1] == CloseGeneration(1, "resized", 40, None)
    assert effects[2].first_step == 40 and after.step == 40


def test_a_rebuild_rolls_the_step_back_and_forgets_lost_devices_it_no_longer_holds():
    from slurm_etc.alloc.topology import Device
    from slurm_etc.coordinator.reconcile import commit

    gone = Device("n3", 0)
    shrink = Resize("j", 2, LayoutSpec.make("dp=2,tp=1,pp=1", (0, 1)),
                    LayoutSpec.make("dp=1,tp=1,pp=1", (0,)), lost=(1,))
    held, d = _holdings(lost=frozenset({gone}),
                        notices={gone: (5.0, "a9")}, held={gone: "a9"})
    fl = resize(vranks={0: d[0], 1: d[1]}, joiners=(), dead=frozenset({1}), order=shrink)
    after, effects = commit(held, fl, Commit(0.2, 0.0, (31, 40), "peer-copies"), 2.0)
    assert after.step == 30 and after.loss is None  # steps 31-40 are trained again
    assert effects[1].last_step == 40  # the old generation closed where it was
    assert effects[2].first_step == 30
    assert gone not in after.lost and gone not in after.held and gone not in after.notices
    assert after.leaving == frozenset()  # vrank 1 died: it does not leave, it is gone


def test_an_abort_records_and_stops_the_idle_only_when_nobody_died():
    from slurm_etc.coordinator.reconcile import RecordFinish, StopIdle, abort
    from slurm_etc.lifecycle import ResizeOutcome

    fl = resize()
    again = abort(fl, Abort("peer died", retry=True), 3.0)
    assert again == [RecordFinish(7, ResizeOutcome.ABORTED, 3.0, error="peer died")]
    stops = abort(fl, Abort("refused", retry=False), 3.0)
    assert stops[0].outcome == ResizeOutcome.ABORTED and stops[1] == StopIdle("resize aborted")


# -- the order of a resize: vranks, plan, generation, joiners, prepared beside training ----

def test_an_order_reserves_vranks_plans_and_prepares_beside_training_when_the_grace_holds():
    from slurm_etc.alloc.topology import Device
    from slurm_etc.coordinator.reconcile import ASIDE_MARGIN, ASIDE_STEPS, order_resize

    held, d = _holdings()
    topo = Topology(gpus_per_node=2)
    pool = {0: d[0], 1: d[1], 2: d[2], 3: Device("n2", 1)}
    common = dict(job_id="j", generation=5, config=ParallelConfig(4, 1, 1), pool=pool,
                  reason="grow", model=PRESETS["tiny"], topology=topo, gpus_per_node=2,
                  can_rebuild=False, prepare_while_training=True)
    got = order_resize(held, deadline=None, now=0.0, longest_aside_s=None,
                       first_aside_grace_s=15.0, **common)
    assert got.order.generation == 5 and got.order.new.config == "dp=4,tp=1,pp=1"
    assert got.joiners == {2, 3} and got.participants == {0, 1, 2, 3}
    assert got.order.prepare_while_training and got.grace_left is None
    assert got.order.plan_digest and got.order.lost == ()
    # under a notice: 10 s of grace, none timed yet (15 s needed): full speed
    short = order_resize(held, deadline=110.0, now=100.0, longest_aside_s=None,
                         first_aside_grace_s=15.0, **common)
    assert not short.order.prepare_while_training and short.aside_needs == 15.0
    # one timed at 2 s: ASIDE_MARGIN x 2 s + the estimate fits in 10 s
    timed = order_resize(held, deadline=110.0, now=100.0, longest_aside_s=2.0,
                         first_aside_grace_s=15.0, **common)
    assert timed.aside_needs == ASIDE_MARGIN * 2.0 + timed.plan.est_seconds
    assert timed.order.prepare_while_training
    # steps of 1.25 s (the Slurm test's paced ones): its stages wait for 4 boundaries, twice
    # over that is more than the 10 s: full speed, however quick the last one timed
    slow = order_resize(held, deadline=110.0, now=100.0, longest_aside_s=0.4,
                        first_aside_grace_s=15.0, step_s=1.25, **common)
    assert slow.aside_needs == ASIDE_MARGIN * ASIDE_STEPS * 1.25 + slow.plan.est_seconds
    assert not slow.order.prepare_while_training
    quick = order_resize(held, deadline=110.0, now=100.0, longest_aside_s=0.4,
                         first_aside_grace_s=15.0, step_s=0.05, **common)
    assert quick.order.prepare_while_training


def test_a_leaving_devices_vrank_is_never_given_to_another_device():
    from slurm_etc.alloc.topology import Device
    from slurm_etc.coordinator.reconcile import reserve_vranks

    layout = {0: Device("n1", 0), 1: Device("n1", 1)}
    pool = {0: Device("n2", 0), 1: Device("n2", 1)}  # the allocator reused n1's vranks
    got = reserve_vranks(pool, layout, 2)
    assert got == {2: Device("n2", 0), 3: Device("n2", 1)}
    assert reserve_vranks(layout, layout, 2) == layout


def test_what_the_workers_say_gives_a_new_resize_and_leaves_the_one_before():
    fl = resize(sent_at=0.0)
    after = died(fl, 2, "vrank 2 exited with 1 before Ready")
    after = died(after, 2, "a second line")  # the first line said stays
    assert after.dead == {2} and after.never_joined == {2: "vrank 2 exited with 1 before Ready"}
    assert fl.dead == frozenset() and fl.never_joined == {}
    after = answered(fl, 0, said(0))
    assert after.reports == {0: said(0)} and fl.reports == {}
    assert answered(after, 0, said(0, "aborted")).reports[0] == said(0)  # a commit is final
    assert replayed(fl, "step 9").early == ("step 9",) and fl.early == ()
    assert ordered(fl, {0}, 120.0).sent_at == 120.0 and fl.sent_at == 0.0
    with pytest.raises(AttributeError):
        fl.sent_at = 1.0  # type: ignore[misc]  # never changed in place


def test_the_old_layout_is_ordered_once_every_joiner_is_ready_and_none_died():
    fl = resize(joiners=(2, 3), sent_at=0.0)
    assert may_order(fl, False)  # ordered at once: no warm-up wait
    assert not may_order(fl, True)
    assert not may_order(became_ready(fl, 3), True)  # 2 is not ready
    ready = became_ready(became_ready(fl, 3), 2)
    assert may_order(ready, True)
    assert not may_order(died(ready, 2), True)  # a dead joiner: replanned, nobody paused
    assert not may_order(ordered(ready, {0, 1}, 120.0), True)  # once
    assert not may_order(replace(ready, stayers=frozenset()), True)
    assert not may_order(None, True)


def test_a_worker_that_says_hello_gets_the_order_it_has_not_had():
    fl = resize(joiners=(2,), sent_at=0.0, told=frozenset())
    assert owes_order(fl, 2)  # a joiner: at once
    assert not owes_order(fl, 0)  # the old layout: only once it is ordered
    assert not owes_order(told(fl, 2), 2)
    assert owes_order(ordered(fl, {1}, 120.0), 0)  # still starting when the order went out
    assert not owes_order(ordered(fl, {0, 1}, 120.0), 0)
    assert not owes_order(fl, 7)  # not a participant
    assert not owes_order(None, 2)


def test_the_longest_preparation_aside_counts_only_resizes_prepared_beside_training():
    aside = resize(sent_at=101.0, order=Resize("j", 2, ORDER.old, ORDER.new,
                                               prepare_while_training=True))
    assert longest_aside(None, aside, 105.0, 0.5) == 3.5  # order to commit, less the pause
    assert longest_aside(9.0, aside, 105.0, 0.5) == 9.0  # the longest stays
    assert longest_aside(2.0, resize(sent_at=101.0), 105.0, 0.5) == 2.0  # at full speed
    assert longest_aside(None, replace(aside, sent_at=0.0), 105.0, 0.5) is None  # never ordered


# -- a message costs O(log n): the fields it changes are persistent, never copied ----------

def test_the_fields_a_message_changes_are_persistent_and_read_as_before():
    fl = resize(sent_at=0.0, dead=frozenset({1}), never_joined={1: "gone"})
    # a plain set, dict or tuple given is taken as its persistent kind, equal as before
    assert type(fl.told) is VrankSet and type(fl.reports) is VrankMap
    assert type(fl.early) is Replays and type(fl.never_joined) is VrankMap
    assert fl.told == {0, 1, 2} == fl.told and hash(fl.told) == hash(frozenset({0, 1, 2}))
    assert fl.dead == frozenset({1}) and fl.never_joined == {1: "gone"} and fl.reports == {}
    assert fl.joiners - fl.dead == {2} and type(fl.participants - fl.dead) is frozenset
    assert sorted(fl.participants & fl.dead) == [1] and 1 in fl.dead and 0 not in fl.dead
    # a new value per message, the one before unchanged; a commit is final through answered
    after = answered(fl, 0, said(0))
    assert type(after.reports) is VrankMap and len(after.reports) == 1 and len(fl.reports) == 0
    assert answered(after, 0, said(0, "aborted")).reports == {0: said(0)}
    assert answered(after, 0, said(0, pause_seconds=2.0)).reports[0].pause_seconds == 2.0
    assert told(fl, 0) is not fl and told(fl, 0).told is fl.told  # told already: shared
    early = replayed(replayed(fl, "step 9"), "step 10").early
    assert early == ("step 9", "step 10") and list(early) == ["step 9", "step 10"]
    # the same messages give equal values, however the fields were first given
    built = replace(fl, reports={0: said(0)}, ready=frozenset({2}), told=[0, 1, 2])
    assert became_ready(after, 2) == built and became_ready(after, 2) != after
    # owes_order and may_order read them as they read frozensets
    assert owes_order(replace(fl, told=VrankSet()), 2) and not owes_order(fl, 2)
    assert not may_order(fl, True) and may_order(replace(became_ready(fl, 2), dead=()), True)


N = 10_000


def _big(**kw) -> InflightResize:
    """A resize of N + 1 ranks with N answers, told, ready, dead and replayed steps."""
    vs = range(N)
    return resize(participants=frozenset(range(N + 1)), joiners=range(N + 1),
                  reports={v: said(v) for v in vs}, told=frozenset(vs), ready=frozenset(vs),
                  dead=frozenset(vs), never_joined={v: "gone" for v in vs},
                  early=tuple(f"step {v}" for v in vs), **kw)


def _allocated(update) -> int:
    """The bytes one call allocates at its peak (what it returns kept): counted, not timed."""
    tracemalloc.start()
    try:
        kept = update()  # noqa: F841  # the new value stays allocated while it is counted
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _copies(update) -> bool:
    """Whether a message's update copies what the resize holds of every vrank: a copy of
    N entries takes at least a pointer (8 bytes) each; sharing the old value's structure, a
    message allocates the path to one leaf (a few KiB), well under 1 byte per vrank."""
    return _allocated(update) > N


MESSAGES = {
    "answered": lambda fl: answered(fl, N, said(N)),
    "told": lambda fl: told(fl, N),
    "became_ready": lambda fl: became_ready(fl, N),
    "died": lambda fl: died(fl, N, "vrank N exited"),
    "replayed": lambda fl: replayed(fl, "step N"),
    "ordered again": lambda fl: ordered(fl, (N,), 130.0),
}


@pytest.mark.parametrize("message", sorted(MESSAGES))
def test_a_message_on_a_resize_of_ten_thousand_ranks_copies_nothing(message):
    fl = _big()
    after = MESSAGES[message](fl)
    assert not _copies(lambda: MESSAGES[message](fl))
    # a new value one larger, the one before the same size (nothing changed in place)
    field = {"answered": "reports", "told": "told", "became_ready": "ready", "died": "dead",
             "replayed": "early", "ordered again": "told"}[message]
    assert len(getattr(after, field)) == N + 1 and len(getattr(fl, field)) == N


def test_the_copy_check_catches_a_message_that_copies():
    """Planted bugs: the updates as they were (a dict, a frozenset, a tuple copied whole per
    message) fail the same check."""
    fl, r = _big(), said(N)
    assert _copies(lambda: replace(fl, reports={**fl.reports, N: r}))
    assert _copies(lambda: replace(fl, reports=VrankMap(dict(fl.reports) | {N: r})))
    assert _copies(lambda: replace(fl, told=fl.told | {N}))
    assert _copies(lambda: replace(fl, early=(*fl.early, "step N")))


class _Unlisted(frozenset):
    """Vranks that may be asked about one at a time, never listed (listing is O(n))."""

    def __iter__(self):
        raise AssertionError("every vrank looked at for one message")


def test_what_each_message_asks_looks_at_no_vrank_but_its_own():
    """may_order (asked at each Hello and Ready), owes_order (each Hello) and a settle that
    waits (each turn of the loop) never list the joiners or participants while they wait."""
    everyone = _Unlisted(range(N))
    fl = replace(resize(participants=everyone, sent_at=0.0, told=(), ready=range(N - 1),
                        reports={v: said(v) for v in range(N - 1)}), joiners=everyone)
    assert not may_order(fl, True) and owes_order(fl, 5)
    assert settle(fl, 102.0, TIMEOUT).outcome == Wait()
    # planted bugs: the same questions asked as set algebra, as they were, list every vrank
    for asked in (lambda: fl.joiners - fl.ready, lambda: fl.joiners & fl.dead,
                  lambda: fl.participants - fl.dead <= set(fl.reports)):
        with pytest.raises(AssertionError, match="every vrank"):
            asked()
    # the last Ready: looked at once, then ordered
    last = became_ready(replace(fl, joiners=frozenset(everyone)), N - 1)
    assert may_order(last, True)
