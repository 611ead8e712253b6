"""Property tests: random models and layouts give valid plans that reproduce the state."""
import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from slurm_etc.plan import Layout, ParallelConfig, Topology, default_pool, plan_migration

from .plan_helpers import apply_plan, expected_state, global_tensors, make_plan
from .plan_strategies import FAMILIES, tp_degrees, transitions


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("which", ["old", "new"])
def test_strategies_reach_tensor_parallel_in_every_family(family, which):
    index = 1 if which == "old" else 2
    model, old, new = find(transitions(family), lambda t: t[index][1] > 1,
                           settings=settings(max_examples=200, database=None))
    assert (old, new)[index - 1][1] in tp_degrees(model)
    assert (old, new)[index - 1][1] > 1
    assert old != new


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_plans_reproduce_global_slices(data):
    model, old, new = data.draw(transitions())
    dist = data.draw(st.booleans())
    keep_tp = data.draw(st.booleans())
    plan = make_plan(model, old, new, dist, gpn=4, keep_tp=keep_tp)
    assert plan.moved_bytes >= plan.lower_bound_moved_bytes
    if not keep_tp:
        assert plan.moved_bytes == plan.lower_bound_moved_bytes
    tensors = global_tensors(plan.catalog, seed=data.draw(st.integers(0, 10)))
    got, want = apply_plan(plan, tensors), expected_state(plan, tensors)
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_plans_do_not_depend_on_device_order(data):
    model, old, new = data.draw(transitions())
    oc, nc = ParallelConfig(*old, True), ParallelConfig(*new, True)
    layout = Layout(oc, tuple(range(oc.world)))
    topo = Topology(gpus_per_node=4)
    pool = default_pool(layout, nc, topo)
    shuffled = data.draw(st.permutations(pool))
    a = plan_migration(model, layout, nc, pool, topo)
    b = plan_migration(model, layout, nc, shuffled, topo)
    assert a.new.devices == b.new.devices
    for x, y in zip(a.transfers.__dict__.values(), b.transfers.__dict__.values()):
        np.testing.assert_array_equal(x, y)
