"""Who may change policies: root, or a Slurm Operator/Administrator (pure parts only).

The CLI runs the command this module builds and hands the output back to ``parse``.
"""
from __future__ import annotations

from dataclasses import dataclass

ADMIN_LEVELS = ("operator", "administrator")


@dataclass(frozen=True)
class AdminVerdict:
    """Whether a user may change policies, and why (one line)."""

    allowed: bool
    reason: str


def adminlevel_command(user: str) -> list[str]:
    """``sacctmgr`` query of a user's AdminLevel (parsable, no header)."""
    return ["sacctmgr", "-nP", "show", "user", user, "format=adminlevel"]


def verdict(user: str, uid: int, sacctmgr_output: str | None) -> AdminVerdict:
    """Decide from the uid and sacctmgr's answer (None: sacctmgr missing or failed).

    ``sacctmgr -nP show user U format=adminlevel`` prints one line: ``None``, ``Operator``
    or ``Administrator``; nothing when the user is not in the accounting database.
    """
    if uid == 0:
        return AdminVerdict(True, "root")
    if sacctmgr_output is None:
        return AdminVerdict(False, f"{user} is not root and Slurm's admin level cannot be "
                                   "checked (sacctmgr unavailable); only root may change "
                                   "policies")
    level = next((line.strip() for line in sacctmgr_output.splitlines() if line.strip()), "")
    if level.lower() in ADMIN_LEVELS:
        return AdminVerdict(True, f"Slurm {level}")
    shown = level or "no accounting record"
    return AdminVerdict(False, f"{user} has Slurm AdminLevel {shown}; changing policies needs "
                               "root or a Slurm Operator/Administrator")
