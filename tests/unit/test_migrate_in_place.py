"""Local copies found in place: an old shard that lives inside its destination already (moved
there before the pause, megatron/placement.py) is not copied again, and every new shard is
still exactly the slice of the global tensor it should be (``shard_mismatches``: cut from the
global tensors, sharing nothing with the executor or the placement).

Fake shards, threads: the placement's region search (``placement._region``) on every old
shard of the staying processes, without megatron (a shard is its own target here).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from slurm_etc.megatron.placement import _region
from slurm_etc.migrate.executor import MigrationOptions, allocate_destinations
from slurm_etc.migrate.program import compile_program, group_devices
from slurm_etc.migrate.threads import run_threads
from slurm_etc.plan import PRESETS
from slurm_etc.testing.fake_state import fake_shards, shard_mismatches
from tests.unit.plan_helpers import make_plan

OPTS = MigrationOptions(measure_memory=False, timeout_s=20)
TINY_BF16 = dataclasses.replace(PRESETS["tiny"], param_dtype="bf16")


def _place(program, shards, dests, stale=False):
    """Move every old shard that lands whole in one contiguous region of a destination
    there (``stale``: planted, without its values); the shards moved and their bytes."""
    pieces: dict[int, list] = {}
    for pc in program.local_pieces():
        pieces.setdefault(pc[0], []).append(pc)
    old_index = {sp.key: i for i, sp in enumerate(program.old_specs)}
    kept_of = {i: j for j, i in program.kept.items()}
    out, nbytes = list(shards), 0
    for k, sh in enumerate(shards):
        t = sh.tensor
        target = SimpleNamespace(dtype=t.dtype, numel=t.numel())
        slot = SimpleNamespace(key=sh.key, a=0, b=t.numel())
        region = _region(target, [slot], old_index, kept_of, pieces, dests)
        if region is None or old_index[sh.key] in kept_of:
            continue
        if not stale:
            region.copy_(t)
        out[k] = dataclasses.replace(sh, tensor=region)
        nbytes += t.numel() * t.element_size()
    return out, nbytes


@pytest.mark.parametrize("model", [PRESETS["tiny"], TINY_BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("old,new", [((1, 2, 2), (2, 1, 2)), ((2, 2, 1), (1, 1, 4)),
                                     ((1, 2, 1), (2, 2, 1))])
def test_shards_placed_in_their_destinations_are_not_copied(model, old, new):
    plan = make_plan(model, old, new)
    progs = {d: compile_program(plan, d, OPTS.staging_bytes, OPTS.direct_min_bytes)
             for d in group_devices(plan)}
    dests = {d: allocate_destinations(p, OPTS) for d, p in progs.items()}
    state, placed = {}, {}
    for r, d in enumerate(plan.old.devices):
        shards = fake_shards(plan, r)
        if d in plan.new.devices:
            shards, placed[d] = _place(progs[d], shards, dests[d])
        state[d] = shards
    results = run_threads(plan, state, options=OPTS, destinations=dests)
    for d, res in results.items():
        assert not isinstance(res, BaseException), f"device {d}: {res}"
        assert shard_mismatches(plan, res.new_rank, res.new_shards) == [], d
        assert res.stats.in_place_bytes == placed.get(d, 0)
    if old == (1, 2, 2):  # a tp reshape: the kept halves of column-parallel weights
        assert all(n > 0 for n in placed.values()), placed


def test_a_stale_placement_is_caught():
    """Planted: the shards moved into their regions without their values. The executor
    skips them (they are in place) and the oracle sees the new shards wrong."""
    plan = make_plan(PRESETS["tiny"], (1, 2, 2), (2, 1, 2))
    progs = {d: compile_program(plan, d, OPTS.staging_bytes, OPTS.direct_min_bytes)
             for d in group_devices(plan)}
    dests = {d: allocate_destinations(p, OPTS) for d, p in progs.items()}
    state = {}
    for r, d in enumerate(plan.old.devices):
        state[d], _ = _place(progs[d], fake_shards(plan, r), dests[d], stale=True)
    results = run_threads(plan, state, options=OPTS, destinations=dests)
    bad = [d for d, res in results.items()
           if shard_mismatches(plan, res.new_rank, res.new_shards)]
    assert sorted(bad) == sorted(plan.new.devices), "a stale placement went unnoticed"
