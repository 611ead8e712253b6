"""The new layout's world prepared before the pause trains exactly as a normally built one.

``prepare_resize(world=True)`` starts the new layout's process groups beside the old ones,
builds its megatron-core model, DDP and optimizer there, and the migration writes straight
into them (``slurm_etc/megatron/world.py``). Real gloo processes (one pool of 4, started
once), real megatron-core state, per transition:

1. the old layout is built and trained 2 steps; its state is snapshotted (cloned shards,
   step, generator);
2. the old layout trains one step alone: reference loss and state digest; the snapshot is
   put back;
3. the new world is prepared (the old state that stays on a process moved into it,
   ``megatron/placement.py``), and the old layout trains the same step beside it, in that
   memory: loss and state digest must be bit-equal to the reference (the prepared world
   neither disturbs the old groups nor the generator; a planted stale placement is caught);
4. the in-place resize into the prepared world; its state is snapshotted; it trains 2 steps;
5. oracle, sharing nothing with the prepared path: fresh default group, megatron's own
   ``initialize_model_parallel``, the state built normally (``build_empty_state``) and the
   snapshot installed with ``install_shards``; it trains the same 2 steps. Losses and the
   final state digest must be bit-equal to the prepared world's.

A last case aborts the resize before the switch: the prepared world is dropped (no group
of it stays registered), the placed old tensors get memory of their own again, and the old
layout trains on, bit-equal to its reference.

The oracle is shown to catch a planted fault: ``test_oracle_catches_wrong_groups`` builds
the prepared world with megatron's globals left at the OLD world during the build (as a
naive second build would): the losses differ.
"""
from __future__ import annotations

import dataclasses

import pytest

from slurm_etc.harness.phases import PRELOAD, Transition, batch_for
from slurm_etc.plan import PRESETS, ParallelConfig
from slurm_etc.pool.local import LocalWorkers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

TINY6 = dataclasses.replace(PRESETS["tiny"], name="tiny6", num_layers=6)
SEQ, SEED = 16, 7


def P(dp, tp=1, pp=1, dist=False):  # noqa: N802 - reads like the CLI's dp=..,tp=..,pp=..
    return ParallelConfig(dp, tp, pp, distributed_optimizer=dist)


# cases where the old state that stays on a process moves into the prepared world
PLACED = ("tp-reshape",)

CASES = {
    "grow": (P(1, 2, 1), P(2, 2, 1)),
    "tp-reshape": (P(1, 2, 2), P(2, 1, 2)),
    "tp-pp-change": (P(1, 2, 2), P(1, 4, 1)),
    "dist-opt-dp-shrink": (P(4, 1, 1, True), P(2, 1, 1, True)),
    "dist-opt-tp2-to-pp3": (P(2, 2, 1, True), P(1, 1, 3, True)),
}


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(4, preload=PRELOAD, timeout_s=240) as pool:
        yield pool


# -- worker phases -----------------------------------------------------------------------------

def _snapshot(state):
    from slurm_etc.megatron.state import local_shards, resume_state
    from slurm_etc.migrate.shards import LocalShard
    from slurm_etc.plan.catalog import build_catalog

    catalog = build_catalog(state.model_desc, state.config)
    shards = [LocalShard(sh.state_key, sh.lo, sh.hi, sh.s, sh.tensor.detach().clone())
              for sh in local_shards(state, catalog)]
    return shards, resume_state(state)


def _restore(state, snapshot):
    from slurm_etc.megatron.state import install_shards
    from slurm_etc.plan.catalog import build_catalog

    shards, resume = snapshot
    install_shards(state, build_catalog(state.model_desc, state.config),
                   [dataclasses.replace(sh, tensor=sh.tensor.clone()) for sh in shards],
                   resume, adopt=False)


