"""Property tests: random models and layouts give valid plans that reproduce the state."""
import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from slurm_etc.plan import Layout, ModelDesc, ParallelConfig, Topology, default_pool, plan_migration

from .plan_helpers import apply_plan, expected_state, global_tensors, make_plan

FAMILIES = ("gpt", "llama")


@st.composite
def models(draw, family=None):
    """A small GPT (GELU, LayerNorm, biases, learned positions, one kv group per head) or
    Llama (SwiGLU, RMSNorm, no biases, grouped-query attention) in which tp 2 and 4 divide
    heads, kv groups, ffn and padded vocab, so every family reaches tp > 1."""
    family = family or draw(st.sampled_from(FAMILIES))
    llama = family == "llama"
    heads = draw(st.sampled_from([2, 4]))
    kv = draw(st.sampled_from([2, 4]))
    return ModelDesc(
        f"prop-{family}", num_layers=draw(st.sampled_from([2, 4])), hidden=heads * kv,
        ffn_hidden=draw(st.sampled_from([4, 8, 12])), num_heads=heads,
        num_query_groups=draw(st.sampled_from([g for g in (2, 4) if heads % g == 0])) if llama
        else None,
        vocab_size=draw(st.integers(5, 40)), seq_length=draw(st.integers(1, 6)), swiglu=llama,
        rmsnorm=llama, add_bias_linear=not llama, learned_position_embeddings=not llama,
        tied_embeddings=draw(st.booleans()), param_dtype=draw(st.sampled_from(["fp32", "bf16"])),
        vocab_divisor=4)


def tp_degrees(model):
    return [t for t in (1, 2, 4) if model.query_groups % t == 0 and model.ffn_hidden % t == 0
            and model.padded_vocab % t == 0 and model.num_heads % t == 0]


@st.composite
def configs(draw, model, max_world=8):
    """(dp, tp, pp) of at most ``max_world`` ranks that ``model`` can run."""
    tp = draw(st.sampled_from(tp_degrees(model)))
    pp = draw(st.sampled_from([p for p in (1, 2, 4) if model.num_layers % p == 0
                               and tp * p <= max_world]))
    dp = draw(st.integers(1, min(4, max_world // (tp * pp))))
    return dp, tp, pp


@st.composite
def transitions(draw, family=None, max_world=8):
    """(model, old, new) with old != new: every example is a real resize."""
    model = draw(models(family))
    old = draw(configs(model, max_world))
    new = draw(configs(model, max_world).filter(lambda c: c != old))
    return model, old, new


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
