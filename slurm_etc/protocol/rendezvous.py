"""The names of the keys workers meet on in the job's rendezvous store.

Every key of a generation lives under ``<job>/g<generation>`` (a path below it, or a suffix
after a dot), so the store deletes a dead generation's keys by that prefix alone
(:meth:`.store.StoreServer.retire_generations`). Workers build names here, not by hand.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


def generation_pattern(job: str) -> re.Pattern[str]:
    """Matches a key of one of ``job``'s generations; group 1 is the generation."""
    return re.compile(rf"{re.escape(job)}/g(\d+)[/.]")


@dataclass(frozen=True)
class GenerationKeys:
    """The keys of one generation of a job."""

    job: str
    generation: int

    @property
    def prefix(self) -> str:
        """``<job>/g<generation>``: the resize's tag (migration groups, installs below it)."""
        return f"{self.job}/g{self.generation}"

    @property
    def train_group(self) -> str:
        """The training process group's rendezvous prefix."""
        return train_group_prefix(self.prefix)

    def agreement(self, attempt: int, step: int, rank: int | str) -> str:
        """Rank ``rank``'s key in the agreement on step ``step`` (attempt > 0: after an
        aborted resize); ``decided`` and ``arrived`` are the step's decision and count."""
        base = f"{self.prefix}/agree" + (f".{attempt}" if attempt else "")
        return f"{base}/{step}/{rank}"

    @property
    def trainer(self) -> str:
        """The trainer state (step, data position, scheduler) the new layout starts from."""
        return f"{self.prefix}/trainer"

    @property
    def model(self) -> str:
        """The model description (JSON) the workers planned this resize with."""
        return f"{self.prefix}/model"

    @property
    def last_ended(self) -> str:
        """When this generation's last step ended (wall clock), for the measured pause."""
        return f"{self.prefix}/last-ended"

    @property
    def lost(self) -> str:
        """The coordinator's newest order naming devices of this generation's layout as
        lost: it ends the survivors' waits at a step boundary at once (a dead peer never
        votes)."""
        return f"{self.prefix}/lost"

    def rng(self, rank: int) -> str:
        """Old rank ``rank``'s RNG extras."""
        return f"{self.prefix}/rng/{rank}"

    def holdings(self, vrank: int) -> str:
        """What vrank ``vrank`` holds of lost peers' state (their copies)."""
        return f"{self.prefix}/holdings/{vrank}"

    def fingerprint(self, rank: int) -> str:
        """A new rank's fingerprint of a state rebuilt from peer copies or a checkpoint."""
        return f"{self.prefix}/fingerprint/{rank}"


# Below a resize's tag (a generation's prefix in a job; any tag in the verify/bench harness):
def train_group_prefix(tag: str) -> str:
    """The new layout's training process group's rendezvous prefix."""
    return f"{tag}/train"


def migration_group_prefix(tag: str) -> str:
    """The migration process group's rendezvous prefix."""
    return f"{tag}/migrate"


def installing(tag: str, new_rank: int) -> str:
    """New rank ``new_rank`` checked in to install the committed migration."""
    return f"{tag}/installing/{new_rank}"


def commit_decision(tag: str) -> str:
    """The resize's two-phase commit decision (set once: commit or abort)."""
    return f"{tag}/commit"
