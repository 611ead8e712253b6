"""plan_migration: cost matrix -> sketch -> instructions -> rounds, validated once."""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .catalog import Catalog, build_catalog
from .classes import assign_classes, assign_classes_tp_in_node, kept_upper_bound
from .config import Layout, ParallelConfig
from .cost import CostMatrix, build_cost
from .errors import ConfigError, require
from .flow import assign_exact_tp_in_node, kept_exact
from .instructions import Transfers, balance_stats, choose_sources, coalesce, needs
from .intersect import Fragments, intersect
from .lost import alive_ranks, check_lost, require_survivors
from .model import ModelDesc
from .regions import RegionTable, region_table
from .schedule import Topology, color_edges, round_times
from .sketch import assign_tp_in_node, assign_unconstrained

# Up to this many cost-matrix cells (pool devices x new ranks) the sketch is solved densely
# and the byte lower bound is exact; beyond, over classes of interchangeable devices.
DENSE_CELLS = 2_500_000
# Beyond the dense regime, the exact flow (``flow.py``) runs where the class sketch moves more
# than this fraction above the cheap bound: 1.2-1.7 s at 16,384 GPUs for qwen3-235b's ep
# changes (0.5-3.6 % gaps closed), but 62 s for llama-70b tp8 -> tp4 at 131,072 GPUs, whose
# gap is 4e-8 (there the bound stays the relaxed one: ``stats["lower_bound_exact"]``).
FLOW_GAP = 1e-3


