"""Plain-JSON metadata of megatron-core sharded state dicts.

megatron-core's ``sharded_state_dict()`` (model or optimizer) is a nested dict/list whose
leaves are ``ShardedTensor`` (a rank's box of a global tensor), ``ShardedTensorFactory``
(a tensor saved as several ShardedTensors, e.g. the SwiGLU ``linear_fc1`` weight, whose gate
and up halves are sharded separately), ``ShardedObject`` (pickled per-rank objects such as the
optimizer's bucket sizes) and plain or non-persistent values. The shard catalog only needs
the ShardedTensors' metadata, which :func:`shard_records` turns into plain dicts that can be
compared, stored as JSON and reproduced without building the model.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InternalError

RECORD_FIELDS = ("key", "path", "dtype", "global_shape", "global_offset", "local_shape",
                 "axis_fragmentations", "replica_id", "prepend_axis_num", "flattened_range")


def _walk(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) of a nested dict/list, in insertion order."""
    if isinstance(node, dict):
        for name, child in node.items():
            yield from _walk(child, f"{path}.{name}" if path else str(name))
    elif isinstance(node, (list, tuple)):
        for index, child in enumerate(node):
            yield from _walk(child, f"{path}.{index}" if path else str(index))
    else:
        yield path, node


def iter_sharded_leaves(sharded_state_dict: Any) -> Iterator[tuple[str, Any]]:
    """(path, ShardedTensor or ShardedObject), with ShardedTensorFactories expanded.

    Factories are built (``factory.build()``) and their ShardedTensors reported under the
    factory's path with the index of each part appended. Other leaves are skipped.
    """
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    for path, leaf in _walk(sharded_state_dict, ""):
        if isinstance(leaf, ShardedTensorFactory):
            yield from iter_sharded_leaves({path: leaf.build()})
        elif isinstance(leaf, (ShardedTensor, ShardedObject)):
            yield path, leaf


def iter_sharded_tensors(sharded_state_dict: Any) -> Iterator[tuple[str, Any]]:
    """(path, ShardedTensor) for every ShardedTensor, factories expanded.

    The tensors' ``data`` are the live parameters or views of them (SwiGLU halves), so
    writing into them writes the model.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for path, leaf in iter_sharded_leaves(sharded_state_dict):
        if isinstance(leaf, ShardedTensor):
            yield path, leaf


def _replica_id(replica_id: Any) -> list[int] | int:
    return list(replica_id) if isinstance(replica_id, (tuple, list)) else int(replica_id)


def shard_record(path: str, sh: Any) -> dict:
    """The plain-JSON metadata of one ShardedTensor.

    ``dtype`` is the torch dtype without its ``torch.`` prefix; ``replica_id`` is a list
    (megatron uses ``(pp-or-tie, tp, dp)`` style tuples; all zeros marks the main copy) or an
    int; ``flattened_range`` is ``[start, stop]`` into the flattened ``local_shape`` or None.
    """
    flat = sh.flattened_range
    return {
        "key": sh.key,
        "path": path,
        "dtype": str(sh.dtype).removeprefix("torch."),
        "global_shape": list(sh.global_shape),
        "global_offset": list(sh.global_offset),
        "local_shape": list(sh.local_shape),
        "axis_fragmentations": (list(sh.axis_fragmentations)
                                if sh.axis_fragmentations is not None else None),
        "replica_id": _replica_id(sh.replica_id),
        "prepend_axis_num": sh.prepend_axis_num,
        "flattened_range": [flat.start, flat.stop] if flat is not None else None,
    }


def shard_records(sharded_state_dict: Any) -> list[dict]:
    """Metadata of every ShardedTensor in a sharded state dict, in traversal order.

    ShardedTensorFactories are expanded into their ShardedTensors (the SwiGLU ``linear_fc1``
    gives two records per rank with the same key); ShardedObjects are not included (see
    :func:`sharded_object_keys`).
    """
    return [shard_record(path, sh) for path, sh in iter_sharded_tensors(sharded_state_dict)]


def sharded_object_keys(sharded_state_dict: Any) -> list[str]:
    """Keys of the ShardedObjects in a sharded state dict (skipped by :func:`shard_records`)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return [leaf.key for _path, leaf in iter_sharded_leaves(sharded_state_dict)
            if isinstance(leaf, ShardedObject)]


def is_main_replica(record: dict) -> bool:
    """Whether a record is the main copy of its region (every replica id component is 0)."""
    replica = record["replica_id"]
    return all(r == 0 for r in replica) if isinstance(replica, list) else replica == 0


