"""Cost matrix C[device][new rank]: bytes new rank needs that the device already holds.

Built from fragments, never by pairwise loops over devices: replicated state collapses to a
small matrix over (old holding class, new holding class), the distributed
optimizer's shards to a sparse list of (old rank, new rank, bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .catalog import Catalog
from .config import Layout, ParallelConfig
from .intersect import Fragments
from .regions import RegionTable


def _cross(ptr_a: np.ndarray, idx_a: np.ndarray, ptr_b: np.ndarray, idx_b: np.ndarray,
           rows_a: np.ndarray, rows_b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each pair k, every (x, y) with x in set_a[rows_a[k]], y in set_b[rows_b[k]]."""
    na = ptr_a[rows_a + 1] - ptr_a[rows_a]
    nb = ptr_b[rows_b + 1] - ptr_b[rows_b]
    n = na * nb
    k = np.repeat(np.arange(len(n)), n)
    off = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    x = idx_a[ptr_a[rows_a[k]] + off // nb[k]]
    y = idx_b[ptr_b[rows_b[k]] + off % nb[k]]
    return k, x, y


@dataclass(frozen=True)
class CostMatrix:
    """C = M[class(device), class(rank)] + D[device, rank] over the placement pool.

    Attributes:
        pool: device ids new ranks may be placed on, ascending.
        pool_old_rank: old rank of each pool device, -1 for devices the job did not hold.
        rank_class: new model-parallel class of each new rank.
        M: int64 (old classes, new classes), replicated state both hold.
        dist_pool, dist_rank, dist_bytes: sparse distributed-optimizer overlaps.
    """

    pool: np.ndarray
    pool_old_rank: np.ndarray
    pool_class: np.ndarray
    rank_class: np.ndarray
    M: np.ndarray
    dist_pool: np.ndarray
    dist_rank: np.ndarray
    dist_bytes: np.ndarray
    needed_bytes: int

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.pool), len(self.rank_class)

    def dense(self) -> np.ndarray:
        """The full matrix (pool devices x new ranks) as int64."""
        c = np.zeros(self.shape, np.int64)
        held = self.pool_class >= 0
        c[held] = self.M[self.pool_class[held]][:, self.rank_class]
        np.add.at(c, (self.dist_pool, self.dist_rank), self.dist_bytes)
        return c

    def kept(self, placement: np.ndarray) -> int:
        """Bytes kept in place when new rank r runs on pool device ``placement[r]``."""
        cls = self.pool_class[placement]
        held = cls >= 0
        rep = int(self.M[cls[held], self.rank_class[held]].sum())
        hit = placement[self.dist_rank] == self.dist_pool
        return rep + int(self.dist_bytes[hit].sum())


def build_cost(catalog: Catalog, old: Layout, new: ParallelConfig, pool: np.ndarray,
               old_tab: RegionTable, new_tab: RegionTable, frag: Fragments) -> CostMatrix:
    bpe = np.array([g.bytes_per_element for g in catalog.groups], np.int64)
    nbytes = frag.count * bpe[old_tab.group[frag.old_row]]
    oc, nc = old.config, new
    dist = old_tab.dp_rank[frag.old_row] >= 0
    # replicated x replicated: class pairs
    rep = np.flatnonzero(~dist)
    M = np.zeros((oc.classes, nc.classes), np.int64)
    k, x, y = _cross(old_tab.class_ptr, old_tab.class_idx, new_tab.class_ptr, new_tab.class_idx,
                     frag.old_row[rep], frag.new_row[rep])
    np.add.at(M, (x, y), nbytes[rep][k])
    # distributed optimizer shards: rank pairs
    dis = np.flatnonzero(dist)
    k, x, y = _cross(old_tab.class_ptr, old_tab.class_idx, new_tab.class_ptr, new_tab.class_idx,
                     frag.old_row[dis], frag.new_row[dis])
    ow, nw, orep, nrep = oc.class_width, nc.class_width, oc.replicas, nc.replicas
    o_rank = (x % ow) + ow * (old_tab.dp_rank[frag.old_row[dis]][k] + orep * (x // ow))
    n_rank = (y % nw) + nw * (new_tab.dp_rank[frag.new_row[dis]][k] + nrep * (y // nw))
    o_dev = np.asarray(old.devices, np.int64)[o_rank]
    pidx = np.searchsorted(pool, o_dev)
    in_pool = (pidx < len(pool)) & (pool[np.minimum(pidx, len(pool) - 1)] == o_dev)
    key = pidx[in_pool] * nc.world + n_rank[in_pool]
    uk, inv = np.unique(key, return_inverse=True)
    db = np.zeros(len(uk), np.int64)
    np.add.at(db, inv, nbytes[dis][k][in_pool])
    # pool bookkeeping
    old_dev = np.asarray(old.devices, np.int64)
    pool_old_rank = np.full(len(pool), -1, np.int64)
    where = np.searchsorted(pool, old_dev)
    ok = (where < len(pool)) & (pool[np.minimum(where, len(pool) - 1)] == old_dev)
    pool_old_rank[where[ok]] = np.flatnonzero(ok)
    pool_class = np.where(pool_old_rank >= 0,
                          (pool_old_rank % ow) + ow * (pool_old_rank // (ow * orep)), -1)
    ranks = np.arange(nc.world)
    rank_class = (ranks % nw) + nw * (ranks // (nw * nrep))
    needed = int((new_tab.count * bpe[new_tab.group] * _holders(new_tab)).sum())
    return CostMatrix(pool, pool_old_rank, pool_class, rank_class, M,
                      uk // nc.world, uk % nc.world, db, needed)


def _holders(tab: RegionTable) -> np.ndarray:
    n_cls = np.diff(tab.class_ptr)
    return n_cls * np.where(tab.dp_rank < 0, tab.config.replicas, 1)
