"""Reading the limits slurmctld holds, and carrying out ``policy apply``'s changes.

The decisions (what a policy wants of Slurm, what differs) are pure, in
``policy/enforce.py``; here are the ``scontrol``/``sacctmgr`` calls and their parsing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..policy.enforce import AccountHolds, Change, NodeLimits, PartitionHolds, qos_name
from ..policy.rules import PolicyError, Scope
from .model import Command
from .parsers import parse_scontrol_record
from .runner import SlurmRunner

_NODE = re.compile(r"(?:^|,)node=(\d+)")


def tres_nodes(tres: str) -> int | None:
    """The node count of a TRES string (``cpu=4,node=2`` -> 2; none -> None)."""
    m = _NODE.search(tres.strip())
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class SlurmConfig:
    """What ``policy apply|check`` need of slurmctld's configuration."""

    cluster: str
    enforce: tuple[str, ...]

    @property
    def limits_enforced(self) -> bool:
        """AccountingStorageEnforce includes ``limits`` (association and QOS limits)."""
        return "limits" in self.enforce or "safe" in self.enforce


def parse_config(stdout: str) -> SlurmConfig:
    """``scontrol show config``: ``Key = value`` lines."""
    values = {}
    for line in stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    enforce = values.get("AccountingStorageEnforce", "none")
    return SlurmConfig(values.get("ClusterName", ""),
                       tuple(e.strip() for e in enforce.split(",") if e.strip()))


def parse_partitions(stdout: str) -> dict[str, tuple[str | None, int | None]]:
    """``scontrol -o show partition``: each partition's QOS (None: N/A) and GraceTime."""
    out: dict[str, tuple[str | None, int | None]] = {}
    for line in stdout.splitlines():
        if "PartitionName=" not in line:
            continue
        r = parse_scontrol_record(line)
        qos = r.get("QoS", "N/A")
        grace = r.get("GraceTime", "")
        out[r["PartitionName"]] = (None if qos in ("", "N/A") else qos,
                                   int(grace) if grace.isdigit() else None)
    return out


def parse_qos(stdout: str) -> dict[str, NodeLimits]:
    """``sacctmgr -n -P show qos format=name,maxtrespu,maxtres``."""
    out = {}
    for line in stdout.splitlines():
        parts = line.split("|")
        if len(parts) >= 3 and parts[0]:
            out[parts[0]] = NodeLimits(tres_nodes(parts[1]), tres_nodes(parts[2]))
    return out


def parse_user_assocs(stdout: str) -> AccountHolds:
    """``sacctmgr -n -P show assoc ... format=user,grptres,maxtres``: the user associations
    (the account's own row, with no user, is not one)."""
    users = []
    for line in stdout.splitlines():
        parts = line.split("|")
        if len(parts) >= 3 and parts[0]:
            users.append((parts[0], NodeLimits(tres_nodes(parts[1]), tres_nodes(parts[2]))))
    return AccountHolds(tuple(sorted(users)))


class SlurmLimits:
    """slurmctld's limits as ``policy apply|check`` see them, read once per command."""

    def __init__(self, runner: SlurmRunner):
        self.runner = runner
        self.config = parse_config(self._out("scontrol", "show", "config"))
        self.partitions = parse_partitions(self._out("scontrol", "-o", "show", "partition"))
        self.qos = parse_qos(self._out("sacctmgr", "-n", "-P", "show", "qos",
                                       "format=name,maxtrespu,maxtres"))

    def _out(self, *argv: str) -> str:
        return self.runner.run(Command(tuple(argv))).stdout

    def partition(self, scope: Scope) -> PartitionHolds:
        if scope.name not in self.partitions:
            raise PolicyError(f"{scope}: no such partition on cluster {self.config.cluster} "
                              f"(partitions: {', '.join(sorted(self.partitions)) or 'none'})")
        qos, grace = self.partitions[scope.name]
        return PartitionHolds(qos, grace, self.qos.get(qos_name(scope)))

    def account(self, scope: Scope) -> AccountHolds:
        return parse_user_assocs(self._out(
            "sacctmgr", "-n", "-P", "show", "assoc", "where", f"account={scope.name}",
            f"cluster={self.config.cluster}", "format=user,grptres,maxtres"))

    def carry_out(self, change: Change) -> None:
        self.runner.run(Command(change.argv))
