"""Who may change policies, and how a user's own policy combines with the site's (pure).

The user is the process's real uid, resolved through the password database, never the
environment (LOGNAME, USER: anyone can set them). The CLI looks the name up, runs the
command this module builds and hands the outcome to :func:`verdict`.

None of this is a security boundary: it runs in the user's own process, and under a user
namespace (``unshare -r``) the real uid is 0 and the verdict says root. What binds is
Slurm's own limits (QOS, associations) and who may write the policy file: the site's
policies live in a root-owned file users cannot write, so a namespace "root" is refused by
the kernel when it tries. ``updated_by`` is therefore the writer's claim about itself.
"""
from __future__ import annotations

from dataclasses import dataclass

from .rules import EffectivePolicy, PolicyError

ADMIN_LEVELS = ("operator", "administrator")


@dataclass(frozen=True)
class AdminVerdict:
    """Whether a user may change policies, and why (one line); ``user`` is who asked (the
    name recorded as ``updated_by``)."""

    allowed: bool
    reason: str
    user: str = ""


@dataclass(frozen=True)
class SacctmgrAnswer:
    """What ``sacctmgr`` said: its stdout when it exited 0, else what went wrong (one line:
    not found, timed out, exit code and first line of stderr)."""

    output: str | None = None
    problem: str | None = None


def adminlevel_command(user: str, sacctmgr: str = "sacctmgr") -> list[str]:
    """``sacctmgr`` query of a user's AdminLevel (parsable, no header, the user's name first,
    so the answer can be checked against the question)."""
    return [sacctmgr, "-nP", "show", "user", user, "format=user,adminlevel"]


def adminlevel(user: str, output: str) -> str:
    """The AdminLevel of ``user`` in ``sacctmgr -nP ... format=user,adminlevel`` output
    (``alice|None``, ``bob|Administrator``); "" when no line is about ``user``.

    Slurm stores user names in lower case unless PreserveCaseUser is set, so names compare
    case-insensitively; lines about anyone else are ignored.
    """
    for line in output.splitlines():
        name, sep, level = line.strip().partition("|")
        if sep and name.lower() == user.lower():
            return level.strip()
    return ""


def verdict(user: str | None, uid: int, answer: SacctmgrAnswer | None) -> AdminVerdict:
    """Decide from the real uid, its user name (None: the uid has no passwd entry) and
    sacctmgr's answer about that name (None: not asked)."""
    if uid == 0:
        return AdminVerdict(True, "root", user or "root")
    if user is None:
        return AdminVerdict(False, f"uid {uid} has no user name in the password database; "
                                   "only root may change policies", f"uid {uid}")
    if answer is None or answer.output is None:
        problem = (answer.problem if answer is not None and answer.problem
                   else "sacctmgr was not asked")
        return AdminVerdict(False, f"{user} is not root and Slurm's admin level cannot be "
                                   f"checked ({problem}); only root may change policies",
                            user)
    level = adminlevel(user, answer.output)
    if level.lower() in ADMIN_LEVELS:
        return AdminVerdict(True, f"Slurm {level}", user)
    shown = level or "no accounting record"
    return AdminVerdict(False, f"{user} has Slurm AdminLevel {shown}; changing policies needs "
                               "root or a Slurm Operator/Administrator", user)


def stricter(site: EffectivePolicy, own: EffectivePolicy) -> EffectivePolicy:
    """The site's policy, narrowed by a user's own (``run --policy-db``): a user's policy
    file can only make the job's limits stricter, never looser.

    The larger ``min_nodes`` and preemption grace, the smaller ``max_nodes``, resize cap
    (unset: no limit) and request patience, the common allowed degrees, growth only if both
    allow it. The member partition and QOS are the site's where it sets them (Slurm
    decides who may use which; a user's choice applies only where the site leaves it open).

    Raises:
        PolicyError: the two leave nothing (no common degree, min above max).
    """
    def smaller(a: int | None, b: int | None) -> int | None:
        return b if a is None else a if b is None else min(a, b)

    def common(name: str, a: tuple[int, ...] | None,
               b: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if a is None or b is None:
            return b if a is None else a
        both = tuple(sorted(set(a) & set(b)))
        if not both:
            raise PolicyError(f"{name}: the site allows {_csv(a)}, your policy {_csv(b)}; "
                              "nothing in common")
        return both

    out = EffectivePolicy(
        min_nodes=max(site.min_nodes, own.min_nodes),
        max_nodes=smaller(site.max_nodes, own.max_nodes),
        allowed_tp=common("allowed_tp", site.allowed_tp, own.allowed_tp),
        allowed_pp=common("allowed_pp", site.allowed_pp, own.allowed_pp),
        grow=site.grow and own.grow,
        grow_partition=site.grow_partition or own.grow_partition,
        grow_qos=site.grow_qos or own.grow_qos,
        preempt_grace_s=max(site.preempt_grace_s, own.preempt_grace_s),
        max_resizes_per_hour=smaller(site.max_resizes_per_hour, own.max_resizes_per_hour),
        request_patience_s=smaller(site.request_patience_s, own.request_patience_s))
    if out.max_nodes is not None and out.min_nodes > out.max_nodes:
        raise PolicyError(f"min_nodes {out.min_nodes} exceeds max_nodes {out.max_nodes} "
                          "(the site's and your policy together)")
    return out


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))
