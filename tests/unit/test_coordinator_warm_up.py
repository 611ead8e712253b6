"""A grow's joiners warm up aside while the old layout trains: the coordinator orders the
old layout only once every joiner said Ready, and a joiner that never gets ready pauses
nobody (its resize is replanned without it). Real processes, the real coordinator, local
backend, authenticated channel and SQLite record; the workers are stand-ins that speak the
channel's protocol (no megatron), so the timing is theirs to script.
"""
from __future__ import annotations

import logging
import sys
import textwrap
import time
from dataclasses import replace

from slurm_etc.alloc.chooser import TrainingJob
from slurm_etc.coordinator import deciding, observe
from slurm_etc.coordinator.job import JobSpec
from slurm_etc.coordinator.run import run_job
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.demo import DEMO_HARDWARE
from slurm_etc.local.script import script_from_options
from slurm_etc.plan.model import PRESETS
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.store import jobs as record
from slurm_etc.store.db import open_store_readonly

STEP_S, LAST_STEP = 0.05, 300

WORKER = textwrap.dedent("""
    import os, sys, time

    from slurm_etc.protocol.channel import WorkerChannel
    from slurm_etc.protocol.env import LAYOUT
    from slurm_etc.protocol.messages import (Exited, Progress, Ready, Resize, Resized,
                                          Stop, parse_layout)
    log, warm = sys.argv[1], float(sys.argv[2])
    job, vrank = os.environ["SLURM_ETC_JOB"], int(os.environ["SLURM_ETC_VRANK"])

    def note(what):
        with open(log, "a") as f:
            f.write(f"{time.time():.3f} {vrank} {what}\\n")

    ch = WorkerChannel.from_env()
    ch.join(60.0, pid=os.getpid())
    if os.environ["SLURM_ETC_GENERATION"] != "0":  # a joiner
        order = None
        while not isinstance(order, Resize):
            order = ch.wait(1.0)
        note(f"joiner-got-order {order.generation}")
        if warm < 0:
            time.sleep(600)  # never ready
        time.sleep(warm)  # its warm-up (imports, ...): the old layout trains meanwhile
        ch.report(Ready(job, order.generation, vrank, warm))
        note("ready")
        ch.report(Resized(job, order.generation, vrank, "committed", 0))
        ch.report(Exited(job, order.generation, vrank, "done", 0))
        while not isinstance(ch.wait(1.0), Stop):
            pass
        sys.exit(0)
    layout, gen, step = parse_layout(os.environ[LAYOUT]), 0, 0
    while step < %(last)d:
        order = ch.poll()
        if isinstance(order, Resize) and order.generation > gen:
            note(f"ordered {order.generation} at-step {step}")
            ch.report(Resized(job, order.generation, vrank, "committed", step))
            gen, layout = order.generation, order.new.layout()
        time.sleep(%(step_s)s)
        step += 1
        ch.report(Progress(job, gen, vrank, step, 1.0, 1e-3, step * 8, str(layout.config)))
        note(f"step {step}")
    ch.report(Exited(job, gen, vrank, "done", step))
    time.sleep(0.3)
""") % {"last": LAST_STEP, "step_s": STEP_S}


def _run(tmp_path, warm_s: float, join_timeout_s: float = 60.0) -> tuple[dict, list[list[str]]]:
    worker, log = tmp_path / "worker.py", tmp_path / "notes.txt"
    worker.write_text(WORKER)
    spec = JobSpec("warm-1", "t", (sys.executable, str(worker), str(log), str(warm_s)),
                   TrainingJob(PRESETS["tiny"], 8, 1, False), EffectivePolicy(),
                   DEMO_HARDWARE, worker_timeout_s=60.0, join_timeout_s=join_timeout_s)
    assert spec.order_after_joined  # the default
    # one node trains; at step 3 a second node is granted
    backend = LocalBackend(script_from_options(2, 1, initial_nodes=1,
                                               events=[{"at_step": 3, "grant": ["n1"]}]),
                           log_dir=tmp_path / "workers")
    out = run_job(spec, backend, backend.topology, db=str(tmp_path / "job.db"),
                  state_dir=str(tmp_path / "state"), secret_dir=tmp_path / "keys",
                  deadline_s=120)
    notes = [line.split() for line in log.read_text().splitlines()]
    return out, notes


def _migrations(tmp_path) -> list:
    store = open_store_readonly(tmp_path / "job.db")
    try:
        detail = record.job_detail(store, "warm-1")
    finally:
        store.close()
    assert detail is not None
    return detail.migrations


