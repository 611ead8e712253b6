"""SlurmBackend against a real local Slurm cluster (4 nodes x 2 fake GPUs; see conftest).

No coordinator: each test drives the backend with a small loop of its own. The anchor is a
plain ``sleep`` job in ``main`` (exclusive on n1) whose id the backend is given, as if the
test process ran in it; members go to ``scavenge``; a ``high`` job preempts them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator.backend import (
    BackendEvent,
    Grant,
    LaunchWorkers,
    Loss,
    PreemptNotice,
    ReleaseDevices,
    RequestFailed,
    RequestNodes,
    StopWorkers,
    WorkerExited,
    WorkerSpec,
)
from slurm_etc.slurm import BatchSpec, NodeAdminState, SlurmJobState
from slurm_etc.slurm.backend import SlurmBackend, member_job_name

from .test_client import partition, wait_for, wait_free

pytestmark = pytest.mark.timeout(300)

# Writes the worker's environment to <dir>/v<vrank>.json and exits with $EXIT_CODE.
DUMP_ENV = ("import json, os, sys; d = os.environ['OUT_DIR']; "
            "open(os.path.join(d, 'v' + os.environ['SLURM_ETC_VRANK'] + '.json'), 'w')"
            ".write(json.dumps(dict(os.environ))); sys.exit(int(os.environ.get('EXIT_CODE', 0)))")
# Runs until stopped; notes the signals it gets (the notice must not kill it).
SLEEPER = ("import signal, time, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "time.sleep(600)")

# The anchor's variables, as the coordinator running in the anchor's batch script has them.
ANCHOR_ENV = {"SLURM_JOB_NAME": "the-anchor", "SLURM_JOB_NODELIST": "n1",
              "SLURM_NODELIST": "n1", "SLURM_JOB_GPUS": "0,1", "SLURM_STEP_GPUS": "0,1",
              "SLURM_JOB_NUM_NODES": "1"}


class Driver:
    """The test's stand-in for the coordinator's loop: polls and keeps every event."""

    def __init__(self, backend: SlurmBackend):
        self.backend = backend
        self.events: list[tuple[float, BackendEvent]] = []

    def until(self, what: str, pick: Callable[[BackendEvent], bool], timeout: float,
              count: int = 1) -> list[tuple[float, BackendEvent]]:
        deadline = time.monotonic() + timeout
        while True:
            for e in self.backend.poll():
                self.events.append((time.time(), e))
            found = [(t, e) for t, e in self.events if pick(e)]
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout:g} s waiting for {what}; events: "
                            f"{[e for _, e in self.events]}")
            time.sleep(0.1)

    def settle(self, seconds: float) -> None:
        """Keep polling for ``seconds`` (events that should not come)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.events += [(time.time(), e) for e in self.backend.poll()]
            time.sleep(0.1)


@contextmanager
def inside_anchor(anchor: str) -> Iterator[None]:
    """os.environ as in the anchor's batch script (SLURM_JOB_ID and friends)."""
    saved = dict(os.environ)
    os.environ.update({**ANCHOR_ENV, "SLURM_JOB_ID": anchor, "SLURM_JOBID": anchor})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def backend_for(anchor: str, tmp_path: Path, **kwargs) -> SlurmBackend:
    return SlurmBackend(tmp_path / "run", anchor_job=anchor, poll_interval_s=0.5,
                        log_dir=tmp_path / "logs", **kwargs)


