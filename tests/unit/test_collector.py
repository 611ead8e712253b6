"""Python's garbage collector is held off in the pause, and put back as it was afterwards."""
from __future__ import annotations

import dataclasses
import gc
import threading

import pytest

from slurm_etc.migrate import executor
from slurm_etc.migrate.collector import collector_paused
from slurm_etc.migrate.executor import MigrationOptions
from slurm_etc.migrate.threads import run_threads
from slurm_etc.plan import PRESETS
from slurm_etc.testing.fake_state import fake_shards, shard_mismatches
from tests.unit.plan_helpers import make_plan


@pytest.fixture(autouse=True)
def _collector_on():
    gc.enable()
    yield
    gc.enable()


def test_off_inside_back_on_after_even_on_error():
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError):
        with collector_paused():
            raise KeyError("x")
    assert gc.isenabled()


def test_nested_stays_off_until_the_outermost_exit():
    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_left_off_when_it_was_off_before():
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_threads_overlapping_in_any_order():
    """A enters, B enters, A leaves (still off: B is inside), B leaves (on again)."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with collector_paused():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with collector_paused():
            b_in.set()
            a_out.wait(5)
            seen["after A left"] = gc.isenabled()

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after A left": False}
    assert gc.isenabled()


def test_the_data_phase_runs_without_the_collector(monkeypatch):
    """Every rank's local copies (inside the data phase) see the collector off; the
    migration commits and the collector is on again afterwards."""
    model = dataclasses.replace(PRESETS["tiny"], param_dtype="bf16")
    plan = make_plan(model, (1, 2, 2), (2, 1, 2))
    seen = []
    copies = executor._Run.local_copies

    def spy(run):
        seen.append(gc.isenabled())
        return copies(run)

    monkeypatch.setattr(executor._Run, "local_copies", spy)
    old = {d: fake_shards(plan, r) for r, d in enumerate(plan.old.devices)}
    results = run_threads(plan, old, options=MigrationOptions(measure_memory=False,
                                                              timeout_s=20))
    for res in results.values():
        assert not isinstance(res, BaseException), res
        if res.new_rank is not None:
            assert shard_mismatches(plan, res.new_rank, res.new_shards) == []
    assert seen and not any(seen)
    assert gc.isenabled()
