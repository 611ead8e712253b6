"""Parsers on real Slurm output, captured by tests/slurm/make_fixtures.py from the local
cluster (one directory per Slurm version under tests/fixtures/slurm/)."""
import re
from datetime import datetime
from pathlib import Path

import pytest

from slurm_etc.slurm import NodeState, SlurmJobState
from slurm_etc.slurm.parsers import (
    count_gpus,
    expand_nodelist,
    is_unknown_job,
    parse_sbatch,
    parse_scontrol_jobs,
    parse_scontrol_record,
    parse_sinfo_nodes,
    parse_squeue,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
VERSIONS = sorted(d.name for d in FIXTURES.iterdir() if re.fullmatch(r"\d+\.\d+.*", d.name))


@pytest.fixture(params=VERSIONS)
def out(request):
    """Reads one captured file of one Slurm version."""
    return lambda name: (FIXTURES / request.param / name).read_text()


def by_name(jobs):
    return {j.name: j for j in jobs}


def test_fixtures_exist():
    assert VERSIONS, f"no captured Slurm output under {FIXTURES}"


def test_sbatch(out):
    assert parse_sbatch(out("sbatch_parsable.out")).isdigit()
    assert parse_sbatch("123;cluster\n") == "123"
    with pytest.raises(ValueError, match="no job id"):
        parse_sbatch("sbatch: error: something\n")


def test_squeue_running(out):
    jobs = by_name(parse_squeue(out("squeue_running.out")))
    assert set(jobs) == {"done", "anchor", "member", "wide", "odd name|with pipe"}
    anchor = jobs["anchor"]
    assert anchor.state is SlurmJobState.RUNNING and anchor.slurm_state == "RUNNING"
    assert anchor.partition == "main" and anchor.num_nodes == 2
    assert anchor.nodelist == "n[1-2]" and anchor.nodes == ("n1", "n2")
    assert anchor.batch_host == "n1" and anchor.reason is None and anchor.preempt_time is None
    assert anchor.user == "root"
    assert jobs["member"].partition == "scavenge" and jobs["member"].nodes == ("n4",)
    assert jobs["done"].state is SlurmJobState.COMPLETED
    wide = jobs["wide"]
    assert wide.state is SlurmJobState.PENDING and wide.nodes == () and wide.batch_host is None
    assert wide.num_nodes == 4 and wide.reason
    held = jobs["odd name|with pipe"]  # the separator inside the name survives
    assert held.state is SlurmJobState.PENDING and held.reason == "JobHeldUser"


def test_squeue_grace_and_requeue(out):
    grace = by_name(parse_squeue(out("squeue_grace.out")))
    member = grace["member"]
    # Picked for preemption: still RUNNING during GraceTime, with a preempt time.
    assert member.state is SlurmJobState.RUNNING
    assert isinstance(member.preempt_time, datetime)
    assert grace["preemptor"].state is SlurmJobState.PENDING
    requeued = by_name(parse_squeue(out("squeue_requeued.out")))
    assert requeued["member"].state is SlurmJobState.PENDING
    assert requeued["member"].reason == "BeginTime" and requeued["member"].nodes == ()
    assert requeued["preemptor"].state is SlurmJobState.RUNNING
    assert requeued["preemptor"].nodes == ("n4",)


def test_scontrol_jobs(out):
    (running,) = parse_scontrol_jobs(out("scontrol_job_running.out"))
    assert running.name == "anchor" and running.state is SlurmJobState.RUNNING
    assert running.nodes == ("n1", "n2") and running.batch_host == "n1"
    assert running.restarts == 0 and running.preempt_time is None
    assert running.fields["TresPerNode"].endswith("gpu:2")
    (pending,) = parse_scontrol_jobs(out("scontrol_job_pending.out"))
    assert pending.state is SlurmJobState.PENDING and pending.nodes == ()
    (held,) = parse_scontrol_jobs(out("scontrol_job_held.out"))
    assert held.name == "odd name|with pipe" and held.reason == "JobHeldUser"
    (done,) = parse_scontrol_jobs(out("scontrol_job_completed.out"))
    assert done.state is SlurmJobState.COMPLETED and done.state.finished
    (grace,) = parse_scontrol_jobs(out("scontrol_job_grace.out"))
    assert grace.state is SlurmJobState.RUNNING and grace.preempt_time is not None
    assert grace.partition == "scavenge" and grace.batch_host == "n4"
    (requeued,) = parse_scontrol_jobs(out("scontrol_job_requeued.out"))
    assert requeued.state is SlurmJobState.PENDING and requeued.restarts == 1
    assert requeued.reason == "BeginTime"
    everything = parse_scontrol_jobs(out("scontrol_jobs_all.out"))
    assert {"anchor", "member", "preemptor", "wide", "done"} <= {j.name for j in everything}


def test_unknown_job(out):
    assert is_unknown_job(out("squeue_unknown.err"))
    assert is_unknown_job(out("scontrol_job_unknown.err"))
    assert parse_squeue(out("squeue_unknown.out")) == []
    assert parse_scontrol_jobs("No jobs in the system\n") == []


def test_sinfo(out):
    nodes = {n.name: n for n in parse_sinfo_nodes(out("sinfo_down_drain.out"))}
    assert list(nodes) == ["n1", "n2", "n3", "n4"]
    n1, n2, n3, n4 = nodes.values()
    assert n1.state is NodeState.MIXED and n1.usable and n1.reason is None
    assert n1.partitions == ("main", "scavenge", "high")  # merged rows, default mark dropped
    assert n1.cpus == 4 and n1.gres == "gpu:2" and n1.gpus == 2 and n1.gpus_used == 2
    assert n2.state is NodeState.DRAINING and not n2.usable
    assert n2.reason == "fixture: maintenance window"
    assert n3.state is NodeState.DOWN and n3.reason == "fixture: node lost"
    assert n3.gpus_used == 0 and not n3.usable
    assert n4.state is NodeState.ALLOCATED
    (one,) = parse_sinfo_nodes(out("sinfo_one_node.out"))
    assert one.name == "n3" and one.state is NodeState.DOWN


def test_sinfo_after_resume(out):
    # Right after cancelling and RESUME: idle* (resumed, slurmd not pinged yet), completing,
    # planned; never down, drained or unknown.
    for node in parse_sinfo_nodes(out("sinfo_after_resume.out")):
        assert node.state in (NodeState.IDLE, NodeState.COMPLETING), node


def test_scontrol_record_values_with_spaces():
    r = parse_scontrol_record("JobId=5 JobName=a b Reason=Nodes required for job are DOWN "
                              "AllocNode:Sid=h:1 CPUs/Task=1 Power=")
    assert r == {"JobId": "5", "JobName": "a b",
                 "Reason": "Nodes required for job are DOWN", "AllocNode:Sid": "h:1",
                 "CPUs/Task": "1", "Power": ""}


@pytest.mark.parametrize("text,names", [
    ("", ()),
    ("(null)", ()),
    ("n1", ("n1",)),
    ("n[1-3]", ("n1", "n2", "n3")),
    ("n[1-2,5],gpu-a[08-10]", ("n1", "n2", "n5", "gpu-a08", "gpu-a09", "gpu-a10")),
    ("r[1-2]n[1-2]", ("r1n1", "r1n2", "r2n1", "r2n2")),
    ("a,b", ("a", "b")),
])
def test_expand_nodelist(text, names):
    assert expand_nodelist(text) == names


def test_expand_nodelist_unbalanced():
    with pytest.raises(ValueError, match="unbalanced"):
        expand_nodelist("n[1-2")


@pytest.mark.parametrize("gres,gpus", [
    ("gpu:2", 2), ("gpu:0", 0), ("", 0), ("gpu:a100:4(S:0-1)", 4),
    ("gpu:2(IDX:0-1),mps:100", 2), ("gpu:a100:2,gpu:h100:1", 3), ("mps:100", 0),
])
def test_count_gpus(gres, gpus):
    assert count_gpus(gres) == gpus
