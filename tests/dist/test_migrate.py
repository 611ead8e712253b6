"""The executor across 8 real gloo processes: grow, shrink, reshapes, chunking, aborts, timeouts.

One pool of 8 worker processes serves the whole module (device id = pool rank). Each case
builds fake old state from seeded global values on every old rank, runs the plan with
``execute_migration`` over a migration group of old ∪ new processes, and checks on every
rank that each new shard equals the slice of the global tensors (bit for bit) and that the
old shards did not change. Failure cases inject a fault on one rank (or stall one rank's
sends, so its peer times out) and check that every participant aborts with an error naming
the failing rank, and keeps its old state.
"""
from __future__ import annotations

import pytest

from slurm_etc.migrate.faults import FaultInjector
from tests.dist.harness import pool_fixture
from tests.dist.migrate_helpers import Case, make_plan, run_case

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

pool8 = pool_fixture(8, preload=("slurm_etc.migrate.executor", "slurm_etc.plan"))

# (old dp, tp, pp) -> (new dp, tp, pp), devices the new layout may use (None: the planner's
# default pool); gpus_per_node = 4, old layouts on devices 0..world-1
TRANSITIONS = {
    "grow-4to8": ((1, 2, 2), (2, 2, 2), None),
    "grow-4to8-tp": ((4, 1, 1), (2, 2, 2), None),
    "shrink-8to4": ((2, 2, 2), (2, 1, 2), None),
    "shrink-8to4-keep-node1": ((2, 2, 2), (1, 2, 2), (4, 5, 6, 7)),
    "reshape-4-pp": ((2, 2, 1), (1, 2, 2), None),
    "reshape-4-tp": ((4, 1, 1), (1, 4, 1), None),
    "reshape-8": ((2, 2, 2), (1, 4, 2), None),
    "move-4-to-other-node": ((2, 2, 1), (1, 2, 2), (4, 5, 6, 7)),
}
MODELS = [("tiny", "fp32"), ("tiny", "bf16"), ("tiny-llama", "fp32"), ("tiny-llama", "bf16")]

CASES = [Case(model, old, new, dist, dtype, pool=pool)
         for (old, new, pool) in TRANSITIONS.values()
         for model, dtype in MODELS
         for dist in (False, True)]
IDS = [f"{name}-{model}-{dtype}{'-distopt' if dist else ''}"
       for name in TRANSITIONS for model, dtype in MODELS for dist in (False, True)]

SHRINK = Case("tiny", (2, 2, 2), (2, 1, 2), True, "bf16")


def _participants(results):
    return [r for r in results if r is not None]


def _check_committed(case: Case, results) -> None:
    plan = make_plan(case)
    parts = _participants(results)
    assert len(parts) == len(set(plan.old.devices) | set(plan.new.devices))
    for r in parts:
        assert not r["aborted"], r["message"]
        assert r["mismatches"] == [], f"rank {r['rank']}: {r['mismatches']}"
        assert r["old_unchanged"] and r["old_mismatches"] == [], r["rank"]
        assert r["departing"] == (r["rank"] not in plan.new.devices)
        assert r["departing"] == (r["new_shards"] == 0)
    sent = sum(r["stats"]["sent_bytes"] for r in parts)
    received = sum(r["stats"]["received_bytes"] for r in parts)
    assert sent == received == plan.moved_bytes


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_new_shard_is_the_global_slice(pool8, case):
    _check_committed(case, pool8.run(run_case, case))


@pytest.mark.parametrize("staging", [4 * 4099, 4 * 16411 + 2], ids=["chunk4099", "chunk16411"])
@pytest.mark.parametrize("case", [SHRINK, Case("tiny-llama", (1, 2, 2), (2, 2, 2), True, "bf16")],
                         ids=["shrink", "grow"])
