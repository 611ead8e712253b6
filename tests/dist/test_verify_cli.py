"""`slurm-etc verify` for real: it spawns its own processes, migrates, and reports.

Two runs of the CLI (each starts its own local gloo processes): a verified transition
(exit 0, the JSON contract), and the comparator self-test ``--corrupt`` (one bit flipped in
the copy of new rank 0's state the oracles read: exit 1, the tensor and region named on
stderr). That a faulty *migration* makes the CLI exit 1 is tests/dist/test_planted_bugs.py.
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

ARGS = ["verify", "--model", "tiny", "--from", "dp=2", "--to", "dp=1,tp=2",
        "--distributed-optimizer"]


def test_verified_transition_json_exit_0():
    r = CliRunner().invoke(cli, [*ARGS, "--json"])
    assert r.exit_code == 0, (r.stdout[-2000:], r.stderr[-2000:])
    out = json.loads(r.stdout)
    assert out["verified"] is True and out["mismatches"] == 0
    assert out["first_mismatch"] is None and not out["unchecked_tensors"]
    assert out["tensors"] == len(out["per_tensor"]) == 48  # tiny: 16 parameters x (1 + 2 moments)
    assert out["bytes"] == sum(t["bytes"] for t in out["per_tensor"]) > 0
    assert out["shards"] == sum(t["shards"] for t in out["per_tensor"])
    assert out["shards"] == out["coverage"]["new_shards"]
    # tp changes with the distributed optimizer: megatron's checkpoint reshards the model,
    # the optimizer is checked by the gather oracle (megatron's own dp gather on both layouts)
    assert out["optimizer_oracle"] == "megatron-gather"
    for t in out["per_tensor"]:
        expected = ["megatron-gather"]
        if not t["tensor"].startswith("optimizer."):
            expected.append("megatron-checkpoint")
        assert t["oracles"] == expected, t
        assert t["shards"] > 0 and t["bytes"] > 0, t
    assert out["step"] == {"expected": 2, "old": [2], "migrated": [2], "checkpoint": [],
                           "ok": True}
    assert out["rng_installed"] and out["rng"]["sources"] == {"0": 0, "1": 0}
    loss = out["loss_after"]
    assert loss["ok"] and loss["compared_with"] == "old-layout" and loss["steps"] == 3
    assert loss["max_relative_difference"] <= loss["tolerance"]
    # progress went to stderr, one line per phase
    assert "migrating in place" in r.stderr and "trained 3 steps on" in r.stderr


def test_corrupted_copy_exit_1_names_it():
    r = CliRunner().invoke(cli, [*ARGS, "--corrupt"])
    assert r.exit_code == 1, (r.stdout[-2000:], r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("slurm-etc: verify: MISMATCH: ")
    assert "box lo=(" in last and "on new rank 0" in last and "1 of " in last
    assert "checked by megatron-gather" in last
