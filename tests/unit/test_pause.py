"""The pause measured at the step boundaries (coordinator/pause.py) and its record (migration
0004_measured_pause): the largest gap over the new layout's processes, joiners measured from
the old layout's last step, preparation apart; written only for a committed migration, shown
by status, absent without harm from an older record."""
import random
import sqlite3
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import msgspec
import pytest

from slurm_etc.coordinator.pause import PauseTracker, ProcessGap, measured_pause
from slurm_etc.protocol.messages import ENCODER, MAX_VRANKS, REPORT_DECODER, Resumed
from slurm_etc.store import (
    RecordError,
    create_job,
    job_detail,
    open_store,
    open_store_readonly,
    record_migration_finish,
    record_migration_pause,
    record_migration_start,
)
from slurm_etc.worker.reporting import code_vrank, gap_codes

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 2, 1, 0, 0, tzinfo=timezone.utc)
DECIDED = 1000.0


def test_the_pause_is_the_widest_gap_and_preparation_ends_where_it_begins():
    gaps = [ProcessGap(0, 1003.0, 1004.5),          # a stayer: 1.5 s
            ProcessGap(1, 1003.1, 1004.4),          # 1.3 s
            ProcessGap(2, 1003.0, 1005.25, True)]   # a joiner, from the old layout's end
    p = measured_pause(gaps, DECIDED)
    assert p is not None
    assert (p.seconds, p.vrank, p.processes) == (2.25, 2, 3)
    assert (p.paused_at, p.resumed_at) == (1003.0, 1005.25)
    assert p.preparation_seconds == 3.0  # decision to the last old step: trained through
    # the order of the reports changes nothing; a tie goes to the lowest vrank
    assert measured_pause(reversed(gaps), DECIDED) == p
    tie = measured_pause([ProcessGap(5, 10.0, 11.0), ProcessGap(4, 10.0, 11.0)], 9.0)
    assert tie is not None and tie.vrank == 4


def test_a_loss_stops_training_before_the_decision_no_preparation():
    p = measured_pause([ProcessGap(0, 995.0, 1002.0)], DECIDED)
    assert p is not None and p.seconds == 7.0 and p.preparation_seconds == 0.0
    assert measured_pause([], DECIDED) is None


def _resumed(vrank, started, last, gen=1, joined=False):
    return Resumed("j", gen, vrank, 7, started, last, joined)


def test_the_tracker_waits_for_the_commit_and_for_every_new_process():
    t = PauseTracker()
    assert t.add(_resumed(0, 1004.0, 1003.0)) == []  # before the commit was settled
    assert t.committed(1, "m1", (0, 1, 2), DECIDED) == []  # vranks 1, 2 not yet
    assert t.add(_resumed(1, 1004.2, 1003.0)) == []
    ((mid, p),) = t.add(_resumed(2, 1004.9, 1003.0, joined=True))
    assert mid == "m1" and p.processes == 3 and p.vrank == 2
    assert round(p.seconds, 6) == 1.9
    assert t.flush() == []  # written once


def test_flush_takes_what_came_and_an_unknown_end_counts_for_nothing():
    t = PauseTracker()
    t.committed(2, "m2", (0, 1, 2, 3), DECIDED)
    t.add(_resumed(0, 1010.0, 1009.5, gen=2))
    t.add(_resumed(3, 1012.0, None, gen=2, joined=True))  # a joiner that found no end
    t.add(_resumed(9, 1099.0, 1000.0, gen=2))  # not of the new layout: ignored
    ((mid, p),) = t.flush()
    assert (mid, p.seconds, p.processes) == ("m2", 0.5, 1)


