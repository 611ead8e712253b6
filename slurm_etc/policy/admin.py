"""Who may change policies: root, or a Slurm Operator/Administrator (pure parts only).

The user is the process's real uid, resolved through the password database, never the
environment (LOGNAME, USER: anyone can set them). The CLI looks the name up, runs the
command this module builds and hands the outcome to :func:`verdict`.
"""
from __future__ import annotations

from dataclasses import dataclass

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
