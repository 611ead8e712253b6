"""The executor across real gloo processes when a device died without notice.

A pool of 4 gloo ranks (device id = pool rank) holds dp=2,tp=2 fake state. Device 2 (tp rank
0 of dp replica 1) is lost: it calls nothing, not even ``new_group`` (with a loss the
migration group is built with ``use_local_synchronization``, so only the participants take
part). The three survivors resize to dp=1,tp=1,pp=2 on devices 0 and 3 (what device 2 held
comes from device 0), device 1 departs; every new shard is checked bit for bit against the
global values.
"""
from __future__ import annotations

import pytest

from tests.dist.harness import pool_fixture

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

pool4 = pool_fixture(4, preload=("slurm_etc.migrate.executor", "slurm_etc.plan"))

LOST = (2,)


def _plan():
    from slurm_etc.plan import PRESETS, Layout, ParallelConfig, Topology, plan_migration

    old = ParallelConfig(2, 2, 1)
    return plan_migration(PRESETS["tiny-llama"], Layout(old, (0, 1, 2, 3)),
                          ParallelConfig(1, 1, 2), (0, 3), Topology(gpus_per_node=4),
                          keep_tp_in_node=False, lost=LOST)


def _survivor(rank, world):
    from slurm_etc.migrate.executor import MigrationOptions, execute_migration
    from slurm_etc.migrate.group import new_migration_group
    from slurm_etc.testing.fake_state import fake_shards, shard_mismatches

    if rank in LOST:
        return None  # dead: takes part in nothing
    plan = _plan()
    group = new_migration_group(plan, rank, timeout_s=60)
    old_rank = plan.old.devices.index(rank)
    res = execute_migration(plan, group.transport(), rank, fake_shards(plan, old_rank),
                            options=MigrationOptions(timeout_s=30, measure_memory=False))
    group.destroy()
    return {"group": group.devices, "rank": group.rank, "new_rank": res.new_rank,
            "departing": res.departing, "sent": res.stats.sent_bytes,
            "mismatches": shard_mismatches(plan, res.new_rank, res.new_shards)}


def test_survivors_migrate_over_a_group_without_the_dead(pool4):
    plan = _plan()
    assert plan.participants == (0, 1, 3)
    out = pool4.run(_survivor)
    assert out[2] is None
    for d in (0, 1, 3):
        assert out[d]["group"] == (0, 1, 3) and out[d]["rank"] == (0, 1, 3).index(d)
        assert out[d]["mismatches"] == []
        assert out[d]["departing"] == (d == 1)
    assert {out[d]["new_rank"] for d in (0, 3)} == {0, 1}
    assert sum(out[d]["sent"] for d in (0, 1, 3)) == plan.moved_bytes > 0
