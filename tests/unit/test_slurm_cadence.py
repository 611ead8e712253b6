"""When the Slurm backend asks Slurm (slurm_etc/slurm/cadence.py): the pure policy driven by
a clock the test moves, then the backend over the in-memory FakeSlurmClient with the same
fake clock, counting the commands it runs (steady, a request pending, a busy Slurm)."""
from __future__ import annotations

import logging
import time

import pytest

from slurm_etc.alloc.topology import Device
from slurm_etc.coordinator.backend import (
    BackendError,
    Grant,
    LaunchWorkers,
    Loss,
    RequestNodes,
    WorkerSpec,
)
from slurm_etc.slurm import NodeState, parsers
from slurm_etc.slurm import backend as slurm_backend
from slurm_etc.slurm.backend import SlurmBackend
from slurm_etc.slurm.cadence import (
    STEADY,
    Ask,
    Cadence,
    Flux,
    Outcome,
    PollState,
    answered,
    hurry,
    next_ask,
)
from slurm_etc.slurm.member import STARTED, write_notice
from slurm_etc.slurm.model import Command, SlurmError
from slurm_etc.slurm.observe import pending_gloss
from slurm_etc.testing.fake_slurm import FakeSlurmClient

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

C = Cadence(steady_s=30.0, fast_s=2.0, backoff_base_s=2.0, backoff_cap_s=120.0)


NOTICED = Flux(noticed=True)


def run(state: PollState, start: float, end: float, *, flux: Flux = STEADY,
        pending_since: float | None = None, outcome: Outcome = Outcome.ANSWERED,
        tick: float = 0.1) -> tuple[PollState, list]:
    """The policy as the backend's loop applies it, every ``tick`` from start to end (a
    request pending since ``pending_since``, else ``flux``): the asks made, with their time."""
    asks = []
    t = start
    while t < end:
        if pending_since is not None:
            flux = Flux(pending_s=t - pending_since)
        ask = next_ask(C, state, t, flux)
        if ask is not None:
            asks.append((round(t, 1), ask))
            state = answered(C, state, t, ask, outcome, jitter=0.0)
        t = round(t + tick, 1)
    return state, asks


# ---- the pure policy ---------------------------------------------------------------------

def test_steady_asks_one_full_query_every_steady_interval():
    _, asks = run(PollState(), 0.0, 120.0)
    assert [t for t, _ in asks] == [0.0, 30.0, 60.0, 90.0]
    assert all(a.full for _, a in asks)


def test_under_notice_asks_the_allocations_in_flux_every_fast_interval_and_full_still_steady():
    _, asks = run(PollState(), 0.0, 61.0, flux=NOTICED)
    full = [t for t, a in asks if a.full]
    fast = [t for t, a in asks if not a.full]
    assert full == [0.0, 30.0, 60.0]
    assert fast == [t for t in (2.0 * i for i in range(1, 31)) if t not in full]
    times = sorted(full + fast)
    assert all(b - a <= 2.0 + 1e-9 for a, b in zip(times, times[1:]))


def test_a_pending_request_is_asked_about_every_quarter_of_its_wait():
    state, asks = run(PollState(), 0.0, 600.0, pending_since=0.0)
    times = [t for t, _ in asks]
    fast = [t for t, a in asks if not a.full]
    assert [t for t in fast if t < 10] == [2.0, 4.0, 6.0, 8.0]  # 2 s while young
    # then a quarter of the wait so far between two asks: a grant at g is seen by g * 4/3
    assert all(b - a <= max(2.0, b / 4) + 0.1 + 1e-9 for a, b in zip(times, times[1:]))
    assert fast[4:] == [10.7, 14.3, 19.1, 25.5, 40.0, 53.4, 80.0], fast
    # after two minutes no more than the full queries themselves (every 30 s)
    assert times[-16:] == [120.0 + 30 * i for i in range(16)], times


def test_flux_ends_and_the_steady_interval_comes_back():
    state, asks = run(PollState(), 0.0, 10.0, flux=NOTICED)
    assert len(asks) == 5  # 0, 2, 4, 6, 8
    state, asks = run(state, 10.0, 40.0)
    assert [t for t, _ in asks] == [30.0]  # 30 s after the last full one, not after 8.0


def test_busy_backs_off_exponentially_up_to_the_cap_and_an_answer_resets():
    state, asks = run(PollState(), 0.0, 600.0, flux=NOTICED, outcome=Outcome.BUSY)
    times = [t for t, _ in asks]
    gaps = [round(b - a, 1) for a, b in zip(times, times[1:])]
    assert gaps[:7] == [2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 120.0]
    assert set(gaps[6:]) == {120.0}
    # a full query that was refused stays due: the first try after the wait is a full one
    assert all(a.full for _, a in asks)
    t = times[-1] + 120.0
    ask = next_ask(C, state, t, NOTICED)
    assert ask is not None and ask.full and ask.why == "retry after busy"
    state = answered(C, state, t, ask, Outcome.ANSWERED)
    assert state.busy == 0 and state.retry_at == 0.0 and state.full_due == t + 30.0
    assert next_ask(C, state, t + 2.0, NOTICED) == Ask(False, "notice")


