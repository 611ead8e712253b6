"""A node request restored from the record (open at a coordinator restart) is checked again
against the job's policy and the cluster's size before it is sent again: one that the policy
or the cluster refuses (e.g. 999,999 nodes planted in a snapshot) is dropped with one log
line and recorded as failed, so no later restart sends it either; one that fits is sent
again under its own key, as before. A real Coordinator and SQLite record; the recording
backend (tests/unit/conftest.py) notes what it is asked."""
from __future__ import annotations

import logging

import pytest

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.alloc.topology import ClusterTopology
from slurm_etc.coordinator import restart
from slurm_etc.plan.model import PRESETS
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.store import jobs as record
from tests.unit.coordinator_harness import coordinator_over

TOPOLOGY = ClusterTopology(2, tuple(f"n{i}" for i in range(4)))


@pytest.mark.parametrize("nodes,policy,refused", [
    (999_999, EffectivePolicy(grow=True, max_nodes=4), "policy"),
    (999_999, EffectivePolicy(grow=True), "cluster"),
    (2, EffectivePolicy(grow=False), "policy"),
    (2, EffectivePolicy(grow=True, max_nodes=4), None),
])
def test_a_restored_request_is_checked_before_it_is_sent(tmp_path, caplog, nodes, policy,
                                                          refused, recording_backend):
    backend = recording_backend(TOPOLOGY)
    job = "restored"
    with coordinator_over(tmp_path, job, backend, training=TrainingJob(PRESETS["tiny"], 8, 1,
                                                                       False),
                          policy=policy, hardware=Hardware(gpus_per_node=2),
                          backend_name="local") as (coordinator, _db):
        # what a planted or stale snapshot holds: a request recorded and never answered
        record.record_event(coordinator.io.store, job, "request", source="coordinator",
                            key="request:grow-1", payload={"nodes": nodes, "summary": "x"})
        caplog.set_level(logging.INFO)
        restart.recover(coordinator)
        detail = record.job_detail(coordinator.io.store, job)
    assert detail is not None
    failed = [e for e in detail.events if e.kind == "request-failed"]
    if refused is None:
        assert [(a.nodes, a.key) for a in backend.requested] == [(nodes, "grow-1")]
        assert coordinator.request.growing == nodes and failed == []
        return
    assert backend.requested == [] and coordinator.request.growing == 0
    assert len(failed) == 1 and failed[0].payload["request"] == "grow-1", failed
    lines = [r.getMessage() for r in caplog.records if "grow-1" in r.getMessage()]
    assert len(lines) == 1 and "dropped" in lines[0] and refused in lines[0], lines
