"""Property tests: random models and layouts give valid plans that reproduce the state."""
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_etc.plan import Layout, ModelDesc, ParallelConfig, Topology, default_pool, plan_migration

from .plan_helpers import apply_plan, expected_state, global_tensors, make_plan


@st.composite
def models(draw):
    heads = draw(st.sampled_from([2, 4]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0]))
    kv = draw(st.sampled_from([2, 4]))
    llama = draw(st.booleans())
    return ModelDesc(
        "prop", num_layers=draw(st.sampled_from([2, 4])), hidden=heads * kv,
        ffn_hidden=draw(st.sampled_from([4, 8, 12])), num_heads=heads, num_query_groups=groups,
        vocab_size=draw(st.integers(5, 40)), seq_length=draw(st.integers(1, 6)), swiglu=llama,
        rmsnorm=llama, add_bias_linear=not llama, learned_position_embeddings=not llama,
        tied_embeddings=draw(st.booleans()), param_dtype=draw(st.sampled_from(["fp32", "bf16"])),
        vocab_divisor=4)


def configs(model, max_world=8):
    tps = [t for t in (1, 2, 4) if model.query_groups % t == 0 and model.ffn_hidden % t == 0
           and model.padded_vocab % t == 0]
    pps = [p for p in (1, 2, 4) if model.num_layers % p == 0]
    return st.tuples(st.integers(1, 4), st.sampled_from(tps), st.sampled_from(pps)).filter(
        lambda c: c[0] * c[1] * c[2] <= max_world)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_plans_reproduce_global_slices(data):
    model = data.draw(models())
    old = data.draw(configs(model))
    new = data.draw(configs(model))
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
    model = data.draw(models())
    old, new = data.draw(configs(model)), data.draw(configs(model))
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