def test_jitter_takes_up_to_half_off_the_wait():
    assert C.backoff_s(1, 0.0) == 2.0 and C.backoff_s(1, 1.0) == 1.0
    assert C.backoff_s(3, 0.5) == 6.0
    assert C.backoff_s(40, 0.0) == 120.0 and C.backoff_s(0) == 0.0


def test_other_failures_are_retried_after_the_fast_interval_without_backing_off():
    state, asks = run(PollState(), 0.0, 11.0, outcome=Outcome.FAILED)
    assert [t for t, _ in asks] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert state.busy == 0


def test_hurry_asks_a_full_query_early_but_never_while_backing_off():
    state = answered(C, PollState(), 0.0, Ask(True, "steady"), Outcome.ANSWERED)
    assert next_ask(C, state, 5.0) is None
    state = hurry(state, 5.0)
    assert next_ask(C, state, 5.0) == Ask(True, "steady")
    assert hurry(state, 50.0).full_due == 5.0  # never later than it was
    busy = answered(C, state, 5.0, Ask(True, "steady"), Outcome.BUSY, jitter=0.0)
    assert next_ask(C, hurry(busy, 5.5), 5.5, NOTICED) is None
    assert next_ask(C, hurry(busy, 5.5), 7.0, NOTICED) == Ask(True, "retry after busy")


def test_cadence_refuses_a_steady_interval_shorter_than_the_fast_one():
    with pytest.raises(ValueError, match=r"steady_s \(1\) must be at least fast_s \(2\)"):
        Cadence(steady_s=1.0, fast_s=2.0)
    with pytest.raises(ValueError, match="fast_s"):
        Cadence(fast_s=float("nan"))


@pytest.mark.parametrize("text,busy", [
    ("squeue: error: Rate limit exceeded, please retry momentarily", True),
    ("slurm_load_jobs error: Resource temporarily unavailable", True),
    ("slurm_load_node error: Socket timed out on send/recv operation", True),
    ("slurm_load_jobs error: Unable to contact slurm controller (connect failure)", True),
    ("slurm_load_jobs error: Invalid job id specified", False),
    ("squeue: error: Invalid user: nobody", False),
])
def test_busy_answers_are_told_from_other_failures(text, busy):
    assert parsers.is_busy(text) is busy


def test_pending_reasons_in_words():
    assert pending_gloss("QOSMaxNodePerUserLimit") == "held by Slurm: QOS limit"
    assert pending_gloss("AssocGrpNodeLimit") == "held by Slurm: account/association limit"
    assert pending_gloss("Resources") == "waiting for free nodes"
    assert pending_gloss("Priority") == "jobs of higher priority go first"
    assert pending_gloss(None) == "not yet scheduled"
    assert pending_gloss("SomethingNew") == ""


# ---- the backend over the fake client, on a fake clock -------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class BusyClient(FakeSlurmClient):
    """The fake, answering queries with Slurm's rate-limit line while ``busy``."""

    busy = False

    def _call(self, *argv: str) -> None:
        if self.busy and argv[0] in ("squeue", "sinfo", "scontrol-show-job"):
            self.calls.append(("refused", *argv))
            raise SlurmError(argv, 1, "slurm_load_jobs error: Rate limit exceeded, please "
                                      "retry momentarily")
        super()._call(*argv)


QUERIES = ("squeue", "sinfo", "scontrol-show-job")


@pytest.fixture
def fake():
    f = BusyClient(grace_time=30)
    f.anchor = f.add_job("anchor", nodes=["n1"], gpus_per_node=2)
    return f


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def backend(fake, clock, tmp_path):
    b = SlurmBackend(tmp_path, anchor_job=fake.anchor, client=fake, poll_interval_s=2.0,
                     steady_poll_s=30.0, notice_margin_s=5, monotonic=clock,
                     jitter=lambda: 0.0)
    yield b
    b.close()


def drive(backend, clock, seconds: float, tick: float = 0.5) -> list:
    events = []
    end = clock.t + seconds
    while clock.t < end:
        events += backend.poll()
        clock.t += tick
    return events


def queries(fake, since: int = 0) -> list[tuple[str, ...]]:
    return [c for c in fake.calls[since:] if c[0] in QUERIES or c[0] == "refused"]


def test_backend_steady_one_scontrol_and_one_sinfo_per_steady_interval(fake, clock, backend):
    start = len(fake.calls)
    events = drive(backend, clock, 110.0)
    assert events == [Grant(fake.anchor, (Device("n1", 0), Device("n1", 1)), None)]
    got = queries(fake, start)
    # one allocation: scontrol show job (2 RPCs; squeue of one job costs 3); all nodes
    assert got == [("scontrol-show-job", fake.anchor), ("sinfo",)] * 4, got
    # the coordinator's count of usable nodes comes from that sinfo: nothing more asked
    assert backend.usable_nodes() == 4 and queries(fake, start) == got


