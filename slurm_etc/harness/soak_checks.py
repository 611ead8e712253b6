"""The checks of ``slurm-etc soak``: pure functions over what the soak observed (the job's
record as plain data, the losses heard, the oracle's losses, the processes found), each
returning what it found wrong. No I/O: the soak (:mod:`.soak`) gathers, these judge, and the
tests plant a bug in the observations to show each check catches it
(tests/unit/test_soak.py).

* :func:`final_history`: every step 1..N in the final history exactly once. A generation
  starts where the one before it ended, or earlier only by steps recorded as lost (the
  committed migration into it names them: rebuilt from a copy or a checkpoint and trained
  again); anything else is a step trained twice unrecorded, or a step never trained.
* :func:`diverged_steps`: every step's final loss (the last heard for it) bit-equal to the
  oracle's (megatron-core's checkpoint-restart through the same layouts).
* :func:`record_problems`: the record consistent: the job finished, every migration
  committed or aborted, the generations that trained contiguous (each after the first
  entered by one committed migration from the one before it), every generation closed, the
  lease released.
* leaked processes: any process of the job alive after it ended (the soak lists them).
"""
from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GenerationSeen:
    """One generation as the record has it: ``first_step`` is the step its state was at
    when it opened (it trains from the next), ``last_step`` the last it trained."""

    number: int
    layout: str
    first_step: int | None
    last_step: int | None
    closed: bool = True


@dataclass(frozen=True)
class MigrationSeen:
    """One migration (resize) as the record has it."""

    id: int
    from_generation: int
    to_generation: int
    outcome: str | None
    lost_steps: tuple[int, int] | None = None


@dataclass(frozen=True)
class RecordSeen:
    """The parts of a job's record the checks read."""

    state: str
    generations: tuple[GenerationSeen, ...]
    migrations: tuple[MigrationSeen, ...]
    lease_released: bool = True


@dataclass(frozen=True)
class History:
    """The final history: which generation's training of each step counts.

    Attributes:
        steps: step -> the generation whose training of it is final.
        twice: steps trained again without a record of their loss.
        missing: steps of 1..last never trained.
        segments: (generation, layout, first, last) of the final history, in order (a
            generation whose every step was trained again later has none).
    """

    steps: Mapping[int, int]
    twice: tuple[int, ...]
    missing: tuple[int, ...]
    segments: tuple[tuple[int, str, int, int], ...] = field(default=())

    @property
    def last(self) -> int:
        return max(self.steps, default=0)


def trained(record: RecordSeen) -> list[GenerationSeen]:
    """The generations that trained a step, in order."""
    return sorted((g for g in record.generations
                   if g.first_step is not None and g.last_step is not None),
                  key=lambda g: g.number)


def final_history(record: RecordSeen) -> History:
    """Every step's final generation; steps trained twice without a record, steps never
    trained (see the module doc)."""
    lost: dict[int, list[tuple[int, int]]] = {}
    for m in record.migrations:
        if m.outcome == "committed" and m.lost_steps is not None:
            lost.setdefault(m.to_generation, []).append(m.lost_steps)
    steps: dict[int, int] = {}
    twice: list[int] = []
    carried: list[tuple[int, int]] = []
    for g in trained(record):
        # a rollback recorded into a generation that trained nothing holds for the next
        again = [*lost.get(g.number, ()), *carried]
        # it trains from the step after the one its state was at; where the migration into
        # it rebuilt a lost state, from the first lost step (trained again)
        first = min([int(g.first_step or 0) + 1] + [a for a, _b in again])
        last = int(g.last_step or 0)
        if last < first:  # nothing trained (a generation opened and left at once)
            carried = again
            continue
        carried = []
        done = max(steps, default=0)
        for s in range(first, min(last, done) + 1):
            if not any(a <= s <= b for a, b in again):
                twice.append(s)
        for s in range(first, last + 1):
            steps[s] = g.number
        for s in [s for s in steps if s > last]:  # a rollback before this generation's end
            del steps[s]
    top = max(steps, default=0)
    missing = tuple(s for s in range(1, top + 1) if s not in steps)
    segments: list[tuple[int, str, int, int]] = []
    layouts = {g.number: g.layout for g in record.generations}
    for s in sorted(steps):
        n = steps[s]
        if segments and segments[-1][0] == n and segments[-1][3] == s - 1:
            segments[-1] = (n, layouts[n], segments[-1][2], s)
        else:
            segments.append((n, layouts[n], s, s))
    return History(steps, tuple(sorted(set(twice))), missing, tuple(segments))


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def final_losses(heard: Iterable[tuple[int, float]]) -> dict[int, float]:
    """step -> the last loss heard for it (a step trained again: its replay's)."""
    out: dict[int, float] = {}
    for step, loss in heard:
        out[step] = loss
    return out


