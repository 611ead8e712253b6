"""Record, then act: every backend action the coordinator takes that a restarted coordinator
must know of is preceded by the record that allows it. A real Coordinator (SQLite record,
control channel) over a backend that logs its actions into the same ledger as the
coordinator's record writes, driven through a scenario: the first layout launched, a node
request, its withdrawal and a smaller one, a grow whose joiners launch, devices given back.
The checker shares no code with the coordinator, and is shown to catch an act before its
record."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from slurm_etc.alloc.chooser import TrainingJob
from slurm_etc.alloc.topology import ClusterTopology, Device
from slurm_etc.coordinator import deciding, observe
from slurm_etc.coordinator.backend import Grant
from slurm_etc.local.demo import DEMO_HARDWARE
from slurm_etc.plan.model import PRESETS
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.protocol.messages import Progress
from slurm_etc.store import jobs as record

from .coordinator_harness import RecordingBackend, coordinator_over

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TOPO = ClusterTopology(2, ("n0", "n1", "n2"))
N0, N1, N2 = ((Device(n, 0), Device(n, 1)) for n in ("n0", "n1", "n2"))


class Ledger(RecordingBackend):
    """A recording backend that also writes each action into ``log``, the list the
    coordinator's record writes go to (:func:`_log_records`)."""

    def __init__(self) -> None:
        super().__init__(TOPO)
        self.log: list[tuple[str, str, Any]] = []

    def launch(self, action: Any) -> None:
        self.log.append(("act", "launch", action.generation))
        super().launch(action)

    def release(self, action: Any) -> None:
        self.log.append(("act", "release", frozenset(action.devices)))
        super().release(action)

    def request(self, action: Any) -> None:
        self.log.append(("act", "request", action.key))
        super().request(action)

    def cancel_request(self, action: Any) -> None:
        self.log.append(("act", "withdraw", action.key))
        super().cancel_request(action)


def _log_records(c: Any, log: list[tuple[str, str, Any]]) -> None:
    """Each record write of ``c`` goes into ``log`` first, named by what it holds."""
    write = c.io.journal.write

    def logged(fn: Any, *args: Any, **kw: Any) -> Any:
        if fn is record.open_generation:
            log.append(("record", "generation opened", args[1]))
        elif fn is record.record_migration_start:
            log.append(("record", "migration into", kw["to_generation"]))
        elif fn is record.set_device_state and args[2] == "released":
            log.append(("record", "released", frozenset(args[1])))
        elif fn is record.record_event and args[1] in ("request", "request-withdrawn"):
            log.append(("record", args[1], kw["key"].split(":", 1)[1]))
        return write(fn, *args, **kw)

    c.io.journal.write = logged


# what each action needs recorded before it: a launch, its generation opened (the first
# layout) or the migration into it (a resize's joiners); a request, a withdrawal and a
# release, their own record
ALLOWS = {"launch": ("generation opened", "migration into"), "request": ("request",),
          "withdraw": ("request-withdrawn",), "release": ("released",)}


def unrecorded(log: list[tuple[str, str, Any]]) -> list[tuple[str, Any]]:
    """The actions in ``log`` with no record allowing them before them."""
    seen: set[tuple[str, Any]] = set()
    bad = []
    for kind, what, key in log:
        if kind == "record":
            seen.add((what, key))
        elif not any((r, key) in seen for r in ALLOWS[what]):
            bad.append((what, key))
    return bad


def test_the_checker_catches_an_act_before_its_record() -> None:
    good = [("record", "generation opened", 0), ("act", "launch", 0),
            ("record", "request", "grow-1"), ("act", "request", "grow-1")]
    assert unrecorded(good) == []
    assert unrecorded([good[1], good[0]]) == [("launch", 0)]
    assert unrecorded([("record", "request", "grow-1"), ("act", "withdraw", "grow-1")]) == \
        [("withdraw", "grow-1")]  # a request's record does not allow its withdrawal
    assert unrecorded([("record", "released", frozenset(N1)),
                       ("act", "release", frozenset(N2))]) == [("release", frozenset(N2))]


def _step(c: Any, step: int) -> None:
    observe.progress(c, Progress("record-then-act", c.generation, 0, step, 5.0, 1e-3, step * 8,
                                 str(c.layout.config), time.time() - 1, time.time()))


def test_every_action_follows_the_record_that_allows_it(tmp_path: Path) -> None:
    backend = Ledger()
    with coordinator_over(tmp_path, "record-then-act", backend,
                          training=TrainingJob(PRESETS["tiny"], 8, 1, False),
                          policy=EffectivePolicy(grow=True, max_nodes=3),
                          hardware=DEMO_HARDWARE, backend_name="local") as (c, _db):
        _log_records(c, backend.log)
        backend.pending = [Grant("a0", N0)]
        observe.observe_backend(c)
        deciding.decide_now(c)  # the first layout, and a request for more
        assert backend.launched and backend.requested, backend.log
        c.request.partition_nodes = 1  # the other nodes of the partition went DOWN
        deciding.decide_now(c)  # withdrawn
        assert backend.withdrawn, backend.log
        c.request.partition_nodes = 3
        _step(c, 3)
        backend.pending = [Grant("a1", N1, request=c.request.key)]
        observe.observe_backend(c)
        deciding.decide_now(c)  # a grow: its joiners launch
        assert c.resize.inflight is not None and len(backend.launched) == 2, backend.log
        c.resize.inflight = None  # (its settlement is reconcile's; tested there)
        c.resize.release_later |= set(N2)
        c.holdings = replace(c.holdings, held={**c.held, **{d: "a2" for d in N2}})
        deciding.release_now(c)
        assert backend.released, backend.log
    assert unrecorded(backend.log) == [], backend.log


def test_a_withdrawn_request_is_not_sent_again_at_a_restart(tmp_path: Path) -> None:
    """The withdrawal answers its request in the record: a coordinator killed after it (and
    before a smaller request) restarts with no request open, where it sent the withdrawn one
    again."""
    with coordinator_over(tmp_path, "withdrawn", Ledger(),
                          training=TrainingJob(PRESETS["tiny"], 8, 1, False),
                          policy=EffectivePolicy(grow=True, max_nodes=3),
                          hardware=DEMO_HARDWARE, backend_name="local") as (c, _db):
        store = c.io.store
        record.record_event(store, "withdrawn", "request", source="coordinator",
                            key="request:grow-1", payload={"nodes": 2, "summary": "more"})
        assert record.recover(store, "withdrawn").open_request is not None
        record.record_event(store, "withdrawn", "request-withdrawn", source="coordinator",
                            key="withdraw:grow-1",
                            payload={"nodes": 2, "request": "grow-1", "summary": "fewer"})
        assert record.recover(store, "withdrawn").open_request is None
