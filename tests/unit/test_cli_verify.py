"""`slurm-etc verify` and `bench migrate` through click's CliRunner, without processes.

The experiments themselves (``verify.verify_transition`` / ``bench.bench_migrate``) are replaced
by stubs returning recorded reports, so these tests check the CLI contract: the JSON fields,
the exit codes (0 verified, 1 mismatch, 2 bad input, 3 the run failed) and the one-line
messages. tests/dist/test_verify_cli.py runs the same commands for real.
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.harness import bench, verify
from slurm_etc.pool.local import WorkerError
from tests.unit.verify_reports import report


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def fake_verify(tr, **kwargs):
        seen.append((tr, kwargs))
        return report(verified=not kwargs.get("corrupt"))

    monkeypatch.setattr(verify, "verify_transition", fake_verify)
    return seen


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_verified_json_and_exit_0(calls):
    r = run("verify", "--model", "tiny", "--from", "dp=2", "--to", "dp=1,tp=2", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert {"tensors", "bytes", "mismatches", "verified", "oracles", "per_tensor"} <= out.keys()
    assert out["verified"] is True and out["mismatches"] == 0
    (tr, kwargs), = calls
    assert (tr.old.dp, tr.new.tp, tr.processes) == (2, 2, 2)
    assert kwargs["seed"] == 1234 and kwargs["steps"] == 2


def test_mismatch_exit_1_names_tensor_and_region(calls):
    r = run("verify", "--model", "tiny", "--from", "dp=2", "--to", "dp=1,tp=2", "--corrupt")
    assert r.exit_code == 1
    assert "MISMATCH" in r.stdout  # the table's result row
    line = r.stderr.strip().splitlines()[-1]
    assert line == ("slurm-etc: verify: MISMATCH: optimizer.state.exp_avg.decoder.layers.mlp."
                    "linear_fc1.weight (box lo=(2, 0, 0) hi=(3, 256, 64)) on new rank 1, checked "
                    "by megatron-gather: 1 of 16384 elements differ, first at 7: bits "
                    "1065353217 instead of 1065353216")


BAD_STEP = {"step": {"expected": 2, "old": [2], "migrated": [1], "checkpoint": [2],
                     "ok": False}}
BAD_RNG = {"rng_installed": False,
           "rng": {"ok": False, "sources": {0: 0, 1: 0, 2: 2}, "wrong_ranks": [1],
                   "checked_against_checkpoint": []}}
BAD_LOSS = {"loss_after": {"migrated": [5.5, float("nan")], "old_layout": [5.5, 5.4],
                           "steps": 2, "compared_with": "old-layout", "tolerance": 1e-6,
                           "ok": False}}
MISSING = {"mismatches": 1, "first_mismatch": {
    "oracle": "megatron-checkpoint", "new_rank": 0, "state_key": "decoder.layers.mlp.fc2.weight",
    "lo": [0, 0, 0], "hi": [1, 64, 256],
    "problem": "shard (replica (0, 0, 0)) missing in the migrated state"}}
HOLE = {"mismatches": 1, "first_mismatch": {
    "oracle": "megatron-gather", "side": "new layout",
    "state_key": "embedding.word_embeddings.weight",
    "problem": "64 of 8192 elements held by no rank"}}


@pytest.mark.parametrize("extra, named", [
    (BAD_STEP, "Adam step: every parameter must be at step 2; old [2], migrated [1]"),
    (BAD_RNG, "RNG: new rank(s) [1] do not continue the CPU generator of their source old "
              "rank(s) {1: 0}"),
    (BAD_LOSS, "loss after the resize: migrated [5.5, nan], old-layout [5.5, 5.4]"),
    (MISSING, "decoder.layers.mlp.fc2.weight (box lo=(0, 0, 0) hi=(1, 64, 256)) on new rank 0, "
              "checked by megatron-checkpoint: shard (replica (0, 0, 0)) missing in the "
              "migrated state"),
    (HOLE, "embedding.word_embeddings.weight, checked by megatron-gather: 64 of 8192 elements "
           "held by no rank"),
    ({"unchecked_tensors": ["output_layer.weight"]},
     "tensors no oracle checked: output_layer.weight"),
])
def test_every_failure_is_exit_1_and_named(monkeypatch, extra, named):
    monkeypatch.setattr(verify, "verify_transition",
                        lambda tr, **kw: report(verified=False, **{"first_mismatch": None,
                                                                   **extra}))
    r = run("verify", "--model", "tiny", "--from", "dp=2", "--to", "dp=1,tp=2", "--json")
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)["verified"] is False
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("slurm-etc: verify: MISMATCH: ") and named in line, line


def test_corrupt_is_described_as_a_comparator_self_test():
    r = run("verify", "--help")
    assert r.exit_code == 0
    assert "--corrupt" not in r.stdout  # hidden: a self-test, not a user feature
    from slurm_etc.cli.cmd_verify import verify as command

    (option,) = [p for p in command.params if p.name == "corrupt"]
    assert "Comparator self-test" in option.help and "does not" in option.help


def test_options_reach_the_experiment(calls):
    r = run("verify", "--model", "tiny-llama", "--from", "dp=2,tp=2", "--to", "dp=4",
            "--distributed-optimizer", "--param-dtype", "bf16", "--seed", "7", "--steps", "3")
    assert r.exit_code == 0, r.output
    (tr, kwargs), = calls
    assert tr.model.param_dtype == "bf16" and tr.model.name == "tiny-llama-bf16"
    assert tr.old.distributed_optimizer and tr.new.distributed_optimizer
    assert kwargs["seed"] == 7 and kwargs["steps"] == 3


@pytest.mark.parametrize("args, message", [
    (["--model", "nope", "--from", "dp=1", "--to", "dp=2"], "unknown model 'nope'"),
    (["--model", "tiny", "--from", "dp=1,tp=3", "--to", "dp=2"], "tp (3) must divide"),
    (["--model", "tiny", "--from", "dp=x", "--to", "dp=2"], "dp must be an integer"),
    (["--model", "tiny", "--from", "dp=8,tp=2", "--to", "dp=2"],
     "needs 16 local processes, more than --max-processes (8)"),
    (["--model", "tiny", "--from", "dp=1,pp=3", "--to", "dp=2"], "pp (3) must divide"),
])
@pytest.mark.parametrize("command", [["verify"], ["bench", "migrate"]])
def test_bad_input_is_one_line_exit_2(calls, command, args, message):
    r = run(*command, *args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not calls


def test_run_failure_is_exit_3(monkeypatch):
    def broken(tr, **kwargs):
        raise WorkerError(1, "slurm_etc.harness.phases.w_build",
                          "Traceback ...\nRuntimeError: boom\n")

    monkeypatch.setattr(verify, "verify_transition", broken)
    r = run("verify", "--model", "tiny", "--from", "dp=2", "--to", "dp=1")
    assert r.exit_code == 3
    assert "worker 1 raised in slurm_etc.harness.phases.w_build" in r.stderr
    assert "RuntimeError: boom" in r.stderr


BENCH = {
    "model": "tiny", "from": "dp=1,tp=2,pp=2", "to": "dp=2,tp=1,pp=2", "processes": 4,
    "repeat": 1, "state_bytes": 2_646_528, "moved_bytes": 2_727_936, "kept_bytes": 2_900_000,
    "messages": 4, "rounds": 1, "etc_seconds": 0.5, "checkpoint_seconds": 4.7,
    "checkpoint_seconds_all_at_once": 8.8,
    "checkpoint_parts": {"save": 0.3, "stop": 0.1, "cold_start": 3.5, "build_load": 0.8,
                         "cold_start_all_at_once": 7.5, "build_load_all_at_once": 0.9,
                         "handoffs_all_at_once": 0.01, "cold_start_each": [3.4, 3.5, 3.3, 3.4],
                         "cold_start_each_all_at_once": [7.4, 7.5, 7.3, 7.4],
                         "cold_start_one_at_a_time_total": 13.7, "group": 0.05, "build": 0.3,
                         "load": 0.3, "megatron_save": 0.28, "extra_fsync": 0.01,
                         "save_first": 6.0, "checkpoint_bytes": 3_000_000},
    "etc_parts": {"resume": 0.01, "migrate": 0.1, "train_group": 0.07, "rebuild": 0.3,
                  "install": 0.02},
    "prepare_parts": {"group": 0.02, "allocate": 0.15},
    "ratio": 9.4, "ratio_all_at_once": 17.6, "ratio_cold_start": "per_process_core",
    "ratios": [9.4], "ratios_all_at_once": [17.6],
    "data_seconds": 0.05, "achieved_gibps": 0.05, "raw_p2p_gibps": 2.0,
    "raw_p2p_fresh_gibps": 1.4, "data_over_raw_p2p": 0.025, "data_over_raw_p2p_fresh": 0.04,
    "raw_pattern_seconds": 0.01, "data_over_raw_pattern": 0.2, "peak_over_bound_max": 0.02,
    "same_state": True, "checkpoint_complete": True,
    "load_average": {"before": [1.5, 1.2, 1.0], "after": [2.0, 1.4, 1.1], "cpus": 2},
    "targets": {"pause_le_data_plus_150ms": True, "ratio_ge_25": False,
                "data_ge_80pct_raw_pattern": False, "peak_le_bound_plus_10pct": True},
    "runs": [{"etc": {"per_rank": [{"device": 0, "new_rank": 0, "sent_bytes": 1,
                                    "received_bytes": 1, "data_seconds": 0.05,
                                    "throughput_gibps": 0.1, "memory_peak_delta": 10,
                                    "memory_bound": 100, "peak_over_bound": 0.1}]}}],
}


def test_bench_json_and_table(monkeypatch):
    seen = []

    def fake_bench(tr, **kwargs):
        seen.append(kwargs)
        return BENCH

    monkeypatch.setattr(bench, "bench_migrate", fake_bench)
    r = run("bench", "migrate", "--model", "tiny", "--from", "dp=1,tp=2,pp=2", "--to",
            "dp=2,tp=1,pp=2", "--repeat", "2", "--staging-mb", "16", "--p2p-mb", "8", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["ratio"] == 9.4
    assert seen[0]["repeat"] == 2 and seen[0]["staging_bytes"] == 16 << 20
    assert seen[0]["p2p_bytes"] == 8 << 20
    r = run("bench", "migrate", "--model", "tiny", "--from", "dp=1,tp=2,pp=2", "--to",
            "dp=2,tp=1,pp=2")
    assert r.exit_code == 0, r.output
    for label in ("in-place downtime", "checkpoint downtime", "ratio", "raw gloo p2p",
                  "peak memory", "missed", "per migrating rank", "cold start, per process core",
                  "cold start, all at once", "9.4x", "17.6x", "load average 1.50"):
        assert label in r.stdout
