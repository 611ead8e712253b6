"""The exact sketch where the class sketch leaves a gap: the assignment as a network flow.

A placement keeps C[d, r] = V[class(d), class(r)] + D[d, r] summed over its pairs (see
``cost.py``). As a flow network each source (a device, or a slot of tp devices) sends at
most one unit, either to its class node, from there along a class pair (value V) to the
class node of the destination and on to one destination (a new rank, or a tensor-parallel
group), or straight to a destination it shares shards with (value V + D). Every variable
sits in at most two flow constraints, so the matrix is a network matrix and the simplex
optimum is integral: an assignment. Its value is the most any assignment keeps, because
values are non-negative and a partial assignment is completed at no loss. A few hundred
thousand variables at 16,384 GPUs instead of the 268 M cells of the dense matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from .cost import CostMatrix
from .errors import PlanError
from .sketch import check_fit, node_slots


@dataclass(frozen=True)
class Assignment:
    """Sources onto destinations: ``value`` by class plus sparse ``pair_bytes``.

    Attributes:
        value: int64 (source classes, destination classes), non-negative.
        src_class: class of each source, -1 for one that holds nothing.
        dst_class: class of each destination.
        pair_src, pair_dst, pair_bytes: distinct (source, destination) pairs and the bytes
            they share beyond ``value``.
    """

    value: np.ndarray
    src_class: np.ndarray
    dst_class: np.ndarray
    pair_src: np.ndarray
    pair_dst: np.ndarray
    pair_bytes: np.ndarray

    def kept(self, src_of: np.ndarray) -> int:
        """Bytes kept when destination i takes source ``src_of[i]``."""
        cls = self.src_class[src_of]
        held = cls >= 0
        rep = int(self.value[cls[held], self.dst_class[held]].sum())
        hit = src_of[self.pair_dst] == self.pair_src
        return rep + int(self.pair_bytes[hit].sum())


def solve(problem: Assignment) -> tuple[int, np.ndarray]:
    """The most bytes any assignment keeps, and one assignment that keeps them.

    Returns (kept, src_of): src_of[i] is destination i's source; each source at most once.
    Destinations the flow leaves free take the free sources in order (identity first).
    """
    v, sc, dc = problem.value, problem.src_class, problem.dst_class
    n_src, n_dst = len(sc), len(dc)
    if n_dst > n_src:
        raise PlanError(f"invalid migration plan: {n_dst} destinations for {n_src} sources")
    a, b = np.nonzero(v > 0)
    held = np.flatnonzero(sc >= 0)
    p_src, p_dst = problem.pair_src, problem.pair_dst
    p_val = np.where(sc[p_src] >= 0, v[np.maximum(sc[p_src], 0), dc[p_dst]], 0) \
        + problem.pair_bytes
    n_y, n_z, n_f = len(a), len(p_src), len(held)
    o_z, o_f, o_g = n_y, n_y + n_z, n_y + n_z + n_f
    n_var = o_g + n_dst
    gain = np.concatenate([v[a, b], p_val, np.zeros(n_f + n_dst, np.int64)])
    # at most one unit out of each source and into each destination
    rows = np.concatenate([p_src, held, n_src + p_dst, n_src + np.arange(n_dst)])
    cols = np.concatenate([o_z + np.arange(n_z), o_f + np.arange(n_f),
                           o_z + np.arange(n_z), o_g + np.arange(n_dst)])
    a_ub = coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(n_src + n_dst, n_var))
    # class nodes conserve flow: sources in, class pairs through, destinations out
    n_a, n_b = v.shape
    rows = np.concatenate([sc[held], a, n_a + b, n_a + dc])
    cols = np.concatenate([o_f + np.arange(n_f), np.arange(n_y), np.arange(n_y),
                           o_g + np.arange(n_dst)])
    vals = np.concatenate([np.ones(n_f), -np.ones(n_y), np.ones(n_y), -np.ones(n_dst)])
    a_eq = coo_matrix((vals, (rows, cols)), shape=(n_a + n_b, n_var))
    scale = max(float(gain.max(initial=0)), 1.0)    # keeps HiGHS well conditioned
    res = linprog(-gain / scale, A_ub=a_ub.tocsr(), b_ub=np.ones(n_src + n_dst),
                  A_eq=a_eq.tocsr(), b_eq=np.zeros(n_a + n_b), bounds=(0, None),
                  method="highs-ds")
    if res.status != 0:
        raise PlanError(f"invalid migration plan: the exact sketch's flow failed: {res.message}")
    x = np.rint(res.x).astype(np.int64)
    if np.any(np.abs(res.x - x) > 1e-6):
        raise PlanError("invalid migration plan: the exact sketch's flow is fractional")
    src_of = _expand(problem, x, a, b, held, o_z, o_f, o_g)
    kept = problem.kept(src_of)
    if kept != int(gain @ x):
        raise PlanError(f"invalid migration plan: the exact sketch keeps {kept} bytes, its "
                        f"flow {int(gain @ x)}")
    return kept, src_of


def _expand(problem: Assignment, x: np.ndarray, a: np.ndarray, b: np.ndarray,
            held: np.ndarray, o_z: int, o_f: int, o_g: int) -> np.ndarray:
    """The flow as src_of: direct pairs, then class pairs in order, then the free ones."""
    sc, dc = problem.src_class, problem.dst_class
    n_src, n_dst = len(sc), len(dc)
    src_of = np.full(n_dst, -1, np.int64)
    z = np.flatnonzero(x[o_z:o_f])
    src_of[problem.pair_dst[z]] = problem.pair_src[z]
    via_src = held[x[o_f:o_g] > 0]              # ascending, so grouped by class stably
    via_dst = np.flatnonzero(x[o_g:] > 0)
    src_by = via_src[np.argsort(sc[via_src], kind="stable")]
    dst_by = via_dst[np.argsort(dc[via_dst], kind="stable")]
    src_next = np.searchsorted(sc[src_by], np.arange(sc.max(initial=-1) + 1))
    dst_next = np.searchsorted(dc[dst_by], np.arange(dc.max(initial=-1) + 1))
    for k in np.flatnonzero(x[:o_z]).tolist():
        i, j = int(src_next[a[k]]), int(dst_next[b[k]])
        n = int(x[k])
        src_of[dst_by[j:j + n]] = src_by[i:i + n]
        src_next[a[k]] += n
        dst_next[b[k]] += n
    free_dst = np.flatnonzero(src_of < 0)
    used = np.zeros(n_src, bool)
    used[src_of[src_of >= 0]] = True
    ident = free_dst[(free_dst < n_src)]
    ident = ident[~used[ident]]
    src_of[ident] = ident
    used[ident] = True
    rest = np.flatnonzero(src_of < 0)
    src_of[rest] = np.flatnonzero(~used)[:len(rest)]
    return src_of


def rank_problem(cost: CostMatrix) -> Assignment:
    """New ranks onto pool devices, unconstrained: the problem the byte lower bound solves."""
    return Assignment(cost.M, cost.pool_class, cost.rank_class, cost.dist_pool,
                      cost.dist_rank, cost.dist_bytes)


def kept_exact(cost: CostMatrix) -> tuple[int, np.ndarray]:
    """The most bytes any placement keeps, and one unconstrained placement keeping them."""
    return solve(rank_problem(cost))


def assign_exact_tp_in_node(cost: CostMatrix, tp: int, gpus_per_node: int
                            ) -> np.ndarray:
    """Tensor-parallel groups onto slots (aligned tp devices of a node), by the exact flow.

    Group g's rank g * tp + t runs on its slot's device t; the best such placement.
    """
    world = cost.shape[1]
    groups = world // tp
    slot_first, slot_node, start, _ = node_slots(cost.pool, tp, gpus_per_node)
    check_fit(groups, tp, slot_node, len(start))
    rep = np.vstack([cost.M, np.zeros((1, cost.M.shape[1]), np.int64)])
    dev_cls = np.where(cost.pool_class >= 0, cost.pool_class, cost.M.shape[0])
    s_cls, s_of = np.unique(dev_cls[slot_first[:, None] + np.arange(tp)], axis=0,
                            return_inverse=True)
    g_cls, g_of = np.unique(cost.rank_class.reshape(groups, tp), axis=0, return_inverse=True)
    value = sum(rep[s_cls[:, t]][:, g_cls[:, t]] for t in range(tp))
    slot_of = np.full(cost.shape[0], -1, np.int64)
    slot_of[slot_first[:, None] + np.arange(tp)] = np.arange(len(slot_first))[:, None]
    aligned = (slot_of[cost.dist_pool] >= 0) & (
        cost.dist_pool - slot_first[np.maximum(slot_of[cost.dist_pool], 0)]
        == cost.dist_rank % tp)
    key = slot_of[cost.dist_pool[aligned]] * groups + cost.dist_rank[aligned] // tp
    uk, inv = np.unique(key, return_inverse=True)
    pair_bytes = np.zeros(len(uk), np.int64)
    np.add.at(pair_bytes, inv, cost.dist_bytes[aligned])
    problem = Assignment(np.asarray(value, np.int64), s_of.ravel(), g_of.ravel(),
                         uk // groups, uk % groups, pair_bytes)
    _, slot_for = solve(problem)
    placement: np.ndarray = (slot_first[slot_for][:, None] + np.arange(tp)).ravel()
    return placement
