"""What a backend's events make of the devices the job holds: pure functions of the
:class:`~.reconcile.Holdings` and the event (no record, no backend, no clock of their own).
The loop records the event, then takes up what these return (``Coordinator.holdings``).

- **grant**: the devices are held by the granting allocation and whole again, whatever
  happened to them under an earlier one (a worker killed there, a loss): neither lost nor
  under notice;
- **notice**: the devices leave at the deadline (a preemption's grace);
- **loss**: the devices of that allocation are lost now (a device already another
  allocation's is not: the loss is of the earlier one);
- **failed**: a device whose worker died unexplained, or never joined, counts as lost by
  failure;
- **to_release** / **released**: the devices given back at a decision (those set aside at
  a commit and those under notice, outside the layout and the anchor) and the holdings
  without them.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import replace

from slurm_etc.alloc.topology import Device

from .reconcile import Holdings


def grant(held: Holdings, devices: Iterable[Device], allocation: str) -> Holdings:
    """``devices`` granted to the job by ``allocation``."""
    got = set(devices)
    return replace(held, held={**held.held, **{d: allocation for d in got}},
                   notices={d: n for d, n in held.notices.items() if d not in got},
                   lost=held.lost - got)


def notice(held: Holdings, devices: Iterable[Device], deadline: float) -> Holdings:
    """``devices`` leave at ``deadline`` (unix seconds): a preemption's notice."""
    return replace(held, notices={**held.notices,
                                  **{d: (deadline, "preemption") for d in devices}})


def loss(held: Holdings, devices: Iterable[Device], allocation: str, cause: str,
         now: float) -> Holdings:
    """``allocation`` lost ``devices`` at ``now`` (``cause`` "failure", else a
    preemption); a device held by another allocation since is not lost."""
    gone = {d for d in devices if held.held.get(d, allocation) == allocation}
    why = "failure" if cause == "failure" else "preemption"
    return replace(held, lost=held.lost | gone,
                   notices={**held.notices, **{d: (now, why) for d in gone}})


def failed(held: Holdings, devices: Iterable[Device], now: float) -> Holdings:
    """``devices`` count as failed at ``now`` (their worker died or never joined)."""
    gone = set(devices)
    return replace(held, lost=held.lost | gone,
                   notices={**held.notices, **{d: (now, "failure") for d in gone}})


def to_release(held: Holdings, set_aside: Collection[Device],
               anchor: Collection[Device]) -> frozenset[Device]:
    """The devices to give back now: those set aside at a commit and those under notice,
    less the layout's and the anchor's, of those held."""
    in_layout = ({held.vranks[v] for v in held.layout.devices} if held.layout is not None
                 else set())
    leaving = {d for d in held.held if d in held.notices and d not in in_layout}
    return frozenset(((set(set_aside) | leaving) - in_layout - set(anchor)) & set(held.held))


def released(held: Holdings, devices: Iterable[Device]) -> Holdings:
    """The holdings once ``devices`` are given back."""
    gone = set(devices)
    return replace(held, held={d: a for d, a in held.held.items() if d not in gone},
                   notices={d: n for d, n in held.notices.items() if d not in gone})