def test_backend_polls_fast_only_while_a_request_pends(fake, clock, backend, caplog, tmp_path):
    drive(backend, clock, 1.0)
    start = len(fake.calls)
    backend.request(RequestNodes(1, "g1"))
    member = backend.members["g1"]
    with caplog.at_level(logging.INFO, logger="slurm_etc.slurm.backend"):
        drive(backend, clock, 10.0)
        fake._set(member, reason="QOSMaxNodePerUserLimit")
        drive(backend, clock, 10.0)
    pending = queries(fake, start)
    # the pending member alone (one id: scontrol), no sinfo: every 2 s while it is young,
    # then every quarter of its wait: at 1, 3, 5, 7, 9.5, 13 and 17.5 s of its 20 s
    assert pending == [("scontrol-show-job", member)] * 7, pending
    lines = [r.getMessage() for r in caplog.records if "pending" in r.getMessage()]
    assert lines == ["[slurm] member request g1 pending: Resources (waiting for free nodes)",
                     "[slurm] member request g1 pending: QOSMaxNodePerUserLimit (held by "
                     "Slurm: QOS limit)"], lines
    assert backend.pending_reasons == {"g1": "QOSMaxNodePerUserLimit"}
    fake.start(member, ["n2"])
    assert not [e for e in drive(backend, clock, 2.0) if isinstance(e, Grant)]  # not asked yet
    # its batch shell starts and writes its start file: the backend asks Slurm at once
    write_notice(tmp_path, member, "0", STARTED, time.time())
    events = backend.poll() + backend.poll()
    assert [e for e in events if isinstance(e, Grant)] == [
        Grant(member, (Device("n2", 0), Device("n2", 1)), "g1")]
    # granted: steady again, one full query (both jobs: one squeue, and sinfo) per 30 s
    start = len(fake.calls)
    drive(backend, clock, 60.5)
    assert queries(fake, start) == [("squeue", fake.anchor, member), ("sinfo",)] * 2, \
        queries(fake, start)


def test_backend_backs_off_while_slurm_is_busy_and_says_so_once(fake, clock, backend, caplog):
    drive(backend, clock, 1.0)
    backend.request(RequestNodes(1, "g1"))
    fake.busy = True
    start = len(fake.calls)
    with caplog.at_level(logging.INFO, logger="slurm_etc.slurm.backend"):
        drive(backend, clock, 300.0)
        refused = [c for c in fake.calls[start:] if c[0] == "refused"]
        # tries at +0 (fast), +2, +6, +14, +30, +62, +126, +246: 2 s doubling, 120 s cap
        assert len(refused) == 8, refused
        fake.busy = False
        drive(backend, clock, 130.0)
    said = [r.getMessage() for r in caplog.records if "Slurm is busy" in r.getMessage()]
    assert len(said) == 1 and "query failed" in said[0] and "Rate limit" in said[0], said
    assert any("Slurm answers again (after 8 busy answer(s))" in r.getMessage()
               for r in caplog.records)


def test_backend_sees_a_node_down_under_no_worker_at_the_next_steady_query(fake, clock,
                                                                          backend):
    drive(backend, clock, 1.0)
    fake.set_state("n1", NodeState.DOWN, "down", "lost")
    assert not [e for e in drive(backend, clock, 25.0) if isinstance(e, Loss)]
    assert [e for e in drive(backend, clock, 6.0) if isinstance(e, Loss)]


def test_backend_asks_at_once_when_a_workers_step_dies_unexplained(fake, clock, backend,
                                                                   monkeypatch):
    """Slurm kills the steps on a node it set DOWN: the step's end (no exit line from the
    task wrapper) makes the backend ask Slurm at once, not at the next steady query."""
    drive(backend, clock, 1.0)
    # srun stands in as a process that ends at once without a word (its step was killed)
    monkeypatch.setattr(slurm_backend.commands, "srun", lambda spec: Command(("true",)))
    backend.launch(LaunchWorkers(1, (WorkerSpec(0, Device("n1", 0)),), ("train",)))
    fake.set_state("n1", NodeState.DOWN, "down", "lost")
    start = len(fake.calls)
    deadline = time.monotonic() + 10.0
    events: list = []
    while not any(isinstance(e, Loss) for e in events) and time.monotonic() < deadline:
        events += backend.poll()  # the fake clock stands still: no steady query is due
        time.sleep(0.05)
    assert Loss(fake.anchor, (Device("n1", 0), Device("n1", 1)), "failure") in events, events
    assert ("sinfo",) in fake.calls[start:]


def test_backend_refuses_a_steady_interval_below_the_fast_one(fake, tmp_path):
    with pytest.raises(BackendError, match=r"steady_s \(1\) must be at least fast_s \(2\)"):
        SlurmBackend(tmp_path, anchor_job=fake.anchor, client=fake, poll_interval_s=2.0,
                     steady_poll_s=1.0)
