"""The step boundary asks the coordinator's store nothing while no rank holds an order
(issue #42): the order's presence rides on the step's own loss all-reduce, and only a
boundary after a step where some rank held one agrees through the store. Real worker
processes train a preset through a resize told to one rank only (one rank told is enough);
the store requests each rank makes are counted per step. Two planted bugs are caught: a
gate that is never open (the store asked every step) and a gate read from the rank's own
flag alone (the told rank agrees alone and times out); and one in the decision: a rank
that holds the order never proposes it (the resize never happens).

Told to every rank, the order is decided by the collective after the gate alone: no rank
arrives at the store. A planted bug there is caught too: the collective read from its
highest order alone (told alone, rank 0 resizes while its peer, holding nothing, trains
on)."""
from __future__ import annotations

import pytest

from slurm_etc.plan.model import PRESETS
from slurm_etc.pool.local import LocalWorkers, WorkerError, WorkerTimeout
from slurm_etc.worker.sequence import PRELOAD, ResizeSequence, parse_sequence, w_elastic

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

TEXT = "dp=2,tp=1,pp=1 -> dp=1,tp=2,pp=1"
STEPS = 6


@pytest.fixture(scope="module")
def pool():
    with LocalWorkers(2, preload=PRELOAD, timeout_s=20) as workers:
        yield workers


def w_counted(ctx, seq, layouts, digests, job, plant="", tell_all=False):
    """One worker's stints, with the store requests it had sent when each step began and
    the boundaries where it arrived at the store's agreement."""
    import dataclasses

    from slurm_etc.worker import agreement, sequence
    from slurm_etc.worker.trainer import ElasticTrainer

    seen, arrivals, collectives = [], [], []
    real_step, real_reduce = ElasticTrainer.train_step, ElasticTrainer._reduce_loss

    def counted(self):
        seen.append((self.generation, self.step, self.proc.store.requests))
        return real_step(self)

    def never_open(self, losses, cfg):
        loss = real_reduce(self, losses, cfg)
        self._gate = None  # the planted bug: every boundary agrees through the store
        return loss

    def own_flag_only(self, losses, cfg):
        holds = self._holds_an_order()  # the planted bug: no other rank's flag is read
        loss = real_reduce(self, losses, cfg)
        self._gate = (self.generation, self.step, holds)
        return loss

    real_arrive, real_unanimous = ElasticTrainer._arrive, agreement.unanimous
    real_held = ElasticTrainer._held_everywhere
    real_script = sequence._script

    def arrive(self, decided, arrived, world):
        arrivals.append((self.generation, self.step))
        if plant == "never-propose":
            held, self._pending = self._pending, None  # the planted bug: counts itself in
            try:
                return real_arrive(self, decided, arrived, world)
            finally:
                self._pending = held
        return real_arrive(self, decided, arrived, world)

    def held(self):
        collectives.append((self.generation, self.step))
        return real_held(self)

    def highest_only(lowest, highest):
        return highest != 1  # the planted bug: the lowest (a rank holding nothing) unread

    def told_everyone(*args):
        return [dataclasses.replace(e, recipients=None) for e in real_script(*args)]

    ElasticTrainer.train_step, ElasticTrainer._arrive = counted, arrive
    ElasticTrainer._held_everywhere = held
    if plant == "highest-only":
        agreement.unanimous = highest_only
    elif plant in ("never-open", "own-flag-only"):
        ElasticTrainer._reduce_loss = {"never-open": never_open,
                                       "own-flag-only": own_flag_only}[plant]
    if tell_all:
        sequence._script = told_everyone
    try:
        out = w_elastic(ctx, seq, layouts, digests, job)
    finally:
        ElasticTrainer.train_step, ElasticTrainer._reduce_loss = real_step, real_reduce
        ElasticTrainer._arrive, agreement.unanimous = real_arrive, real_unanimous
        ElasticTrainer._held_everywhere = real_held
        sequence._script = real_script
    return {"seen": seen, "arrivals": arrivals, "collectives": collectives,
            "steps": [h["step"] for h in out["history"]],
            "generations": sorted({h["generation"] for h in out["history"]})}


def _run(pool, plant="", tell_all=False):
    configs = parse_sequence(TEXT)
    seq = ResizeSequence(PRESETS["tiny"], tuple(configs), steps=STEPS, global_batch=4)
    layouts, digests = seq.layouts()
    return pool.run(w_counted, seq, layouts, digests,
                    f"gate-{plant or 'real'}{'-all' if tell_all else ''}", plant, tell_all)


def steady_requests(seen) -> list[int]:
    """Store requests between consecutive steps of one generation, before its resize is
    ordered (at STEPS): the per-step control cost through the coordinator."""
    return [b[2] - a[2] for a, b in zip(seen, seen[1:], strict=False)
            if a[0] == b[0] == 0 and 1 <= a[1] and b[1] < STEPS - 1]


def steady_collectives(r) -> list[tuple[int, int]]:
    """The boundaries of those steady steps where the agreement ran its collective beyond
    the gate (a closed gate runs none)."""
    return [(g, s) for g, s in r["collectives"] if g == 0 and 2 <= s < STEPS - 1]


def test_no_store_request_per_step_and_one_told_rank_is_enough(pool):
    results = _run(pool)
    for r in results:
        assert r["generations"] == [0, 1]  # the resize happened on every rank
        deltas = steady_requests(r["seen"])
        assert len(deltas) >= 3 and deltas == [0] * len(deltas), deltas
        assert steady_collectives(r) == [], r["collectives"]
        assert r["arrivals"], r["arrivals"]  # one rank told: the store decided
    assert results[0]["steps"] == list(range(1, 2 * STEPS + 1))


def test_told_to_every_rank_the_collective_decides_and_the_store_is_not_asked(pool):
    results = _run(pool, tell_all=True)
    for r in results:
        assert r["generations"] == [0, 1]
        # the store is asked at each layout's first boundary only (no gate yet), never at
        # the one that decided the resize
        assert r["arrivals"] == [(0, 0), (1, STEPS)], r["arrivals"]
        assert r["collectives"] == [(0, STEPS)], r["collectives"]
    assert results[0]["steps"] == list(range(1, 2 * STEPS + 1))


def test_a_collective_read_from_its_highest_order_alone_is_caught(pool):
    # told alone, rank 0 takes the order as everyone's and resizes while its peer trains
    # on: the two wait on each other in different collectives until one's deadline
    with pytest.raises((WorkerError, WorkerTimeout)):
        _run(pool, plant="highest-only")


def test_the_count_catches_a_gate_never_open(pool):
    results = _run(pool, plant="never-open")
    assert all(min(steady_requests(r["seen"])) >= 1 for r in results)


def test_a_decision_nobody_proposes_to_is_caught(pool):
    # the told rank only counts itself in: the last rank in closes every decision with "no
    # order", so the resize never happens (or the run fails waiting for it)
    try:
        results = _run(pool, plant="never-propose")
    except (WorkerError, WorkerTimeout):
        return
    assert any(r["generations"] == [0] for r in results), results


def test_a_gate_read_from_the_own_flag_alone_is_caught(pool):
    # the told rank agrees through the store alone while its peer trains on: it fails at
    # its deadline, or the two hang on each other past the call's (this test runs last:
    # the pool's processes are stopped after it)
    with pytest.raises((WorkerError, WorkerTimeout)):
        _run(pool, plant="own-flag-only")
