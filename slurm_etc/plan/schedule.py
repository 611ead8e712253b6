"""Rounds and time: messages scheduled so no device sends or receives two at once.

Messages form a bipartite multigraph (senders, receivers); a proper edge colouring with
max-degree colours exists (König) and is found with alternating-path recolouring. Big
messages are coloured first so they share early rounds. Time per round is its slowest
message over its link (intra-node or inter-node bandwidth).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import numpy as np


@dataclass(frozen=True)
class Topology:
    """Devices are ints: node = device // gpus_per_node. Bandwidths in GB/s per device."""

    gpus_per_node: int = 8
    intra_node_gbps: float = 150.0
    inter_node_gbps: float = 25.0

    @overload
    def node(self, device: int) -> int: ...
    @overload
    def node(self, device: np.ndarray) -> np.ndarray: ...

    def node(self, device: int | np.ndarray) -> int | np.ndarray:
        return device // self.gpus_per_node

    def bandwidth(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Bytes per second of each (src, dst) link."""
        same = self.node(src) == self.node(dst)
        return np.where(same, self.intra_node_gbps, self.inter_node_gbps) * 1e9


def color_edges(u: np.ndarray, v: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Round of each edge (u[k] -> v[k]) using exactly max-degree rounds."""
    n = len(u)
    colors = np.full(n, -1, np.int64)
    if n == 0:
        return colors
    degree = max(np.bincount(np.unique(u, return_inverse=True)[1]).max(),
                 np.bincount(np.unique(v, return_inverse=True)[1]).max())
    at_u: dict[int, dict[int, int]] = {}
    at_v: dict[int, dict[int, int]] = {}
    for k in np.lexsort((np.arange(n), -weight)).tolist():
        a_map = at_u.setdefault(int(u[k]), {})
        b_map = at_v.setdefault(int(v[k]), {})
        a = next(c for c in range(degree) if c not in a_map)
        if a in b_map:
            b = next(c for c in range(degree) if c not in b_map)
            _flip(at_u, at_v, u, v, colors, int(v[k]), a, b)
        colors[k] = a
        a_map[a] = k
        b_map[a] = k
    return colors


def _flip(at_u: dict[int, dict[int, int]], at_v: dict[int, dict[int, int]], u: np.ndarray,
          v: np.ndarray, colors: np.ndarray, start_v: int, a: int, b: int) -> None:
    """Swap colours a and b along the a/b alternating path that starts at receiver start_v."""
    path: list[int] = []
    side, node, want = "v", start_v, a
    while True:
        table = at_v if side == "v" else at_u
        k = table.get(node, {}).get(want)
        if k is None:
            break
        path.append(k)
        if side == "v":
            side, node = "u", int(u[k])
        else:
            side, node = "v", int(v[k])
        want = b if want == a else a
    for k in path:
        old = int(colors[k])
        at_u[int(u[k])].pop(old, None)
        at_v[int(v[k])].pop(old, None)
    for k in path:
        new = b if colors[k] == a else a
        colors[k] = new
        at_u[int(u[k])][new] = k
        at_v[int(v[k])][new] = k


def round_times(rounds: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Duration of each round: its slowest message."""
    if len(rounds) == 0:
        return np.zeros(0)
    out = np.zeros(int(rounds.max()) + 1)
    np.maximum.at(out, rounds, seconds)
    return out
