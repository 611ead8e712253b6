"""`slurm-etc simulate --sacct` (issue #44, part 3): a site's sacct history read by header
names, every kind of line handled, what happened computed from it, and the same GPU work
replayed with elastic jobs; a malformed line is one line naming its number, exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.sim.history import HistoryError, peak_gpus, read_history, what_happened

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sacct" / "history-22.05.txt"


def test_every_kind_of_line():
    h = read_history(FIXTURE.read_text(), "fixture")
    by_id = {j.job_id: j for j in h.jobs}
    # steps skipped, the pending array never ran, the CPU job apart
    assert set(by_id) == {"100", "101_3", "102+0", "104", "105"}
    assert (h.steps_skipped, h.never_ran, h.cpu_jobs) == (2, 1, 1)
    assert by_id["100"].gpus == 16 and by_id["100"].nodes == 2
    assert by_id["101_3"].gpus == 2 and by_id["101_3"].state == "PREEMPTED"  # gres/gpu:a100=2
    assert by_id["102+0"].state == "CANCELLED"  # "CANCELLED by 1000"
    assert by_id["104"].end == by_id["100"].end  # Unknown end: running at the history's end
    assert by_id["100"].start - by_id["100"].submit == 600
    figures = what_happened(h, 32)
    # 16 GPUs x 4 h + 2 x 1 h + 4 x 1 h + 8 x 1 h + 1 x 20 min
    assert figures["gpu_hours_used"] == pytest.approx(64 + 2 + 4 + 8 + 1 / 3)
    assert figures["gpu_hours_idle"] == pytest.approx(32 * 25 / 6 - figures["gpu_hours_used"])
    assert figures["preempted_jobs"] == 1 and figures["preempted_gpu_hours"] == 2
    assert figures["node_fail_jobs"] == 1 and figures["jobs"] == 5
    assert peak_gpus(h) == 16 + 1 + 8  # 100, 105 and 104 at 03:10


def test_a_helios_layout_reads_the_same():
    csv = ("job_id,user,vc,jobname,gpu_num,cpu_num,node_num,state,submit_time,start_time,"
           "end_time,duration,queue\n"
           "a1,u1,vc1,j,8,16,1,COMPLETED,2020-04-01 00:00:00,2020-04-01 00:30:00,"
           "2020-04-01 02:30:00,7200,1800\n"
           "a2,u2,vc1,j,0,4,1,COMPLETED,2020-04-01 00:00:00,2020-04-01 00:00:10,"
           "2020-04-01 01:00:00,3590,10\n"
           "a3,u1,vc2,j,16,32,2,FAILED,2020-04-01 01:00:00,2020-04-01 01:00:00,"
           "2020-04-01 01:30:00,1800,0\n")
    h = read_history(csv, "helios.csv")
    assert [(j.job_id, j.gpus, j.nodes, j.state) for j in h.jobs] == [
        ("a1", 8, 1, "COMPLETED"), ("a3", 16, 2, "FAILED")]
    assert h.cpu_jobs == 1
    assert what_happened(h, 16)["gpu_hours_used"] == pytest.approx(8 * 2 + 16 * 0.5)


@pytest.mark.parametrize("text,where,what", [
    ("JobID|State|Start|End|AllocTRES\n1|COMPLETED|2026-11-01T00:00:00|x|gres/gpu=1\n",
     ":2:", "'x' is not a time"),
    ("JobID|State|Start|End|AllocTRES\n1|COMPLETED|2026-11-01T00:00:00\n", ":2:",
     "3 fields, the header has 5"),
    ("JobID|State|End\n", ":1:", "no start column"),
    ("", "", "empty"),
    ("JobID|State|Start|End|NNodes|AllocTRES\n1|COMPLETED|2026-11-01T00:00:00|"
     "2026-11-01T01:00:00|lots|gres/gpu=1\n", ":2:", "'lots' is not a number of nodes"),
])
def test_a_malformed_history_is_one_line(text, where, what):
    with pytest.raises(HistoryError) as err:
        read_history(text, "h.txt")
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"h.txt{where}") and what in line


def test_the_command_line_reports_and_replays(tmp_path):
    run = CliRunner().invoke(cli, ["simulate", "--sacct", str(FIXTURE), "--jobs", "2",
                                   "--json", "--plot", str(tmp_path / "h.png")])
    assert run.exit_code == 0, run.output
    out = json.loads(run.stdout)
    assert out["jobs"] == 5 and out["gpu_hours_used"] == pytest.approx(78.333, abs=1e-3)
    assert out["capacity_gpus"] == 32  # the peak (25 GPUs) in whole nodes of 8
    assert out["compact"]["rigid_jobs_started"] == 5  # the history's GPU jobs, replayed
    assert out["elastic_gpu_hours"] >= 0 and (tmp_path / "h.png").stat().st_size > 0
    bad = tmp_path / "bad.txt"
    bad.write_text("JobID|State|Start|End|AllocTRES\n1|COMPLETED|2026-11-01T00:00:00\n")
    run = CliRunner().invoke(cli, ["simulate", "--sacct", str(bad)])
    assert run.exit_code == 2 and f"{bad}:2: 3 fields" in run.output
    run = CliRunner().invoke(cli, ["simulate", "--sacct", "-", "--json"],
                             input=FIXTURE.read_text())
    assert run.exit_code == 0 and json.loads(run.stdout)["jobs"] == 5
