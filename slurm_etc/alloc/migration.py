"""What a resize costs, asked of the planner, memoised on the transition's shape.

The planner only cares which devices share a node and which device held which old rank, not
what the devices are called. Device ids are therefore relabelled canonically (nodes and
local indices numbered by first appearance) before planning, so the same transition on
other nodes is planned once. Results are mapped back to the caller's ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from ..plan import Layout, ModelDesc, ParallelConfig, Topology, plan_migration

_CACHE_SIZE = 8192


@dataclass(frozen=True)
class MigrationCost:
    """The planner's answer for one resize.

    Attributes:
        moved_bytes: bytes sent between devices under the planner's placement.
        lower_bound_moved_bytes: bytes any placement must move.
        est_seconds: the planner's time estimate of the transfers.
        assignment: new rank -> device id (the caller's ids).
    """

    moved_bytes: int
    lower_bound_moved_bytes: int
    est_seconds: float
    assignment: tuple[int, ...]


def migration_cost(model: ModelDesc, old: Layout, new_config: ParallelConfig,
                   pool: Sequence[int], topology: Topology) -> MigrationCost:
    """Plan ``old`` -> ``new_config`` on ``pool`` (tensor-parallel groups inside nodes).

    Args:
        model: the model.
        old: the current layout; device ids are node-aligned (``id // gpus_per_node`` is the
            node), as vranks and the planner's ids are.
        new_config: the next configuration.
        pool: device ids the new ranks may use (the allocator's pool).
        topology: node size and bandwidths.
    """
    G = topology.gpus_per_node
    label: dict[int, int] = {}
    node_label: dict[int, int] = {}
    next_local: dict[int, int] = {}
    for device in (*old.devices, *sorted(pool)):
        if device in label:
            continue
        node = node_label.setdefault(device // G, len(node_label))
        local = next_local.get(node, 0)
        next_local[node] = local + 1
        label[device] = node * G + local
    moved, lower, seconds, assignment = _plan(
        model, Layout(old.config, tuple(label[d] for d in old.devices)), new_config,
        tuple(sorted(label[d] for d in pool)), topology)
    back = {v: k for k, v in label.items()}
    return MigrationCost(moved, lower, seconds, tuple(back[d] for d in assignment))


def placement_moved_bytes(model: ModelDesc, old: Layout, new: Layout) -> int:
    """Bytes moved when new rank r runs on ``new.devices[r]`` (a fixed placement).

    Only which device held which old rank matters here, so devices are relabelled to make
    the fixed placement the planner's identity placement, whose bytes it reports as
    ``naive_moved_bytes``.
    """
    label = {d: r for r, d in enumerate(new.devices)}
    for d in old.devices:
        label.setdefault(d, len(label))
    relabelled = Layout(old.config, tuple(label[d] for d in old.devices))
    return _identity_bytes(model, relabelled, new.config)


@lru_cache(maxsize=_CACHE_SIZE)
def _plan(model: ModelDesc, old: Layout, new_config: ParallelConfig, pool: tuple[int, ...],
          topology: Topology) -> tuple[int, int, float, tuple[int, ...]]:
    plan = plan_migration(model, old, new_config, pool, topology, keep_tp_in_node=True)
    return plan.moved_bytes, plan.lower_bound_moved_bytes, plan.est_seconds, plan.assignment


@lru_cache(maxsize=_CACHE_SIZE)
def _identity_bytes(model: ModelDesc, old: Layout, new_config: ParallelConfig) -> int:
    plan = plan_migration(model, old, new_config, range(new_config.world),
                          Topology(gpus_per_node=new_config.world), keep_tp_in_node=False)
    return plan.naive_moved_bytes
