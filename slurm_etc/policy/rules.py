"""Admin resize policies: what HPC admins allow elastic jobs, per partition or account.

A policy sets any subset of the fields below; unset fields fall back to the defaults. A job
is bound by its partition's policy and its account's policy together: ``effective`` merges
them so that the stricter value of every field wins.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .. import bounds
from ..errors import InputError

SCOPE_KINDS = ("partition", "account")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

# The value of one policy field: counts, tp/pp lists, the grow flag, partition/qos names.
PolicyValue = int | bool | str | tuple[int, ...] | None


class PolicyError(InputError, ValueError):
    """An invalid policy, scope or assignment, with the valid choices."""


@dataclass(frozen=True, order=True)
class Scope:
    """What a policy applies to: a Slurm partition or a Slurm account."""

    kind: str
    name: str

    def __post_init__(self) -> None:
        if self.kind not in SCOPE_KINDS:
            raise PolicyError(f"policy scope must be one of {', '.join(SCOPE_KINDS)}, "
                              f"got {self.kind!r}")
        if not _NAME.match(self.name):
            raise PolicyError(f"{self.kind} name {self.name!r} is not a Slurm name "
                              "(letters, digits, '_', '.', '-'; at most 64)")

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


@dataclass(frozen=True)
class ResizePolicy:
    """Limits on how an elastic job may resize; ``None`` means not set here.

    Attributes:
        min_nodes: the job never runs on fewer nodes (below it, it pauses).
        max_nodes: the job never holds more nodes.
        allowed_tp: tensor-parallel degrees the job may use.
        allowed_pp: pipeline-parallel degrees the job may use.
        grow: whether the job may request member allocations to grow.
        grow_partition: partition member allocations are submitted to.
        grow_qos: QOS member allocations are submitted with.
        preempt_grace_s: seconds of warning a preemption of a member must leave (the
            member's ``--signal`` lead time; the partition's GraceTime should match).
        max_resizes_per_hour: voluntary resizes allowed in any hour (hysteresis); losses
            are always handled.
        request_patience_s: seconds a node request may pend before it is withdrawn and
            asked again smaller (a big request can wait forever on a busy partition where a
            smaller one starts); checked at most once a minute.
    """

    min_nodes: int | None = None
    max_nodes: int | None = None
    allowed_tp: tuple[int, ...] | None = None
    allowed_pp: tuple[int, ...] | None = None
    grow: bool | None = None
    grow_partition: str | None = None
    grow_qos: str | None = None
    preempt_grace_s: int | None = None
    max_resizes_per_hour: int | None = None
    request_patience_s: int | None = None

    def __post_init__(self) -> None:
        for name in ("min_nodes", "max_nodes", "max_resizes_per_hour", "preempt_grace_s",
                     "request_patience_s"):
            value = getattr(self, name)
            # a patience of 0 would withdraw every request at its first look
            low = 1 if name in ("min_nodes", "max_nodes", "request_patience_s") else 0
            if value is not None and (not _is_int(value) or value < low):
                raise PolicyError(f"{name} must be an integer >= {low}, got "
                                  f"{bounds.shown(value)}")
            _bounded(name, value)
        for name in ("allowed_tp", "allowed_pp"):
            value = getattr(self, name)
            if value is None:
                continue
            if not value or not all(_is_int(v) and v >= 1 for v in value):
                raise PolicyError(f"{name} must be a non-empty list of positive integers, "
                                  f"got {bounds.shown(value)}")
            _bounded(name, value)
            object.__setattr__(self, name, tuple(sorted(set(value))))
        if self.grow is not None and not isinstance(self.grow, bool):
            raise PolicyError(f"grow must be true or false, got {self.grow!r}")
        for name in ("grow_partition", "grow_qos"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and _NAME.match(value)):
                raise PolicyError(f"{name} {value!r} is not a Slurm name "
                                  "(letters, digits, '_', '.', '-'; at most 64)")
        if (self.min_nodes is not None and self.max_nodes is not None
                and self.min_nodes > self.max_nodes):
            raise PolicyError(f"min_nodes ({self.min_nodes}) must not exceed max_nodes "
                              f"({self.max_nodes})")

    def set_fields(self) -> dict[str, Any]:
        """The fields this policy sets (not None), in declaration order."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def is_empty(self) -> bool:
        return not self.set_fields()


