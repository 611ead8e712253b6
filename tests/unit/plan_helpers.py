"""Shared helpers for planner tests: building plans and applying them to fake state."""
from __future__ import annotations

import numpy as np

from slurm_etc.plan import Layout, ParallelConfig, Topology, default_pool, plan_migration
from slurm_etc.plan.boxes import interval_boxes


def make_plan(model, old, new, dist=False, gpn=4, keep_tp=True, drop=(), add=None, **kw):
    oc = ParallelConfig(*old, distributed_optimizer=dist)
    nc = ParallelConfig(*new, distributed_optimizer=dist)
    layout = Layout(oc, tuple(range(oc.world)))
    topo = Topology(gpus_per_node=gpn)
    pool = default_pool(layout, nc, topo, drop_nodes=drop, add_nodes=add)
    return plan_migration(model, layout, nc, pool, topo, keep_tp_in_node=keep_tp, **kw)


def global_tensors(catalog, seed=0):
    """A distinct random integer tensor per group (padded to 3 axes)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in catalog.groups:
        shape = tuple(g.shape) + (1,) * (3 - len(g.shape))
        out.append(rng.integers(0, 2**31, size=shape, dtype=np.int64))
    return out


def cut(tensor, lo, hi, s, e):
    """Row-major interval [s, e) of box [lo, hi) cut from a global tensor."""
    box = tensor[tuple(slice(a, b) for a, b in zip(lo, hi))]
    return box.reshape(-1)[s:e]


def _positions(lo, hi, s, sub_lo, sub_hi):
    """Positions of a sub-box's elements (row-major) inside a row's flat interval."""
    grids = np.meshgrid(*[np.arange(a, b) for a, b in zip(sub_lo, sub_hi)], indexing="ij")
    ext = [b - a for a, b in zip(lo, hi)]
    flat = np.ravel_multi_index(tuple(g - a for g, a in zip(grids, lo)), ext).reshape(-1)
    return flat - s


def apply_plan(plan, tensors):
    """Execute a plan on fake per-rank state; return {(new rank, new row): data}."""
    old_tab, new_tab, frag, t = plan.old_regions, plan.new_regions, plan.fragments, plan.transfers
    old_state = {}
    ranks, rows = old_tab.rank_rows
    for r, row in zip(ranks.tolist(), rows.tolist()):
        old_state[(r, row)] = cut(tensors[old_tab.group[row]], old_tab.lo[row], old_tab.hi[row],
                                  old_tab.s[row], old_tab.e[row])
    new_state = {}
    ranks, rows = new_tab.rank_rows
    for r, row in zip(ranks.tolist(), rows.tolist()):
        new_state[(r, row)] = np.full(int(new_tab.count[row]), -1, np.int64)
    for k in range(len(t)):
        f = int(t.frag[k])
        i, j = int(frag.old_row[f]), int(frag.new_row[f])
        src = old_state[(int(t.src_rank[k]), i)]
        dst = new_state[(int(t.dst_rank[k]), j)]
        boxes = interval_boxes(frag.lo[f], frag.hi[f], int(frag.u[f]), int(frag.v[f]))
        for sub_lo, sub_hi in boxes:
            dst[_positions(new_tab.lo[j], new_tab.hi[j], new_tab.s[j], sub_lo, sub_hi)] = \
                src[_positions(old_tab.lo[i], old_tab.hi[i], old_tab.s[i], sub_lo, sub_hi)]
    return new_state


def expected_state(plan, tensors):
    new_tab = plan.new_regions
    ranks, rows = new_tab.rank_rows
    return {(r, row): cut(tensors[new_tab.group[row]], new_tab.lo[row], new_tab.hi[row],
                          new_tab.s[row], new_tab.e[row])
            for r, row in zip(ranks.tolist(), rows.tolist())}


def region_elements(tab, row):
    """Flat global element indices (in the group's padded 3-d shape) of one region row."""
    lo, hi = tab.lo[row], tab.hi[row]
    grid = np.stack(np.meshgrid(*[np.arange(a, b) for a, b in zip(lo, hi)], indexing="ij"))
    return grid.reshape(3, -1)[:, tab.s[row]:tab.e[row]]


def brute_overlaps(catalog, old, new):
    """{(old row, new row): element count} by enumerating elements: the oracle."""
    out = {}
    for i in range(len(old)):
        gi = int(old.group[i])
        shape = tuple(catalog.groups[gi].shape) + (1,) * (3 - len(catalog.groups[gi].shape))
        a = set(np.ravel_multi_index(tuple(region_elements(old, i)), shape).tolist())
        for j in np.flatnonzero(new.group == gi).tolist():
            b = np.ravel_multi_index(tuple(region_elements(new, j)), shape)
            n = int(np.isin(b, list(a)).sum()) if a else 0
            if n:
                out[(i, j)] = n
    return out
