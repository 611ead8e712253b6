"""What of a resize policy slurmctld enforces itself, and the changes that make it so.

Pure: reading Slurm and running the changes happen in ``slurm/limits.py`` and the CLI
(``slurm-etc policy apply|check``).

Slurm knows allocations, not elastic jobs: an elastic job is its anchor plus member
allocations, each a Slurm job of its own. The bound slurmctld can hold is therefore per
user, over the jobs a scope covers:

- a partition's policy: a QOS ``slurm-etc-partition-<name>`` with
  ``MaxTRESPerUser=node=<max_nodes>`` and ``MaxTRESPerJob=node=<max_nodes>``, made the
  partition's QOS (a partition QOS binds every job in the partition, whatever QOS the job
  names); ``preempt_grace_s`` becomes the partition's ``GraceTime``.
- an account's policy: ``GrpTRES=node=<max_nodes>`` and ``MaxTRES=node=<max_nodes>`` on each
  of the account's user associations.

A user's exclusive jobs there hold at most ``max_nodes`` together (Slurm counts a node once
however many of the user's jobs share it): one elastic job per user is bound exactly, its
anchor included; several of the same user's jobs share the bound. The rest of a policy
(``min_nodes``, the tp/pp degrees, ``grow``, where members go, the resize cap, the request
patience) only the coordinator applies.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .rules import FIELDS, PolicyError, ResizePolicy, Scope

QOS_PREFIX = "slurm-etc-"
ENFORCED = ("max_nodes", "preempt_grace_s")
COORDINATOR_ONLY = tuple(f for f in FIELDS if f not in ENFORCED)
# sacctmgr's value that removes a TRES limit
NO_LIMIT = -1


def qos_name(scope: Scope) -> str:
    """The QOS that carries a partition policy's limits."""
    return f"{QOS_PREFIX}{scope.kind}-{scope.name}"


def is_ours(qos: str | None) -> bool:
    return qos is not None and qos.startswith(f"{QOS_PREFIX}partition-")


@dataclass(frozen=True)
class NodeLimits:
    """A node limit per user (summed over their running jobs) and per job; None: none."""

    per_user: int | None = None
    per_job: int | None = None


@dataclass(frozen=True)
class PartitionHolds:
    """What Slurm holds for a partition: its QOS, that QOS's node limits, its GraceTime.

    ``our_qos`` is the limits of ``slurm-etc-partition-<name>`` when that QOS exists (attached
    or not), else None.
    """

    qos: str | None
    grace_time_s: int | None
    our_qos: NodeLimits | None


@dataclass(frozen=True)
class AccountHolds:
    """What Slurm holds for an account: each user association's node limits."""

    users: tuple[tuple[str, NodeLimits], ...]


@dataclass(frozen=True)
class Change:
    """One Slurm command that moves a scope toward its policy, and why."""

    scope: Scope
    argv: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Finding:
    """One field of one scope: what the policy says beside what Slurm enforces.

    ``state``: ``enforced`` (Slurm holds what the policy says), ``drift`` (it does not:
    ``policy apply`` fixes it), ``conflict`` (something not slurm-etc's is in the way),
    ``coordinator only`` (Slurm cannot hold this field), ``not enforced`` (Slurm holds the
    limit but its AccountingStorageEnforce lacks ``limits``).
    """

    scope: Scope
    field: str
    policy: str
    slurm: str
    state: str
    how: str


