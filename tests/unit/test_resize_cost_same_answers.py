"""The cuts of a resize's cost at the coordinator (issue #42) answer as the code before them.

Each reference below is the code as it was before the cut, kept here verbatim (names
suffixed ``_before``), and each test compares it with the code now on the same inputs: the
class sketch's picks (sparse where the answer is forced, else dense as before), the vrank
allocator's node choice and numbering, the chooser's data-parallel degrees.
"""
from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable, Mapping
from types import SimpleNamespace

import numpy as np
import pytest

from slurm_etc.alloc import chooser, vranks
from slurm_etc.alloc.topology import ClusterTopology, Device
from slurm_etc.plan import Layout, ParallelConfig, load_model
from slurm_etc.plan.catalog import build_catalog
from slurm_etc.plan.classes import (
    _pick_block,
    _pool_class,
    _rep_value,
    _ShardLookup,
    assign_classes,
    pick_pairs,
    transport,
)
from slurm_etc.plan.cost import build_cost
from slurm_etc.plan.intersect import intersect
from slurm_etc.plan.regions import region_table

# ---------------------------------------------------------------- the class sketch


def assign_classes_before(cost):
    """``assign_classes`` before the cut: a dense gain block per class pair."""
    value = _rep_value(cost)
    cls = _pool_class(cost)
    supply = np.bincount(cls, minlength=value.shape[0])
    demand = np.bincount(cost.rank_class, minlength=value.shape[1])
    x, _ = transport(value, supply, demand)
    shards = _ShardLookup(cost)
    free = {a: np.flatnonzero(cls == a) for a in range(value.shape[0])}
    placement = np.full(cost.shape[1], -1, np.int64)
    for b in range(value.shape[1]):
        ranks = np.flatnonzero(cost.rank_class == b)
        for a in np.flatnonzero(x[:, b]).tolist():
            devs = free[a]
            gain = shards.block(devs, ranks).T + (ranks[:, None] == devs[None, :]) * 0.25
            r, c = pick_pairs(gain, int(x[a, b]))
            placement[ranks[r]] = devs[c]
            free[a] = np.delete(devs, c)
            ranks = np.delete(ranks, r)
    return placement


def _cost(model, old_cfg, new_cfg, old_devices, pool):
    catalog = build_catalog(model, old_cfg)
    old = Layout(old_cfg, tuple(old_devices))
    old_tab, new_tab = region_table(catalog, old_cfg), region_table(catalog, new_cfg)
    return build_cost(catalog, old, new_cfg, np.asarray(sorted(pool), np.int64), old_tab,
                      new_tab, intersect(old_tab, new_tab))


TRANSITIONS = [  # (old dp, tp, pp), (new dp, tp, pp), the old devices, the pool
    ((16, 1, 1), (18, 1, 1), range(16), range(18)),            # a grow by nodes
    ((18, 1, 1), (16, 1, 1), range(18), range(16)),            # a shrink
    ((16, 1, 1), (12, 1, 1), range(16), range(8, 20)),         # a loss, replaced elsewhere
    ((8, 1, 1), (8, 1, 1), range(8), [1, 3, 5, 7, 8, 9, 10, 11]),
    ((8, 2, 1), (6, 2, 1), range(16), range(4, 16)),
    ((4, 1, 2), (8, 1, 1), range(8), range(8)),
    ((4, 1, 2), (6, 1, 2), range(8), range(2, 14)),
    ((6, 1, 1), (4, 1, 2), [0, 2, 4, 6, 8, 10], range(12)),
]


@pytest.mark.parametrize("dist", [False, True])
@pytest.mark.parametrize("old,new,old_devices,pool", TRANSITIONS)
def test_assign_classes_places_as_the_dense_blocks_did(old, new, old_devices, pool, dist):
    model = load_model("tiny")
    oc = ParallelConfig(*old, distributed_optimizer=dist)
    nc = ParallelConfig(*new, distributed_optimizer=dist)
    cost = _cost(model, oc, nc, old_devices, pool)
    assert np.array_equal(assign_classes(cost), assign_classes_before(cost))


