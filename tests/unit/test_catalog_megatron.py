"""The catalog reproduces megatron-core's sharded_state_dict and DistributedOptimizer buffers.

Fixtures are records of real megatron-core 0.16.1 GPTModels built on CPU (tests/dist checks
that they still match a live build): keys, global shapes, the box every rank holds, and the
distributed optimizer's flat buffer layout (parameter order, offsets, buckets, dp ranges).
The MoE / VPP / CP fixtures (``tests/dist/make_moe_fixtures.py``: ep over dp and over
dp x cp, ep with tp, vpp chunks on tiny and tiny-moe) record the model's boxes of every
rank and megatron's own ep / expert-dp / cp / dp ranks.
"""
import json
import pathlib
from collections import Counter

import numpy as np
import pytest

from slurm_etc.plan import ModelDesc, ParallelConfig
from slurm_etc.plan.catalog import TIED_SUFFIX, build_catalog, unfold_expert_box
from slurm_etc.plan.regions import dist_buffer, region_table

FIXTURES = sorted((pathlib.Path(__file__).parents[1] / "fixtures" / "megatron").glob("*.json"))


def load(path):
    return from_payload(json.loads(path.read_text()))


def from_payload(data):
    model = ModelDesc(**data["model"])
    config = ParallelConfig(**data["config"])
    return data, model, config


def megatron_boxes(records):
    """{(key, lo, hi)} of a rank's ShardedTensors (layer-stacked keys: one layer per box;
    expert keys: one (layer, expert) per box)."""
    out = set()
    for r in records:
        lo = tuple(r["global_offset"])
        local = [1] * r["prepend_axis_num"] + list(r["local_shape"])
        hi = tuple(a + b for a, b in zip(lo, local))
        pad = max(3 - len(lo), 0)
        out.add((r["key"], lo + (0,) * pad, hi + (1,) * pad))
    return out


def megatron_shape(g):
    """A group's global shape as megatron reports it (the expert axis unfolded)."""
    if g.expert:
        return (g.shape[0] // g.experts, g.experts, *g.shape[1:])
    return tuple(g.shape)


def catalog_boxes(catalog, table, rank):
    """Same view from the region table: replicated rows split per layer."""
    out = set()
    ranks, rows = table.rank_rows
    for row in rows[ranks == rank]:
        g = catalog.groups[table.group[row]]
        if g.dist:
            continue
        lo, hi = [int(x) for x in table.lo[row]], [int(x) for x in table.hi[row]]
        key = g.param.removesuffix(TIED_SUFFIX)
        if g.expert:
            for index in range(lo[0], hi[0]):
                ulo, uhi = unfold_expert_box(g, (index, *lo[1:len(g.shape)]),
                                             (index + 1, *hi[1:len(g.shape)]))
                pad = max(3 - len(ulo), 0)
                out.add((key, ulo + (0,) * pad, uhi + (1,) * pad))
            continue
        layers = range(lo[0], hi[0]) if g.stacked else [None]
        for layer in layers:
            if layer is None:
                out.add((key, tuple(lo), tuple(hi)))
            else:
                out.add((key, (layer, *lo[1:]), (layer + 1, *hi[1:])))
    return out


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_keys_shapes_and_boxes_match_megatron(path):
    check_model_records(*load(path))


def check_model_records(data, model, config):
    catalog = build_catalog(model, config)
    shapes = {g.param.removesuffix(TIED_SUFFIX): megatron_shape(g) for g in catalog.groups}
    table = region_table(catalog, config)
    keys = {g.param.removesuffix(TIED_SUFFIX) for g in catalog.groups}
    seen = {r["key"] for rank_data in data["ranks"] for r in rank_data["model_records"]}
    assert seen == keys, sorted(seen ^ keys)
    for rank_data in data["ranks"]:
        groups = rank_data.get("groups")
        if groups is not None:   # megatron's own ranks agree with the layout's rank order
            r = rank_data["rank"]
            assert (groups["ep"], groups["expert_dp"], groups["cp"], groups["dp"]) == (
                config.ep_rank(r), config.expert_dp_rank(r), config.cp_rank(r),
                config.coords(r)[1]), r
        for rec in rank_data["model_records"]:
            assert shapes[rec["key"]] == tuple(rec["global_shape"]), rec["key"]
        want = megatron_boxes(rank_data["model_records"])
        got = catalog_boxes(catalog, table, rank_data["rank"])
        assert got == want, (rank_data["rank"], sorted(got ^ want)[:4])


DIST = [p for p in FIXTURES if "distopt" in p.stem]


@pytest.mark.parametrize("path", DIST, ids=[p.stem for p in DIST])
def test_distributed_optimizer_buffer_matches_megatron(path):
    check_buffers(*load(path))


def check_buffers(data, model, config):
    catalog = build_catalog(model, config)
    for rank_data in data["ranks"]:
        c = rank_data["coords"]
        entries, buckets = dist_buffer(catalog, config, c["t"], c["p"])
        (buffer,) = rank_data["buffers"]
        assert [(b["offset"], b["offset"] + b["numel"]) for b in buffer["buckets"]] == buckets
        got = [(catalog.groups[gi].param.removesuffix(TIED_SUFFIX),
                None if layer < 0 else layer, start) for gi, layer, start in entries]
        want = [(p["key"], p["layer"], p["start"]) for p in buffer["params"]]
        assert got == want


@pytest.mark.parametrize("path", DIST, ids=[p.stem for p in DIST])
def test_dp_ranges_cover_megatron_optimizer_shards(path):
    """Elements each dp rank holds of the fp32 state equal megatron's optimizer shard sizes."""
    data, model, config = load(path)
    catalog = build_catalog(model, config)
    table = region_table(catalog, config)
    ranks, rows = table.rank_rows
    # with one stage the tied output layer aliases the embedding: count that memory once
    is_dist = np.array([catalog.groups[g].dist and not (
        config.pp == 1 and catalog.groups[g].param.endswith(TIED_SUFFIX)) for g in table.group])
    for rank_data in data["ranks"]:
        mine = rows[(ranks == rank_data["rank"]) & is_dist[rows]]
        # elements held per (parameter, layer), not only in total: a range cut at the wrong
        # parameter would keep the total
        held = Counter()
        for row in mine.tolist():
            key = catalog.groups[table.group[row]].param.removesuffix(TIED_SUFFIX)
            layer = int(table.layer[row])
            held[(key, None if layer < 0 else layer)] += int(table.count[row])
        (buffer,) = rank_data["buffers"]
        d = rank_data["coords"]["d"]
        expect = Counter()
        for b in buffer["buckets"]:
            shard = b["numel"] // config.dp
            lo, hi = b["offset"] + d * shard, b["offset"] + (d + 1) * shard
            for p in buffer["params"]:
                overlap = min(hi, p["end"]) - max(lo, p["start"])
                if overlap > 0:
                    expect[(p["key"], p["layer"])] += overlap
        assert held == expect, rank_data["rank"]
        assert len(expect) > 1
