"""Allocator, chooser and the planner wrapper: worked examples."""
import pytest

from slurm_etc.alloc import (
    AllocationError,
    ClusterTopology,
    Device,
    Hardware,
    TrainingJob,
    allocate,
    capacity,
    choose_config,
    identity_layout,
    migration_cost,
    number_vranks,
    placement_moved_bytes,
    select_devices,
    split_tp_groups,
)
from slurm_etc.alloc.chooser import candidates, memory_bytes
from slurm_etc.plan import PRESETS, ConfigError, Layout, ParallelConfig, Topology, plan_migration

pytestmark = pytest.mark.unit

TOPO = ClusterTopology.uniform(8, 8, nodes_per_switch=4)


def node(i, locals_=range(8)):
    return [Device(TOPO.nodes[i], j) for j in locals_]


def nodes_of(devices):
    return sorted({d.node for d in devices})


def test_topology_ids_round_trip_and_reject_unknown_devices():
    d = Device("n0003", 5)
    assert TOPO.device_id(d) == 29 and TOPO.device(29) == d
    assert TOPO.switch("n0005") == "s1"
    with pytest.raises(AllocationError, match="unknown node 'x'"):
        TOPO.device_id(Device("x", 0))
    with pytest.raises(AllocationError, match="local index 8"):
        TOPO.check(Device("n0000", 8))
    with pytest.raises(AllocationError, match="unique"):
        ClusterTopology(8, ("a", "a"))


def test_whole_nodes_first_and_exact_fit_for_the_remainder():
    # node 0 whole, node 1 whole, node 2 has 4 free: 12 devices = node 0 + node 2 (exact),
    # not node 0 + half of node 1 (a new partly used node).
    avail = node(0) + node(1) + node(2, range(4))
    chosen = select_devices(avail, 12, 4, TOPO)
    assert nodes_of(chosen) == ["n0000", "n0002"]


def test_fewest_nodes_even_when_state_sits_on_small_nodes():
    avail = node(0) + node(1) + node(2, range(6)) + node(3, range(2))
    state = node(2, range(6)) + node(3, range(2))
    chosen = select_devices(avail, 16, 2, TOPO, in_layout=state)
    # only the two full nodes give 16 devices on 2 nodes; the state's nodes would need 3
    assert nodes_of(chosen) == ["n0000", "n0001"]


def test_state_in_place_breaks_ties_and_switch_locality():
    # nodes 0-3 on switch s0, 4-7 on s1; the job trains on nodes 4 and 5.
    avail = [d for i in range(8) for d in node(i)]
    chosen = select_devices(avail, 24, 8, TOPO, in_layout=node(4) + node(5))
    assert nodes_of(chosen) == ["n0004", "n0005", "n0006"]


def test_devices_that_cannot_join_a_tp_group_are_released():
    avail = node(0) + node(1, range(3))
    alloc = allocate(avail, 8, 4, TOPO)
    assert nodes_of(alloc.devices) == ["n0000"]
    assert alloc.released == tuple(node(1, range(3)))
    assert capacity([8, 3], 4) == 8 and capacity([8, 8, 6], 4, max_nodes=2) == 16


def test_too_few_placeable_devices_is_a_clear_error():
    with pytest.raises(AllocationError, match="cannot place 16 devices in tensor-parallel "
                                              "groups of 8"):
        select_devices(node(0) + node(1, range(7)), 16, 8, TOPO)
    with pytest.raises(AllocationError, match="more than max_nodes"):
        select_devices(node(0, range(4)) + node(1, range(4)), 8, 4, TOPO, max_nodes=1)


def test_pinned_devices_are_used_first_and_never_released():
    avail = node(0) + node(1) + node(2)
    alloc = allocate(avail, 8, 8, TOPO, pinned=node(2))
    assert nodes_of(alloc.devices) == ["n0002"]
    alloc = allocate(avail, 0, 8, TOPO, pinned=node(2))
    assert set(alloc.released) == set(node(0) + node(1))


def test_vranks_are_stable_and_new_nodes_fill_free_slots():
    first = number_vranks(node(0) + node(1) + node(2), {}, TOPO)
    assert first[0] == Device("n0000", 0) and first[23] == Device("n0002", 7)
    # node 1 leaves, node 5 joins: it takes slot 1; nodes 0 and 2 keep their vranks.
    second = number_vranks(node(0) + node(2) + node(5), first, TOPO)
    assert all(second[v] == d for v, d in first.items() if d.node != "n0001")
    assert {second[v].node for v in range(8, 16)} == {"n0005"}
    # a partial node: two devices of node 0 leave, two others of node 0 come back later.
    third = number_vranks(node(0, range(6)) + node(2) + node(5), second, TOPO)
    assert third == {v: d for v, d in second.items() if d not in node(0, [6, 7])}
    with pytest.raises(AllocationError, match="slot 0 holds devices of two nodes"):
        number_vranks([], {0: Device("n0000", 0), 1: Device("n0001", 0)}, TOPO)


