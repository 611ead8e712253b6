"""megatron-core on 4 gloo ranks: build, train, and check the sharded state against our rules.

Every configuration is built once (in the same 4 worker processes, reused across configs) and
its description is cached for the module; the tests then check different properties of it:

* the model trains (finite loss near ln(vocab) for random tokens, the same on every rank);
* the main replicas (replica_id all zero) of the model's ShardedTensors tile every global
  tensor exactly once, and their bytes add up to the model's parameter count;
* optimizer state follows the parameters (non-distributed) or the documented flat-buffer
  rules of the DistributedOptimizer (``megatron_cases.dist_opt_buffer_layout``);
* the same seed gives the same global weights and losses in every configuration;
* the JSON fixtures in ``tests/fixtures/megatron`` are what megatron-core builds today.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from slurm_etc.megatron.shards import is_main_replica, record_numel
from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.model import DTYPE_BYTES, PRESETS
from slurm_etc.pool.local import WorkerError
from tests.dist.harness import pool_fixture
from tests.dist.megatron_cases import (
    describe_build,
    dist_opt_buffer_layout,
    dp_rank_ranges,
    dp_reshardable_records,
    dumps_fixture,
    expected_param_order,
    fixture_payload,
    model_param_count,
    save_then_load,
)
from tests.unit.megatron_oracle import check_buffers, check_model_records, from_payload

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

FIXTURE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
REGENERATE = ".venv/bin/python -m tests.dist.make_megatron_fixtures"

TINY = PRESETS["tiny"]
TINY_LLAMA = PRESETS["tiny-llama"]
TINY_BF16 = replace(TINY, name="tiny-bf16", param_dtype="bf16")

# name -> (model, config); names of fixture cases are the fixture file names.
CASES = {
    "tiny_dp4tp1pp1": (TINY, ParallelConfig(4, 1, 1)),
    "tiny_dp1tp2pp2": (TINY, ParallelConfig(1, 2, 2)),
    "tiny_dp2tp1pp2": (TINY, ParallelConfig(2, 1, 2)),
    "tiny_dp1tp4pp1": (TINY, ParallelConfig(1, 4, 1)),
    "tiny_dp1tp1pp4": (TINY, ParallelConfig(1, 1, 4)),
    "tiny_dp2tp2pp1_distopt": (TINY, ParallelConfig(2, 2, 1, distributed_optimizer=True)),
    "tiny_dp2tp1pp2_distopt": (TINY, ParallelConfig(2, 1, 2, distributed_optimizer=True)),
    "tiny-llama_dp1tp2pp2": (TINY_LLAMA, ParallelConfig(1, 2, 2)),
    "tiny-llama_dp2tp2pp1_distopt": (TINY_LLAMA,
                                     ParallelConfig(2, 2, 1, distributed_optimizer=True)),
    "tiny-bf16_dp1tp2pp2": (TINY_BF16, ParallelConfig(1, 2, 2)),
    "tiny-bf16_dp2tp2pp1_distopt": (TINY_BF16,
                                    ParallelConfig(2, 2, 1, distributed_optimizer=True)),
}
FIXTURE_CASES = ["tiny_dp1tp2pp2", "tiny_dp2tp1pp2", "tiny_dp1tp4pp1", "tiny-llama_dp1tp2pp2",
                 "tiny_dp2tp2pp1_distopt", "tiny_dp2tp1pp2_distopt", "tiny-llama_dp2tp2pp1_distopt",
                 "tiny-bf16_dp2tp2pp1_distopt"]
DIST_OPT_CASES = [name for name, (_, config) in CASES.items() if config.distributed_optimizer]
# fp32 configurations of one model whose trained weights must agree (same seed, same data).
SAME_WEIGHTS = {
    "tiny": ["tiny_dp4tp1pp1", "tiny_dp1tp2pp2", "tiny_dp2tp1pp2", "tiny_dp1tp4pp1",
             "tiny_dp1tp1pp4", "tiny_dp2tp2pp1_distopt", "tiny_dp2tp1pp2_distopt"],
    "tiny-llama": ["tiny-llama_dp1tp2pp2", "tiny-llama_dp2tp2pp1_distopt"],
}

pool4 = pool_fixture(4, preload=("megatron.core", "slurm_etc.megatron.build"))


@pytest.fixture(scope="module")
def built(pool4):
    """``built(name)``: the per-rank descriptions of a case, built on first use."""
    cache: dict[str, list[dict]] = {}

    def get(name: str) -> list[dict]:
        if name not in cache:
            model, config = CASES[name]
            cache[name] = pool4.run(describe_build, model, config, with_values=True)
        return cache[name]

    return get


def _box(record: dict) -> tuple:
    return (record["key"], tuple(record["global_offset"]), tuple(record["local_shape"]),
            tuple(record["flattened_range"] or ()))


def _global_box(record: dict) -> list[tuple[int, int]]:
    """[(start, stop)] per global axis (prepended layer axes have length 1)."""
    p = record["prepend_axis_num"]
    return [(o, o + 1) for o in record["global_offset"][:p]] + [
        (o, o + n) for o, n in zip(record["global_offset"][p:], record["local_shape"])]


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


# -- model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_model_trains_with_finite_loss(built, name):
    model, _ = CASES[name]
    results = built(name)
    losses = results[0]["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    # Random tokens: the loss of a freshly initialised model is close to ln(vocab).
    assert all(abs(x - math.log(model.vocab_size)) < 0.5 for x in losses), losses
    assert all(r["losses"] == losses for r in results), "ranks disagree on the loss"


@pytest.mark.parametrize("name", CASES)
def test_main_replicas_tile_every_tensor_once(built, name):
    model, _ = CASES[name]
    records = [rec for r in built(name) for rec in r["model_records"]]
    assert records

    shapes: dict[str, tuple] = {}
    for rec in records:
        assert shapes.setdefault(rec["key"], tuple(rec["global_shape"])) == \
            tuple(rec["global_shape"]), f"{rec['key']}: ranks disagree on the global shape"

    main = [rec for rec in records if is_main_replica(rec)]
    boxes_per_copy: dict[tuple, int] = {}
    for rec in records:
        boxes_per_copy.setdefault(_box(rec), 0)
    for rec in main:
        boxes_per_copy[_box(rec)] += 1
    assert set(boxes_per_copy.values()) == {1}, "a region has no main replica or several"

    for key, shape in shapes.items():
        boxes = [_global_box(rec) for rec in main if rec["key"] == key]
        assert not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[:i]), key
        covered = sum(math.prod(hi - lo for lo, hi in box) for box in boxes)
        assert covered == math.prod(shape), f"{key}: main replicas cover {covered} elements " \
                                            f"of {math.prod(shape)}"
    itemsize = DTYPE_BYTES[model.param_dtype]
    total_bytes = sum(record_numel(rec) * itemsize for rec in main)
    assert total_bytes == model_param_count(model) * itemsize


@pytest.mark.parametrize("name", CASES)
def test_params_register_in_documented_order(built, name):
    model, config = CASES[name]
    for result in built(name):
        expected = expected_param_order(model, config, result["coords"]["p"])
        live = [{k: p[k] for k in ("name", "numel", "shared_embedding")}
                for p in result["params"]]
        assert live == expected, f"rank {result['rank']}"


def test_config_must_match_the_world_size(pool4):
    with pytest.raises(WorkerError, match=r"= 2 must equal the devices \(4\)"):
        pool4.run(describe_build, TINY, ParallelConfig(2, 1, 1))


def test_swiglu_fc1_is_two_shards_per_rank(built):
    results = built("tiny-llama_dp1tp2pp2")
    ffn, tp = TINY_LLAMA.ffn_hidden, 2
    for result in results:
        halves = [rec for rec in result["model_records"]
                  if rec["key"] == "decoder.layers.mlp.linear_fc1.weight"]
        t = result["coords"]["t"]
        per_layer = {}
        for rec in halves:
            per_layer.setdefault(rec["global_offset"][0], []).append(rec)
        for layer_records in per_layer.values():
            gate, up = sorted(layer_records, key=lambda rec: rec["global_offset"][1])
            assert gate["global_shape"] == [TINY_LLAMA.num_layers, 2 * ffn, TINY_LLAMA.hidden]
            assert gate["axis_fragmentations"][1] == 2 * tp
            assert gate["global_offset"][1] == t * ffn // tp
            assert up["global_offset"][1] == ffn + t * ffn // tp


def test_tied_embedding_on_last_stage_is_a_replica(built):
    for result in built("tiny_dp1tp2pp2"):
        output = [rec for rec in result["model_records"] if rec["path"] == "output_layer.weight"]
        if result["coords"]["p"] == 1:
            (rec,) = output
            assert rec["key"] == "embedding.word_embeddings.weight"
            assert rec["replica_id"][0] == 1
        else:
            assert output == []


def test_same_seed_same_global_weights_in_every_config(built):
    for names in SAME_WEIGHTS.values():
        reference_losses = built(names[0])[0]["losses"]
        reference = _global_tensors(built(names[0]))
        for name in names[1:]:
            assert built(name)[0]["losses"] == pytest.approx(reference_losses, abs=1e-5), name
            tensors = _global_tensors(built(name))
            assert tensors.keys() == reference.keys(), name
            for key, value in tensors.items():
                # Two Adam steps amplify float rounding differences up to ~lr/10 at most.
                diff = float(np.abs(value - reference[key]).max())
                assert diff < 1e-4, f"{name}: {key} differs from {names[0]} by {diff}"


def _global_tensors(results: list[dict]) -> dict[str, np.ndarray]:
    full: dict[str, np.ndarray] = {}
    for result in results:
        for rec, data in result["values"]:
            tensor = full.setdefault(rec["key"], np.full(rec["global_shape"], np.nan, np.float32))
            p = rec["prepend_axis_num"]
            region = tuple(rec["global_offset"][:p]) + tuple(
                slice(o, o + n) for o, n in zip(rec["global_offset"][p:], rec["local_shape"]))
            tensor[region] = data
    for key, tensor in full.items():
        assert not np.isnan(tensor).any(), f"{key}: not fully covered by main replicas"
    return full


# -- optimizer ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n in CASES if n not in DIST_OPT_CASES])
def test_optimizer_state_has_the_boxes_of_its_params(built, name):
    model, _ = CASES[name]
    state_keys = ["exp_avg", "exp_avg_sq"] + (["fp32_param"] if model.mixed_precision else [])
    for result in built(name):
        params = {_box(rec) + (tuple(rec["replica_id"]),) for rec in result["model_records"]}
        for state_key in state_keys:
            prefix = f"optimizer.state.{state_key}."
            state = {(rec["key"].removeprefix(prefix),) + _box(rec)[1:]
                     + (tuple(rec["replica_id"]),)
                     for rec in result["optimizer_records"] if rec["key"].startswith(prefix)}
            assert state == params, f"rank {result['rank']}: {state_key}"
        assert all(rec["dtype"] == "float32" for rec in result["optimizer_records"])


@pytest.mark.parametrize("name", DIST_OPT_CASES)
def test_dist_opt_buffer_follows_documented_rules(built, name):
    model, config = CASES[name]
    for result in built(name):
        coords = result["coords"]
        (live,) = result["buffers"]
        layout = dist_opt_buffer_layout(
            expected_param_order(model, config, coords["p"]), config.dp)
        assert live["numel"] == layout["numel"]
        assert live["numel_unpadded"] == layout["numel_unpadded"]
        assert live["buckets"] == layout["buckets"]
        assert [{k: p[k] for k in ("name", "start", "end", "bucket")}
                for p in live["params"]] == layout["params"]
        assert live["dp_rank_ranges"] == dp_rank_ranges(layout, config.dp, coords["d"])
        assert live["param_dtype"] == model.param_dtype.replace("bf16", "bfloat16") \
            .replace("fp32", "float32")


@pytest.mark.parametrize("name", DIST_OPT_CASES)
def test_dist_opt_sharded_state_follows_documented_rules(built, name):
    model, config = CASES[name]
    param_dtype = "torch.bfloat16" if model.mixed_precision else "torch.float32"
    dtype_key = f"({param_dtype}, torch.float32)"
    flat: dict[str, list[tuple[int, int]]] = {}
    for result in built(name):
        coords = result["coords"]
        layout = dist_opt_buffer_layout(
            expected_param_order(model, config, coords["p"]), config.dp)
        expected = dp_reshardable_records(layout, config.dp, coords["d"],
                                          mp_rank=coords["t"] + config.tp * coords["p"],
                                          dtype_key=dtype_key)
        live = [{k: rec[k] for k in ("key", "global_shape", "global_offset", "local_shape")}
                for rec in result["optimizer_records"]]
        assert live == expected, f"rank {result['rank']}"
        assert all(rec["replica_id"] == [0, 0, 0] and rec["dtype"] == "float32"
                   for rec in result["optimizer_records"])
        for rec in result["optimizer_records"]:
            flat.setdefault(rec["key"], []).append(
                (rec["global_offset"][0], rec["global_offset"][0] + rec["local_shape"][0]))
            flat[rec["key"]].sort()
    # Over all dp ranks, the pieces of each flat tensor tile it exactly.
    for result in built(name):
        for rec in result["optimizer_records"]:
            pieces = flat[rec["key"]]
            assert pieces[0][0] == 0 and pieces[-1][1] == rec["global_shape"][0]
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), rec["key"]


# -- fixtures -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FIXTURE_CASES)
def test_fixture_is_current(built, name):
    path = FIXTURE_DIR / f"{name}.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: run `{REGENERATE}`")
    model, config = CASES[name]
    live = json.loads(dumps_fixture(fixture_payload(model, config, built(name))))
    assert json.loads(path.read_text()) == live, \
        f"{path} differs from what megatron-core builds now: run `{REGENERATE}`"


# -- the planner's catalog against live builds -------------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_catalog_reproduces_live_sharded_state_dict(built, name):
    """slurm_etc.plan's catalog (built without the model) gives the same keys, global shapes,
    per-rank boxes and distributed-optimizer buffers as this real megatron-core build."""
    model, config = CASES[name]
    data = json.loads(dumps_fixture(fixture_payload(model, config, built(name))))
    check_model_records(*from_payload(data))
    if config.distributed_optimizer:
        check_buffers(*from_payload(data))


# -- dist_checkpointing -------------------------------------------------------------------------

def test_dist_checkpoint_saves_and_reshards_on_cpu(pool4, tmp_path):
    """cpu_compat is enough for megatron's own checkpoint path: save TP2PP2, load DP2PP2."""
    results = pool4.run(save_then_load, TINY, ParallelConfig(1, 2, 2), ParallelConfig(2, 1, 2),
                        str(tmp_path))
    saved = _global_tensors([{"values": r["saved"]} for r in results])
    loaded = _global_tensors([{"values": r["loaded"]} for r in results])
    assert saved.keys() == loaded.keys()
    for key, value in saved.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
