"""A resize after devices died without notice, on real megatron-core state and real gloo.

Four local processes train ``tiny`` under dp=2,tp=1,pp=2 (old rank r on device r; ranks 0, 2
are data-parallel replica 0, ranks 1, 3 replica 1). Then one replica "dies": its two
processes (a whole node) take part in nothing, they do not even call the resize. The two
survivors plan around the loss (``plan_migration(..., lost=...)``), connect the migration
group among themselves, exchange step and RNG, migrate and start the new layout's training
group. The result is checked bit for bit against the old layout's full tensors, gathered
from all four processes' state (read through megatron-core, ``reference.py``) before the
loss; the Adam step is preserved, each new rank continues a surviving old rank's generator,
and the new layout trains a step.

Where the lost processes held state nobody else has (both processes of pipeline stage 0),
planning raises StateLostError on every survivor before anything moves; their state is
untouched.
"""
from __future__ import annotations

import hashlib

import pytest

from slurm_etc.harness.phases import PRELOAD, batch_for, w_build, w_drop, w_train_step
from slurm_etc.harness.reference import (
    assemble,
    compare_globals,
    rng_digest,
    w_megatron_view,
    w_seed_rng,
)
from slurm_etc.plan import PRESETS, Layout, ParallelConfig, Topology, plan_migration
from slurm_etc.pool.local import LocalWorkers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

MODEL = PRESETS["tiny"]
OLD = ParallelConfig(2, 1, 2)
TOPO = Topology(gpus_per_node=4)
SEQ, SEED, STEPS = 16, 11, 2


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(4, preload=PRELOAD, timeout_s=120) as pool:
        yield pool


def _plan(new: ParallelConfig, pool: tuple[int, ...], lost: tuple[int, ...]):
    return plan_migration(MODEL, Layout(OLD, (0, 1, 2, 3)), new, pool, TOPO,
                          keep_tp_in_node=False, lost=lost)


def w_resize_lost(ctx, new, pool, lost, *, tag):
    """Survivors: plan around ``lost`` and resize in place. Lost workers are dead: they call
    nothing (their state is simply gone)."""
    from slurm_etc.megatron import cpu_compat
    from slurm_etc.megatron.resize import prepare_resize, resize_in_place
    from slurm_etc.migrate.executor import MigrationOptions

    if ctx.index in lost:
        ctx.drop()
        return None
    cpu_compat.install()
    plan = _plan(new, pool, lost)
    prepared = prepare_resize(plan, ctx.index, ctx.store, tag=tag,
                              options=MigrationOptions(timeout_s=60), group_timeout_s=60)
    out = resize_in_place(prepared, ctx.objects.pop("state"))
    if out.state is None:
        ctx.drop()
        return {"new_rank": None}
    ctx.objects["state"] = out.state
    return {"new_rank": plan.new.devices.index(ctx.index), "step": out.resume.step,
            "rng": rng_digest(), "participants": plan.participants,
            "received": out.stats["received_bytes"], "sent": out.stats["sent_bytes"]}


def w_plan_only(ctx, new, pool, lost):
    """Survivors try to plan; a StateLostError is reported, not raised."""
    from slurm_etc.plan import StateLostError

    if ctx.index in lost:
        return None
    try:
        _plan(new, pool, lost)
    except StateLostError as err:
        return {"error": str(err), "tensors": err.tensors}
    return {"error": None}


def _digest(view):
    return None if view is None else {k: hashlib.sha1(v.tobytes()).hexdigest()
                                      for k, v in view["shards"].items()}


def test_unreplicated_state_lost_raises_before_anything_moves(workers):
    gb = batch_for(OLD)
    try:
        workers.run(w_build, MODEL, OLD, tag="nolost", seed=SEED, steps=STEPS, seq=SEQ,
                    global_batch=gb)
        before = [_digest(v) for v in workers.run(w_megatron_view)]
        # devices 0 and 1 are both replicas of pipeline stage 0
        seen = workers.run(w_plan_only, ParallelConfig(1, 1, 2), (2, 3), (0, 1))
        after = [_digest(v) for v in workers.run(w_megatron_view)]
    finally:
        workers.run(w_drop)
    assert seen[:2] == [None, None]
    for result in seen[2:]:
        assert "every data-parallel replica of these shards is lost" in result["error"]
        assert "held only by lost devices 0, 1" in result["error"]
        assert "cannot be rebuilt in memory" in result["error"]
        assert "embedding.word_embeddings.weight" in result["tensors"]
    assert after == before and all(before)


@pytest.mark.parametrize("lost,new,pool", [
    # replica 1 dies; the survivors keep their stages: nothing needs to move
    ((1, 3), ParallelConfig(1, 1, 2), (0, 2)),
    # replica 0 (old rank 0 included) dies; the survivors re-shard to tp=2 and continue
    # the generator of old rank 1 (tp 0, stage 0, lowest surviving dp rank)
    ((0, 2), ParallelConfig(1, 2, 1), (1, 3)),
], ids=["lose-dp1-to-pp2", "lose-dp0-to-tp2"])
def test_survivors_resize_bit_for_bit(workers, lost, new, pool):
    gb = batch_for(OLD, new)
    tag = f"lost-{'-'.join(map(str, lost))}"
    try:
        workers.run(w_build, MODEL, OLD, tag=tag, seed=SEED, steps=STEPS, seq=SEQ,
                    global_batch=gb)
        workers.run(w_seed_rng, SEED)
        old_views = workers.run(w_megatron_view)   # the whole state, before the loss
        out = workers.run(w_resize_lost, new, pool, lost, tag=f"{tag}/resize")
        new_by_worker = workers.run(w_megatron_view)
        losses = workers.run(w_train_step, "state", seed=SEED, seq=SEQ, global_batch=gb)
    finally:
        workers.run(w_drop)
    plan = _plan(new, pool, lost)
    for d in lost:
        assert out[d] is None and new_by_worker[d] is None and losses[d] is None
    survivors = [d for d in range(4) if d not in lost]
    assert all(out[d]["participants"] == tuple(survivors) for d in survivors)
    # the new layout, rank by rank, against the old layout's full tensors
    new_views = [None] * new.world
    for d in survivors:
        new_views[out[d]["new_rank"]] = new_by_worker[d]
    assert all(v is not None for v in new_views)
    old = assemble(old_views, "old")
    assert not old.problems
    mismatches, checked = compare_globals(old, new_views, assemble(new_views, "new"),
                                          "megatron-gather")
    assert mismatches == []
    assert set(checked) == set(old.tensors)
    # step preserved; each new rank continues its surviving source's generator
    for d in survivors:
        r = out[d]["new_rank"]
        assert out[d]["step"] == STEPS and new_views[r]["steps"] == [STEPS]
        src = plan.old.devices[_rng_source(plan, r)]
        assert src not in lost
        assert new_views[r]["rng"] == old_views[src]["rng"] == out[d]["rng"]
    if lost == (0, 2):
        assert {_rng_source(plan, r) for r in range(new.world)} == {1}
        assert sum(out[d]["received"] for d in survivors) > 0
    else:
        assert sum(out[d]["received"] for d in survivors) == 0 == plan.moved_bytes
    # the new layout trains on
    assert all(losses[d] is not None for d in survivors)


def _rng_source(plan, new_rank):
    from slurm_etc.megatron.state import plan_rng_source

    return plan_rng_source(plan, new_rank)