FIELDS = tuple(f.name for f in fields(ResizePolicy))

# The bound of every numeric field (of each degree, for the lists): a numeric field added
# without one fails tests/unit/test_bounds_property.py.
POLICY_BOUNDS: dict[str, bounds.Bound] = {
    "min_nodes": bounds.NODES, "max_nodes": bounds.NODES, "allowed_tp": bounds.DEGREE,
    "allowed_pp": bounds.DEGREE, "preempt_grace_s": bounds.SECONDS,
    "max_resizes_per_hour": bounds.RESIZES_PER_HOUR, "request_patience_s": bounds.SECONDS,
}


def _bounded(name: str, value: object) -> None:
    """PolicyError unless ``value`` (a number or a list of degrees) is within its bound."""
    if value is None:
        return
    try:
        if isinstance(value, tuple):
            bounds.DEGREES.check(f"{name} (the number of degrees)", len(value))
            for v in value:
                POLICY_BOUNDS[name].check(name, v)
        else:
            POLICY_BOUNDS[name].check(name, value)
    except bounds.BoundError as exc:
        raise PolicyError(str(exc)) from None


# A node request pending this long is withdrawn and asked again smaller, unless a policy
# says otherwise.
DEFAULT_REQUEST_PATIENCE_S = 300


@dataclass(frozen=True)
class EffectivePolicy:
    """Every field resolved: what ``decide`` applies to one job."""

    min_nodes: int = 1
    max_nodes: int | None = None
    allowed_tp: tuple[int, ...] | None = None
    allowed_pp: tuple[int, ...] | None = None
    grow: bool = True
    grow_partition: str | None = None
    grow_qos: str | None = None
    preempt_grace_s: int = 0
    max_resizes_per_hour: int | None = None
    # None: no policy sets it (DEFAULT_REQUEST_PATIENCE_S); kept apart from the default so
    # that merging takes the shortest any policy sets, never the default over a site's
    request_patience_s: int | None = None

    @property
    def patience_s(self) -> int:
        """How long a node request may pend before it is withdrawn and asked smaller."""
        return (DEFAULT_REQUEST_PATIENCE_S if self.request_patience_s is None
                else self.request_patience_s)


def effective(policies: Iterable[tuple[Scope, ResizePolicy]]) -> EffectivePolicy:
    """Merge the policies that bind one job (its partition's and its account's).

    The stricter value wins: the larger min_nodes and preempt grace, the smaller max_nodes,
    resize cap and request patience (a big request holds its place in the queue less
    long), the intersection of allowed degrees, growth only if all allow it. The
    member partition and QOS come from the account's policy before the partition's.

    Raises:
        PolicyError: the policies contradict each other (naming both scopes).
    """
    out = EffectivePolicy()
    source: dict[str, Scope] = {}
    ordered = sorted(policies, key=lambda sp: SCOPE_KINDS.index(sp[0].kind), reverse=True)
    for scope, policy in ordered:
        for name, value in policy.set_fields().items():
            current = getattr(out, name)
            if name in ("min_nodes", "preempt_grace_s"):
                merged = max(current, value)
            elif name in ("max_nodes", "max_resizes_per_hour", "request_patience_s"):
                merged = value if current is None else min(current, value)
            elif name in ("allowed_tp", "allowed_pp"):
                merged = value if current is None else tuple(sorted(set(current) & set(value)))
                if not merged:
                    raise PolicyError(f"{name} of {source[name]} ({_csv(current)}) and of "
                                      f"{scope} ({_csv(value)}) have nothing in common")
            elif name == "grow":
                merged = current and value
            else:  # grow_partition, grow_qos: the first (account) setting wins
                merged = value if current is None else current
            if merged != current:
                source[name] = scope
            out = replace(out, **{name: merged})
    if out.max_nodes is not None and out.min_nodes > out.max_nodes:
        raise PolicyError(f"min_nodes {out.min_nodes} (from {source['min_nodes']}) exceeds "
                          f"max_nodes {out.max_nodes} (from {source['max_nodes']})")
    return out