def _lookup(n_pool, world, entries):
    pool, rank, nbytes = (np.asarray(x) for x in zip(*entries)) if entries else (
        np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
    fake = SimpleNamespace(dist_pool=pool.astype(np.int64), dist_rank=rank.astype(np.int64),
                           dist_bytes=nbytes.astype(np.int64), shape=(n_pool, world))
    return _ShardLookup(fake)


def _pairs(r, c, ranks, devs):
    return sorted(zip(ranks[np.asarray(r)].tolist(), devs[np.asarray(c)].tolist()))


@pytest.mark.parametrize("seed", range(300))
def test_pick_block_picks_the_pairs_of_the_dense_solve(seed):
    """Random blocks: sparse or dense overlaps, identity bonuses, ties (both the forced
    readings and the fallback), k = rows, k = columns and k below both."""
    rng = random.Random(seed)
    n_pool = world = rng.randint(2, 40)
    devs = np.asarray(sorted(rng.sample(range(n_pool), rng.randint(1, n_pool))), np.int64)
    ranks = np.asarray(sorted(rng.sample(range(world), rng.randint(1, world))), np.int64)
    density = rng.choice([0.0, 0.02, 0.1, 0.5])
    values = [1, 2, 3, 1000] if rng.random() < 0.5 else [7]  # few values: ties
    entries = [(d, r, rng.choice(values)) for d in range(n_pool) for r in range(world)
               if rng.random() < density]
    entries += [(d, r, b) for d, r, b in entries if rng.random() < 0.1]  # summed twice
    shards = _lookup(n_pool, world, entries)
    most = min(len(devs), len(ranks))
    k = rng.choice([most, most, max(1, most - rng.randint(0, 2))])
    dense = shards.block(devs, ranks).T + (ranks[:, None] == devs[None, :]) * 0.25
    want = pick_pairs(dense, k)
    got = _pick_block(shards, devs, ranks, k)
    assert _pairs(*got, ranks, devs) == _pairs(*want, ranks, devs)


def test_pick_block_reads_a_grow_without_the_dense_block(monkeypatch):
    """The 16,384-rank grow's block (every rank a class-0 rank, the old devices its
    columns, only identity bonuses): forced, no assignment solve."""
    import slurm_etc.plan.classes as classes

    ranks = np.arange(4608)
    devs = np.arange(4096)
    called = []
    monkeypatch.setattr(classes, "pick_pairs", lambda *a: called.append(a))
    r, c = _pick_block(_lookup(4608, 4608, []), devs, ranks, 4096)
    assert not called
    assert np.array_equal(r, np.arange(4096)) and np.array_equal(c, np.arange(4096))


# ---------------------------------------------------------------- the vrank allocator


def take_nodes_before(world, usable, anchored, key, topology):
    remaining = sorted(usable, key=key)
    take: dict[str, int] = {}
    need = world
    while need:
        fits = [n for n in remaining if usable[n] >= need]
        if fits:
            used_switches = {topology.switch(n) for n in take}
            last = min(fits, key=lambda n: (not anchored[n], usable[n] - need,
                                            topology.switch(n) not in used_switches, key(n)))
            take[last] = need
            need = 0
        else:
            node = remaining.pop(0)
            take[node] = usable[node]
            need -= usable[node]
    return take


def number_vranks_before(selected: Iterable[Device], previous: Mapping[int, Device],
                         topology: ClusterTopology) -> dict[int, Device]:
    G = topology.gpus_per_node
    vranks._check_table(previous, G)
    vrank_of = {d: v for v, d in previous.items()}
    slot_of: dict[str, int] = {}
    result: dict[int, Device] = {}
    fresh: dict[str, list[Device]] = defaultdict(list)
    for d in sorted(set(selected)):
        topology.check(d)
        if d in vrank_of:
            result[vrank_of[d]] = d
            slot_of[d.node] = vrank_of[d] // G
        else:
            fresh[d.node].append(d)
    used_slots = set(slot_of.values())
    next_slot = 0
    for node in sorted(fresh, key=topology.index):
        if node not in slot_of:
            while next_slot in used_slots:
                next_slot += 1
            slot_of[node] = next_slot
            used_slots.add(next_slot)
        base = slot_of[node] * G
        taken = {v - base for v, d in result.items() if d.node == node}
        free = (p for p in range(G) if p not in taken)
        for d in fresh[node]:
            result[base + next(free)] = d
    return dict(sorted(result.items()))


def _cluster(rng):
    G = rng.choice([2, 4, 8])
    n = rng.randint(2, 12)
    switches = tuple(f"s{rng.randint(0, 2)}" for _ in range(n)) if rng.random() < 0.5 else ()
    names = [f"n{i:02d}" for i in range(n)]
    rng.shuffle(names)  # the topology's order is not the names' order
    return ClusterTopology(G, tuple(names), switches)


@pytest.mark.parametrize("seed", range(200))
def test_allocate_chooses_and_numbers_as_before(seed, monkeypatch):
    """Random holdings, previous tables and pinned nodes: the allocation (its vranks and
    what it releases) is the one the allocator gave before (its node choice and numbering
    replaced by the references, every other step the same)."""
    rng = random.Random(seed)
    topo = _cluster(rng)
    G = topo.gpus_per_node
    every = [Device(n, k) for n in topo.nodes for k in range(G)]
    held = [d for d in every if rng.random() < 0.85]
    if not held:
        held = every[:G]
    # a previous table: some held nodes' devices, each node in one slot
    previous: dict[int, Device] = {}
    slots = rng.sample(range(len(topo.nodes) + 2), k=len(topo.nodes))
    for slot, node in zip(slots, topo.nodes):
        if rng.random() < 0.5:
            for k in range(G):
                if rng.random() < 0.7:
                    previous[slot * G + k] = Device(node, k)
    tp = rng.choice([t for t in (1, 2, 4, 8) if G % t == 0])
    pinned = [d for d in held if d.node == held[0].node] if rng.random() < 0.5 else []
    room = vranks.capacity([sum(1 for d in held if d.node == n) for n in topo.nodes], tp)
    world = tp * rng.randint(0, room // tp)
    got = vranks.allocate(held, world, tp, topo, previous, pinned=pinned)
    monkeypatch.setattr(vranks, "_take_nodes", take_nodes_before)
    monkeypatch.setattr(vranks, "number_vranks", number_vranks_before)
    want = vranks.allocate(held, world, tp, topo, previous, pinned=pinned)
    assert dict(got.vranks) == dict(want.vranks)
    assert list(got.vranks) == list(want.vranks)
    assert got.released == want.released


def test_device_key_orders_devices_as_their_comparison():
    rng = random.Random(1)
    devices = [Device(f"n{rng.randint(0, 30)}", rng.randint(0, 9)) for _ in range(500)]
    assert sorted(devices, key=vranks.device_key) == sorted(devices)


# ---------------------------------------------------------------- the chooser


@pytest.mark.parametrize("n", [*range(1, 400), 1_179_648, 2**20, 3**12, 999_983])
def test_divisors_are_every_divisor_ascending(n):
    if n < 400:
        assert chooser._divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    else:
        got = chooser._divisors(n)
        assert got == sorted(set(got)) and all(n % d == 0 for d in got)
        assert len(got) == sum(2 - (d * d == n) for d in range(1, int(n**0.5) + 1)
                               if n % d == 0)


# ---------------------------------------------------------------- the sketch kept


def test_a_sketch_kept_plans_as_one_solved_afresh(monkeypatch):
    """The chooser's pricing and the resize's plan share one sketch (same cost matrix);
    the plan from the kept sketch is the plan solved afresh, and another matrix is solved
    anew."""
    from slurm_etc.alloc.migration import migration_cost
    from slurm_etc.plan import Topology, plan_migration
    from slurm_etc.plan import plan as plan_module
    from slurm_etc.plan.fingerprint import plan_digest

    model = load_model("tiny")
    topo = Topology(gpus_per_node=4)
    old = Layout(ParallelConfig(8, 1, 1), tuple(range(8)))
    new = ParallelConfig(10, 1, 1)
    monkeypatch.setattr(plan_module, "_SKETCHES", type(plan_module._SKETCHES)())
    solved = []
    solve = plan_module._solve_sketch
    monkeypatch.setattr(plan_module, "_solve_sketch",
                        lambda *a: solved.append(1) or solve(*a))
    priced = migration_cost(model, old, new, tuple(range(12)), topo)
    kept = plan_migration(model, old, new, range(12), topo)
    assert len(solved) == 1
    plan_module._SKETCHES.clear()
    afresh = plan_migration(model, old, new, range(12), topo)
    assert len(solved) == 2
    assert plan_digest(kept) == plan_digest(afresh)
    assert kept.assignment == afresh.assignment == priced.assignment
    plan_migration(model, old, ParallelConfig(12, 1, 1), range(12), topo)
    assert len(solved) == 3
