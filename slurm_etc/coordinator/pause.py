"""A resize's training pause, measured at the step boundaries.

Every process of a new layout reports (:class:`~slurm_etc.protocol.messages.Resumed`) when
its first step in that layout began and when its last step in the old layout ended (a
joiner: when the old layout's last step ended). The difference is that process's training
gap; the migration's pause is the largest gap over the new layout's processes, whatever
happened in between (agreement, warm-up of joiners, preparation of the new world, data
phase, commit vote, switch). The layout's ranks find its widest gap and widest stall
together (one all-reduce) and only those ranks report, each for all the layout
(``Resumed.widest_of``, ``stall_of``); where that all-reduce failed each reports its own.
The time from the coordinator's decision to the start of that gap (planning, launching and
warming up joiners while the old layout trained on) is the preparation, recorded apart.
Measured this way a pause cannot start after planning or end before the first new step,
which a timer around the resize code would let it do.

Training can also stop once before the pause, while the resize is prepared beside it: a
stayer builds the new world (groups, model, DDP, optimizer) at one step boundary of the old
layout (megatron's globals are swapped while it builds: not in a thread). Each process
reports the widest gap between two of its old-layout steps meanwhile; the migration's stall
is the widest over the processes, recorded beside the pause, so the record says every time
training stopped for the resize.

A loss without notice interrupts the step in flight: a process whose collective failed says
when (``failed_at``). The gap stays the pause (training stopped all that time); its part
before the failure, the step's work lost with the node, is recorded apart as ``interrupted``,
so the recovery (failure to first new step) is the pause less it.

Pure: the coordinator feeds reports in and writes what comes out.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from slurm_etc.protocol.messages import Resumed


@dataclass(frozen=True)
class ProcessGap:
    """One process's training gap across a resize (unix seconds)."""

    vrank: int
    last_ended: float
    started: float
    joined: bool = False
    stalled: float = 0.0
    failed_at: float | None = None

    @property
    def seconds(self) -> float:
        return self.started - self.last_ended

    @property
    def interrupted(self) -> float:
        """The part of the gap before this process's step in flight failed (0: none did)."""
        if self.failed_at is None:
            return 0.0
        return min(max(0.0, self.failed_at - self.last_ended), max(0.0, self.seconds))


@dataclass(frozen=True)
class MeasuredPause:
    """A migration's pause: the largest gap over the new layout's processes.

    Attributes:
        seconds: the largest gap.
        paused_at, resumed_at: where that gap lies (unix seconds).
        preparation_seconds: from the decision to ``paused_at`` (0 when training had
            already stopped when the coordinator decided, as on a node lost).
        processes: how many processes' gaps the largest is taken over.
        vrank: the process whose gap it is.
        stall_seconds: the widest gap between two old-layout steps of any of them while the
            resize was prepared beside training (0: none).
        stall_vrank: the process whose stall that is.
        interrupted_seconds: of the pause, the part before that process's step in flight
            failed (a loss without notice: the step's work lost with the node; 0: none).
    """

    seconds: float
    paused_at: float
    resumed_at: float
    preparation_seconds: float
    processes: int
    vrank: int
    stall_seconds: float = 0.0
    stall_vrank: int | None = None
    interrupted_seconds: float = 0.0


def measured_pause(gaps: Iterable[ProcessGap], decided_at: float,
                   processes: int | None = None) -> MeasuredPause | None:
    """The pause of one migration from its processes' gaps (None: no gap known);
    ``processes``: how many the gaps stand for (default: as many as there are; the
    widest gap and stall a layout found together stand for all of it)."""
    known = list(gaps)
    if not known:
        return None
    # ties go to the lowest vrank, so every run of the same reports records the same
    widest = max(known, key=lambda g: (g.seconds, -g.vrank))
    stalled = max(known, key=lambda g: (g.stalled, -g.vrank))
    return MeasuredPause(widest.seconds, widest.last_ended, widest.started,
                         max(0.0, widest.last_ended - decided_at),
                         len(known) if processes is None else processes, widest.vrank,
                         stalled.stalled, stalled.vrank if stalled.stalled > 0 else None,
                         widest.interrupted)


