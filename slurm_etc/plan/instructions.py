"""Fine-grained instructions: which device sends which region to which new rank.

Every fragment a new rank needs either is already on its device (a local copy) or gets one
source among all surviving old devices holding a replica (lost devices send nothing):
same-node holders first, then the holder
with the least bytes to send so far (longest-first greedy, which keeps the most loaded
sender close to the minimum). Transfers between one pair of devices are then coalesced into
one message whose offset table says where each region is packed.
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


def choose_sources(old: Layout, old_tab: RegionTable, frag: Fragments, frag_bytes: np.ndarray,
                   f: np.ndarray, dst_rank: np.ndarray, dst_dev: np.ndarray,
                   gpus_per_node: int, alive: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Source (device, old rank) for every (fragment, new rank) pair.

    Local when the destination device holds the fragment's old row; otherwise greedy
    longest-first balancing of bytes sent, same-node holders preferred. ``alive`` (per old
    rank; default all) limits the sources to surviving ranks: destinations are never lost
    devices, so a local copy is always from a survivor.

    Raises:
        PlanError: a fragment has no surviving holder (``lost.require_survivors`` rules
            that out first, with the tensors named).
    """
    old_dev = np.asarray(old.devices, np.int64)
    dev_to_old = np.full(max(int(old_dev.max()), int(dst_dev.max(initial=0))) + 1, -1, np.int64)
    dev_to_old[old_dev] = np.arange(len(old_dev))
    dst_old = dev_to_old[dst_dev]
    keys = holder_keys(old_tab)
    probe = np.where(dst_old >= 0, dst_old * len(old_tab) + frag.old_row[f], -1)
    pos = np.minimum(np.searchsorted(keys, probe), len(keys) - 1)
    local = (dst_old >= 0) & (keys[pos] == probe)
    src_rank = np.where(local, dst_old, -1)

    remote = np.flatnonzero(~local)
    if len(remote):
        ranks, rows = old_tab.rank_rows
        if alive is not None:
            keep = alive[ranks]
            ranks, rows = ranks[keep], rows[keep]
        by_row = np.lexsort((ranks, rows))
        rows_sorted, ranks_sorted = rows[by_row], ranks[by_row]
        start = np.searchsorted(rows_sorted, np.arange(len(old_tab)))
        end = np.searchsorted(rows_sorted, np.arange(len(old_tab)), side="right")
        load = np.zeros(len(old_dev), np.int64)
        node_of = old_dev // gpus_per_node
        nb = frag_bytes[f[remote]]
        order = remote[np.lexsort((dst_rank[remote], f[remote], -nb))]
        rows_of = frag.old_row[f[order]]
        dst_node = dst_dev[order] // gpus_per_node
        for idx, row, node in zip(order.tolist(), rows_of.tolist(), dst_node.tolist()):
            cand = ranks_sorted[start[row]:end[row]]
            if not len(cand):
                raise PlanError(f"invalid migration plan: old row {row} has no surviving "
                                "holder")
            near = cand[node_of[cand] == node]
            pick = near if len(near) else cand
            best = int(pick[np.argmin(load[pick])])
            load[best] += frag_bytes[f[idx]]
            src_rank[idx] = best
    return old_dev[src_rank], src_rank


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


