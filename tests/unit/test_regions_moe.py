"""Regions of layouts with ep, cp and vpp: every element held as often as megatron keeps it.

Counted element by element over the whole tensor of every group (small models only): a
replicated parameter is held once per dp x cp rank of its stage (cp replicates parameters)
and an expert once per expert data-parallel replica; the distributed optimizer's states
exactly once, dense ones cut over dp x cp, expert ones over the expert data-parallel ranks
(tensors not split over tp: once more per tp rank).
"""
from __future__ import annotations

import numpy as np
import pytest

from slurm_etc.plan import PRESETS, ParallelConfig
from slurm_etc.plan.catalog import build_catalog
from slurm_etc.plan.regions import chunk_layers, dist_buffer, layer_place, region_table

pytestmark = pytest.mark.unit

LAYOUTS = [
    ("tiny-moe", "dp=2,tp=1,pp=2,ep=2"), ("tiny-moe", "dp=4,tp=1,pp=1,ep=4"),
    ("tiny-moe", "dp=2,tp=2,pp=1,ep=2"), ("tiny-moe", "dp=2,tp=1,pp=1,ep=4,cp=2"),
    ("tiny-moe", "dp=1,tp=2,pp=2,vpp=2"), ("tiny-moe", "dp=2,tp=1,pp=2,ep=2,cp=2,vpp=2"),
    ("tiny", "dp=2,tp=1,pp=2,vpp=2"), ("tiny", "dp=1,tp=2,pp=1,cp=2"),
    ("tiny", "dp=2,tp=2,pp=2,cp=2,vpp=2"), ("moe6", "dp=3,tp=1,pp=2,ep=3"),
]


def _moe3():
    from dataclasses import replace

    return replace(PRESETS["tiny-moe"], name="moe6", num_experts=6)


def held_counts(model, config):
    catalog = build_catalog(model, config)
    table = region_table(catalog, config)
    ranks, rows = table.rank_rows
    holders = np.bincount(rows, minlength=len(table))
    counts = [np.zeros(g.numel, np.int64) for g in catalog.groups]
    for row in range(len(table)):
        g = catalog.groups[table.group[row]]
        lo, hi = table.lo[row][:len(g.shape)], table.hi[row][:len(g.shape)]
        grid = np.ix_(*[np.arange(a, b) for a, b in zip(lo, hi)])
        flat = np.ravel_multi_index(grid, g.shape).ravel()[table.s[row]:table.e[row]]
        counts[table.group[row]][flat] += holders[row]
    return catalog, counts


@pytest.mark.parametrize("dist", [False, True], ids=["replicated", "dist-opt"])
@pytest.mark.parametrize(("name", "layout"), LAYOUTS, ids=[f"{m}-{c}" for m, c in LAYOUTS])
def test_every_element_is_held_as_often_as_megatron_keeps_it(name, layout, dist):
    model = _moe3() if name == "moe6" else PRESETS[name]
    config = ParallelConfig.parse(layout, distributed_optimizer=dist)
    config.validate_for(model)
    catalog, counts = held_counts(model, config)
    for g, count in zip(catalog.groups, counts):
        if g.dist:
            want = 1
        elif g.expert:
            want = config.replicas
        else:
            want = config.dp_cp
        if g.tp_axis is None:   # not split over tp: each tp rank keeps it (and its state)
            want *= config.tp
        assert np.all(count == want), (g.name, np.unique(count), want)


def test_vpp_maps_layers_to_pipeline_rank_and_chunk():
    """megatron-core's offsets: with pp=2, vpp=2 on 8 layers, rank 0 holds 0-1 and 4-5."""
    assert [chunk_layers(8, 2, 2, 0, c) for c in range(2)] == [(0, 2), (4, 6)]
    assert [chunk_layers(8, 2, 2, 1, c) for c in range(2)] == [(2, 4), (6, 8)]
    assert [layer_place(8, 2, 2, layer) for layer in range(8)] == [
        (0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1)]
    assert chunk_layers(8, 2, 1, 1, 0) == (4, 8)


def test_vpp_chunks_have_their_own_buffers_and_embedding_on_the_first_chunk():
    model = PRESETS["tiny"]
    config = ParallelConfig.parse("dp=2,tp=1,pp=2,vpp=2", distributed_optimizer=True)
    catalog = build_catalog(model, config)
    names = {}
    for p in range(2):
        for chunk in range(2):
            entries, buckets = dist_buffer(catalog, config, 0, p, chunk)
            names[p, chunk] = {catalog.groups[gi].param for gi, _, _ in entries}
            layers = {layer for gi, layer, _ in entries if catalog.groups[gi].stacked}
            assert layers == set(range(*chunk_layers(4, 2, 2, p, chunk)))
            assert buckets[0][0] == 0 and all(b % 128 == 0 for _, b in buckets)
    assert "embedding.word_embeddings.weight" in names[0, 0]
    assert "embedding.word_embeddings.weight" not in names[0, 1]
    assert "decoder.final_layernorm.weight" in names[1, 1]
    assert "decoder.final_layernorm.weight" not in names[1, 0]


