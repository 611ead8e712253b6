"""``slurm-etc soak``'s pure parts: the schedule drawn from a seed, and every check shown to
catch its planted bug (slurm_etc/testing/soak_plants.py) on made-up records; the CLI's bad
input. The soak of a real job: tests/dist/test_soak.py."""
from __future__ import annotations

import os
import signal
import time

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.harness.soak import MARK, job_processes, lease_released
from slurm_etc.harness.soak_checks import (
    GenerationSeen,
    MigrationSeen,
    RecordSeen,
    diverged_steps,
    final_history,
    final_losses,
    judge,
    record_problems,
)
from slurm_etc.harness.soak_schedule import KINDS, SCRIPT_KINDS, draw_schedule
from slurm_etc.local.script import script_from_dict
from slurm_etc.migrate.faults import KillSchedule, KillSpec
from slurm_etc.testing import soak_plants as plant
from slurm_etc.testing.hooks import kill_spec_from_env

pytestmark = pytest.mark.unit


# -- the schedule ---------------------------------------------------------------------------

def test_the_same_seed_draws_the_same_schedule():
    assert draw_schedule(7, 40) == draw_schedule(7, 40)
    assert draw_schedule(7, 40).to_json() == draw_schedule(7, 40).to_json()
    assert draw_schedule(7, 40) != draw_schedule(8, 40)
    assert len(draw_schedule(7, 40).events) == 40


def test_every_kind_is_drawn_over_seeds_and_the_schedule_is_playable():
    seen = set()
    for seed in range(30):
        s = draw_schedule(seed, 30)
        seen |= {e.kind for e in s.events}
        assert s.events[0].kind == "grant" and s.events[-1].kind in SCRIPT_KINDS
        steps = [e.at_step for e in s.script_events]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
        gens = [e.generation for e in s.phase_kills]
        assert len(set(gens)) == len(gens) and all(g >= 1 for g in gens)
        # the local backend accepts its script (strictly: every event can be carried out
        # if the job holds what the schedule expects)
        script = script_from_dict(s.script(), f"<seed {seed}>")
        assert len(script.events) == len(s.script_events)
        assert script.end_step == s.end_step
        # the phase kills parse as the trainer's kill hook reads them
        if s.phase_kills:
            spec = kill_spec_from_env({"SLURM_ETC_INJECT": s.kill_specs()})
            assert spec is not None
    assert seen == set(KINDS)
    graces = {e.grace_s for seed in range(30) for e in draw_schedule(seed, 30).events
              if e.kind == "preempt"}
    assert 0.0 in graces and max(graces) >= 60.0  # no notice at all, and minutes


def test_without_a_filesystem_of_its_own_no_full_disk_is_drawn():
    for seed in range(20):
        s, full = draw_schedule(seed, 30, full_disk=False), draw_schedule(seed, 30)
        assert "full-disk" not in {e.kind for e in s.events}
        assert s.notes
        # the same schedule, a duplicate coordinator where the disk would fill
        assert [e.kind for e in s.events] == [
            "duplicate" if e.kind == "full-disk" else e.kind for e in full.events]


def test_held_nodes_stay_within_bounds():
    """A grant while the job holds the anchor alone, a loss or preemption while it holds
    the most: the cluster's nodes are never short of a scripted event."""
    for seed in range(30):
        held = 1
        for e in draw_schedule(seed, 50).script_events:
            held += 1 if e.kind == "grant" else -1
            assert 1 <= held <= 3, (seed, e)


def test_bad_event_counts_are_refused():
    with pytest.raises(ValueError, match="at least 1 event"):
        draw_schedule(1, 0)


def test_several_kill_specs_arm_each_its_generation():
    spec = KillSpec.parse_many("before-send@,2;after-commit@3,4")
    assert isinstance(spec, KillSchedule)
    assert spec.specs == (KillSpec("before-send", None, 2), KillSpec("after-commit", 3, 4))
    assert KillSpec.parse_many("in-vote@,5") == KillSpec("in-vote", None, 5)

    class Plan:  # what KillSpec.victim reads of a plan
        participants = (0, 1, 2, 3)

        class messages:  # noqa: N801 -- the plan's attribute
            src = (0, 1)
            dst = (2, 3)

    assert spec.injector(Plan(), 3, 4).kills == ((3, "after-commit"),)
    assert spec.injector(Plan(), 1, 2).kills == ((1, "before-send"),)  # highest sender
    assert spec.injector(Plan(), 3, 2).kills == ()
    assert spec.injector(Plan(), 3, 3).kills == ()