@dataclass(frozen=True)
class Messages:
    """Coalesced device-to-device messages: transfers[start:end] travel in message k."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    start: np.ndarray
    end: np.ndarray
    round: np.ndarray
    seconds: np.ndarray

    def __len__(self) -> int:
        return len(self.src)


@dataclass(frozen=True)
class MigrationPlan:
    """Everything one resize moves, validated at construction (see ``_validate``).

    ``lost``: devices of the old layout that died (sorted); they send nothing, hold no new
    rank and take no part (``participants``).
    """

    catalog: Catalog
    old: Layout
    new: Layout
    topology: Topology
    old_regions: RegionTable
    new_regions: RegionTable
    fragments: Fragments
    transfers: Transfers
    messages: Messages
    needed_bytes: int
    lower_bound_moved_bytes: int
    naive_moved_bytes: int
    plan_seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    lost: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def participants(self) -> tuple[int, ...]:
        """Devices that take part in the migration, sorted: old ∪ new, minus the lost."""
        return tuple(sorted((set(self.old.devices) | set(self.new.devices)) - set(self.lost)))

    @property
    def lost_old_ranks(self) -> tuple[int, ...]:
        """Old ranks whose device is lost, ascending."""
        lost = set(self.lost)
        return tuple(r for r, d in enumerate(self.old.devices) if d in lost)

    @property
    def assignment(self) -> tuple[int, ...]:
        return self.new.devices

    @property
    def moved_bytes(self) -> int:
        return int(self.transfers.nbytes[~self.transfers.local].sum())

    @property
    def kept_bytes(self) -> int:
        return self.needed_bytes - self.moved_bytes

    @property
    def moved_intra_node_bytes(self) -> int:
        t = self.transfers
        same = self.topology.node(t.src) == self.topology.node(t.dst)
        return int(t.nbytes[~t.local & same].sum())

    @property
    def moved_inter_node_bytes(self) -> int:
        return self.moved_bytes - self.moved_intra_node_bytes

    @property
    def rounds(self) -> int:
        return int(self.messages.round.max()) + 1 if len(self.messages) else 0

    @property
    def est_seconds(self) -> float:
        return float(round_times(self.messages.round, self.messages.seconds).sum())

    @property
    def lower_bound_seconds(self) -> float:
        """Most seconds any device must spend receiving or sending, at its link speed."""
        m = self.messages
        if not len(m):
            return 0.0
        send = np.bincount(np.unique(m.src, return_inverse=True)[1], m.seconds)
        recv = np.bincount(np.unique(m.dst, return_inverse=True)[1], m.seconds)
        return float(max(send.max(), recv.max()))

    def summary(self) -> dict[str, Any]:
        """The numbers `slurm-etc plan --json` prints."""
        lb, naive = self.lower_bound_moved_bytes, self.naive_moved_bytes
        moved = self.moved_bytes
        out = {
            "model": self.catalog.model.name,
            "from": str(self.old.config), "to": str(self.new.config),
            "old_devices": len(self.old.devices), "new_devices": len(self.new.devices),
            "total_state_bytes": self.catalog.total_bytes,
            "needed_bytes": self.needed_bytes,
            "kept_bytes": self.kept_bytes,
            "moved_bytes": moved,
            "moved_intra_node_bytes": self.moved_intra_node_bytes,
            "moved_inter_node_bytes": self.moved_inter_node_bytes,
            "lower_bound_moved_bytes": lb,
            "moved_over_lower_bound": _ratio(moved, lb),
            "naive_moved_bytes": naive,
            "moved_over_naive": _ratio(moved, naive),
            "transfers": int((~self.transfers.local).sum()),
            "local_copies": int(self.transfers.local.sum()),
            "messages": len(self.messages),
            "rounds": self.rounds,
            "est_seconds": self.est_seconds,
            "lower_bound_seconds": self.lower_bound_seconds,
            "seconds_over_lower_bound": _ratio(self.est_seconds, self.lower_bound_seconds),
            "plan_seconds": self.plan_seconds,
        }
        if self.lost:
            out["lost_devices"] = list(self.lost)
        out.update(self.stats)
        return out


def _ratio(a: float, b: float) -> float | None:
    if b == 0:
        return 1.0 if a == 0 else None
    return a / b


def _duplicates(keys: np.ndarray) -> int:
    k = np.sort(keys)
    return int((k[1:] == k[:-1]).sum())


def _unpacked_messages(t: Transfers, m: Messages) -> np.ndarray:
    """Messages whose transfers are not packed back to back from offset 0 up to their size,
    all messages at once."""
    length = m.end - m.start
    if len(m) and (np.any(length <= 0) or np.any(m.start[1:] < m.end[:-1])):
        return np.flatnonzero((length <= 0) | np.r_[False, m.start[1:] < m.end[:-1]])
    msg = np.repeat(np.arange(len(m)), length)
    seg_first = np.cumsum(length) - length
    idx = np.arange(len(msg)) - np.repeat(seg_first, length) + np.repeat(m.start, length)
    nb, off = t.nbytes[idx], t.offset[idx]
    run = np.cumsum(nb) - nb
    packed = off == run - np.repeat(run[seg_first] if len(m) else run[:0], length)
    total = np.add.reduceat(nb, seg_first) if len(m) else np.zeros(0, np.int64)
    wrong = total != m.nbytes
    wrong[msg[~packed]] = True
    return np.flatnonzero(wrong)


def _validate(plan: MigrationPlan) -> None:
    """Every byte each new rank needs is covered exactly once, by a device that holds it."""
    t, frag, new_tab = plan.transfers, plan.fragments, plan.new_regions
    world = plan.new.config.world
    require(len(set(plan.new.devices)) == world,
            f"{world} new ranks placed on {len(set(plan.new.devices))} distinct devices")
    dst_dev = np.asarray(plan.new.devices, np.int64)[t.dst_rank]
    require(bool(np.all(dst_dev == t.dst)), "a transfer goes to a device its rank is not on")
    # exactly once: (new rank, fragment) unique, and per (rank, row) the counts add up
    dup = _duplicates(t.dst_rank * len(frag) + t.frag)
    require(dup == 0, f"{dup} fragments delivered twice")
    ranks, rows = new_tab.rank_rows
    need = new_tab.count[rows]
    have = np.zeros(len(ranks), np.int64)
    pos = np.searchsorted(ranks * len(new_tab) + rows,
                          t.dst_rank * len(new_tab) + frag.new_row[t.frag])
    np.add.at(have, pos, frag.count[t.frag])
    bad = np.flatnonzero(have != need)
    require(len(bad) == 0, "" if not len(bad) else
            f"new rank {ranks[bad[0]]} needs {need[bad[0]]} elements of "
            f"{plan.catalog.groups[new_tab.group[rows[bad[0]]]].name} but the plan delivers "
            f"{have[bad[0]]} ({len(bad)} regions wrong)")
    # sources hold what they send
    old_ranks, old_rows = plan.old_regions.rank_rows
    held = old_ranks * len(plan.old_regions) + old_rows
    probe = t.src_rank * len(plan.old_regions) + frag.old_row[t.frag]
    pos = np.minimum(np.searchsorted(held, probe), len(held) - 1)
    require(bool(np.all(held[pos] == probe)), "a source sends a region it does not hold")
    src_dev = np.asarray(plan.old.devices, np.int64)[t.src_rank]
    require(bool(np.all(src_dev == t.src)), "a transfer's source device is not its old rank's")
    if plan.lost:
        lost = np.asarray(plan.lost, np.int64)
        require(list(plan.lost) == sorted(set(plan.lost))
                and set(plan.lost) <= set(plan.old.devices),
                f"lost devices {list(plan.lost)} are not distinct old devices, sorted")
        dead_src = np.unique(t.src[np.isin(t.src, lost)])
        require(len(dead_src) == 0, f"transfers come from lost device(s) {dead_src.tolist()}")
        dead_dst = sorted(set(plan.new.devices) & set(plan.lost))
        require(not dead_dst, f"new ranks placed on lost device(s) {dead_dst}")
    # element counts and packing
    bpe = np.array([g.bytes_per_element for g in plan.catalog.groups], np.int64)
    expect = frag.count[t.frag] * bpe[plan.old_regions.group[frag.old_row[t.frag]]]
    require(bool(np.all(expect == t.nbytes)), "transfer bytes differ from element counts")
    m = plan.messages
    bad_msg = _unpacked_messages(t, m)
    require(len(bad_msg) == 0, "" if not len(bad_msg) else
            f"message {bad_msg[0]} ({m.src[bad_msg[0]]} -> {m.dst[bad_msg[0]]}) is not packed "
            f"contiguously ({len(bad_msg)} messages wrong)")
    if len(m):
        for side in (m.src, m.dst):
            require(_duplicates(side * (int(m.round.max()) + 1) + m.round) == 0,
                    "a device has two messages in one round")


def default_pool(old: Layout, new: ParallelConfig, topology: Topology,
                 drop_nodes: Sequence[int] = (), add_nodes: int | None = None) -> list[int]:
    """Devices the new layout may use: kept nodes first, new nodes appended.

    By default a shrink keeps the first nodes and a grow appends whole nodes after the last.
    """
    gpn = topology.gpus_per_node
    nodes = sorted({d // gpn for d in old.devices})
    unknown = sorted(set(drop_nodes) - set(nodes))
    if unknown:
        raise ConfigError(f"cannot drop node(s) {unknown}: the old layout uses nodes "
                          f"{nodes[0]}..{nodes[-1]}")
    dropped = set(drop_nodes)
    kept = [n for n in nodes if n not in dropped]
    need_nodes = -(-new.world // gpn)
    if add_nodes is None:
        add_nodes = max(need_nodes - len(kept), 0)
        if not drop_nodes:
            kept = kept[:max(need_nodes, 0)] if len(kept) > need_nodes else kept
    nxt = (max(nodes) + 1) if nodes else 0
    all_nodes = kept + list(range(nxt, nxt + add_nodes))
    pool = [n * gpn + i for n in all_nodes for i in range(gpn)]
    if len(pool) < new.world:
        raise ConfigError(f"the new layout needs {new.world} devices but the kept and added "
                          f"nodes give {len(pool)} ({len(all_nodes)} nodes x {gpn}); "
                          "add nodes with --add-nodes or drop fewer")
    return pool


def plan_migration(model: ModelDesc, old: Layout, new_config: ParallelConfig,
                   new_devices: Sequence[int], topology: Topology = Topology(),
                   keep_tp_in_node: bool = True, catalog: Catalog | None = None,
                   lost: Collection[int] = ()) -> MigrationPlan:
    """Plan moving the training state from ``old`` to ``new_config`` on ``new_devices``.

    Args:
        model: the model (its catalog is built unless given).
        old: the current layout.
        new_config: the next ParallelConfig; its distributed_optimizer must match old's.
        new_devices: pool the new ranks may run on (at least new_config.world devices).
        topology: node size and link bandwidths.
        keep_tp_in_node: every tensor-parallel group of the new layout inside one node.
        catalog: the model's shard catalog (built from ``model`` unless given).
        lost: devices of the old layout that died without notice: they send nothing, hold
            no new rank and are no participants; only surviving replicas are sources, and
            the bytes they held are neither kept nor movable (the byte lower bound counts
            survivors only).

    Raises:
        ConfigError: configurations that cannot run the model or do not fit the devices;
            lost devices that are not old devices, or that are in ``new_devices``.
        StateLostError: (a ConfigError) some state is held only by lost devices (dp=1, the
            distributed optimizer's shards, every replica lost); names the tensors.
    """
    t0 = time.perf_counter()
    old.config.validate_for(model)
    new_config.validate_for(model)
    if old.config.distributed_optimizer != new_config.distributed_optimizer:
        raise ConfigError("the distributed optimizer must be on in both configurations or in "
                          "neither")
    pool = np.unique(np.asarray(list(new_devices), np.int64))
    lost_devices = check_lost(old, lost, pool.tolist())
    if len(pool) < new_config.world:
        raise ConfigError(f"{new_config} needs {new_config.world} devices, {len(pool)} given")
    if keep_tp_in_node and topology.gpus_per_node % new_config.tp:
        raise ConfigError(f"tp ({new_config.tp}) must divide gpus per node "
                          f"({topology.gpus_per_node}) to keep tensor-parallel groups in a node")
    catalog = catalog or build_catalog(model, old.config)
    old_tab = region_table(catalog, old.config)
    alive = None
    if lost_devices:
        alive = alive_ranks(old, lost_devices)
        require_survivors(catalog, old, old_tab, alive)
    new_tab = region_table(catalog, new_config)
    frag = intersect(old_tab, new_tab)
    cost = build_cost(catalog, old, new_config, pool, old_tab, new_tab, frag)

    constrained = keep_tp_in_node and new_config.tp > 1
    placement, lower_bound, sketch, bound_exact = _sketch(cost, new_config, topology,
                                                          constrained)
    naive = cost.needed_bytes - cost.kept(np.arange(new_config.world))
    new = Layout(new_config, tuple(int(d) for d in pool[placement]))
    transfers, messages = _instructions(catalog, old, new, old_tab, new_tab, frag, topology,
                                        alive)
    plan_seconds = time.perf_counter() - t0
    return MigrationPlan(catalog, old, new, topology, old_tab, new_tab, frag, transfers,
                         messages, cost.needed_bytes, lower_bound, naive, plan_seconds,
                         stats={**balance_stats(transfers), "sketch": sketch,
                                "lower_bound_exact": bound_exact}, lost=lost_devices)

# Sketches kept by their inputs (the cost matrix's arrays, tp, node size, the thresholds
# above): the chooser prices
# a candidate with the very matrix the resize it picks is then planned with (a dense solve of
# 0.1 s at 1,024 ranks, asked twice). A placement of N ints an entry.
_SKETCHES: OrderedDict[bytes, tuple[np.ndarray, int, str, bool]] = OrderedDict()
_SKETCHES_KEPT = 32


def _sketch_key(cost: CostMatrix, tp: int, gpus_per_node: int, constrained: bool) -> bytes:
    # the module's thresholds too: which way it is solved is part of the answer
    h = hashlib.sha256(repr((cost.shape, cost.M.shape, cost.needed_bytes, tp, gpus_per_node,
                             constrained, DENSE_CELLS, FLOW_GAP)).encode())
    for a in (cost.pool, cost.pool_old_rank, cost.pool_class, cost.rank_class, cost.M,
              cost.dist_pool, cost.dist_rank, cost.dist_bytes):
        h.update(np.ascontiguousarray(a, np.int64).tobytes())
    return h.digest()


def _sketch(cost: CostMatrix, new_config: ParallelConfig, topology: Topology,
            constrained: bool) -> tuple[np.ndarray, int, str, bool]:
    """:func:`_solve_sketch`, once per distinct input (a pure function of it: the same
    inputs give the same answer, so it is kept)."""
    key = _sketch_key(cost, new_config.tp, topology.gpus_per_node, constrained)
    got = _SKETCHES.get(key)
    if got is None:
        got = _SKETCHES[key] = _solve_sketch(cost, new_config, topology, constrained)
        got[0].setflags(write=False)
        while len(_SKETCHES) > _SKETCHES_KEPT:
            _SKETCHES.popitem(last=False)
    else:
        _SKETCHES.move_to_end(key)
    return got


def _solve_sketch(cost: CostMatrix, new_config: ParallelConfig, topology: Topology,
                  constrained: bool) -> tuple[np.ndarray, int, str, bool]:
    """The migration sketch: (placement of the new ranks on the pool, byte lower bound, how
    it was found, whether the bound is exact). Dense where the matrix is small; else by
    classes, and the exact flow where the cheap bound leaves a real gap. ``constrained``:
    tensor-parallel groups stay inside a node."""
    exact = cost.shape[0] * cost.shape[1] <= DENSE_CELLS
    if exact:
        sketch, bound_exact = "dense", True
        dense = cost.dense()
        best = assign_unconstrained(cost, dense)
        lower_bound = cost.needed_bytes - cost.kept(best)
        placement = (assign_tp_in_node(cost, dense, new_config.tp, topology.gpus_per_node)
                     if constrained else best)
    else:
        sketch = "classes"
        lower_bound = cost.needed_bytes - kept_upper_bound(cost)
        placement = (assign_classes_tp_in_node(cost, new_config.tp, topology.gpus_per_node)
                     if constrained else assign_classes(cost))
        gap = cost.needed_bytes - cost.kept(placement) - lower_bound
        bound_exact = gap == 0 or not len(cost.dist_rank)
        if gap > FLOW_GAP * lower_bound:
            # the exact flow, bound and placement, where the cheap bound leaves a real gap
            sketch, bound_exact = "classes + exact flow", True
            most, best = kept_exact(cost)
            lower_bound = cost.needed_bytes - most
            if constrained and cost.kept(placement) < most:
                best = assign_exact_tp_in_node(cost, new_config.tp, topology.gpus_per_node)
            if cost.kept(best) > cost.kept(placement):
                placement = best
    return placement, lower_bound, sketch, bound_exact


def _instructions(catalog: Catalog, old: Layout, new: Layout, old_tab: RegionTable,
                  new_tab: RegionTable, frag: Fragments, topology: Topology,
                  alive: np.ndarray | None = None) -> tuple[Transfers, Messages]:
    bpe = np.array([g.bytes_per_element for g in catalog.groups], np.int64)
    frag_bytes = frag.count * bpe[old_tab.group[frag.old_row]]
    f, dst_rank = needs(new_tab, frag)
    dst = np.asarray(new.devices, np.int64)[dst_rank]
    src, src_rank = choose_sources(old, old_tab, frag, frag_bytes, f, dst_rank, dst,
                                   topology.gpus_per_node, alive)
    t = coalesce(src, dst, dst_rank, f, frag, src_rank, frag_bytes[f])
    remote = np.flatnonzero(~t.local)
    if len(remote):
        change = t.msg[remote][1:] != t.msg[remote][:-1]
        first = remote[np.r_[True, change]]
        last = remote[np.r_[change, True]] + 1
        nbytes = np.add.reduceat(t.nbytes[remote], np.searchsorted(remote, first))
        m_src, m_dst = t.src[first], t.dst[first]
        seconds = nbytes / topology.bandwidth(m_src, m_dst)
        rounds = color_edges(m_src, m_dst, nbytes)
    else:
        first = last = nbytes = m_src = m_dst = rounds = np.empty(0, np.int64)
        seconds = np.empty(0)
    return t, Messages(m_src, m_dst, nbytes, first, last, rounds, seconds)
