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
The injector is a frozen value: it pickles to worker processes and every call returns a new one.
"""
from __future__ import annotations

from dataclasses import dataclass

FAULT_POINTS = ("start", "pack", "before", "local", "unpack", "after", "commit")


class InjectedFault(RuntimeError):
    """Raised where a FaultInjector says so."""


@dataclass(frozen=True)
class FaultInjector:
    faults: tuple[tuple[int, str, int], ...] = ()
    stalls: tuple[tuple[int, int], ...] = ()

    def fail(self, rank: int, at: str = "before", round: int = 0) -> "FaultInjector":
        if at not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {at!r}; points: {', '.join(FAULT_POINTS)}")
        return FaultInjector(self.faults + ((rank, at, round),), self.stalls)

    def stall(self, rank: int, round: int = 0) -> "FaultInjector":
        return FaultInjector(self.faults, self.stalls + ((rank, round),))

    def check(self, rank: int, at: str, round: int = 0) -> None:
        """Raise InjectedFault if (rank, at, round) is armed (round is ignored for
        ``start``, ``local`` and ``commit``)."""
        for r, a, rd in self.faults:
            if r == rank and a == at and (rd == round or at in ("start", "local", "commit")):
                where = at if at in ("start", "local", "commit") else f"{at} of round {round}"
                raise InjectedFault(f"injected fault at {where}")

    def stalled(self, rank: int, round: int) -> bool:
        return (rank, round) in self.stalls
