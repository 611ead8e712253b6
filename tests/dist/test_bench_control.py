"""``slurm-etc bench control`` at 16 ranks: the JSON the issue asks for, with sane values, and
planted miscounts of the coordinator's messages caught by its check; a size past the
machine's open-file limit refused in one line before anything runs."""
from __future__ import annotations

import json
import resource

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.harness.control import ControlBench, check_run, descriptor_problem, run_control
from slurm_etc.testing import bench_plants

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

FAST = ["--step-s", "0.05", "--steady-steps", "10", "--steady-s", "2.5", "--timeout-s", "120"]
KEYS = {"ranks", "step_control_ms", "coordinator_cpu_s_per_s", "coordinator_messages_per_step",
        "resize_control_s", "coordinator_rss_mib", "record_bytes"}


def test_bench_control_json_at_16_ranks():
    got = CliRunner().invoke(cli, ["bench", "control", "--ranks", "16", "--json", *FAST])
    assert got.exit_code == 0, got.output
    out = json.loads(got.stdout)
    (run,) = out["runs"]
    assert KEYS <= set(run)
    assert run["ranks"] == 16 and run["state"] == "finished"
    assert set(run["resize_control_s"]) == {"grow", "shrink", "loss"}
    assert check_run(run) == []
    # a steady step asks the store nothing (the gate is closed: every rank takes part in
    # its all-reduce) and rank 0 reports one Progress; libzmq's heartbeats never reach the
    # coordinator's loop
    steady = run["steady"]
    per = steady["messages_per_step"]
    assert per["channel_in"] == pytest.approx(1.0, abs=0.1)
    assert per["store_requests"] == 0 and per["channel_out"] == 0
    assert steady["gate_contributions_per_step"] == pytest.approx(16, abs=1)
    # a resize is decided by the ranks' collectives: a few store requests (the decision
    # written once, the trainer state published, the commit asked once), plus each joiner's
    # read of the trainer state (a grow by a node of 8), never one a rank of the old layout
    resizes = run["resizes"]
    assert 1 <= resizes["shrink"]["store_requests"] <= 6
    assert 1 <= resizes["loss"]["store_requests"] <= 6
    assert 8 <= resizes["grow"]["store_requests"] <= 8 + 6
    assert run["store_totals"]["requests"] == run["store_totals"]["replies"] > 0
    assert 0 < run["step_control_ms"] < 1000
    assert 0 < run["coordinator_cpu_s_per_s"] < 2.2
    for phase in ("grow", "shrink", "loss"):
        assert 0 < run["resize_control_s"][phase] < 30, phase
        assert run["resizes"][phase]["outcome"] == "committed"
        # the control time is the slowest rank's own part (its boundary to the migration
        # group's barrier, the data phase's stand-in) and the barrier's end to the commit;
        # the definition of before (the earliest boundary to the commit, less the
        # proposer's wait in the barrier) beside it
        detail = run["resizes"][phase]
        assert detail["slowest_rank_s"] >= 0 and detail["barrier_to_commit_s"] >= 0, phase
        assert run["resize_control_s"][phase] == pytest.approx(
            detail["slowest_rank_s"] + detail["barrier_to_commit_s"], abs=2e-3), phase
        # a rank's part lies between the earliest boundary and the barrier's end: the two
        # parts fit in the span from that boundary to the commit
        assert run["resize_control_s"][phase] <= detail["boundary_to_commit_s"] + 2e-3, phase
        assert 0 <= detail["group_barrier_s"] < detail["boundary_to_commit_s"], phase
        assert detail["earliest_boundary_control_s"] == pytest.approx(
            detail["boundary_to_commit_s"] - detail["group_barrier_s"], abs=2e-3), phase
    # one migration each: the grow, the preemption shrink, the node loss
    assert [(m["from"], m["to"], m["outcome"]) for m in run["migrations"]] == [
        (0, 1, "committed"), (1, 2, "committed"), (2, 3, "committed")]
    assert run["record_bytes"] > 0 and run["coordinator_rss_mib"] > 0


@pytest.mark.parametrize("plant", [bench_plants.store_requests_half_counted,
                                   bench_plants.store_replies_uncounted])
def test_planted_miscount_is_caught(plant):
    # the store's requests and replies over the run differ
    run = run_control(ControlBench(16, steady_min_s=2.5, timeout_s=120), counters=plant)
    problems = check_run(run)
    assert any("store re" in p for p in problems), (plant.__name__, problems,
                                                    run["resizes"])


def test_too_many_ranks_for_the_open_file_limit_is_one_line():
    if descriptor_problem(ControlBench(131_072)) is None:  # one descriptor a rank fits
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        pytest.skip(f"no open-file limit under 131,072 ranks here (hard {hard})")
    got = CliRunner().invoke(cli, ["bench", "control", "--ranks", "131072"])
    assert got.exit_code == 2
    lines = [x for x in got.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "open files" in lines[0] and "Traceback" not in got.output
