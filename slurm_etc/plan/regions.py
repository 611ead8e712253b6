"""Regions a layout holds: boxes in each tensor group's global index space.

A row of a ``RegionTable`` is a box (``lo``/``hi`` per axis, padded to three axes) and an
interval ``[s, e)`` of that box's row-major order, held by a set of holding classes
(``t + tp * (e + ep * p)``, see ``ParallelConfig.rank_of``) on one replica of them
(``dp_rank``: the expert data-parallel index, the dp rank when ep = cp = 1) or on all of
them (``-1``). Dense state is held alike by the ep classes of its (t, p) and by all
``dp x cp`` ranks of each (parameters are replicated over cp); the distributed optimizer's
dense buffers are cut over the ``dp x cp`` ranks (rank ``c + cp * d`` = class ep rank
``m % ep``, replica ``m // ep``), its expert buffers over the expert data-parallel replicas.

With VPP a pipeline rank holds ``vpp`` chunks of layers (``chunk_layers``), each a model
chunk of its own with its own distributed-optimizer buffers, as megatron-core builds them.
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

from .catalog import EXPERT_PREFIX, FIRST, LAST, LAYERS, TIED_SUFFIX, Catalog, TensorGroup
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
    layer: np.ndarray      # int32, the single model layer of a per-layer row, else -1
    lo: np.ndarray         # int64 (n, 3)
    hi: np.ndarray         # int64 (n, 3)
    s: np.ndarray          # int64 start of the row-major interval within the box
    e: np.ndarray          # int64 end
    dp_rank: np.ndarray    # int32 replica holding it, -1 = every replica
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
        w, n = cfg.class_width, cfg.replicas
        classes = self.class_idx[self.class_ptr[row]:self.class_ptr[row + 1]]
        t, p = classes % w, classes // w
        dps = np.arange(n) if self.dp_rank[row] < 0 else np.array([self.dp_rank[row]])
        ranks = (t[:, None] + w * (dps[None, :] + n * p[:, None])).ravel()
        return np.sort(ranks)

    @cached_property
    def rank_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(rank, row) pairs for every rank holding every row, sorted by rank then row."""
        cfg = self.config
        w, n = cfg.class_width, cfg.replicas
        n_cls = np.diff(self.class_ptr)
        row_of_cls = np.repeat(np.arange(len(self)), n_cls)
        t, p = self.class_idx % w, self.class_idx // w
        dp = self.dp_rank[row_of_cls]
        all_dp = dp < 0
        reps = np.where(all_dp, n, 1)
        rows = np.repeat(row_of_cls, reps)
        t, p = np.repeat(t, reps), np.repeat(p, reps)
        starts = np.cumsum(reps) - reps
        d = np.arange(len(rows)) - np.repeat(starts, reps)
        d = np.where(np.repeat(all_dp, reps), d, np.repeat(dp, reps))
        ranks = t + w * (d + n * p)
        order = np.lexsort((rows, ranks))
        return ranks[order].astype(np.int64), rows[order].astype(np.int64)


def chunk_layers(num_layers: int, pp: int, vpp: int, p: int, chunk: int) -> tuple[int, int]:
    """Layers of virtual chunk ``chunk`` of pipeline rank ``p``: megatron-core's
    ``get_transformer_layer_offset`` (chunk c of rank p is the (c * pp + p)-th slice)."""
    per = num_layers // (pp * vpp)
    first = (chunk * pp + p) * per
    return first, first + per


