"""The coordinator's writes to the job record, kept in order through a full disk.

The record is written before the coordinator acts, but a record that cannot be written (a
full disk: SQLite's "database or disk is full", any other OperationalError, a snapshot
that cannot be published) must not stop the training it records. A write that fails so is
queued, and every later write queues behind it (the record stays in the order things
happened); the queue is retried with a growing backoff while the loop goes on, and the
record catches up when space returns. One warning when it starts, one when it caught up;
never one per step. A refusal of the record itself (:class:`~slurm_etc.store.jobs.
RecordError`: an invalid value, a contradiction) is no disk problem and is raised as before.

A write that returns a value (an event's or a migration's id) returns a :class:`Deferred`
while it waits; a later queued write that is handed it gets the value once it ran.
Progress writes of one generation coalesce (only the newest step is kept waiting), so the
queue holds one entry per event or action recorded during the outage, not one per step.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slurm_etc.store import jobs as record
from slurm_etc.store.db import StoreError

logger = logging.getLogger(__name__)

FIRST_RETRY_S = 0.5
MAX_RETRY_S = 10.0
# Writes that may wait (memory stays bounded through an outage of any length: past this,
# further writes are dropped, counted and said once; the record then misses them).
MAX_BEHIND = 100_000


class Deferred:
    """What a queued write returns once it ran (``value``); ``done`` says whether it has."""

    __slots__ = ("value", "done")

    def __init__(self) -> None:
        self.value: Any = None
        self.done = False

    def __repr__(self) -> str:
        return f"Deferred({self.value!r})" if self.done else "Deferred(pending)"


@dataclass
class _Write:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Deferred = field(default_factory=Deferred)


def transient(err: BaseException) -> bool:
    """A failure that waiting can cure (disk full, locked, I/O), not a refusal."""
    return isinstance(err, (StoreError, OSError)) and not isinstance(err, record.RecordError)


class Journal:
    """Writes to ``store`` in order; queued and retried while the record cannot be written.

    Args:
        store: the job's open store (passed as every write's first argument).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, store: Any, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.clock = clock
        self.queue: deque[_Write] = deque()
        self.failing_since: float | None = None
        self.last_error = ""
        self._next_try = self._last_try = 0.0
        self._backoff = FIRST_RETRY_S
        self.outages = 0  # how many times the record fell behind (for tests and logs)
        self.dropped = 0  # writes dropped with MAX_BEHIND waiting
        self.max_behind = MAX_BEHIND

    @property
    def behind(self) -> int:
        """Writes waiting for the record."""
        return len(self.queue)

    def write(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(store, *args, **kwargs)`` now, or queued behind a write that failed; its
        value, or a :class:`Deferred` of it while it waits.

        Raises:
            RecordError: the record refuses the write (not a disk problem).
        """
        if self.queue:
            return self._enqueue(_Write(fn, args, kwargs))
        try:  # a value that waited (an event's id) is handed on as what it became
            return fn(self.store, *(_resolved_one(a) for a in args),
                      **{k: _resolved_one(v) for k, v in kwargs.items()})
        except Exception as err:  # noqa: BLE001 - sorted into disk trouble or a refusal
            if not transient(err):
                raise
            self._fell_behind(err)
            return self._enqueue(_Write(fn, args, kwargs))

    def retry(self, *, hurry: bool = False) -> None:
        """Apply the waiting writes, in order, when the backoff says so (every loop turn);
        ``hurry``: a decision waits for them, try every FIRST_RETRY_S whatever the backoff."""
        due = min(self._next_try, self._last_try + FIRST_RETRY_S) if hurry else self._next_try
        if self.queue and self.clock() >= due:
            self._drain()

    def catch_up(self, timeout_s: float) -> bool:
        """At the end: try for up to ``timeout_s`` to apply every waiting write; True when
        none is left (else one error line says what stays unwritten)."""
        deadline = self.clock() + timeout_s
        while self.queue:
            self._drain()
            if not self.queue or self.clock() >= deadline:
                break
            time.sleep(min(self._backoff, max(0.0, deadline - self.clock())))
        if self.queue:
            logger.error("the job record is %d write(s) behind and cannot be written (%s): "
                         "it ends without them", len(self.queue), self.last_error)
            return False
        return True

    # -- internals ------------------------------------------------------------------------

    def _enqueue(self, w: _Write) -> Deferred:
        if w.fn is record.record_progress:  # only the newest step of a generation matters
            for queued in self.queue:  # args: job, generation
                if queued.fn is record.record_progress and queued.args[:2] == w.args[:2]:
                    queued.args, queued.kwargs = w.args, w.kwargs
                    return queued.result
        if len(self.queue) >= self.max_behind:
            if not self.dropped:
                logger.error("the job record is %d writes behind: later writes are dropped "
                             "until it catches up (it will miss them)", len(self.queue))
            self.dropped += 1
            return w.result
        self.queue.append(w)
        return w.result

    def _fell_behind(self, err: BaseException) -> None:
        self.outages += 1
        self.failing_since = self.clock()
        self.last_error = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        self._backoff = FIRST_RETRY_S
        self._next_try = self.clock() + self._backoff
        logger.warning("the job record cannot be written (%s): training goes on; the "
                       "record's writes wait and are retried (every %.1f-%.0f s) until it "
                       "catches up", self.last_error, FIRST_RETRY_S, MAX_RETRY_S)

    def _drain(self) -> None:
        self._last_try = self.clock()
        while self.queue:
            w = self.queue[0]
            try:
                value = w.fn(self.store, *(_resolved_one(a) for a in w.args),
                             **{k: _resolved_one(v) for k, v in w.kwargs.items()})
            except Exception as err:  # noqa: BLE001 - sorted as in write()
                if transient(err):
                    self.last_error = str(err).splitlines()[0][:300]
                    self._backoff = min(self._backoff * 2, MAX_RETRY_S)
                    self._next_try = self.clock() + self._backoff
                    return
                logger.error("a delayed write of the job record was refused and dropped "
                             "(%s: %s)", getattr(w.fn, "__name__", w.fn), err)
                value = None
            self.queue.popleft()
            w.result.value, w.result.done = value, True
        since = self.failing_since
        self.failing_since = None
        logger.warning("the job record caught up after %.1f s",
                       0.0 if since is None else self.clock() - since)


def _resolved_one(v: Any) -> Any:
    if isinstance(v, Deferred):
        return v.value
    if isinstance(v, (list, tuple)):
        return type(v)(_resolved(v))
    return v


def _resolved(values: Any) -> list[Any]:
    """Deferred values replaced by what they became; one that became a list (the ids of
    one poll's events) is spliced into the list holding it."""
    out: list[Any] = []
    for v in values:
        if isinstance(v, Deferred) and isinstance(v.value, list):
            out.extend(v.value)
        else:
            out.append(_resolved_one(v))
    return out
