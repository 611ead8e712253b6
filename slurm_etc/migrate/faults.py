"""Explicit fault injection for executor tests: make rank k fail at a named point of round r.

    faults = FaultInjector().fail(rank=2, at="before", round=1).stall(rank=5, round=0)

Points, in the order a step meets them (``rank`` is the migration-group rank):

* ``start``: while checking the old shards, before anything moves;
* ``pack``: while packing the first chunk of round ``round``'s outgoing message;
* ``before``: just before the vote that opens round ``round``;
* ``local``: during the local copies (which run alongside the first step);
* ``unpack``: while unpacking the first chunk received in round ``round``;
* ``after``: after the last step of round ``round``;
* ``commit``: just before the final (commit) vote.

``stall(rank, round)`` makes the rank skip its sends of that round without telling anyone,
so its peers' receives time out: the timeout path, driven by the plan, with no sleeps.

``kill(rank, at)`` makes the process itself die by SIGKILL (no exception, no vote, no
goodbye: what a crashed or OOM-killed worker does) at one phase of a resize, in the order a
resize meets them (:data:`KILL_PHASES`):

* ``before-send``: before the first vote, nothing of its sends posted;
* ``mid-transfer``: right after posting its first sends/receives (data on the wire);
* ``after-receive``: right after unpacking the first chunk it received;
* ``before-commit``: just before the commit vote, every transfer done;
* ``in-vote``: inside the commit vote: its own vote sent, the outcome not yet known (the
  survivors' views of the vote may differ; :mod:`slurm_etc.migrate.decision` makes them
  follow one decision);
* ``after-commit``: the commit vote passed, before the new layout is installed.

``lose_vote(rank)`` makes the rank's view of the commit vote fail as if its transport had
(the others saw every vote OK): the split that a death inside the vote can cause, made
deterministic.

:class:`KillSpec` is the reusable form for whole jobs (a trainer's ``hooks.kill``, which
:mod:`slurm_etc.testing` sets from ``SLURM_ETC_INJECT`` and ``slurm-etc demo --inject``):
which phase, which vrank (default: one the plan has do that phase) and which generation's
resize.

The injector is a frozen value: it pickles to worker processes and every call returns a new one.
"""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..errors import InternalError

if TYPE_CHECKING:
    from slurm_etc.plan.plan import MigrationPlan

logger = logging.getLogger(__name__)

FAULT_POINTS = ("start", "pack", "before", "local", "unpack", "after", "commit")
KILL_PHASES = ("before-send", "mid-transfer", "after-receive", "before-commit", "in-vote",
               "after-commit")


class InjectedFault(InternalError, RuntimeError):
    """Raised where a FaultInjector says so."""


@dataclass(frozen=True)
class FaultInjector:
    faults: tuple[tuple[int, str, int], ...] = ()
    stalls: tuple[tuple[int, int], ...] = ()
    kills: tuple[tuple[int, str], ...] = ()
    lost_votes: tuple[int, ...] = ()

    def fail(self, rank: int, at: str = "before", round: int = 0) -> "FaultInjector":
        if at not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {at!r}; points: {', '.join(FAULT_POINTS)}")
        return replace(self, faults=self.faults + ((rank, at, round),))

    def stall(self, rank: int, round: int = 0) -> "FaultInjector":
        return replace(self, stalls=self.stalls + ((rank, round),))

    def lose_vote(self, rank: int) -> "FaultInjector":
        """Rank ``rank``'s view of the commit vote fails (the others' does not)."""
        return replace(self, lost_votes=self.lost_votes + (rank,))

    def vote_lost(self, rank: int) -> bool:
        return rank in self.lost_votes

    def kill(self, rank: int, at: str) -> "FaultInjector":
        """SIGKILL the process of migration-group rank ``rank`` at phase ``at``."""
        if at not in KILL_PHASES:
            raise ValueError(f"unknown kill phase {at!r}; phases: {', '.join(KILL_PHASES)}")
        return replace(self, kills=self.kills + ((rank, at),))

    def die_if(self, rank: int, at: str) -> None:
        """This process dies here by SIGKILL if (rank, at) is armed."""
        if (rank, at) in self.kills:
            logger.warning("fault injection: migration rank %d killing itself (SIGKILL) at %s",
                           rank, at)
            for h in logging.getLogger().handlers + logger.handlers:
                h.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def check(self, rank: int, at: str, round: int = 0) -> None:
        """Raise InjectedFault if (rank, at, round) is armed (round is ignored for
        ``start``, ``local`` and ``commit``)."""
        for r, a, rd in self.faults:
            if r == rank and a == at and (rd == round or at in ("start", "local", "commit")):
                where = at if at in ("start", "local", "commit") else f"{at} of round {round}"
                raise InjectedFault(f"injected fault at {where}")

    def stalled(self, rank: int, round: int) -> bool:
        return (rank, round) in self.stalls


