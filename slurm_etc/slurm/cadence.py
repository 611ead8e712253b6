"""When the Slurm backend asks Slurm, and what: a pure policy, the time passed in.

Sites rate-limit slurmctld per user (``SlurmctldParameters=rl_enable``, Slurm 23.02+: a bucket
of 30 RPCs refilled at 2 per second by default), and one squeue or sinfo is two RPCs (the job
or node table plus the partition table, counted with ``sdiag`` on 22.05). So the backend asks
seldom when nothing is in flux, and often only while something it waits on can change in
Slurm. The rules, in the order :func:`next_ask` applies them:

- **backing off**: after Slurm answered "busy" (rate limited, timed out, resource temporarily
  unavailable, controller unreachable: :func:`~slurm_etc.slurm.parsers.is_busy`) nothing is
  asked before ``retry_at``: ``backoff_base_s * 2**(n-1)`` after the n-th busy answer in a
  row, at most ``backoff_cap_s``, jittered down by up to half so that many jobs told "busy"
  together do not come back together. An answer resets it.
- **full query due** (every ``steady_s`` after the last answered one, or sooner when the
  backend asks for one: :func:`hurry`): one squeue of every live allocation of the job (the
  anchor and its members by job id) and one sinfo (its nodes' states; the coordinator's
  count of usable nodes is answered from it too).
- **in flux** (:class:`Flux`): a squeue of those allocations only: every ``fast_s`` while a
  member is under a preemption notice (its grace runs); while a member request pends, when a
  quarter of the time it has pended has passed since the last query (``fast_s`` for its first
  seconds, ``steady_s`` after two minutes): a grant is seen within a third of the wait for
  it, and at once where the member's batch shell says it started (its start file, written
  by :mod:`.member`; the backend then asks for a full query), so a request that waits an
  hour for nodes costs what steady state costs.
- otherwise nothing.

A failure that is not "busy" (a parse error, an unexpected exit) is retried after ``fast_s``,
as before this policy. What a full query missed stays due.

What arrives without a query: preemption notices (the member's batch shell turns the signal
into a file within a second), and a node failure under running workers (Slurm kills their
step; its end makes the backend ask at once, :func:`hurry`). A node that fails, drains or
stops responding under no worker is seen at the next full query: within ``steady_s``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

# The steady interval: the least time between two full queries while nothing is in flux.
# One full query is 4 RPCs (squeue + sinfo), so 30 s is 8 RPCs a minute per job: 15 jobs of
# one user stay inside rl_enable's default refill (2 RPCs/s per user) with room to spare for
# resizes. Longer would delay seeing a node that fails with no worker on it (detected
# otherwise by the worker's step ending) and squeue's PreemptTime, the backup to the notice
# signal; 30 s is also Slurm's own cadence for preemption grace checks.
STEADY_POLL_S = 30.0
# The fast interval while a resize is pending (the backend's poll_interval_s; the 2 s every
# query used before this policy).
FAST_POLL_S = 2.0
# A pending member request is asked about every 1/PENDING_SLOWDOWN of the time it has pended.
PENDING_SLOWDOWN = 4.0
# Back-off after "busy": the first wait, and the longest.
BACKOFF_BASE_S = 2.0
BACKOFF_CAP_S = 120.0


class Outcome(Enum):
    """How Slurm answered a query."""

    ANSWERED = "answered"
    BUSY = "busy"  # rate limited, timed out, unavailable: back off
    FAILED = "failed"  # anything else: retried after fast_s


@dataclass(frozen=True)
class Cadence:
    """The policy's settings (seconds).

    Args:
        steady_s: the least time between two full queries (nothing in flux).
        fast_s: between two queries of the allocations in flux.
        backoff_base_s, backoff_cap_s: the first and the longest wait after "busy".
    """

    steady_s: float = STEADY_POLL_S
    fast_s: float = FAST_POLL_S
    backoff_base_s: float = BACKOFF_BASE_S
    backoff_cap_s: float = BACKOFF_CAP_S

    def __post_init__(self) -> None:
        for name in ("steady_s", "fast_s", "backoff_base_s", "backoff_cap_s"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ValueError(f"{name} ({value}) must be a finite number of seconds >= 0")
        if self.steady_s < self.fast_s:
            raise ValueError(f"steady_s ({self.steady_s:g}) must be at least fast_s "
                             f"({self.fast_s:g}): the steady interval is the longer one")

    def backoff_s(self, busy: int, jitter: float = 1.0) -> float:
        """The wait after the ``busy``-th busy answer in a row; ``jitter`` in [0, 1] takes
        up to half of it off."""
        if busy < 1:
            return 0.0
        full = min(self.backoff_cap_s, self.backoff_base_s * 2.0 ** min(busy - 1, 32))
        return full * (1.0 - 0.5 * min(1.0, max(0.0, jitter)))


@dataclass(frozen=True)
class Flux:
    """What of the job is in flux in Slurm.

    Attributes:
        noticed: a member is under a preemption notice (its grace runs).
        pending_s: how long the youngest pending member request has pended; None: none.
    """

    noticed: bool = False
    pending_s: float | None = None

    def interval(self, cadence: Cadence) -> float | None:
        """Seconds between two queries of the allocations in flux; None: nothing is."""
        if self.noticed:
            return cadence.fast_s
        if self.pending_s is not None:
            return min(cadence.steady_s,
                       max(cadence.fast_s, self.pending_s / PENDING_SLOWDOWN))
        return None


STEADY = Flux()


@dataclass(frozen=True)
class PollState:
    """Where the policy stands (times on the backend's monotonic clock).

    Attributes:
        full_due: the next full query is due at this time (0: at once).
        last_ask: when the last query was made (None: never).
        retry_at: nothing is asked before this time (backing off).
        busy: busy answers in a row.
    """

    full_due: float = 0.0
    last_ask: float | None = None
    retry_at: float = 0.0
    busy: int = 0


@dataclass(frozen=True)
class Ask:
    """A query to make: ``full``: every live allocation and the nodes' states; else only
    the allocations in flux. ``why``: for the debug log and the tests."""

    full: bool
    why: str


def next_ask(cadence: Cadence, state: PollState, now: float, flux: Flux = STEADY
             ) -> Ask | None:
    """The query due at ``now``, or None (see the module's rules)."""
    if now < state.retry_at:
        return None
    if now >= state.full_due:
        return Ask(True, "steady" if state.busy == 0 else "retry after busy")
    interval = flux.interval(cadence)
    if interval is not None and (state.last_ask is None or now >= state.last_ask + interval):
        return Ask(False, "notice" if flux.noticed else "pending")
    return None


def answered(cadence: Cadence, state: PollState, now: float, ask: Ask, outcome: Outcome,
             jitter: float = 1.0) -> PollState:
    """The state after ``ask`` was made at ``now`` and Slurm answered with ``outcome``
    (``jitter`` in [0, 1], for a busy answer's wait)."""
    if outcome is Outcome.ANSWERED:
        return PollState(full_due=now + cadence.steady_s if ask.full else state.full_due,
                         last_ask=now, retry_at=0.0, busy=0)
    if outcome is Outcome.BUSY:
        busy = state.busy + 1
        return replace(state, last_ask=now, busy=busy,
                       retry_at=now + cadence.backoff_s(busy, jitter))
    return replace(state, last_ask=now, retry_at=now + cadence.fast_s)


def hurry(state: PollState, at: float) -> PollState:
    """A full query due at ``at`` at the latest (still not before ``retry_at``)."""
    return replace(state, full_due=min(state.full_due, at))
