"""CliSlurmClient against a real local Slurm cluster (4 nodes x 2 fake GPUs; see conftest).

Each test names the nodes it uses, waits for them to be free, and cancels its jobs."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_etc.slurm import (
    BatchSpec,
    NodeAdminState,
    NodeState,
    SlurmError,
    SlurmJobState,
    SlurmRunner,
    StepSpec,
    commands,
    parsers,
)

pytestmark = pytest.mark.timeout(240)

# A batch script that records every signal it gets (Python handlers: bash traps can miss a
# USR2 that arrives together with SIGCONT) and exits on SIGTERM.
RECORDER = """#!{python}
import os, signal, sys, time
log = {log!r}
def note(what):
    with open(log, "a") as f:
        f.write(f"{{time.time():.3f}} {{what}}\\n")
def on(signum, frame):
    note(signal.Signals(signum).name)
    if signum == signal.SIGTERM:
        sys.exit(0)
for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGCONT, signal.SIGINT):
    signal.signal(s, on)
note("START " + os.environ.get("SLURM_JOB_ID", "?"))
while True:
    time.sleep(0.05)
"""


def recorder(log: Path) -> str:
    return RECORDER.format(python=sys.executable, log=str(log))


def events(log: Path) -> list[tuple[float, str]]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        t, _, what = line.partition(" ")
        out.append((float(t), what))
    return out


def wait_for(predicate, what: str, timeout: float = 30.0, interval: float = 0.2):
    """Polls predicate until it returns something true; fails naming the last value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}; last seen: {last!r}")


def wait_free(client, names, timeout=60.0):
    """Waits until the named nodes are idle and responding (jobs of earlier tests gone)."""
    def free():
        nodes = {n.name: n for n in client.nodes(names)}
        return all(nodes[n].state is NodeState.IDLE and nodes[n].responding for n in names)
    wait_for(free, f"nodes {names} idle", timeout)


def running(client, job_id):
    def check():
        (job,) = client.jobs([job_id]) or (None,)
        return job if job is not None and job.state is SlurmJobState.RUNNING else None
    return check


def partition(name: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "--oneliner", "show", "partition", name],
                         capture_output=True, text=True, check=True).stdout
    return parsers.parse_scontrol_record(out.strip())


def test_cluster_shape(client, cluster):
    nodes = client.nodes()
    assert len(nodes) >= 4, nodes
    assert all(n.gpus >= 2 and n.cpus >= 2 for n in nodes), nodes
    assert {"main", "scavenge", "high"} <= set(nodes[0].partitions)
    main, scavenge, high = partition("main"), partition("scavenge"), partition("high")
    assert main["Default"] == "YES" and main["PreemptMode"] == "OFF"
    assert scavenge["PreemptMode"] == "REQUEUE" and int(scavenge["GraceTime"]) > 0
    assert int(high["PriorityTier"]) > int(main["PriorityTier"]) > int(
        scavenge["PriorityTier"])
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                            check=True).stdout
    assert "preempt_send_user_signal" in config and "preempt/partition_prio" in config
    if cluster.up_seconds is not None:
        print(f"cluster up in {cluster.up_seconds:.1f} s")


def test_unknown_jobs(client):
    assert client.jobs(["999999"]) == []
    assert client.job("999999") is None
    with pytest.raises(SlurmError, match=r"`scontrol update JobId=999999 NumNodes=1` failed "
                                         r"\(exit 1\): .*Invalid job id"):
        client.resize("999999", 1)


