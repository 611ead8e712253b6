"""Which shards a rank holds or needs: pure helpers over a plan's region tables.

A process's training state, as the executor sees it, is a list of :class:`LocalShard`: one
contiguous tensor per (state tensor, region). Its flattened elements are elements
``[s, s + numel)`` of the row-major order of box ``[lo, hi)`` in the state tensor's global
index space (three axes, padded with trailing 1s, as in ``slurm_etc.plan.regions``).

Stacked per-layer tensors (``decoder.layers.*``) are held one layer per shard
(``lo[0] = layer``, ``hi[0] = layer + 1``), as megatron-core keeps one parameter per layer;
a plan row spanning several layers of a pipeline stage therefore stands for several shards.

Nothing here imports torch: these functions only say which shards exist, so they can run
(and be tested) anywhere, and an adapter can check its state against them before a resize.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from slurm_etc.plan.catalog import Catalog
from slurm_etc.plan.regions import RegionTable

Box3 = tuple[int, int, int]


@dataclass(frozen=True)
class ShardSpec:
    """One shard a rank holds (old layout) or needs (new layout).

    Attributes:
        state_key: the StateTensor key (megatron-core sharded_state_dict key or
            ``optimizer.state.<name>.<param key>``).
        group: index of the state's TensorGroup in ``catalog.groups``.
        lo, hi: the box in the global index space (three axes).
        s, e: the row-major interval of the box that the shard holds.
        itemsize: bytes per element (4 for fp32 states, 2 for bf16 params).
    """

    state_key: str
    group: int
    lo: Box3
    hi: Box3
    s: int
    e: int
    itemsize: int

    @property
    def numel(self) -> int:
        return self.e - self.s

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def key(self) -> tuple[str, Box3, Box3, int]:
        """Identity of the shard within one rank's state."""
        return (self.state_key, self.lo, self.hi, self.s)


@dataclass
class LocalShard:
    """A shard of live state: ``tensor`` (contiguous, ``e - s`` elements) holds elements
    ``[s, s + tensor.numel())`` of box ``[lo, hi)`` of state ``state_key`` in row-major order."""

    state_key: str
    lo: Box3
    hi: Box3
    s: int
    tensor: Any  # torch.Tensor; kept untyped so this module does not import torch

    @property
    def key(self) -> tuple[str, Box3, Box3, int]:
        return (self.state_key, box3(self.lo), box3(self.hi), int(self.s))


def box3(values: Sequence[int] | np.ndarray) -> Box3:
    """Three plain ints (a live shard's corners may come as lists or numpy integers)."""
    a, b, c = values
    return (int(a), int(b), int(c))


def _box_size(lo, hi) -> int:
    n = 1
    for a, b in zip(lo, hi):
        n *= int(b) - int(a)
    return n


def rank_rows(table: RegionTable, rank: int) -> np.ndarray:
    """Rows of ``table`` that ``rank`` holds, ascending."""
    ranks, rows = table.rank_rows
    a, b = np.searchsorted(ranks, [rank, rank + 1])
    return rows[a:b]


def row_shards(catalog: Catalog, table: RegionTable, row: int) -> list[tuple[Box3, Box3, int, int]]:
    """(lo, hi, s, e) of the shards a region row stands for: one per layer for a stacked
    tensor's row that spans a layer range, else the row itself."""
    g = catalog.groups[int(table.group[row])]
    lo, hi = box3(table.lo[row]), box3(table.hi[row])
    s, e = int(table.s[row]), int(table.e[row])
    if not g.stacked or hi[0] - lo[0] == 1:
        return [(lo, hi, s, e)]
    if s != 0 or e != _box_size(lo, hi):
        # Rows over several layers come from whole-box holdings; a partial interval there
        # would not split into per-layer shards.
        raise ValueError(f"row {row} of {g.name} spans layers {lo[0]}..{hi[0] - 1} with a "
                         f"partial interval [{s}, {e}) of {_box_size(lo, hi)} elements")
    per_layer = _box_size(lo, hi) // (hi[0] - lo[0])
    return [((layer, lo[1], lo[2]), (layer + 1, hi[1], hi[2]), 0, per_layer)
            for layer in range(lo[0], hi[0])]


def shard_specs(catalog: Catalog, table: RegionTable, rank: int | None) -> list[ShardSpec]:
    """Every shard ``rank`` of ``table``'s layout holds, per state key and per layer.

    Sorted by (state key, lo, s), so every process lists them in the same order.
    ``rank=None`` (a process without a rank in that layout) holds nothing.
    """
    if rank is None:
        return []
    out: list[ShardSpec] = []
    for row in rank_rows(table, rank).tolist():
        gi = int(table.group[row])
        for lo, hi, s, e in row_shards(catalog, table, row):
            for state in catalog.groups[gi].states:
                out.append(ShardSpec(state.key, gi, lo, hi, s, e, state.itemsize))
    out.sort(key=lambda sp: (sp.state_key, sp.lo, sp.s))
    return out


def state_bytes(specs: list[ShardSpec]) -> int:
    """Bytes of a list of shards."""
    return sum(sp.nbytes for sp in specs)