@dataclass(frozen=True)
class KillSpec:
    """``<phase>[@[<vrank>][,<generation>]]``: the worker of ``vrank`` kills itself at
    ``phase`` of the resize to ``generation`` (default: the first resize, generation 1).

    Without a vrank the victim is the highest vrank the plan has do that phase: a sender for
    ``before-send``, a receiver for ``after-receive``, one that sends or receives for
    ``mid-transfer``, any participant for the commit phases. Every worker computes the same
    victim from the same plan; only the victim acts.
    """

    phase: str
    vrank: int | None = None
    generation: int = 1

    @classmethod
    def parse(cls, text: str) -> "KillSpec":
        """Parse the spec; ValueError with one line saying what is wrong and what is right."""
        form = "<phase>[@<vrank>[,<generation>]], e.g. mid-transfer or after-commit@3,1"
        phase, _, where = text.strip().partition("@")
        if phase not in KILL_PHASES:
            raise ValueError(f"injection {text!r}: unknown phase {phase!r}; phases: "
                             f"{', '.join(KILL_PHASES)} (form {form})")
        if not where:
            return cls(phase)
        vrank, _, gen = where.partition(",")
        try:  # an empty vrank (``phase@,G``): the default victim, at generation G
            v = int(vrank) if vrank.strip() else None
            g = int(gen) if gen else 1
        except ValueError:
            raise ValueError(f"injection {text!r}: vrank and generation must be integers "
                             f"(form {form})") from None
        if (v is not None and v < 0) or g < 1:
            raise ValueError(f"injection {text!r}: vrank must be >= 0 and generation >= 1 "
                             f"(form {form})")
        return cls(phase, v, g)

    @classmethod
    def parse_many(cls, text: str) -> "KillSpec":
        """Several specs separated by ``;`` (each as :meth:`parse`; e.g. ``before-send@,2;
        after-commit@,5``): a :class:`KillSchedule` where there are several, the one spec
        where there is one."""
        parts = [p for p in text.split(";") if p.strip()]
        if len(parts) == 1:
            return cls.parse(parts[0])
        if not parts:
            raise ValueError(f"injection {text!r}: no kill spec in it")
        specs = tuple(KillSpec.parse(p) for p in parts)
        return KillSchedule(specs[0].phase, specs[0].vrank, specs[0].generation, specs)

    def victim(self, plan: MigrationPlan) -> int | None:
        """The vrank that dies in ``plan`` (None: nobody in the plan does the phase)."""
        if self.vrank is not None:
            return self.vrank if self.vrank in plan.participants else None
        m = plan.messages
        senders = {int(x) for x in m.src}
        receivers = {int(x) for x in m.dst}
        pick = {"before-send": senders, "after-receive": receivers,
                "mid-transfer": senders | receivers}.get(self.phase, set(plan.participants))
        return max(pick, default=None)

    def injector(self, plan: MigrationPlan, device: int, generation: int) -> FaultInjector:
        """The injector of ``device``'s side of the resize to ``generation``: armed on the
        victim only."""
        if generation != self.generation or self.victim(plan) != device:
            return FaultInjector()
        return FaultInjector().kill(plan.participants.index(device), self.phase)



@dataclass(frozen=True)
class KillSchedule(KillSpec):
    """Several :class:`KillSpec` armed together (``slurm-etc soak`` arms one per drawn
    phase kill, each at its own generation): a device's injector kills it at every phase a
    spec of that generation names it the victim of (its first own field repeats the first
    spec's, as a KillSpec)."""

    specs: tuple[KillSpec, ...] = ()

    def injector(self, plan: MigrationPlan, device: int, generation: int) -> FaultInjector:
        out = FaultInjector()
        for spec in self.specs:
            for rank, at in spec.injector(plan, device, generation).kills:
                out = out.kill(rank, at)
        return out
