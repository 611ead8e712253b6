"""One poll's events recorded in one batch (``record_observed``: a few set-based statements)
leave the record exactly as recording them one at a time does (``record_allocation`` /
``update_allocation`` + ``record_event``, the per-row ORM path): allocations (state, nodes,
times), their devices' states, events (keys, order, payloads) and the ids handed back.
Both records are read back with plain sqlite3. The comparison is shown to catch a batch that
applies a poll's allocation changes out of order."""
from __future__ import annotations

import shutil
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_etc.alloc.topology import Device
from slurm_etc.store import jobs as record
from slurm_etc.store.jobs import ALLOCATION_STATES, Observed

JOB = "batch"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
AT = T0 + timedelta(seconds=5)
HELD = ("a0", "a1", "a2", "a3")            # granted before the poll, each with 2 held devices
NAMES = (*HELD, "a4", "a5")                # a4, a5 appear first in the poll


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A record with four granted allocations whose devices a generation holds, and one
    event already recorded (key ``k0``)."""
    db = tmp_path_factory.mktemp("tpl") / "job.db"
    store = record.open_job_store(JOB, db=db, publish=False)
    record.create_job(store, JOB, name="t", owner_uid=0, owner_name="t", backend="local", at=T0)
    devices = {}
    for i, name in enumerate(HELD):
        record.record_allocation(store, JOB, name, role="anchor" if i == 0 else "member",
                                 state="granted", nodes=[f"n{i}"], at=T0)
        devices.update({2 * i + k: Device(f"n{i}", k) for k in range(2)})
    record.open_generation(store, JOB, 0, "dp=8", sorted(devices), devices, at=T0)
    record.record_event(store, JOB, "grant", source="backend", key="k0", at=T0)
    store.close()
    return db


def _copy(template: Path, where: Path) -> Any:
    where.mkdir(parents=True, exist_ok=True)
    for f in where.iterdir():
        f.unlink()
    shutil.copy(template, where / "job.db")
    return record.open_job_store(JOB, db=where / "job.db", publish=False)


def one_at_a_time(store: Any, observed: list[Observed]) -> list[int]:
    """The oracle: each event through the single-row API, in order."""
    con_ids: dict[str, int] = {}
    known = {o.key for o in observed if o.key == "k0"}
    out = []
    for o in observed:
        if o.key not in known and o.allocation is not None:
            exists = _query(store, "SELECT count(*) FROM allocations WHERE backend_id = ?",
                            (o.allocation,))[0][0]
            if exists:
                record.update_allocation(store, JOB, o.allocation, state=o.state,
                                         nodes=o.nodes, at=AT)
            else:
                record.record_allocation(store, JOB, o.allocation, role=o.role,
                                         state=o.state or "requested", nodes=o.nodes or (),
                                         at=AT)
        known.add(o.key)
        eid = record.record_event(store, JOB, o.kind, source="backend", payload=o.payload,
                                  deadline=o.deadline, key=o.key, at=AT)
        con_ids.setdefault(o.key, eid)
        out.append(con_ids[o.key])
    return out


def _query(store: Any, sql: str, args: tuple = ()) -> list[tuple]:
    con = sqlite3.connect(f"file:{store.path}?mode=ro", uri=True)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def dump(store: Any) -> dict[str, list[tuple]]:
    """The record as plain rows (no ids except through the names they stand for)."""
    return {
        "allocations": _query(store, "SELECT backend_id, role, state, nodes, requested_at, "
                                     "granted_at, lost_at, released_at FROM allocations "
                                     "ORDER BY backend_id"),
        "devices": _query(store, "SELECT d.node, d.local_index, d.state, a.backend_id, "
                                 "d.updated_at FROM devices d LEFT JOIN allocations a ON "
                                 "a.id = d.allocation_id ORDER BY d.node, d.local_index"),
        "events": _query(store, "SELECT dedup_key, kind, source, payload, deadline, "
                                "received_at, handled_at FROM events ORDER BY id"),
    }


observed_events = st.lists(st.builds(
    Observed,
    kind=st.sampled_from(("grant", "preempt-notice", "loss", "request-failed")),
    key=st.sampled_from([f"k{i}" for i in range(12)]),
    payload=st.fixed_dictionaries({"n": st.integers(0, 9)}),
    deadline=st.none() | st.just(AT + timedelta(seconds=30)),
    allocation=st.none() | st.sampled_from(NAMES),
    state=st.none() | st.sampled_from(ALLOCATION_STATES),
    role=st.just("member"),
    nodes=st.none() | st.sampled_from([("n4",), ("n5",), ("n1", "n2")]),
), min_size=1, max_size=25)


def _check(template: Path, tmp: Path, observed: list[Observed]) -> None:
    batched, single = _copy(template, tmp / "batched"), _copy(template, tmp / "single")
    try:
        ids_batched = record.record_observed(batched, JOB, observed, at=AT)
        ids_single = one_at_a_time(single, observed)
        assert dump(batched) == dump(single)
        # ids name the same events (each record numbers its own rows the same way)
        assert ids_batched == ids_single
    finally:
        batched.close()
        single.close()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(observed=observed_events)
def test_a_batch_records_what_one_at_a_time_records(template: Path, tmp_path: Path,
                                                    observed: list[Observed]) -> None:
    _check(template, tmp_path, observed)


# A poll that takes an allocation through lost and released and gives another its nodes:
# the devices end lost (the first change that frees them), times set once, nodes changed.
KNOWN = [Observed("preempt-notice", "k1", {}, AT, "a1", "preempting"),
         Observed("loss", "k2", {}, None, "a1", "lost"),
         Observed("grant", "k3", {}, None, "a4", "granted", nodes=("n4",)),
         Observed("loss", "k1", {}, None, "a2", "lost"),     # key seen in this poll: dropped
         Observed("grant", "k0", {}, None, "a3", "released"),  # key recorded before: dropped
         Observed("release", "k4", {}, None, "a1", "released"),
         Observed("grant", "k5", {}, None, "a2", None, nodes=("n1", "n2"))]


def test_known_poll(template: Path, tmp_path: Path) -> None:
    _check(template, tmp_path, KNOWN)
    store = _copy(template, tmp_path / "again")
    try:
        ids = record.record_observed(store, JOB, KNOWN, at=AT)
        assert ids[3] == ids[0] and ids[4] == 1  # k1 twice: one row; k0: the old row
        rows = dict((r[0], r[2:4]) for r in dump(store)["allocations"])
        assert rows["a1"] == ("released", "n1") and rows["a2"] == ("granted", "n1,n2")
        assert rows["a4"] == ("granted", "n4")
        states = {(n, k): s for n, k, s, _a, _t in dump(store)["devices"]}
        assert states[("n1", 0)] == states[("n1", 1)] == "lost"
        assert states[("n3", 0)] == "held"  # k0's change was not applied
    finally:
        store.close()


def test_comparison_catches_out_of_order_changes(template: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the batch applies a poll's allocation changes last-first."""
    real = record._apply_allocation_changes
    monkeypatch.setattr(record, "_apply_allocation_changes",
                        lambda s, job, obs, at: real(s, job, list(reversed(obs)), at))
    with pytest.raises(AssertionError):
        _check(template, tmp_path, KNOWN)
