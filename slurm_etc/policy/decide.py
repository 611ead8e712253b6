"""decide(snapshot, policy) -> Decision: what an elastic job does next, and why.

Pure: the coordinator builds a ``JobView`` from what Slurm and the store say, calls
``decide``, and carries out the actions. Every action carries a one-line reason.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping

from ..alloc.chooser import (
    Choice,
    Hardware,
    TrainingJob,
    choose_config,
    survives_node_loss,
    tokens_per_second,
)
from ..alloc.migration import migration_cost
from ..alloc.topology import ClusterTopology, Device, format_devices
from ..alloc.vranks import Allocation, allocate
from ..plan import Layout, ParallelConfig, Topology
from ..plan.errors import ConfigError
from .rules import EffectivePolicy

# A voluntary resize (growing, or reshaping without a loss) must raise the estimated
# throughput by at least this much; smaller gains do not pay for the pause.
MIN_GAIN = 0.05
HOUR = 3600.0

CostFn = Callable[[Layout, ParallelConfig, Allocation], int]


@dataclass(frozen=True)
class Notice:
    """Devices that leave the job: preempted (at ``deadline``) or failed (already gone)."""

    devices: frozenset[Device]
    deadline: float
    cause: str = "preemption"


@dataclass(frozen=True)
class JobView:
    """Everything ``decide`` knows about one job at one instant.

    Attributes:
        now: seconds (any epoch; only differences matter).
        job: model and batch.
        hardware: device and link figures.
        topology: node order and switches.
        held: every device the job's allocations hold, including leaving ones.
        layout: the current layout in vranks (None before the first start).
        vranks: vrank -> device for the current layout.
        notices: devices leaving the job.
        resizes: times of earlier resizes (for the per-hour cap).
        growing: nodes already requested by member allocations that have not started.
        pinned: devices of the anchor allocation (runs the coordinator; never released).
        partition_nodes: nodes the job may ever hold (the partitions' nodes from Slurm; the
            local backend's scripted cluster); None: unknown. No request asks for more than
            these minus the nodes it keeps.
        request_age_s: how long the pending request (``growing``) has waited; None: none.
            Past the policy's ``request_patience_s`` it is withdrawn and asked again smaller.
    """

    now: float
    job: TrainingJob
    hardware: Hardware
    topology: ClusterTopology
    held: frozenset[Device]
    layout: Layout | None = None
    vranks: Mapping[int, Device] = field(default_factory=dict)
    notices: tuple[Notice, ...] = ()
    resizes: tuple[float, ...] = ()
    growing: int = 0
    pinned: frozenset[Device] = frozenset()
    partition_nodes: int | None = None
    request_age_s: float | None = None


@dataclass(frozen=True)
class ResizeDecision:
    """Move to ``config`` on the pool ``allocation`` (the planner places the ranks)."""

    config: ParallelConfig
    allocation: Allocation
    forced: bool
    reason: str
    deadline: float | None = None

    def __str__(self) -> str:
        a = self.allocation
        return (f"resize to {self.config} on {len(a.vranks)} devices ({len(a.nodes)} nodes): "
                f"{self.reason}")


@dataclass(frozen=True)
class Release:
    """Give devices back to Slurm."""

    devices: tuple[Device, ...]
    reason: str

    def __str__(self) -> str:
        return (f"release {len(self.devices)} devices ({format_devices(self.devices)}): "
                f"{self.reason}")


@dataclass(frozen=True)
class RequestGrow:
    """Submit a member allocation of ``nodes`` whole nodes."""

    nodes: int
    partition: str | None
    qos: str | None
    signal_grace_s: int
    reason: str

    def __str__(self) -> str:
        where = f" in partition {self.partition}" if self.partition else ""
        qos = f" with QOS {self.qos}" if self.qos else ""
        warn = (f", warned {self.signal_grace_s} s before preemption"
                if self.signal_grace_s else "")
        return f"request {self.nodes} more node(s){where}{qos}{warn}: {self.reason}"


@dataclass(frozen=True)
class Pause:
    """Stop training at a step boundary and wait (state stays on the held devices)."""

    reason: str

    def __str__(self) -> str:
        return f"pause: {self.reason}"


@dataclass(frozen=True)
class WithdrawRequest:
    """Cancel the pending node request (a smaller :class:`RequestGrow` follows it)."""

    nodes: int
    reason: str

    def __str__(self) -> str:
        return f"withdraw the request for {self.nodes} node(s): {self.reason}"


Action = ResizeDecision | Release | RequestGrow | Pause | WithdrawRequest


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    reason: str

    def lines(self) -> list[str]:
        """The decision's reason, then one line per action."""
        return [self.reason, *(f"  - {a}" for a in self.actions)]


def planner_cost(snapshot: JobView) -> CostFn:
    """Bytes the planner moves for a candidate (layout -> config on an allocation's pool)."""
    topo = _topology(snapshot)

    def cost(layout: Layout, config: ParallelConfig, allocation: Allocation) -> int:
        return migration_cost(snapshot.job.model, layout, config, allocation.pool,
                              topo).moved_bytes
    return cost


def _topology(snapshot: JobView) -> Topology:
    hw = snapshot.hardware
    return Topology(hw.gpus_per_node, hw.intra_node_gbps, hw.inter_node_gbps)


def decide(snapshot: JobView, policy: EffectivePolicy, *,
           cost: CostFn | None = None) -> Decision:
    """What the job does next under ``policy``.

    Order of concerns: devices that leave force a resize (never blocked by the resize cap);
    otherwise a resize must gain ``MIN_GAIN`` estimated throughput and respect the cap;
    devices no configuration uses are released; growth is requested only when a bigger
    allocation would pay.

    Args:
        snapshot: the job's state.
        policy: the merged policy of the job's partition and account.
        cost: migration bytes of a candidate; defaults to asking the planner.
    """
    s = snapshot
    given_cost = cost
    planned = cost is None  # the planner prices moves: its placement is the one to judge
    cost = cost or planner_cost(s)
    leaving = frozenset().union(*(n.devices for n in s.notices)) & s.held
    usable = s.held - leaving
    in_layout = frozenset(s.vranks.values())
    lost = in_layout & leaving
    recent = sum(1 for t in s.resizes if 0 <= s.now - t < HOUR)
    capped = policy.max_resizes_per_hour is not None and recent >= policy.max_resizes_per_hour
    try:
        choice = _choose(s, policy, usable, cost, planned, bool(lost) or not capped)
    except ConfigError as exc:
        ride = _ride_out_notice(s, policy, given_cost, lost)
        if ride is not None:
            return ride
        grow = _grow_request(s, policy, usable, None, capped)
        return Decision(tuple([Pause(str(exc))] + ([grow] if grow else [])),
                        f"no configuration fits the {len(usable)} usable devices")

    actions: list[Action] = []
    target, keep, forced, why, summary = _weigh(s, policy, usable, lost, choice, recent,
                                                capped)
    if keep is not None:
        config = keep
        target = Allocation(dict(s.vranks), tuple(sorted(usable - in_layout - s.pinned)))
    else:
        config = choice.config
        if len(target.nodes) < policy.min_nodes:
            pause: list[Action] = [Pause(f"the best configuration ({config}) spans "
                                         f"{len(target.nodes)} node(s), below the policy's "
                                         f"min_nodes ({policy.min_nodes})")]
            grow = _grow_request(s, policy, usable, None, capped)
            return Decision(tuple(pause + ([grow] if grow else [])),
                            "below the policy's minimum size")
        deadline = (min(n.deadline for n in s.notices if n.devices & lost) if lost else None)
        actions.append(ResizeDecision(config, target, forced, why, deadline))
    actions += _release_and_grow(s, policy, config, target, choice, capped)
    return Decision(tuple(actions), summary)


def _choose(s: JobView, policy: EffectivePolicy, usable: frozenset[Device], cost: CostFn,
            planned: bool, can_move: bool) -> Choice:
    """The best configuration on the ``usable`` devices (raises ConfigError where none
    fits); its migration cost counts only where a resize ``can_move`` now (not at a first
    start, nor for a voluntary resize the cap forbids)."""
    counts = list(Counter(d.node for d in usable).values())
    cost_of: Callable[[ParallelConfig], int] | None = None
    layout = s.layout
    if layout is not None and can_move:
        def cost_from_layout(config: ParallelConfig) -> int:
            return cost(layout, config, _allocate(s, usable, config, policy))
        cost_of = cost_from_layout

    def survives(config: ParallelConfig) -> bool:
        """Placed as it would be (the planner's placement from the current layout, where
        the planner prices the move; else rank r on the r-th vrank of the pool)."""
        allocation = _allocate(s, usable, config, policy)
        order: Iterable[int] = allocation.pool
        if layout is not None and planned:
            order = migration_cost(s.job.model, layout, config, allocation.pool,
                                   _topology(s)).assignment
        return survives_node_loss(config, [allocation.vranks[v].node for v in order])

    return choose_config(s.job, s.hardware, counts, allowed_tp=policy.allowed_tp,
                         allowed_pp=policy.allowed_pp, max_nodes=policy.max_nodes,
                         migration_cost=cost_of, survives_loss=survives)


def _weigh(s: JobView, policy: EffectivePolicy, usable: frozenset[Device],
           lost: frozenset[Device], choice: Choice, recent: int, capped: bool
           ) -> tuple[Allocation, ParallelConfig | None, bool, str, str]:
    """What ``choice`` means from where the job is: its allocation, the current
    configuration where that stays instead, whether the move is forced, why, and the
    decision's summary."""
    target = _allocate(s, usable, choice.config, policy)
    keep: ParallelConfig | None = None  # the current configuration, if it stays
    if s.layout is None:
        forced, why = False, f"start: {choice.reason}"
        summary = f"start on {len(target.vranks)} of {len(usable)} usable devices"
    elif lost:
        forced, why = True, f"{_loss_reason(s, lost, policy)}; {choice.reason}"
        summary = f"{len(lost)} training device(s) leaving: resize"
    else:
        current = tokens_per_second(s.job, s.layout.config, s.hardware)
        gain = choice.best.tokens_per_s / current - 1
        forced, why = False, f"+{gain:.0%} estimated throughput; {choice.reason}"
        if choice.config == s.layout.config or gain < MIN_GAIN or capped:
            keep = s.layout.config
        if keep is None:
            summary = f"resize for +{gain:.0%} estimated throughput"
        elif choice.config == s.layout.config or gain < MIN_GAIN:
            summary = (f"keep {s.layout.config}: the best configuration gains "
                       f"{max(gain, 0):.0%} (< {MIN_GAIN:.0%})")
        else:
            summary = (f"keep {s.layout.config}: {recent} resizes in the last hour reach the "
                       f"policy cap ({policy.max_resizes_per_hour}); a {gain:.0%} gain waits")
    return target, keep, forced, why, summary


def _release_and_grow(s: JobView, policy: EffectivePolicy, config: ParallelConfig,
                      target: Allocation, choice: Choice, capped: bool) -> list[Action]:
    """After the resize (or none): a request withdrawn, devices released, growth asked."""
    actions: list[Action] = []
    kept = frozenset(target.vranks.values())
    unmeetable = _unmeetable(s, kept)
    withdraw = unmeetable or _withdraw(s, policy, capped)
    released, grow = target.released, None
    if withdraw is not None:
        released, grow = _growth(s, policy, kept, target.released, choice, capped, 0,
                                 s.growing)
        if grow is None and unmeetable is None:
            withdraw = None  # past its patience: only where a smaller one is worth asking
    if withdraw is None:
        released, grow = _growth(s, policy, kept, target.released, choice, capped,
                                 s.growing, None)
    else:
        actions.append(withdraw)
    if released:
        actions.append(Release(released, _release_reason(config, target, policy)))
    if grow:
        actions.append(grow)
    return actions


def _growth(s: JobView, policy: EffectivePolicy, kept: frozenset[Device],
            released: tuple[Device, ...], choice: Choice, capped: bool, growing: int,
            smaller_than: int | None) -> tuple[tuple[Device, ...], RequestGrow | None]:
    """What to release and what to ask for: granted nodes that fit no layout now stay
    (:func:`_spare_worth_keeping`) or go, and the request sized on what stays."""
    spare = _spare_worth_keeping(s, policy, kept, released, choice, growing, capped,
                                 smaller_than)
    if spare is not None:
        return tuple(d for d in released if d not in spare[0]), spare[1]
    return released, _grow_request(s, policy, kept, choice, capped, growing=growing,
                                   smaller_than=smaller_than)


def _unmeetable(s: JobView, kept: frozenset[Device]) -> WithdrawRequest | None:
    """The pending request, when the partition's usable nodes no longer meet it (nodes went
    DOWN or DRAIN after it was sent): it would pend forever, whatever its age. Counted
    beside the nodes the job keeps, as the request was sized: nodes it releases are free
    again once released."""
    if not s.growing or s.partition_nodes is None:
        return None
    keeps = len({d.node for d in kept})
    beyond = max(s.partition_nodes - keeps, 0)
    if s.growing <= beyond:
        return None
    return WithdrawRequest(s.growing, f"the partition has {beyond} usable node(s) beyond the "
                                      f"{keeps} this job keeps; asking for fewer")


def _withdraw(s: JobView, policy: EffectivePolicy, capped: bool) -> WithdrawRequest | None:
    """The pending request, when it waited past the policy's patience and a smaller one
    exists."""
    patience = policy.patience_s
    if not s.growing or s.growing < 2 or s.request_age_s is None or capped or \
            s.request_age_s < patience:
        return None
    return WithdrawRequest(s.growing, f"pending for {s.request_age_s:.0f} s (more than "
                                      f"{patience} s); asking for fewer")


def _spare_worth_keeping(s: JobView, policy: EffectivePolicy, kept: frozenset[Device],
                         released: tuple[Device, ...], choice: Choice, growing: int,
                         capped: bool, smaller_than: int | None
                         ) -> tuple[frozenset[Device], RequestGrow | None] | None:
    """Granted whole nodes that fit no valid layout now, kept (instead of released and asked
    for again) when the pending request, or a new one, makes a layout with them pay: the
    nodes to keep and the request to send (None: the pending one). None: release them (and
    at a first start, which has no layout to grow from yet).

    Kept only while a request is pending that is younger than the patience (a withdrawn one
    is asked again smaller, which must still make them useful), and never past max_nodes."""
    if not policy.grow or capped or s.layout is None:
        return None
    whole = Counter(d.node for d in released)
    spare_nodes = {n for n, k in whole.items() if k == s.topology.gpus_per_node} - {
        d.node for d in s.pinned}
    if not spare_nodes:
        return None
    spare = frozenset(d for d in released if d.node in spare_nodes)
    with_spare = kept | spare
    if policy.max_nodes is not None and \
            len({d.node for d in with_spare}) > policy.max_nodes:
        return None
    if growing:
        counts = list(Counter(d.node for d in with_spare).values())
        bigger = _best(s, policy, counts + [s.topology.gpus_per_node] * growing)
        if bigger is not None and bigger.best.tokens_per_s >= \
                (1 + MIN_GAIN) * choice.best.tokens_per_s and \
                bigger.config.world > len(kept) + growing * s.topology.gpus_per_node:
            return spare, None
        return None
    grow = _grow_request(s, policy, with_spare, choice, capped, growing=0,
                         smaller_than=smaller_than)
    if grow is None:
        return None
    counts = list(Counter(d.node for d in with_spare).values())
    bigger = _best(s, policy, counts + [s.topology.gpus_per_node] * grow.nodes)
    if bigger is None or bigger.config.world <= len(kept) + \
            grow.nodes * s.topology.gpus_per_node:
        return None  # the layout it pays for does not need the spare nodes
    why = (f"{grow.reason}, with the {len(spare_nodes)} granted node(s) kept "
           f"({', '.join(sorted(spare_nodes))}) that fit no valid layout now")
    return spare, RequestGrow(grow.nodes, grow.partition, grow.qos, grow.signal_grace_s, why)


def _best(s: JobView, policy: EffectivePolicy, counts: list[int]) -> Choice | None:
    try:
        return choose_config(s.job, s.hardware, counts, allowed_tp=policy.allowed_tp,
                             allowed_pp=policy.allowed_pp, max_nodes=policy.max_nodes)
    except ConfigError:
        return None


def _allocate(s: JobView, usable: frozenset[Device], config: ParallelConfig,
              policy: EffectivePolicy) -> Allocation:
    return allocate(usable, config.world, config.tp, s.topology, previous=s.vranks,
                    max_nodes=policy.max_nodes, pinned=s.pinned & usable)


def _ride_out_notice(s: JobView, policy: EffectivePolicy, cost: CostFn | None,
                     lost: frozenset[Device]) -> Decision | None:
    """Where devices of the layout are gone (failed, or their notice ran out) and nothing
    fits the usable devices, the layout's state survives only on devices still under
    notice: a layout on them trains until the notice runs out (a grant meanwhile takes it
    up) rather than pausing with the state at risk. The decision on those devices as if
    they stayed, its resize forced and due by the notice; None where no device of the
    layout is gone (a pause loses nothing), none is under a running notice, or nothing
    fits them either."""
    gone = {d for n in s.notices if n.deadline <= s.now for d in n.devices} & lost
    running = tuple(n for n in s.notices if n.deadline > s.now and n.devices & s.held)
    if not gone or not running:
        return None
    stayed = decide(replace(s, notices=tuple(n for n in s.notices if n.deadline <= s.now)),
                    policy, cost=cost)
    deadline = min(n.deadline for n in running)
    riding = frozenset().union(*(n.devices for n in running))
    actions: list[Action] = []
    for a in stayed.actions:
        if isinstance(a, ResizeDecision):
            on = riding & frozenset(a.allocation.vranks.values())
            why = (f"{a.reason}; nothing else fits: on {format_devices(on)} until their "
                   f"notice runs out ({deadline - s.now:.0f} s)")
            actions.append(replace(a, forced=True, reason=why, deadline=deadline))
        elif not isinstance(a, Pause):
            actions.append(a)
    if not any(isinstance(a, ResizeDecision) for a in actions):
        return None
    return Decision(tuple(actions), f"{len(gone)} training device(s) gone: resize onto "
                                    f"devices under notice ({deadline - s.now:.0f} s left)")


def _loss_reason(s: JobView, lost: frozenset[Device], policy: EffectivePolicy) -> str:
    parts = []
    for n in s.notices:
        gone = n.devices & lost
        if not gone:
            continue
        text = f"{len(gone)} device(s) lost to {n.cause} ({format_devices(gone)})"
        left = n.deadline - s.now
        if n.cause == "preemption":
            text += f", {left:.0f} s of notice"
            if left < policy.preempt_grace_s:
                text += f" (policy asks for {policy.preempt_grace_s} s)"
        parts.append(text)
    return "; ".join(parts)


def _release_reason(config: ParallelConfig, target: Allocation,
                    policy: EffectivePolicy) -> str:
    used = set(target.nodes)
    if policy.max_nodes is not None and len(used) >= policy.max_nodes and any(
            d.node not in used for d in target.released):
        return f"{config} runs on {len(used)} nodes, the policy's max_nodes"
    return (f"{config} runs on {len(target.vranks)} devices; the rest cannot join whole "
            "tensor-parallel groups in a node or a larger valid configuration")


def _grow_request(s: JobView, policy: EffectivePolicy, kept: frozenset[Device],
                  choice: Choice | None, capped: bool, *, growing: int | None = None,
                  smaller_than: int | None = None) -> RequestGrow | None:
    """Ask for the fewest whole nodes that, added to ``kept``, make a configuration
    MIN_GAIN faster: never more than the policy's max_nodes, nor the partition's nodes,
    minus the nodes kept (a request for more would pend forever), and fewer than
    ``smaller_than`` (a withdrawn request's size) when given.

    Throughput grows with devices (not strictly: batch divisibility makes steps), so the
    fewest such nodes is found by bisection over 1..room.
    """
    if not policy.grow or (s.growing if growing is None else growing) or capped:
        return None
    held_nodes = len({d.node for d in kept})
    room = (policy.max_nodes - held_nodes if policy.max_nodes is not None
            else max(held_nodes, 1))
    if s.partition_nodes is not None:
        room = min(room, s.partition_nodes - held_nodes)
    if smaller_than is not None:
        room = min(room, smaller_than - 1)
    counts = list(Counter(d.node for d in kept).values())
    base = choice.best.tokens_per_s if choice else 0.0

    def best_with(extra: int) -> Choice | None:
        try:
            return choose_config(s.job, s.hardware,
                                 counts + [s.topology.gpus_per_node] * extra,
                                 allowed_tp=policy.allowed_tp, allowed_pp=policy.allowed_pp,
                                 max_nodes=policy.max_nodes)
        except ConfigError:
            return None

    def pays(c: Choice | None) -> bool:
        return c is not None and c.best.tokens_per_s >= (1 + MIN_GAIN) * base

    if room < 1:
        return None
    bigger = best_with(room)
    if bigger is None or not pays(bigger):
        return None
    low, high = 0, room  # pays(high) holds, bigger = best_with(high); find the smallest extra
    while high - low > 1:
        mid = (low + high) // 2
        candidate = best_with(mid)
        if candidate is not None and pays(candidate):
            high, bigger = mid, candidate
        else:
            low = mid
    gain = ("enough devices to start" if not base else
            f"{bigger.config} would be {bigger.best.tokens_per_s / base - 1:.0%} faster")
    return RequestGrow(high, policy.grow_partition, policy.grow_qos, policy.preempt_grace_s,
                       gain)