# -- the checks, each against its plant -----------------------------------------------------

def _record(**kw) -> RecordSeen:
    """A job grown at step 10 (0 -> 2, the resize to 1 aborted), a node lost at step 20
    with steps 19-20 rebuilt and trained again in generation 3, finished at 30."""
    gens = (GenerationSeen(0, "dp=1,tp=1,pp=1", 0, 10), GenerationSeen(2, "dp=2,tp=1,pp=1", 10, 20),
            GenerationSeen(3, "dp=1,tp=1,pp=1", 18, 30))
    migs = (MigrationSeen(1, 0, 1, "aborted"), MigrationSeen(2, 0, 2, "committed"),
            MigrationSeen(3, 2, 3, "committed", (19, 20)))
    return RecordSeen(**{"state": "finished", "generations": gens, "migrations": migs, **kw})


def test_a_sound_record_passes_every_check():
    r = _record()
    h = final_history(r)
    assert h.twice == () and h.missing == () and h.last == 30
    assert h.segments == ((0, "dp=1,tp=1,pp=1", 1, 10), (2, "dp=2,tp=1,pp=1", 11, 18),
                          (3, "dp=1,tp=1,pp=1", 19, 30))
    assert record_problems(r) == []
    heard = [(s, 1.0 / s) for s in range(1, 31)]
    v = judge(r, heard, {s: 1.0 / s for s in range(1, 31)}, [])
    assert v.ok, v


def test_a_step_trained_twice_unrecorded_is_caught():
    assert final_history(plant.step_twice(_record())).twice == (10,)
    # the same rollback with its lost steps recorded is no bug; without them it is
    r = _record()
    unrecorded = RecordSeen(r.state, r.generations, r.migrations[:2]
                            + (MigrationSeen(3, 2, 3, "committed"),))
    assert final_history(unrecorded).twice == (19, 20)


def test_a_rollback_into_a_generation_that_trained_nothing_holds_for_the_next():
    # soak seed 102: steps 81-94 rebuilt from the checkpoint of step 80 into generation 9,
    # which resized to 10 before its first step; 10 trained them again: no step twice
    gens = (GenerationSeen(6, "dp=2,tp=2,pp=1", 0, 84), GenerationSeen(7, "dp=1,tp=2,pp=1", 84, 94),
            GenerationSeen(9, "dp=4,tp=1,pp=1", 80, 80),
            GenerationSeen(10, "dp=2,tp=1,pp=1", 80, 103))
    migs = (MigrationSeen(7, 6, 7, "committed"), MigrationSeen(9, 7, 9, "committed", (81, 94)),
            MigrationSeen(10, 9, 10, "committed"))
    h = final_history(RecordSeen("finished", gens, migs))
    assert h.twice == () and h.missing == () and h.last == 103
    # without the rollback recorded, the same steps are caught
    unrecorded = (migs[0], MigrationSeen(9, 7, 9, "committed"), migs[2])
    h = final_history(RecordSeen("finished", gens, unrecorded))
    assert h.twice == tuple(range(81, 95))


def test_a_step_never_trained_is_caught():
    h = final_history(plant.step_skipped(_record()))
    assert h.missing == (11,)
    assert not judge(plant.step_skipped(_record()), [], {}, []).ok


def test_a_loss_one_ulp_off_is_caught():
    heard = [(s, 1.0 / s) for s in range(1, 31)] + [(19, 0.5)]  # 19 trained again: 0.5 last
    oracle = {s: 1.0 / s for s in range(1, 31)} | {19: 0.5}
    assert diverged_steps(final_losses(heard), oracle) == []
    assert diverged_steps(final_losses(plant.loss_off_by_one_ulp(heard, 19)), oracle) == [19]
    assert diverged_steps(final_losses(plant.loss_off_by_one_ulp(heard, 30)), oracle) == [30]
    # by default the last loss heard: the replay of 19
    assert diverged_steps(final_losses(plant.loss_off_by_one_ulp(heard)), oracle) == [19]
    assert diverged_steps({3: float("nan")}, {3: float("nan")}) == [3]  # a NaN diverges
    assert diverged_steps({3: 1.0}, {}) == [3]  # a step the oracle never trained
    assert not judge(_record(), plant.loss_off_by_one_ulp(heard, 19), oracle, []).ok


