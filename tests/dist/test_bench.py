"""`slurm-etc bench migrate` on tiny: both paths run and the report is complete and sane.

No timing assertions (the machine is shared): only that every number exists, is positive
where it must be, adds up, and that both paths end in the same state.
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.megatron.phases import Transition
from slurm_etc.plan import PRESETS, ParallelConfig

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def test_bench_tiny_reports_both_paths():
    r = CliRunner().invoke(cli, ["bench", "migrate", "--model", "tiny", "--from",
                                 "dp=1,tp=2,pp=2", "--to", "dp=2,tp=1,pp=2", "--p2p-mb", "8",
                                 "--json"])
    assert r.exit_code == 0, (r.stdout[-2000:], r.stderr[-2000:])
    s = json.loads(r.stdout)
    plan = Transition(PRESETS["tiny"], ParallelConfig(1, 2, 2),
                      ParallelConfig(2, 1, 2)).plan()
    assert s["moved_bytes"] == plan.moved_bytes > 0
    assert s["state_bytes"] == plan.catalog.total_bytes
    for key in ("etc_seconds", "checkpoint_seconds", "ratio", "data_seconds",
                "achieved_gibps", "raw_p2p_gibps", "raw_p2p_fresh_gibps",
                "raw_pattern_seconds", "peak_over_bound_max"):
        assert s[key] is not None and s[key] > 0, key
    parts = s["checkpoint_parts"]
    assert parts["save"] + parts["restart"] + parts["load"] == pytest.approx(
        s["checkpoint_seconds"])
    assert parts["restart"] == pytest.approx(parts["stop"] + parts["fresh_start"]
                                             + parts["fresh_build"])
    assert parts["checkpoint_bytes"] >= s["state_bytes"]
    assert s["ratio"] == pytest.approx(s["checkpoint_seconds"] / s["etc_seconds"])
    assert set(s["etc_parts"]) == {"resume", "migrate", "train_group", "rebuild", "install"}
    # connected and allocated before the pause, not part of the downtime
    assert set(s["prepare_parts"]) == {"group", "allocate"}
    assert all(v > 0 for v in s["prepare_parts"].values())
    assert s["same_state"] is True
    assert set(s["targets"]) == {"ratio_ge_10", "throughput_ge_80pct_raw",
                                 "peak_le_bound_plus_10pct"}
    (run,) = s["runs"]
    ranks = run["etc"]["per_rank"]
    assert [p["device"] for p in ranks] == [0, 1, 2, 3]
    assert sum(p["sent_bytes"] for p in ranks) == sum(p["received_bytes"] for p in ranks) \
        == plan.moved_bytes
    for p in ranks:
        assert p["memory_peak_delta"] is not None and p["memory_bound"] > 0
        # a process's phases follow one another inside its own pause .. ready span, and the
        # downtime spans every process's
        assert 0 < sum(p["phases"].values()) <= p["span"] <= s["etc_seconds"] + 1e-6, p
    assert all(p["phases"]["migrate"] > 0 for p in ranks)
    assert run["raw_p2p"]["ok"]
