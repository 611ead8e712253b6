"""Property tests: vranks stable, no device twice, tp groups inside a node, valid configs."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_etc.alloc import (
    ClusterTopology,
    Hardware,
    TrainingJob,
    allocate,
    capacity,
    choose_config,
    identity_layout,
    split_tp_groups,
)
from slurm_etc.alloc.chooser import memory_bytes
from slurm_etc.plan import PRESETS, ConfigError

pytestmark = pytest.mark.unit

SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def histories(draw):
    """A cluster and a sequence of (held devices, tp, world) steps of one job."""
    gpus = draw(st.sampled_from([4, 8]))
    topo = ClusterTopology.uniform(draw(st.integers(2, 8)), gpus,
                                   nodes_per_switch=draw(st.sampled_from([None, 2, 3])))
    every = [d for n in topo.nodes for d in topo.devices_of(n)]
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        held = draw(st.sets(st.sampled_from(every), min_size=1))
        tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if gpus % t == 0]))
        counts = [sum(d.node == n for d in held) for n in topo.nodes]
        room = capacity(counts, tp)
        world = tp * draw(st.integers(0, room // tp))
        steps.append((sorted(held), tp, world))
    return topo, steps, draw(st.randoms())


@SETTINGS
@given(histories())
def test_allocations_are_stable_compact_and_never_reuse_a_device(history):
    topo, steps, rnd = history
    G = topo.gpus_per_node
    previous = {}
    for held, tp, world in steps:
        shuffled = list(held)
        rnd.shuffle(shuffled)
        alloc = allocate(shuffled, world, tp, topo, previous=previous)
        # deterministic: the order devices are listed in does not matter
        assert alloc == allocate(held, world, tp, topo, previous=previous)
        devices = list(alloc.vranks.values())
        assert len(devices) == len(set(devices)) == world
        assert set(devices) | set(alloc.released) == set(held)
        assert not set(devices) & set(alloc.released)
        # stable: a device kept keeps its vrank
        before = {d: v for v, d in previous.items()}
        assert all(before[d] == v for v, d in alloc.vranks.items() if d in before)
        # one node per vrank slot, and whole tp groups per node
        slot_nodes = {}
        for v, d in alloc.vranks.items():
            assert slot_nodes.setdefault(v // G, d.node) == d.node
        per_node = {}
        for d in devices:
            per_node[d.node] = per_node.get(d.node, 0) + 1
        assert all(c % tp == 0 for c in per_node.values())
        # compact: as few nodes as any placement could use
        usable = sorted(((sum(d.node == n for d in held) // tp) * tp for n in topo.nodes),
                        reverse=True)
        fewest = next((m for m in range(len(usable) + 1) if sum(usable[:m]) >= world), None)
        assert len(per_node) == fewest
        previous = alloc.vranks


MODELS = ["tiny", "tiny-llama", "gpt-1.3b", "llama-7b", "llama-13b"]


@SETTINGS
@given(model=st.sampled_from(MODELS), batch=st.sampled_from([64, 96, 512, 768, 1536]),
       micro=st.sampled_from([1, 2]), counts=st.lists(st.integers(0, 8), min_size=1,
                                                       max_size=24),
       allowed_tp=st.sampled_from([None, (1, 2), (2, 4, 8), (8,)]),
       allowed_pp=st.sampled_from([None, (1,), (1, 2, 4)]),
       max_nodes=st.sampled_from([None, 2, 8]), seed=st.integers(0, 1000))
def test_chosen_configurations_are_valid_and_placeable(model, batch, micro, counts,
                                                       allowed_tp, allowed_pp, max_nodes,
                                                       seed):
    job = TrainingJob(PRESETS[model], batch, micro)
    hw = Hardware()
    try:
        choice = choose_config(job, hw, counts, allowed_tp=allowed_tp, allowed_pp=allowed_pp,
                               max_nodes=max_nodes)
    except ConfigError:
        return
    c = choice.config
    c.validate_for(job.model)
    assert batch % (c.dp * micro) == 0
    assert allowed_tp is None or c.tp in allowed_tp
    assert allowed_pp is None or c.pp in allowed_pp
    assert memory_bytes(job, c) <= (hw.memory_gib - hw.reserved_gib) * 2 ** 30
    assert c.world <= capacity(counts, c.tp, max_nodes)
    # the allocator can always place what the chooser offers, tp groups inside nodes
    topo = ClusterTopology.uniform(len(counts), 8)
    held = [d for n, k in zip(topo.nodes, counts) for d in topo.devices_of(n)[:k]]
    random.Random(seed).shuffle(held)
    alloc = allocate(held, c.world, c.tp, topo, max_nodes=max_nodes)
    assert split_tp_groups(identity_layout(c, alloc.pool), 8) == 0
