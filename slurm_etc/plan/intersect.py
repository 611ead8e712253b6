"""Intersections of what an old layout holds with what a new layout needs.

Both tables' rows are (box, row-major interval) pairs. For two rows of one tensor group the
overlap lies in the box X = box_old ∩ box_new, and each row's interval restricted to X is an
interval of X's own row-major order (lexicographic order restricts to sub-boxes). So the
overlap is one interval ``[u, v)`` of X, found with a few integer operations per pair.

Rows of one box hold disjoint intervals (the distributed optimizer's dp ranks cut a box
into consecutive pieces), and restriction to X keeps their order; so for a pair of boxes
the overlaps are a merge of two sorted interval lists, done for all box pairs at once with
one ``searchsorted`` on a common line. The cost follows the rows and the overlaps found,
never the all-pairs product of the rows of a (tensor, layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import PlanError
from .regions import NDIM, RegionTable


@dataclass(frozen=True)
class Fragments:
    """Non-empty overlaps of old rows with new rows (one entry each)."""

    old_row: np.ndarray  # int64
    new_row: np.ndarray  # int64
    lo: np.ndarray       # int64 (n, 3): box X
    hi: np.ndarray
    u: np.ndarray        # int64: interval of X's row-major order
    v: np.ndarray

    def __len__(self) -> int:
        return len(self.old_row)

    @property
    def count(self) -> np.ndarray:
        count: np.ndarray = self.v - self.u
        return count


def _unravel(flat: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Global multi-index of the element at row-major position ``flat`` of box [lo, hi)."""
    ext = hi - lo
    out = np.empty_like(lo)
    rem = flat.copy()
    for k in range(NDIM - 1, -1, -1):
        out[:, k] = lo[:, k] + rem % ext[:, k]
        rem //= ext[:, k]
    return out


def _count_below(xlo: np.ndarray, xhi: np.ndarray, point: np.ndarray) -> np.ndarray:
    """Elements of box X that come before ``point`` in row-major (lexicographic) order."""
    ext = xhi - xlo
    stride = np.ones_like(ext)
    for k in range(NDIM - 2, -1, -1):
        stride[:, k] = stride[:, k + 1] * ext[:, k + 1]
    total = np.zeros(len(point), np.int64)
    alive = np.ones(len(point), bool)
    for k in range(NDIM):
        below = np.clip(point[:, k] - xlo[:, k], 0, ext[:, k])
        total += np.where(alive, below * stride[:, k], 0)
        alive &= (point[:, k] >= xlo[:, k]) & (point[:, k] < xhi[:, k])
    return total


