"""Scripted resource events for the local backend: the script's schema, its validation, and
the pure state machine that turns steps, time and the coordinator's actions into events.

A script is a JSON file (YAML too when PyYAML is installed), or the same structure given as
options::

    {"nodes": 4, "gpus_per_node": 2, "initial_nodes": 1, "grace_s": 30,
     "events": [{"at_step": 5, "grant": 2},
                {"at_step": 12, "preempt": 2, "grace_s": 10},
                {"at_step": 18, "lose": ["n1:1"], "reason": "ECC error"}]}

* ``nodes`` simulated nodes named ``n0``, ``n1``, ... with ``gpus_per_node`` devices each,
  named ``n0:0``, ``n0:1``, ...; the first ``initial_nodes`` form the anchor allocation
  ``a0`` (it runs the coordinator and is never preempted or lost); later grants are
  allocations ``a1``, ``a2``, ... in the order they start.
* every event fires once, when the coordinator reports the job reached ``at_step``
  (``on_step``); events are listed in step order. Events with the same ``at_step`` form a
  group and fire together; groups fire one at a time, in order: a report fires only the
  earliest group due, and the next group waits until the one before was handed to the
  coordinator (its next ``poll``) and the coordinator reports a step again. The coordinator
  reports steps only when it is settled (no resize in flight, no event waiting for its
  decision), so every group is decided, and any resize it causes committed or aborted,
  before the next fires: the sequence of resizes does not depend on how fast the workers
  train or start (a group due during a resize fires when it settles, later in training
  than ``at_step``). Each event has exactly one of ``grant``/``preempt``/``lose``, whose
  value is either a number of whole nodes or node and device names (a name or a list of
  names):

  - ``grant: N`` gives the job the N lowest-numbered free nodes as a new allocation (it
    satisfies the oldest pending request, if any); ``grant: [names]`` exactly those devices;
  - ``preempt: N`` warns that the job's N newest non-anchor nodes (newest allocation first,
    highest node first) are taken ``grace_s`` seconds later (the event's, else the script's);
    released before then they are handed back, still held then they are lost (workers
    killed, a Loss with cause ``preempted``); preempted devices never come back;
  - ``lose: N`` / ``lose: [names]``: the nodes fail now (workers killed, a Loss with cause
    ``failure``); by count as for preempt, nodes under notice last; a lost device that the
    job does not hold just disappears.
* ``settled_steps`` (default false): when true, ``at_step`` counts only the steps trained
  while the job was settled: the steps the old layout trains on through a resize (a grow's
  joiners warming up, the preparation) move every later event back by as many, so the
  events keep their spacing in training however long a warm-up takes (the demo).
* ``end_step`` (default none): when given, the job's training ends (the backend says
  :class:`~slurm_etc.coordinator.backend.EndTraining`; the coordinator stops the workers at
  a step boundary and the job ends finished) at the first report of ``end_step`` or later
  after every event fired, counted as ``at_step`` is (with ``settled_steps``, in steps
  trained while settled), and never below a step the job reported before: steps lost with a
  node and rolled back are trained again first. The workers' own ``train_steps`` remains
  the most they train: a script that has not played out by then ends with training (the
  demo says which events never fired). At least the last event's ``at_step``.
* ``grant_requests`` (default false): when true, the coordinator's requests are granted as
  soon as enough whole nodes are free; when false, nodes arrive only by scripted grants.

The cluster's state (who holds which device, what is gone or under notice, the requests
pending, how far the script played, the events not yet handed over) is plain data
(:meth:`ScriptedResources.state`), which the local backend keeps in a file beside the job's
record: a coordinator restarted on the job takes the cluster up where the killed one left it
(:meth:`ScriptedResources.resume`), as a Slurm cluster outlives the coordinator of a job on it.

A script is checked once when loaded by playing it without a coordinator: names must exist,
counts must be available, the anchor is never preempted or lost. A problem is one line,
e.g. ``events.json: event 3: node n7 does not exist (nodes: n0..n3)`` (events count from 1).
At run time the coordinator's own requests and releases can leave fewer nodes than the script
expects; an event then does what it still can and logs a warning.
"""
from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeAlias

import msgspec

from slurm_etc import bounds
from slurm_etc.alloc.topology import ClusterTopology, Device

from ..coordinator.backend import BackendEvent, EndTraining, Grant, Loss, PreemptNotice
from ..errors import InputError

logger = logging.getLogger(__name__)

ANCHOR = "a0"
EventKind: TypeAlias = Literal["grant", "preempt", "lose"]
_KINDS: tuple[EventKind, ...] = ("grant", "preempt", "lose")

# The bound of every size field of a script (events' node counts are counts of nodes): a
# field added without one fails tests/unit/test_bounds_property.py. msgspec checks them while
# decoding; products (nodes x gpus_per_node) and the event count in ``_validated``.
SCRIPT_BOUNDS: dict[str, bounds.Bound] = {
    "nodes": bounds.NODES, "gpus_per_node": bounds.GPUS_PER_NODE,
    "initial_nodes": bounds.NODES, "grace_s": bounds.SECONDS, "end_step": bounds.STEPS,
}
EVENT_BOUNDS: dict[str, bounds.Bound] = {
    "at_step": bounds.STEPS, "grant": bounds.NODES, "preempt": bounds.NODES,
    "lose": bounds.NODES, "grace_s": bounds.SECONDS,
}


def _meta(bound: bounds.Bound, low: float | None = None) -> msgspec.Meta:
    return msgspec.Meta(ge=bound.low if low is None else low, le=bound.high)


_Count = Annotated[int, _meta(bounds.NODES)]
_Name = Annotated[str, msgspec.Meta(max_length=bounds.NAME_CHARS)]
_Target = (_Count | _Name | Annotated[tuple[_Name, ...], msgspec.Meta(max_length=bounds.GPUS)]
           | None)


class EventSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One event as written in a script."""

    at_step: Annotated[int, _meta(bounds.STEPS)]
    grant: _Target = None
    preempt: _Target = None
    lose: _Target = None
    grace_s: Annotated[float, _meta(bounds.SECONDS)] | None = None
    reason: Annotated[str, msgspec.Meta(max_length=bounds.LINE_CHARS)] = ""


class ScriptSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A script as written (see the module doc)."""

    nodes: Annotated[int, _meta(bounds.NODES)]
    gpus_per_node: Annotated[int, _meta(bounds.GPUS_PER_NODE)] = 1
    initial_nodes: Annotated[int, _meta(bounds.NODES)] = 1
    grace_s: Annotated[float, _meta(bounds.SECONDS)] = 30.0
    grant_requests: bool = False
    settled_steps: bool = False
    end_step: Annotated[int, _meta(bounds.STEPS)] | None = None
    events: Annotated[tuple[EventSpec, ...],
                      msgspec.Meta(max_length=int(bounds.SCRIPT_EVENTS.high))] = ()


class ScriptError(InputError, ValueError):
    """An events script that does not parse or does not fit its cluster (one line)."""


@dataclass(frozen=True)
class ScriptedEvent:
    """One validated event: a count of whole nodes or named devices.

    Attributes:
        index: position in the script, from 1 (what messages call "event N").
    """

    index: int
    at_step: int
    kind: EventKind
    count: int | None
    devices: tuple[Device, ...]
    grace_s: float
    reason: str = ""

    def __str__(self) -> str:
        what = (f"{self.count} node(s)" if self.count is not None
                else ",".join(str(d) for d in self.devices))
        grace = f" (grace {self.grace_s:g} s)" if self.kind == "preempt" else ""
        return f"event {self.index} at step {self.at_step}: {self.kind} {what}{grace}"


@dataclass(frozen=True)
class EventsScript:
    """A validated script: its cluster, the anchor and the events in step order."""

    source: str
    topology: ClusterTopology
    initial_nodes: int
    grant_requests: bool
    events: tuple[ScriptedEvent, ...]
    settled_steps: bool = False
    end_step: int | None = None

    @property
    def anchor_devices(self) -> tuple[Device, ...]:
        return tuple(Device(n, i) for n in self.topology.nodes[:self.initial_nodes]
                     for i in range(self.topology.gpus_per_node))


