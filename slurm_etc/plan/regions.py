"""Regions a layout holds: boxes in each tensor group's global index space.

A row of a ``RegionTable`` is a box (``lo``/``hi`` per axis, padded to three axes) and an
interval ``[s, e)`` of that box's row-major order, held by a set of model-parallel classes
(``t + tp * p``) on one data-parallel rank (``dp_rank``) or on all of them (``-1``).
Whole boxes have ``[0, size)``; the distributed optimizer's flat ranges cut a parameter's
local tensor into such intervals (a row-major interval of a box stays an interval of any
sub-box's row-major order, which is what makes intersections cheap; see intersect.py).

Rows of one table never overlap partially: replicas (same box, same interval) are merged
into one row held by several classes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from math import lcm

import numpy as np

from .catalog import FIRST, LAST, LAYERS, TIED_SUFFIX, Catalog, TensorGroup
from .config import ParallelConfig

NDIM = 3
# megatron-core DistributedOptimizer buffer rules (param_and_grad_buffer.py, 0.16.1).
PARAM_START_ALIGN = 64
BUCKET_END_ALIGN = 128


@dataclass(frozen=True)
class RegionTable:
    """Column arrays, one entry per held region (see module docstring)."""

    config: ParallelConfig
    group: np.ndarray      # int32, index into catalog.groups
    layer: np.ndarray      # int32, the single layer of a per-layer row, else -1
    lo: np.ndarray         # int64 (n, 3)
    hi: np.ndarray         # int64 (n, 3)
    s: np.ndarray          # int64 start of the row-major interval within the box
    e: np.ndarray          # int64 end
    dp_rank: np.ndarray    # int32, -1 = every dp rank holds it
    class_ptr: np.ndarray  # int64 CSR pointers into class_idx
    class_idx: np.ndarray  # int32 model-parallel classes holding the row

    def __len__(self) -> int:
        return len(self.group)

    @property
    def count(self) -> np.ndarray:
        count: np.ndarray = self.e - self.s
        return count

    def holder_ranks(self, row: int) -> np.ndarray:
        """Ranks holding a row, ascending."""
        cfg = self.config
        classes = self.class_idx[self.class_ptr[row]:self.class_ptr[row + 1]]
        t, p = classes % cfg.tp, classes // cfg.tp
        dps = np.arange(cfg.dp) if self.dp_rank[row] < 0 else np.array([self.dp_rank[row]])
        ranks = (t[:, None] + cfg.tp * (dps[None, :] + cfg.dp * p[:, None])).ravel()
        return np.sort(ranks)

    @cached_property
    def rank_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(rank, row) pairs for every rank holding every row, sorted by rank then row."""
        cfg = self.config
        n_cls = np.diff(self.class_ptr)
        row_of_cls = np.repeat(np.arange(len(self)), n_cls)
        t, p = self.class_idx % cfg.tp, self.class_idx // cfg.tp
        dp = self.dp_rank[row_of_cls]
        all_dp = dp < 0
        reps = np.where(all_dp, cfg.dp, 1)
        rows = np.repeat(row_of_cls, reps)
        t, p = np.repeat(t, reps), np.repeat(p, reps)
        starts = np.cumsum(reps) - reps
        d = np.arange(len(rows)) - np.repeat(starts, reps)
        d = np.where(np.repeat(all_dp, reps), d, np.repeat(dp, reps))
        ranks = t + cfg.tp * (d + cfg.dp * p)
        order = np.lexsort((rows, ranks))
        return ranks[order].astype(np.int64), rows[order].astype(np.int64)


def stage_layers(num_layers: int, pp: int, p: int) -> tuple[int, int]:
    per = num_layers // pp
    return p * per, (p + 1) * per


def holds_group(g: TensorGroup, p: int, pp: int) -> bool:
    return g.stage == LAYERS or (g.stage == FIRST and p == 0) or (g.stage == LAST and p == pp - 1)