def diverged_steps(final: Mapping[int, float], oracle: Mapping[int, float]) -> list[int]:
    """The steps whose final loss is not the oracle's bit for bit (a NaN diverges; a step
    the oracle has not trained diverges)."""
    out = []
    for step, loss in sorted(final.items()):
        want = oracle.get(step)
        if want is None or math.isnan(loss) or _bits(loss) != _bits(want):
            out.append(step)
    return out


def record_problems(record: RecordSeen) -> list[str]:
    """What is inconsistent in the record (one line each; empty: consistent)."""
    out: list[str] = []
    if record.state != "finished":
        out.append(f"the job ended {record.state!r}, not 'finished'")
    for m in record.migrations:
        if m.outcome not in ("committed", "aborted"):
            out.append(f"migration {m.id} ({m.from_generation} -> {m.to_generation}) is "
                       f"left {m.outcome or 'open'}")
    numbers = [g.number for g in record.generations]
    if len(set(numbers)) != len(numbers):
        out.append(f"generation numbers repeat: {sorted(numbers)}")
    into: dict[int, list[MigrationSeen]] = {}
    for m in record.migrations:
        if m.outcome == "committed":
            into.setdefault(m.to_generation, []).append(m)
    ran = trained(record)
    if ran and ran[0].number != 0:
        out.append(f"the first generation that trained is {ran[0].number}, not 0")
    for before, g in zip(ran, ran[1:], strict=False):
        entered = into.get(g.number, [])
        if len(entered) != 1:
            out.append(f"generation {g.number} was entered by {len(entered)} committed "
                       f"migration(s), not 1")
        elif entered[0].from_generation != before.number:
            out.append(f"generation {g.number} was entered from generation "
                       f"{entered[0].from_generation}, but {before.number} trained before it")
    known = set(numbers)
    for number, ms in sorted(into.items()):
        if number not in known:
            out.append(f"migration {ms[0].id} committed generation {number}, which the record "
                       f"does not have")
    for g in record.generations:
        if not g.closed:
            out.append(f"generation {g.number} is still open")
    if not record.lease_released:
        out.append("the job's lease is still held")
    return out


@dataclass(frozen=True)
class Verdict:
    """Every check's finding, and whether the soak passed."""

    steps_twice: tuple[int, ...]
    steps_missing: tuple[int, ...]
    diverged: tuple[int, ...]
    unheard: tuple[int, ...]
    leaked: tuple[int, ...]
    record: tuple[str, ...]
    other: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not (self.steps_twice or self.steps_missing or self.diverged or self.leaked
                    or self.record or self.other)


def judge(record: RecordSeen, heard: Sequence[tuple[int, float]],
          oracle: Mapping[int, float], leaked: Sequence[int],
          other: Sequence[str] = ()) -> Verdict:
    """All checks together. ``heard``: (step, loss) in the order heard; ``oracle``: step ->
    loss of the reference; ``leaked``: pids of the job's processes alive at the end;
    ``other``: problems the soak saw while running (a duplicate coordinator accepted)."""
    history = final_history(record)
    final = final_losses(heard)
    unheard = tuple(s for s in history.steps if s not in final)
    return Verdict(history.twice, history.missing,
                   tuple(diverged_steps({s: x for s, x in final.items()
                                         if s <= history.last}, oracle)),
                   unheard, tuple(leaked), tuple(record_problems(record)), tuple(other))
