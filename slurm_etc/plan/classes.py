"""Sketch at cluster scale: assignment over classes of interchangeable devices and ranks.

Devices that held the same model-parallel shard are interchangeable for the replicated
state, and so are new ranks that need the same shard. The dense assignment over devices
collapses to a transportation problem over (old class, new class) - a few hundred cells
instead of hundreds of millions - whose basic optimal solutions are integral. The solution
is expanded deterministically (identity placement first), and inside each block the
distributed optimizer's shards are matched exactly. With tensor-parallel groups kept in a
node, groups are placed on node slots the same way, then ranks on devices per node.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment, linprog
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from .cost import CostMatrix
from .errors import PlanError
from .sketch import check_fit, node_slots


def transport(value: np.ndarray, supply: np.ndarray, demand: np.ndarray
              ) -> tuple[np.ndarray, float]:
    """Integral x maximising sum(value * x), row sums <= supply, column sums == demand."""
    n_a, n_b = value.shape
    cells = np.arange(n_a * n_b)
    a_ub = csr_matrix((np.ones(n_a * n_b), (cells // n_b, cells)), shape=(n_a, n_a * n_b))
    a_eq = csr_matrix((np.ones(n_a * n_b), (cells % n_b, cells)), shape=(n_b, n_a * n_b))
    # scale to keep HiGHS well conditioned; integrality comes from the network structure
    scale = max(float(np.abs(value).max()), 1.0)
    res = linprog(-(value.ravel() / scale), A_ub=a_ub, b_ub=supply,
                  A_eq=a_eq, b_eq=demand, bounds=(0, None), method="highs-ds")
    if res.status != 0:
        raise PlanError(f"invalid migration plan: class transport failed: {res.message}")
    x = np.rint(res.x).reshape(n_a, n_b).astype(np.int64)
    if np.any(np.abs(res.x - x.ravel()) > 1e-6) or np.any(x.sum(axis=0) != demand):
        raise PlanError("invalid migration plan: class transport returned a fractional solution")
    return x, float((value * x).sum())


def _rep_value(cost: CostMatrix) -> np.ndarray:
    """M with a zero row for devices that hold nothing (class -1 -> last row)."""
    return np.vstack([cost.M, np.zeros((1, cost.M.shape[1]), np.int64)])


def _pool_class(cost: CostMatrix) -> np.ndarray:
    cls = cost.pool_class.copy()
    cls[cls < 0] = cost.M.shape[0]
    return cls


def _forced_pairs(value: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The pairs of ``pick_pairs`` with k = rows when they are forced (see there), else None."""
    n_rows, n_cols = value.shape
    if n_rows == 0 or n_rows > n_cols or n_cols < 2 or float(value.min()) < 0:
        return None
    best = np.argmax(value, axis=1)
    top = value[np.arange(n_rows), best]
    second = np.partition(value, n_cols - 2, axis=1)[:, n_cols - 2]
    pos = top > 0
    if np.any(pos & (top <= second)):
        return None
    taken = best[pos]
    if len(np.unique(taken)) != len(taken):
        return None
    return np.arange(n_rows), _with_free_columns(pos, taken, n_cols)


def _with_free_columns(pos: np.ndarray, taken: np.ndarray, n_cols: int) -> np.ndarray:
    """Each row's column: its own best (``taken``, distinct) where it gains (``pos``), the
    columns nobody took, in order, for the rest."""
    col = np.empty(len(pos), np.int64)
    col[pos] = taken
    free = np.ones(n_cols, bool)
    free[taken] = False
    col[~pos] = np.flatnonzero(free)[:int((~pos).sum())]
    return col


