"""The pieces a restarted coordinator reattaches live workers with (the whole path, real
training killed and restarted: tests/dist/test_coordinator_restart.py): the local backend
adopts the processes recorded at launch, by pid and start time (a reused pid is not taken);
a restarted coordinator's channel listens where the workers look, takes a rejoining worker
up, and tells one it does not take up to stop; the store client follows the restarted
coordinator's new store."""
from __future__ import annotations

import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from slurm_etc.alloc.chooser import TrainingJob
from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator import acting, deciding, observe, restart
from slurm_etc.coordinator.backend import (
    UNKNOWN_EXIT,
    Grant,
    StopWorkers,
    WorkerExited,
    WorkerState,
)
from slurm_etc.coordinator.loop import Coordinator
from slurm_etc.coordinator.processes import process_start
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.demo import DEMO_HARDWARE
from slurm_etc.local.script import script_from_options
from slurm_etc.plan.model import PRESETS
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.protocol.channel import CoordinatorChannel, WorkerChannel
from slurm_etc.protocol.messages import Hello, Stop
from slurm_etc.protocol.store import StoreClient, StoreServer
from slurm_etc.store import jobs as record

from .coordinator_harness import HandDrivenBackend, coordinator_over

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

JOB = "reattach-unit"


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)


def test_adopts_the_recorded_process_and_not_a_reused_pid() -> None:
    """A recorded (pid, start) that is alive is adopted, stopped through its process group
    and reported ended with UNKNOWN_EXIT; the same pid with another start time (a reused
    pid), a gone pid and a device the backend does not hold are not adopted."""
    alive, gone = _sleeper(), _sleeper()
    gone.kill()
    gone.wait()
    backend = LocalBackend(script_from_options(1, 2))
    try:
        d0, d1 = sorted(backend.held)
        start = process_start(alive.pid)
        assert start is not None and process_start(gone.pid) is None
        recorded = [WorkerState(0, 3, d0, alive.pid, start=start),
                    WorkerState(1, 3, d1, alive.pid, start=start + 1),  # a reused pid
                    WorkerState(2, 3, d1, gone.pid, start=start)]
        assert backend.adopt(recorded) == [0]
        assert {v: (w.generation, w.pid, w.running) for v, w in backend.workers().items()} \
            == {0: (3, alive.pid, True)}
        assert not [e for e in backend.poll() if isinstance(e, WorkerExited)]  # it runs
        backend.stop(StopWorkers((0,), 5.0, "test"))
        exited: list[WorkerExited] = []
        until = time.monotonic() + 10
        while not exited and time.monotonic() < until:
            exited = [e for e in backend.poll() if isinstance(e, WorkerExited)]
            time.sleep(0.05)
        assert exited == [WorkerExited(0, 3, d0, UNKNOWN_EXIT, True)]
        assert alive.wait(5) == -signal.SIGTERM  # the stop reached the process itself
    finally:
        backend.close()
        if alive.poll() is None:
            alive.kill()
            alive.wait()


def test_a_rejoining_worker_is_taken_up_or_told_to_stop(tmp_path: object) -> None:
    """After a restart, the channel answers a rejoining worker (step >= 0) that trains in a
    generation it runs with a Welcome, and one from before with a Stop (it is never taken
    for the vrank it names); a first Hello (step < 0) is welcomed as always."""
    key = secrets.token_bytes(32)
    with CoordinatorChannel(JOB, key, "127.0.0.1") as c:
        c.admit = lambda hello: hello.step < 0 or hello.trained >= 2
        old = WorkerChannel(JOB, 0, c.address, key, generation=1)
        new = WorkerChannel(JOB, 1, c.address, key, generation=2)
        try:
            old.rejoin(step=17, trained=1)
            new.rejoin(step=17, trained=2)
            heard: list[tuple[int, object]] = []
            until = time.monotonic() + 10
            while time.monotonic() < until and (new.rendezvous is None or not heard
                                                or old.poll() is None):
                got = c.recv(0.05)
                if got is not None:
                    heard.append(got)
                new.poll()
            assert [(v, type(r).__name__, r.step) for v, r in heard  # type: ignore[attr-defined]
                    ] == [(1, "Hello", 17)]
            assert new.rendezvous is not None and old.rendezvous is None
            assert c.vranks == frozenset({1})
        finally:
            old.close(0)
            new.close(0)
        stopped = WorkerChannel(JOB, 0, c.address, key, generation=1)
        try:
            stopped.rejoin(step=3, trained=1)
            order = None
            until = time.monotonic() + 10
            while order is None and time.monotonic() < until:
                c.recv(0.05)
                order = stopped.poll()
            assert isinstance(order, Stop) and order.generation == 2
        finally:
            stopped.close(0)
        first = WorkerChannel(JOB, 3, c.address, key, generation=0)
        try:
            until = time.monotonic() + 10
            first.report(Hello(JOB, 0, 3, "h", os.getpid()))
            while first.rendezvous is None and time.monotonic() < until:
                c.recv(0.05)
                first.poll()
            assert first.rendezvous is not None
        finally:
            first.close(0)


def test_store_client_follows_a_restarted_store() -> None:
    """The client (and every group built over it) sends to the new store once repointed."""
    key = secrets.token_bytes(32)
    with StoreServer(key, "127.0.0.1", job="j") as before, \
            StoreServer(key, "127.0.0.1", job="j") as after:
        client = StoreClient(before.host, before.port, key, timeout=timedelta(seconds=5))
        try:
            client.set("k", b"before")
            after_client = StoreClient(after.host, after.port, key,
                                       timeout=timedelta(seconds=5))
            after_client.set("k", b"after")
            after_client.close()
            client.repoint(after.host, after.port)
            assert client.get("k") == b"after"
        finally:
            client.close()