# --------------------------------------------------------------------------- parsing


def load_script(path: str | Path) -> EventsScript:
    """Read and validate a script file (``.json``; ``.yaml``/``.yml`` with PyYAML).

    Raises:
        ScriptError: one line naming the file and the problem.
    """
    path = Path(path)
    source = path.name
    try:
        raw = bounds.read_capped(path)
    except OSError as e:
        raise ScriptError(f"{source}: cannot read {path}: {e.strerror}") from None
    except bounds.BoundError as e:
        raise ScriptError(f"{source}: {e}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            yaml: Any = importlib.import_module("yaml")
        except ImportError:
            raise ScriptError(f"{source}: YAML scripts need PyYAML (pip install pyyaml); "
                              f"or write the script as JSON") from None
        try:
            # An alias repeats a node by reference: a few lines of them expand to billions of
            # values when the script is checked (billion laughs). Scripts need none.
            if any(isinstance(t, yaml.AliasToken) for t in yaml.scan(raw)):
                raise ScriptError(f"{source}: YAML aliases (*name) are not allowed in a "
                                  "script; write the values out")
            obj = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ScriptError(f"{source}: not valid YAML: {_one_line(str(e))}") from None
        return script_from_dict(obj, source)
    return parse_script(raw, source)


def parse_script(data: bytes | str, source: str = "<script>") -> EventsScript:
    """Validate a JSON script.

    Raises:
        ScriptError: one line naming ``source`` and the problem.
    """
    try:
        spec = msgspec.json.decode(data, type=ScriptSpec)
    except msgspec.ValidationError as e:
        raise ScriptError(f"{source}: {_explain(e)}") from None
    except msgspec.DecodeError as e:
        raise ScriptError(f"{source}: not valid JSON: {_one_line(str(e))}") from None
    return _validated(spec, source)


def script_from_dict(obj: object, source: str = "<options>") -> EventsScript:
    """Validate a script given as Python data (options, or parsed YAML).

    Raises:
        ScriptError: one line naming ``source`` and the problem.
    """
    try:
        spec = msgspec.convert(obj, ScriptSpec)
    except msgspec.ValidationError as e:
        raise ScriptError(f"{source}: {_explain(e)}") from None
    return _validated(spec, source)


def script_from_options(nodes: int, gpus_per_node: int = 1, initial_nodes: int = 1,
                        events: Sequence[Mapping[str, object]] = (), *,
                        grace_s: float = 30.0, grant_requests: bool = False) -> EventsScript:
    """A script from keyword options (e.g. a CLI's ``--nodes``/``--event`` flags)."""
    return script_from_dict({"nodes": nodes, "gpus_per_node": gpus_per_node,
                             "initial_nodes": initial_nodes, "grace_s": grace_s,
                             "grant_requests": grant_requests, "events": list(events)})


_PATH = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_EVENT_PATH = re.compile(r"^\.events\[(?P<i>\d+)\](?P<rest>.*)$")


def _explain(e: msgspec.ValidationError) -> str:
    """msgspec's ``Expected ... - at `$.events[2].grant``` as ``event 3: grant: expected ...``."""
    m = _PATH.match(str(e))
    msg, path = (m.group("msg"), m.group("path") or "") if m else (str(e), "")
    msg = msg[:1].lower() + msg[1:]
    ev = _EVENT_PATH.match(path)
    fields = ScriptSpec.__struct_fields__
    where = ""
    if ev:
        where = f"event {int(ev.group('i')) + 1}: "
        path = ev.group("rest")
        fields = EventSpec.__struct_fields__
    elif path.startswith(".events"):
        where = "events: "
        path = path[len(".events"):]
    path = path.lstrip(".")
    if "unknown field" in msg:
        msg += f" (fields: {', '.join(fields)})"
    return f"{where}{path + ': ' if path else ''}{msg}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _validated(spec: ScriptSpec, source: str) -> EventsScript:
    def fail(msg: str) -> ScriptError:
        return ScriptError(f"{source}: {msg}")

    if spec.initial_nodes > spec.nodes:
        raise fail(f"initial_nodes ({spec.initial_nodes}) exceeds nodes ({spec.nodes})")
    try:  # before the topology lists every device; each can become a process on this host
        bounds.check_product("the local cluster", {"nodes": spec.nodes,
                                                   "gpus_per_node": spec.gpus_per_node},
                             bounds.PROCESSES)
        for i, ev in enumerate(spec.events, start=1):
            bounds.check_text(f"event {i}: reason", ev.reason, bounds.LINE_CHARS)
            for kind in _KINDS:
                target = getattr(ev, kind)
                for name in ((target,) if isinstance(target, str) else
                             target if isinstance(target, tuple) else ()):
                    bounds.check_text(f"event {i}: {kind}: a name", name)
    except bounds.BoundError as e:
        raise fail(str(e)) from None
    topology = ClusterTopology(spec.gpus_per_node,
                               tuple(f"n{i}" for i in range(spec.nodes)))
    events: list[ScriptedEvent] = []
    for i, ev in enumerate(spec.events, start=1):
        given = [k for k in _KINDS if getattr(ev, k) is not None]
        if len(given) != 1:
            raise fail(f"event {i}: give exactly one of grant, preempt, lose "
                       f"(got {', '.join(given) or 'none'})")
        kind = given[0]
        if ev.grace_s is not None and kind != "preempt":
            raise fail(f"event {i}: grace_s applies only to preempt")
        if events and ev.at_step < events[-1].at_step:
            raise fail(f"event {i}: at_step {ev.at_step} comes before event {i - 1}'s "
                       f"at_step {events[-1].at_step}; list events in step order")
        target = getattr(ev, kind)
        count: int | None = None
        devices: tuple[Device, ...] = ()
        if isinstance(target, int):
            count = target
        else:
            names = (target,) if isinstance(target, str) else target
            if not names:
                raise fail(f"event {i}: {kind} names no nodes or devices")
            try:
                devices = resolve_names(topology, names)
            except ValueError as e:
                raise fail(f"event {i}: {e}") from None
        grace = ev.grace_s if ev.grace_s is not None else spec.grace_s
        events.append(ScriptedEvent(i, ev.at_step, kind, count, devices, grace, ev.reason))
    if spec.end_step is not None and events and spec.end_step < events[-1].at_step:
        raise fail(f"end_step {spec.end_step} comes before the last event's at_step "
                   f"{events[-1].at_step}; the events fire before training ends")
    script = EventsScript(source, topology, spec.initial_nodes, spec.grant_requests,
                          tuple(events), spec.settled_steps, spec.end_step)
    # Play it once without a coordinator: every count available, no anchor touched.
    dry = ScriptedResources(script, strict=True)
    for event in script.events:
        try:
            dry.fire(event, now=0.0)
        except ScriptError as e:
            raise fail(str(e)) from None
    return script


def resolve_names(topology: ClusterTopology, names: Iterable[str]) -> tuple[Device, ...]:
    """``n1`` (every device of node n1) and ``n1:0`` (one device) -> sorted devices.

    Raises:
        ValueError: a name that is not a node or device of ``topology``.
    """
    nodes = topology.nodes
    gpn = topology.gpus_per_node
    span = f"{nodes[0]}..{nodes[-1]}" if len(nodes) > 1 else nodes[0]
    out: dict[Device, None] = {}
    for name in names:
        node, sep, local = name.partition(":")
        if node not in nodes:
            raise ValueError(f"node {node} does not exist (nodes: {span})")
        if not sep:
            out.update((Device(node, i), None) for i in range(gpn))
            continue
        if not local.isdigit() or int(local) >= gpn:
            raise ValueError(f"device {name} does not exist ({node} has devices "
                             f"{node}:0..{node}:{gpn - 1})" if gpn > 1 else
                             f"device {name} does not exist ({node} has device {node}:0)")
        out[Device(node, int(local))] = None
    return tuple(sorted(out, key=topology_order(topology)))


def topology_order(topology: ClusterTopology) -> Any:
    """Sort key: devices in node order, then local index."""
    return lambda d: (topology.index(d.node), d.local)


# --------------------------------------------------------------------------- state


class ScriptedResources:
    """Who holds which simulated device, moved by script events, time and the coordinator.

    Pure (no processes, no clock: ``now`` is passed in). Events accumulate until
    :meth:`drain`. With ``strict`` a shortfall raises :class:`ScriptError` (the load-time
    check); otherwise the event does what it can and logs a warning.
    """

    def __init__(self, script: EventsScript, *, strict: bool = False) -> None:
        self.script = script
        self.strict = strict
        self._order = topology_order(script.topology)
        self._all = tuple(Device(n, i) for n in script.topology.nodes
                          for i in range(script.topology.gpus_per_node))
        self._anchor = frozenset(script.anchor_devices)
        self._owner: dict[Device, str] = {}          # held by the job: device -> allocation
        self._gone: dict[Device, str] = {}           # preempted or failed: device -> why
        self._noticed: dict[Device, float] = {}      # held, under notice: device -> deadline
        self._alloc_order: dict[str, int] = {}
        self._granted_for: dict[str, str | None] = {}  # allocation -> the request it met
        self._next_alloc = 0
        self._pending: list[tuple[str, int]] = []     # requests waiting: (key, nodes)
        self._keys: set[str] = set()
        self._fired = 0
        self._step = -1
        self._lag = 0  # settled_steps: steps trained while not settled (not reported)
        self._undelivered = False  # a group fired and no tick (poll) came since
        self._ended = False  # EndTraining went out
        self._out: list[BackendEvent] = []
        self.version = 0  # bumped at every change of the state (:meth:`state`)
        self._grant(script.anchor_devices, None)

    # -- observed state ----------------------------------------------------------------
    @property
    def held(self) -> Mapping[Device, str]:
        """Devices the job holds, with their allocation."""
        return dict(self._owner)

    @property
    def noticed(self) -> Mapping[Device, float]:
        """Held devices under a preemption notice, with their deadline."""
        return dict(self._noticed)

    @property
    def gone(self) -> frozenset[Device]:
        return frozenset(self._gone)

    @property
    def unfired(self) -> tuple[ScriptedEvent, ...]:
        """The events that have not fired (yet)."""
        return self.script.events[self._fired:]

    @property
    def settled_step(self) -> int:
        """The highest step reported, less (with ``settled_steps``) the steps trained while
        a resize was in flight: what ``at_step`` and ``end_step`` are counted in."""
        return self._step - self._lag

    @property
    def pending_requests(self) -> tuple[tuple[str, int], ...]:
        return tuple(self._pending)

    def free_nodes(self) -> list[str]:
        """Nodes all of whose devices are free, in node order."""
        busy = {d.node for d in self._owner} | {d.node for d in self._gone}
        return [n for n in self.script.topology.nodes if n not in busy]

    def drain(self) -> list[BackendEvent]:
        out, self._out = self._out, []
        if out:
            self.version += 1
        return out

    # -- inputs --------------------------------------------------------------------------
    def on_step(self, step: int, now: float) -> None:
        """The job reached ``step`` (steps going back count as the highest seen): fire the
        earliest group of scripted events due by then (events with one ``at_step``), unless
        the group fired before has not been handed over yet (no :meth:`tick` since). With
        ``settled_steps``, steps not reported since the last report (trained while a resize
        was in flight) push the remaining events back by as many. Once every event fired,
        and the last group was handed over, ``end_step`` ends training, at a step no lower
        than the highest reported (after a rollback, the lost steps are trained again
        first: a job never finishes below a step it reported)."""
        if step > self._step:
            self.version += 1
        if self.script.settled_steps and 0 <= self._step < step - 1:
            self._lag += step - 1 - self._step
        self._step = max(self._step, step)
        events = self.script.events
        end = self.script.end_step
        if self._fired >= len(events) and not self._undelivered and end is not None \
                and not self._ended and self.settled_step >= end and step >= self._step:
            self._ended = True
            logger.info("[local] the script played out: training ends at step %d", step)
            self._out.append(EndTraining(f"the events script played out at step {step}"))
            return
        if self._undelivered or self._fired >= len(events) \
                or events[self._fired].at_step + self._lag > self._step:
            return
        at = events[self._fired].at_step
        while self._fired < len(events) and events[self._fired].at_step == at:
            event = events[self._fired]
            self._fired += 1
            logger.info("[local] %s%s", event, f": {event.reason}" if event.reason else "")
            self.fire(event, now)
        self._undelivered = True

    def tick(self, now: float) -> None:
        """The backend polls (what fired so far is handed over): take preempted devices
        whose deadline passed; grant waiting requests (when the script grants requests)."""
        self._undelivered = False
        due = sorted((d for d, t in self._noticed.items() if t <= now), key=self._order)
        if due:
            self._take(due, "preempted")
        if self.script.grant_requests:
            while self._pending:
                key, nodes = self._pending[0]
                free = self.free_nodes()
                if len(free) < nodes:
                    break
                self._pending.pop(0)
                self._grant(self._node_devices(free[:nodes]), key)

    def request(self, key: str, nodes: int) -> None:
        """Note a request for ``nodes`` whole nodes (a key seen before is ignored)."""
        if key in self._keys:
            return
        self.version += 1
        self._keys.add(key)
        self._pending.append((key, nodes))

    def withdraw(self, key: str) -> bool:
        """Drop the pending request ``key``; whether it was pending."""
        kept = [(k, n) for k, n in self._pending if k != key]
        dropped = len(kept) != len(self._pending)
        self._pending = kept
        self.version += dropped
        return dropped

    def release(self, devices: Iterable[Device]) -> list[Device]:
        """Give devices back; returns those that were held (the others are ignored).
        Devices under a preemption notice go to the preemptor, the rest become free."""
        released = sorted({d for d in devices if d in self._owner}, key=self._order)
        self.version += bool(released)
        for d in released:
            del self._owner[d]
            if self._noticed.pop(d, None) is not None:
                self._gone[d] = "preempted"
        return released

    def fire(self, event: ScriptedEvent, now: float) -> None:
        """Apply one scripted event."""
        self.version += 1
        if event.kind == "grant":
            self._fire_grant(event)
        elif event.kind == "preempt":
            devices = self._pick(event)
            if devices:
                self._notice(devices, now + event.grace_s)
        else:
            devices = self._pick(event)
            held = [d for d in devices if d in self._owner]
            self._take(held, "failure")
            for d in devices:
                self._gone.setdefault(d, "failure")

    # -- kept across a coordinator's restart ------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The cluster's state as JSON-able data (what :meth:`resume` takes up): the script
        it plays, who holds what, what is gone or under notice, requests, how far the script
        played, and the events not handed over yet."""
        return {
            "script": _fingerprint(self.script),
            "owner": {str(d): a for d, a in self._owner.items()},
            "gone": {str(d): why for d, why in self._gone.items()},
            "noticed": {str(d): t for d, t in self._noticed.items()},
            "allocations": [[a, self._granted_for.get(a)] for a in
                            sorted(self._alloc_order, key=self._alloc_order.__getitem__)],
            "pending": [[k, n] for k, n in self._pending], "keys": sorted(self._keys),
            "fired": self._fired, "step": self._step, "lag": self._lag, "ended": self._ended,
            "out": [_event_data(e) for e in self._out],
        }

    def resume(self, state: Mapping[str, Any]) -> None:
        """Take up the cluster where ``state`` (from :meth:`state`, by an earlier coordinator
        of the job) left it. What it holds is announced again, as its first events: a
        :class:`Grant` per allocation still held (the anchor first), a
        :class:`PreemptNotice` per notice still running; then the losses and the end of
        training that fired and were not handed over.

        Raises:
            ValueError: ``state`` is of another script, or malformed (one line); nothing
                changed.
        """
        if state.get("script") != _fingerprint(self.script):
            raise ValueError("it was kept for another events script or cluster")
        try:
            owner = {_device(k): str(a) for k, a in state["owner"].items()}
            gone = {_device(k): str(why) for k, why in state["gone"].items()}
            noticed = {_device(k): float(t) for k, t in state["noticed"].items()}
            allocs = [(str(a), None if r is None else str(r)) for a, r in state["allocations"]]
            pending = [(str(k), int(n)) for k, n in state["pending"]]
            keys = {str(k) for k in state["keys"]}
            fired, step, lag = int(state["fired"]), int(state["step"]), int(state["lag"])
            ended = bool(state["ended"])
            undelivered = [e for e in map(_event_of, state["out"])
                           if isinstance(e, (Loss, EndTraining))]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"it is malformed ({e.__class__.__name__}: {e})") from None
        order = {a: i for i, (a, _r) in enumerate(allocs)}
        if not 0 <= fired <= len(self.script.events) or set(owner.values()) - set(order) \
                or not set(owner) | set(gone) <= set(self._all) or set(noticed) - set(owner):
            raise ValueError("it names devices, allocations or events the script does not "
                             "have")
        self._owner, self._gone, self._noticed = owner, gone, noticed
        self._alloc_order, self._granted_for = order, dict(allocs)
        self._next_alloc = max((int(a[1:]) for a in order if a[1:].isdigit()), default=-1) + 1
        self._pending, self._keys = pending, keys
        self._fired, self._step, self._lag, self._ended = fired, step, lag, ended
        self._undelivered = False
        self._out = [Grant(a, devs, self._granted_for.get(a))
                     for a, devs in self._by_allocation(owner)]
        by_notice: dict[float, list[Device]] = {}
        for d, t in noticed.items():
            by_notice.setdefault(t, []).append(d)
        for t, devs in sorted(by_notice.items()):
            self._out += [PreemptNotice(a, ds, t) for a, ds in self._by_allocation(devs)]
        self._out += undelivered
        self.version += 1

    # -- internals -----------------------------------------------------------------------
    def _short(self, event: ScriptedEvent, msg: str) -> None:
        if self.strict:
            raise ScriptError(f"event {event.index}: {msg}")
        logger.warning("[local] %s: %s; doing what is possible", event, msg)

    def _fire_grant(self, event: ScriptedEvent) -> None:
        if event.count is not None:
            free = self.free_nodes()
            if len(free) < event.count:
                self._short(event, f"grant {event.count} node(s), but only {len(free)} "
                                   f"{'is' if len(free) == 1 else 'are'} free then"
                                   f"{' (' + ', '.join(free) + ')' if free else ''}")
            devices = self._node_devices(free[:event.count])
        else:
            devices = []
            for d in event.devices:
                if d in self._owner or d in self._gone:
                    self._short(event, f"{d} is not free then ({self._state(d)})")
                else:
                    devices.append(d)
        if devices:
            request = self._pending.pop(0)[0] if self._pending else None
            self._grant(devices, request)

    def _pick(self, event: ScriptedEvent) -> list[Device]:
        """The devices a preempt or lose event hits."""
        verb = event.kind
        if event.count is None:
            for d in event.devices:
                if d in self._anchor:
                    raise ScriptError(
                        f"event {event.index}: {d.node} belongs to the anchor allocation "
                        f"(initial_nodes={self.script.initial_nodes}), which runs the "
                        f"coordinator and is never preempted or lost")
            if verb == "lose":
                hit = [d for d in event.devices if d not in self._gone]
                for d in event.devices:
                    if d in self._gone:
                        self._short(event, f"{d} is already gone ({self._gone[d]})")
                return hit
            hit = []
            for d in event.devices:
                if d not in self._owner or d in self._noticed:
                    self._short(event, f"{d} is not held by the job then ({self._state(d)})")
                else:
                    hit.append(d)
            return hit
        # By count: whole nodes, newest allocation first, highest node first, skipping
        # the anchor and (for preempt) nodes already under notice.
        # A failure hits nodes under notice last (they are leaving anyway).
        candidates: dict[str, tuple[int, int, int]] = {}
        for d, alloc in self._owner.items():
            if alloc == ANCHOR or (verb == "preempt" and d in self._noticed):
                continue
            rank = (0 if d in self._noticed else 1, self._alloc_order[alloc],
                    self.script.topology.index(d.node))
            candidates[d.node] = max(candidates.get(d.node, rank), rank)
        nodes = sorted(candidates, key=lambda n: candidates[n], reverse=True)
        if len(nodes) < event.count:
            listed = ", ".join(sorted(nodes, key=self.script.topology.index))
            self._short(event, f"{verb} {event.count} node(s), but the job holds only "
                               f"{len(nodes)} node(s) outside the anchor then"
                               f"{f' ({listed})' if nodes else ''}")
        chosen = set(nodes[:event.count])
        return sorted((d for d in self._owner if d.node in chosen
                       and not (verb == "preempt" and d in self._noticed)), key=self._order)

    def _state(self, d: Device) -> str:
        if d in self._gone:
            return f"gone: {self._gone[d]}"
        if d in self._noticed:
            return f"under preemption notice in allocation {self._owner[d]}"
        if d in self._owner:
            return f"held by the job in allocation {self._owner[d]}"
        return "free"

    def _node_devices(self, nodes: Iterable[str]) -> list[Device]:
        gpn = self.script.topology.gpus_per_node
        return [Device(n, i) for n in nodes for i in range(gpn)]

    def _grant(self, devices: Iterable[Device], request: str | None) -> None:
        alloc = f"a{self._next_alloc}"
        self.version += 1
        self._alloc_order[alloc] = self._next_alloc
        self._granted_for[alloc] = request
        self._next_alloc += 1
        devs = tuple(sorted(devices, key=self._order))
        for d in devs:
            self._owner[d] = alloc
        self._out.append(Grant(alloc, devs, request))

    def _by_allocation(self, devices: Iterable[Device]) -> list[tuple[str, tuple[Device, ...]]]:
        groups: dict[str, list[Device]] = {}
        for d in devices:
            groups.setdefault(self._owner[d], []).append(d)
        return [(a, tuple(sorted(ds, key=self._order)))
                for a, ds in sorted(groups.items(), key=lambda kv: self._alloc_order[kv[0]])]

    def _notice(self, devices: Sequence[Device], deadline: float) -> None:
        for d in devices:
            self._noticed[d] = deadline
        for alloc, devs in self._by_allocation(devices):
            self._out.append(PreemptNotice(alloc, devs, deadline))

    def _take(self, devices: Sequence[Device], cause: Literal["failure", "preempted"]) -> None:
        self.version += bool(devices)
        groups = self._by_allocation(devices)
        for d in devices:
            del self._owner[d]
            self._noticed.pop(d, None)
            self._gone[d] = cause
        for alloc, devs in groups:
            self._out.append(Loss(alloc, devs, cause))


def _fingerprint(script: EventsScript) -> dict[str, Any]:
    """What a kept state must match to be taken up: the cluster and the events."""
    return {"source": script.source, "nodes": list(script.topology.nodes),
            "gpus_per_node": script.topology.gpus_per_node,
            "initial_nodes": script.initial_nodes,
            "events": [str(e) for e in script.events]}


def _device(name: str) -> Device:
    node, local = name.rsplit(":", 1)
    return Device(node, int(local))


def _event_data(event: BackendEvent) -> dict[str, Any]:
    data: dict[str, Any] = {"kind": type(event).__name__}
    for key in ("allocation", "request", "deadline", "cause", "reason"):
        if hasattr(event, key):
            data[key] = getattr(event, key)
    data["devices"] = [str(d) for d in getattr(event, "devices", ())]
    return data


def _event_of(data: Mapping[str, Any]) -> BackendEvent | None:
    """An event from :func:`_event_data` (None: a kind not kept)."""
    devices = tuple(_device(d) for d in data.get("devices", ()))
    match data["kind"]:
        case "Grant":
            return Grant(str(data["allocation"]), devices, data.get("request"))
        case "PreemptNotice":
            return PreemptNotice(str(data["allocation"]), devices, float(data["deadline"]))
        case "Loss":
            return Loss(str(data["allocation"]), devices,
                        "preempted" if data.get("cause") == "preempted" else "failure")
        case "EndTraining":
            return EndTraining(str(data["reason"]))
    return None
