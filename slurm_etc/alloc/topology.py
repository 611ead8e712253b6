"""Devices and the node/switch structure the allocator reasons about.

Slurm names nodes (``gpu-017``) and, where ``topology.conf`` is configured, groups them
under leaf switches. The planner only sees integers: ``device id = node index *
gpus_per_node + local index``. ``ClusterTopology`` is the one place that maps between them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from .errors import AllocationError


@dataclass(frozen=True, order=True)
class Device:
    """One accelerator: the node Slurm names and its local index (CUDA ordinal) there."""

    node: str
    local: int

    def __str__(self) -> str:
        return f"{self.node}:{self.local}"

    @classmethod
    def parse(cls, text: str) -> Device:
        """The device ``str`` wrote (``node:local``); ValueError for anything else."""
        node, local = str(text).rsplit(":", 1)
        return cls(node, int(local))


def format_devices(devices: Iterable[Device]) -> str:
    """``n0001:0-3,n0002:0-7`` style: devices grouped by node, local ranges merged (a few
    characters a node, however many devices: what logs and reasons name)."""
    by_node: dict[str, list[int]] = {}
    for d in sorted(devices):
        by_node.setdefault(d.node, []).append(d.local)
    parts = []
    for node, locals_ in by_node.items():
        runs, start = [], locals_[0]
        for prev, cur in zip(locals_, [*locals_[1:], -1]):  # -1: the run ends
            if cur != prev + 1:
                runs.append(f"{start}" if start == prev else f"{start}-{prev}")
                start = cur
        parts.append(f"{node}:{'+'.join(runs)}")
    return ",".join(parts)


@dataclass(frozen=True)
class ClusterTopology:
    """Nodes in Slurm's order, each with ``gpus_per_node`` devices and an optional switch.

    Attributes:
        gpus_per_node: devices on every node (tensor-parallel groups never cross a node).
        nodes: node names; a node's position is its index in planner device ids.
        switches: leaf switch of each node, aligned with ``nodes``; empty when Slurm has no
            topology (every node then counts as on one switch).
    """

    gpus_per_node: int
    nodes: tuple[str, ...]
    switches: tuple[str, ...] = ()
    _index: Mapping[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise AllocationError(f"gpus_per_node must be a positive integer, "
                                  f"got {self.gpus_per_node!r}")
        index = {name: i for i, name in enumerate(self.nodes)}
        if len(index) != len(self.nodes):
            dupes = sorted({n for n in self.nodes if self.nodes.count(n) > 1})
            raise AllocationError(f"node names must be unique; repeated: {', '.join(dupes)}")
        if self.switches and len(self.switches) != len(self.nodes):
            raise AllocationError(f"{len(self.switches)} switches given for "
                                  f"{len(self.nodes)} nodes; give one per node or none")
        object.__setattr__(self, "_index", index)

    @classmethod
    def uniform(cls, num_nodes: int, gpus_per_node: int, nodes_per_switch: int | None = None,
                prefix: str = "n") -> "ClusterTopology":
        """``num_nodes`` nodes named ``n0000``..., ``nodes_per_switch`` to a leaf switch."""
        width = max(4, len(str(num_nodes - 1)))
        names = tuple(f"{prefix}{i:0{width}d}" for i in range(num_nodes))
        switches: tuple[str, ...] = ()
        if nodes_per_switch:
            switches = tuple(f"s{i // nodes_per_switch}" for i in range(num_nodes))
        return cls(gpus_per_node, names, switches)

    def index(self, node: str) -> int:
        """Position of ``node`` in Slurm's order.

        Raises:
            AllocationError: the node is not part of this topology.
        """
        try:
            return self._index[node]
        except KeyError:
            raise AllocationError(f"unknown node {node!r} (topology has "
                                  f"{len(self.nodes)} nodes)") from None

    def switch(self, node: str) -> str:
        """Leaf switch of ``node`` ('' when the cluster has no switch topology)."""
        return self.switches[self.index(node)] if self.switches else ""

    def device_id(self, device: Device) -> int:
        """The planner's integer id of a device."""
        self.check(device)
        return self.index(device.node) * self.gpus_per_node + device.local

    def device(self, device_id: int) -> Device:
        """Inverse of ``device_id``."""
        node, local = divmod(device_id, self.gpus_per_node)
        if not 0 <= node < len(self.nodes):
            raise AllocationError(f"device id {device_id} is outside the topology "
                                  f"({len(self.nodes)} nodes x {self.gpus_per_node})")
        return Device(self.nodes[node], local)

    def devices_of(self, node: str) -> tuple[Device, ...]:
        """Every device of ``node``, by local index."""
        self.index(node)
        return tuple(Device(node, i) for i in range(self.gpus_per_node))

    def check(self, device: Device) -> None:
        """Raise AllocationError unless ``device`` exists in this topology."""
        self.index(device.node)
        if not 0 <= device.local < self.gpus_per_node:
            raise AllocationError(f"device {device} has local index {device.local}; nodes "
                                  f"have {self.gpus_per_node} devices")

    def check_all(self, devices: Sequence[Device]) -> None:
        """Check every device and that none is listed twice."""
        seen: set[Device] = set()
        for device in devices:
            self.check(device)
            if device in seen:
                raise AllocationError(f"device {device} is listed twice")
            seen.add(device)
