"""The local driver's side of the control seam: orders from a script instead of a coordinator.

Each process holds its own :class:`ScriptedControl` over the same script. An entry
``(at_step, order, recipients)`` is handed to the processes in ``recipients`` (all when
None) once their trainer has trained ``at_step`` steps; a joining process, which trains
nothing before it is brought in, gets the first order naming it at once (it then waits in the
resize's rendezvous for the others to reach the step). Telling only one old rank and the
joiners is enough: the trainer's step-boundary agreement spreads an order to every rank.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..protocol.messages import Order, Report


@dataclass(frozen=True)
class ScriptEntry:
    at_step: int
    order: Order
    recipients: frozenset[int] | None = None


@dataclass
class ScriptedControl:
    """``Control`` from a script (see the module doc).

    Attributes:
        script: the entries, in generation order.
        vrank: this process.
        clock: the trainer's current step.
        after_generation: entries of this generation or older are never handed out (a
            process that left and joins again).
        reports: every report the trainer sent, in order.
    """

    script: Sequence[ScriptEntry]
    vrank: int
    clock: Callable[[], int]
    after_generation: int = -1
    reports: list[Report] = field(default_factory=list)
    _given: set[int] = field(default_factory=set)

    def _mine(self, entry: ScriptEntry) -> bool:
        return ((entry.recipients is None or self.vrank in entry.recipients)
                and entry.order.generation > self.after_generation)

    def poll(self) -> Order | None:
        step = self.clock()
        for i, entry in enumerate(self.script):
            if i not in self._given and self._mine(entry) and step >= entry.at_step:
                self._given.add(i)
                return entry.order
        return None

    def wait(self, timeout_s: float) -> Order | None:
        for i, entry in enumerate(self.script):
            if i not in self._given and self._mine(entry):
                self._given.add(i)
                return entry.order
        return None

    def report(self, message: Report) -> None:
        self.reports.append(message)
