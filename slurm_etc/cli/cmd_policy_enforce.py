"""`slurm-etc policy apply|check`: the policies' limits that slurmctld enforces itself.

A coordinator runs as the user, so its policy is advisory: a coordinator started with
another policy file, or a plain `sbatch` of members, could exceed it. `apply` turns each
policy's node limit into Slurm limits (a partition QOS, user-association limits) and its
preemption grace into the partition's GraceTime; `check` shows, per policy and field, what
Slurm enforces beside what the policy says. What Slurm cannot hold stays the coordinator's
(policy/enforce.py says which and why).
"""
from __future__ import annotations

import json
import shlex
import sys

import click
from rich.console import Console
from rich.table import Table

from ..policy.enforce import (
    Change,
    Finding,
    account_changes,
    check_account,
    check_partition,
    is_ours,
    needs_attention,
    partition_changes,
)
from ..policy.rules import PolicyError, ResizePolicy, Scope
from ..slurm.limits import SlurmLimits
from ..slurm.runner import SlurmRunner
from ..store import get_policy, list_policies
from .cmd_policy import _require_admin, _scope, _store_to_read
from .errors import UserError
from .params import Text

# exit code of `check` when a limit Slurm could hold is not held (`apply` fixes it)
DRIFT_EXIT = 1


def _limits(ctx: click.Context) -> SlurmLimits:
    runner = ctx.obj.get("slurm_runner") or SlurmRunner()
    return SlurmLimits(runner)


def _policies(ctx: click.Context, scope: Scope | None) -> dict[Scope, ResizePolicy | None]:
    """The stored policies (one scope's, None where it has none), in the database's order."""
    store = _store_to_read(ctx)
    if scope is not None:
        found = get_policy(store, scope) if store is not None else None
        return {scope: found.policy if found else None}
    return {p.scope: p.policy for p in list_policies(store)} if store is not None else {}


def _with_stale(policies: dict[Scope, ResizePolicy | None],
                limits: SlurmLimits) -> dict[Scope, ResizePolicy | None]:
    """Add partitions that carry slurm-etc's QOS but have no policy any more."""
    out = dict(policies)
    for name, (qos, _) in limits.partitions.items():
        scope = Scope("partition", name)
        if is_ours(qos) and scope not in out:
            out[scope] = None
    return out


def _changes(policies: dict[Scope, ResizePolicy | None], limits: SlurmLimits) -> list[Change]:
    changes: list[Change] = []
    for scope, policy in policies.items():
        if scope.kind == "partition":
            changes += partition_changes(scope, policy, limits.partition(scope))
        else:
            changes += account_changes(scope, policy, limits.account(scope),
                                       limits.config.cluster)
    return changes


def _warn_unenforced(limits: SlurmLimits) -> str | None:
    if limits.config.limits_enforced:
        return None
    return (f"slurmctld does not enforce these limits: AccountingStorageEnforce is "
            f"{','.join(limits.config.enforce) or 'none'}; add limits "
            "(AccountingStorageEnforce=associations,limits,qos in slurm.conf) and restart "
            "slurmctld")


@click.command("apply")
@click.option("--partition", type=Text(), help="Only this partition's policy (none: take "
              "slurm-etc's QOS off it).")
@click.option("--account", type=Text(), help="Only this account's policy (none: remove the "
              "node limits of its user associations).")
@click.option("--dry-run", is_flag=True, help="Print the commands; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def apply(ctx: click.Context, partition: str | None, account: str | None, dry_run: bool,
          as_json: bool) -> None:
    """Make slurmctld enforce the policies (root or a Slurm admin): max_nodes as a partition
    QOS (MaxTRESPerUser/MaxTRESPerJob node=N) or on the account's user associations
    (GrpTRES/MaxTRES node=N), preempt_grace_s as the partition's GraceTime. Idempotent:
    only what differs is changed; an interrupted apply is finished by running it again.
    Partition QOS and GraceTime set by scontrol last until slurmctld reads slurm.conf again:
    put them there too (the output says what)."""
    if not dry_run:
        _require_admin(ctx)
    limits = _limits(ctx)
    policies = _policies(ctx, _scope(partition, account))
    if partition is None and account is None:
        policies = _with_stale(policies, limits)
    try:
        changes = _changes(policies, limits)  # every refusal before any change
    except PolicyError as exc:
        raise UserError(f"{exc} (nothing changed)") from None
    warning = _warn_unenforced(limits)
    if as_json:
        click.echo(json.dumps({
            "cluster": limits.config.cluster, "applied": not dry_run,
            "limits_enforced": limits.config.limits_enforced,
            "changes": [{"scope": str(c.scope), "argv": list(c.argv), "why": c.why}
                        for c in changes]}, indent=2))
    for change in changes:
        if not as_json:
            click.echo(f"{'would run' if dry_run else 'running'}: {shlex.join(change.argv)}"
                       f"   # {change.scope}: {change.why}")
        if not dry_run:
            limits.carry_out(change)
    if not as_json:
        if not changes:
            click.echo("nothing to change: Slurm holds every policy's limits")
        partitions = sorted({c.scope.name for c in changes
                             if c.scope.kind == "partition" and c.argv[0] == "scontrol"})
        if partitions and not dry_run:
            click.echo("scontrol's partition changes last until slurmctld reads slurm.conf "
                       "again: give PartitionName=" + ",".join(partitions)
                       + " the same QOS= and GraceTime= there")
    if warning:
        click.echo(f"slurm-etc: warning: {warning}", err=True)


def _table(findings: list[Finding], cluster: str) -> Table:
    t = Table(title=f"resize policies on cluster {cluster}: the policy beside Slurm")
    for name in ("scope", "field", "policy", "Slurm enforces", "state", "by"):
        t.add_column(name)
    style = {"enforced": "green", "drift": "red", "conflict": "red", "not enforced": "red",
             "coordinator only": "dim"}
    for f in findings:
        t.add_row(str(f.scope), f.field, f.policy, f.slurm,
                  f"[{style[f.state]}]{f.state}[/]", f.how)
    return t


@click.command("check")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def check(ctx: click.Context, as_json: bool) -> None:
    """Per policy and field: what the policy says, what slurmctld enforces, and the state
    (enforced, drift: `policy apply` fixes it, conflict, not enforced, coordinator only).
    Exit 1 when anything Slurm could hold is not held."""
    limits = _limits(ctx)
    findings: list[Finding] = []
    enforced = limits.config.limits_enforced
    for scope, policy in _with_stale(_policies(ctx, None), limits).items():
        if scope.kind == "partition":
            try:
                holds = limits.partition(scope)
            except PolicyError as exc:
                findings.append(Finding(scope, "scope", "-", str(exc), "conflict", "-"))
                continue
            findings += check_partition(scope, policy, holds, enforced)
        elif policy is not None:
            findings += check_account(scope, policy, limits.account(scope), enforced)
    attention = needs_attention(findings)
    if as_json:
        click.echo(json.dumps({
            "cluster": limits.config.cluster, "limits_enforced": enforced,
            "needs_apply": attention,
            "findings": [{"scope": str(f.scope), "field": f.field, "policy": f.policy,
                          "slurm": f.slurm, "state": f.state, "by": f.how}
                         for f in findings]}, indent=2))
    elif findings:
        Console(width=max(Console().width, 140)).print(_table(findings, limits.config.cluster))
    else:
        click.echo("no policies: nothing for Slurm to enforce")
    warning = _warn_unenforced(limits)
    if warning and not as_json:
        click.echo(f"slurm-etc: warning: {warning}", err=True)
    if attention:
        sys.exit(DRIFT_EXIT)