def test_grant_launch_stop_preempt(client, jobs, anchor, tmp_path):
    wait_free(client, ["n2", "n3", "n4"])
    # a site's or user's own srun options reach every worker step (containers: pyxis's
    # --container-image; here --export, which the workers see)
    backend = backend_for(anchor, tmp_path,
                          srun_options=("--export=ALL,SLURM_ETC_STEP_MARK=from-srun",))
    try:
        drive = Driver(backend)
        ((_, first),) = drive.until("anchor grant", lambda e: isinstance(e, Grant), 5)
        assert first == Grant(anchor, (Device("n1", 0), Device("n1", 1)), None)
        assert backend.gpus_per_node == 2

        # Request twice with one key: one member.
        t0 = time.monotonic()
        backend.request(RequestNodes(1, "grow-1"))
        backend.request(RequestNodes(1, "grow-1"))
        member = backend.members["grow-1"]
        jobs.append(member)
        assert [j.job_id for j in client.jobs(name=member_job_name(anchor))] == [member]
        ((_, grant),) = drive.until("member grant", lambda e: isinstance(e, Grant)
                                    and e.request == "grow-1", 30)
        grant_s = time.monotonic() - t0
        assert grant.allocation == member and len(grant.devices) == 2
        (node,) = grant.nodes
        assert node != "n1"

        # Workers on the anchor and the member, launched from "inside" the anchor.
        out = tmp_path / "env"
        out.mkdir()
        specs = (WorkerSpec(0, Device("n1", 1)), WorkerSpec(1, Device(node, 0)),
                 WorkerSpec(2, Device(node, 1), {"EXIT_CODE": "3"}))
        t1 = time.monotonic()
        with inside_anchor(anchor):
            backend.launch(LaunchWorkers(1, specs, (sys.executable, "-c", DUMP_ENV),
                                         {"OUT_DIR": str(out), "SLURM_ETC_JOB": "j1"}))
        exits = drive.until("3 worker exits", lambda e: isinstance(e, WorkerExited), 60,
                            count=3)
        launch_s = time.monotonic() - t1
        codes = {e.vrank: (e.returncode, e.stopped, e.generation) for _, e in exits}
        assert codes == {0: (0, False, 1), 1: (0, False, 1), 2: (3, False, 1)}
        envs = {v: json.loads((out / f"v{v}.json").read_text()) for v in (0, 1, 2)}
        for v, spec in enumerate(specs):
            env = envs[v]
            alloc = anchor if v == 0 else member
            assert env["SLURM_JOB_ID"] == alloc and env["SLURM_JOB_NODELIST"] == spec.device.node
            assert env["SLURMD_NODENAME"] == spec.device.node
            assert env.get("SLURM_JOB_NAME") != "the-anchor"
            assert env["CUDA_VISIBLE_DEVICES"] == str(spec.device.local)
            assert env["SLURM_ETC_VRANK"] == str(v) and env["SLURM_ETC_GENERATION"] == "1"
            assert env["SLURM_ETC_DEVICE"] == str(spec.device)
            assert env["SLURM_ETC_JOB"] == "j1" and env["OUT_DIR"] == str(out)
            assert env["SLURM_ETC_STEP_MARK"] == "from-srun"  # the extra srun option
        assert "SLURM_CONF" in envs[1]

        # Long-running workers; stopping one leaves the other running.
        backend.launch(LaunchWorkers(2, specs[1:], (sys.executable, "-c", SLEEPER)))
        wait_for(lambda: (tmp_path / "logs" / f"gen2-{node}-{member}.log").exists(), "step log")
        time.sleep(1.0)  # let the wrappers start their workers
        backend.stop(StopWorkers((1,), grace_s=10))
        ((_, stopped),) = drive.until("vrank 1 stopped", lambda e: isinstance(e, WorkerExited)
                                      and e.generation == 2, 30)
        assert (stopped.vrank, stopped.returncode, stopped.stopped) == (1, -15, True)
        assert backend.workers()[2].running

        # A high-priority job takes the member's node: notice within seconds, loss after the
        # grace; the worker survives the notice.
        grace = int(partition("scavenge")["GraceTime"])
        t_submit = time.time()
        pre = client.submit(BatchSpec(script="#!/bin/sh\nsleep 600\n", name="preemptor",
                                    partition="high", nodes=1, exclusive=True,
                                    nodelist=(node,), output=str(tmp_path / "pre-%j.out")))
        jobs.append(pre)
        ((t_notice, notice),) = drive.until("notice", lambda e: isinstance(e, PreemptNotice),
                                            grace)
        assert notice.allocation == member and set(notice.devices) == set(grant.devices)
        assert t_submit < notice.deadline <= t_notice + grace
        assert backend.workers()[2].running
        assert (tmp_path / "run" / "notices").iterdir()  # the member's batch shell wrote it
        ((t_loss, loss),) = drive.until("loss", lambda e: isinstance(e, Loss), grace + 60)
        assert loss == Loss(member, grant.devices, "preempted")
        ((_, gone),) = drive.until("vrank 2 ends", lambda e: isinstance(e, WorkerExited)
                                   and e.vrank == 2 and e.generation == 2, 45)
        assert gone.stopped
        assert not any(d.node == node for d in backend.held)
        print(f"\nmember grant {grant_s:.2f} s after the request; 3 workers on 2 nodes ran "
              f"and exited in {launch_s:.2f} s; notice {t_notice - t_submit:.2f} s after the "
              f"preemptor's submission (deadline +{notice.deadline - t_notice:.1f} s); loss "
              f"{t_loss - t_notice:.1f} s after the notice (GraceTime {grace} s)")
    finally:
        backend.close()
    (job,) = client.jobs([member])
    assert job.state.finished or job.state in (SlurmJobState.ENDING, SlurmJobState.PENDING), job


