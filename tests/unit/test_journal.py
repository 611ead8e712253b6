"""The coordinator's journal of record writes (coordinator/journal.py) over a store that can
be made to fail like a full disk: writes keep their order behind the first failure, values
of queued writes reach the writes that use them, progress coalesces, one warning per outage,
and a refusal of the record (RecordError) is raised as before."""
from __future__ import annotations

import logging

import pytest

from slurm_etc.coordinator.journal import Deferred, Journal
from slurm_etc.store import jobs as record
from slurm_etc.store.db import StoreError


class Disk:
    """Stands in for the store: ``full`` makes every write fail as SQLite does."""

    def __init__(self) -> None:
        self.full = False
        self.log: list[tuple] = []


def writer(name: str, value=None):
    def fn(disk: Disk, *args, **kwargs):
        if disk.full:
            raise StoreError("job.db: database or disk is full")
        disk.log.append((name, args, kwargs))
        return value
    fn.__name__ = name
    return fn


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_order_values_and_one_warning_per_outage(caplog, monkeypatch):
    disk, clock = Disk(), Clock()
    j = Journal(disk, clock=clock)
    observe, handle = writer("observe", [7, 8]), writer("handle")
    migration = writer("migration_start", 42)
    monkeypatch.setattr(record, "record_progress", writer("progress"))
    caplog.set_level(logging.WARNING)
    assert j.write(observe, "job") == [7, 8]  # written at once while there is room
    disk.full = True
    ids = j.write(observe, "job")
    assert isinstance(ids, Deferred) and not ids.done and j.behind == 1
    mid = j.write(migration, "job")
    for step in range(1, 200):  # a step each: they coalesce into one write
        j.write(record.record_progress, "job", 3, last_step=step)
    j.write(handle, [1, ids], "decided")
    j.write(writer("finish"), mid, outcome="committed")
    assert j.behind == 5
    for _ in range(5):
        clock.t += 20
        j.retry()  # still full: nothing lost, nothing reordered
    assert j.behind == 5 and len(disk.log) == 1
    disk.full = False
    clock.t += 20
    j.retry()
    assert j.behind == 0
    assert [e[0] for e in disk.log] == ["observe", "observe", "migration_start", "progress",
                                        "handle", "finish"]
    assert disk.log[3][2] == {"last_step": 199}
    assert disk.log[4][1] == ([1, 7, 8], "decided")  # the queued ids, spliced in
    assert disk.log[5][1] == (42,)
    warnings = [r.getMessage() for r in caplog.records]
    assert len([m for m in warnings if "cannot be written" in m]) == 1, warnings
    assert len([m for m in warnings if "caught up" in m]) == 1, warnings
    assert j.write(writer("later", 5)) == 5  # direct again
    # a value that waited, handed to a write made once the record caught up, is the value
    # (it was bound as a Deferred, failed, and started an outage of its own)
    j.write(writer("handle again"), mid, ids)
    assert disk.log[-1][1] == (42, [7, 8]) and j.behind == 0 and j.outages == 1


def test_a_decision_waiting_for_the_record_retries_it_every_half_second():
    disk, clock = Disk(), Clock()
    j = Journal(disk, clock=clock)
    disk.full = True
    j.write(writer("observe"), "job")
    for _ in range(6):  # the backoff grows: 0.5, 1, 2, 4, 8 s
        clock.t += 100
        j.retry()
    disk.full = False
    clock.t += 0.6
    j.retry()
    assert j.behind == 1  # the backoff's 10 s
    j.retry(hurry=True)
    assert j.behind == 0


def test_a_refusal_is_raised_not_queued():
    disk = Disk()
    j = Journal(disk)

    def refuse(_disk):
        raise record.RecordError("job j exists already, owned by uid 1")

    with pytest.raises(record.RecordError):
        j.write(refuse)
    assert j.behind == 0


def test_catch_up_at_the_end_gives_up_with_one_line(caplog):
    disk, clock = Disk(), Clock()
    j = Journal(disk, clock=clock)
    disk.full = True
    j.write(writer("state"), "finished")
    caplog.set_level(logging.ERROR)
    assert j.catch_up(0.0) is False
    assert any("ends without them" in r.getMessage() for r in caplog.records)


def test_what_waits_is_bounded(caplog):
    disk = Disk()
    j = Journal(disk)
    j.max_behind = 10
    disk.full = True
    caplog.set_level(logging.ERROR)
    for i in range(50):
        j.write(writer(f"event{i}"), i)
    assert j.behind == 10 and j.dropped == 40
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1
