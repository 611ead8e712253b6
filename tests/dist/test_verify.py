"""`verify` on real megatron-core states: every transition migrates bit for bit.

One pool of 4 worker processes (``LocalWorkers``, the same runner the CLI uses) serves every
case: each builds tiny / tiny-llama (fp32 or bf16 mixed precision) under the old layout,
trains 2 Adam steps, saves megatron's checkpoint, resizes in place with the executor, and
checks the new layout through megatron-core and torch alone (``reference.py``): its full
tensors against the old layout's (``megatron-gather``), each rank against megatron's own
checkpoint resharding (``megatron-checkpoint``: the model always, the optimizer where megatron
reshards it), the Adam step of every parameter, each rank's generator, and the losses of
three more training steps (against the checkpoint-loaded state, bit for bit, or the old
layout trained on). Transitions cover dp, tp and pp changes, grow and shrink, dp=3, with and
without the distributed optimizer. tests/dist/test_planted_bugs.py shows these checks fail
on a faulty migration.
"""
from __future__ import annotations

import dataclasses

import pytest

from slurm_etc.harness.phases import PRELOAD, Transition
from slurm_etc.harness.verify import (
    AFTER_STEPS,
    LOSS_RTOL,
    ORACLE_CHECKPOINT,
    ORACLE_GATHER,
    verify_transition,
)
from slurm_etc.megatron.checkpoint import megatron_reshards_optimizer
from slurm_etc.plan import PRESETS, ParallelConfig
from slurm_etc.pool.local import LocalWorkers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY, LLAMA = PRESETS["tiny"], PRESETS["tiny-llama"]
TINY_BF16 = dataclasses.replace(TINY, name="tiny-bf16", param_dtype="bf16")
LLAMA_BF16 = dataclasses.replace(LLAMA, name="tiny-llama-bf16", param_dtype="bf16")


def P(dp, tp=1, pp=1, dist=False):  # noqa: N802 - reads like the CLI's dp=..,tp=..,pp=..
    return ParallelConfig(dp, tp, pp, distributed_optimizer=dist)


CASES = {
    # name: (model, old, new)
    "tp2pp2-to-dp2pp2": (TINY, P(1, 2, 2), P(2, 1, 2)),
    "grow-dp2-to-tp2pp2": (TINY, P(2), P(1, 2, 2)),
    "shrink-dp4-to-pp2": (TINY, P(4), P(1, 1, 2)),
    "uneven-dp3-to-tp2pp2": (TINY, P(3), P(1, 2, 2)),
    "distopt-shrink-dp2tp2-to-tp2": (TINY, P(2, 2, 1, True), P(1, 2, 1, True)),
    "distopt-dp2pp2-to-pp4": (TINY, P(2, 1, 2, True), P(1, 1, 4, True)),
    "distopt-tp2-to-dp3": (TINY, P(1, 2, 1, True), P(3, 1, 1, True)),
    "llama-tp2pp2-to-dp4": (LLAMA, P(1, 2, 2), P(4)),
    "llama-distopt-dp2tp2-to-dp4": (LLAMA, P(2, 2, 1, True), P(4, 1, 1, True)),
    "llama-shrink-dp2pp2-to-tp2": (LLAMA, P(2, 1, 2), P(1, 2, 1)),
    "bf16-tp2pp2-to-dp2tp2": (TINY_BF16, P(1, 2, 2), P(2, 2, 1)),
    "bf16-distopt-dp2pp2-to-dp4": (TINY_BF16, P(2, 1, 2, True), P(4, 1, 1, True)),
    "llama-bf16-distopt-dp4-to-dp2": (LLAMA_BF16, P(4, 1, 1, True), P(2, 1, 1, True)),
}


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(4, preload=PRELOAD, timeout_s=240) as pool:
        yield pool