def test_tiny_staging_budget_chunks_messages(pool8, case, staging):
    """Chunks smaller than a message (and cutting bf16/fp32 elements in half) give the same
    state; every rank walks the same number of steps."""
    results = _participants(pool8.run(run_case, case, staging_bytes=staging))
    _check_committed(case, results)
    chunk = staging // 4
    assert {r["stats"]["chunk_bytes"] for r in results} == {chunk}
    steps = {r["stats"]["steps"] for r in results}
    assert len(steps) == 1 and steps.pop() > make_plan(case).rounds
    assert max(r["stats"]["staging_bytes"] for r in results) <= staging


DIRECT_CASES = [Case(model, old, new, dist, dtype, pool=pool)
                for (old, new, pool) in TRANSITIONS.values()
                for model, dtype, dist in (("tiny", "bf16", True), ("tiny-llama", "fp32", False))]


@pytest.mark.parametrize("case", DIRECT_CASES,
                         ids=[f"{n}-{m}" for n in TRANSITIONS for m in ("tiny-bf16-distopt",
                                                                          "llama-fp32")])
def test_large_contiguous_segments_travel_without_staging(pool8, case):
    """With a low direct threshold, contiguous parts go straight from / into shards (mixed
    with staged runs in the same chunk); the state is the same."""
    results = _participants(pool8.run(run_case, case, direct_min_bytes=600,
                                      staging_bytes=4 * 20011))
    _check_committed(case, results)
    if make_plan(case).moved_bytes:
        assert sum(r["stats"]["direct_bytes"] for r in results) > 0


def test_without_overlap(pool8):
    _check_committed(SHRINK, pool8.run(run_case, SHRINK, staging_bytes=4 * 8192, overlap=False))


FAULTS = [
    ("start", 5, 0), ("pack", 2, 0), ("before", 6, 1), ("local", 0, 0),
    ("unpack", 1, 0), ("after", 3, 0), ("commit", 7, 0),
]


@pytest.mark.parametrize("at,rank,rnd", FAULTS, ids=[f"{a}-rank{r}-round{n}" for a, r, n in FAULTS])
def test_injected_failure_aborts_everywhere(pool8, at, rank, rnd):
    results = _participants(pool8.run(run_case, SHRINK,
                                      faults=FaultInjector().fail(rank, at=at, round=rnd)))
    assert len(results) == 8
    votes = {r["vote"] for r in results}
    assert len(votes) == 1, votes  # every rank stopped at the same vote
    for r in results:
        assert r["aborted"], f"rank {r['rank']} committed"
        assert f"rank {rank} (device {rank}," in r["message"]
        assert "injected fault" in r["message"]
        assert [f["rank"] for f in r["failures"]] == [rank]
        assert not r["transport_failed"]
        assert r["old_unchanged"] and r["old_mismatches"] == []


def test_next_migration_after_an_abort_commits(pool8):
    _check_committed(SHRINK, pool8.run(run_case, SHRINK))


def test_stalled_sender_times_out_and_everyone_aborts(pool8):
    """The sender of a round-0 message silently skips its send: the receiver's wait times out
    after 1.5 s, the receiver votes the timeout, naming the message, and every rank aborts."""
    plan = make_plan(SHRINK)
    m = plan.messages
    k = next(i for i in range(len(m)) if int(m.round[i]) == 0)
    sender, receiver = int(m.src[k]), int(m.dst[k])
    results = _participants(pool8.run(run_case, SHRINK, faults=FaultInjector().stall(sender, 0),
                                      p2p_timeout_s=1.5, vote_timeout_s=20, fresh_group=True))
    assert len(results) == 8
    for r in results:
        assert r["aborted"]
        assert r["transport_failed"]
        assert r["old_unchanged"] and r["old_mismatches"] == []
        failed = {f["rank"] for f in r["failures"]}
        assert receiver in failed, r["message"]
        assert (f"timed out receiving message {k} (device {sender} -> device "
                f"{receiver}") in r["message"]
    # the cached group of these devices was not used: it still works
    _check_committed(SHRINK, pool8.run(run_case, SHRINK))
