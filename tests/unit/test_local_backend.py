"""Local backend: the events script (parsing, one-line errors, events at the right steps,
deadlines, requests, releases) and real worker processes (launch, environment, stop, kill on
loss, release and close)."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator.backend import (
    Backend,
    BackendError,
    BackendEvent,
    EndTraining,
    Grant,
    LaunchWorkers,
    Loss,
    PreemptNotice,
    ReleaseDevices,
    RequestNodes,
    StopWorkers,
    WorkerExited,
    WorkerSpec,
    perform,
)
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.script import (
    ScriptedResources,
    ScriptError,
    load_script,
    parse_script,
    script_from_options,
)
from slurm_etc.protocol import env as envvars

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

EXAMPLE = {"nodes": 4, "gpus_per_node": 2, "initial_nodes": 1,
           "events": [{"at_step": 5, "grant": 2},
                      {"at_step": 12, "preempt": 1, "grace_s": 10},
                      {"at_step": 18, "lose": 1}]}
SLEEP = (sys.executable, "-c", "import time; time.sleep(60)")


def d(name: str) -> Device:
    node, _, local = name.partition(":")
    return Device(node, int(local))


def devs(*names: str) -> tuple[Device, ...]:
    return tuple(d(n) for n in names)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- parsing


def test_example_script_parses(tmp_path: Path) -> None:
    path = tmp_path / "events.json"
    path.write_text(json.dumps(EXAMPLE))
    script = load_script(path)
    assert script.source == "events.json"
    assert script.topology.nodes == ("n0", "n1", "n2", "n3")
    assert script.anchor_devices == devs("n0:0", "n0:1")
    assert [(e.index, e.at_step, e.kind, e.count, e.grace_s) for e in script.events] == [
        (1, 5, "grant", 2, 30.0), (2, 12, "preempt", 1, 10.0), (3, 18, "lose", 1, 30.0)]
    named = parse_script(json.dumps({"nodes": 2, "gpus_per_node": 2, "events": [
        {"at_step": 1, "grant": ["n1:1", "n1:0"]}, {"at_step": 2, "lose": "n1:0"}]}))
    assert named.events[0].devices == devs("n1:0", "n1:1")
    assert named.events[1].devices == devs("n1:0")
    assert script_from_options(4, 2, 1, EXAMPLE["events"]) == \
        parse_script(json.dumps(EXAMPLE), "<options>")


@pytest.mark.parametrize("script, error", [
    ({"nodes": 4, "events": [{"at_step": 1, "grant": 1}, {"at_step": 2, "grant": 1},
                             {"at_step": 3, "lose": ["n7"]}]},
     "events.json: event 3: node n7 does not exist (nodes: n0..n3)"),
    ({"nodes": 4, "gpus_per_node": 2, "events": [{"at_step": 3, "lose": ["n1:5"]}]},
     "events.json: event 1: device n1:5 does not exist (n1 has devices n1:0..n1:1)"),
    ({"nodes": 4, "events": [{"at_step": 3, "grnat": 2}]},
     "events.json: event 1: object contains unknown field `grnat` (fields: at_step, grant, "
     "preempt, lose, grace_s, reason)"),
    ({"nodes": 4, "events": [{"at_step": 3, "grant": 0}]},
     "events.json: event 1: grant: expected `int` >= 1"),
    ({"nodes": 4, "events": [{"at_step": -1, "grant": 1}]},
     "events.json: event 1: at_step: expected `int` >= 0"),
    ({"nodes": 4, "events": [{"at_step": 3}]},
     "events.json: event 1: give exactly one of grant, preempt, lose (got none)"),
    ({"nodes": 4, "events": [{"at_step": 3, "grant": 1, "lose": 1}]},
     "events.json: event 1: give exactly one of grant, preempt, lose (got grant, lose)"),
    ({"nodes": 4, "events": [{"at_step": 3, "grant": 4}]},
     "events.json: event 1: grant 4 node(s), but only 3 are free then (n1, n2, n3)"),
    ({"nodes": 4, "events": [{"at_step": 3, "preempt": 1}]},
     "events.json: event 1: preempt 1 node(s), but the job holds only 0 node(s) outside "
     "the anchor then"),
    ({"nodes": 4, "events": [{"at_step": 3, "preempt": "n0"}]},
     "events.json: event 1: n0 belongs to the anchor allocation (initial_nodes=1), which "
     "runs the coordinator and is never preempted or lost"),
    ({"nodes": 4, "events": [{"at_step": 3, "grant": 1, "grace_s": 3}]},
     "events.json: event 1: grace_s applies only to preempt"),
    ({"nodes": 4, "events": [{"at_step": 3, "grant": 1}, {"at_step": 2, "grant": 1}]},
     "events.json: event 2: at_step 2 comes before event 1's at_step 3; list events in "
     "step order"),
    ({"nodes": 4, "evnts": []},
     "events.json: object contains unknown field `evnts` (fields: nodes, gpus_per_node, "
     "initial_nodes, grace_s, grant_requests, settled_steps, end_step, events)"),
    ({"nodes": 0}, "events.json: nodes: expected `int` >= 1"),
    ({"gpus_per_node": 2}, "events.json: object missing required field `nodes`"),
    ({"nodes": 2, "initial_nodes": 3}, "events.json: initial_nodes (3) exceeds nodes (2)"),
    ({"nodes": 4, "events": {}}, "events.json: events: expected `array`, got `object`"),
    ([], "events.json: expected `object`, got `array`"),
    ({"nodes": 4, "events": [{"at_step": 3, "lose": []}]},
     "events.json: event 1: lose names no nodes or devices"),
    ({"nodes": 4, "events": [{"at_step": 3, "lose": "n2"}, {"at_step": 3, "lose": "n2"}]},
     "events.json: event 2: n2:0 is already gone (failure)"),
    ({"nodes": 4, "events": [{"at_step": 3, "grant": ["n0"]}]},
     "events.json: event 1: n0:0 is not free then (held by the job in allocation a0)"),
    ({"nodes": 3, "events": [{"at_step": 1, "grant": 2}, {"at_step": 2, "preempt": 2},
                             {"at_step": 3, "grant": 1}]},
     "events.json: event 3: grant 1 node(s), but only 0 are free then"),
])
def test_bad_scripts_fail_with_one_line(script: object, error: str) -> None:
    with pytest.raises(ScriptError) as e:
        parse_script(json.dumps(script), "events.json")
    assert str(e.value) == error
    assert "\n" not in str(e.value)


def test_unparsable_and_unreadable_files(tmp_path: Path) -> None:
    bad = tmp_path / "events.json"
    bad.write_text('{"nodes": 4,\n "events": [')
    with pytest.raises(ScriptError, match=r"^events.json: not valid JSON: ") as e:
        load_script(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(ScriptError, match=r"^missing.json: cannot read"):
        load_script(tmp_path / "missing.json")


def test_yaml_scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "events.yaml"
    path.write_text("nodes: 2\nevents:\n  - {at_step: 1, grant: 1}\n")
    assert load_script(path).events[0].count == 1  # PyYAML is in the test extra
    # without PyYAML (an install without the yaml extra): one line saying what to do
    real = importlib.import_module

    def without_yaml(name: str, *args: object) -> object:
        if name == "yaml":
            raise ModuleNotFoundError("No module named 'yaml'")
        return real(name, *args)
    monkeypatch.setattr(importlib, "import_module", without_yaml)
    with pytest.raises(ScriptError, match="events.yaml: YAML scripts need PyYAML"):
        load_script(path)


# --------------------------------------------------------------------------- pure state


def test_events_fire_once_at_their_steps() -> None:
    r = ScriptedResources(parse_script(json.dumps(EXAMPLE)))
    assert r.drain() == [Grant("a0", devs("n0:0", "n0:1"))]
    r.on_step(4, now=0)
    assert r.drain() == []
    r.on_step(5, now=0)
    assert r.drain() == [Grant("a1", devs("n1:0", "n1:1", "n2:0", "n2:1"))]
    r.on_step(5, now=0)
    r.on_step(3, now=0)  # steps going back change nothing
    assert r.drain() == []
    r.tick(0)  # the grant was handed over
    r.on_step(30, now=100.0)  # skipped steps: the earliest due group fires ...
    assert r.drain() == [PreemptNotice("a1", devs("n2:0", "n2:1"), 110.0)]
    r.on_step(30, now=100.0)  # ... and the next waits until it was handed over (a poll)
    assert r.drain() == []
    r.tick(100.0)
    r.on_step(30, now=100.0)
    assert r.drain() == [Loss("a1", devs("n1:0", "n1:1"), "failure")]
    r.tick(109.9)
    assert r.drain() == []
    r.tick(110.0)
    assert r.drain() == [Loss("a1", devs("n2:0", "n2:1"), "preempted")]
    assert set(r.held) == set(devs("n0:0", "n0:1"))
    assert r.free_nodes() == ["n3"]


def test_groups_fire_one_at_a_time_each_after_the_one_before_was_polled() -> None:
    """The flake this fixes: a grant and a preemption due at once (a resize was in flight
    while the job passed both steps) fired in one poll, and the coordinator made one resize
    of two (fewer generations). Now each group fires alone, in script order, and only
    after the one before was handed over; events with one at_step fire together."""
    script = parse_script(json.dumps({"nodes": 4, "events": [
        {"at_step": 2, "grant": ["n1"]}, {"at_step": 4, "preempt": ["n1"], "grace_s": 5},
        {"at_step": 6, "grant": ["n2"]}, {"at_step": 6, "grant": ["n3"]},
        {"at_step": 8, "lose": ["n2"]}]}))
    r = ScriptedResources(script)
    r.drain()
    seen = []
    for step in (2, 3, 20, 20, 20, 20, 20):  # step 20 reported again: every group is due
        r.on_step(step, now=0)
        r.on_step(step, now=0)  # reported twice before a poll: nothing more fires
        seen.append([type(e).__name__ + ":" + e.allocation for e in r.drain()])
        r.tick(0)
    assert seen == [["Grant:a1"], [], ["PreemptNotice:a1"], ["Grant:a2", "Grant:a3"],
                    ["Loss:a2"], [], []]


def test_release_before_the_deadline_hands_devices_back() -> None:
    r = ScriptedResources(parse_script(json.dumps(EXAMPLE)))
    r.on_step(12, now=0)
    r.tick(0)
    r.on_step(12, now=0)
    r.drain()
    assert r.release(devs("n2:0", "n2:1", "n3:0")) == list(devs("n2:0", "n2:1"))
    r.tick(1e9)
    assert r.drain() == []                      # no loss: they were given back in time
    assert d("n2:0") in r.gone                 # ... to the preemptor
    assert r.release(devs("n1:0")) == list(devs("n1:0"))
    assert "n1" not in r.free_nodes()          # n1:1 still held
    r.release(devs("n1:1"))
    assert r.free_nodes() == ["n1", "n3"]


def test_grants_satisfy_requests() -> None:
    script = parse_script(json.dumps({"nodes": 4, "events": [{"at_step": 2, "grant": 1}]}))
    r = ScriptedResources(script)
    r.drain()
    r.request("grow-1", 2)
    r.request("grow-1", 2)  # the same request again
    r.tick(0)
    assert r.drain() == []  # requests wait for scripted grants by default
    r.on_step(2, now=0)
    assert r.drain() == [Grant("a1", devs("n1:0"), "grow-1")]
    assert r.pending_requests == ()

    auto = parse_script(json.dumps({"nodes": 4, "grant_requests": True}))
    r = ScriptedResources(auto)
    r.drain()
    r.request("a", 2)
    r.request("b", 2)   # only one node left after "a": waits
    r.tick(0)
    assert r.drain() == [Grant("a1", devs("n1:0", "n2:0"), "a")]
    assert r.pending_requests == (("b", 2),)
    r.release(devs("n1:0"))
    r.tick(0)
    assert r.drain() == [Grant("a2", devs("n1:0", "n3:0"), "b")]


def test_runtime_shortfall_does_what_it_can(caplog: pytest.LogCaptureFixture) -> None:
    script = parse_script(json.dumps({"nodes": 3, "grant_requests": True,
                                      "events": [{"at_step": 1, "grant": 2}]}))
    r = ScriptedResources(script)
    r.request("mine", 1)
    r.tick(0)
    r.drain()
    r.on_step(1, now=0)  # the coordinator's request took one of the two scripted nodes
    assert r.drain() == [Grant("a2", devs("n2:0"))]
    assert "only 1 is free" in caplog.text


def test_preempt_by_count_takes_newest_allocation_first() -> None:
    script = parse_script(json.dumps({"nodes": 5, "events": [
        {"at_step": 1, "grant": 2}, {"at_step": 2, "grant": ["n4"]},
        {"at_step": 3, "preempt": 2}]}))
    r = ScriptedResources(script)
    for _ in range(3):
        r.on_step(3, now=0)
        r.tick(0)
    assert r.drain()[-2:] == [PreemptNotice("a1", devs("n2:0"), 30.0),
                              PreemptNotice("a2", devs("n4:0"), 30.0)]


# --------------------------------------------------------------------------- processes


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def backend(clock: FakeClock, tmp_path: Path) -> Iterator[LocalBackend]:
    b = LocalBackend(parse_script(json.dumps(EXAMPLE)), log_dir=tmp_path / "logs", clock=clock)
    try:
        yield b
    finally:
        b.close()


def wait_for(backend: LocalBackend, done: Callable[[list[BackendEvent]], bool],
             timeout_s: float = 20.0) -> list[BackendEvent]:
    events: list[BackendEvent] = []
    deadline = time.monotonic() + timeout_s
    while not done(events):
        assert time.monotonic() < deadline, f"timed out; events so far: {events}"
        events += backend.poll()
        time.sleep(0.02)
    return events


def exits(events: list[BackendEvent]) -> list[WorkerExited]:
    return [e for e in events if isinstance(e, WorkerExited)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_local_backend_is_a_backend(backend: LocalBackend) -> None:
    b: Backend = backend  # the coordinator's loop sees only the protocol
    assert b.poll() == [Grant("a0", devs("n0:0", "n0:1"))]


def test_launch_sets_the_environment_and_logs(backend: LocalBackend, tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    code = ("import json, os, sys; json.dump({k: v for k, v in os.environ.items() "
            "if k.startswith('SLURM_ETC_') or k == 'EXTRA'}, open(sys.argv[1], 'w')); "
            "print('hello from the worker')")
    backend.launch(LaunchWorkers(3, (WorkerSpec(7, d("n0:1"), {"EXTRA": "x"}),),
                                 (sys.executable, "-c", code, str(out)),
                                 {envvars.COORDINATOR: "tcp://127.0.0.1:1"}))
    events = wait_for(backend, lambda ev: bool(exits(ev)))
    assert exits(events) == [WorkerExited(7, 3, d("n0:1"), 0, False)]
    assert json.loads(out.read_text()) == {
        envvars.VRANK: "7", envvars.GENERATION: "3", envvars.NODE: "n0",
        envvars.LOCAL_INDEX: "1", envvars.DEVICE: "n0:1",
        envvars.COORDINATOR: "tcp://127.0.0.1:1", "EXTRA": "x"}
    assert (tmp_path / "logs" / "gen3-vrank7.log").read_text() == "hello from the worker\n"
    assert backend.workers()[7].returncode == 0


def test_stop_terminates_then_kills(backend: LocalBackend, clock: FakeClock) -> None:
    stubborn = (sys.executable, "-c", "import signal, time; "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                "time.sleep(60)")
    backend.launch(LaunchWorkers(0, (WorkerSpec(0, d("n0:0")),), SLEEP))
    backend.launch(LaunchWorkers(0, (WorkerSpec(1, d("n0:1")),), stubborn))
    log = backend.log_dir / "gen0-vrank1.log"  # type: ignore[operator]
    deadline = time.monotonic() + 20
    while not (log.exists() and "ready" in log.read_text()):  # its handler is installed
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pids = {v: s.pid for v, s in backend.workers().items()}
    assert all(s.running for s in backend.workers().values())
    perform(backend, StopWorkers((0, 1), grace_s=5.0, reason="done"))
    events = wait_for(backend, lambda ev: len(exits(ev)) == 1)
    assert exits(events) == [WorkerExited(0, 0, d("n0:0"), -signal.SIGTERM, True)]
    assert alive(pids[1])
    backend.stop(StopWorkers((0, 1), grace_s=5.0))  # again: no-op, the grace keeps running
    clock.now += 5.0
    events = wait_for(backend, lambda ev: len(exits(ev)) == 1)
    assert exits(events) == [WorkerExited(1, 0, d("n0:1"), -signal.SIGKILL, True)]
    assert not alive(pids[1])
    backend.stop(StopWorkers((0, 1, 99)))  # stopped or unknown: nothing happens
    assert backend.poll() == []


def test_stop_kills_the_workers_children(backend: LocalBackend, tmp_path: Path) -> None:
    child_pid = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); open(sys.argv[1], 'w').write(str(p.pid)); "
            "time.sleep(60)")
    backend.launch(LaunchWorkers(0, (WorkerSpec(0, d("n0:0")),),
                                 (sys.executable, "-c", code, str(child_pid))))
    deadline = time.monotonic() + 20
    while not child_pid.exists() or not child_pid.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pid = int(child_pid.read_text())
    backend.stop(StopWorkers((0,)))
    wait_for(backend, lambda ev: bool(exits(ev)))
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid)


def test_launch_is_idempotent_and_checked(backend: LocalBackend) -> None:
    launch = LaunchWorkers(0, (WorkerSpec(0, d("n0:0")),), SLEEP)
    backend.launch(launch)
    pid = backend.workers()[0].pid
    backend.launch(launch)  # a retried launch after a coordinator restart
    assert backend.workers()[0].pid == pid and len(backend.workers()) == 1
    with pytest.raises(BackendError, match="it already runs on n0:0"):
        backend.launch(LaunchWorkers(0, (WorkerSpec(0, d("n0:1")),), SLEEP))
    with pytest.raises(BackendError, match="vrank 0 runs there"):
        backend.launch(LaunchWorkers(0, (WorkerSpec(1, d("n0:0")),), SLEEP))
    with pytest.raises(BackendError, match="the job does not hold n1:0"):
        backend.launch(LaunchWorkers(0, (WorkerSpec(1, d("n1:0")),), SLEEP))
    with pytest.raises(BackendError, match="cannot start"):
        backend.launch(LaunchWorkers(0, (WorkerSpec(1, d("n0:1")),), ("/nonexistent/x",)))
    with pytest.raises(BackendError, match="distinct"):
        LaunchWorkers(0, (WorkerSpec(1, d("n0:1")), WorkerSpec(1, d("n0:0"))), SLEEP)
    assert len(backend.workers()) == 1


def test_scripted_loss_kills_workers_on_lost_devices(backend: LocalBackend) -> None:
    backend.on_step(5)
    grants = [e for e in backend.poll() if isinstance(e, Grant)]
    assert grants[-1] == Grant("a1", devs("n1:0", "n1:1", "n2:0", "n2:1"))
    workers = tuple(WorkerSpec(v, dev) for v, dev in enumerate(grants[-1].devices))
    backend.launch(LaunchWorkers(1, workers, SLEEP))
    backend.on_step(18)  # preempt notice for n2 (step 12), then n1 fails (step 18)
    events = backend.poll()
    backend.on_step(18)
    events += wait_for(backend, lambda ev: len(exits(ev)) == 2)
    assert [e for e in events if not isinstance(e, WorkerExited)] == [
        PreemptNotice("a1", devs("n2:0", "n2:1"), 1010.0),
        Loss("a1", devs("n1:0", "n1:1"), "failure")]
    assert sorted(exits(events), key=lambda e: e.vrank) == [
        WorkerExited(0, 1, d("n1:0"), -signal.SIGKILL, True),
        WorkerExited(1, 1, d("n1:1"), -signal.SIGKILL, True)]
    assert backend.workers()[2].running and backend.workers()[3].running


def test_preemption_deadline_kills_what_is_still_held(backend: LocalBackend,
                                                     clock: FakeClock) -> None:
    backend.on_step(12)
    backend.poll()
    backend.on_step(12)
    backend.poll()
    backend.launch(LaunchWorkers(1, (WorkerSpec(4, d("n2:0")), WorkerSpec(5, d("n1:0"))),
                                 SLEEP))
    clock.now += 9.9
    assert backend.poll() == []
    clock.now += 0.1
    events = wait_for(backend, lambda ev: bool(exits(ev)))
    assert events[0] == Loss("a1", devs("n2:0", "n2:1"), "preempted")
    assert exits(events) == [WorkerExited(4, 1, d("n2:0"), -signal.SIGKILL, True)]
    assert backend.workers()[5].running


def test_release_kills_leftover_workers_and_is_idempotent(backend: LocalBackend) -> None:
    backend.on_step(5)
    backend.launch(LaunchWorkers(1, (WorkerSpec(2, d("n1:0")),), SLEEP))
    perform(backend, ReleaseDevices(devs("n1:0", "n1:1"), "shrink"))
    events = wait_for(backend, lambda ev: bool(exits(ev)))
    assert exits(events) == [WorkerExited(2, 1, d("n1:0"), -signal.SIGKILL, True)]
    assert d("n1:0") not in backend.held
    backend.release(ReleaseDevices(devs("n1:0", "n1:1")))  # again: nothing happens
    with pytest.raises(BackendError, match="does not hold n1:0"):
        backend.launch(LaunchWorkers(2, (WorkerSpec(2, d("n1:0")),), SLEEP))


def test_request_is_granted_by_the_next_scripted_grant(backend: LocalBackend) -> None:
    backend.poll()
    perform(backend, RequestNodes(2, "gen1-grow", "more throughput"))
    backend.on_step(5)
    assert backend.poll() == [Grant("a1", devs("n1:0", "n1:1", "n2:0", "n2:1"), "gen1-grow")]
    with pytest.raises(BackendError, match="nodes must be >= 1"):
        RequestNodes(0, "x")


def test_close_stops_everything(clock: FakeClock) -> None:
    backend = LocalBackend(parse_script(json.dumps(EXAMPLE)), clock=clock)
    backend.launch(LaunchWorkers(0, (WorkerSpec(0, d("n0:0")), WorkerSpec(1, d("n0:1"))),
                                 SLEEP))
    pids = [s.pid for s in backend.workers().values()]
    t = time.monotonic()
    backend.close()
    assert time.monotonic() - t < 5
    assert not any(alive(p) for p in pids)
    backend.close()  # twice is fine


def test_relaunch_after_an_unreported_exit(backend: LocalBackend) -> None:
    quick = (sys.executable, "-c", "raise SystemExit(3)")
    backend.launch(LaunchWorkers(0, (WorkerSpec(0, d("n0:0")),), quick))
    first = backend.workers()[0].pid
    deadline = time.monotonic() + 20
    while alive(first) and time.monotonic() < deadline:  # a zombie until reaped
        try:
            if os.waitid(os.P_PID, first, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                break
        except ChildProcessError:
            break
        time.sleep(0.02)
    # the coordinator has not polled yet; it launches vrank 0 for the next generation
    backend.launch(LaunchWorkers(1, (WorkerSpec(0, d("n0:0")),), SLEEP))
    events = backend.poll()
    assert events == [Grant("a0", devs("n0:0", "n0:1")),
                      WorkerExited(0, 0, d("n0:0"), 3, False)]
    assert backend.workers()[0].pid != first and backend.workers()[0].running


WORKER = """
from slurm_etc.protocol.channel import WorkerChannel
from slurm_etc.protocol.messages import Exited
with WorkerChannel.from_env() as w:
    welcome = w.join(timeout_s=60)
    order = w.wait(60)
    w.report(Exited(w.job, order.generation, w.vrank, f"{order.reason} via {welcome.store}"))
