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

from collections.abc import Iterator
from typing import Any

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
