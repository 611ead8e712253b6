"""Migration sketch: which pool device each new rank runs on.

Maximises the bytes kept in place (a linear assignment over the cost matrix). With
``keep_tp_in_node`` every tensor-parallel group of the new layout lands inside one node:
first tensor-parallel groups are assigned to node slots (value of a group on a node = what
its ranks could keep there), then, inside each node, ranks to devices exactly.
Ties are broken towards identity placement (new rank i on pool device i), so the same
inputs always give the same sketch.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

from .cost import CostMatrix

# Tie-break weight, far below one byte in total.
_BONUS = 0.25


def _solve(value: np.ndarray, bonus_cols: np.ndarray | None = None) -> np.ndarray:
    """Column chosen for each row maximising value (+ a sub-byte bonus on bonus_cols)."""
    v = value.astype(np.float64)
    if bonus_cols is not None:
        rows = np.flatnonzero(bonus_cols >= 0)
        v[rows, bonus_cols[rows]] += _BONUS / max(len(value), 1)
    r, c = linear_sum_assignment(v, maximize=True)
    out = np.empty(len(value), np.int64)
    out[r] = c
    return out


def identity_placement(cost: CostMatrix) -> np.ndarray:
    return np.arange(cost.shape[1])


def assign_unconstrained(cost: CostMatrix) -> np.ndarray:
    """Pool index of each new rank maximising kept bytes (the byte lower bound's placement)."""
    n_pool, world = cost.shape
    ident = np.where(np.arange(world) < n_pool, np.arange(world), -1)
    return _solve(cost.dense().T, ident)


def assign_tp_in_node(cost: CostMatrix, tp: int, gpus_per_node: int) -> np.ndarray:
    """Like assign_unconstrained, with every group of ``tp`` consecutive ranks in one node."""
    n_pool, world = cost.shape
    if tp == 1:
        return assign_unconstrained(cost)
    c = cost.dense()
    node = cost.pool // gpus_per_node
    nodes, start, size = np.unique(node, return_index=True, return_counts=True)
    groups = world // tp
    # value of group g on node n: each rank keeps its best device's bytes there
    best = np.maximum.reduceat(c, start, axis=0)                    # (nodes, world)
    value = best.reshape(len(nodes), groups, tp).sum(axis=2).T        # (groups, nodes)
    slots = size // tp
    slot_node = np.repeat(np.arange(len(nodes)), slots)
    if len(slot_node) < groups:
        from .errors import ConfigError
        raise ConfigError(f"{groups} tensor-parallel groups of {tp} do not fit in the "
                          f"{len(nodes)} nodes given ({int(slots.sum())} slots of {tp} devices)")
    # prefer the node that identity placement would use
    ident_node = np.searchsorted(nodes, node[np.minimum(np.arange(groups) * tp, n_pool - 1)])
    slot_bonus = np.full(groups, -1)
    for g in range(groups):
        hit = np.flatnonzero(slot_node == ident_node[g])
        slot_bonus[g] = hit[0] if len(hit) else -1
    group_slot = _solve(value[:, slot_node], slot_bonus)
    group_node = slot_node[group_slot]
    placement = np.empty(world, np.int64)
    for n in np.unique(group_node):
        ranks = (np.flatnonzero(group_node == n)[:, None] * tp + np.arange(tp)).ravel()
        devs = np.arange(start[n], start[n] + size[n])
        ident = np.array([np.searchsorted(devs, r) if r in devs else -1 for r in ranks])
        placement[ranks] = devs[_solve(c[np.ix_(devs, ranks)].T, ident)]
    return placement
