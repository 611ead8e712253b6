"""The scripted local cluster outlives its coordinator (issue #43): its state, kept in a file
beside the job's record, is taken up by a coordinator restarted on the job, so what was
granted before the kill is held again and the workers on it can be adopted (the whole path,
real training grown and restarted: tests/dist/test_coordinator_restart.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator.backend import Grant, Loss, PreemptNotice, WorkerState
from slurm_etc.coordinator.processes import process_start
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.script import ScriptedResources, script_from_dict

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SCRIPT = {"nodes": 4, "gpus_per_node": 2, "initial_nodes": 1, "grant_requests": True,
          "events": [{"at_step": 5, "grant": 1}, {"at_step": 9, "preempt": 1, "grace_s": 60},
                     {"at_step": 12, "lose": 1}]}
N = {n: (Device(n, 0), Device(n, 1)) for n in ("n0", "n1", "n2", "n3")}


def _played() -> ScriptedResources:
    """Anchor n0; request grow-1 granted (n1, a1); the script's grant at step 5 (n2, a2);
    the preemption at step 9 notices n2; the loss at step 12 takes n1."""
    r = ScriptedResources(script_from_dict(SCRIPT))
    r.request("grow-1", 1)
    r.tick(0.0)
    r.on_step(5, 0.0)
    r.tick(0.0)
    r.on_step(9, 100.0)
    r.tick(100.0)
    r.on_step(12, 100.0)  # fired, not handed over (no tick, no drain)
    return r


def test_the_state_taken_up_holds_what_was_held_and_announces_it_again() -> None:
    before = _played()
    kept = json.loads(json.dumps(before.state()))  # what the file holds
    before.drain()
    after = ScriptedResources(script_from_dict(SCRIPT))
    after.drain()  # the fresh anchor's grant: replaced
    after.resume(kept)
    assert after.held == before.held == {**dict.fromkeys(N["n0"], "a0"),
                                         **dict.fromkeys(N["n2"], "a2")}
    assert (after.noticed, after.gone, after.unfired) == \
        (before.noticed, before.gone, before.unfired)
    assert after.unfired == ()
    assert after.drain() == [Grant("a0", N["n0"]), Grant("a2", N["n2"], None),
                             PreemptNotice("a2", N["n2"], 160.0),
                             Loss("a1", N["n1"], "failure")]  # fired, never handed over
    # the script goes on from there: no event fires again, a request seen is not asked twice,
    # and the next allocation gets a new name
    after.on_step(30, 150.0)
    after.request("grow-1", 1)
    after.tick(150.0)
    assert after.drain() == []
    after.request("grow-2", 1)
    after.tick(150.0)
    assert after.drain() == [Grant("a3", N["n3"], "grow-2")]


def test_a_state_of_another_script_or_malformed_is_refused_and_changes_nothing() -> None:
    kept = _played().state()
    other = ScriptedResources(script_from_dict({**SCRIPT, "nodes": 5}))
    with pytest.raises(ValueError, match="another events script"):
        other.resume(kept)
    fresh = ScriptedResources(script_from_dict(SCRIPT))
    for bad in ({**kept, "owner": {"n9:0": "a0"}}, {**kept, "fired": 99},
                {**kept, "owner": {"n0": "a0"}}, {k: v for k, v in kept.items() if k != "gone"}):
        with pytest.raises(ValueError):
            fresh.resume(bad)
    assert fresh.held == dict.fromkeys(N["n0"], "a0")


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)


def test_a_restarted_backend_holds_the_grants_and_adopts_the_joiners(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The backend before the kill grew to n1 (a scripted grant) and launched a joiner there;
    the one after it, given the kept state, holds n1 and adopts that worker. Without taking
    it up (``resume=False``, or no file) it holds the anchor only and adopts nothing there."""
    script = script_from_dict({"nodes": 2, "gpus_per_node": 2, "initial_nodes": 1,
                               "events": [{"at_step": 3, "grant": 1}]})
    path = tmp_path / "job.db.cluster.json"
    first = LocalBackend(script)
    first.keep_state(path, resume=False)
    first.poll()
    first.on_step(3)
    assert [e for e in first.poll() if isinstance(e, Grant)] == [Grant("a1", N["n1"])]
    joiner = _sleeper()
    try:
        recorded = [WorkerState(2, 1, Device("n1", 0), joiner.pid,
                                start=process_start(joiner.pid))]
        again = LocalBackend(script)
        again.keep_state(path, resume=True)
        assert [e for e in again.poll() if isinstance(e, Grant)] == \
            [Grant("a0", N["n0"]), Grant("a1", N["n1"])]
        assert again.adopt(recorded) == [2]
        again.on_step(10)  # the grant does not fire again
        assert again.poll() == [] and set(again.held) == set(N["n0"] + N["n1"])

        forgot = LocalBackend(script)
        forgot.keep_state(tmp_path / "elsewhere.json", resume=True)
        assert "no cluster state kept" in caplog.text
        assert set(forgot.held) == set(N["n0"]) and forgot.adopt(recorded) == []
        forgot.keep_state(path, resume=False)  # a new job: the file is written afresh
        assert json.loads(path.read_text())["owner"] == {"n0:0": "a0", "n0:1": "a0"}
        assert path.stat().st_mode & 0o077 == 0
    finally:
        joiner.kill()
        joiner.wait()


def test_a_request_the_scripted_cluster_can_still_grant(tmp_path: Path) -> None:
    """What the coordinator's outlook asks: only where the script grants requests and the
    nodes are free (scripted grants need training steps)."""
    granting = LocalBackend(script_from_dict({**SCRIPT, "events": []}))
    granting._resources.request("grow-1", 9)  # more than the cluster has: pending
    assert not granting.request_can_be_met("grow-1")
    assert not granting.request_can_be_met("grow-7")  # not pending
    waiting = LocalBackend(script_from_dict({**SCRIPT, "grant_requests": False}))
    waiting._resources.request("grow-1", 1)
    assert not waiting.request_can_be_met("grow-1")