def test_the_stall_is_the_widest_over_the_processes_and_kept_apart_from_the_pause():
    """A stayer built the new world at one boundary of the old layout (0.8 s without a
    step); the pause after it is another gap: both recorded, neither inside the other."""
    gaps = [ProcessGap(0, 1003.0, 1003.2, stalled=0.8), ProcessGap(1, 1003.0, 1003.25,
                                                                    stalled=0.75),
            ProcessGap(2, 1003.0, 1003.1, True)]  # a joiner: nothing prepared beside it
    p = measured_pause(gaps, DECIDED)
    assert p is not None and (p.seconds, p.vrank) == (0.25, 1)
    assert (p.stall_seconds, p.stall_vrank) == (0.8, 0)
    none = measured_pause([ProcessGap(0, 1003.0, 1003.2)], DECIDED)
    assert none is not None and (none.stall_seconds, none.stall_vrank) == (0.0, None)
    # what a worker says is bounded: a negative or non-finite stall counts for nothing
    t = PauseTracker()
    t.committed(1, "m", (0, 1), DECIDED)
    t.add(Resumed("j", 1, 0, 7, 1004.0, 1003.0, stalled=float("nan")))
    ((_, q),) = t.add(Resumed("j", 1, 1, 7, 1004.0, 1003.0, stalled=-5.0))
    assert (q.stall_seconds, q.stall_vrank) == (0.0, None)


def test_a_loss_keeps_the_whole_gap_as_the_pause_and_the_interrupted_step_apart():
    """A node died in step 8: the survivors' collective failed 0.4 s into it (their last
    step ended at 1003.0); they resumed at 1003.65. The pause is the whole gap, the step in
    flight (0.4 s) recorded of it; a failure time outside the gap counts no more than it."""
    gaps = [ProcessGap(0, 1003.0, 1003.6, failed_at=1003.4),
            ProcessGap(1, 1003.0, 1003.65, failed_at=1003.45)]
    p = measured_pause(gaps, DECIDED)
    assert p is not None and (p.seconds, p.vrank) == (pytest.approx(0.65), 1)
    assert p.interrupted_seconds == pytest.approx(0.45)  # the widest process's
    assert ProcessGap(0, 1003.0, 1003.6, failed_at=1002.0).interrupted == 0.0
    assert ProcessGap(0, 1003.0, 1003.6, failed_at=1009.0).interrupted == pytest.approx(0.6)
    assert ProcessGap(0, 1003.0, 1003.6).interrupted == 0.0  # no step failed: a resize
    t = PauseTracker()
    t.committed(1, "m", (0,), DECIDED)
    ((_, q),) = t.add(Resumed("j", 1, 0, 7, 1004.0, 1003.0, failed_at=float("inf")))
    assert q.interrupted_seconds == 0.0  # what a worker says is bounded


def _together(reports: list[Resumed]) -> list[Resumed]:
    """What a layout's ranks send when they find the widest gap and stall together
    (worker/reporting.py): the maxima of their codes, as the all-reduce gives them, and
    only the ranks they name report, each for all."""
    codes = [gap_codes(r.vrank, r.started, r.last_ended, r.stalled) for r in reports]
    widest, stall = (code_vrank(max(c[i] for c in codes)) for i in (0, 1))
    n = len(reports)
    return [msgspec.structs.replace(r, widest_of=n if r.vrank == widest else 0,
                                    stall_of=n if r.vrank == stall else 0)
            for r in reports if r.vrank in (widest, stall)]


def _widest_by_definition(reports: list[Resumed]) -> tuple[int | None, int]:
    """The oracle: the widest gap's vrank (None: no gap known) and the widest stall's,
    ties to the lowest vrank, in plain float arithmetic (no codes)."""
    known = [r for r in reports if r.last_ended is not None]
    widest = min(known, key=lambda r: (-(r.started - r.last_ended), r.vrank)).vrank \
        if known else None
    return widest, min(reports, key=lambda r: (-r.stalled, r.vrank)).vrank


