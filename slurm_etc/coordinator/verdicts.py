"""The loop's own decisions as pure functions: what it concludes from what it holds, the
workers' states and the time, without asking the backend, the record or the channel.

``loop.py`` gathers the inputs (a poll of the backend's workers, a listing of the
checkpoint directory, the clock) and carries out what a verdict says: start again, stop
with one line, withdraw a request, use anchor devices again. Each is tested by a table in
``tests/unit/test_verdicts.py``, without sockets or a record.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import msgspec

from slurm_etc.alloc.topology import Device
from slurm_etc.plan import Layout
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.protocol.messages import ORDER_DECODER, Resize

from .backend import WorkerState

# how often an anchor device whose worker died is used again when nothing else fits
MAX_REUSES = 3
# What a worker that never joined most likely got wrong.
NEVER_JOINED_HINT = "TRAIN_CMD must run a script that ends in run_worker(trainer)"
# How long the withdrawal of an overdue request waits after the last look (s).
OVERDUE_EVERY_S = 60.0


def finished(layout: Layout | None, done: Collection[int]) -> bool:
    """Every worker of the layout said it finished training (O(1) a turn until the count
    of those done reaches the layout's)."""
    return layout is not None and len(done) >= len(layout.devices) and \
        all(v in done for v in layout.devices)


def step_decided_the_order(key: str, value: bytes, old_prefix: str, generation: int) -> bool:
    """Whether a first value the store set (``key``, ``value``: its hook) is a step's
    decision in the old layout (whose keys are under ``old_prefix``) holding the order that
    opens ``generation``: every rank of that layout then reads the order from the store,
    and none of them needs it sent again."""
    if value == b"-" or not key.endswith("/decided") or \
            not key.startswith(old_prefix + "/agree"):
        return False
    try:
        order = ORDER_DECODER.decode(value)
    except msgspec.DecodeError:
        return False
    return isinstance(order, Resize) and order.generation == generation


def stop_generation(generation: int, last_generation: int) -> int:
    """A Stop's generation: past every one ordered (an aborted resize's included), so that
    no worker takes it for a copy of an order it has carried out or given up."""
    return max(generation, last_generation) + 1


def anyone_left(layout: Layout, workers: Mapping[int, WorkerState],
                found_dead: Collection[int]) -> bool:
    """Whether some worker of ``layout`` may still train: one running, or one the backend
    never reported (it may be starting) that a restart did not find dead. Stops at the
    first such worker: asked every turn, O(1) while the job trains."""
    return any((w is None and v not in found_dead) or (w is not None and w.running)
               for v, w in ((v, workers.get(v)) for v in layout.devices))


@dataclass(frozen=True)
class StartAgain:
    """Nothing of the layout lives and the state can come back: the first layout again."""

    why: str


@dataclass(frozen=True)
class Stop:
    """Nothing of the layout lives and nothing can bring it back: the job fails with
    ``line``."""

    line: str


def none_left(*, generation: int, step: int, members: int, reattached: bool,
              came_back: bool, newest: int | None, exits: Iterable[WorkerState],
              said: str | None) -> StartAgain | Stop:
    """What a job does once every worker of its layout exited and nothing is pending: a
    reattached layout none of whose workers came back starts again, as does one whose state
    a checkpoint (of step ``newest``) holds; otherwise the job stops, with the reason a
    worker gave (``said``) where one did."""
    if reattached and not came_back:
        return StartAgain(f"coordinator restarted: none of the {members} worker(s) of "
                          f"generation {generation} came back after the restart")
    if newest is not None:
        return StartAgain(f"every worker of generation {generation} exited at step {step}: "
                          f"the first layout again, from the checkpoint of step {newest}")
    codes = ", ".join(f"vrank {w.vrank}: {w.returncode}" for w in exits)
    if said is not None:
        return Stop(f"every worker of generation {generation} exited ({codes}) at step "
                    f"{step}: {said}")
    return Stop(f"every worker of generation {generation} exited ({codes}) at step {step} "
                "and nothing is pending: nothing left to train (the workers' logs say why)")


def refuse_restored(policy: EffectivePolicy, cluster_nodes: int, nodes: int) -> str | None:
    """Why a node request restored from the record may not be sent again (the record may
    be stale, or planted): the job's policy and the cluster's size are checked again, as a
    new request would be; None when it fits."""
    if not policy.grow:
        return "the job's policy does not allow growing"
    anchor = max(1, policy.min_nodes)
    if policy.max_nodes is not None and anchor + nodes > policy.max_nodes:
        return (f"{nodes} node(s) beside the anchor's {anchor} exceed the policy's "
                f"max_nodes {policy.max_nodes}")
    if anchor + nodes > cluster_nodes:
        return (f"{nodes} node(s) beside the anchor's {anchor} exceed the cluster's "
                f"{cluster_nodes} nodes")
    return None


UNFIT = "the partition's usable nodes no longer fit it"
PAST_PATIENCE = "it waited past the policy's patience"


def request_overdue(*, nodes: int, usable_nodes: int | None, keeps: int, age_s: float,
                    patience_s: float, since_last_look_s: float) -> str | None:
    """Why the pending request for ``nodes`` node(s) is decided again (it may be withdrawn
    and asked again smaller), None while it is not: a fresh count of the partition's usable
    nodes (``usable_nodes``; None: not read now) no longer fits it beside the ``keeps``
    nodes the job keeps (:data:`UNFIT`), or it waited past the policy's patience, looked at
    once a minute (:data:`PAST_PATIENCE`: the look is then counted from now)."""
    if usable_nodes is not None and nodes > usable_nodes - keeps:
        return UNFIT
    if age_s >= patience_s and since_last_look_s >= OVERDUE_EVERY_S:
        return PAST_PATIENCE
    return None


def anchor_again(pinned: Iterable[Device], failed: Collection[Device],
                 in_layout: Collection[Device], reused: Mapping[Device, int]
                 ) -> list[Device]:
    """The anchor's devices used again when nothing fits the usable devices: those whose
    workers died (``failed``: their process, not a loss the backend reported; the anchor is
    the job's own allocation and its node is up), not still their dead vrank's in the
    layout, each at most :data:`MAX_REUSES` times."""
    return sorted(d for d in pinned if d in failed and d not in in_layout
                  and reused.get(d, 0) < MAX_REUSES)


@dataclass(frozen=True)
class NeverJoined:
    """What a worker that never said Hello means for the job: ``fatal`` (the first layout:
    nothing has trained and nothing would), ``dead`` (its device fails; a participant of
    the resize in flight is dead to it), or neither (a process nothing waits for)."""

    why: str
    fatal: bool
    dead: bool


def never_joined(vrank: int, what: str, clean: bool, *, first_layout: bool,
                 in_layout: bool, in_resize: bool) -> NeverJoined:
    """A worker that exited (``clean``: with code 0) or stayed silent past the join
    timeout before its Hello, told apart by where it was to train."""
    why = f"vrank {vrank} {what} before joining the job: " + (
        NEVER_JOINED_HINT if clean else f"its log says why ({NEVER_JOINED_HINT})")
    fatal = first_layout and in_layout
    return NeverJoined(why, fatal, not fatal and (in_layout or in_resize))


def admits(*, step: int, trained: int, gave_up: Collection[int], admit_from: int) -> bool:
    """Whether a Hello's sender is taken for the vrank it names: one just started
    (``step`` < 0), or one that lost its coordinator and trains in a generation this
    coordinator runs, not one whose resize the restart closed as aborted (a commit the
    record never held: a full disk)."""
    if step >= 0 and trained in gave_up:
        return False
    return step < 0 or trained >= admit_from
