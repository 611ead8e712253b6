"""One supervisor of a backend's worker processes: stop -> grace -> kill (-> backstop) ->
report, the same for every backend.

A backend hands each worker it starts (or adopts) to its :class:`WorkerSupervisor`, which
decides *when*: it asks a worker to stop and notes by when it must have ended
(:class:`StopEscalation`), kills it when that grace runs out, falls back to the backend's
last resort when a kill is ignored, kills at once a worker whose device is lost or released,
and reports every worker that ended, once, as a :class:`WorkerExited`. The backend supplies
only *how*, in ``do_*`` hooks (:class:`WorkerMechanism`; dask-gateway's ``db_base`` keeps
its mechanism in ``do_*`` hooks the same way):

=================  ==============================  ===========================================
hook               local processes                 Slurm (workers as tasks of ``srun`` steps)
=================  ==============================  ===========================================
do_exit_status     ``waitid`` on the process        the task wrapper's exit line, or the end
                                                   of its step
do_stop            SIGTERM to its process group     ``stop <vrank>`` on the step's stdin
do_kill            SIGKILL to its process group     ``kill <vrank>``
do_backstop        (none: a SIGKILL is final)       ``scancel --signal=KILL <job>.<step>``
do_ended           close its log                    (nothing held)
=================  ==============================  ===========================================

Nothing here blocks except :meth:`WorkerSupervisor.close`; the deadlines are in the
backend's clock (unix seconds, injectable), so that a test moves them with a fake clock.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Generic, Literal, Protocol, TypeVar

from .backend import WorkerExited, WorkerState

logger = logging.getLogger(__name__)

H = TypeVar("H")


@dataclass
class StopEscalation:
    """One worker's stop -> grace -> kill (-> backstop), as deadlines (pure).

    :meth:`stop` asks for a graceful stop that must end by ``now + grace``; a later stop
    with a longer grace never postpones an earlier deadline. :meth:`due` says what is owed
    at ``now``: ``"kill"`` once the grace ran out, ``"backstop"`` once a kill was ignored
    for the backstop given to :meth:`killed` (Slurm: the step is cancelled)."""

    kill_at: float | None = None
    backstop_at: float | None = None

    def stop(self, now: float, grace_s: float) -> bool:
        """Whether to send the stop now (False: one with an earlier deadline is on)."""
        kill_at = now + grace_s
        if self.kill_at is not None and self.kill_at <= kill_at:
            return False
        self.kill_at = kill_at
        return True

    def killed(self, now: float, backstop_s: float | None = None) -> None:
        """The kill was sent (the grace ran out, or the worker is killed at once)."""
        self.kill_at = None
        self.backstop_at = None if backstop_s is None else now + backstop_s

    def due(self, now: float) -> Literal["kill", "backstop"] | None:
        if self.kill_at is not None and now >= self.kill_at:
            return "kill"
        if self.backstop_at is not None and now >= self.backstop_at:
            self.backstop_at = None
            return "backstop"
        return None


@dataclass
class Supervised(Generic[H]):
    """One worker under supervision: what the coordinator is told of it (``state``), the
    backend's handle on it (a process, a task of a step), its escalation, and whether its
    end was reported."""

    state: WorkerState
    handle: H
    escalation: StopEscalation = field(default_factory=StopEscalation)
    reported: bool = False

    @property
    def vrank(self) -> int:
        return self.state.vrank


class WorkerMechanism(Protocol[H]):
    """How one backend signals, kills and polls one worker; the supervisor decides when."""

    def do_exit_status(self, worker: Supervised[H]) -> int | None:
        """Its exit status once it ended (negative: the signal that killed it), None while
        it runs. Called often: cheap, never blocking."""
        ...

    def do_stop(self, worker: Supervised[H]) -> None:
        """Ask it to stop (it may take its time, up to the grace)."""
        ...

    def do_kill(self, worker: Supervised[H]) -> None:
        """Kill it now."""
        ...

    def do_backstop(self, worker: Supervised[H]) -> None:
        """The last resort for a worker that outlived its kill by the backstop (only called
        when the supervisor was given a ``backstop_s``)."""
        ...

    def do_ended(self, worker: Supervised[H]) -> None:
        """Its end is being reported: free what the backend held for it, say it."""
        ...

    def do_describe(self, worker: Supervised[H]) -> str:
        """A few words naming its process for log lines (``pid 123``)."""
        ...


class WorkerSupervisor(Generic[H]):
    """The workers of one backend, by vrank (the latest per vrank), and their escalation.

    Args:
        mechanism: the backend's ``do_*`` hooks.
        name: the backend's prefix in log lines (``[local]``).
        backstop_s: how long a kill may be ignored before ``do_backstop``; None: never.
    """

    def __init__(self, mechanism: WorkerMechanism[H], *, name: str,
                 backstop_s: float | None = None) -> None:
        self._do = mechanism
        self.name = name
        self.backstop_s = backstop_s
        self._workers: dict[int, Supervised[H]] = {}

    # -- the registry -------------------------------------------------------------------
    def add(self, state: WorkerState, handle: H) -> Supervised[H]:
        """A worker started (or adopted): it replaces an earlier one of its vrank."""
        worker = Supervised(state, handle)
        self._workers[state.vrank] = worker
        return worker

    def get(self, vrank: int) -> Supervised[H] | None:
        return self._workers.get(vrank)

    def all(self) -> list[Supervised[H]]:
        """Every worker, by vrank."""
        return [w for _, w in sorted(self._workers.items())]

    def states(self) -> dict[int, WorkerState]:
        return {w.vrank: w.state for w in self.all()}

    def alive(self, worker: Supervised[H]) -> bool:
        """Not reported and still running."""
        return not worker.reported and self._do.do_exit_status(worker) is None

    # -- the escalation -----------------------------------------------------------------
    def stop(self, vranks: Iterable[int], now: float, grace_s: float, reason: str = "") -> None:
        """Ask the workers of ``vranks`` to stop; each is killed if it still runs after
        ``grace_s``. Unknown, ended and already stopping workers (with an earlier deadline)
        are left alone; its exit will count as stopped."""
        for vrank in vranks:
            w = self._workers.get(vrank)
            if w is None or not self.alive(w) or not w.escalation.stop(now, grace_s):
                continue
            w.state = replace(w.state, stopping=True)
            self._do.do_stop(w)
            logger.info("%s stopping vrank %d (%s)%s", self.name, vrank, self._do.do_describe(w),
                        f": {reason}" if reason else "")

    def kill(self, worker: Supervised[H], now: float, why: str) -> None:
        """Kill ``worker`` at once (its device was lost or released): its exit, even one
        that came before, counts as stopped."""
        worker.state = replace(worker.state, stopping=True)
        if not self.alive(worker):
            return
        logger.info("%s %s: killing vrank %d (%s)", self.name, why, worker.vrank,
                    self._do.do_describe(worker))
        worker.escalation.killed(now, self.backstop_s)
        self._do.do_kill(worker)

    def sweep(self, now: float, hold: Callable[[Supervised[H]], bool] | None = None
              ) -> list[WorkerExited]:
        """Escalate what is due at ``now`` (a kill once a stop's grace ran out, the backstop
        once a kill was ignored) and report the workers that ended, by vrank: each once.
        An ended worker for which ``hold`` is true is reported at a later sweep."""
        out = []
        for w in self.all():
            if w.reported:
                continue
            code = self._do.do_exit_status(w)
            if code is None:
                self._escalate(w, now)
                continue
            if hold is not None and hold(w):
                continue
            w.reported = True
            w.state = replace(w.state, returncode=code)
            self._do.do_ended(w)
            out.append(WorkerExited(w.vrank, w.state.generation, w.state.device, code,
                                    w.state.stopping))
        return out

    def close(self, now: float, grace_s: float, linger_s: float,
              refresh: Callable[[], None] = lambda: None) -> list[Supervised[H]]:
        """Stop every worker still running with ``grace_s``, escalate as :meth:`sweep` does
        while waiting, and return those still running ``grace_s + linger_s`` later (blocks;
        real time, from the backend's clock at ``now``). ``refresh`` is called before each
        look (what the backend reads its workers' ends from). Ends are not reported: the
        backend is closing."""
        t0 = time.monotonic()
        live = [w for w in self.all() if self.alive(w)]
        self.stop([w.vrank for w in live], now, grace_s, "closing")
        while True:
            refresh()
            live = [w for w in live if self.alive(w)]
            elapsed = time.monotonic() - t0
            if not live or elapsed >= grace_s + linger_s:
                return live
            for w in live:
                self._escalate(w, now + elapsed)
            time.sleep(0.02)

    def _escalate(self, w: Supervised[H], now: float) -> None:
        due = w.escalation.due(now)
        if due == "kill":
            logger.warning("%s vrank %d (%s) ignored its stop for its grace; killing it",
                           self.name, w.vrank, self._do.do_describe(w))
            self._do.do_kill(w)
            w.escalation.killed(now, self.backstop_s)
        elif due == "backstop":
            logger.warning("%s vrank %d (%s) outlived its kill by %.0f s", self.name, w.vrank,
                           self._do.do_describe(w), self.backstop_s or 0.0)
            self._do.do_backstop(w)
