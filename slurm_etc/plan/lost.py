"""Loss without grace: devices of the old layout that died and hold nothing any more.

A lost device sends nothing and takes part in nothing. Every region the new layout needs
must then come from a surviving replica: with data parallelism (dp >= 2) the other replicas
of a model-parallel shard hold it, unless every one of them died. Where no survivor holds a
region (dp = 1; the distributed optimizer, whose dp ranks each own the only copy of their
optimizer shard; or every replica lost) the state cannot be rebuilt in memory and planning
stops with :class:`~.errors.StateLostError` naming the tensors.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from .catalog import Catalog, TensorGroup
from .config import Layout
from .errors import ConfigError, StateLostError
from .regions import RegionTable

# Tensors described one by one in a StateLostError's message; the rest are counted.
_NAMED = 3


def check_lost(old: Layout, lost: Collection[int], new_devices: Sequence[int]
               ) -> tuple[int, ...]:
    """The lost devices, sorted; ConfigError unless they are old devices outside the pool."""
    out = tuple(sorted({int(d) for d in lost}))
    unknown = sorted(set(out) - set(old.devices))
    if unknown:
        raise ConfigError(f"lost device(s) {unknown} are not devices of the old layout "
                          f"{old.config} (devices {list(old.devices)})")
    dead = sorted(set(out) & {int(d) for d in new_devices})
    if dead:
        raise ConfigError(f"the new devices include lost device(s) {dead}: a dead device "
                          "cannot run a new rank; leave it out of the pool")
    return out


def alive_ranks(old: Layout, lost: Sequence[int]) -> np.ndarray:
    """Boolean per old rank: its device survived."""
    alive: np.ndarray = ~np.isin(np.asarray(old.devices, np.int64), np.asarray(lost, np.int64))
    return alive


def tensor_name(g: TensorGroup) -> str:
    """What a person calls a group's tensors: the parameter, or its optimizer states."""
    if not g.dist:
        return g.param
    kinds = ",".join(s.key.split(".")[2] for s in g.states)
    return f"optimizer.state.{{{kinds}}}.{g.param}"


def require_survivors(catalog: Catalog, old: Layout, old_tab: RegionTable,
                      alive: np.ndarray) -> None:
    """Raise StateLostError if some region of the old layout is held by lost ranks only.

    Every region of the old table is needed by the new layout (it holds the whole state).
    """
    ranks, rows = old_tab.rank_rows
    held = np.bincount(rows[alive[ranks]], minlength=len(old_tab)) > 0
    orphans = np.flatnonzero(~held & (old_tab.count > 0))
    if not len(orphans):
        return
    cfg = old.config
    lost = tuple(int(d) for d, a in zip(old.devices, alive) if not a)
    by_tensor: dict[str, list[int]] = {}
    for row in orphans.tolist():
        by_tensor.setdefault(tensor_name(catalog.groups[int(old_tab.group[row])]), []).append(row)
    if cfg.dp_cp == 1:
        why = f"{cfg} layout: every shard has one copy"
    elif bool(np.any(old_tab.dp_rank[orphans] >= 0)):
        why = (f"{cfg} layout: the distributed optimizer keeps one copy of each dp rank's "
               "optimizer shard")
    else:
        why = f"{cfg} layout: every data-parallel replica of these shards is lost"
    parts = []
    for name in sorted(by_tensor)[:_NAMED]:
        row = by_tensor[name][0]
        devs = sorted({int(old.devices[r]) for r in old_tab.holder_ranks(row).tolist()})
        parts.append(f"{name}{_where(catalog, old_tab, row)} held only by lost "
                     f"device{'s' if len(devs) > 1 else ''} {', '.join(map(str, devs))}")
    more = len(by_tensor) - _NAMED
    tail = f" (and {more} more tensor{'s' if more > 1 else ''})" if more > 0 else ""
    raise StateLostError(
        f"state lost with device{'s' if len(lost) > 1 else ''} {list(lost)}: {why}; "
        f"{'; '.join(parts)}{tail}: the state cannot be rebuilt in memory (restart from a "
        "checkpoint)", tuple(sorted(by_tensor)), lost)


def _where(catalog: Catalog, tab: RegionTable, row: int) -> str:
    """Layers, tensor-parallel part and dp shard of a row, as far as they narrow it down."""
    g = catalog.groups[int(tab.group[row])]
    bits = []
    if g.stacked:
        a, b = int(tab.lo[row, 0]), int(tab.hi[row, 0])
        bits.append(f"layer {a}" if b - a == 1 else f"layers {a}-{b - 1}")
    if g.tp_axis is not None:
        a, b = int(tab.lo[row, g.tp_axis]), int(tab.hi[row, g.tp_axis])
        if b - a < g.shape[g.tp_axis]:
            bits.append(f"axis {g.tp_axis} {a}:{b}")
    if int(tab.dp_rank[row]) >= 0:
        bits.append(f"dp rank {int(tab.dp_rank[row])}'s shard")
    return f" ({', '.join(bits)})" if bits else ""


# -- peer copies: what rebuilds state that no surviving replica holds ------------------------

def peer_buddies(devices: Sequence[int], gpus_per_node: int) -> tuple[int, ...]:
    """The rank that keeps a copy of each rank's state (``out[r]``), never on ``r``'s node.

    Ranks are ordered by (node, device); rank ``r`` at position ``i`` sends to the rank at
    position ``i + m`` (``m``: the most ranks any node holds), walking on past ranks of its
    own node. With every node holding ``m`` ranks this is a permutation (each rank keeps
    exactly one copy). Deterministic: every rank computes the same assignment.

    Raises:
        ConfigError: all ranks are on one node (no copy could survive the node).
    """
    if gpus_per_node < 1:
        raise ConfigError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    nodes = [int(d) // gpus_per_node for d in devices]
    if len(set(nodes)) < 2:
        raise ConfigError(f"peer copies need ranks on at least two nodes; devices "
                          f"{list(devices)} are all on node {nodes[0] if nodes else '-'}")
    order = sorted(range(len(devices)), key=lambda r: (nodes[r], int(devices[r])))
    m = max(nodes.count(n) for n in set(nodes))
    out = [0] * len(devices)
    for i, r in enumerate(order):
        j = i + m
        while nodes[order[j % len(order)]] == nodes[r]:
            j += 1
        out[r] = order[j % len(order)]
    return tuple(out)


def rollback_step(lost_ranks: Collection[int], own: dict[int, Collection[int]],
                  copies: dict[int, dict[int, Collection[int]]]) -> int | None:
    """The newest step every survivor can roll back to with the lost ranks' peer copies.

    Args:
        lost_ranks: old ranks whose device died.
        own: surviving rank -> steps of the snapshots it keeps of its own state.
        copies: surviving rank -> {rank it keeps copies of: steps of those copies}.

    Returns:
        The largest step ``s`` such that every survivor holds its own snapshot of ``s`` and
        every lost rank's copy of ``s`` is held by a survivor; None if there is none.
    """
    lost = set(lost_ranks)
    if not own:
        return None
    common = set.intersection(*(set(v) for v in own.values()))
    for r in lost:
        held: set[int] = set()
        for holder, wards in copies.items():
            if holder not in lost:
                held |= set(wards.get(r, ()))
        common &= held
    return max(common) if common else None