def test_expert_buffer_holds_the_ep_ranks_experts_in_reverse_registration_order():
    model = PRESETS["tiny-moe"]
    config = ParallelConfig.parse("dp=4,tp=1,pp=1,ep=2", distributed_optimizer=True)
    catalog = build_catalog(model, config)
    entries, buckets = dist_buffer(catalog, config, 0, 0, expert=True, e=1)
    folded = [layer for _, layer, _ in entries]
    # ep rank 1 holds experts 2, 3 of every layer; last layer's last expert first
    assert sorted({f % 4 for f in folded}) == [2, 3]
    assert folded[:2] == [3 * 4 + 3, 3 * 4 + 3] and folded[-1] == 0 * 4 + 2
    assert [catalog.groups[gi].param.rsplit(".", 2)[-2] for gi, _, _ in entries[:2]] == [
        "linear_fc2", "linear_fc1"]
    # the expert buffer is cut over the 2 expert data-parallel ranks, the dense over 4
    dense, dense_buckets = dist_buffer(catalog, config, 0, 0)
    assert not {gi for gi, _, _ in entries} & {gi for gi, _, _ in dense}
    assert all((b - a) % 128 == 0 for a, b in buckets + dense_buckets)


def test_moe_layer_tensors_are_named_as_megatron_names_them():
    catalog = build_catalog(PRESETS["qwen3-235b-a22b"], False)
    shapes = {g.param: g.shape for g in catalog.groups}
    assert shapes["decoder.layers.mlp.router.weight"] == (94, 128, 4096)
    # folded (layer x expert) axis: megatron's (94, 128, 2 x 1536, 4096)
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (
        94 * 128, 3072, 4096)
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == (
        94 * 128, 4096, 1536)
    assert shapes["decoder.layers.self_attention.linear_qkv.weight"] == (94, 128 * 72, 4096)
    assert shapes["decoder.layers.self_attention.linear_proj.weight"] == (94, 4096, 8192)
    assert shapes["decoder.layers.self_attention.q_layernorm.weight"] == (94, 128)
    assert "decoder.layers.mlp.linear_fc2.weight" not in shapes
    total = sum(g.numel for g in catalog.groups)
    assert 234e9 < total < 236e9


MOE_TRANSITIONS = [
    ("dp=2,tp=1,pp=2,ep=2", "dp=4,tp=1,pp=1,ep=4"), ("dp=4,tp=1,pp=1,ep=4", "dp=4,tp=1,pp=1"),
    ("dp=2,tp=2,pp=1,ep=2", "dp=1,tp=2,pp=2,vpp=2"),
    ("dp=2,tp=1,pp=2,ep=2,vpp=2", "dp=2,tp=1,pp=1,ep=4,cp=2"),
]


@pytest.mark.parametrize("dist", [False, True], ids=["replicated", "dist-opt"])
@pytest.mark.parametrize(("old", "new"), MOE_TRANSITIONS,
                         ids=[f"{a}->{b}" for a, b in MOE_TRANSITIONS])
def test_moe_intersections_equal_element_enumeration(old, new, dist):
    from slurm_etc.plan.intersect import intersect

    from .plan_helpers import brute_overlaps

    model = PRESETS["tiny-moe"]
    oc, nc = (ParallelConfig.parse(x, distributed_optimizer=dist) for x in (old, new))
    catalog = build_catalog(model, oc)
    ot, nt = region_table(catalog, oc), region_table(catalog, nc)
    frag = intersect(ot, nt)
    got = {}
    for i, j, c in zip(frag.old_row.tolist(), frag.new_row.tolist(), frag.count.tolist()):
        got[(i, j)] = got.get((i, j), 0) + c
    assert got == brute_overlaps(catalog, ot, nt)


@pytest.mark.parametrize(("old", "new"), MOE_TRANSITIONS,
                         ids=[f"{a}->{b}" for a, b in MOE_TRANSITIONS])
def test_moe_plans_move_the_lower_bound(old, new):
    from slurm_etc.plan import Layout, Topology, default_pool, plan_migration

    oc, nc = (ParallelConfig.parse(x, distributed_optimizer=True) for x in (old, new))
    layout = Layout(oc, tuple(range(oc.world)))
    topo = Topology(gpus_per_node=4)
    plan = plan_migration(PRESETS["tiny-moe"], layout, nc, default_pool(layout, nc, topo), topo)
    s = plan.summary()
    assert s["moved_bytes"] == s["lower_bound_moved_bytes"] > 0