def tp_boxes(g: TensorGroup, t: int, tp: int) -> list[tuple[int, int]]:
    """Intervals along the tp axis held by tp rank t (two for SwiGLU, one otherwise)."""
    if g.tp_axis is None:
        raise ValueError(f"{g.param} is not split over tensor-parallel ranks")
    n = g.shape[g.tp_axis]
    if g.swiglu:
        half = n // 2
        w = half // tp
        return [(t * w, (t + 1) * w), (half + t * w, half + (t + 1) * w)]
    w = n // tp
    return [(t * w, (t + 1) * w)]


Box = tuple[list[int], list[int]]


def local_boxes(g: TensorGroup, t: int, tp: int, layers: tuple[int, int]) -> list[Box]:
    """Boxes (lo, hi over NDIM axes) tp rank t holds of g over a layer range."""
    lo = [0] * NDIM
    hi = list(g.shape) + [1] * (NDIM - len(g.shape))
    if g.stacked:
        lo[0], hi[0] = layers
    if g.tp_axis is None:
        return [(lo, hi)]
    boxes: list[Box] = []
    for a, b in tp_boxes(g, t, tp):
        blo, bhi = list(lo), list(hi)
        blo[g.tp_axis], bhi[g.tp_axis] = a, b
        boxes.append((blo, bhi))
    return boxes


def _box_size(lo: Sequence[int], hi: Sequence[int]) -> int:
    n = 1
    for a, b in zip(lo, hi):
        n *= b - a
    return n


class _Builder:
    """Collects rows as column chunks, then merges replicas (same region, same dp rank)
    across classes with one sort: no Python object per row."""

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, ...]] = []
        self.scalars: list[tuple[int, ...]] = []

    def add(self, group: int, layer: int, lo: Sequence[int], hi: Sequence[int], s: int, e: int,
            dp_rank: int, cls: int) -> None:
        self.scalars.append((group, layer, *lo, *hi, s, e, dp_rank, cls))

    def add_columns(self, group: np.ndarray, layer: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                    s: np.ndarray, e: np.ndarray, dp_rank: np.ndarray, cls: int) -> None:
        n = len(group)
        self.chunks.append((group, layer, *lo.T, *hi.T, s, e, dp_rank,
                            np.full(n, cls, np.int64)))

    def table(self, config: ParallelConfig) -> RegionTable:
        chunks = list(self.chunks)
        if self.scalars:
            chunks.append(tuple(np.array(self.scalars, np.int64).T))
        width = 2 + 2 * NDIM + 4
        cols = ([np.concatenate([np.asarray(c[k], np.int64) for c in chunks]) for k in
                 range(width)] if chunks else [np.empty(0, np.int64)] * width)
        key, cls = cols[:-1], cols[-1]
        # rows in key order (group, layer, lo, hi, s, e, dp rank), classes ascending
        order = np.lexsort((cls, *key[::-1]))
        key = [k[order] for k in key]
        cls = cls[order]
        n_all = len(cls)
        change = np.ones(n_all, bool)
        if n_all:
            change[1:] = np.any(np.stack([k[1:] != k[:-1] for k in key]), axis=0)
        first = np.flatnonzero(change)
        n = len(first)
        ptr = np.append(first, n_all).astype(np.int64)
        k = [x[first] for x in key]
        group, layer = k[0].astype(np.int32), k[1].astype(np.int32)
        lo = np.stack(k[2:2 + NDIM], axis=1).reshape(n, NDIM)
        hi = np.stack(k[2 + NDIM:2 + 2 * NDIM], axis=1).reshape(n, NDIM)
        s, e, dp = k[-3], k[-2], k[-1].astype(np.int32)
        idx = cls.astype(np.int32)
        arrays = (group, layer, lo, hi, s, e, dp, ptr, idx)
        for a in arrays:
            a.setflags(write=False)
        return RegionTable(config, *arrays)