@dataclass
class _Committed:
    migration_id: object
    expected: frozenset[int]
    decided_at: float


@dataclass
class _Widest:
    """What the layout's ranks found together (``Resumed.widest_of``, ``stall_of``): the
    report of the widest gap and of the widest stall, each standing for ``processes``."""

    # (the report's gap,): its gap may be unknown (None); None: no such report yet
    gap: tuple[ProcessGap | None] | None = None
    stall: tuple[ProcessGap | None] | None = None
    processes: int = 0

    @property
    def complete(self) -> bool:
        return self.gap is not None and self.stall is not None

    def gaps(self) -> dict[int, ProcessGap]:
        """The known gaps of the reports, by vrank (one rank may be both)."""
        return {g.vrank: g for got in (self.gap, self.stall) if got is not None
                for g in got if g is not None}


@dataclass
class PauseTracker:
    """Collects the Resumed reports of each generation and yields a migration's pause once
    every process of its new layout reported, or the ranks of its widest gap and stall
    reported for all of it (or, at :meth:`flush`, from those that did).

    A report may come before the coordinator settled the resize that it follows (the first
    new step can begin before the last Resized report is read): reports wait for the
    commit."""

    _gaps: dict[int, dict[int, ProcessGap | None]] = field(default_factory=dict)
    _widest: dict[int, _Widest] = field(default_factory=dict)
    _committed: dict[int, _Committed] = field(default_factory=dict)

    def add(self, report: Resumed) -> list[tuple[object, MeasuredPause]]:
        """One process's report; the pauses it completes."""
        gap = (None if report.last_ended is None else
               ProcessGap(report.vrank, report.last_ended, report.started, report.joined,
                          report.stalled if math.isfinite(report.stalled)
                          and report.stalled > 0 else 0.0,
                          report.failed_at if report.failed_at is not None
                          and math.isfinite(report.failed_at) else None))
        if report.widest_of or report.stall_of:
            found = self._widest.setdefault(report.generation, _Widest())
            if report.widest_of:
                found.gap = (gap,)
            if report.stall_of:
                found.stall = (gap,)
            found.processes = max(found.processes, report.widest_of, report.stall_of)
        else:
            self._gaps.setdefault(report.generation, {})[report.vrank] = gap
        return self._complete(report.generation, partial=False)

    def committed(self, generation: int, migration_id: object, new_devices: Iterable[int],
                  decided_at: float) -> list[tuple[object, MeasuredPause]]:
        """The resize into ``generation`` committed: its pause is complete once every
        process of ``new_devices`` reported."""
        self._committed[generation] = _Committed(migration_id, frozenset(new_devices),
                                                 decided_at)
        return self._complete(generation, partial=False)

    def flush(self) -> list[tuple[object, MeasuredPause]]:
        """The pauses of every committed resize from the reports there are (the job ends;
        a process that never reported, e.g. it died, counts for nothing)."""
        out = []
        for generation in sorted(self._committed):
            out += self._complete(generation, partial=True)
        return out

    def _complete(self, generation: int, *, partial: bool) -> list[tuple[object, MeasuredPause]]:
        done = self._committed.get(generation)
        got = self._gaps.get(generation, {})
        found = self._widest.get(generation)
        together = found is not None and found.complete
        # counted first: asked at each report, it looks at each process only once as many
        # reported as the new layout has (O(1) a report, not a set of every report's vrank)
        if done is None or (not partial and not together and (
                len(got) < len(done.expected) or not all(v in got for v in done.expected))):
            return []
        del self._committed[generation]
        self._gaps.pop(generation, None)
        self._widest.pop(generation, None)
        gaps = {v: g for v, g in got.items() if g is not None and v in done.expected}
        processes = None
        if found is not None:  # the layout's own finding stands for every process of it
            gaps.update((v, g) for v, g in found.gaps().items() if v in done.expected)
            processes = max(found.processes, len(gaps))
        pause = measured_pause(gaps.values(), done.decided_at, processes)
        return [] if pause is None else [(done.migration_id, pause)]
