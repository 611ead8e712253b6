"""The simulated Slurm: who holds each device, and where requests are placed.

Placement follows Slurm's habits closely enough for the comparison: a request for whole
nodes takes the lowest-numbered fully free nodes, preferring a single leaf switch (as
topology/tree does); a request for GPUs on one node takes the fullest node that still fits
(best fit, as select/cons_tres packs). Both allocators face the same Slurm.
"""
from __future__ import annotations

from collections import defaultdict

from ..alloc.topology import ClusterTopology, Device

DOWN = "<down>"


class SimCluster:
    """Device ownership on a homogeneous cluster. Owners are job names."""

    def __init__(self, topology: ClusterTopology) -> None:
        self.topology = topology
        self.G = topology.gpus_per_node
        self.owner: dict[Device, str | None] = {
            d: None for n in topology.nodes for d in topology.devices_of(n)}
        self.free_on: dict[str, int] = {n: self.G for n in topology.nodes}
        self.down: set[str] = set()

    def place(self, gpus: int | None = None, nodes: int | None = None) -> list[Device] | None:
        """Free devices for a request, or None if it does not fit now."""
        if nodes is not None:
            whole = [n for n in self.topology.nodes if self.free_on[n] == self.G]
            if len(whole) < nodes:
                return None
            by_switch: dict[str, list[str]] = defaultdict(list)
            for n in whole:
                by_switch[self.topology.switch(n)].append(n)
            single = [ns for ns in by_switch.values() if len(ns) >= nodes]
            chosen = single[0][:nodes] if single else whole[:nodes]
            return [d for n in chosen for d in self.topology.devices_of(n)]
        if gpus is None:
            raise ValueError("a request needs gpus or nodes")
        fits = [n for n in self.topology.nodes if self.free_on[n] >= gpus]
        if not fits:
            return None
        node = min(fits, key=lambda n: (self.free_on[n], self.topology.index(n)))
        free = [d for d in self.topology.devices_of(node) if self.owner[d] is None]
        return free[:gpus]

    def assign(self, devices, owner: str) -> None:
        for d in devices:
            if self.owner[d] is not None:
                raise RuntimeError(f"simulator bug: {d} given to {owner} but held by "
                                   f"{self.owner[d]}")
            self.owner[d] = owner
            self.free_on[d.node] -= 1

    def transfer(self, devices, owner: str) -> None:
        """Hand devices straight to another owner (preemption)."""
        for d in devices:
            self.owner[d] = owner

    def release(self, devices, owner: str) -> None:
        for d in devices:
            if self.owner[d] != owner:
                raise RuntimeError(f"simulator bug: {owner} releases {d} held by "
                                   f"{self.owner[d]}")
            self.owner[d] = None
            self.free_on[d.node] += 1

    def fail(self, node: str) -> dict[str, list[Device]]:
        """Take a node down; returns what each owner lost."""
        lost: dict[str, list[Device]] = defaultdict(list)
        for d in self.topology.devices_of(node):
            owner = self.owner[d]
            if owner is not None and owner != DOWN:
                lost[owner].append(d)
            self.owner[d] = DOWN
        self.free_on[node] = 0
        self.down.add(node)
        return dict(lost)

    def recover(self, node: str) -> None:
        if node not in self.down:
            return
        for d in self.topology.devices_of(node):
            self.owner[d] = None
        self.free_on[node] = self.G
        self.down.discard(node)