def _digest(state) -> str:
    import hashlib

    import torch

    from slurm_etc.megatron.state import local_shards
    from slurm_etc.plan.catalog import build_catalog

    h = hashlib.sha1()
    for sh in sorted(local_shards(state, build_catalog(state.model_desc, state.config)),
                     key=lambda s: s.key):
        h.update(repr(sh.key).encode())
        h.update(sh.tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def _step(state, gb):
    from slurm_etc.megatron import build
    from slurm_etc.megatron.state import optimizer_step

    return build._train_step(state, seed=SEED, step=optimizer_step(state), micro_batch=1,
                             seq=SEQ, global_batch=gb)


def w_old(ctx, tr, *, tag, gb):
    """Old ranks: build and train 2 steps, snapshot; the reference step; put it back."""
    from slurm_etc.megatron import build, cpu_compat

    ctx.drop()
    cpu_compat.install()
    if ctx.index >= tr.old.world:
        return None
    ctx.init_group(f"{tag}/old", ctx.index, tr.old.world)
    state = build.build_training_state(tr.model, tr.old, seed=SEED, steps=2, micro_batch=1,
                                       seq=SEQ, global_batch=gb)
    snap = _snapshot(state)
    loss = _step(state, gb)
    ref = (loss, _digest(state))
    _restore(state, snap)
    ctx.objects["state"] = state
    return ref


def w_prepare_and_step(ctx, tr, *, tag, gb, naive=False, stale=False):
    """Every participant: prepare the new world, the old state that stays placed in it;
    the old ranks then train the reference step beside it (in the placed memory).

    ``stale`` plants a placement that did not carry the values over (the placed memory is
    zeroed after the move)."""
    import torch.distributed.distributed_c10d as c10d

    from slurm_etc.megatron import cpu_compat
    from slurm_etc.megatron.resize import prepare_resize
    from slurm_etc.migrate.executor import MigrationOptions

    cpu_compat.install()
    plan = tr.plan()
    if ctx.index not in plan.participants:
        return None
    ctx.objects["groups_before"] = len(c10d._world.pg_map)
    build_new = _naive_build(tr) if naive else None
    state = ctx.objects.get("state")
    prepared = prepare_resize(plan, ctx.index, ctx.store, tag=tag,
                              options=MigrationOptions(timeout_s=120), group_timeout_s=120,
                              world=True, build_new=build_new, state=state)
    ctx.objects["prepared"] = prepared
    placed = prepared.placed
    if stale and placed is not None:
        import torch

        with torch.no_grad():
            for target in placed.targets:
                target.base().zero_()
    world = prepared.world
    # every megatron group of the new world (tp, pp, dp, ...) is one the preparation made
    megatron_groups = [] if world is None else [
        g for name, g in world.megatron.items()
        if name.endswith("_GROUP") and g is not None and not isinstance(g, list)]
    out = {"prepared": world is not None,
           "groups_prepared": len(world.groups) if world else 0,
           "megatron_groups_prepared": bool(megatron_groups) and all(
               any(g is p for p in world.groups) for g in megatron_groups),
           "placed_bytes": placed.bytes if placed is not None else 0}
    if state is not None:
        out["step"] = (_step(state, gb), _digest(state))
    return out


def _naive_build(tr):
    """The planted fault: the new world's model built while megatron's globals still
    describe the OLD world (what building a second model without a world of its own does)."""
    def build_new(cfg):
        from slurm_etc.megatron import build
        from slurm_etc.megatron.world import megatron_globals, set_megatron_globals

        new_globals = megatron_globals()
        set_megatron_globals(_OLD_GLOBALS[0])
        try:
            return build.build_modules(tr.model, cfg, seed=None)
        finally:
            set_megatron_globals(new_globals)
    return build_new


_OLD_GLOBALS: list = []


def w_keep_old_globals(ctx):
    from slurm_etc.megatron.world import megatron_globals

    _OLD_GLOBALS[:] = [megatron_globals()]


def w_resize(ctx, *, faults=None):
    """Every participant: the pause. New ranks keep the new state and its snapshot."""
    import torch.distributed.distributed_c10d as c10d

    from slurm_etc.megatron.resize import resize_in_place
    from slurm_etc.migrate.executor import MigrationAborted

    prepared = ctx.objects.pop("prepared", None)
    if prepared is None:
        return None
    from slurm_etc.megatron import world

    state = ctx.objects.pop("state", None)
    migration = (prepared.group.data, prepared.group.control)
    try:
        out = resize_in_place(prepared, state, faults=faults)
    except MigrationAborted:
        if state is not None:
            ctx.objects["state"] = state
        return {"aborted": True,
                "groups_left": len(c10d._world.pg_map) - ctx.objects["groups_before"],
                "digest": _digest(state) if state is not None else None,
                # the placed tensors have memory of their own again
                "own_memory": state is None or all(
                    p.untyped_storage().nbytes() == p.numel() * p.element_size()
                    for p in state.gpt.parameters())}
    del state
    # the migration group's backends are kept for the shutdown beside training (a gloo
    # backend's destructor costs ~20 ms: dropped as the resize returned, it was pause)
    retired = all(any(b is r for r in world._RETIRED) for b in migration)
    world.shutdown_retired()
    if out.state is None:
        ctx.drop()
        return {"new_rank": None, "retired": retired}
    ctx.objects["state"] = out.state
    ctx.objects["snapshot"] = _snapshot(out.state)
    return {"new_rank": prepared.plan.new.devices.index(ctx.index), "retired": retired,
            "phases": sorted(k for k in out.seconds if k not in ("pause", "ready")),
            "adopted": out.stats["adopted"],
            "received_into_state_bytes": out.stats["received_into_state_bytes"],
            "in_place_bytes": out.stats["in_place_bytes"],
            "copied_bytes": out.stats["copied_bytes"]}


def w_train(ctx, *, gb, steps=2):
    state = ctx.objects.get("state")
    if state is None:
        return None
    return [_step(state, gb) for _ in range(steps)], _digest(state)


def w_normal_world(ctx, tr, *, tag, gb, steps=2):
    """The oracle: the new layout built normally from a fresh default group, the snapshot
    installed, the same steps trained."""
    from slurm_etc.megatron.state import build_empty_state, install_shards

    snap = ctx.objects.pop("snapshot", None)
    new_rank = (tr.plan().new.devices.index(ctx.index)
                if ctx.index in tr.plan().new.devices else None)
    ctx.drop()
    if snap is None:
        return None
    ctx.init_group(f"{tag}/normal", new_rank, tr.new.world)
    state = build_empty_state(tr.model, tr.new)
    shards, resume = snap
    install_shards(state, tr.plan().catalog, shards, resume)
    out = [_step(state, gb) for _ in range(steps)], _digest(state)
    ctx.objects["state"] = state
    return out


# -- the cases ---------------------------------------------------------------------------------

def _run(workers, name, old, new, *, naive=False, stale=False):
    tr = Transition(TINY6, old, new)
    gb = batch_for(old, new)
    tag = f"pw-{name}{'-naive' if naive else ''}{'-stale' if stale else ''}"
    refs = workers.run(w_old, tr, tag=tag, gb=gb)
    if naive:
        workers.run(w_keep_old_globals)
    prepared = workers.run(w_prepare_and_step, tr, tag=f"{tag}/resize", gb=gb, naive=naive,
                           stale=stale)
    for i, (ref, prep) in enumerate(zip(refs, prepared)):
        if ref is not None:  # the old layout's step beside the prepared world, in the
            # memory placed there: unchanged
            assert prep["step"] == ref, f"worker {i}: the old layout's step changed"
    resized = workers.run(w_resize)
    trained = workers.run(w_train, gb=gb)
    normal = workers.run(w_normal_world, tr, tag=tag, gb=gb)
    workers.run(_drop)
    return tr, prepared, resized, trained, normal


def _drop(ctx):
    ctx.drop()


@pytest.mark.parametrize("name", CASES)
def test_prepared_world_trains_like_a_normal_one(workers, name):
    old, new = CASES[name]
    tr, prepared, resized, trained, normal = _run(workers, name, old, new)
    plan = tr.plan()
    for dev in plan.new.devices:
        assert prepared[dev]["prepared"] and prepared[dev]["groups_prepared"] >= 2
        assert prepared[dev]["megatron_groups_prepared"], prepared[dev]
        r = resized[dev]
        assert r["phases"] == ["migrate", "resume", "switch"], r
        assert r["retired"], r
        assert r["received_into_state_bytes"] > 0 or r["adopted"] > 0
    placed = {dev: prepared[dev]["placed_bytes"] for dev in plan.new.devices}
    in_place = {dev: resized[dev]["in_place_bytes"] for dev in plan.new.devices}
    print(name, "placed", placed, "in place", in_place,
          "copied at the switch", {dev: resized[dev]["copied_bytes"] for dev in placed})
    if name in PLACED:  # the old state that stays was moved before the pause
        staying = [d for d in plan.new.devices if d in plan.old.devices]
        assert all(placed[d] > 0 for d in staying), placed
    departing = set(plan.old.devices) - set(plan.new.devices)
    for dev in departing:
        assert resized[dev] == {"new_rank": None, "retired": True}
    losses = {tuple(t[0]) for t in trained if t is not None}
    assert len(losses) == 1, trained  # every new rank knows the same mean loss
    for dev in plan.new.devices:
        assert trained[dev] == normal[dev], (
            f"device {dev}: prepared world {trained[dev]} != normally built {normal[dev]}")


def test_a_stale_placement_is_caught(workers):
    """Planted: the placed memory loses its values after the move (a placement that did
    not carry them over): the old layout's step beside the prepared world differs from its
    reference."""
    old, new = CASES["tp-reshape"]
    with pytest.raises(AssertionError, match="the old layout's step changed"):
        _run(workers, "stale", old, new, stale=True)
    workers.run(_drop)


def test_abort_drops_the_prepared_world(workers):
    """A failure before the commit: every participant raises MigrationAborted, the prepared
    world's groups are gone, the old state that had moved into it has memory of its own
    again, and the old layout trains on bit-equal to its reference."""
    from slurm_etc.migrate.faults import FaultInjector

    old, new = CASES["tp-reshape"]
    tr = Transition(TINY6, old, new)
    gb = batch_for(old, new)
    refs = workers.run(w_old, tr, tag="pw-abort", gb=gb)
    # the reference step was put back; beside the prepared world the same step again
    prepared = workers.run(w_prepare_and_step, tr, tag="pw-abort/resize", gb=gb)
    assert [p["step"] for p in prepared] == refs
    assert all(p["placed_bytes"] > 0 for p in prepared)  # moved into the new world
    resized = workers.run(w_resize, faults=FaultInjector().fail(2, at="before"))
    assert all(r["aborted"] and r["groups_left"] == 0 for r in resized), resized
    assert all(r["own_memory"] for r in resized), resized  # and given back
    # the old state is untouched by the aborted migration (and its generator too)
    assert [r["digest"] for r in resized] == [p["step"][1] for p in prepared]
    after = workers.run(w_train, gb=gb, steps=1)
    assert len({tuple(a[0]) for a in after}) == 1  # the old layout trains on, in step
    workers.run(_drop)


def test_oracle_catches_wrong_groups(workers):
    """The planted fault (model built under the old world's megatron globals) is caught."""
    from slurm_etc.pool.local import WorkerFailed

    old, new = CASES["tp-reshape"]
    try:
        tr, _p, _r, trained, normal = _run(workers, "planted", old, new, naive=True)
    except (AssertionError, WorkerFailed) as exc:  # the fault stopped the run: caught too
        workers.run(_drop)
        caught = str(exc)[:300]
    else:
        differ = [dev for dev in tr.plan().new.devices if trained[dev] != normal[dev]]
        caught = f"devices {differ} differ" if differ else ""
    assert caught, "the oracle did not see a model built on the old world's groups"