"""


def test_launched_workers_join_the_channel(tmp_path: Path) -> None:
    """The seams fit: the backend launches workers that find the channel from their
    environment, are welcomed with the rendezvous store, take an order and report."""
    from slurm_etc.protocol.channel import CoordinatorChannel, create_secret
    from slurm_etc.protocol.messages import Exited, Hello, Stop

    secret = create_secret("demo", tmp_path / "secrets")
    with CoordinatorChannel("demo", secret) as channel, \
            LocalBackend(parse_script(json.dumps(EXAMPLE)), log_dir=tmp_path / "logs") as b:
        b.launch(LaunchWorkers(0, (WorkerSpec(0, d("n0:0")), WorkerSpec(1, d("n0:1"))),
                               (sys.executable, "-c", WORKER), channel.worker_env()))
        hellos: set[int] = set()
        deadline = time.monotonic() + 60
        while hellos != {0, 1}:
            assert time.monotonic() < deadline, (tmp_path / "logs").glob("*")
            got = channel.recv(0.5)
            if got is not None and isinstance(got[1], Hello):
                hellos.add(got[0])
        assert channel.broadcast(Stop("demo", 0, "done"), [0, 1]) == []
        reports = {}
        while len(reports) < 2:
            assert time.monotonic() < deadline
            got = channel.recv(0.5)
            if got is not None and isinstance(got[1], Exited):
                reports[got[0]] = got[1].reason
        via = f"done via 127.0.0.1:{channel.port}"  # the store rides the channel
        assert reports == {0: via, 1: via}
        events = wait_for(b, lambda ev: len(exits(ev)) == 2, timeout_s=60)
        assert sorted((e.vrank, e.returncode) for e in exits(events)) == [(0, 0), (1, 0)]
        assert sum(channel.rejected.values()) == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300) | st.recursive(
    st.none() | st.booleans() | st.integers(-5, 40) | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(
        st.sampled_from(["nodes", "gpus_per_node", "initial_nodes", "events", "at_step",
                         "grant", "preempt", "lose", "grace_s", "reason", "x"]), c, max_size=6),
    max_leaves=25).map(lambda o: json.dumps(o).encode()))
def test_fuzz_script_parser_raises_only_script_errors(data: bytes) -> None:
    try:
        parse_script(data, "fuzz.json")
    except ScriptError as e:
        assert "\n" not in str(e) and str(e).startswith("fuzz.json: ")


def test_launch_never_takes_an_older_process_for_the_new_one(backend: LocalBackend) -> None:
    """A vrank launched again on the same device while its process of an earlier generation
    still runs (a worker that left the job at a commit and is still exiting): the launch is
    refused, never a silent no-op (the resize would wait forever for a joiner that never
    started); once that process is stopped, the launch waits for it and starts the new one."""
    backend.launch(LaunchWorkers(0, (WorkerSpec(0, d("n0:0")),), SLEEP))
    old = backend.workers()[0].pid
    with pytest.raises(BackendError, match="its process of generation 0 .* still runs"):
        backend.launch(LaunchWorkers(3, (WorkerSpec(0, d("n0:0")),), SLEEP))
    backend.stop(StopWorkers((0,), grace_s=5.0, reason="its vrank joins again"))
    backend.launch(LaunchWorkers(3, (WorkerSpec(0, d("n0:0")),), SLEEP))
    now = backend.workers()[0]
    assert now.pid != old and now.generation == 3 and now.running
    assert WorkerExited(0, 0, d("n0:0"), -signal.SIGTERM, True) in backend.poll()


def test_settled_steps_move_later_events_back_by_the_steps_trained_through_a_resize() -> None:
    script = {**EXAMPLE, "settled_steps": True}
    r = ScriptedResources(parse_script(json.dumps(script)))
    r.drain()
    r.on_step(5, now=0)  # the grant at step 5
    assert r.drain() == [Grant("a1", devs("n1:0", "n1:1", "n2:0", "n2:1"))]
    r.tick(0)
    # steps 6..29 trained while the grow was in flight (not reported): the preemption due
    # at step 12 moves back by those 24 steps, to 36
    r.on_step(30, now=100.0)
    assert r.drain() == []
    for step in range(31, 36):
        r.on_step(step, now=100.0)
    assert r.drain() == []
    r.on_step(36, now=100.0)
    assert [type(e) for e in r.drain()] == [PreemptNotice]
    # without settled_steps the same reports fire it at once (absolute steps)
    plain = ScriptedResources(parse_script(json.dumps(EXAMPLE)))
    plain.on_step(5, now=0)
    plain.tick(0)
    plain.drain()
    plain.on_step(30, now=100.0)
    assert [type(e) for e in plain.drain()] == [PreemptNotice]


def test_end_step_ends_training_once_every_event_fired_and_was_handed_over() -> None:
    script = {**EXAMPLE, "settled_steps": True, "end_step": 20}
    r = ScriptedResources(parse_script(json.dumps(script)))
    r.drain()
    r.on_step(5, now=0)  # the grant
    r.tick(0)
    r.on_step(30, now=1.0)  # steps 6..29 trained through the grow: everything moves by 24
    for step in range(31, 37):
        r.on_step(step, now=1.0)  # the preemption at 12 + 24
    r.tick(1.0)
    r.drain()
    for step in range(37, 43):
        r.on_step(step, now=2.0)  # the loss at 18 + 24, not yet handed over
    assert [type(e) for e in r.drain()] == [Loss] and r.unfired == ()
    r.on_step(43, now=2.0)
    r.on_step(44, now=2.0)  # settled step 20, but the loss was not handed over yet
    assert r.drain() == []
    r.tick(2.0)
    r.on_step(44, now=2.0)
    assert r.drain() == [EndTraining("the events script played out at step 44")]
    assert r.settled_step == 20
    r.on_step(45, now=2.0)
    assert r.drain() == []  # once
    # events not all fired by end_step: no end (training ends at its own train_steps)
    early = ScriptedResources(parse_script(json.dumps({**EXAMPLE, "end_step": 18})))
    early.drain()
    early.on_step(100, now=0)
    early.tick(0)
    early.on_step(101, now=0)
    assert [type(e) for e in early.drain()] == [Grant, PreemptNotice]
    assert [e.index for e in early.unfired] == [3]


def test_end_step_waits_for_the_steps_lost_in_a_rollback_to_be_trained_again() -> None:
    """CI: the old layout reported up to step 16 after the loss fired (settled step 12 =
    end_step), the survivors rolled back to step 6; the end came at the rebuilt layout's
    step 14, leaving steps 15-16 reported and never trained again."""
    script = {**EXAMPLE, "settled_steps": True, "end_step": 20}
    r = ScriptedResources(parse_script(json.dumps(script)))
    r.drain()
    for step in range(1, 19):  # every event fires, the last (the loss) at step 18
        r.on_step(step, now=0)
        if step < 18:
            r.tick(0)
    assert r.unfired == ()
    r.drain()
    for step in range(19, 25):  # trained on before the loss was handed over
        r.on_step(step, now=0)
    r.tick(0)  # handed over: settled step 24 >= 20, and the job rolls back to step 6
    assert r.drain() == [] and r.settled_step == 24
    for step in range(7, 24):  # rolled back to 6: the lost steps trained again
        r.on_step(step, now=0)
    assert r.drain() == []
    r.on_step(24, now=0)
    assert r.drain() == [EndTraining("the events script played out at step 24")]


def test_end_step_before_the_last_event_is_refused() -> None:
    with pytest.raises(ScriptError, match="end_step 10 comes before the last event's "
                                          "at_step 18"):
        parse_script(json.dumps({**EXAMPLE, "end_step": 10}))


def test_a_signal_reaches_a_worker_not_yet_leading_its_own_group() -> None:
    """Soak seed 104: a joiner forked by the preloader was killed before its setsid (no
    process group of its own yet): killpg found no group, the kill was lost, and the process
    lived on; its vrank's next launch was refused ("its process of generation 10 still
    runs"). The process itself gets the signal then."""
    import subprocess
    from types import SimpleNamespace

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert os.getpgid(child.pid) != child.pid  # in this test's group, as before setsid
        w = SimpleNamespace(handle=SimpleNamespace(proc=child))
        LocalBackend._signal(w, signal.SIGKILL)  # type: ignore[arg-type]
        assert child.wait(10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