def _shown(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _nodes(limits: NodeLimits | None, none: str = "-") -> str:
    if limits is None or (limits.per_user is None and limits.per_job is None):
        return none
    if limits.per_user == limits.per_job:
        return f"{limits.per_user} nodes"
    return f"{_shown(limits.per_user)} per user, {_shown(limits.per_job)} per job"


def _tres(n: int | None) -> str:
    return f"node={NO_LIMIT if n is None else n}"


def partition_changes(scope: Scope, policy: ResizePolicy | None,
                      holds: PartitionHolds) -> list[Change]:
    """What makes Slurm hold ``policy`` on partition ``scope`` (None: the scope has no
    policy, so slurm-etc's QOS is taken off it). Raises PolicyError when the partition's QOS
    is someone else's: replacing it would drop the site's limits."""
    name = qos_name(scope)
    max_nodes = policy.max_nodes if policy else None
    want = NodeLimits(max_nodes, max_nodes)
    out: list[Change] = []
    if max_nodes is not None:
        if holds.qos is not None and holds.qos != name:
            raise PolicyError(
                f"{scope} has QOS {holds.qos}, not slurm-etc's: slurm-etc would replace it; "
                f"put MaxTRESPerUser=node={max_nodes} on {holds.qos} yourself, or take it "
                f"off the partition and apply again")
        if holds.our_qos is None:
            out.append(Change(scope, ("sacctmgr", "-i", "add", "qos", name,
                                      f"Description=slurm-etc policy {scope}"),
                              f"create QOS {name}"))
        if holds.our_qos != want:
            out.append(Change(scope, ("sacctmgr", "-i", "modify", "qos", "where",
                                      f"name={name}", "set", f"MaxTRESPerUser={_tres(max_nodes)}",
                                      f"MaxTRESPerJob={_tres(max_nodes)}"),
                              f"max_nodes {max_nodes} (it holds "
                              f"{_nodes(holds.our_qos, 'no limit')})"))
        if holds.qos != name:
            out.append(Change(scope, ("scontrol", "update", f"PartitionName={scope.name}",
                                      f"QOS={name}"),
                              f"make {name} the partition's QOS"))
    else:
        if holds.qos == name:
            out.append(Change(scope, ("scontrol", "update", f"PartitionName={scope.name}",
                                      "QOS="), "no max_nodes: take slurm-etc's QOS off"))
        if holds.our_qos is not None:
            out.append(Change(scope, ("sacctmgr", "-i", "delete", "qos", name),
                              f"no max_nodes: delete QOS {name}"))
    grace = policy.preempt_grace_s if policy else None
    if grace is not None and holds.grace_time_s != grace:
        out.append(Change(scope, ("scontrol", "update", f"PartitionName={scope.name}",
                                  f"GraceTime={grace}"),
                          f"preempt_grace_s {grace} (GraceTime is {_shown(holds.grace_time_s)})"))
    return out


def account_changes(scope: Scope, policy: ResizePolicy | None, holds: AccountHolds,
                    cluster: str) -> list[Change]:
    """What makes Slurm hold ``policy`` on every user association of account ``scope`` (None
    or no max_nodes: the node limits are removed)."""
    max_nodes = policy.max_nodes if policy else None
    want = NodeLimits(max_nodes, max_nodes)
    if all(limits == want for _, limits in holds.users):
        return []
    return [Change(scope, ("sacctmgr", "-i", "modify", "user", "where",
                           f"account={scope.name}", f"cluster={cluster}", "set",
                           f"GrpTRES={_tres(max_nodes)}", f"MaxTRES={_tres(max_nodes)}"),
                   (f"max_nodes {max_nodes}" if max_nodes is not None else "no max_nodes: no "
                    "node limit") + f" on {len(holds.users)} user association(s)")]


def _coordinator_only(scope: Scope, policy: ResizePolicy) -> list[Finding]:
    fields = [f for f in COORDINATOR_ONLY if getattr(policy, f) is not None]
    if scope.kind == "account" and policy.preempt_grace_s is not None:
        fields.append("preempt_grace_s")  # a grace time is a partition's
    return [Finding(scope, f, _shown(getattr(policy, f)), "-", "coordinator only",
                    "the coordinator") for f in fields]


def check_partition(scope: Scope, policy: ResizePolicy | None, holds: PartitionHolds,
                    limits_enforced: bool) -> list[Finding]:
    """Each field of a partition's policy beside what Slurm holds (None: the partition has
    no policy, and slurm-etc's QOS on it is drift)."""
    name = qos_name(scope)
    if policy is None:
        return [Finding(scope, "max_nodes", "-", _nodes(holds.our_qos), "drift",
                        f"partition QOS {name}: no policy, `policy apply` takes it off")
                ] if holds.qos == name else []
    out: list[Finding] = []
    if policy.max_nodes is not None:
        attached = holds.qos == name
        slurm = _nodes(holds.our_qos) if attached else (
            f"QOS {holds.qos} (not slurm-etc's)" if holds.qos else "-")
        if holds.qos is not None and not attached:
            state = "conflict"
        elif attached and holds.our_qos == NodeLimits(policy.max_nodes, policy.max_nodes):
            state = "enforced" if limits_enforced else "not enforced"
        else:
            state = "drift"
        out.append(Finding(scope, "max_nodes", f"{policy.max_nodes} nodes", slurm, state,
                           f"partition QOS {name}"))
    if policy.preempt_grace_s is not None:
        same = holds.grace_time_s == policy.preempt_grace_s
        out.append(Finding(scope, "preempt_grace_s", f"{policy.preempt_grace_s} s",
                           f"{_shown(holds.grace_time_s)} s", "enforced" if same else "drift",
                           "partition GraceTime"))
    return out + _coordinator_only(scope, policy)


def check_account(scope: Scope, policy: ResizePolicy, holds: AccountHolds,
                  limits_enforced: bool) -> list[Finding]:
    """Each field of an account's policy beside what Slurm holds."""
    out: list[Finding] = []
    if policy.max_nodes is not None:
        want = NodeLimits(policy.max_nodes, policy.max_nodes)
        seen = sorted({_nodes(limits) for _, limits in holds.users})
        if not holds.users:
            slurm, state = "no user associations", "drift"
        else:
            slurm = " / ".join(seen)
            ok = all(limits == want for _, limits in holds.users)
            state = ("enforced" if limits_enforced else "not enforced") if ok else "drift"
        out.append(Finding(scope, "max_nodes", f"{policy.max_nodes} nodes", slurm, state,
                           f"{len(holds.users)} user association(s)"))
    return out + _coordinator_only(scope, policy)


def needs_attention(findings: Sequence[Finding]) -> bool:
    """Whether any field Slurm could hold is not held as the policy says."""
    return any(f.state in ("drift", "conflict", "not enforced") for f in findings)