def layer_place(num_layers: int, pp: int, vpp: int, layer: int) -> tuple[int, int]:
    """(pipeline rank, chunk) holding a layer: the inverse of ``chunk_layers``."""
    chunk, p = divmod(layer // (num_layers // (pp * vpp)), pp)
    return p, chunk


def holds_group(g: TensorGroup, p: int, pp: int, chunk: int = 0, vpp: int = 1) -> bool:
    """Whether chunk ``chunk`` of pipeline rank ``p`` holds g: the embedding sits in the first
    chunk of the first rank, the final norm and output layer in the last of the last."""
    return (g.stage == LAYERS or (g.stage == FIRST and p == 0 and chunk == 0)
            or (g.stage == LAST and p == pp - 1 and chunk == vpp - 1))


def expert_range(g: TensorGroup, e: int, ep: int) -> tuple[int, int]:
    """Experts ep rank e holds of an expert group (consecutive, as SequentialMLP numbers
    them: ``ep_rank * local + i``)."""
    local = g.experts // ep
    return e * local, (e + 1) * local


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


def local_boxes(g: TensorGroup, t: int, tp: int, layers: tuple[int, int],
                experts: tuple[int, int] | None = None) -> list[Box]:
    """Boxes (lo, hi over NDIM axes) tp rank t holds of g over a layer range.

    For an expert group ``layers`` ranges over the folded (layer, expert) axis unless
    ``experts`` (an ep rank's expert range) is given: then one box per layer of ``layers``
    covers those experts, or one box for all when they are all the experts.
    """
    spans = [layers]
    if g.expert and experts is not None:
        e0, e1 = experts
        n = g.experts
        spans = ([(layers[0] * n, layers[1] * n)] if (e0, e1) == (0, n) else
                 [(layer * n + e0, layer * n + e1) for layer in range(*layers)])
    boxes: list[Box] = []
    for span in spans:
        lo = [0] * NDIM
        hi = list(g.shape) + [1] * (NDIM - len(g.shape))
        if g.stacked:
            lo[0], hi[0] = span
        if g.tp_axis is None:
            boxes.append((lo, hi))
            continue
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
                    s: np.ndarray, e: np.ndarray, dp_rank: np.ndarray,
                    cls: int | np.ndarray) -> None:
        n = len(group)
        self.chunks.append((group, layer, *lo.T, *hi.T, s, e, dp_rank,
                            np.broadcast_to(np.asarray(cls, np.int64), (n,))))

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