def record_numel(record: dict) -> int:
    """Elements the record covers (its flattened range if it has one)."""
    if record["flattened_range"] is not None:
        start, stop = record["flattened_range"]
        return stop - start
    numel = 1
    for n in record["local_shape"]:
        numel *= n
    return numel


# -- moving boxes between layouts (the live reshard, :mod:`.reshard`) -----------------------

@dataclass(frozen=True)
class PieceMeta:
    """Where one local tensor lies in its global tensor: box ``[lo, hi)`` over every axis
    (the prepended layer / expert axes have length 1), and whether it is the main copy.

    Attributes:
        key: the global tensor (megatron's ShardedTensor key).
        path: where it sits in the rank's sharded state dict (names the vpp chunk).
        lo, hi: the box.
        main: every replica id component is 0 (the copy a move reads).
        global_shape: the global tensor's shape.
    """

    key: str
    path: str
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    main: bool
    global_shape: tuple[int, ...]

    @classmethod
    def of(cls, path: str, sh: Any) -> "PieceMeta":
        """The metadata of a (model-space) ShardedTensor."""
        p = sh.prepend_axis_num
        lo = tuple(int(x) for x in sh.global_offset)
        hi = tuple(o + 1 for o in lo[:p]) + tuple(
            o + int(n) for o, n in zip(lo[p:], sh.local_shape))
        replica = sh.replica_id if isinstance(sh.replica_id, (tuple, list)) else (sh.replica_id,)
        return cls(sh.key, path, lo, hi, all(int(r) == 0 for r in replica),
                   tuple(int(n) for n in sh.global_shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.lo, self.hi))

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def renamed(self, key: str, path: str) -> "PieceMeta":
        """The same box of another tensor (an optimizer state of this parameter)."""
        return PieceMeta(key, path, self.lo, self.hi, self.main, self.global_shape)

    def to_json(self) -> list:
        return [self.key, self.path, list(self.lo), list(self.hi), self.main,
                list(self.global_shape)]

    @classmethod
    def from_json(cls, row: list) -> "PieceMeta":
        key, path, lo, hi, main, shape = row
        return cls(str(key), str(path), tuple(int(x) for x in lo), tuple(int(x) for x in hi),
                   bool(main), tuple(int(x) for x in shape))


@dataclass(frozen=True)
class BoxMove:
    """Box ``[lo, hi)`` of ``key`` from old rank ``src`` (its piece ``src_piece``) to new rank
    ``dst`` (its piece ``dst_piece``)."""

    key: str
    src: int
    src_piece: int
    dst: int
    dst_piece: int
    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for a, b in zip(self.lo, self.hi):
            n *= b - a
        return n


class MoveError(InternalError, ValueError):
    """The old layout's pieces do not cover a piece the new layout needs, exactly once."""


def plan_box_moves(old: Sequence[Sequence[PieceMeta]], new: Sequence[Sequence[PieceMeta]]
                   ) -> list[BoxMove]:
    """Every box each new rank needs, from the old ranks' main copies that intersect it.

    ``old[r]`` / ``new[r]``: rank r's pieces in each layout. Pure and deterministic: every
    rank computes the same list from the same inputs (old pieces by key in (rank, piece)
    order; moves in (new rank, piece, old rank, piece) order).

    Raises:
        MoveError: a new piece is not covered exactly once by old main copies (overlapping
            or missing old boxes, or a global shape that differs), with the numbers.
    """
    sources: dict[str, list[tuple[int, int, PieceMeta]]] = {}
    for rank, metas in enumerate(old):
        for i, m in enumerate(metas):
            if m.main:
                sources.setdefault(m.key, []).append((rank, i, m))
    moves: list[BoxMove] = []
    for dst, metas in enumerate(new):
        for j, want in enumerate(metas):
            covered = 0
            for src, i, have in sources.get(want.key, []):
                if have.global_shape != want.global_shape:
                    raise MoveError(f"{want.key}: global shape {have.global_shape} in the old "
                                    f"layout, {want.global_shape} in the new one")
                lo = tuple(max(a, b) for a, b in zip(have.lo, want.lo))
                hi = tuple(min(a, b) for a, b in zip(have.hi, want.hi))
                if any(a >= b for a, b in zip(lo, hi)):
                    continue
                move = BoxMove(want.key, src, i, dst, j, lo, hi)
                covered += move.numel
                moves.append(move)
            if covered != want.numel:
                raise MoveError(f"{want.key} {list(want.lo)}..{list(want.hi)} of new rank {dst}: "
                                f"old main copies cover {covered} of its {want.numel} elements")
    return moves
