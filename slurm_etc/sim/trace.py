"""The trace format `slurm-etc simulate --trace` replays (JSON; see docs/allocator.md).

A trace describes a cluster, the elastic jobs on it, the admin policies that bind them and
a time-ordered list of events: elastic jobs asking to grow (a member allocation is
submitted), preemptions of their members, node failures and recoveries, and rigid
(non-elastic) jobs submitted to the same cluster. Which devices a member allocation or a
rigid job gets, and when, is decided by the simulated Slurm, so what one allocator
releases is what the next request can use.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .. import bounds
from ..alloc.chooser import Hardware, TrainingJob
from ..errors import InputError
from ..plan.errors import ConfigError
from ..plan.model import load_model
from ..policy.rules import FIELDS, PolicyError, ResizePolicy, Scope

EVENT_KINDS = ("grow", "preempt", "fail", "recover", "submit")


class TraceError(InputError, ValueError):
    """A trace that cannot be replayed: where in the file, what, and what is valid."""


@dataclass(frozen=True)
class ClusterSpec:
    """Homogeneous nodes under leaf switches, and what each device offers."""

    nodes: int
    gpus_per_node: int = 8
    nodes_per_switch: int = 16
    memory_gib: float = 80.0
    tflops: float = 400.0
    intra_node_gbps: float = 150.0
    inter_node_gbps: float = 25.0

    def hardware(self) -> Hardware:
        return Hardware(self.gpus_per_node, self.memory_gib, self.tflops,
                        self.intra_node_gbps, self.inter_node_gbps)


@dataclass(frozen=True)
class ElasticJobSpec:
    """An elastic training job: its anchor allocation starts at ``start`` with ``nodes``
    whole nodes; member allocations follow ``grow`` events."""

    name: str
    model: str
    global_batch: int
    nodes: int
    micro_batch: int = 1
    distributed_optimizer: bool = True
    partition: str = "gpu"
    account: str = "default"
    start: float = 0.0

    def training(self) -> TrainingJob:
        return TrainingJob(load_model(self.model), self.global_batch, self.micro_batch,
                           self.distributed_optimizer)


@dataclass(frozen=True)
class Event:
    """One trace event (fields a kind does not use stay None)."""

    t: float
    kind: str
    job: str | None = None
    gpus: int | None = None
    nodes: int | None = None
    node: int | None = None
    duration: float | None = None


@dataclass(frozen=True)
class Trace:
    cluster: ClusterSpec
    jobs: tuple[ElasticJobSpec, ...]
    events: tuple[Event, ...]
    duration: float
    policies: tuple[tuple[Scope, ResizePolicy], ...] = field(default=())

    def to_json(self) -> dict:
        return {
            "cluster": asdict(self.cluster),
            "duration": self.duration,
            "policies": [{"scope": str(s), **{k: list(v) if isinstance(v, tuple) else v
                                              for k, v in p.set_fields().items()}}
                         for s, p in self.policies],
            "jobs": [asdict(j) for j in self.jobs],
            "events": [{k: v for k, v in asdict(e).items() if v is not None}
                       for e in self.events],
        }


# The bound of every numeric field, per part of a trace: a numeric field added without one
# fails tests/unit/test_bounds_property.py. Text fields are bounded by ``bounds.check_text``.
TRACE_BOUNDS: dict[type, dict[str, bounds.Bound]] = {
    ClusterSpec: {"nodes": bounds.NODES, "gpus_per_node": bounds.GPUS_PER_NODE,
                  "nodes_per_switch": bounds.NODES, "memory_gib": bounds.MEMORY_GIB,
                  "tflops": bounds.TFLOPS, "intra_node_gbps": bounds.GBPS,
                  "inter_node_gbps": bounds.GBPS},
    ElasticJobSpec: {"global_batch": bounds.BATCH, "nodes": bounds.NODES,
                     "micro_batch": bounds.BATCH, "start": bounds.SIM_SECONDS},
    # a preemption takes GPUs across nodes; grow and submit are checked against one node
    Event: {"t": bounds.SIM_SECONDS, "gpus": bounds.DEVICES, "nodes": bounds.NODES,
            "node": bounds.NODE_INDEX, "duration": bounds.SIM_SECONDS},
}


def load_trace(path: str | Path) -> Trace:
    """Read and validate a trace file.

    Raises:
        TraceError: unreadable file, malformed JSON or an invalid entry (with its place).
    """
    try:
        data = bounds.load_json(bounds.read_capped(path))
    except bounds.BoundError as exc:
        raise TraceError(f"trace file {path}: {exc}") from None
    except RecursionError:
        raise TraceError(f"trace file {path} nests too deeply to be a trace") from None
    except FileNotFoundError:
        raise TraceError(f"trace file {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"trace file {path} is not valid JSON: {exc.msg} at line "
                         f"{exc.lineno} column {exc.colno}") from None
    except IsADirectoryError:
        raise TraceError(f"trace file {path} is a directory; give a JSON file") from None
    except OSError as exc:
        raise TraceError(f"cannot read trace file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"trace file {path} is not text (not a JSON trace)") from None
    return parse_trace(data, str(path))


def parse_trace(data: dict, where: str = "trace") -> Trace:
    """Build a validated Trace from its JSON form."""
    if not isinstance(data, dict):
        raise TraceError(f"{where}: expected a JSON object with cluster, jobs, events")
    cluster = _build(ClusterSpec, data.get("cluster"), f"{where}: cluster")
    _bounded(f"{where}: cluster", bounds.check_product, "devices",
             {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node}, bounds.DEVICES)
    raw_jobs = _list(data, "jobs", where)
    raw_events = _list(data, "events", where)
    _bounded(where, bounds.TRACE_JOBS.check, "the number of jobs", len(raw_jobs))
    _bounded(where, bounds.TRACE_EVENTS.check, "the number of events", len(raw_events))
    jobs = tuple(_build(ElasticJobSpec, j, f"{where}: jobs[{i}]")
                 for i, j in enumerate(raw_jobs))
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise TraceError(f"{where}: elastic job names must be unique")
    for i, j in enumerate(jobs):
        try:
            j.training()
        except ConfigError as exc:
            raise TraceError(f"{where}: jobs[{i}] ({j.name}): {exc}") from None
        if j.nodes < 1 or j.nodes > cluster.nodes:
            raise TraceError(f"{where}: jobs[{i}] ({j.name}): nodes must be 1..{cluster.nodes}")
    raw_policies = _list(data, "policies", where, required=False)
    _bounded(where, bounds.TRACE_POLICIES.check, "the number of policies", len(raw_policies))
    policies = tuple(_policy(p, f"{where}: policies[{i}]") for i, p in enumerate(raw_policies))
    events = []
    for i, e in enumerate(raw_events):
        event = _build(Event, e, f"{where}: events[{i}]")
        _check_event(event, set(names), cluster, f"{where}: events[{i}]")
        events.append(event)
    events.sort(key=lambda e: e.t)  # stable: equal times keep file order
    duration = data.get("duration", max((e.t for e in events), default=0.0))
    if (not isinstance(duration, (int, float)) or isinstance(duration, bool)
            or not math.isfinite(duration) or duration <= 0):
        raise TraceError(f"{where}: duration must be a positive number of seconds")
    _bounded(where, bounds.SIM_SECONDS.check, "duration", duration)
    return Trace(cluster, jobs, tuple(events), float(duration), policies)


def _bounded(where: str, check: Any, *args: Any) -> None:
    """``check(*args)``, a bounds check, its refusal as a TraceError naming ``where``."""
    try:
        check(*args)
    except bounds.BoundError as exc:
        raise TraceError(f"{where}: {exc}") from None


def _list(data: dict, key: str, where: str, required: bool = True) -> list:
    value = data.get(key, None if required else [])
    if not isinstance(value, list):
        raise TraceError(f"{where}: {key} must be a list")
    return value


def _build(cls, raw, where: str):
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: expected a JSON object")
    names = [f for f in cls.__dataclass_fields__]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {', '.join(unknown)}; valid: "
                         f"{', '.join(names)}")
    _check_types(cls, raw, where)
    limits = TRACE_BOUNDS.get(cls, {})
    for f in fields(cls):
        value = raw.get(f.name)
        if value is None:
            continue
        if f.name in limits:
            _bounded(where, limits[f.name].check, f.name, value)
        elif isinstance(value, str):
            _bounded(where, bounds.check_text, f.name, value,
                     bounds.PATH_CHARS if f.name == "model" else bounds.NAME_CHARS)
    try:
        return cls(**raw)
    except TypeError as exc:
        raise TraceError(f"{where}: {exc}") from None


# JSON types of the annotated field types (annotations are strings here)
_JSON_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float),
                                            "str": (str,), "bool": (bool,)}
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string",
               "bool": "true or false"}


def _check_types(cls: Any, raw: dict, where: str) -> None:
    """Each given field of the JSON object has its field's type (null where optional)."""
    for f in fields(cls):
        if f.name not in raw:
            continue
        value, text = raw[f.name], str(f.type)
        base = text.removesuffix(" | None")
        optional = base != text
        allowed = _JSON_TYPES.get(base)
        if allowed is None or (value is None and optional):
            continue
        wrong = (not isinstance(value, allowed) or (isinstance(value, bool) and base != "bool")
                 or (isinstance(value, float) and not math.isfinite(value)))
        if wrong:
            raise TraceError(f"{where}: {f.name} must be {_TYPE_WORDS[base]}"
                             f"{' or null' if optional else ''}, got {value!r}")


