"""Intersections of what an old layout holds with what a new layout needs.

Both tables' rows are (box, row-major interval) pairs. For two rows of one tensor group the
overlap lies in the box X = box_old ∩ box_new, and each row's interval restricted to X is an
interval of X's own row-major order (lexicographic order restricts to sub-boxes). So the
overlap is one interval ``[u, v)`` of X, found with a few integer operations per pair, all
vectorised over candidate pairs.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

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


def intersect(old: RegionTable, new: RegionTable, chunk: int = 2_000_000) -> Fragments:
    """Every non-empty overlap between a row of ``old`` and a row of ``new``.

    Rows are joined on (group, layer) where both are per-layer rows and on group otherwise,
    so candidate pairs stay close to the number of real overlaps.
    """
    parts = []
    for old_rows, new_rows in _candidates(old, new):
        for c in range(0, len(old_rows), chunk):
            parts.append(_overlap(old, new, old_rows[c:c + chunk], new_rows[c:c + chunk]))
    if not parts:
        z = np.empty(0, np.int64)
        return Fragments(z, z, np.empty((0, NDIM), np.int64), np.empty((0, NDIM), np.int64), z, z)
    cat = [np.concatenate(x) for x in zip(*parts)]
    frag = Fragments(*cat)
    order = np.lexsort((frag.old_row, frag.new_row))
    return Fragments(*(x[order] for x in cat))


def _candidates(old: RegionTable, new: RegionTable
                ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    n_layer_keys = 1 << 20
    old_layered, new_layered = old.layer >= 0, new.layer >= 0
    # per-layer rows against per-layer rows: key (group, layer)
    oi, ni = np.flatnonzero(old_layered), np.flatnonzero(new_layered)
    a, b = _join(old.group[oi].astype(np.int64) * n_layer_keys + old.layer[oi],
                 new.group[ni].astype(np.int64) * n_layer_keys + new.layer[ni])
    yield oi[a], ni[b]
    # any pair involving a row spanning a layer range (or a non-layer tensor): key group
    for om, nm in ((~old_layered, np.ones(len(new), bool)), (old_layered, ~new_layered)):
        oi, ni = np.flatnonzero(om), np.flatnonzero(nm)
        a, b = _join(old.group[oi].astype(np.int64), new.group[ni].astype(np.int64))
        yield oi[a], ni[b]


def _overlap(old: RegionTable, new: RegionTable, oi: np.ndarray, ni: np.ndarray
             ) -> tuple[np.ndarray, ...]:
    xlo = np.maximum(old.lo[oi], new.lo[ni])
    xhi = np.minimum(old.hi[oi], new.hi[ni])
    ok = np.all(xhi > xlo, axis=1)
    oi, ni, xlo, xhi = oi[ok], ni[ok], xlo[ok], xhi[ok]
    u0, v0 = _restrict(old, oi, xlo, xhi)
    u1, v1 = _restrict(new, ni, xlo, xhi)
    u, v = np.maximum(u0, u1), np.minimum(v0, v1)
    ok = v > u
    return oi[ok], ni[ok], xlo[ok], xhi[ok], u[ok], v[ok]