def test_a_migration_left_open_is_caught():
    problems = record_problems(plant.migration_left_open(_record()))
    assert "migration 3 (2 -> 3) is left open" in problems, problems


def test_other_inconsistencies_are_caught():
    assert record_problems(plant.lease_kept(_record())) == ["the job's lease is still held"]
    assert record_problems(_record(state="failed")) == ["the job ended 'failed', not 'finished'"]
    r = _record()
    twice_in = RecordSeen(r.state, r.generations, r.migrations
                          + (MigrationSeen(4, 0, 3, "committed"),))
    assert "generation 3 was entered by 2 committed migration(s), not 1" in \
        record_problems(twice_in)
    from dataclasses import replace
    still_open = replace(r, generations=r.generations[:2]
                         + (replace(r.generations[2], closed=False),))
    assert record_problems(still_open) == ["generation 3 is still open"]


def test_a_leftover_process_is_caught_and_the_lease_read_directly(tmp_path):
    job = f"plant-{os.getpid()}"
    assert job_processes(job) == []
    proc = plant.leftover_process(job, MARK)
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in job_processes(job):
            assert time.monotonic() < deadline, "the planted process is not found"
            time.sleep(0.05)
        assert not judge(_record(), [], {}, job_processes(job)).ok
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert job_processes(job) == []
    # the lease: free without a file, held while someone holds the flock
    import fcntl

    db = tmp_path / "job.db"
    assert lease_released(db)
    fd = os.open(str(db) + ".lease", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # flock is per open file description: a second one of this process is refused too
        assert not lease_released(db)
    finally:
        os.close(fd)
    assert lease_released(db)


# -- the command's input --------------------------------------------------------------------

@pytest.mark.parametrize("args,says", [
    (["--events", "-1"], "--events"), (["--events", "0"], "--events"),
    (["--events", "10001"], "--events"), (["--seed", "-3"], "--seed"),
    (["--seed", "x"], "--seed"), (["--events", "nan"], "--events"),
])
def test_bad_input_is_one_line_exit_2(args, says):
    got = CliRunner().invoke(cli, ["soak", *args])
    assert got.exit_code == 2, got.output
    lines = [ln for ln in got.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], got.output


def test_the_disk_is_filled_and_freed_again(tmp_path):
    """The full-disk window's ballast fills a small filesystem and can be written again once
    freed (a buffered write raised at close on the last chunk and left the disk full: seeds
    104 and 208 of the long soak)."""
    import subprocess

    from slurm_etc.harness.soak import fill, listing

    where = tmp_path / "fs"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if got.returncode != 0:
        pytest.fail(f"cannot mount a 1 MiB tmpfs as root: {got.stderr.strip()}")
    try:
        for _ in range(2):
            ballast = fill(where)
            assert ballast.stat().st_size == 1 << 20
            assert "ballast 1,048,576 B" in listing(where)
            ballast.unlink()
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_window_ends_once_a_decision_waits_for_the_record(tmp_path, monkeypatch):
    """Record, then act: on a full disk a decision (a loss's resize) waits for the record,
    so training cannot go on the window's steps; the window ends RECORD_HOLD_S after the
    coordinator said so in its log (only what it logged after the window began counts)."""
    from slurm_etc.coordinator.deciding import HELD_FOR_RECORD
    from slurm_etc.harness import soak

    log = tmp_path / "coordinator-1.log"
    log.write_text(f"01:00 WARNING {HELD_FOR_RECORD} (an earlier window)\n")
    monkeypatch.setattr(soak, "RECORD_HOLD_S", 0.2)
    held = soak._HeldForRecord(log)
    assert not held()  # said before this window began
    with open(log, "a") as f:
        f.write("01:01 INFO event: loss 2 devices (failure)\n")
    assert not held()
    with open(log, "a") as f:
        f.write(f"01:02 WARNING {HELD_FOR_RECORD} (3 write(s) behind)\n")
    assert not held()  # said, not yet for RECORD_HOLD_S
    time.sleep(0.25)
    assert held()
