"""Whether a job with nothing training has anything left to wait for (pure).

A coordinator whose workers are gone, or that never found devices the model fits, waits
for devices only while they can still come: a node request pending that the cluster can
still grant (a Slurm member queued in a partition with the nodes for it). With none, it
would pause forever; :func:`outlook` bounds that wait. The rules, in order:

1. something goes on (a worker of the layout runs or is starting, a resize is in flight,
   events wait for their decision, training is ending): :class:`GoesOn`;
2. a node request is pending that can still be met: :class:`Waits`, for as long as it
   takes (the policy's patience withdraws it and asks for less; ``status`` says what it
   waits for);
3. otherwise the job is stranded, since the first time the loop saw it so: :class:`Stranded`
   until ``bound_s`` passed, then :class:`GiveUp` with the one line the job fails with
   (why, and what would help).

``now`` and ``since`` are passed in; the loop keeps ``since`` (the ``since`` of the last
:class:`Stranded`, None otherwise) and performs the outcome (``deciding.check_outlook``).
"""
from __future__ import annotations

from dataclasses import dataclass

# How long a coordinator with nothing to train on and no node request that can be met
# waits (for a grant nobody asked for, an admin) before the job ends failed.
DEFAULT_GIVE_UP_AFTER_S = 600.0


@dataclass(frozen=True)
class Prospects:
    """What the job could go on with, as the loop sees it now.

    Attributes:
        busy: a worker of the layout runs (or was launched and is starting), a resize is
            in flight, events wait for a decision, or training is ending.
        idle_why: why nothing trains (no device held, no configuration fits the usable
            devices, every worker of the layout exited), for the lines below.
        request_nodes: nodes of the node request pending (0: none).
        request_met: whether the cluster can still grant that request.
        request_since: when it was sent (unix seconds; None: not known, e.g. sent again at
            a restart).
        request_held: why the cluster holds it, as the backend last saw (Slurm's pending
            Reason, e.g. ``QOSMaxNodePerUserLimit``: a limit ``policy apply`` set); "": none.
    """

    busy: bool
    idle_why: str = ""
    request_nodes: int = 0
    request_met: bool = True
    request_since: float | None = None
    request_held: str = ""


@dataclass(frozen=True)
class GoesOn:
    """Something trains or is under way."""


@dataclass(frozen=True)
class Waits:
    """Nothing trains; a node request that can be met is pending (``what``: for status)."""

    what: str


@dataclass(frozen=True)
class Stranded:
    """Nothing trains and nothing can come, since ``since``; the job ends at ``ends_at``
    unless something does (``what``: for status)."""

    since: float
    ends_at: float
    what: str


@dataclass(frozen=True)
class GiveUp:
    """Stranded past the bound: the job ends failed with ``line``."""

    line: str


Outlook = GoesOn | Waits | Stranded | GiveUp

HELP = "give the job devices its model fits (more nodes, a smaller model) and run it again"


def outlook(p: Prospects, since: float | None, now: float, bound_s: float) -> Outlook:
    """What a job with prospects ``p`` does at ``now`` (the rules in the module doc);
    ``since``: when it was first seen stranded (None: it was not). The lines put what
    matters first: the record keeps 250 characters of a reason."""
    if p.busy:
        return GoesOn()
    why = p.idle_why or "nothing trains"
    if p.request_nodes and p.request_met:
        return Waits(f"waiting for {p.request_nodes} node(s) requested"
                     + (f" at {_clock(p.request_since)}" if p.request_since else "")
                     + (f" (pending: {p.request_held})" if p.request_held else "")
                     + f": {why}")
    start = now if since is None else since
    request = (f"its request for {p.request_nodes} node(s) cannot be met" if p.request_nodes
               else "no node request that can be met is pending")
    if now - start >= bound_s:
        return GiveUp(f"nothing to train on for {now - start:.0f} s (--give-up-after "
                      f"{bound_s:g}) and {request}: {HELP}; {why}")
    return Stranded(start, start + bound_s,
                    f"stranded since {_clock(start)}, fails at {_clock(start + bound_s)} "
                    f"unless devices come ({request}): {why}")


def _clock(t: float) -> str:
    """``HH:MM:SS`` UTC of unix time ``t`` (a status line that does not change each turn)."""
    import time

    return time.strftime("%H:%M:%S UTC", time.gmtime(t))