def pick_pairs(value: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exactly k (row, column) pairs, each row and column at most once, maximising value.

    Where every row is placed (k = rows), values are non-negative and each row with a
    positive best has a strictly best column no other such row wants, those pairs are an
    optimum (each such row gets its maximum; the other rows are all zero and take the
    lowest free columns in order): no assignment solve is needed.
    """
    n_rows, n_cols = value.shape
    forced = _forced_pairs(value) if k == n_rows else None
    if forced is not None:
        return forced
    idle = n_cols - k
    big = float(np.abs(value).sum()) + 1.0
    padded = np.vstack([value.astype(np.float64), np.full((idle, n_cols), big)])
    r, c = linear_sum_assignment(padded, maximize=True)
    real = r < n_rows
    return r[real], c[real]


class _ShardLookup:
    """Dense blocks of the sparse shard-overlap matrix D, cut by pool-index ranges."""

    def __init__(self, cost: CostMatrix) -> None:
        order = np.argsort(cost.dist_pool, kind="stable")
        self.pool = cost.dist_pool[order]
        self.rank = cost.dist_rank[order]
        self.bytes = cost.dist_bytes[order].astype(np.float64)
        self.slot = np.full(cost.shape[1], -1, np.int64)

    def block(self, devs: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """D[devs][:, ranks] as a dense (len(devs), len(ranks)) array; devs ascending."""
        out = np.zeros((len(devs), len(ranks)))
        pos, col, nbytes = self.entries(devs, ranks)
        np.add.at(out, (pos, col), nbytes)
        return out

    def entries(self, devs: np.ndarray, ranks: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The non-zero entries of :meth:`block` before they are summed: (index in
        ``devs``, index in ``ranks``, bytes), in the order ``block`` adds them."""
        empty = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0))
        if not len(devs) or not len(ranks):
            return empty
        lo, hi = np.searchsorted(self.pool, [devs[0], devs[-1] + 1])
        if hi <= lo:
            return empty
        self.slot[ranks] = np.arange(len(ranks))
        pos = np.searchsorted(devs, self.pool[lo:hi]).clip(0, len(devs) - 1)
        col = self.slot[self.rank[lo:hi]]
        ok = (col >= 0) & (devs[pos] == self.pool[lo:hi])
        self.slot[ranks] = -1
        return pos[ok], col[ok], self.bytes[lo:hi][ok]


