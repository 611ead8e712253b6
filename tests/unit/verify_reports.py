"""A recorded ``verify`` report (the JSON a verified or mismatched transition gives) for the
CLI tests that stub the experiment out (tests/unit/test_cli_verify.py,
test_verify_live_cli.py)."""
from __future__ import annotations

MISMATCH = {"oracle": "megatron-gather", "new_rank": 1,
            "state_key": "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight",
            "lo": [2, 0, 0], "hi": [3, 256, 64], "differing": 1, "of": 16384,
            "first": 7, "got": 1065353217, "expected": 1065353216}


def report(verified: bool = True, **extra) -> dict:
    out = {"model": "tiny", "from": "dp=2,tp=1,pp=1", "to": "dp=1,tp=2,pp=1", "processes": 2,
           "tensors": 48, "shards": 159, "bytes": 2_912_256, "moved_bytes": 1_000_000,
           "mismatches": 0 if verified else 1, "verified": verified,
           "first_mismatch": None if verified else MISMATCH, "old_state_problems": [],
           "unchecked_tensors": [],
           "oracles": {"megatron-gather": 48, "megatron-checkpoint": 48},
           "oracle_tensors": {}, "per_tensor": [], "optimizer_oracle": "megatron-checkpoint",
           "coverage": {"old_shards": 159, "new_shards": 159, "checkpoint_shards": 159},
           "step": {"expected": 2, "old": [2], "migrated": [2], "checkpoint": [2], "ok": True},
           "rng_installed": True,
           "rng": {"ok": True, "sources": {0: 0, 1: 0}, "wrong_ranks": [],
                   "checked_against_checkpoint": [0, 1]},
           "loss_after": {"migrated": [5.5, 5.4, 5.3], "checkpoint": [5.5, 5.4, 5.3],
                          "steps": 3, "compared_with": "checkpoint", "tolerance": 0.0,
                          "ok": True},
           "seconds": 3.0}
    out.update(extra)
    return out