def _param_keys(model) -> set[str]:
    """What megatron-core calls the parameters of ``model`` (its sharded_state_dict keys;
    the layer norms are saved under the linear layer they precede)."""
    keys = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    layer = ["self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
             "self_attention.linear_proj.weight", "mlp.linear_fc1.layer_norm_weight",
             "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    if not model.rmsnorm:
        keys.add("decoder.final_layernorm.bias")
        layer += ["self_attention.linear_qkv.layer_norm_bias", "mlp.linear_fc1.layer_norm_bias"]
    if model.add_bias_linear:
        layer += ["self_attention.linear_qkv.bias", "self_attention.linear_proj.bias",
                  "mlp.linear_fc1.bias", "mlp.linear_fc2.bias"]
    if model.learned_position_embeddings:
        keys.add("embedding.position_embeddings.weight")
    if not model.tied_embeddings:
        keys.add("output_layer.weight")
    return keys | {f"decoder.layers.{name}" for name in layer}


@pytest.mark.parametrize("name", CASES)
def test_migrated_state_is_bit_identical(workers, name):
    model, old, new = CASES[name]
    tr = Transition(model, old, new)
    report = verify_transition(tr, workers=workers)
    assert report["verified"], (report["first_mismatch"], report["old_state_problems"],
                                report["step"], report["rng"], report["loss_after"])
    assert report["mismatches"] == 0 and report["first_mismatch"] is None
    # every parameter, with its Adam moments (and fp32 main copy in mixed precision), is
    # checked, element by element, on every new rank
    params = _param_keys(model)
    states = ["exp_avg", "exp_avg_sq"] + (["fp32_param"] if model.param_dtype == "bf16" else [])
    expected = params | {f"optimizer.state.{s}.{k}" for s in states for k in params}
    seen = {t["tensor"]: t for t in report["per_tensor"]}
    assert set(seen) == expected
    assert report["tensors"] == len(expected) and not report["unchecked_tensors"]
    assert all(t["shards"] > 0 and t["bytes"] > 0 for t in seen.values())
    assert report["shards"] == report["coverage"]["new_shards"]
    reshards = megatron_reshards_optimizer(old, new)
    checked_by_ckpt = expected if reshards else params
    assert {k for k, t in seen.items() if ORACLE_CHECKPOINT in t["oracles"]} == checked_by_ckpt
    assert all(ORACLE_GATHER in t["oracles"] for t in seen.values())
    assert report["oracles"] == {ORACLE_GATHER: len(expected),
                                 ORACLE_CHECKPOINT: len(checked_by_ckpt)}
    assert report["step"] == {"expected": 2, "old": [2], "migrated": [2],
                              "checkpoint": [2] if reshards else [], "ok": True}
    rng = report["rng"]
    assert rng["ok"] and not rng["wrong_ranks"] and sorted(rng["sources"]) == list(range(new.world))
    assert sorted(rng["checked_against_checkpoint"]) == (
        sorted(r for r, s in rng["sources"].items() if s == 0) if reshards else [])
    loss = report["loss_after"]
    assert loss["ok"] and loss["steps"] == AFTER_STEPS == len(loss["migrated"])
    if reshards:
        assert loss["compared_with"] == "checkpoint"
        assert loss["checkpoint"] == loss["migrated"]
    else:
        assert loss["compared_with"] == "old-layout"
        assert len(loss["old_layout"]) == AFTER_STEPS
        assert loss["max_relative_difference"] <= LOSS_RTOL[model.param_dtype]


def test_a_flipped_bit_is_named(workers):
    """Comparator self-test (``--corrupt``): one bit flipped in the copy of new rank 0's state
    the oracles read is reported, with its tensor and region, by both oracles, and as a
    disagreement with its data-parallel replica on new rank 1. (That a faulty migration is
    caught is shown by tests/dist/test_planted_bugs.py.)"""
    tr = Transition(TINY, P(1, 2, 2), P(2, 1, 2))
    report = verify_transition(tr, workers=workers, corrupt=True, after_steps=0)
    assert not report["verified"]
    assert report["mismatches"] == 3
    first = report["first_mismatch"]
    assert first["oracle"] == ORACLE_GATHER and first["new_rank"] == 0
    assert first["differing"] == 1 and first["first"] == 0
    assert first["got"] ^ first["expected"] == 1
    assert report["step"]["ok"] and report["rng"]["ok"]


def _resize_expecting_abort(ctx, faults):
    """Worker: the pause with an injected fault; report the abort each process saw."""
    from slurm_etc.harness.phases import w_resize
    from slurm_etc.migrate.executor import MigrationAborted

    try:
        w_resize(ctx, keep_bits=False, faults=faults)
    except MigrationAborted as exc:
        return {"aborted": True, "message": str(exc), "has_state": "state" in ctx.objects}
    return {"aborted": False}


def _view_digest(ctx):
    """Worker: sha1 of every shard of the live state, read through megatron-core."""
    import hashlib

    from slurm_etc.harness.reference import w_megatron_view

    view = w_megatron_view(ctx)
    return None if view is None else {k: hashlib.sha1(v.tobytes()).hexdigest()
                                      for k, v in view["shards"].items()}


def test_abort_keeps_the_old_layout_training(workers):
    """A migration that fails half-way (rank 2 while unpacking round 0) aborts on every
    process; the old state is bit for bit what it was (read through megatron-core) and trains
    on in the old layout, with the same loss as an untouched copy of it."""
    from slurm_etc.harness.phases import batch_for, w_build, w_drop, w_prepare, w_train_step
    from slurm_etc.migrate.faults import FaultInjector

    tr = Transition(TINY, P(1, 2, 2), P(2, 1, 2))
    gb, seq = batch_for(tr.old, tr.new), 32
    common = dict(seed=7, steps=2, seq=seq, global_batch=gb)
    try:
        workers.run(w_build, tr.model, tr.old, tag="abort-a", **common)
        before = workers.run(_view_digest)
        workers.run(w_prepare, tr, tag="abort-a/resize", staging_bytes=None)
        seen = workers.run(_resize_expecting_abort, FaultInjector().fail(rank=2, at="unpack"))
        assert all(s["aborted"] and s["has_state"] for s in seen), seen
        assert all("rank 2" in s["message"] and "injected fault" in s["message"]
                   for s in seen), seen
        after = workers.run(_view_digest)
        assert after == before and all(d for d in before[:tr.old.world])
        after_abort = workers.run(w_train_step, "state", seed=7, seq=seq, global_batch=gb)
        workers.run(w_drop)
        workers.run(w_build, tr.model, tr.old, tag="abort-b", **common)
        untouched = workers.run(w_train_step, "state", seed=7, seq=seq, global_batch=gb)
    finally:
        workers.run(w_drop)
    assert after_abort == untouched and after_abort[0] is not None