def test_shrink_node_down_release_recover(client, jobs, anchor, tmp_path):
    wait_free(client, ["n2", "n3", "n4"])
    backend = backend_for(anchor, tmp_path)
    down: list[str] = []
    try:
        drive = Driver(backend)
        backend.request(RequestNodes(2, "two"))
        jobs.append(backend.members["two"])
        ((_, grant),) = drive.until("2-node grant", lambda e: isinstance(e, Grant)
                                    and e.request == "two", 30)
        first, last = grant.nodes
        # The anchor is never released; one device of a node is kept (nothing to free).
        backend.release(ReleaseDevices((Device("n1", 0), Device(first, 0))))
        assert Device("n1", 0) in backend.held and Device(first, 0) not in backend.held
        assert client.job(grant.allocation).num_nodes == 2
        # The member's last node as a whole: scontrol update NumNodes=1.
        backend.release(ReleaseDevices((Device(last, 0), Device(last, 1))))
        job = client.job(grant.allocation)
        assert job.num_nodes == 1 and job.nodes == (first,), job

        # Its remaining node goes DOWN: a loss at the next query.
        t0 = time.monotonic()
        client.set_node_state([first], NodeAdminState.DOWN, "slurm-etc test: node lost")
        down.append(first)
        ((_, loss),) = drive.until("loss", lambda e: isinstance(e, Loss), 10)
        loss_s = time.monotonic() - t0
        assert loss == Loss(grant.allocation, (Device(first, 1),), "failure")
        # Slurm SIGTERMs the member's batch shell too (its notice file appears): the loss
        # comes alone, no preemption notice before or after it.
        drive.settle(4.0)
        assert not [e for _, e in drive.events if isinstance(e, PreemptNotice)], drive.events

        # A member found again by a restarted coordinator (its key in --comment).
        backend.request(RequestNodes(1, "again"))
        again = backend.members["again"]
        jobs.append(again)
        drive.until("grant", lambda e: isinstance(e, Grant) and e.request == "again", 30)
        second = backend_for(anchor, tmp_path)
        try:
            assert second.members == {"again": again}
            drive2 = Driver(second)
            grants = drive2.until("recovered grant", lambda e: isinstance(e, Grant), 10,
                                  count=2)
            ((_, regrant),) = [(t, e) for t, e in grants if e.request == "again"]
            assert regrant.allocation == again
            second.request(RequestNodes(1, "again"))  # known key: nothing submitted
            assert len(client.jobs(name=member_job_name(anchor))) == 1
            # Released as a whole: scancel.
            second.release(ReleaseDevices(regrant.devices))
            wait_for(lambda: all(j.state is not SlurmJobState.RUNNING
                                 for j in client.jobs([again])), "member cancelled", 30)
        finally:
            second.close()
        print(f"\nnode DOWN -> Loss in {loss_s:.2f} s (poll interval 0.5 s)")
    finally:
        backend.close()
        if down:
            client.set_node_state(down, NodeAdminState.RESUME)
            # Back in service (responding, no reason) before the next test uses it.
            wait_for(lambda: all(n.usable and n.reason is None for n in client.nodes(down)),
                     f"{down} back in service", timeout=60)
    members = list(backend.members.values())
    assert all(j.state is not SlurmJobState.RUNNING for j in client.jobs(members))