def _match_block(cost: CostMatrix, shards: _ShardLookup, devs: np.ndarray, ranks: np.ndarray,
                 value: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """Exact assignment of ranks onto devs (len(devs) >= len(ranks)); identity on ties.

    ``cls``: ``_pool_class(cost)``, computed once by the caller.
    """
    block = value[cls[devs]][:, cost.rank_class[ranks]].astype(np.float64)
    block += shards.block(devs, ranks)
    bonus = (devs[:, None] == ranks[None, :]) * (0.25 / max(len(ranks), 1))
    r, c = linear_sum_assignment((block + bonus).T, maximize=True)
    out = np.empty(len(ranks), np.int64)
    out[r] = devs[c]
    return out


def _match_nodes(cost: CostMatrix, shards: _ShardLookup, start: np.ndarray, size: np.ndarray,
                 nodes: np.ndarray, members: list[np.ndarray], tp: int, value: np.ndarray,
                 cls: np.ndarray, placement: np.ndarray) -> None:
    """``_match_block`` for every node at once where the answer is forced.

    Node k holds the ranks of tensor-parallel groups ``members[k]``. Where every rank's best
    device in its node is strictly best and no two ranks want the same device, that
    permutation is the unique optimum of the node's assignment, read off for all nodes with
    a few array operations; only the other nodes are solved one by one. Fills
    ``placement`` in place.
    """
    n_nodes = len(nodes)
    dev_n = size[nodes]
    rank_n = np.array([len(m) * tp for m in members], np.int64)
    dm, rm = int(dev_n.max()), int(rank_n.max())
    devs = start[nodes][:, None] + np.arange(dm)[None, :]
    dev_ok = np.arange(dm)[None, :] < dev_n[:, None]
    devs = np.where(dev_ok, devs, 0)
    ranks = np.zeros((n_nodes, rm), np.int64)
    rank_ok = np.arange(rm)[None, :] < rank_n[:, None]
    ranks[rank_ok] = np.concatenate([(m[:, None] * tp + np.arange(tp)).ravel()
                                     for m in members])
    block = value[cls[devs][:, :, None], cost.rank_class[ranks][:, None, :]].astype(np.float64)
    # shard bytes of (device, rank) pairs in the same node
    node_pos = np.full(len(size), -1, np.int64)
    node_pos[nodes] = np.arange(n_nodes)
    rank_node = np.full(cost.shape[1], -1, np.int64)
    rank_slot = np.zeros(cost.shape[1], np.int64)
    rank_node[ranks[rank_ok]] = np.repeat(np.arange(n_nodes), rank_n)
    rank_slot[ranks[rank_ok]] = np.nonzero(rank_ok)[1]
    pool_node = node_pos[np.searchsorted(start, shards.pool, side="right") - 1]
    same = (pool_node >= 0) & (pool_node == rank_node[shards.rank])
    k = pool_node[same]
    d_slot = shards.pool[same] - start[nodes][k]
    flat = (k * dm + d_slot) * rm + rank_slot[shards.rank[same]]
    block += np.bincount(flat, shards.bytes[same], minlength=n_nodes * dm * rm).reshape(
        n_nodes, dm, rm)
    block += (devs[:, :, None] == ranks[:, None, :]) * (0.25 / np.maximum(rank_n, 1))[:, None,
                                                                                      None]
    block = np.where(dev_ok[:, :, None], block, -np.inf)
    best = np.argmax(block, axis=1)                                 # (nodes, ranks)
    top = np.take_along_axis(block, best[:, None, :], axis=1)[:, 0, :]
    runner = block.copy()
    np.put_along_axis(runner, best[:, None, :], -np.inf, axis=1)
    strict = np.all((top > runner.max(axis=1)) | ~rank_ok, axis=1)
    picked = np.sort(np.where(rank_ok, best, -1 - np.arange(rm)[None, :]), axis=1)
    distinct = np.all(picked[:, 1:] != picked[:, :-1], axis=1)
    forced = strict & distinct
    placement[ranks[forced][rank_ok[forced]]] = np.take_along_axis(
        devs, best, axis=1)[forced][rank_ok[forced]]
    for k in np.flatnonzero(~forced).tolist():
        n = int(nodes[k])
        r = ranks[k, :rank_n[k]]
        d = np.arange(start[n], start[n] + size[n])
        placement[r] = _match_block(cost, shards, d, r, value, cls)


def _group_slot_overlap(cost: CostMatrix, slot_first: np.ndarray, tp: int) -> csr_matrix:
    """Sparse (groups x slots): shard bytes each group's ranks could keep in the slot."""
    slot_of = np.full(cost.shape[0], -1, np.int64)
    slot_of[(slot_first[:, None] + np.arange(tp)).ravel()] = np.repeat(
        np.arange(len(slot_first)), tp)
    s_idx = slot_of[cost.dist_pool]
    ok = s_idx >= 0
    key = s_idx[ok] * cost.shape[1] + cost.dist_rank[ok]
    uk, inv = np.unique(key, return_inverse=True)
    best = np.zeros(len(uk), np.float64)
    np.maximum.at(best, inv, cost.dist_bytes[ok])
    groups = cost.shape[1] // tp
    return csr_matrix((best, ((uk % cost.shape[1]) // tp, uk // cost.shape[1])),
                      shape=(groups, len(slot_first)))


def kept_upper_bound(cost: CostMatrix) -> int:
    """No placement keeps more: class transport optimum + a bound on the shard bytes kept.

    A placement keeps the shard bytes of one matching of new ranks to devices in the
    shard-overlap graph D. Per connected component of D, that is at most each rank's best
    overlap summed, and at most each device's best overlap summed (a device runs one rank):
    the smaller of the two. Cheap, and met by most class placements; where it is not,
    ``flow.kept_exact`` gives the exact bound.
    """
    value = _rep_value(cost)
    cls = _pool_class(cost)
    supply = np.bincount(cls, minlength=value.shape[0])
    demand = np.bincount(cost.rank_class, minlength=value.shape[1])
    _, rep = transport(value, supply, demand)
    return int(round(rep)) + _shard_upper_bound(cost)


def _shard_upper_bound(cost: CostMatrix) -> int:
    n_pool, world = cost.shape
    if not len(cost.dist_rank):
        return 0
    graph = csr_matrix((np.ones(len(cost.dist_rank)), (cost.dist_rank, world + cost.dist_pool)),
                       shape=(world + n_pool, world + n_pool))
    _, label = connected_components(graph, directed=False)
    by_rank = np.zeros(world, np.int64)
    np.maximum.at(by_rank, cost.dist_rank, cost.dist_bytes)
    by_device = np.zeros(n_pool, np.int64)
    np.maximum.at(by_device, cost.dist_pool, cost.dist_bytes)
    n_comp = int(label.max()) + 1
    side_r = np.bincount(label[:world], by_rank, minlength=n_comp)
    side_d = np.bincount(label[world:], by_device, minlength=n_comp)
    return int(np.minimum(side_r, side_d).astype(np.int64).sum())


def _block_gain(shards: _ShardLookup, devs: np.ndarray, ranks: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The non-zero cells of ``shards.block(devs, ranks).T + (ranks == devs) * 0.25`` (the
    gain of rank ``ranks[i]`` on device ``devs[j]``) as (i, j, value), one per cell, row by
    row, each summed in the order the dense block sums it (the same floats)."""
    if not len(devs) or not len(ranks):
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0)
    pos, col, nbytes = shards.entries(devs, ranks)
    at = np.searchsorted(devs, ranks).clip(0, len(devs) - 1)
    same = np.flatnonzero(devs[at] == ranks)
    rows = np.concatenate([col, same])
    cols = np.concatenate([pos, at[same]])
    vals = np.concatenate([nbytes, np.full(len(same), 0.25)])
    key, inv = np.unique(rows * len(devs) + cols, return_inverse=True)
    summed = np.bincount(inv.ravel(), vals, minlength=len(key))
    keep = summed != 0
    return key[keep] // len(devs), key[keep] % len(devs), summed[keep]


def _strict_best(line: np.ndarray, other: np.ndarray, vals: np.ndarray, n_lines: int,
                 n_other: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per line (row or column) of a non-negative sparse matrix given as (line, other, vals)
    cells: its largest value, where it is (its lowest index on a tie; -1 for an empty
    line), and whether that largest is strictly above every other value of the line, the
    zeros of the cells not given included."""
    top = np.zeros(n_lines)
    best = np.full(n_lines, -1, np.int64)
    second = np.zeros(n_lines)
    if len(vals):
        order = np.lexsort((other, -vals, line))    # by line, then value down, index up
        ln, ot, v = line[order], other[order], vals[order]
        first = np.r_[True, ln[1:] != ln[:-1]]
        top[ln[first]], best[ln[first]] = v[first], ot[first]
        nxt = np.flatnonzero(first) + 1
        has = (nxt < len(ln)) & (ln[np.minimum(nxt, len(ln) - 1)] == ln[first])
        second[ln[first][has]] = v[nxt[has]]
    # a line without a value in every cell has a zero there: the runner-up is at least 0
    return top, best, (top > second) & (n_other >= 2)


def _pick_block(shards: _ShardLookup, devs: np.ndarray, ranks: np.ndarray, k: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """``pick_pairs`` of the gain of ``ranks`` (rows) on ``devs`` (columns) (see
    :func:`_block_gain`), the same pairs, without the dense block where the answer is
    forced: ``k`` = rows, as ``_forced_pairs`` reads it; or ``k`` = columns with every
    column's best row strictly best and no two columns wanting one row, the unique optimum
    (any other choice gives some column less than its best), which the assignment solve
    finds too. Else the dense block and ``pick_pairs``."""
    n_rows, n_cols = len(ranks), len(devs)
    rows, cols, vals = _block_gain(shards, devs, ranks)
    if n_rows and k == n_rows and n_rows <= n_cols:
        top, best, strict = _strict_best(rows, cols, vals, n_rows, n_cols)
        pos = top > 0
        if n_cols >= 2 and not np.any(pos & ~strict):
            taken = best[pos]
            if len(np.unique(taken)) == len(taken):
                return np.arange(n_rows), _with_free_columns(pos, taken, n_cols)
    elif n_cols and k == n_cols and n_cols < n_rows:
        top, best, strict = _strict_best(cols, rows, vals, n_cols, n_rows)
        if np.all(strict) and len(np.unique(best)) == n_cols:
            order = np.argsort(best)  # rows ascending, as the solve returns them
            return best[order], order
    gain = np.zeros((n_rows, n_cols))
    gain[rows, cols] = vals
    return pick_pairs(gain, k)


def assign_classes(cost: CostMatrix) -> np.ndarray:
    """Pool index of each new rank, maximising replicated bytes kept, then shard bytes."""
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
            r, c = _pick_block(shards, devs, ranks, int(x[a, b]))
            placement[ranks[r]] = devs[c]
            free[a] = np.delete(devs, c)
            ranks = np.delete(ranks, r)
    return placement


def assign_classes_tp_in_node(cost: CostMatrix, tp: int, gpus_per_node: int) -> np.ndarray:
    """Tensor-parallel groups onto slots (aligned tp-device blocks) by class, then per node."""
    value = _rep_value(cost)
    cls = _pool_class(cost)
    world = cost.shape[1]
    groups = world // tp
    slot_first, slot_node, start, size = node_slots(cost.pool, tp, gpus_per_node)
    check_fit(groups, tp, slot_node, len(start))
    g_cls, g_of = np.unique(cost.rank_class.reshape(groups, tp), axis=0, return_inverse=True)
    slot_devs = slot_first[:, None] + np.arange(tp)
    s_cls, s_of = np.unique(np.sort(cls[slot_devs], axis=1), axis=0, return_inverse=True)
    # value of one group of class gc on a slot of class sc: each rank's best device there
    v = np.stack([value[sig].max(axis=0)[g_cls].sum(axis=1) for sig in s_cls])
    x, _ = transport(v, np.bincount(s_of, minlength=len(s_cls)),
                     np.bincount(g_of, minlength=len(g_cls)))
    # expand each (slot class, group class) block maximising shard bytes kept, identity on ties
    shard = _group_slot_overlap(cost, slot_first, tp)
    free = np.ones(len(slot_first), bool)
    group_node = np.full(groups, -1, np.int64)
    ident_slot = np.searchsorted(slot_first, np.arange(groups) * tp)
    for gc in range(len(g_cls)):
        members = np.flatnonzero(g_of == gc)
        for sc in np.flatnonzero(x[:, gc]):
            cand = np.flatnonzero((s_of == sc) & free)
            gain = shard[members][:, cand].toarray()
            gain += (ident_slot[members][:, None] == cand[None, :]) * 0.25
            r, c = pick_pairs(gain, int(x[sc, gc]))
            group_node[members[r]] = slot_node[cand[c]]
            free[cand[c]] = False
            members = np.delete(members, r)
    shards = _ShardLookup(cost)
    placement = np.empty(world, np.int64)
    by_node = np.argsort(group_node, kind="stable")
    nodes, first = np.unique(group_node[by_node], return_index=True)
    _match_nodes(cost, shards, start, size, nodes, np.split(by_node, first[1:]), tp, value, cls,
                 placement)
    return placement