def test_the_codes_name_the_widest_gap_and_stall_as_the_pause_does():
    """Random layouts (negative gaps from clocks apart, unknown ends, ties, stalls):
    the maxima of the codes name the ranks the definition does."""
    rng = random.Random(45)
    for case in range(2000):
        n = rng.randint(1, 40)
        vranks = rng.sample(range(MAX_VRANKS), n) if case % 2 else list(range(n))
        reports = []
        for v in vranks:
            last = None if rng.random() < 0.1 else 1000.0 + rng.choice([0.0, 0.25, 0.5])
            started = 1000.0 + rng.choice([-3.0, 0.5, 1.0, 1.75, 1.75, 2.0])
            stalled = rng.choice([0.0, 0.0, 0.25, 0.8, 0.8])
            reports.append(Resumed("j", 1, v, 7, started, last, stalled=stalled))
        codes = [gap_codes(r.vrank, r.started, r.last_ended, r.stalled) for r in reports]
        widest, stall = (code_vrank(max(c[i] for c in codes)) for i in (0, 1))
        want_widest, want_stall = _widest_by_definition(reports)
        assert stall == want_stall, (case, reports)
        if want_widest is not None:
            assert widest == want_widest, (case, reports)
    with pytest.raises(ValueError, match="does not fit"):
        gap_codes(MAX_VRANKS, 1.0, 0.0, 0.0)
    # not finite: an unknown gap, no stall (below every known one), never an exception
    bad = gap_codes(5, 1.0, float("-inf"), float("nan"))
    assert bad == gap_codes(5, 1.0, None, 0.0)
    assert bad[0] < gap_codes(6, 1.0, 1e6, 0.0)[0] and code_vrank(bad[1]) == 5


def test_the_widest_found_together_gives_the_pause_every_report_would():
    """One or two reports stand for the layout: the same pause (and stall) as every
    process's own, its process count the layout's, whichever comes first, before or
    after the commit; neither alone completes it."""
    rng = random.Random(7)
    for case in range(300):
        n = rng.randint(1, 12)
        # an unknown end is a joiner's (it found no end in the store): it prepared nothing
        # beside training, so it has no stall
        ends = [None if rng.random() < 0.1 else 1003.0 + rng.random() / 2 for _ in range(n)]
        reports = [Resumed("j", 1, v, 7, 1004.0 + rng.random(), end,
                           stalled=rng.choice([0.0, rng.random()]) if end else 0.0)
                   for v, end in enumerate(ends)]
        each = PauseTracker()
        each.committed(1, "m", range(n), DECIDED)
        got_each = [x for r in reports for x in each.add(r)] or each.flush()
        together = _together(reports)
        assert 1 <= len(together) <= 2
        t = PauseTracker()
        if case % 2:
            t.committed(1, "m", range(n), DECIDED)
        done = [x for r in together for x in t.add(r)]
        if not case % 2:
            done = t.committed(1, "m", range(n), DECIDED)
        want = [(m, replace(p, processes=n)) for m, p in got_each]
        assert done == want, (case, reports)
    # the widest gap's report alone waits for the stall's (a plant that does not is caught)
    reports = [Resumed("j", 1, 0, 7, 1004.0, 1003.0, stalled=0.9),
               Resumed("j", 1, 1, 7, 1005.0, 1003.0)]
    first, second = _together(reports)
    t = PauseTracker()
    t.committed(1, "m", (0, 1), DECIDED)
    assert t.add(second if second.widest_of else first) == []
    ((_, p),) = t.add(first if second.widest_of else second)
    assert (p.vrank, p.seconds, p.stall_vrank, p.stall_seconds, p.processes) == \
        (1, 2.0, 0, 0.9, 2)


def test_resumed_travels_on_the_wire():
    r = _resumed(3, 1004.25, None, joined=True)
    assert REPORT_DECODER.decode(ENCODER.encode(r)) == r


def _migration(store, job="7"):
    create_job(store, job, name="n", owner_uid=1, owner_name="a", backend="local", at=T0)
    return record_migration_start(store, job, from_generation=0, to_generation=1,
                                  plan_digest="d", moved_bytes=10, kept_bytes=5,
                                  lower_bound_bytes=10, messages=1, rounds=1, at=T0)