def test_identity_layout_keeps_tp_groups_in_nodes():
    alloc = allocate(node(0, range(4)) + node(3) + node(6, range(4)), 16, 4, TOPO)
    layout = identity_layout(ParallelConfig(2, 4, 2), alloc.pool)
    assert split_tp_groups(layout, 8) == 0
    assert split_tp_groups(Layout(ParallelConfig(2, 4, 1), (0, 1, 2, 8, 3, 9, 10, 11)), 8) == 2


JOB = TrainingJob(PRESETS["llama-7b"], global_batch=1024)


def test_chosen_configuration_keeps_the_batch_fits_memory_and_is_valid():
    hw = Hardware()
    choice = choose_config(JOB, hw, [8] * 12)
    c = choice.config
    c.validate_for(JOB.model)
    assert c.world <= 96 and JOB.global_batch % c.dp == 0 and c.distributed_optimizer
    assert memory_bytes(JOB, c) <= (hw.memory_gib - hw.reserved_gib) * 2 ** 30
    assert choice.reason.startswith(str(c))


def test_policy_limits_the_candidates():
    got = candidates(JOB, Hardware(), [8] * 8, allowed_tp=[2], allowed_pp=[2, 4], max_nodes=4)
    # exactly the unrestricted candidates of 4 nodes that the policy allows
    want = {c.config for c in candidates(JOB, Hardware(), [8] * 4)
            if c.config.tp == 2 and c.config.pp in (2, 4)}
    assert len(want) > 1 and {c.config for c in got} == want


def test_no_configuration_names_what_limited_it():
    with pytest.raises(ConfigError, match=r"no parallel configuration of llama-70b fits 8 "
                                          r"devices on 1 node\(s\) with 80 GiB"):
        choose_config(TrainingJob(PRESETS["llama-70b"], 1536), Hardware(), [8])


def test_near_equal_candidates_are_decided_by_migration_cost():
    asked = []

    def cost(config):
        asked.append(config)
        return 0 if config.pp == 8 else 10 ** 12

    choice = choose_config(JOB, Hardware(), [8] * 16, migration_cost=cost, tolerance=0.5)
    assert len(asked) == len(choice.near_equal) > 1
    assert choice.config.pp == 8 and choice.best.moved_bytes == 0
    assert "moves the fewest bytes" in choice.reason


def test_first_fit_chooser_counts_devices_only():
    # 6 nodes with 4 free devices each: tp=8 only fits without the in-node rule.
    tp8 = candidates(JOB, Hardware(), [4] * 6, allowed_tp=[8])
    assert tp8 == []
    # without the rule only the count matters: 24 devices anywhere are 3 full nodes
    anywhere = candidates(JOB, Hardware(), [24], allowed_tp=[8], tp_in_node=False)
    in_nodes = candidates(JOB, Hardware(), [8] * 3, allowed_tp=[8])
    assert len(in_nodes) > 0 and {c.config for c in anywhere} == {c.config for c in in_nodes}


TINY = PRESETS["tiny"]


def test_migration_cost_maps_the_plan_back_to_the_callers_ids():
    topo = Topology(gpus_per_node=4)
    old = Layout(ParallelConfig(2, 2, 2), tuple(range(40, 48)))
    pool = tuple(range(44, 48)) + tuple(range(200, 204))
    new_config = ParallelConfig(4, 2, 1)
    got = migration_cost(TINY, old, new_config, pool, topo)
    direct = plan_migration(TINY, old, new_config, pool, topo)
    assert sorted(got.assignment) == sorted(pool)
    assert got.moved_bytes == direct.moved_bytes
    assert got.lower_bound_moved_bytes == direct.lower_bound_moved_bytes
    # the same shape elsewhere is the same plan, in other ids
    shifted = migration_cost(TINY, Layout(old.config, tuple(d + 400 for d in old.devices)),
                             new_config, tuple(d + 400 for d in pool), topo)
    assert shifted.assignment == tuple(d + 400 for d in got.assignment)


def test_placement_moved_bytes_is_the_planners_identity_placement():
    old = Layout(ParallelConfig(2, 2, 1), (0, 1, 2, 3))
    new = Layout(ParallelConfig(4, 1, 1), (3, 2, 1, 0))
    direct = plan_migration(TINY, old, new.config, new.devices, Topology(gpus_per_node=4),
                            keep_tp_in_node=False)
    assert placement_moved_bytes(TINY, old, Layout(new.config, (0, 1, 2, 3))) == \
        direct.naive_moved_bytes
    assert placement_moved_bytes(TINY, old, old) == 0
