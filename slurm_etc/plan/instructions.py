"""Fine-grained instructions: which device sends which region to which new rank.

Every fragment a new rank needs either is already on its device (a local copy) or gets one
source among the surviving old devices holding a replica (lost devices send nothing):
the holders on the destination's node if any, else all of them. All of it is vectorised
(no Python loop per transfer): holders are spelled once per holder set; what a new rank
needs from one candidate list is a bundle sent by one device (one message, not one per
fragment); bundles with one candidate are forced; a bundle at most as big as a forced one
to the same new rank rides with that message where its sender holds the rows; the rest
are dealt biggest first, boustrophedon, over the list ordered by the bytes its members
already send. Transfers between one pair of devices are then coalesced into one message
whose offset table says where each region is packed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import Layout
from .errors import PlanError
from .intersect import Fragments, _join
from .regions import RegionTable


@dataclass(frozen=True)
class Transfers:
    """One row per (fragment, new rank): a region copied from ``src`` to ``dst``.

    ``src == dst`` rows are local copies. Rows are sorted by (src, dst, new rank, new row,
    old row); ``msg`` numbers the message a row travels in (-1 for local copies) and
    ``offset`` is its byte offset in that message's packed buffer.
    """

    src: np.ndarray       # device ids
    dst: np.ndarray
    dst_rank: np.ndarray  # new rank
    src_rank: np.ndarray  # old rank of the source device
    frag: np.ndarray      # index into Fragments
    nbytes: np.ndarray
    msg: np.ndarray
    offset: np.ndarray

    def __len__(self) -> int:
        return len(self.src)

    @property
    def local(self) -> np.ndarray:
        local: np.ndarray = self.src == self.dst
        return local


def needs(new_tab: RegionTable, frag: Fragments) -> tuple[np.ndarray, np.ndarray]:
    """Every (fragment, new rank) pair: each new rank needs every fragment of its rows."""
    ranks, rows = new_tab.rank_rows
    f, k = _join(frag.new_row, rows)
    return f, ranks[k]


def holder_keys(old_tab: RegionTable) -> np.ndarray:
    """Sorted keys old_rank * rows + row for every (old rank, row) holding."""
    ranks, rows = old_tab.rank_rows
    return np.sort(ranks * len(old_tab) + rows)


def _holder_sets(old: Layout, old_tab: RegionTable, rows: np.ndarray, alive: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows holding alike share one holder set: (set of each row, CSR ptr, ranks ascending).

    A row's holders are its classes times its dp rank (or every dp rank), so rows with the
    same classes and dp rank have the same surviving holders; each set is spelled once.
    """
    cfg = old.config
    ptr, idx = old_tab.class_ptr, old_tab.class_idx
    n_cls = (ptr[rows + 1] - ptr[rows]).astype(np.int64)
    width = int(n_cls.max(initial=1))
    pad = np.full((len(rows), width), -1, np.int64)
    col = np.arange(width)
    filled = col[None, :] < n_cls[:, None]
    pad[filled] = idx[(ptr[rows][:, None] + col[None, :])[filled]]
    key = np.column_stack([old_tab.dp_rank[rows].astype(np.int64), pad])
    uniq, row_set = np.unique(key, axis=0, return_inverse=True)
    # every (set, holder rank), sorted by set then rank
    dp_of = uniq[:, 0]
    cls = uniq[:, 1:]
    s_idx, c_pos = np.nonzero(cls >= 0)
    c = cls[s_idx, c_pos]
    reps = np.where(dp_of[s_idx] < 0, cfg.replicas, 1)
    s_all = np.repeat(s_idx, reps)
    c_all = np.repeat(c, reps)
    within = np.arange(len(s_all)) - np.repeat(np.cumsum(reps) - reps, reps)
    d_all = np.where(np.repeat(dp_of[s_idx] < 0, reps), within, np.repeat(dp_of[s_idx], reps))
    w = cfg.class_width
    ranks = (c_all % w) + w * (d_all + cfg.replicas * (c_all // w))
    if alive is not None:
        keep = alive[ranks]
        s_all, ranks = s_all[keep], ranks[keep]
    order = np.lexsort((ranks, s_all))
    s_all, ranks = s_all[order], ranks[order]
    set_ptr = np.searchsorted(s_all, np.arange(len(uniq) + 1))
    return row_set.ravel().astype(np.int64), set_ptr.astype(np.int64), ranks.astype(np.int64)


def _prefer_forced_senders(b_pick: np.ndarray, forced: np.ndarray, b_bytes: np.ndarray,
                           b_rank: np.ndarray, b_node: np.ndarray, b_set: np.ndarray,
                           set_ptr: np.ndarray, set_rank: np.ndarray, rank_node: np.ndarray
                           ) -> None:
    """A bundle rides with a forced bundle to the same new rank where that forced sender is
    a candidate (holds the rows; on the list's node for a same-node list) and the forced
    bundle is at least as big: one message instead of two, so fewer rounds, and that
    sender's load at most doubles on that message. Fills ``b_pick`` in place (the sender
    of the biggest such forced bundle, then the lowest rank).

    ``b_node``: the node of each same-node bundle's list, -1 for a whole-set list;
    ``b_set``: its holder set; ``rank_node``: the node of each old rank.
    """
    cand = np.flatnonzero(~forced)
    if not len(cand) or not forced.any():
        return
    f_idx = np.flatnonzero(forced)
    by_dst = f_idx[np.lexsort((b_pick[f_idx], -b_bytes[f_idx], b_rank[f_idx]))]
    f_dst, f_src, f_bytes = b_rank[by_dst], b_pick[by_dst], b_bytes[by_dst]
    lo = np.searchsorted(f_dst, b_rank[cand], side="left")
    n = np.searchsorted(f_dst, b_rank[cand], side="right") - lo
    b = np.repeat(cand, n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo, n)
    sender = f_src[k]
    width = int(set_rank.max(initial=0)) + 1
    member = np.repeat(np.arange(len(set_ptr) - 1), np.diff(set_ptr)) * width + set_rank
    probe = b_set[b] * width + sender
    pos = np.minimum(np.searchsorted(member, probe), len(member) - 1)
    ok = ((member[pos] == probe) & (f_bytes[k] >= b_bytes[b])
          & ((b_node[b] < 0) | (b_node[b] == rank_node[sender])))
    if ok.any():
        b_ok, s_ok = b[ok], sender[ok]
        first = np.r_[True, b_ok[1:] != b_ok[:-1]]
        b_pick[b_ok[first]] = s_ok[first]


def choose_sources(old: Layout, old_tab: RegionTable, frag: Fragments, frag_bytes: np.ndarray,
                   f: np.ndarray, dst_rank: np.ndarray, dst_dev: np.ndarray,
                   gpus_per_node: int, alive: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Source (device, old rank) for every (fragment, new rank) pair.

    Local when the destination device holds the fragment's old row. Otherwise the candidates
    are the row's surviving holders on the destination's node, or all of them when none is
    there. Everything one new rank needs from one candidate list is a bundle with one
    sender. A bundle with one candidate is forced; a bundle no bigger than a forced bundle
    to the same new rank goes with that sender where it is a candidate (one message
    instead of two); the rest are dealt over their list biggest first in boustrophedon order
    (0, 1, .., m-1, m-1, .., 0, ...), the list ordered by the forced bytes its members
    already send, which evens out what each sender sends the way longest-first greedy does,
    for all bundles at once. ``alive`` (per old rank; default all) limits the sources to
    surviving ranks: destinations are never lost devices, so a local copy is always from a
    survivor.

    Raises:
        PlanError: a fragment has no surviving holder (``lost.require_survivors`` rules
            that out first, with the tensors named).
    """
    old_dev = np.asarray(old.devices, np.int64)
    src_rank, local = _local_sources(old_dev, old_tab, frag, f, dst_dev)

    remote = np.flatnonzero(~local)
    if not len(remote):
        return old_dev[src_rank], src_rank
    rows = frag.old_row[f[remote]]
    used, row_of = np.unique(rows, return_inverse=True)
    row_set, set_ptr, set_rank = _holder_sets(old, old_tab, used, alive)
    t_set = row_set[row_of.ravel()]
    empty = set_ptr[t_set + 1] == set_ptr[t_set]
    if np.any(empty):
        raise PlanError(f"invalid migration plan: old row {int(rows[np.flatnonzero(empty)[0]])} "
                        "has no surviving holder")
    # candidate lists: a set's holders on one node ("near"), else the whole set
    n_nodes = max(int(old_dev.max()), int(dst_dev.max())) // gpus_per_node + 1
    near_keys, near_first, near_count, near_rank = _near_holders(old_dev, set_ptr, set_rank,
                                                                 n_nodes, gpus_per_node)
    probe = t_set * n_nodes + dst_dev[remote] // gpus_per_node
    k = np.minimum(np.searchsorted(near_keys, probe), max(len(near_keys) - 1, 0))
    near = near_keys[k] == probe
    group = np.where(near, k, len(near_keys) + t_set)
    cand_first = np.where(near, near_first[k], set_ptr[t_set])
    cand_count = np.where(near, near_count[k], set_ptr[t_set + 1] - set_ptr[t_set])
    # what one new rank needs from one candidate list travels from one sender (one message,
    # not one per fragment); these bundles are dealt to the list, biggest first (ties: new
    # rank)
    nb = frag_bytes[f[remote]]
    bundle_key = group * (int(dst_rank.max()) + 1) + dst_rank[remote]
    bundles, of_bundle = np.unique(bundle_key, return_inverse=True)
    of_bundle = of_bundle.ravel()
    b_bytes = np.bincount(of_bundle, nb).astype(np.int64)
    first_t = np.zeros(len(bundles), np.int64)
    first_t[of_bundle[::-1]] = np.arange(len(of_bundle))[::-1]
    b_group = group[first_t]
    b_rank = dst_rank[remote][first_t]
    b_first = cand_first[first_t]
    b_count = cand_count[first_t]
    b_near = near[first_t]
    # bundles with one candidate are forced; the others are dealt over each candidate list
    # ordered by the forced bytes its members already send (least first; ties rotated by
    # the list's id, so lists sharing senders do not all start on the lowest rank)
    forced = b_count == 1
    pool_rank = np.where(b_near, near_rank[np.minimum(b_first, max(len(near_rank) - 1, 0))],
                         set_rank[np.minimum(b_first, len(set_rank) - 1)])
    load0 = np.bincount(pool_rank[forced], b_bytes[forced], minlength=len(old_dev))
    b_pick = np.where(forced, pool_rank, -1)
    b_node = np.where(b_near, near_keys[np.minimum(b_group, max(len(near_keys) - 1, 0))]
                      % n_nodes, -1) if len(near_keys) else np.full(len(b_group), -1)
    _prefer_forced_senders(b_pick, forced, b_bytes, b_rank, b_node, t_set[first_t], set_ptr,
                           set_rank, old_dev // gpus_per_node)
    free = np.flatnonzero(b_pick < 0)
    if len(free):
        _deal(b_pick, free, b_group, b_count, b_first, b_near, b_rank, b_bytes, load0,
              near_rank, set_rank)
    src_rank[remote] = b_pick[of_bundle]
    return old_dev[src_rank], src_rank


def _local_sources(old_dev: np.ndarray, old_tab: RegionTable, frag: Fragments, f: np.ndarray,
                   dst_dev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(old rank of the source, -1 where not local; whether local) per (fragment, new rank)
    pair: local where the destination device holds the fragment's old row."""
    dev_to_old = np.full(max(int(old_dev.max()), int(dst_dev.max(initial=0))) + 1, -1, np.int64)
    dev_to_old[old_dev] = np.arange(len(old_dev))
    dst_old = dev_to_old[dst_dev]
    keys = holder_keys(old_tab)
    probe = np.where(dst_old >= 0, dst_old * len(old_tab) + frag.old_row[f], -1)
    pos = np.minimum(np.searchsorted(keys, probe), len(keys) - 1)
    local = (dst_old >= 0) & (keys[pos] == probe)
    return np.where(local, dst_old, -1), local

def _near_holders(old_dev: np.ndarray, set_ptr: np.ndarray, set_rank: np.ndarray,
                  n_nodes: int, gpus_per_node: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each holder set's holders grouped by node: (set x node key, first and count of its
    holders in the returned ranks, the ranks ordered by key then rank)."""
    member_set = np.repeat(np.arange(len(set_ptr) - 1), np.diff(set_ptr))
    near_key = member_set * n_nodes + old_dev[set_rank] // gpus_per_node
    by_key = np.lexsort((set_rank, near_key))       # stable in rank within a key
    near_sorted, near_rank = near_key[by_key], set_rank[by_key]
    near_keys, near_first, near_count = np.unique(near_sorted, return_index=True,
                                                  return_counts=True)
    return near_keys, near_first, near_count, near_rank


def _deal(b_pick: np.ndarray, free: np.ndarray, b_group: np.ndarray, b_count: np.ndarray,
          b_first: np.ndarray, b_near: np.ndarray, b_rank: np.ndarray, b_bytes: np.ndarray,
          load0: np.ndarray, near_rank: np.ndarray, set_rank: np.ndarray) -> None:
    """Deal the ``free`` bundles (no sender yet) over their candidate lists, in place in
    ``b_pick``: each list ordered by the forced bytes its members already send (least
    first; ties rotated by the list's id), its bundles biggest first (ties: new rank),
    dealt 0, 1, .., m-1, m-1, .., 0."""
    groups, g_of = np.unique(b_group[free], return_inverse=True)
    g_of = g_of.ravel()
    g_rep = np.zeros(len(groups), np.int64)
    g_rep[g_of[::-1]] = free[::-1]
    m_g = b_count[g_rep]
    c_g = np.repeat(np.arange(len(groups)), m_g)
    c_pos = np.arange(int(m_g.sum())) - np.repeat(np.cumsum(m_g) - m_g, m_g)
    at = np.repeat(b_first[g_rep], m_g) + c_pos
    c_rank = np.where(np.repeat(b_near[g_rep], m_g),
                      near_rank[np.minimum(at, max(len(near_rank) - 1, 0))],
                      set_rank[np.minimum(at, len(set_rank) - 1)])
    rotated = (c_pos + np.repeat(groups, m_g)) % np.repeat(m_g, m_g)
    c_order = np.lexsort((rotated, load0[c_rank], c_g))
    c_rank = c_rank[c_order]
    g_start = np.cumsum(m_g) - m_g
    # bundles of a list biggest first (ties: new rank), dealt 0, 1, .., m-1, m-1, .., 0
    order = free[np.lexsort((b_rank[free], -b_bytes[free], g_of))]
    g_o = np.searchsorted(groups, b_group[order])
    first_in = np.flatnonzero(np.r_[True, g_o[1:] != g_o[:-1]])
    i = np.arange(len(order)) - np.repeat(first_in, np.diff(np.append(first_in, len(order))))
    m = m_g[g_o]
    lap, j = i // m, i % m
    slot = np.where(lap % 2 == 0, j, m - 1 - j)
    b_pick[order] = c_rank[g_start[g_o] + slot]


def coalesce(src: np.ndarray, dst: np.ndarray, dst_rank: np.ndarray, f: np.ndarray,
             frag: Fragments, src_rank: np.ndarray, nbytes: np.ndarray
             ) -> Transfers:
    """Sort transfers by device pair and pack each pair's regions into one message."""
    order = np.lexsort((frag.old_row[f], frag.new_row[f], dst_rank, dst, src))
    src, dst, dst_rank, f, src_rank, nbytes = (x[order] for x in
                                               (src, dst, dst_rank, f, src_rank, nbytes))
    remote = src != dst
    pair_change = np.ones(len(src), bool)
    pair_change[1:] = (src[1:] != src[:-1]) | (dst[1:] != dst[:-1])
    msg = np.where(remote, np.cumsum(pair_change & remote) - 1, -1)
    offset = np.zeros(len(src), np.int64)
    if remote.any():
        rb = np.where(remote, nbytes, 0)
        csum = np.cumsum(rb) - rb
        first = np.flatnonzero(pair_change)
        seg_start = np.repeat(csum[first], np.diff(np.append(first, len(src))))
        offset = np.where(remote, csum - seg_start, 0)
    return Transfers(src, dst, dst_rank, src_rank, f, nbytes, msg, offset)


def balance_stats(transfers: Transfers) -> dict[str, int]:
    """Most bytes any device sends / receives over the network."""
    rem = ~transfers.local
    if not rem.any():
        return {"max_send_bytes": 0, "max_recv_bytes": 0}
    _, s = np.unique(transfers.src[rem], return_inverse=True)
    _, r = np.unique(transfers.dst[rem], return_inverse=True)
    return {"max_send_bytes": int(np.bincount(s, transfers.nbytes[rem]).max()),
            "max_recv_bytes": int(np.bincount(r, transfers.nbytes[rem]).max())}