def _restrict(tab: RegionTable, rows: np.ndarray, xlo: np.ndarray, xhi: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """Interval of X's order covered by each row's interval."""
    lo, hi = tab.lo[rows], tab.hi[rows]
    size = np.prod(hi - lo, axis=1)
    s, e = tab.s[rows], tab.e[rows]
    whole = (s == 0) & (e == size)
    n_x = np.prod(xhi - xlo, axis=1)
    first = _unravel(s, lo, hi)
    last = _unravel(np.maximum(e - 1, 0), lo, hi)
    start = _count_below(xlo, xhi, first)
    last_in_x = np.all((last >= xlo) & (last < xhi), axis=1)
    end = _count_below(xlo, xhi, last) + last_in_x
    return np.where(whole, 0, start), np.where(whole, n_x, end)


def _join(keys_a: np.ndarray, keys_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All index pairs (i, j) with keys_a[i] == keys_b[j] (a many-to-many equi-join)."""
    oa, ob = np.argsort(keys_a, kind="stable"), np.argsort(keys_b, kind="stable")
    ka, kb = keys_a[oa], keys_b[ob]
    uniq = np.unique(ka)
    a_start = np.searchsorted(ka, uniq, "left")
    a_cnt = np.searchsorted(ka, uniq, "right") - a_start
    b_start = np.searchsorted(kb, uniq, "left")
    b_cnt = np.searchsorted(kb, uniq, "right") - b_start
    keep = b_cnt > 0
    a_start, a_cnt, b_start, b_cnt = a_start[keep], a_cnt[keep], b_start[keep], b_cnt[keep]
    pairs = a_cnt * b_cnt
    total = int(pairs.sum())
    if total == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    grp = np.repeat(np.arange(len(pairs)), pairs)
    offset = np.arange(total) - np.repeat(np.cumsum(pairs) - pairs, pairs)
    i = a_start[grp] + offset // b_cnt[grp]
    j = b_start[grp] + offset % b_cnt[grp]
    return oa[i], ob[j]


def _box_runs(tab: RegionTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows grouped into runs of one (group, layer, box), each run sorted by interval start.

    Returns (order, first, count): ``order`` lists row indices run by run; run ``b`` is
    ``order[first[b]:first[b] + count[b]]``.
    """
    if not len(tab):
        z = np.empty(0, np.int64)
        return z, z, z
    cols = (tab.s, *tab.hi.T[::-1], *tab.lo.T[::-1], tab.layer, tab.group)
    order = np.lexsort(cols)
    key = np.column_stack([c[order] for c in cols[1:]])
    change = np.ones(len(order), bool)
    change[1:] = np.any(key[1:] != key[:-1], axis=1)
    first = np.flatnonzero(change)
    count = np.diff(np.append(first, len(order)))
    return order.astype(np.int64), first, count


def _box_candidates(old: RegionTable, new: RegionTable, o_rep: np.ndarray, n_rep: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of runs (old, new) that may overlap: same group, and where both runs are
    per-layer rows, a shared index of axis 0 (the layer; for experts the folded (layer,
    expert) index, so a layer's experts are not all paired with each other); a run spanning
    a layer range meets every run of its group.

    ``o_rep`` / ``n_rep``: a representative row of each run.
    """
    og, ng = old.group[o_rep].astype(np.int64), new.group[n_rep].astype(np.int64)
    ol, nl = old.layer[o_rep], new.layer[n_rep]
    old_layered, new_layered = ol >= 0, nl >= 0
    parts = []
    oi, ni = np.flatnonzero(old_layered), np.flatnonzero(new_layered)
    (ok, okey), (nk, nkey) = (_axis0_keys(tab, rep[idx], g[idx], idx) for tab, rep, g, idx in
                              ((old, o_rep, og, oi), (new, n_rep, ng, ni)))
    a, b = _join(okey, nkey)
    pair = np.unique(ok[a] * len(n_rep) + nk[b])
    parts.append((pair // len(n_rep), pair % len(n_rep)))
    for om, nm in ((~old_layered, np.ones(len(n_rep), bool)), (old_layered, ~new_layered)):
        oi, ni = np.flatnonzero(om), np.flatnonzero(nm)
        a, b = _join(og[oi], ng[ni])
        parts.append((oi[a], ni[b]))
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


def _axis0_keys(tab: RegionTable, rows: np.ndarray, group: np.ndarray, runs: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """(run, key) for every axis-0 index ``group * 2**40 + i`` a per-layer run's box spans."""
    lo, hi = tab.lo[rows, 0], tab.hi[rows, 0]
    n = hi - lo
    which = np.repeat(np.arange(len(rows)), n)
    i = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo, n)
    return runs[which], group[which] * (1 << 40) + i


def _expand_runs(first: np.ndarray, count: np.ndarray, runs: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(pair index, position in ``order``) for every row of every run in ``runs``."""
    n = count[runs]
    pair = np.repeat(np.arange(len(runs)), n)
    pos = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + np.repeat(first[runs], n)
    return pair, pos


def intersect(old: RegionTable, new: RegionTable) -> Fragments:
    """Every non-empty overlap between a row of ``old`` and a row of ``new``.

    Output-sensitive: rows are grouped into runs of one box (their intervals are disjoint
    and sorted), pairs of runs whose boxes meet are found per (group, layer) over boxes, not
    rows, and inside a pair of runs the overlaps come from one merge of two sorted interval
    lists. Cost: rows of each run times the boxes it meets, plus the overlaps found.
    """
    o_order, o_first, o_count = _box_runs(old)
    n_order, n_first, n_count = _box_runs(new)
    ro, rn = _box_candidates(old, new, o_order[o_first], n_order[n_first])
    rep_o, rep_n = o_order[o_first[ro]], n_order[n_first[rn]]
    xlo = np.maximum(old.lo[rep_o], new.lo[rep_n])
    xhi = np.minimum(old.hi[rep_o], new.hi[rep_n])
    ok = np.all(xhi > xlo, axis=1)
    ro, rn, xlo, xhi = ro[ok], rn[ok], xlo[ok], xhi[ok]
    # each pair of runs gets its own stretch [base, base + |X|) of one global line
    n_x = np.prod(xhi - xlo, axis=1)
    base = np.cumsum(n_x) - n_x
    sides = []
    for tab, order, first, count, runs in ((old, o_order, o_first, o_count, ro),
                                           (new, n_order, n_first, n_count, rn)):
        pair, pos = _expand_runs(first, count, runs)
        rows = order[pos]
        u, v = _restrict(tab, rows, xlo[pair], xhi[pair])
        keep = v > u
        sides.append((rows[keep], pair[keep], u[keep] + base[pair[keep]],
                      v[keep] + base[pair[keep]]))
    (o_rows, o_pair, ou, ov), (n_rows, _, nu, nv) = sides
    # a run's intervals are disjoint and sorted, and restriction keeps their order: both
    # lists are sorted on the global line, so each old interval meets a contiguous range
    _require_sorted(ou, ov, "old")
    _require_sorted(nu, nv, "new")
    lo_j = np.searchsorted(nv, ou, side="right")
    hi_j = np.searchsorted(nu, ov, side="left")
    n = np.maximum(hi_j - lo_j, 0)
    i = np.repeat(np.arange(len(ou)), n)
    j = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo_j, n)
    u, v = np.maximum(ou[i], nu[j]), np.minimum(ov[i], nv[j])
    pair = o_pair[i]
    frag = (o_rows[i], n_rows[j], xlo[pair], xhi[pair], u - base[pair], v - base[pair])
    order = np.lexsort((frag[0], frag[1]))
    return Fragments(*(x[order] for x in frag))


def _require_sorted(u: np.ndarray, v: np.ndarray, side: str) -> None:
    bad = np.flatnonzero(v[:-1] > u[1:])
    if len(bad):
        raise PlanError(f"invalid migration plan: {len(bad)} {side} regions overlap inside "
                        f"one box (first at line position {int(u[bad[0] + 1])})")