def test_bad_anchor_and_member_watch(client, tmp_path, monkeypatch):
    from slurm_etc.coordinator.backend import BackendError

    with pytest.raises(BackendError, match="anchor job 999999 is not running"):
        SlurmBackend(tmp_path, anchor_job="999999")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(BackendError, match="SLURM_JOB_ID is not set"):
        SlurmBackend(tmp_path)
    with pytest.raises(BackendError, match="SLURM_JOB_ID is not set"):
        SlurmBackend.from_environment()
    # A member whose anchor is gone ends by itself (its coordinator died without scancel).
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "slurm_etc.slurm.member", "--run-dir",
                          str(tmp_path), "--anchor", "999999", "--anchor-check-s", "0.2"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "anchor job 999999 ended" in res.stdout, res
    assert time.monotonic() - t0 < 20


def test_from_environment_and_topology(client, anchor, tmp_path, monkeypatch):
    from slurm_etc.policy.rules import EffectivePolicy

    monkeypatch.setenv("SLURM_JOB_ID", anchor)
    monkeypatch.setenv("SLURM_ETC_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("SLURM_ETC_MEMBER_PARTITION", "scavenge")
    backend = SlurmBackend.from_environment(
        "my-job", EffectivePolicy(grow_qos="normal", preempt_grace_s=90))
    try:
        assert backend.anchor_job == anchor and backend.member_partition == "scavenge"
        assert backend.member_qos == "normal" and backend.signal_lead_s == 90
        assert backend.log_dir == tmp_path / "run" / "logs"
        topo = backend.topology
        assert topo.gpus_per_node == 2 and topo.nodes[:4] == ("n1", "n2", "n3", "n4")
        policy = EffectivePolicy(grow_partition="high")
        assert SlurmBackend.from_environment(None, policy).member_partition == "high"
    finally:
        backend.close()


def test_elastic_sbatch_end_to_end(client, jobs, tmp_path):
    """scripts/elastic.sbatch as users submit it: the coordinator in the anchor grows the job
    with a member and runs workers in it (protocol-speaking stand-ins, bench/fake_worker.py);
    cancelling the anchor leaves no member behind."""
    repo = Path(__file__).resolve().parents[2]
    wait_free(client, ["n1", "n2", "n3", "n4"])
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "TRAIN_CMD": f"{sys.executable} {repo / 'bench' / 'fake_worker.py'}",
           "MODEL": "llama-7b", "GLOBAL_BATCH": "64", "STATE_DIR": str(tmp_path / "state")}
    res = subprocess.run(["sbatch", "--parsable", "--nodelist=n1",
                          str(repo / "scripts" / "elastic.sbatch")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True)
    anchor = res.stdout.strip()
    jobs.append(anchor)
    name = member_job_name(anchor)
    try:
        member = wait_for(lambda: [j for j in client.jobs(name=name)
                                   if j.state is SlurmJobState.RUNNING], "a running member", 60)[0]
        jobs.append(member.job_id)
        logs = tmp_path / ".slurm-etc" / anchor / "logs"
        wait_for(lambda: list(logs.glob(f"gen*-*-{member.job_id}.log")),
                 "workers launched into the member", 60)
    finally:
        client.cancel(anchor)
    # The coordinator (and after it the anchor's shell) cancels every member, running or
    # pending; a member asked until Slurm says it is cancelled ends at once.
    out_file = tmp_path / f"slurm-etc-{anchor}.out"

    def members_left():
        left = client.jobs(name=name)
        outs = {p.name: p.read_text()[-1500:] for p in (tmp_path / ".slurm-etc" / anchor)
                .glob("member-*.out")}
        return [(j.job_id, j.slurm_state) for j in left], out_file.read_text()[-3000:], outs

    deadline = time.monotonic() + 60
    while client.jobs(name=name) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not client.jobs(name=name), members_left()
    out = out_file.read_text()
    assert f"[slurm] request grow-1: member job {member.job_id}" in out, out[-2000:]
    assert f"[slurm] closing: cancelled member {member.job_id}" in out, out[-2000:]


def test_member_cancelled_while_pending_fails_its_request(client, jobs, anchor, tmp_path):
    """A member that never ran (here: 4 nodes asked, n1 is the anchor's; scancel'ed while
    PENDING) ends its request with RequestFailed, no loss, and a new request submits anew."""
    backend = backend_for(anchor, tmp_path)
    try:
        drive = Driver(backend)
        backend.request(RequestNodes(4, "too-many"))
        member = backend.members["too-many"]
        jobs.append(member)
        wait_for(lambda: [j for j in client.jobs([member]) if j.state is SlurmJobState.PENDING],
                 "member PENDING", 30)
        drive.settle(1.0)
        client.cancel(member)
        ((_, failed),) = drive.until("request failed", lambda e: isinstance(e, RequestFailed),
                                     15)
        assert failed == RequestFailed("too-many", member, failed.reason), failed
        assert failed.reason.startswith("CANCEL") or failed.reason == "gone", failed
        assert not [e for _, e in drive.events if isinstance(e, (Loss, PreemptNotice))
                    or (isinstance(e, Grant) and e.request)], drive.events
    finally:
        backend.close()


def test_vrank_moved_while_its_old_worker_is_killed(client, jobs, anchor, tmp_path):
    """A migration off a released member hands the leaving worker's vrank to a device of
    the anchor: the launch waits for the killed worker to end instead of refusing (the real
    training test's shrink-then-grow hit this), and the new worker runs."""
    wait_free(client, ["n2", "n3", "n4"])
    backend = backend_for(anchor, tmp_path)
    try:
        drive = Driver(backend)
        backend.request(RequestNodes(1, "grow-1"))
        jobs.append(backend.members["grow-1"])
        ((_, grant),) = drive.until("member grant", lambda e: isinstance(e, Grant)
                                    and e.request == "grow-1", 30)
        old = grant.devices[0]
        with inside_anchor(anchor):
            backend.launch(LaunchWorkers(1, (WorkerSpec(7, old),), (sys.executable, "-c",
                                                                     SLEEPER)))
            time.sleep(3.0)  # running, not starting
            assert backend.workers()[7].running
            # releasing the device kills vrank 7 there (over its task wrapper; the member
            # keeps the node: one GPU of it frees nothing in Slurm)
            backend.release(ReleaseDevices((old,)))
            backend.launch(LaunchWorkers(2, (WorkerSpec(7, Device("n1", 0)),),
                                         (sys.executable, "-c", SLEEPER)))
        now = backend.workers()[7]
        assert now.device == Device("n1", 0) and now.generation == 2 and now.running, now
        drive.until("the old worker's exit", lambda e: isinstance(e, WorkerExited)
                    and e.generation == 1 and e.stopped, 10)
        backend.stop(StopWorkers((7,), grace_s=5))
        drive.until("the new worker's exit", lambda e: isinstance(e, WorkerExited)
                    and e.generation == 2, 30)
    finally:
        backend.close()