def _policy(raw, where: str) -> tuple[Scope, ResizePolicy]:
    if not isinstance(raw, dict) or not isinstance(raw.get("scope"), str):
        raise TraceError(f"{where}: expected an object with scope 'partition:NAME' or "
                         "'account:NAME' and policy fields")
    kind, _, name = raw["scope"].partition(":")
    # values straight from JSON: ResizePolicy checks their types
    fields_: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                               for k, v in raw.items() if k != "scope"}
    unknown = sorted(set(fields_) - set(FIELDS))
    if unknown:
        raise TraceError(f"{where}: unknown policy field(s) {', '.join(unknown)}; valid: "
                         f"{', '.join(FIELDS)}")
    try:
        return Scope(kind, name), ResizePolicy(**fields_)
    except PolicyError as exc:
        raise TraceError(f"{where}: {exc}") from None


def _check_event(e: Event, jobs: set[str], cluster: ClusterSpec, where: str) -> None:
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise TraceError(f"{where} ({e.kind}): {what}")

    need(e.kind in EVENT_KINDS, f"unknown kind; kinds: {', '.join(EVENT_KINDS)}")
    need(isinstance(e.t, (int, float)) and e.t >= 0, "t must be seconds >= 0")
    G = cluster.gpus_per_node
    if e.kind in ("grow", "submit"):
        need((e.gpus is None) != (e.nodes is None), "give exactly one of gpus or nodes")
        need(e.gpus is None or 1 <= e.gpus <= G, f"gpus must be 1..{G} (one node)")
        need(e.nodes is None or 1 <= e.nodes <= cluster.nodes,
             f"nodes must be 1..{cluster.nodes}")
    if e.kind in ("grow", "preempt"):
        need(e.job in jobs, f"job must name an elastic job ({', '.join(sorted(jobs))})")
    if e.kind == "preempt":
        need(isinstance(e.gpus, int) and e.gpus >= 1, "gpus must be a positive integer")
    if e.kind in ("preempt", "submit"):
        need(isinstance(e.duration, (int, float)) and e.duration > 0,
             "duration must be positive seconds")
    if e.kind == "submit":
        need(isinstance(e.job, str) and e.job not in jobs,
             "job must name a rigid job (not an elastic one)")
    if e.kind in ("fail", "recover"):
        need(isinstance(e.node, int) and 0 <= e.node < cluster.nodes,
             f"node must be a node index 0..{cluster.nodes - 1}")