def dist_buffer(catalog: Catalog, config: ParallelConfig, t: int, p: int
                ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """The distributed optimizer's flat buffer of one model-parallel rank.

    Returns (entries, buckets): entries are (group index, layer, start offset) in buffer
    order; buckets are (start, padded end) ranges, each cut into dp equal parts.
    Mirrors megatron-core's _ParamAndGradBuffer (0.16.1, overlap_grad_reduce off, so no size
    limit on buckets): parameters in reverse registration order, each start aligned to 64
    elements, bucket ends padded to a multiple of lcm(dp, 128); a tied embedding shared
    across pipeline stages gets a bucket of its own on both stages.
    """
    model = catalog.model
    layers = stage_layers(model.num_layers, config.pp, p)
    held: list[tuple[tuple[int, int, int], int, int]] = []
    for gi, g in enumerate(catalog.groups):
        if not g.dist or not holds_group(g, p, config.pp) or _alias_of(catalog, g, config):
            continue
        if g.stacked:
            held.extend((layer_order_key(g, layer), gi, layer) for layer in range(*layers))
        else:
            held.append((layer_order_key(g, -1), gi, -1))
    held.sort(reverse=True)
    align = lcm(config.dp, BUCKET_END_ALIGN)
    entries: list[tuple[int, int, int]] = []
    buckets: list[tuple[int, int]] = []
    offset = bucket_start = 0
    in_bucket = 0

    def close(end: int) -> int:
        nonlocal bucket_start, in_bucket
        padded = -(-end // align) * align
        buckets.append((bucket_start, padded))
        bucket_start, in_bucket = padded, 0
        return padded

    for _, gi, layer in held:
        g = catalog.groups[gi]
        shared = _shared_embedding(g, model.tied_embeddings, config.pp)
        offset = -(-offset // PARAM_START_ALIGN) * PARAM_START_ALIGN
        if shared and in_bucket:
            offset = close(offset)
        entries.append((gi, layer, offset))
        in_bucket += 1
        offset += sum(_box_size(lo, hi) for lo, hi in
                      local_boxes(g, t, config.tp, (layer, layer + 1) if g.stacked else (0, 1)))
        if shared:
            offset = close(offset)
    if in_bucket:
        close(offset)
    return entries, buckets


def _alias_of(catalog: Catalog, g: TensorGroup, config: ParallelConfig) -> int | None:
    """With one pipeline stage a tied output layer IS the word embedding: its group aliases
    the embedding's (same memory, same buffer entry). Returns the embedding's group index."""
    if config.pp > 1 or not g.param.endswith(TIED_SUFFIX):
        return None
    return catalog.index(g.name.replace(TIED_SUFFIX, ""))


def _shared_embedding(g: TensorGroup, tied: bool, pp: int) -> bool:
    """megatron marks a tied word embedding ``shared_embedding`` when pp > 1."""
    return tied and pp > 1 and g.param.startswith("embedding.word_embeddings.weight")


# Registration order of parameters inside megatron's GPTModel (local layer spec):
# embeddings, then per layer in module-construction order, then final norm, output layer.
_LAYER_PARAM_ORDER = [
    "self_attention.linear_qkv.layer_norm_weight",   # input_layernorm
    "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "mlp.linear_fc1.layer_norm_weight",              # pre_mlp_layernorm
    "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
]
_TOP_ORDER = {
    "embedding.word_embeddings.weight": (0, 0),
    "embedding.position_embeddings.weight": (0, 1),
    "decoder.final_layernorm.weight": (2, 0),
    "decoder.final_layernorm.bias": (2, 1),
    "output_layer.weight": (3, 0),
}


def layer_order_key(g: TensorGroup, layer: int) -> tuple[int, int, int]:
    """Sort key of a parameter (one layer of it) in megatron's registration order."""
    if g.stacked:
        name = g.param.removeprefix("decoder.layers.")
        return (1, layer, _LAYER_PARAM_ORDER.index(name))
    if g.param.endswith(TIED_SUFFIX):
        return (3, 0, 0)
    major, minor = _TOP_ORDER[g.param]
    return (major, 0, minor)


@lru_cache(maxsize=32)
def region_table(catalog: Catalog, config: ParallelConfig) -> RegionTable:
    """Every region each rank of ``config`` holds of every tensor group.

    Cached: the same layouts recur across resizes and simulations; the arrays are read-only.
    """
    b = _Builder()
    model = catalog.model
    tp, pp = config.tp, config.pp
    for p in range(pp):
        layers = stage_layers(model.num_layers, pp, p)
        for t in range(tp):
            cls = t + tp * p
            for gi, g in enumerate(catalog.groups):
                if g.dist or not holds_group(g, p, pp):
                    continue
                for lo, hi in local_boxes(g, t, tp, layers):
                    b.add(gi, -1, lo, hi, 0, _box_size(lo, hi), -1, cls)
        if catalog.distributed_optimizer:
            _add_dist_rows(b, catalog, config, p)
    return b.table(config)


def _add_dist_rows(b: _Builder, catalog: Catalog, config: ParallelConfig, p: int) -> None:
    """The distributed optimizer's rows of every tp rank of pipeline stage p.

    The flat buffer's layout (offsets, buckets) is the same for every tp rank of a stage
    (each holds an equal slice of every parameter), so the pieces each dp rank's range cuts
    are found once, vectorised over dp ranks, and shifted along the tp axis per tp rank.
    """
    tp = config.tp
    entries, buckets = dist_buffer(catalog, config, 0, p)
    aliases: dict[int, tuple[int, ...]] = {}
    for gi, g in enumerate(catalog.groups):
        main = _alias_of(catalog, g, config) if g.dist else None
        if main is not None:
            aliases[main] = (main, gi)
    # every box of every entry, in buffer order, with its tp rank 0 position and tp shift
    p_group: list[int] = []
    p_layer: list[int] = []
    p_lo: list[list[int]] = []
    p_hi: list[list[int]] = []
    p_shift: list[list[int]] = []
    p_start: list[int] = []
    p_size: list[int] = []
    for gi, layer, off in entries:
        g = catalog.groups[gi]
        span = (layer, layer + 1) if g.stacked else (0, 1)
        base = off
        for lo, hi in local_boxes(g, 0, tp, span):
            size = _box_size(lo, hi)
            step = [0] * NDIM
            if g.tp_axis is not None:
                step[g.tp_axis] = hi[g.tp_axis] - lo[g.tp_axis]
            for alias in aliases.get(gi, (gi,)):
                p_group.append(alias)
                p_layer.append(layer if g.stacked else -1)
                p_lo.append(lo)
                p_hi.append(hi)
                p_shift.append(step)
                p_start.append(base)
                p_size.append(size)
            base += size
    if not p_start:
        return
    start = np.array(p_start, np.int64)
    end = start + np.array(p_size, np.int64)
    lo0, hi0 = np.array(p_lo, np.int64), np.array(p_hi, np.int64)
    shift = np.array(p_shift, np.int64)
    group, layers = np.array(p_group, np.int64), np.array(p_layer, np.int64)
    # every dp rank's range of every bucket, then the pieces it cuts: pieces are in buffer
    # order and disjoint (an alias repeats its main entry's range), so the pieces a range
    # [r0, r1) meets are the slice from the first ending after r0 to the last starting
    # before r1
    bs = np.array([x for x, _ in buckets], np.int64)
    be = np.array([y for _, y in buckets], np.int64)
    part = (be - bs) // config.dp
    r0 = (bs[:, None] + np.arange(config.dp)[None, :] * part[:, None]).ravel()
    r1 = r0 + np.repeat(part, config.dp)
    d = np.tile(np.arange(config.dp, dtype=np.int64), len(bs))
    first = np.searchsorted(end, r0, side="right")
    last = np.searchsorted(start, r1, side="left")
    n = np.maximum(last - first, 0)
    which = np.repeat(np.arange(len(r0)), n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + np.repeat(first, n)
    a = np.maximum(r0[which] - start[k], 0)
    z = np.minimum(r1[which] - start[k], end[k] - start[k])
    ok = a < z
    which, k, a, z = which[ok], k[ok], a[ok], z[ok]
    for t in range(tp):
        off = t * shift[k]
        b.add_columns(group[k], layers[k], lo0[k] + off, hi0[k] + off, a, z, d[which],
                      t + tp * p)
