"""Replay a trace on the simulated Slurm with one allocator, measuring occupancy.

Two allocators run against identical traces:

- ``compact`` (slurm-etc): ``policy.decide`` picks the configuration and the devices
  (alloc's compact, stable vranks), releases what no configuration uses, and the planner
  places the ranks (fewest bytes moved, tensor-parallel groups inside nodes).
- ``naive``: the same chooser and policy, but first-fit ranks over the devices in the order
  they were granted (no compaction: every device granted is held, used or not) and identity
  placement (new rank r on the r-th device).

Both ask to grow at the trace's ``grow`` events: the naive launcher submits a member
allocation of the size in the trace; slurm-etc submits what ``decide``'s RequestGrow asks
(the fewest whole nodes that make a faster configuration, or nothing). The simulated Slurm
starts members and rigid jobs in submission order with EASY backfill.

Modelling choices (the same for both): preemptions take an elastic job's newest member
devices (never its anchor) and hand them to the preempting job; the job learns of it at the
event and resizes at once. Bytes are counted as if leaving devices could still send (true
for preemptions within the grace time; after a failure the data come from replicas). A job
that cannot run any configuration pauses and resumes from a checkpoint (no bytes counted).
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from ..alloc.chooser import TrainingJob, choose_config, tokens_per_second
from ..alloc.migration import migration_cost, placement_moved_bytes
from ..alloc.topology import ClusterTopology, Device
from ..alloc.vranks import identity_layout, split_tp_groups
from ..plan import Layout, Topology
from ..plan.errors import ConfigError
from ..policy.decide import (
    HOUR,
    MIN_GAIN,
    JobView,
    Notice,
    Pause,
    Release,
    RequestGrow,
    ResizeDecision,
    decide,
)
from ..policy.rules import EffectivePolicy, Scope, effective
from .cluster import SimCluster
from .trace import ElasticJobSpec, Event, Trace

ALLOCATORS = ("compact", "naive")


@dataclass
class ElasticState:
    """One elastic job during a run."""

    spec: ElasticJobSpec
    training: TrainingJob
    policy: EffectivePolicy
    held: dict[Device, int] = field(default_factory=dict)  # device -> grant number (0: anchor)
    layout: Layout | None = None
    vranks: dict[int, Device] = field(default_factory=dict)
    active: frozenset[Device] = frozenset()
    notices: list[tuple[frozenset[Device], str]] = field(default_factory=list)
    resize_times: list[float] = field(default_factory=list)
    resizes: int = 0
    pauses: int = 0
    moved_bytes: int = 0
    asking: bool = False  # compact: the launcher asks for a member allocation now


@dataclass(frozen=True)
class _Request:
    seq: int
    owner: str
    gpus: int | None
    nodes: int | None
    duration: float | None  # rigid jobs
    elastic: bool
    submitted: float


_T = TypeVar("_T")


def _need(value: _T | None, what: str) -> _T:
    """A field the trace's validation (or the request's kind) guarantees is set."""
    if value is None:
        raise RuntimeError(f"simulator bug: {what} missing")
    return value


@dataclass
class SimResult:
    """Time series (piecewise constant from each time to the next) and totals of one run."""

    allocator: str
    times: list[float]
    occupancy: list[float]
    idle_held: list[int]
    partial_nodes: list[int]
    summary: dict[str, Any]


class Simulation:
    """One replay of a trace with one allocator (see module docstring)."""

    def __init__(self, trace: Trace, allocator: str) -> None:
        if allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}")
        self.trace = trace
        self.allocator = allocator
        c = trace.cluster
        self.topology = ClusterTopology.uniform(c.nodes, c.gpus_per_node, c.nodes_per_switch)
        self.hardware = c.hardware()
        self.planner_topology = Topology(c.gpus_per_node, c.intra_node_gbps, c.inter_node_gbps)
        self.cluster = SimCluster(self.topology)
        self.G = c.gpus_per_node
        self.jobs = {j.name: ElasticState(j, j.training(), self._policy(j)) for j in trace.jobs}
        self.rigid: dict[str, tuple[list[Device], float]] = {}
        self.queue: list[_Request] = []
        self.grants = 0
        self.waits: list[float] = []
        self.counters: Counter[str] = Counter()
        self._seq = 0
        self._react: Callable[[ElasticState, float], list[Device]] = (
            self._react_compact if allocator == "compact" else self._react_naive)

    def _policy(self, job: ElasticJobSpec) -> EffectivePolicy:
        binding = {Scope("partition", job.partition), Scope("account", job.account)}
        return effective((s, p) for s, p in self.trace.policies if s in binding)

    # -- the event loop ------------------------------------------------------------------

    def run(self) -> SimResult:
        heap: list[tuple[float, int, int, object]] = []
        for j in self.trace.jobs:
            heapq.heappush(heap, (j.start, 0, self._next(), ("start", j.name)))
        for e in self.trace.events:
            heapq.heappush(heap, (e.t, 1, self._next(), e))
        times: list[float] = []
        occ: list[float] = []
        idle: list[int] = []
        partial: list[int] = []
        area: defaultdict[str, float] = defaultdict(float)  # integral over time
        last_t = 0.0
        last = self._sample()
        end = self.trace.duration
        while heap and heap[0][0] <= end:
            t = heap[0][0]
            for k, v in last.items():
                area[k] += v * (t - last_t)
            touched: set[str] = set()
            while heap and heap[0][0] == t:
                _, _, _, item = heapq.heappop(heap)
                self._apply(item, t, heap, touched)
            self._settle(t, touched, heap)
            last, last_t = self._sample(), t
            times.append(t)
            occ.append(last["busy"] / max(last["up"], 1))
            idle.append(last["idle_held"])
            partial.append(last["partial_nodes"])
        for k, v in last.items():
            area[k] += v * (end - last_t)
        return SimResult(self.allocator, times, occ, idle, partial, self._summary(area, end))

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _apply(self, item, t: float, heap, touched: set[str]) -> None:
        if isinstance(item, tuple) and item[0] == "start":
            spec = self.jobs[item[1]].spec
            self.queue.append(_Request(self._next(), spec.name, None, spec.nodes, None, True, t))
            return
        if isinstance(item, tuple) and item[0] == "end":
            name = item[1]
            if name in self.rigid and self.rigid[name][1] == t:
                self.cluster.release(self.rigid.pop(name)[0], name)
            return
        e: Event = item
        if e.kind == "grow":
            owner = _need(e.job, "grow event's job")
            if self.allocator == "naive":
                self.queue.append(_Request(self._next(), owner, e.gpus, e.nodes, None, True, t))
            else:  # slurm-etc sizes the request itself (decide's RequestGrow)
                self.jobs[owner].asking = True
                touched.add(owner)
        elif e.kind == "submit":
            self.queue.append(_Request(self._next(), _need(e.job, "submit event's job"), e.gpus,
                                       e.nodes, e.duration, False, t))
        elif e.kind == "preempt":
            job = self.jobs[_need(e.job, "preempt event's job")]
            members = sorted((d for d, g in job.held.items() if g > 0),
                             key=lambda d: (-job.held[d], d))[:e.gpus]
            if members:
                name = f"preemptor-{self._next()}"
                self.cluster.transfer(members, name)
                self._start_rigid(name, members, t + _need(e.duration, "preemption's duration"),
                                  heap)
                self._lose(job, members, "preemption", touched)
                self.counters["preempted_gpus"] += len(members)
        elif e.kind == "fail":
            node = self.topology.nodes[_need(e.node, "fail event's node")]
            for owner, devices in self.cluster.fail(node).items():
                if owner in self.jobs:
                    self._lose(self.jobs[owner], devices, "failure", touched)
                else:  # a rigid job dies with its node
                    gone = set(devices)
                    rest = [d for d in self.rigid.pop(owner)[0] if d not in gone]
                    self.cluster.release(rest, owner)
                    self.counters["rigid_killed"] += 1
        elif e.kind == "recover":
            self.cluster.recover(self.topology.nodes[_need(e.node, "recover event's node")])

    def _lose(self, job: ElasticState, devices, cause: str, touched: set[str]) -> None:
        for d in devices:
            del job.held[d]
        job.notices.append((frozenset(devices), cause))
        touched.add(job.spec.name)

    def _start_rigid(self, name: str, devices, end: float, heap) -> None:
        self.rigid[name] = (list(devices), end)
        heapq.heappush(heap, (end, 0, self._next(), ("end", name)))

    def _settle(self, t: float, touched: set[str], heap) -> None:
        """React to changes and schedule the queue until nothing moves."""
        for _ in range(100):
            for name in sorted(touched):
                job = self.jobs[name]
                released = self._react(job, t)
                job.notices.clear()
                if released:
                    for d in released:
                        del job.held[d]
                    self.cluster.release(released, name)
            touched = self._schedule(t, heap)
            if not touched:
                return
        raise RuntimeError("simulator bug: grants and releases did not settle")

    def _schedule(self, t: float, heap) -> set[str]:
        """Start queued requests in FIFO order with EASY backfill; returns grown jobs.

        The first request that does not fit gets a reservation at its shadow time (when
        rigid jobs ending free enough devices); a later request may jump ahead only if it
        fits now and ends before that time (elastic members never end, so they wait).
        """
        grown: set[str] = set()
        waiting = []
        shadow = math.inf
        blocked = False
        for r in self.queue:
            if r.elastic and not self._admit(r):
                continue
            request = self._capped(r) if r.elastic else r
            if request is None:
                self.counters["grows_dropped"] += 1
                continue
            if blocked and (r.elastic or t + _need(r.duration, "rigid job's duration") > shadow):
                waiting.append(r)
                continue
            devices = self.cluster.place(request.gpus, request.nodes)
            if devices is None:
                waiting.append(r)
                if not blocked:
                    shadow = self._shadow_time(request)
                    blocked = shadow < math.inf
                continue
            self.cluster.assign(devices, r.owner)
            if r.elastic:
                job = self.jobs[r.owner]
                number = self.grants if job.held else 0
                self.grants += 1
                for d in devices:
                    job.held[d] = number
                grown.add(r.owner)
            else:
                self._start_rigid(r.owner, devices, t + _need(r.duration, "rigid job's duration"),
                                  heap)
                self.waits.append(t - r.submitted)
        self.queue = waiting
        return grown

    def _shadow_time(self, r: _Request) -> float:
        """When ``r`` would fit if only rigid jobs ended (inf: never)."""
        free = dict(self.cluster.free_on)
        whole = sum(1 for v in free.values() if v == self.G)
        most = max(free.values())
        for end, devices in sorted((end, devs) for devs, end in self.rigid.values()):
            for d in devices:
                free[d.node] += 1
                whole += free[d.node] == self.G
                most = max(most, free[d.node])
            if (whole >= r.nodes) if r.nodes is not None else (most >= _need(r.gpus, "gpus")):
                return end
        return math.inf

    def _admit(self, r: _Request) -> bool:
        """Member allocations only for jobs whose policy lets them grow."""
        job = self.jobs[r.owner]
        if not job.held or job.policy.grow:
            return True
        self.counters["grows_dropped"] += 1
        return False

    def _capped(self, r: _Request) -> _Request | None:
        """A member request trimmed so the job stays within its policy's max_nodes."""
        job = self.jobs[r.owner]
        if job.policy.max_nodes is None:
            return r
        room = job.policy.max_nodes * self.G - len(job.held)
        if r.nodes is not None:
            nodes = min(r.nodes, room // self.G)
            return _Request(r.seq, r.owner, None, nodes, None, True, r.submitted) if nodes else None
        gpus = min(_need(r.gpus, "request's gpus or nodes"), room)
        return _Request(r.seq, r.owner, gpus, None, None, True, r.submitted) if gpus > 0 else None

    # -- allocators ----------------------------------------------------------------------

    def _react_compact(self, job: ElasticState, now: float) -> list[Device]:
        grace = job.policy.preempt_grace_s
        notices = tuple(Notice(devs, now + (grace if cause == "preemption" else 0), cause)
                        for devs, cause in job.notices)
        held = frozenset(job.held).union(*(n.devices for n in notices))
        pending = sum(r.nodes or 0 for r in self.queue if r.owner == job.spec.name)
        anchor = frozenset(d for d, grant in job.held.items() if grant == 0)
        snap = JobView(now, job.training, self.hardware, self.topology, held, job.layout,
                        job.vranks, notices, tuple(job.resize_times), growing=pending,
                        pinned=anchor)
        released: list[Device] = []
        for action in decide(snap, job.policy).actions:
            if isinstance(action, RequestGrow):
                if job.asking:
                    self.queue.append(_Request(self._next(), job.spec.name, None, action.nodes,
                                               None, True, now))
            elif isinstance(action, ResizeDecision):
                pool = action.allocation.pool
                if job.layout is None:
                    layout = identity_layout(action.config, pool)
                else:
                    cost = migration_cost(job.training.model, job.layout, action.config, pool,
                                          self.planner_topology)
                    layout = Layout(action.config, cost.assignment)
                    self._count_resize(job, now, cost.moved_bytes)
                job.layout, job.vranks = layout, dict(action.allocation.vranks)
                job.active = action.allocation.devices
            elif isinstance(action, Release):
                released.extend(action.devices)
            elif isinstance(action, Pause):
                self._pause(job)
        job.asking = False
        return released

    def _react_naive(self, job: ElasticState, now: float) -> list[Device]:
        lost = frozenset().union(*(devs for devs, _ in job.notices))
        table = {v: d for v, d in job.vranks.items() if d not in lost}
        placed = set(table.values())
        free_vrank = (v for v in itertools.count() if v not in table)
        for d in sorted((d for d in job.held if d not in placed), key=lambda d: (job.held[d], d)):
            table[next(free_vrank)] = d
        job.vranks = dict(sorted(table.items()))
        order = list(job.vranks.values())
        p = job.policy
        try:
            choice = choose_config(job.training, self.hardware, [len(order)],
                                   allowed_tp=p.allowed_tp, allowed_pp=p.allowed_pp,
                                   max_nodes=p.max_nodes, tp_in_node=False)
        except ConfigError:
            self._pause(job)
            return []
        if job.layout is not None and not (job.active & lost):
            gain = choice.best.tokens_per_s / tokens_per_second(
                job.training, job.layout.config, self.hardware) - 1
            recent = sum(1 for t in job.resize_times if now - t < HOUR)
            capped = p.max_resizes_per_hour is not None and recent >= p.max_resizes_per_hour
            if choice.config == job.layout.config or gain < MIN_GAIN or capped:
                return []
        devices = order[:choice.config.world]
        layout = Layout(choice.config, tuple(self.topology.device_id(d) for d in devices))
        if job.layout is not None:
            self._count_resize(job, now, placement_moved_bytes(job.training.model, job.layout,
                                                               layout))
        job.layout, job.active = layout, frozenset(devices)
        return []

    def _count_resize(self, job: ElasticState, now: float, moved: int) -> None:
        job.resizes += 1
        job.resize_times.append(now)
        job.moved_bytes += moved

    def _pause(self, job: ElasticState) -> None:
        if job.layout is not None:
            job.pauses += 1
        job.layout, job.active = None, frozenset()
        if self.allocator == "compact":
            job.vranks = {}

    # -- measurements --------------------------------------------------------------------

    def _sample(self) -> dict[str, int]:
        busy_on: Counter[str] = Counter()
        idle = split = elastic = 0
        for job in self.jobs.values():
            for d in job.active:
                busy_on[d.node] += 1
            elastic += len(job.active)
            idle += len(job.held) - len(job.active)
            if job.layout is not None:
                split += split_tp_groups(self._physical(job, job.layout), self.G)
        for devices, _ in self.rigid.values():
            for d in devices:
                busy_on[d.node] += 1
        up = (len(self.topology.nodes) - len(self.cluster.down)) * self.G
        partial = sum(1 for n, b in busy_on.items() if 0 < b < self.G)
        return {"busy": sum(busy_on.values()), "elastic": elastic, "idle_held": idle,
                "partial_nodes": partial, "split_tp_groups": split, "up": up,
                "queued": len(self.queue)}

    def _physical(self, job: ElasticState, layout: Layout) -> Layout:
        """``layout`` (the job's, over virtual ranks) over the physical device ids."""
        if self.allocator == "naive":
            return layout
        ids = tuple(self.topology.device_id(job.vranks[v]) for v in layout.devices)
        return Layout(layout.config, ids)

    def _summary(self, area: dict[str, float], end: float) -> dict[str, Any]:
        up = max(area["up"], 1.0)
        return {
            "allocator": self.allocator,
            "hours": end / HOUR,
            "occupancy_pct": 100 * area["busy"] / up,
            "elastic_share_pct": 100 * area["elastic"] / up,
            "elastic_gpu_hours": area["elastic"] / HOUR,
            "idle_held_gpus": area["idle_held"] / end,
            "partial_nodes": area["partial_nodes"] / end,
            "split_tp_groups": area["split_tp_groups"] / end,
            "resizes": sum(j.resizes for j in self.jobs.values()),
            "moved_bytes": sum(j.moved_bytes for j in self.jobs.values()),
            "pauses": sum(j.pauses for j in self.jobs.values()),
            "rigid_jobs_started": len(self.waits),
            "rigid_mean_wait_h": (sum(self.waits) / len(self.waits) / HOUR) if self.waits
            else 0.0,
            "grows_dropped": self.counters["grows_dropped"],
            "preempted_gpus": self.counters["preempted_gpus"],
            "rigid_killed": self.counters["rigid_killed"],
        }


def simulate(trace: Trace, allocator: str) -> SimResult:
    """Replay ``trace`` with ``allocator`` ('compact' or 'naive')."""
    return Simulation(trace, allocator).run()
