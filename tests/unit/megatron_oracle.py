"""The megatron-core oracle of the catalog tests: records of real megatron-core GPTModels
(tests/fixtures/megatron, made by tests/dist/make_megatron_fixtures.py and
make_moe_fixtures.py) read back, and the checks that the catalog's boxes and the distributed
optimizer's buffers equal them. Used by tests/unit/test_catalog_megatron.py on the recorded
fixtures and by tests/dist/test_megatron_build.py on a live build."""
import json
import pathlib

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