def test_old_layout_trains_through_the_joiners_warm_up_and_is_ordered_after_ready(tmp_path):
    warm = 2.0
    out, notes = _run(tmp_path, warm)
    assert out["state"] == "finished", out
    got = next(float(n[0]) for n in notes if n[2] == "joiner-got-order")
    ready = next(float(n[0]) for n in notes if n[2] == "ready")
    (ordered,) = [n for n in notes if n[2] == "ordered"]
    ordered_at, ordered_step = float(ordered[0]), int(ordered[5])
    steps_between = [int(n[3]) for n in notes
                     if n[2] == "step" and got <= float(n[0]) <= ordered_at]
    # the old layout was ordered only after the joiner's Ready ...
    assert ordered_at >= ready, (ordered_at, ready)
    # ... and trained on during the warm-up: steps reported between the joiner's order and
    # the old layout's (at least half of what the warm-up's length allows)
    assert len(steps_between) >= warm / STEP_S / 2, steps_between
    assert ordered_step > 3 + len(steps_between) - 2
    assert [m.outcome for m in _migrations(tmp_path)] == ["committed"]


def test_joiner_never_ready_pauses_nobody_and_the_job_finishes(tmp_path, caplog):
    caplog.set_level(logging.INFO, "slurm_etc")
    t0 = time.monotonic()
    out, notes = _run(tmp_path, -1.0, join_timeout_s=8.0)
    assert out["state"] == "finished", out
    assert time.monotonic() - t0 < 60
    assert any(n[2] == "joiner-got-order" for n in notes)
    # the old layout was never ordered: it trained to its end in the first layout
    assert not [n for n in notes if n[2] == "ordered"], notes
    assert max(int(n[3]) for n in notes if n[2] == "step") == LAST_STEP
    aborted = [r.getMessage() for r in caplog.records if "aborted" in r.getMessage()]
    assert aborted and "vrank 1 said hello but was not ready within 8 s" in aborted[0], aborted
    assert [m.outcome for m in _migrations(tmp_path)] == ["aborted"]


def test_preemption_notice_during_a_grows_warm_up_supersedes_it_at_once(tmp_path):
    """Real coordinator and record over a hand-driven backend: a grow whose joiners are
    still warming up (no Ready) is given up the moment a notice comes, nobody of the old
    layout having been ordered; its joiners are stopped and the noticed node released."""
    import sqlite3

    from slurm_etc.alloc.topology import ClusterTopology, Device
    from slurm_etc.coordinator.backend import Grant, PreemptNotice
    from tests.unit.coordinator_harness import RecordingBackend, coordinator_over

    stub = RecordingBackend(ClusterTopology(2, ("n1", "n2")))
    with coordinator_over(tmp_path, "warm-2", stub,
                          training=TrainingJob(PRESETS["tiny"], 8, 1, False),
                          policy=EffectivePolicy(grow=True, max_nodes=2),
                          hardware=DEMO_HARDWARE, backend_name="local") as (c, db):
        n1, n2 = (Device("n1", 0), Device("n1", 1)), (Device("n2", 0), Device("n2", 1))
        stub.pending = [Grant("a0", n1)]
        observe.observe_backend(c)
        deciding.decide_now(c)
        first = c.layout
        assert first is not None
        c.holdings = replace(c.holdings, step=5)  # the first layout trains
        stub.pending = [Grant("a1", n2)]
        observe.observe_backend(c)
        deciding.decide_now(c)
        fl = c.resize.inflight
        assert fl is not None and fl.joiners and not fl.sent_at  # warming up, not ordered
        assert [len(a.workers) for a in stub.launched] == [len(first.devices), len(fl.joiners)]
        stub.pending = [PreemptNotice("a1", n2, time.time() + 60)]
        observe.observe_backend(c)
        assert c.resize.inflight is None and not fl.sent_at  # superseded at once, nobody ordered
        deciding.decide_now(c)
        assert sorted(v for a in stub.stopped for v in a.vranks) == sorted(fl.joiners)
        assert [d for a in stub.released for d in a.devices] == list(n2)
        assert c.layout == first
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT outcome, error FROM migrations").fetchall()
        finally:
            con.close()
        assert len(rows) == 1 and rows[0][0] == "aborted" and "superseded" in rows[0][1], rows


