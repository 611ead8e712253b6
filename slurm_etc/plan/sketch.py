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
from .errors import ConfigError

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





def assign_unconstrained(cost: CostMatrix, c: np.ndarray) -> np.ndarray:
    """Pool index of each new rank maximising kept bytes (the byte lower bound's placement).

    ``c`` is ``cost.dense()``.
    """
    n_pool, world = cost.shape
    ident = np.where(np.arange(world) < n_pool, np.arange(world), -1)
    return _solve(c.T, ident)


def node_slots(pool: np.ndarray, tp: int, gpus_per_node: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Slots for tensor-parallel groups: aligned blocks of ``tp`` pool devices in one node.

    Returns (slot_first, slot_node, node_start, node_size): each slot's first pool index and
    node index, and each node's range of pool indices.
    """
    node = pool // gpus_per_node
    _, start, size = np.unique(node, return_index=True, return_counts=True)
    per = size // tp
    slot_node = np.repeat(np.arange(len(start)), per)
    within = np.arange(len(slot_node)) - np.repeat(np.cumsum(per) - per, per)
    slot_first = start[slot_node] + within * tp
    return slot_first, slot_node, start, size


def check_fit(groups: int, tp: int, slot_node: np.ndarray, n_nodes: int) -> None:
    if len(slot_node) < groups:
        raise ConfigError(f"{groups} tensor-parallel groups of {tp} do not fit in the "
                          f"{n_nodes} nodes given ({len(slot_node)} slots of {tp} devices)")


def assign_tp_in_node(cost: CostMatrix, c: np.ndarray, tp: int, gpus_per_node: int) -> np.ndarray:
    """Like assign_unconstrained, with every group of ``tp`` consecutive ranks in one node.

    Level 1 places groups on slots (aligned blocks of tp devices, so two groups never count
    on the same device); level 2 re-solves each node exactly, ranks onto its devices.
    """
    n_pool, world = cost.shape
    groups = world // tp
    slot_first, slot_node, start, size = node_slots(cost.pool, tp, gpus_per_node)
    check_fit(groups, tp, slot_node, len(start))
    # value of group g on slot k: each rank keeps its best device's bytes in the slot
    rows = (slot_first[:, None] + np.arange(tp)).ravel()
    best = np.maximum.reduceat(c[rows], np.arange(0, len(rows), tp), axis=0)   # (slots, world)
    value = best.reshape(len(slot_first), groups, tp).sum(axis=2).T            # (groups, slots)
    ident = np.full(groups, -1)
    hit = np.searchsorted(slot_first, np.arange(groups) * tp)
    ok = (hit < len(slot_first)) & (slot_first[np.minimum(hit, len(slot_first) - 1)] ==
                                    np.arange(groups) * tp)
    ident[ok] = hit[ok]
    group_node = slot_node[_solve(value, ident)]
    placement = np.empty(world, np.int64)
    for n in np.unique(group_node):
        ranks = (np.flatnonzero(group_node == n)[:, None] * tp + np.arange(tp)).ravel()
        devs = np.arange(start[n], start[n] + size[n])
        pos = np.searchsorted(devs, ranks).clip(0, len(devs) - 1)
        ident = np.where(devs[pos] == ranks, pos, -1)
        placement[ranks] = devs[_solve(c[np.ix_(devs, ranks)].T, ident)]
    return placement