class _AdoptingBackend(HandDrivenBackend):
    """Workers as launched (pid, start time); adopts the vranks in ``alive``."""

    def __init__(self, alive: set[int]) -> None:
        super().__init__(script_from_options(1, 2).topology)
        self.alive = alive
        self.given: list[WorkerState] = []
        self.stopped: list[tuple[int, ...]] = []
        self.states = {v: WorkerState(v, 0, Device("n0", v), 1000 + v, start=500 + v)
                       for v in (0, 1)}

    def workers(self) -> dict:
        return dict(self.states)

    def adopt(self, recorded: list[WorkerState]) -> list[int]:
        self.given = list(recorded)
        return sorted(w.vrank for w in recorded if w.vrank in self.alive)

    def stop(self, action: Any) -> None:
        self.stopped.append(tuple(action.vranks))


@pytest.mark.parametrize("alive", [{0, 1}, {0}])
def test_a_restarted_coordinator_finds_the_recorded_launches(tmp_path: Path,
                                                            alive: set[int]) -> None:
    """The launches recorded by one coordinator (one transaction, handled at once) are what
    the next one hands the backend to adopt; the layout is reattached at the recorded step,
    whole or missing a worker (issue #43: the dead one is a loss, its device failed once
    held; nobody is stopped)."""
    backend = _AdoptingBackend(alive)
    with coordinator_over(tmp_path, JOB, backend, training=TrainingJob(PRESETS["tiny"], 8, 1),
                          policy=EffectivePolicy(grow=False), hardware=DEMO_HARDWARE,
                          backend_name="local") as (first, db):
        vranks = {v: Device("n0", v) for v in (0, 1)}
        record.open_generation(first.io.store, JOB, 0, "dp=2,tp=1,pp=1", (0, 1), vranks,
                               first_step=0)
        record.record_progress(first.io.store, JOB, 0, last_step=7, last_loss=5.5)
        acting.record_launch(first, 0, (0, 1))
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        rows = con.execute("SELECT payload, handled_at IS NOT NULL FROM events WHERE "
                           "kind = 'launch' ORDER BY id").fetchall()
        con.close()
        assert [(json.loads(p)["pid"], json.loads(p)["start"], h) for p, h in rows] == [
            (1000, 500, 1), (1001, 501, 1)]
        io = first.io
        again = Coordinator(first.spec, backend, io.store, io.channel, io.topology)
        took = restart.reattach(again, record.recover(first.io.store, JOB))
        assert [(w.vrank, w.pid, w.start, w.device) for w in backend.given] == [
            (0, 1000, 500, Device("n0", 0)), (1, 1001, 501, Device("n0", 1))]
        if alive == {0, 1}:
            assert took and again.layout is not None and again.layout.devices == (0, 1)
            assert (again.step, again.generation, again.restart.reattached) == (7, 0, True)
            assert backend.stopped == []
        else:
            assert took and again.layout is not None and again.layout.devices == (0, 1)
            assert again.restart.dead_at_reattach == {Device("n0", 1): 1} and backend.stopped == []
            assert again.launches.unjoined.keys() == {0}  # the dead one is not waited for


@pytest.mark.parametrize("came_back", [False, True])
def test_a_reattached_layout_none_of_whose_workers_came_back_starts_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, came_back: bool) -> None:
    """Vrank 1 found dead at the restart, vrank 0 reattached; vrank 0 then exits too. Had it
    never said Hello again (it was blocked in a collective on the dead one past its
    reattach wait), nothing of the state survives: the first layout starts again on a new
    generation (the devices failed by the deaths whole again), as a restart that found none
    alive. Had it come back, its exit is the job's end like any other."""
    monkeypatch.setattr(deciding, "DEAD_GRACE_S", 0.0)
    backend = _AdoptingBackend({0})
    with coordinator_over(tmp_path, JOB, backend, training=TrainingJob(PRESETS["tiny"], 8, 1),
                          policy=EffectivePolicy(grow=False), hardware=DEMO_HARDWARE,
                          backend_name="local") as (first, db):
        vranks = {v: Device("n0", v) for v in (0, 1)}
        record.open_generation(first.io.store, JOB, 0, "dp=2,tp=1,pp=1", (0, 1), vranks,
                               first_step=0)
        record.record_progress(first.io.store, JOB, 0, last_step=7, last_loss=5.5)
        acting.record_launch(first, 0, (0, 1))
        io = first.io
        again = Coordinator(first.spec, backend, io.store, io.channel, io.topology)
        restart.recover(again)
        assert again.restart.reattached and again.restart.found_dead == {1}
        backend.pending = [Grant("a0", tuple(vranks.values()))]
        observe.observe_backend(again)
        again.phase.event_ids.clear()  # decided (the grant)
        assert again.lost == {Device("n0", 1)} and again.launches.exit_failed == {Device("n0", 1)}
        again.restart.came_back = came_back
        backend.states = {0: replace(backend.states[0], returncode=UNKNOWN_EXIT)}
        said = deciding.nothing_left(again)  # no grace (DEAD_GRACE_S 0)
        if came_back:
            assert said is not None and "every worker of generation 0 exited" in said
            # with a checkpoint the state survives: the first layout again, from it
            (tmp_path / "ck" / "step-5").mkdir(parents=True)
            again.spec = replace(again.spec, recovery=replace(
                again.spec.recovery, checkpoint_dir=str(tmp_path / "ck")))
            assert deciding.nothing_left(again) is None and again.layout is None
            assert again.restart.rebuilt_into_next == (0, 7)  # steps 6-7 recorded lost at the start
            return
        assert said is None and again.layout is None and not again.restart.reattached
        assert (again.restart.generation, again.step, again.lost) == (1, 0, frozenset())
        assert again.phase.dirty and again.restart.admit_from == 1