def test_the_measured_pause_replaces_the_workers_timing_of_a_committed_migration(tmp_path):
    store = open_store(tmp_path / "etc.db")
    try:
        mid = _migration(store)
        with pytest.raises(RecordError, match="only a committed one"):
            record_migration_pause(store, mid, pause_seconds=1.0, paused_at=T0,
                                   resumed_at=T0, preparation_seconds=0.0, processes=1)
        record_migration_finish(store, mid, outcome="committed", measured_seconds=4.0,
                                pause_seconds=0.8, data_seconds=0.3, at=T0)
        (m,) = job_detail(store, "7").migrations
        assert (m.pause_seconds, m.data_seconds, m.pause_measured) == (0.8, 0.3, False)
        resumed = T0 + timedelta(seconds=1.25)
        record_migration_pause(store, mid, pause_seconds=1.25, paused_at=T0,
                               resumed_at=resumed, preparation_seconds=3.5, processes=4,
                               stall_seconds=0.7)
        (m,) = job_detail(store, "7").migrations
        assert (m.pause_seconds, m.preparation_seconds, m.pause_processes) == (1.25, 3.5, 4)
        assert m.stall_seconds == 0.7
        assert (m.paused_at, m.resumed_at, m.pause_measured) == (T0, resumed, True)
        shown = job_detail(store, "7").to_json(now=T0)["migrations"][0]
        assert shown["pause_measured"] and shown["data_seconds"] == 0.3
        assert shown["paused_at"] == T0.isoformat() and shown["stall_seconds"] == 0.7
        for bad, says in [({"pause_seconds": -1.0}, "pause_seconds"),
                          ({"stall_seconds": float("inf")}, "stall_seconds"),
                          ({"processes": 0}, "processes"),
                          ({"resumed_at": T0 - timedelta(seconds=1)}, "before paused_at")]:
            kwargs = {"pause_seconds": 1.0, "paused_at": T0, "resumed_at": resumed,
                      "preparation_seconds": 0.0, "processes": 1, **bad}
            with pytest.raises(RecordError, match=says):
                record_migration_pause(store, mid, **kwargs)
        assert job_detail(store, "7").migrations[0].pause_seconds == 1.25
        with pytest.raises(RecordError, match="interrupted_seconds 2.0 exceeds the pause"):
            record_migration_pause(store, mid, pause_seconds=1.25, paused_at=T0,
                                   resumed_at=resumed, preparation_seconds=0.0, processes=2,
                                   interrupted_seconds=2.0)
        record_migration_pause(store, mid, pause_seconds=1.25, paused_at=T0,
                               resumed_at=resumed, preparation_seconds=0.0, processes=2,
                               interrupted_seconds=0.5)
        (m,) = job_detail(store, "7").migrations
        assert m.interrupted_seconds == 0.5 and m.pause_seconds == 1.25
        assert job_detail(store, "7").to_json(now=T0)["migrations"][0][
            "interrupted_seconds"] == 0.5
    finally:
        store.close()


def test_the_schema_refuses_a_pause_over_no_process(tmp_path):
    path = tmp_path / "etc.db"
    store = open_store(path)
    mid = _migration(store)
    store.close()
    with sqlite3.connect(path) as db, pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        db.execute("update migrations set pause_processes = 0 where id = ?", (mid,))
    with sqlite3.connect(path) as db, pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        db.execute("update migrations set pause_seconds = 0.5, interrupted_seconds = 0.6 "
                   "where id = ?", (mid,))


def test_a_record_from_before_the_columns_reads_as_not_measured_and_upgrades(tmp_path):
    from alembic import command

    from slurm_etc.store.db import alembic_config

    path = tmp_path / "old.db"
    command.upgrade(alembic_config(f"sqlite:///{path}"), "0003_lost_steps")
    with sqlite3.connect(path) as db:
        db.execute("insert into jobs (job_id, name, owner_uid, owner_name, state, backend, "
                   "created_at, updated_at) values ('7', 'n', 1, 'a', 'finished', 'local', "
                   "'2026-12-01 03:00:00', '2026-12-01 03:00:00')")
        db.execute("insert into migrations (job_id, from_generation, to_generation, "
                   "plan_digest, moved_bytes, kept_bytes, lower_bound_bytes, messages, "
                   "rounds, outcome, pause_seconds, started_at) values ('7', 0, 1, 'd', 1, 0, "
                   "1, 1, 1, 'committed', 0.5, '2026-12-01 03:00:00')")
    old = open_store_readonly(path)
    try:
        (m,) = job_detail(old, "7").migrations
        assert (m.pause_seconds, m.pause_measured, m.data_seconds) == (0.5, False, None)
        assert m.stall_seconds is None
    finally:
        old.close()
    store = open_store(path)
    try:
        (m,) = job_detail(store, "7").migrations
        assert (m.outcome, m.pause_seconds, m.paused_at) == ("committed", 0.5, None)
    finally:
        store.close()
