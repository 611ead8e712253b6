"""`verify` on real megatron-core states: every transition migrates bit for bit.

One pool of 4 worker processes (``LocalWorkers``, the same runner the CLI uses) serves every
case: each builds tiny / tiny-llama (fp32 or bf16 mixed precision) under the old layout,
trains 2 Adam steps, saves megatron's checkpoint, resizes in place with the executor and
compares each new rank's shards with megatron's checkpoint resharding (model always; the
optimizer where megatron can reshard it), with the global-gather oracle and with the state
read back after installing; the step, the RNG state and the loss of one more training step
must agree too. Transitions cover dp, tp and pp changes, grow and shrink, dp=3, with and
without the distributed optimizer.
"""
from __future__ import annotations

import dataclasses

import pytest

from slurm_etc.megatron.checkpoint import megatron_reshards_optimizer
from slurm_etc.megatron.verify import (ORACLE_CHECKPOINT, ORACLE_GATHER, ORACLE_INSTALL,
                                            verify_transition)
from slurm_etc.megatron.phases import PRELOAD, Transition
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


@pytest.mark.parametrize("name", CASES)
def test_migrated_state_is_bit_identical(workers, name):
    model, old, new = CASES[name]
    tr = Transition(model, old, new)
    report = verify_transition(tr, workers=workers)
    assert report["verified"], (report["first_mismatch"], report["old_state_problems"],
                                report["step"], report["loss_after"])
    assert report["mismatches"] == 0 and report["first_mismatch"] is None
    assert report["shards"] > 0 and report["bytes"] > 0
    assert report["step"] == {"old": [2], "migrated": [2],
                              "checkpoint": [2] if megatron_reshards_optimizer(old, new) else [],
                              "ok": True}
    assert report["rng_installed"]
    # every tensor is checked by the gather oracle and read back after installing; megatron's
    # checkpoint covers all of them, or the parameters where it cannot reshard the optimizer
    oracles = report["oracles"]
    assert oracles[ORACLE_GATHER] == oracles[ORACLE_INSTALL] == report["tensors"]
    params = sum(1 for t in report["per_tensor"] if not t["tensor"].startswith("optimizer."))
    expected = report["tensors"] if megatron_reshards_optimizer(old, new) else params
    assert oracles[ORACLE_CHECKPOINT] == expected
    if megatron_reshards_optimizer(old, new):
        assert report["loss_after"]["checkpoint"] == report["loss_after"]["migrated"]


def test_a_flipped_bit_is_named(workers):
    """The comparison is not vacuous: one flipped bit in a migrated shard is reported, with
    its tensor and region, by every oracle."""
    tr = Transition(TINY, P(1, 2, 2), P(2, 1, 2))
    report = verify_transition(tr, workers=workers, corrupt=True, train_after=False)
    assert not report["verified"]
    assert report["mismatches"] == 3  # gather, checkpoint and install round trip
    first = report["first_mismatch"]
    assert first["new_rank"] == 0 and first["differing"] == 1 and first["first"] == 0
    assert first["got"] ^ first["expected"] == 1


def _resize_expecting_abort(ctx, faults):
    """Worker: the pause with an injected fault; report the abort each process saw."""
    from slurm_etc.megatron.phases import w_resize
    from slurm_etc.migrate.executor import MigrationAborted

    try:
        w_resize(ctx, keep_bits=False, faults=faults)
    except MigrationAborted as exc:
        return {"aborted": True, "message": str(exc), "has_state": "state" in ctx.objects}
    return {"aborted": False}


def test_abort_keeps_the_old_layout_training(workers):
    """A migration that fails half-way (rank 2 while unpacking round 0) aborts on every
    process; the old state is bit for bit what it was and trains on in the old layout, with
    the same loss as an untouched copy of it."""
    from slurm_etc.megatron.phases import (batch_for, w_build, w_digest, w_drop, w_prepare,
                                             w_train_step)
    from slurm_etc.migrate.faults import FaultInjector

    tr = Transition(TINY, P(1, 2, 2), P(2, 1, 2))
    gb, seq = batch_for(tr.old, tr.new), 32
    common = dict(seed=7, steps=2, seq=seq, global_batch=gb)
    try:
        workers.run(w_build, tr.model, tr.old, tag="abort-a", **common)
        before = workers.run(w_digest)
        workers.run(w_prepare, tr, tag="abort-a/resize", staging_bytes=None)
        seen = workers.run(_resize_expecting_abort, FaultInjector().fail(rank=2, at="unpack"))
        assert all(s["aborted"] and s["has_state"] for s in seen), seen
        assert all("rank 2" in s["message"] and "injected fault" in s["message"]
                   for s in seen), seen
        assert workers.run(w_digest) == before
        after_abort = workers.run(w_train_step, "state", seed=7, seq=seq, global_batch=gb)
        workers.run(w_drop)
        workers.run(w_build, tr.model, tr.old, tag="abort-b", **common)
        untouched = workers.run(w_train_step, "state", seed=7, seq=seq, global_batch=gb)
    finally:
        workers.run(w_drop)
    assert after_abort == untouched and after_abort[0] is not None