def test_submit_step_signal_cancel(client, jobs, tmp_path):
    wait_free(client, ["n1", "n2"])
    log = tmp_path / "anchor.log"
    t0 = time.monotonic()
    job_id = client.submit(BatchSpec(script=recorder(log), name="anchor", partition="main",
                                   nodes=2, ntasks_per_node=2, gpus_per_node=2,
                                   nodelist=("n1", "n2"),
                                   output=str(tmp_path / "%j.out")))
    jobs.append(job_id)
    job = wait_for(running(client, job_id), "anchor RUNNING", timeout=30, interval=0.05)
    started_s = time.monotonic() - t0
    assert job.partition == "main" and job.nodes == ("n1", "n2") and job.num_nodes == 2
    assert job.batch_host == "n1"
    detail = client.job(job_id)
    assert detail.state is SlurmJobState.RUNNING and detail.restarts == 0
    assert detail.preempt_time is None and detail.batch_host == "n1"
    wait_for(lambda: any(w.startswith("START") for _, w in events(log)), "batch script up")

    # A step into the running allocation, one task per node, each seeing its node's GPUs.
    step = commands.srun(StepSpec(job_id=job_id, nodes=2, ntasks=2, argv=[
        "/bin/sh", "-c", 'echo "$SLURMD_NODENAME $SLURM_JOB_ID $CUDA_VISIBLE_DEVICES"']))
    t1 = time.monotonic()
    res = SlurmRunner(timeout=60).run(step, env=commands.step_environment(os.environ))
    step_s = time.monotonic() - t1
    lines = sorted(res.stdout.split("\n")[:-1])
    assert lines == [f"n1 {job_id} 0,1", f"n2 {job_id} 0,1"], res

    # One GPU per task: each task sees its own device.
    step = commands.srun(StepSpec(job_id=job_id, nodes=1, ntasks=2, gpus_per_task=1,
                                  nodelist=("n2",), argv=[
                                      "/bin/sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"']))
    res = SlurmRunner(timeout=60).run(step, env=commands.step_environment(os.environ))
    assert sorted(res.stdout.split()) == ["0", "1"], res

    # A signal to the batch shell only.
    client.signal(job_id, "USR1", batch=True)
    wait_for(lambda: "SIGUSR1" in [w for _, w in events(log)], "USR1 in the batch script")

    client.cancel(job_id)
    done = wait_for(lambda: [j for j in client.jobs([job_id]) if j.state.finished],
                    "anchor cancelled", timeout=30)
    assert done[0].state is SlurmJobState.CANCELLED
    assert "SIGTERM" in [w for _, w in events(log)]
    print(f"submit -> RUNNING {started_s:.2f} s, 2-node srun step {step_s:.2f} s")


def test_preemption_signal_inside_grace(client, jobs, tmp_path):
    wait_free(client, ["n4"])
    grace = int(partition("scavenge")["GraceTime"])
    log = tmp_path / "member.log"
    member = client.submit(BatchSpec(script=recorder(log), name="member", partition="scavenge",
                                   nodes=1, exclusive=True, nodelist=("n4",),
                                   signal="USR2@600", signal_batch_only=True,
                                   output=str(tmp_path / "%j.out")))
    jobs.append(member)
    wait_for(running(client, member), "member RUNNING")
    wait_for(lambda: any(w.startswith("START") for _, w in events(log)), "member script up")

    t_submit = time.time()
    preemptor = client.submit(BatchSpec(script="#!/bin/sh\nsleep 600\n", name="preemptor",
                                      partition="high", nodes=1, exclusive=True,
                                      nodelist=("n4",), output=str(tmp_path / "%j.out")))
    jobs.append(preemptor)
    t_sig = wait_for(lambda: next((t for t, w in events(log) if w == "SIGUSR2"), None),
                     "SIGUSR2 in the member's batch script", timeout=grace)
    signal_s = t_sig - t_submit
    # Inside the grace: still RUNNING, marked for preemption, preemptor waiting.
    job = client.job(member)
    assert job.state is SlurmJobState.RUNNING and job.preempt_time is not None, job
    (pre,) = client.jobs([preemptor])
    assert pre.state is SlurmJobState.PENDING, pre

    # Grace over: the member gets SIGTERM, is requeued; the preemptor runs on its node.
    limit = grace + 35 + 30
    requeued = wait_for(lambda: (lambda j: j if j and j.restarts else None)(client.job(member)),
                        "member requeued", timeout=limit, interval=0.5)
    assert requeued.state in (SlurmJobState.PENDING, SlurmJobState.REQUEUED,
                              SlurmJobState.ENDING), requeued
    # the batch shell's trap writes its line as the job ends: it may trail the requeue count
    t_term = wait_for(lambda: next((t for t, w in events(log) if w == "SIGTERM"), None),
                      "SIGTERM in the member's batch script", timeout=15)
    assert t_term - t_sig >= grace - 1, (t_sig, t_term, grace)
    pre = wait_for(running(client, preemptor), "preemptor RUNNING", timeout=30)
    assert pre.nodes == ("n4",)
    print(f"GraceTime {grace} s: USR2 {signal_s:.2f} s after the preemptor's submission, "
          f"SIGTERM {t_term - t_sig:.1f} s after USR2")


def test_node_down_requeues_and_resume(client, jobs, tmp_path):
    wait_free(client, ["n3"])
    victim = client.submit(BatchSpec(script="#!/bin/sh\nsleep 600\n", name="victim", nodes=1,
                                   nodelist=("n3",), output=str(tmp_path / "%j.out")))
    jobs.append(victim)
    wait_for(running(client, victim), "victim RUNNING")
    try:
        client.set_node_state(["n3"], NodeAdminState.DOWN, "slurm-etc test: node lost")
        (n3,) = client.nodes(["n3"])
        assert n3.state is NodeState.DOWN and not n3.usable
        assert n3.reason == "slurm-etc test: node lost"
        job = wait_for(lambda: (lambda j: j if j and j.restarts else None)(client.job(victim)),
                       "victim requeued", timeout=30)
        assert job.state in (SlurmJobState.PENDING, SlurmJobState.REQUEUED,
                             SlurmJobState.ENDING), job
    finally:
        client.set_node_state(["n3"], NodeAdminState.RESUME)
    t0 = time.monotonic()
    n3 = wait_for(
        lambda: (lambda n: n if n.usable and n.reason is None else None)(client.nodes(["n3"])[0]),
        "n3 back in service", timeout=60)
    assert n3.state in (NodeState.IDLE, NodeState.MIXED, NodeState.ALLOCATED,
                        NodeState.COMPLETING)
    print(f"n3 usable {time.monotonic() - t0:.2f} s after RESUME")


def test_shrink_twice(client, jobs, tmp_path):
    wait_free(client, ["n1", "n2", "n3"])
    job_id = client.submit(BatchSpec(script="#!/bin/sh\nsleep 600\n", name="shrink", nodes=3,
                                   gpus_per_node=2, nodelist=("n1", "n2", "n3"),
                                   output=str(tmp_path / "%j.out")))
    jobs.append(job_id)
    job = wait_for(running(client, job_id), "3-node job RUNNING")
    assert job.nodes == ("n1", "n2", "n3")
    client.resize(job_id, 2)
    job = client.job(job_id)
    assert job.num_nodes == 2 and len(job.nodes) == 2 and job.batch_host in job.nodes, job
    # A second resize of the same job (on 22.05 this needs slurmdbd: without it the job's
    # "DB index is being set" and every later update fails).
    client.resize(job_id, 1)
    job = client.job(job_id)
    assert job.num_nodes == 1 and job.nodes == (job.batch_host,), job
    assert job.state is SlurmJobState.RUNNING
    released = sorted({"n1", "n2", "n3"} - set(job.nodes))
    wait_free(client, released, timeout=30)
    assert all(n.gpus_used == 0 for n in client.nodes(released))
