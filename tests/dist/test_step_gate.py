"""The step boundary asks the coordinator's store nothing while no rank holds an order
(issue #42): the order's presence rides on the step's own loss all-reduce, and only a
boundary after a step where some rank held one decides, by small collectives over the
layout's world. Real worker processes train a preset through a resize told to one rank only
(one rank told is enough: it gives the order to the others) or to every rank (each takes
its own); the store requests each rank makes are counted per step, and the boundaries where
a rank arrived at the store's agreement. Planted bugs caught: a gate that is never open
(the store asked every step); a gate read from the rank's own flag alone (the told rank
decides alone and times out); collectives that take each rank's own order where they
differ (told alone, rank 0 resizes while its peer trains on); and in the store's agreement,
still used at the job's first boundary (no gate yet), a rank that holds an order and never
proposes it (a Stop comes a step late)."""
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


@pytest.fixture(scope="module")
def hanging():
    """Workers for the plants that leave two ranks in different collectives: each call
    ends at a worker's deadline, short here (a normal run takes ~2 s)."""
    with LocalWorkers(2, preload=PRELOAD, timeout_s=6) as workers:
        yield workers


def w_counted(ctx, seq, layouts, digests, job, plant="", tell_all=False, stop_first=False):
    """One worker's stints, with the store requests it had sent when each step began, the
    boundaries where it arrived at the store's agreement, decided by collectives, and was
    given an order by a peer. ``stop_first``: the script is a Stop to vrank 0 alone, due at
    the job's first boundary (no gate read yet: the store's agreement decides it)."""
    import dataclasses

    from slurm_etc.protocol.messages import Stop
    from slurm_etc.worker import agreement, sequence
    from slurm_etc.worker.scripted import ScriptEntry
    from slurm_etc.worker.trainer import ElasticTrainer

    seen, arrivals, collectives, given = [], [], [], []
    real = {name: getattr(ElasticTrainer, name) for name in
            ("train_step", "_reduce_loss", "_arrive", "_decide_together", "_given")}
    real_how, real_script, real_digest = agreement.how_decided, sequence._script, sequence._digest

    def counted(self):
        seen.append((self.generation, self.step, self.proc.store.requests))
        return real["train_step"](self)

    def never_open(self, losses, cfg):
        loss = real["_reduce_loss"](self, losses, cfg)
        self._gate = None  # the planted bug: every boundary agrees through the store
        return loss

    def own_flag_only(self, losses, cfg):
        holds = self._holds_an_order()  # the planted bug: no other rank's flag is read
        loss = real["_reduce_loss"](self, losses, cfg)
        self._gate = (self.generation, self.step, holds)
        return loss

    def arrive(self, decided, arrived, world):
        arrivals.append((self.generation, self.step))
        if plant == "never-propose":
            held, self._pending = self._pending, None  # the planted bug: counts itself in
            try:
                return real["_arrive"](self, decided, arrived, world)
            finally:
                self._pending = held
        return real["_arrive"](self, decided, arrived, world)

    def together(self):
        collectives.append((self.generation, self.step))
        return real["_decide_together"](self)

    def give(self, holder):
        given.append((self.generation, self.step))
        return real["_given"](self, holder)

    def own_order_kept(lowest, highest):
        # the planted bug: where the ranks differ each keeps its own (none gives it)
        return "held" if highest > 1 else real_how(lowest, highest)

    def scripted(*args):
        if stop_first:
            return [ScriptEntry(0, Stop(job, 1, "stopped at once"), frozenset({0}))]
        return [dataclasses.replace(e, recipients=None if tell_all else e.recipients)
                for e in real_script(*args)]

    ElasticTrainer.train_step, ElasticTrainer._arrive = counted, arrive
    ElasticTrainer._decide_together, ElasticTrainer._given = together, give
    sequence._script = scripted
    if stop_first:  # no step trained: no optimizer state to digest
        sequence._digest = lambda trainer: None
    if plant == "own-order-kept":
        agreement.how_decided = own_order_kept
    elif plant in ("never-open", "own-flag-only"):
        ElasticTrainer._reduce_loss = {"never-open": never_open,
                                       "own-flag-only": own_flag_only}[plant]
    try:
        out = w_elastic(ctx, seq, layouts, digests, job)
    finally:
        for name, method in real.items():
            setattr(ElasticTrainer, name, method)
        agreement.how_decided, sequence._script = real_how, real_script
        sequence._digest = real_digest
    return {"seen": seen, "arrivals": arrivals, "collectives": collectives, "given": given,
            "steps": [h["step"] for h in out["history"]],
            "exits": out["exits"], "generations": sorted({h["generation"] for h in out["history"]})}


def _run(pool, plant="", tell_all=False, stop_first=False):
    configs = parse_sequence(TEXT)
    seq = ResizeSequence(PRESETS["tiny"], tuple(configs), steps=STEPS, global_batch=4)
    layouts, digests = seq.layouts()
    job = f"gate-{plant or 'real'}{'-all' if tell_all else ''}{'-stop' if stop_first else ''}"
    return pool.run(w_counted, seq, layouts, digests, job, plant, tell_all, stop_first)


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
        # the store is asked at the job's first boundary only (no gate yet); the told rank
        # gave the order to its peer at the boundary that decided the resize, and the new
        # layout's first boundary, every rank installed, decided by collective too
        assert r["arrivals"] == [(0, 0)], r["arrivals"]
        assert r["collectives"] == [(0, STEPS), (1, STEPS)], r["collectives"]
        assert r["given"] == [(0, STEPS)], r["given"]
    assert results[0]["steps"] == list(range(1, 2 * STEPS + 1))


def test_told_to_every_rank_each_takes_its_own_and_none_is_given(pool):
    results = _run(pool, tell_all=True)
    for r in results:
        assert r["generations"] == [0, 1]
        assert r["arrivals"] == [(0, 0)], r["arrivals"]
        assert r["collectives"] == [(0, STEPS), (1, STEPS)] and r["given"] == [], r
    assert results[0]["steps"] == list(range(1, 2 * STEPS + 1))


def test_the_count_catches_a_gate_never_open(pool):
    results = _run(pool, plant="never-open")
    assert all(min(steady_requests(r["seen"])) >= 1 for r in results)


def test_the_first_boundary_decides_through_the_store_and_a_rank_not_proposing_is_caught(pool):
    # rank 0 alone holds a Stop at the job's first boundary (no gate yet): the store
    # decides it there, and no rank trains a step
    for r in _run(pool, stop_first=True):
        assert r["arrivals"] == [(0, 0)] and r["steps"] == [], r
        assert r["exits"] == ["stopped"], r
    # the planted bug: the told rank only counts itself in, the last rank in closes the
    # decision with "no order", and the Stop waits for the next boundary's gate
    planted = _run(pool, plant="never-propose", stop_first=True)
    assert all(r["steps"] == [1] for r in planted), planted


def test_a_collective_that_keeps_each_rank_s_own_order_is_caught(hanging):
    # told alone, rank 0 takes the order while its peer, holding nothing, trains on: the
    # two wait on each other in different collectives until one's deadline
    with pytest.raises((WorkerError, WorkerTimeout)):
        _run(hanging, plant="own-order-kept")


def test_a_gate_read_from_the_own_flag_alone_is_caught(hanging):
    # the told rank agrees alone while its peer trains on: it fails at its deadline, or
    # the two hang on each other past the call's (the pool's processes are stopped after
    # it and the next call starts new ones)
    with pytest.raises((WorkerError, WorkerTimeout)):
        _run(hanging, plant="own-flag-only")
