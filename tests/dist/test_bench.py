"""`slurm-etc bench migrate` on tiny: both paths run and the report is complete and sane.

No timing assertions (the machine is shared): only that every number exists, is positive
where it must be, fits the spans measured around it, and that both paths end in the same
state.
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
    # both downtimes are wall-clock spans, first rank paused to last rank ready; the ratio's
    # is the one with the cold start of a node with a core per process
    assert s["ratio_cold_start"] == "per_process_core"
    assert s["checkpoint_seconds"] == pytest.approx(
        parts["save"] + parts["stop"] + parts["cold_start"] + parts["build_load"])
    assert parts["cold_start"] == pytest.approx(max(parts["cold_start_each"]))
    assert len(parts["cold_start_each"]) == len(parts["cold_start_each_all_at_once"]) == 4
    # started one at a time, each start is inside the pool's whole start-up, one after the
    # other: a start measured from the pool's beginning instead of its own spawn fails this
    assert sum(parts["cold_start_each"]) <= parts["cold_start_one_at_a_time_total"]
    # all at once, every process's start is inside the pool's
    assert max(parts["cold_start_each_all_at_once"]) <= parts["cold_start_all_at_once"]
    # the all-at-once downtime is measured in one piece: its parts, measured separately on
    # every process's clock, fit inside it, leaving only the parent's hand-offs (a part
    # counted twice, or a sum of per-rank maxima over overlapping phases, fails this)
    assert 0 <= parts["handoffs_all_at_once"] < 1.0
    assert s["checkpoint_seconds_all_at_once"] == pytest.approx(
        parts["save"] + parts["stop"] + parts["cold_start_all_at_once"]
        + parts["build_load_all_at_once"] + parts["handoffs_all_at_once"])
    # the slowest rank's group, build and load each lie inside the build + load span, and
    # megatron's save and the extra fsync inside the save span (their sum need not: the
    # slowest rank of one part is not always the slowest of the next)
    assert max(parts["group"], parts["build"], parts["load"]) <= parts["build_load"] + 1e-6
    assert max(parts["megatron_save"], parts["extra_fsync"]) <= parts["save"] + 1e-6
    assert parts["checkpoint_bytes"] >= s["state_bytes"]
    assert s["ratio"] == pytest.approx(s["checkpoint_seconds"] / s["etc_seconds"])
    assert s["ratio_all_at_once"] == pytest.approx(
        s["checkpoint_seconds_all_at_once"] / s["etc_seconds"])
    load = s["load_average"]
    assert load["cpus"] >= 1 and len(load["before"]) == len(load["after"]) == 3
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


def test_checkpoint_downtime_is_a_span_not_a_sum_of_maxima():
    """Synthetic clocks: the downtime runs from the first pause to the last rank ready, the
    slowest process started alone replaces the all-at-once cold start, and the parent's
    hand-offs between the parts show up only in the all-at-once span, measured in one
    piece."""
    from slurm_etc.megatron.bench import checkpoint_spans

    save = {"pause": 100.0, "saved": 103.0, "stopped": 103.5}
    all_at_once = {"start_seconds": 7.5, "start_each": [7.2, 7.5, 7.4, 7.3],
                   "begin": 111.1, "ready": 112.1}
    per_core = {"start_seconds": 14.0, "start_each": [3.4, 3.5, 3.45, 3.3],
                "begin": 130.0, "ready": 131.25}
    out = checkpoint_spans(save, all_at_once, per_core)
    spans = out["spans"]
    assert spans["save"] == 3.0 and spans["stop"] == 0.5
    assert spans["cold_start"] == 3.5 and spans["cold_start_all_at_once"] == 7.5
    assert spans["build_load"] == 1.25 and spans["build_load_all_at_once"] == pytest.approx(1.0)
    assert out["checkpoint_seconds"] == pytest.approx(3.0 + 0.5 + 3.5 + 1.25)
    assert out["checkpoint_seconds_all_at_once"] == pytest.approx(12.1)
    assert spans["handoffs_all_at_once"] == pytest.approx(12.1 - (3.0 + 0.5 + 7.5 + 1.0))
