"""The coordinator and a request that ends without a grant (RequestFailed): the job stops
"growing" and asks again on its next decision; an older request's failure changes nothing.
Real coordinator, real SQLite record; the backend is the recording one of
tests/unit/conftest.py (the Slurm backend's side is tests/unit/test_slurm_backend_fake.py)."""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.alloc.topology import ClusterTopology
from slurm_etc.coordinator import observe
from slurm_etc.coordinator.backend import RequestFailed
from slurm_etc.plan import load_model
from slurm_etc.policy.rules import EffectivePolicy
from tests.unit.coordinator_harness import coordinator_over

JOB = "reqfail"


@pytest.fixture
def coordinator(tmp_path: Path, recording_backend: Any) -> Any:
    stub = recording_backend(ClusterTopology(2, ("n1", "n2", "n3")))
    with coordinator_over(tmp_path, JOB, stub,
                          training=TrainingJob(load_model("tiny"), 8, 1, False),
                          policy=EffectivePolicy(grow=True, max_nodes=3),
                          hardware=Hardware(gpus_per_node=2), backend_name="slurm") as (c, db):
        yield c, stub, db


def test_failed_request_resets_growing(coordinator: Any) -> None:
    c, stub, db = coordinator
    c.request.count, c.request.growing = 2, 1  # grow-2 is pending
    stub.pending = [RequestFailed("grow-1", "99", "CANCELLED")]  # an older one: no change
    observe.observe_backend(c)
    assert c.request.growing == 1
    stub.pending = [RequestFailed("grow-2", "100", "CANCELLED")]
    observe.observe_backend(c)
    assert c.request.growing == 0 and c.phase.dirty
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        kinds = [k for (k,) in con.execute(
            "SELECT kind FROM events WHERE job_id = ? ORDER BY id", (JOB,))]
    finally:
        con.close()
    assert kinds == ["request-failed", "request-failed"], kinds


def test_backend_refusing_an_action_fails_the_job_in_one_line(coordinator: Any, caplog) -> None:
    """A BackendError from an action (e.g. a launch the backend cannot do) ends the job as
    failed with one logged line, the record closed, no traceback out of run()."""
    from slurm_etc.alloc.topology import Device
    from slurm_etc.coordinator.backend import BackendError, Grant

    c, stub, db = coordinator

    def refuse(action: Any) -> None:
        raise BackendError("launch of vrank 0 on n1:0: refused")
    stub.launch = refuse
    stub.pending = [Grant("a0", (Device("n1", 0), Device("n1", 1)))]
    assert c.run(deadline_s=30) == "failed"
    assert "refused" in caplog.text
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        (state,) = con.execute("SELECT state FROM jobs WHERE job_id = ?", (JOB,)).fetchone()
    finally:
        con.close()
    assert state == "failed"