def dist_buffer(catalog: Catalog, config: ParallelConfig, t: int, p: int, chunk: int = 0,
                expert: bool = False, e: int = 0
                ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """The distributed optimizer's flat buffer of one rank's model chunk.

    Args:
        catalog: the model's tensor groups.
        config: the layout.
        t, p: the rank's tensor- and pipeline-parallel coordinates.
        chunk: the virtual pipeline chunk (each chunk is a DDP module of its own).
        expert: the expert-parallel buffer (expert parameters, cut over the expert
            data-parallel ranks) instead of the dense one (cut over dp x cp).
        e: the ep rank (which experts the expert buffer holds).

    Returns (entries, buckets): entries are (group index, layer, start offset) in buffer
    order (an expert group's layer is the folded ``layer * experts + expert``); buckets are
    (start, padded end) ranges, each cut into equal parts, one per data-parallel rank.
    Mirrors megatron-core's _ParamAndGradBuffer (0.16.1, overlap_grad_reduce off, so no size
    limit on buckets): parameters in reverse registration order, each start aligned to 64
    elements, bucket ends padded to a multiple of lcm(shards, 128); a tied embedding shared
    across pipeline stages gets a bucket of its own on both stages.
    """
    model = catalog.model
    layers = chunk_layers(model.num_layers, config.pp, config.vpp, p, chunk)
    held: list[tuple[tuple[int, ...], int, int]] = []
    for gi, g in enumerate(catalog.groups):
        if (not g.dist or _in_expert_buffer(g, config) != expert
                or not holds_group(g, p, config.pp, chunk, config.vpp)
                or _alias_of(catalog, g, config)):
            continue
        if g.expert:
            e0, e1 = expert_range(g, e, config.ep)
            held.extend((layer_order_key(g, layer * g.experts + j), gi, layer * g.experts + j)
                        for layer in range(*layers) for j in range(e0, e1))
        elif g.stacked:
            held.extend((layer_order_key(g, layer), gi, layer) for layer in range(*layers))
        else:
            held.append((layer_order_key(g, -1), gi, -1))
    held.sort(reverse=True)
    shards = config.replicas if expert else config.dp_cp
    align = lcm(shards, BUCKET_END_ALIGN)
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


def _in_expert_buffer(g: TensorGroup, config: ParallelConfig) -> bool:
    """Whether a parameter lives in the expert-parallel buffer: megatron's experts mark
    their parameters ``allreduce = not expert_parallel`` (``expert_model_parallel_size >
    1``), so at ep = 1 they are ordinary parameters of the dense buffer, in registration
    order with the rest, and there is no expert buffer (nor a second optimizer)."""
    return g.expert and config.ep > 1


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
# A MoE layer registers the router, then every local expert (fc1, fc2), then the shared one.
_LAYER_PARAM_ORDER = [
    "self_attention.linear_qkv.layer_norm_weight",   # input_layernorm
    "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight",              # pre_mlp_layernorm
    "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
    "mlp.router.weight",
    "mlp.experts.experts.",                          # SequentialMLP, expert by expert
    "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1.bias",
    "mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.linear_fc2.bias",
]
_EXPERT_PARAM_ORDER = ["linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight",
                       "linear_fc2.bias"]
_TOP_ORDER = {
    "embedding.word_embeddings.weight": (0, 0),
    "embedding.position_embeddings.weight": (0, 1),
    "decoder.final_layernorm.weight": (2, 0),
    "decoder.final_layernorm.bias": (2, 1),
    "output_layer.weight": (3, 0),
}


def layer_order_key(g: TensorGroup, layer: int) -> tuple[int, ...]:
    """Sort key of a parameter (one layer of it; for an expert group one folded
    (layer, expert) index) in megatron's registration order."""
    if g.expert:
        layer_of, expert = divmod(layer, g.experts)
        name = g.param.removeprefix(EXPERT_PREFIX)
        return (1, layer_of, _LAYER_PARAM_ORDER.index("mlp.experts.experts."), expert,
                _EXPERT_PARAM_ORDER.index(name))
    if g.stacked:
        name = g.param.removeprefix("decoder.layers.")
        return (1, layer, _LAYER_PARAM_ORDER.index(name), 0, 0)
    if g.param.endswith(TIED_SUFFIX):
        return (3, 0, 0, 0, 0)
    major, minor = _TOP_ORDER[g.param]
    return (major, 0, minor, 0, 0)


@lru_cache(maxsize=32)
def region_table(catalog: Catalog, config: ParallelConfig) -> RegionTable:
    """Every region each rank of ``config`` holds of every tensor group.

    Cached: the same layouts recur across resizes and simulations; the arrays are read-only.
    """
    b = _Builder()
    model = catalog.model
    tp, pp, ep, vpp = config.tp, config.pp, config.ep, config.vpp
    for p in range(pp):
        for chunk in range(vpp):
            layers = chunk_layers(model.num_layers, pp, vpp, p, chunk)
            for gi, g in enumerate(catalog.groups):
                if g.dist or not holds_group(g, p, pp, chunk, vpp):
                    continue
                for t in range(tp):
                    for e in range(ep):
                        cls = t + tp * (e + ep * p)
                        experts = expert_range(g, e, ep) if g.expert else None
                        for lo, hi in local_boxes(g, t, tp, layers, experts):
                            b.add(gi, _expert_layer(g, lo, hi), lo, hi, 0, _box_size(lo, hi),
                                  -1, cls)
            if catalog.distributed_optimizer:
                _add_dist_rows(b, catalog, config, p, chunk, expert=False)
                if model.moe and ep > 1:
                    _add_dist_rows(b, catalog, config, p, chunk, expert=True)
    return b.table(config)


def _expert_layer(g: TensorGroup, lo: Sequence[int], hi: Sequence[int]) -> int:
    """The layer column of a replicated row: the model layer of an expert box inside one
    layer (so the intersection pairs it only with rows of that layer), else -1. Expert rows
    of the distributed optimizer carry their model layer too, not the folded index."""
    if not g.expert or (hi[0] - 1) // g.experts != lo[0] // g.experts:
        return -1
    return int(lo[0]) // g.experts


def _add_dist_rows(b: _Builder, catalog: Catalog, config: ParallelConfig, p: int, chunk: int,
                   expert: bool) -> None:
    """The distributed optimizer's rows of one buffer (dense or expert) of every tp and ep
    rank of one model chunk of pipeline rank p.

    The flat buffer's layout (offsets, buckets) is the same for every tp rank of a stage
    (each holds an equal slice of every parameter), and for every ep rank (each holds an
    equal number of experts), so the pieces each data-parallel rank's range cuts are found
    once, vectorised over those ranks, and shifted along the tp axis per tp rank and along
    the folded expert axis per ep rank.
    """
    tp, ep = config.tp, config.ep
    entries, buckets = dist_buffer(catalog, config, 0, p, chunk, expert, 0)
    pieces = _dist_pieces(catalog, config, entries)
    if pieces is None:
        return
    start, end, lo0, hi0, shift, eshift, group, layers, n_experts = pieces
    shards = config.replicas if expert else config.dp_cp
    _, k, a, z, m = _range_cuts(start, end, buckets, shards)
    for t in range(tp):
        if expert:
            # one expert buffer per ep rank, cut over its expert data-parallel replicas
            for e in range(ep):
                off = t * shift[k] + e * eshift[k]
                lay = np.where(layers[k] >= 0, (layers[k] + e * eshift[k][:, 0]) // n_experts[k],
                               -1)
                b.add_columns(group[k], lay, lo0[k] + off, hi0[k] + off, a, z, m,
                              t + tp * (e + ep * p))
        else:
            # the dense buffer is cut over dp x cp ranks m: class ep rank m % ep, replica
            # m // ep
            # (at ep = 1 the experts are here too: their rows' layer is the model layer)
            off = t * shift[k]
            lay = np.where(layers[k] >= 0, layers[k] // n_experts[k], -1)
            b.add_columns(group[k], lay, lo0[k] + off, hi0[k] + off, a, z, m // ep,
                          t + tp * (m % ep + ep * p))


def _dist_pieces(catalog: Catalog, config: ParallelConfig,
                 entries: Sequence[tuple[int, int, int]]) -> tuple[np.ndarray, ...] | None:
    """Every box of every entry of a flat buffer, in buffer order, at tp rank 0 and ep rank
    0: (start, end, lo, hi, tp shift, ep shift, group, layer, experts per group) arrays, an
    alias repeating its main entry's boxes; None for an empty buffer."""
    tp, ep = config.tp, config.ep
    aliases: dict[int, tuple[int, ...]] = {}
    for gi, g in enumerate(catalog.groups):
        main = _alias_of(catalog, g, config) if g.dist else None
        if main is not None:
            aliases[main] = (main, gi)
    p_group: list[int] = []
    p_layer: list[int] = []
    p_lo: list[list[int]] = []
    p_hi: list[list[int]] = []
    p_shift: list[list[int]] = []
    p_eshift: list[int] = []
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
                p_eshift.append(g.experts // ep if g.expert else 0)
                p_start.append(base)
                p_size.append(size)
            base += size
    if not p_start:
        return None
    start = np.array(p_start, np.int64)
    end = start + np.array(p_size, np.int64)
    lo0, hi0 = np.array(p_lo, np.int64), np.array(p_hi, np.int64)
    shift = np.array(p_shift, np.int64)
    eshift = np.zeros_like(shift)
    eshift[:, 0] = p_eshift
    group, layers = np.array(p_group, np.int64), np.array(p_layer, np.int64)
    n_experts = np.array([max(catalog.groups[gi].experts, 1) for gi in p_group], np.int64)
    return start, end, lo0, hi0, shift, eshift, group, layers, n_experts


def _range_cuts(start: np.ndarray, end: np.ndarray, buckets: Sequence[tuple[int, int]],
                shards: int) -> tuple[np.ndarray, ...]:
    """The pieces each of ``shards`` data-parallel ranks' range of every bucket cuts:
    (range, piece, piece-relative start, end, rank) arrays.

    Pieces are in buffer order and disjoint (an alias repeats its main entry's range), so
    the pieces a range [r0, r1) meets are the slice from the first ending after r0 to the
    last starting before r1."""
    bs = np.array([x for x, _ in buckets], np.int64)
    be = np.array([y for _, y in buckets], np.int64)
    part = (be - bs) // shards
    r0 = (bs[:, None] + np.arange(shards)[None, :] * part[:, None]).ravel()
    r1 = r0 + np.repeat(part, shards)
    d = np.tile(np.arange(shards, dtype=np.int64), len(bs))
    first = np.searchsorted(end, r0, side="right")
    last = np.searchsorted(start, r1, side="left")
    n = np.maximum(last - first, 0)
    which = np.repeat(np.arange(len(r0)), n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + np.repeat(first, n)
    a = np.maximum(r0[which] - start[k], 0)
    z = np.minimum(r1[which] - start[k], end[k] - start[k])
    ok = a < z
    which, k, a, z = which[ok], k[ok], a[ok], z[ok]
    return which, k, a, z, d[which]
