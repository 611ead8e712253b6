"""The lifecycles of a job, an allocation, a device and a resize: one enum each.

The record (CHECK constraints of migration ``0007_lifecycle_checks``), the coordinator, the
backends and ``status`` use these names. They are :class:`enum.StrEnum`, so a member is its
text on the wire and in SQL (``JobState.RUNNING == "running"``).

A job's state moves only along :data:`JOB_TRANSITIONS`; the record refuses any other move
(:func:`job_transition_error`). A job that failed or was cancelled may be taken up again by a
new coordinator on the same record (it resumes from the workers or the newest checkpoint);
a finished job is never started again.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping


class JobState(enum.StrEnum):
    """What the coordinator observed last of the whole job."""

    STARTING = "starting"  # recorded, no generation trains yet
    RUNNING = "running"
    RESIZING = "resizing"
    STOPPING = "stopping"
    FINISHED = "finished"  # trained to its last step
    FAILED = "failed"
    CANCELLED = "cancelled"  # signalled, or stopped by its owner


ENDED_JOB_STATES = frozenset({JobState.FINISHED, JobState.FAILED, JobState.CANCELLED})
ACTIVE_JOB_STATES = frozenset(set(JobState) - ENDED_JOB_STATES)

JOB_TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.STOPPING, *ENDED_JOB_STATES}),
    JobState.RUNNING: frozenset({JobState.RESIZING, JobState.STOPPING, *ENDED_JOB_STATES}),
    JobState.RESIZING: frozenset({JobState.RUNNING, JobState.STOPPING, *ENDED_JOB_STATES}),
    JobState.STOPPING: ENDED_JOB_STATES,
    JobState.FAILED: frozenset({JobState.RUNNING}),  # a new coordinator resumes it
    JobState.CANCELLED: frozenset({JobState.RUNNING}),
    JobState.FINISHED: frozenset(),
}


class AllocationState(enum.StrEnum):
    """A backend allocation (a Slurm job: the anchor or a member)."""

    REQUESTED = "requested"  # submitted, pending
    GRANTED = "granted"  # running on its nodes
    PREEMPTING = "preempting"  # a preemption notice is counting down
    LOST = "lost"  # gone without grace (node failure, killed)
    RELEASED = "released"  # given back by the job


class AllocationRole(enum.StrEnum):
    ANCHOR = "anchor"  # the allocation the coordinator runs in: never released
    MEMBER = "member"


class DeviceState(enum.StrEnum):
    """One device (node, local index) of a job."""

    HELD = "held"
    LEAVING = "leaving"  # in a shrink's layout still, released once it commits
    LOST = "lost"
    RELEASED = "released"


class ResizeOutcome(enum.StrEnum):
    """How one migration between generations ended (NULL in the record while it runs)."""

    COMMITTED = "committed"
    ABORTED = "aborted"


class ProcessOutcome(enum.StrEnum):
    """How one process's part of a resize ended (its ``Resized`` report): a record's
    outcome, or it left the job (not in the new layout)."""

    COMMITTED = ResizeOutcome.COMMITTED.value
    ABORTED = ResizeOutcome.ABORTED.value
    LEFT = "left"


class Backend(enum.StrEnum):
    LOCAL = "local"
    SLURM = "slurm"


def job_transition_error(job_id: str, old: str, new: str) -> str | None:
    """Why job ``job_id`` may not go from ``old`` to ``new`` (None: it may; staying is
    always allowed)."""
    if old == new:
        return None
    allowed = JOB_TRANSITIONS[JobState(old)]
    if JobState(new) in allowed:
        return None
    if not allowed:
        return (f"job {job_id} is {old}; a {old} job is not started or changed again: run it "
                f"under a new job id")
    return (f"job {job_id} cannot go from {old} to {new}; from {old} it can go to "
            f"{', '.join(sorted(allowed))}")


def sql_in(column: str, enum_type: type[enum.StrEnum]) -> str:
    """The CHECK expression ``column IN ('a', 'b', ...)`` of an enum's values."""
    return f"{column} IN ({', '.join(repr(str(m)) for m in enum_type)})"