def test_a_short_notice_prepares_at_full_speed_a_long_one_beside_training(tmp_path):
    """Preparing beside training shares the cores with it (several times slower): under a
    notice with less grace left than ``prepare_aside_min_grace_s`` the shrink is ordered to
    prepare at full speed; with ample grace it trains through its preparation."""
    from slurm_etc.alloc.topology import ClusterTopology, Device
    from slurm_etc.coordinator.backend import Grant, PreemptNotice
    from tests.unit.coordinator_harness import HandDrivenBackend, coordinator_over

    def shrink_order(job: str, grace_s: float, measured_aside_s: float | None = None):
        backend = HandDrivenBackend(ClusterTopology(2, ("n1", "n2")))
        with coordinator_over(tmp_path / job, job, backend,
                              training=TrainingJob(PRESETS["tiny"], 8, 1, False),
                              policy=EffectivePolicy(max_nodes=2), hardware=DEMO_HARDWARE,
                              backend_name="local", order_after_joined=False) as (c, _):
            n1, n2 = (Device("n1", 0), Device("n1", 1)), (Device("n2", 0), Device("n2", 1))
            backend.pending = [Grant("a0", n1 + n2)]
            observe.observe_backend(c)
            deciding.decide_now(c)
            assert c.layout is not None and len(c.layout.devices) == 4
            c.holdings = replace(c.holdings, step=5)
            c.resize.aside_preparation_s = measured_aside_s
            backend.pending = [PreemptNotice("a0", n2, time.time() + grace_s)]
            observe.observe_backend(c)
            deciding.decide_now(c)
            assert c.resize.inflight is not None, "the notice ordered no shrink"
            return c.resize.inflight.order

    for job in ("short", "long", "fast", "slow"):
        (tmp_path / job).mkdir()
    short, ample = shrink_order("short", 5.0), shrink_order("long", 120.0)
    assert len(short.new.devices) == 2 and len(ample.new.devices) == 2
    assert short.prepare_while_training is False
    assert ample.prepare_while_training is True
    # once a preparation beside training was timed, the grace must hold twice it (+ the
    # plan's estimate): 5 s holds 2 x 1.5 s, not 2 x 3 s
    assert shrink_order("fast", 5.0, measured_aside_s=1.5).prepare_while_training is True
    assert shrink_order("slow", 5.0, measured_aside_s=3.0).prepare_while_training is False


def test_a_device_granted_again_is_not_the_one_that_was_lost(tmp_path):
    """A node lost (or a worker killed on it) and granted again in a new allocation: its
    devices are whole again. Kept as lost, a later commit dropped them from what the job
    holds although the new allocation held them (the job never grew again: the Slurm tier's
    CI failure), and a late loss of the old allocation does not touch the new one's."""
    from slurm_etc.alloc.topology import ClusterTopology, Device
    from slurm_etc.coordinator.backend import Grant, Loss
    from tests.unit.coordinator_harness import RecordingBackend, coordinator_over

    stub = RecordingBackend(ClusterTopology(2, ("n1", "n2")))
    with coordinator_over(tmp_path, "regrant-1", stub,
                          training=TrainingJob(PRESETS["tiny"], 8, 1, False),
                          policy=EffectivePolicy(grow=True, max_nodes=2),
                          hardware=DEMO_HARDWARE, backend_name="local") as (c, _):
        n1, n2 = (Device("n1", 0), Device("n1", 1)), (Device("n2", 0), Device("n2", 1))
        stub.pending = [Grant("a0", n1)]
        observe.observe_backend(c)
        deciding.decide_now(c)
        c.holdings = replace(c.holdings, step=5)
        stub.pending = [Grant("a1", n2)]
        observe.observe_backend(c)
        deciding.decide_now(c)
        assert c.resize.inflight is not None and c.resize.inflight.joiners  # the grow warms up
        stub.pending = [Loss("a1", n2)]  # its node fails during the warm-up
        observe.observe_backend(c)
        deciding.decide_now(c)
        assert c.resize.inflight is None and set(n2) <= c.lost
        stub.pending = [Grant("a2", n2)]  # the same node, a new allocation
        observe.observe_backend(c)
        assert not set(n2) & c.lost and all(c.held[d] == "a2" for d in n2)
        assert not set(n2) & set(c.notices)
        stub.pending = [Loss("a1", n2)]  # the old allocation's end, reported late
        observe.observe_backend(c)
        assert not set(n2) & c.lost, "a late loss of a1 marked a2's devices lost"
        deciding.decide_now(c)
        fl = c.resize.inflight
        assert fl is not None and {fl.vranks[v] for v in fl.joiners} == set(n2), \
            "the job did not grow onto the node granted again"
