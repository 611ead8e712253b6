"""Virtual rank allocator: which devices a job keeps, and the stable vrank of each.

A vrank is ``slot * gpus_per_node + position``: every node the job holds owns one slot, so
``vrank // gpus_per_node`` names a node exactly as the planner's device ids do, and a
layout written in vranks can be handed to the planner unchanged.

Three rules, in this order of priority:

1. Compact. The devices kept form whole tensor-parallel groups inside nodes (each node
   contributes a multiple of tp), on the fewest nodes, preferring nodes that are used
   whole and nodes on the switches the job already occupies. Whatever cannot join a group
   is released, never held idle.
2. State in place. Among equally compact choices, keep the devices that already hold
   training state (they are in the current layout).
3. Stable. A device the job keeps keeps its vrank; new devices fill free positions of
   their node's slot, and new nodes take the lowest free slots.

Every choice has an explicit tie-break (node index, local index), so every rank computes
the same allocation from the same inputs.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Mapping, Sequence

from ..plan.config import Layout, ParallelConfig
from .errors import AllocationError
from .topology import ClusterTopology, Device


def device_key(d: Device) -> tuple[str, int]:
    """A device's sort key: the order of ``Device``'s own comparison (node, then local
    index), compared as a tuple in C rather than through the dataclass's ``__lt__`` (a
    sort of 16,384 devices called it 200,000 times)."""
    return d.node, d.local


@dataclass(frozen=True)
class Allocation:
    """The devices a job trains on next, by vrank, and the devices it gives back.

    Attributes:
        vranks: vrank -> device for every device in the training pool.
        released: devices the job held but does not keep (sorted).
    """

    vranks: Mapping[int, Device]
    released: tuple[Device, ...]

    @property
    def pool(self) -> tuple[int, ...]:
        """The vranks of the pool, ascending: what the planner may place new ranks on."""
        return tuple(sorted(self.vranks))

    @property
    def devices(self) -> frozenset[Device]:
        return frozenset(self.vranks.values())

    @property
    def nodes(self) -> tuple[str, ...]:
        """Nodes the pool uses, sorted."""
        return tuple(sorted({d.node for d in self.vranks.values()}))


def usable_per_node(counts: Iterable[int], tp: int) -> list[int]:
    """Devices of each node that can join whole tensor-parallel groups of size ``tp``."""
    return [(c // tp) * tp for c in counts]


def capacity(counts: Iterable[int], tp: int, max_nodes: int | None = None) -> int:
    """Most devices a job can train on with tensor-parallel groups of ``tp`` inside nodes.

    Args:
        counts: available devices on each node.
        tp: tensor-parallel degree.
        max_nodes: use at most this many nodes (None: no limit).
    """
    usable = sorted(usable_per_node(counts, tp), reverse=True)
    return sum(usable[:max_nodes] if max_nodes is not None else usable)


def select_devices(available: Iterable[Device], world: int, tp: int,
                   topology: ClusterTopology, in_layout: Collection[Device] = (),
                   max_nodes: int | None = None,
                   pinned: Collection[Device] = ()) -> tuple[Device, ...]:
    """Choose ``world`` devices from ``available``: compact first, then state in place.

    Nodes are taken largest-usable-first (ties: switches holding the most state, then the
    biggest switch, then nodes holding state, then node index) until one more node can
    finish the job; that node is chosen best-fit (an exact fit leaves no new partly used
    node). This takes the fewest nodes possible, except that nodes with pinned devices
    (the anchor allocation, which the job cannot give back) are taken first.

    Args:
        available: devices the job holds and may use (not leaving).
        world: devices to keep (a multiple of ``tp``).
        tp: tensor-parallel degree; every node contributes a multiple of it.
        topology: node order and switches.
        in_layout: devices that hold training state now (preferred on ties).
        max_nodes: refuse allocations that need more nodes.
        pinned: devices the job keeps in any case; used before any other.

    Returns:
        The chosen devices, sorted.

    Raises:
        AllocationError: with the numbers, when ``world`` devices cannot be placed.
    """
    devices = sorted(set(available), key=device_key)
    topology.check_all(devices)
    G = topology.gpus_per_node
    if not 1 <= tp <= G:
        raise AllocationError(f"tp ({tp}) must be between 1 and gpus_per_node ({G}): "
                              "tensor-parallel groups stay inside a node")
    if world < 0 or world % tp:
        raise AllocationError(f"world ({world}) must be a non-negative multiple of tp ({tp})")
    if world == 0:
        return ()
    holding = set(in_layout)
    keep = set(pinned)
    by_node: dict[str, list[Device]] = defaultdict(list)
    for d in devices:
        by_node[d.node].append(d)
    usable = {n: (len(ds) // tp) * tp for n, ds in by_node.items()}
    usable = {n: u for n, u in usable.items() if u}
    anchored = {n: any(d in keep for d in by_node[n]) for n in usable}
    key = _node_order(by_node, usable, anchored, holding, topology)
    total = sum(usable.values())
    if total < world:
        raise AllocationError(
            f"cannot place {world} devices in tensor-parallel groups of {tp} inside nodes: "
            f"only {total} of the {len(devices)} available devices can join whole groups")
    take = _take_nodes(world, usable, anchored, key, topology)
    if max_nodes is not None and len(take) > max_nodes:
        raise AllocationError(f"{world} devices in tensor-parallel groups of {tp} need "
                              f"{len(take)} nodes, more than max_nodes ({max_nodes})")

    chosen: list[Device] = []
    for node, count in take.items():
        # Pinned devices, then devices holding state, then by local index.
        ordered = sorted(by_node[node], key=lambda d: (d not in keep, d not in holding,
                                                       d.local))
        chosen.extend(ordered[:count])
    return tuple(sorted(chosen, key=device_key))


NodeKey = Callable[[str], tuple[bool, int, int, int, int]]


def _node_order(by_node: Mapping[str, list[Device]], usable: Mapping[str, int],
                anchored: Mapping[str, bool], holding: Collection[Device],
                topology: ClusterTopology) -> NodeKey:
    """The order nodes are taken in: anchored nodes first, then the most usable devices,
    then switches holding the most state (then the biggest switch), then nodes holding
    state, then node index."""
    state = {n: sum(d in holding for d in by_node[n]) for n in usable}
    switch_state: dict[str, int] = defaultdict(int)
    switch_cap: dict[str, int] = defaultdict(int)
    for n, u in usable.items():
        switch_state[topology.switch(n)] += state[n]
        switch_cap[topology.switch(n)] += u
    switch_rank = {s: i for i, s in enumerate(
        sorted(switch_cap, key=lambda s: (-switch_state[s], -switch_cap[s], s)))}

    def key(n: str) -> tuple[bool, int, int, int, int]:
        return (not anchored[n], -usable[n], switch_rank[topology.switch(n)], -state[n],
                topology.index(n))

    return key


def _take_nodes(world: int, usable: Mapping[str, int], anchored: Mapping[str, bool],
                key: NodeKey, topology: ClusterTopology) -> dict[str, int]:
    """Devices to take per node, in order: whole nodes by ``key`` until one more node can
    finish the job, that one best-fit (anchored first, then the least left over, then on a
    switch already used)."""
    remaining = sorted(usable, key=key)
    # the most usable devices of any node from position i on: whether one more node can
    # finish the job, known without a pass over the rest at each node taken
    most = [0] * (len(remaining) + 1)
    for i in range(len(remaining) - 1, -1, -1):
        most[i] = max(most[i + 1], usable[remaining[i]])
    take: dict[str, int] = {}
    need, first = world, 0
    while need:
        if most[first] >= need:
            fits = [n for n in remaining[first:] if usable[n] >= need]
            used_switches = {topology.switch(n) for n in take}
            last = min(fits, key=lambda n: (not anchored[n], usable[n] - need,
                                            topology.switch(n) not in used_switches, key(n)))
            take[last] = need
            need = 0
        else:
            node = remaining[first]
            first += 1
            take[node] = usable[node]
            need -= usable[node]
    return take


def number_vranks(selected: Iterable[Device], previous: Mapping[int, Device],
                  topology: ClusterTopology) -> dict[int, Device]:
    """Give every selected device a vrank; a device in ``previous`` keeps its own.

    Args:
        selected: the devices of the new pool.
        previous: the current vrank -> device table (may hold devices not selected).
        topology: node order (new nodes take free slots in this order).

    Raises:
        AllocationError: ``previous`` is inconsistent (a slot shared by two nodes, a node
            in two slots, a device with two vranks).
    """
    G = topology.gpus_per_node
    _check_table(previous, G)
    vrank_of = {d: v for v, d in previous.items()}
    slot_of: dict[str, int] = {}
    result: dict[int, Device] = {}
    fresh: dict[str, list[Device]] = defaultdict(list)
    taken: dict[str, set[int]] = defaultdict(set)  # node -> positions its kept devices hold
    for d in sorted(set(selected), key=device_key):
        topology.check(d)
        if d in vrank_of:
            result[vrank_of[d]] = d
            slot_of[d.node] = vrank_of[d] // G
            taken[d.node].add(vrank_of[d] % G)
        else:
            fresh[d.node].append(d)
    used_slots = set(slot_of.values())
    next_slot = 0
    for node in sorted(fresh, key=topology.index):
        if node not in slot_of:
            while next_slot in used_slots:
                next_slot += 1
            slot_of[node] = next_slot
            used_slots.add(next_slot)
        base = slot_of[node] * G
        # the node's kept devices are in its slot (_check_table): their positions
        free = (p for p in range(G) if p not in taken[node])
        for d in fresh[node]:
            result[base + next(free)] = d
    return dict(sorted(result.items()))


def _check_table(table: Mapping[int, Device], G: int) -> None:
    node_of_slot: dict[int, str] = {}
    slot_of_node: dict[str, int] = {}
    seen: set[Device] = set()
    for v, d in table.items():
        if v < 0:
            raise AllocationError(f"vrank {v} is negative")
        if d in seen:
            raise AllocationError(f"device {d} has two vranks")
        seen.add(d)
        slot = v // G
        if node_of_slot.setdefault(slot, d.node) != d.node:
            raise AllocationError(f"vrank slot {slot} holds devices of two nodes "
                                  f"({node_of_slot[slot]}, {d.node})")
        if slot_of_node.setdefault(d.node, slot) != slot:
            raise AllocationError(f"node {d.node} has vranks in two slots "
                                  f"({slot_of_node[d.node]}, {slot})")


def allocate(held: Iterable[Device], world: int, tp: int, topology: ClusterTopology,
             previous: Mapping[int, Device] | None = None,
             max_nodes: int | None = None, pinned: Collection[Device] = ()) -> Allocation:
    """Select ``world`` of the ``held`` devices and number them (see module docstring).

    Args:
        held: every device the job holds and may keep (leaving devices excluded).
        world: size of the next training pool.
        tp: tensor-parallel degree of the next configuration.
        topology: node order and switches.
        previous: the current vrank table; its devices hold state.
        max_nodes: policy limit on nodes.
        pinned: devices never released (the anchor allocation), used first.

    Returns:
        The pool by vrank, and the held devices to release (never pinned ones).
    """
    previous = previous or {}
    held = sorted(set(held), key=device_key)
    chosen = select_devices(held, world, tp, topology, in_layout=set(previous.values()),
                            max_nodes=max_nodes, pinned=pinned)
    vranks = number_vranks(chosen, previous, topology)
    kept = set(chosen) | set(pinned)
    return Allocation(vranks, tuple(d for d in held if d not in kept))


def identity_layout(config: ParallelConfig, pool: Sequence[int]) -> Layout:
    """Rank r on the r-th lowest vrank: the placement of a job's first layout.

    Each node contributes a multiple of tp consecutive vranks, and tp is the fastest
    varying coordinate of megatron-core's rank order, so every tensor-parallel group lands
    inside one node.
    """
    return Layout(config, tuple(sorted(pool)))


def split_tp_groups(layout: Layout, gpus_per_node: int) -> int:
    """How many tensor-parallel groups of ``layout`` span more than one node."""
    tp = layout.config.tp
    devices = layout.devices
    return sum(len({devices[r] // gpus_per_node for r in range(start, start + tp)}) > 1
               for start in range(0, len(devices), tp))