def parse_assignments(items: Iterable[str]) -> dict[str, PolicyValue]:
    """Parse ``key=value`` strings into field values (validated by ResizePolicy later).

    Values: integers; ``allowed_tp``/``allowed_pp`` as comma lists (``1,2,4``); ``grow`` as
    yes/no/true/false/1/0; ``preempt_grace_s`` and ``request_patience_s`` also as ``90s``,
    ``5m``, ``1h``.

    Raises:
        PolicyError: unknown key, repeated key or unparsable value, naming the valid keys.
    """
    out: dict[str, PolicyValue] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        raw = raw.strip()
        if not sep or not key:
            raise PolicyError(f"expected key=value, got {item!r}; keys: {', '.join(FIELDS)}")
        if key not in FIELDS:
            raise PolicyError(f"unknown policy key {key!r}; valid keys: {', '.join(FIELDS)}")
        if key in out:
            raise PolicyError(f"policy key {key} given twice")
        value = _parse_value(key, raw)
        # Each value checked alone now (type, range, bound), before any store is opened;
        # how values relate (min <= max) is checked once merged with the stored policy.
        alone: dict[str, Any] = {key: value}  # checked by __post_init__, hence Any
        ResizePolicy(**alone)
        out[key] = value
    return out


def check_keys(keys: Iterable[str]) -> list[str]:
    """Normalise field names given to ``unset`` (``min-nodes`` -> ``min_nodes``)."""
    out = []
    for key in keys:
        norm = key.strip().replace("-", "_")
        if norm not in FIELDS:
            raise PolicyError(f"unknown policy key {key!r}; valid keys: {', '.join(FIELDS)}")
        out.append(norm)
    return out


def updated(policy: ResizePolicy, changes: Mapping[str, Any]) -> ResizePolicy:
    """``policy`` with ``changes`` applied (None unsets), validated as a whole.

    The values are checked by ``ResizePolicy.__post_init__`` (they come from users), hence Any.
    """
    unknown = sorted(set(changes) - set(FIELDS))
    if unknown:
        raise PolicyError(f"unknown policy key(s) {', '.join(unknown)}; valid keys: "
                          f"{', '.join(FIELDS)}")
    return replace(policy, **changes)


def _parse_value(key: str, raw: str) -> PolicyValue:
    if len(raw) > bounds.LINE_CHARS:
        # int() of a 4,300-digit string is refused by Python, a longer one is slow work
        raise PolicyError(f"{key}: the value is {len(raw):,} characters long; the bound is "
                          f"{bounds.LINE_CHARS:,}")
    if key in ("allowed_tp", "allowed_pp"):
        parts = [p for p in raw.replace(" ", "").split(",") if p]
        try:
            return tuple(int(p) for p in parts)
        except ValueError:
            raise PolicyError(f"{key} must be a comma list of integers like 1,2,4, "
                              f"got {raw!r}") from None
    if key == "grow":
        low = raw.lower()
        if low in ("yes", "true", "1", "on"):
            return True
        if low in ("no", "false", "0", "off"):
            return False
        raise PolicyError(f"grow must be yes or no, got {raw!r}")
    if key in ("grow_partition", "grow_qos"):
        return raw
    if key in ("preempt_grace_s", "request_patience_s"):
        return _parse_seconds(key, raw)
    try:
        return int(raw)
    except ValueError:
        raise PolicyError(f"{key} must be an integer, got {raw!r}") from None


def _parse_seconds(key: str, raw: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    text = raw.lower()
    scale = units.get(text[-1:], None)
    number = text[:-1] if scale else text
    try:
        return int(number) * (scale or 1)
    except ValueError:
        raise PolicyError(f"{key} must be seconds (like 120, 90s, 5m, 1h), "
                          f"got {raw!r}") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _csv(values: Iterable[object]) -> str:
    return ",".join(map(str, values))
