"""What a restarted coordinator takes up from the record (pure).

A coordinator killed mid-training leaves its workers running. Restarted on the same record, it
finds the open generation (layout, vranks, the step it reached), the workers recorded at their
launch (pid and start time, :func:`launched`), and asks the backend which of them still run
(``adopt``: the same processes, not a reused pid). :func:`reattach` then decides: some
worker of the open generation alive, and no commit recorded past it (a commit the killed
coordinator did not act on: the workers left the layout the record has), gives
:class:`Reattach` — the layout taken up, the step it is at, its members found dead (a loss:
their devices count as failed and the first decision resizes around them, from a replica or
rebuilt from peer copies or a checkpoint with the lost steps trained again, as after a node
lost without grace), the live workers outside it (joiners of the resize the restart closed
as aborted) to stop. Anything else (no member alive, a commit past it, a member's process
of a later generation) gives :class:`Refuse`: every live worker is stopped and the first
layout starts again (from the newest checkpoint). The loop performs either
(``restart.reattach``).
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slurm_etc.alloc.topology import Device
from slurm_etc.lifecycle import ResizeOutcome
from slurm_etc.plan.config import Layout, ParallelConfig

from .backend import WorkerState

if TYPE_CHECKING:
    from slurm_etc.store.jobs import EventInfo, GenerationInfo, JobDetail


@dataclass(frozen=True)
class Reattach:
    """Take up the open generation: its layout on ``vranks``, from ``step`` (and the last
    loss recorded); ``idle``: live workers outside the layout, to stop; ``dead``: members of
    the layout not alive, lost."""

    generation: int
    layout: Layout
    vranks: Mapping[int, Device]
    step: int
    loss: float | None
    idle: frozenset[int]
    dead: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Refuse:
    """The open generation cannot be taken up (``missing``: its vranks not alive, all of
    them where no other reason applies); every live worker stops and the job starts again."""

    generation: int
    missing: tuple[int, ...]


def launched(events: Iterable[EventInfo]) -> dict[int, WorkerState]:
    """The workers recorded at their launch, by vrank (events oldest first: a vrank's newest
    launch wins); a launch event that does not parse is skipped."""
    out: dict[int, WorkerState] = {}
    for e in events:
        p = e.payload
        if e.kind != "launch" or not isinstance(p, dict) or not isinstance(p.get("pid"), int):
            continue
        try:
            out[int(p["vrank"])] = WorkerState(int(p["vrank"]), int(p["generation"]),
                                               Device.parse(p["device"]), p["pid"],
                                               start=p.get("start"))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def open_generation(detail: JobDetail) -> GenerationInfo | None:
    """The newest generation the record has not closed (None: none is open)."""
    open_gens = [g for g in detail.generations if g.ended_at is None]
    return max(open_gens, key=lambda g: g.number) if open_gens else None


def reattach(detail: JobDetail, gen: GenerationInfo, workers: Mapping[int, WorkerState],
             alive: Collection[int]) -> Reattach | Refuse:
    """Whether generation ``gen`` of ``detail`` is taken up with the ``alive`` vranks of the
    ``workers`` launched (the rules in the module doc)."""
    here = sorted((v.rank, v.vrank, Device(v.node, v.local_index))
                  for v in detail.vranks if v.generation == gen.number and v.rank is not None)
    members = tuple(v for _r, v, _d in here)
    missing = tuple(sorted(set(members) - set(alive)))
    moved_on = any(m.outcome == ResizeOutcome.COMMITTED and m.to_generation > gen.number
                   for m in detail.migrations)
    if not members or len(missing) == len(members) or moved_on or any(
            workers[v].generation > gen.number for v in members if v in alive):
        return Refuse(gen.number, missing)
    text = gen.layout
    config = ParallelConfig.parse(text.replace(",dist-opt", ""), "dist-opt" in text)
    return Reattach(gen.number, Layout(config, members), {v: d for _r, v, d in here},
                    max(gen.last_step or 0, gen.first_step or 0), gen.last_loss,
                    frozenset(set(alive) - set(members)), frozenset(missing))
