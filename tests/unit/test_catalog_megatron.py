"""The catalog reproduces megatron-core's sharded_state_dict and DistributedOptimizer buffers.

Fixtures are records of real megatron-core 0.16.1 GPTModels built on CPU (tests/dist checks
that they still match a live build): keys, global shapes, the box every rank holds, and the
distributed optimizer's flat buffer layout (parameter order, offsets, buckets, dp ranges).
The MoE / VPP / CP fixtures (``tests/dist/make_moe_fixtures.py``: ep over dp and over
dp x cp, ep with tp, vpp chunks on tiny and tiny-moe) record the model's boxes of every
rank and megatron's own ep / expert-dp / cp / dp ranks.
"""
from collections import Counter

import numpy as np
import pytest

from slurm_etc.plan.catalog import TIED_SUFFIX, build_catalog
from slurm_etc.plan.regions import region_table
from tests.unit.megatron_oracle import FIXTURES, check_buffers, check_model_records, load


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_keys_shapes_and_boxes_match_megatron(path):
    check_model_records(*load(path))


DIST = [p for p in FIXTURES if "distopt" in p.stem]


@pytest.mark.parametrize("path", DIST, ids=[p.stem for p in DIST])
def test_distributed_optimizer_buffer_matches_megatron(path):
    check_buffers(*load(path))


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
