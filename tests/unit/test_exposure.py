"""The chooser counts exposure (issue #43 part 1): of near-equal configurations it prefers
one where losing any node leaves a copy of every shard, then the fewest bytes moved.
``survives_node_loss`` is checked against a brute force that shares no code with it (every
rank's shard from megatron-core's rank order, written out here)."""
from __future__ import annotations

from itertools import product

import pytest

from slurm_etc.alloc.chooser import TrainingJob, choose_config, survives_node_loss
from slurm_etc.local.demo import DEMO_HARDWARE
from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.model import PRESETS

pytestmark = pytest.mark.unit


def nodes_of(world: int, per_node: int) -> list[str]:
    """Rank r on the r-th device, ``per_node`` devices a node (the compact placement)."""
    return [f"n{r // per_node}" for r in range(world)]


def brute_force(tp: int, dp: int, pp: int, nodes: list[str]) -> bool:
    """Dense layouts: rank = t + tp * (d + dp * p) (megatron-core's tp-dp-pp order); the
    shard of a rank is (t, p); every shard must live on two nodes or more."""
    where: dict[tuple[int, int], set[str]] = {}
    for t, d, p in product(range(tp), range(dp), range(pp)):
        where.setdefault((t, p), set()).add(nodes[t + tp * (d + dp * p)])
    return all(len(n) >= 2 for n in where.values())


CASES = [  # (tp, dp, pp, devices a node, survives)
    (2, 2, 1, 2, True),    # each dp replica (a tp pair) on its own node
    (1, 2, 2, 2, False),   # dp=2 yet both replicas of stage 0 on node 0
    (2, 1, 3, 2, False),   # the dp=1,tp=2,pp=3: no replica at all
    (2, 3, 1, 2, True),
    (1, 4, 1, 4, False),   # every replica on one node
    (1, 4, 2, 4, False),
    (2, 4, 2, 4, True),    # stage 0: replicas 0-1 on node 0, 2-3 on node 1
    (1, 2, 1, 1, True),
]


@pytest.mark.parametrize("tp, dp, pp, per_node, expect", CASES)
def test_survives_a_node_loss_as_the_brute_force_says(tp, dp, pp, per_node, expect):
    config = ParallelConfig(dp=dp, tp=tp, pp=pp)
    nodes = nodes_of(config.world, per_node)
    assert brute_force(tp, dp, pp, nodes) is expect
    assert survives_node_loss(config, nodes) is expect


def test_every_small_dense_layout_agrees_with_the_brute_force():
    for tp, dp, pp, per_node in product((1, 2, 4), (1, 2, 3, 4), (1, 2, 3), (1, 2, 4, 8)):
        config = ParallelConfig(dp=dp, tp=tp, pp=pp)
        nodes = nodes_of(config.world, per_node)
        assert survives_node_loss(config, nodes) == brute_force(tp, dp, pp, nodes), config


JOB = TrainingJob(PRESETS["small"], global_batch=24, micro_batch=1)


def test_of_near_equal_layouts_one_that_survives_comes_before_fewer_bytes():
    counts = [2, 2, 2]
    exposed = ParallelConfig(dp=1, tp=2, pp=3)

    def cost(config: ParallelConfig) -> int:  # the exposed layout moves the fewest bytes
        return 1 if (config.dp, config.tp, config.pp) == (1, 2, 3) else 1000 + config.world

    def survives(config: ParallelConfig) -> bool:
        return survives_node_loss(config, nodes_of(config.world, 2))

    plain = choose_config(JOB, DEMO_HARDWARE, counts, migration_cost=cost, tolerance=0.1)
    assert (plain.config.dp, plain.config.tp, plain.config.pp) == (1, 2, 3)
    safe = choose_config(JOB, DEMO_HARDWARE, counts, migration_cost=cost,
                         survives_loss=survives, tolerance=0.1)
    assert safe.config.dp >= 2 and survives(safe.config), safe.config
    assert "keeps a copy of every shard when a node is lost" in safe.reason, safe.reason
    # the exposed one is still weighed, last
    assert [c.config.dp for c in safe.near_equal][-1] == exposed.dp


def test_when_none_or_all_survive_the_bytes_decide_as_before():
    counts = [2, 2, 2]

    def cost(config: ParallelConfig) -> int:
        return config.world * 10 + config.pp

    base = choose_config(JOB, DEMO_HARDWARE, counts, migration_cost=cost, tolerance=0.1)
    for verdict in (True, False):
        got = choose_config(JOB, DEMO_HARDWARE, counts, migration_cost=cost,
                            survives_loss=lambda c, v=verdict: v, tolerance=0.1)
        assert got.config == base.config and got.reason == base.reason
