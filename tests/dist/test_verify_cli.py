"""`slurm-etc verify` for real: it spawns its own processes, migrates, and reports.

Two runs of the CLI (each starts its own local gloo processes): a verified transition
(exit 0, the JSON contract), and the same with one bit of a migrated shard flipped (exit 1,
the first differing tensor and region named on stderr).
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
    assert out["tensors"] == len(out["per_tensor"]) > 0
    assert out["bytes"] == sum(t["bytes"] for t in out["per_tensor"]) > 0
    # tp changes with the distributed optimizer: megatron's checkpoint reshards the model,
    # the gather oracle covers the optimizer
    assert out["optimizer_oracle"] == "global-gather"
    for t in out["per_tensor"]:
        expected = {"global-gather", "install-roundtrip"}
        if not t["tensor"].startswith("optimizer."):
            expected.add("megatron-checkpoint")
        assert set(t["oracles"]) == expected, t
    assert out["step"]["ok"] and out["rng_installed"]
    # progress went to stderr, one line per phase
    assert "migrating in place" in r.stderr


def test_corrupted_shard_exit_1_names_it():
    r = CliRunner().invoke(cli, [*ARGS, "--corrupt"])
    assert r.exit_code == 1, (r.stdout[-2000:], r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("slurm-etc: verify: MISMATCH: ")
    assert "box lo=(" in last and "on new rank 0" in last and "1 of " in last
