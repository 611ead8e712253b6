"""What a node lost without grace is rebuilt from when no dp replica holds its state: the
settings of peer copies (:mod:`.redundancy`) and periodic megatron-core checkpoints, and how
``slurm-etc run`` hands them to the workers (no torch here: the CLI imports it).
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from slurm_etc.plan.errors import ConfigError

# How `slurm-etc run --peer-copy-every / --checkpoint-every / --checkpoint-dir` reach the
# workers (the coordinator sets them in every worker's environment; run_worker applies them).
PEER_COPY_EVERY = "SLURM_ETC_PEER_COPY_EVERY"
CHECKPOINT_EVERY = "SLURM_ETC_CHECKPOINT_EVERY"
CHECKPOINT_DIR = "SLURM_ETC_CHECKPOINT_DIR"
KEEP_CHECKPOINTS = "SLURM_ETC_KEEP_CHECKPOINTS"
# Set by the coordinator in the first layout's environment when the checkpoint directory
# holds a complete checkpoint: the workers load it and train on from its step.
RESUME_FROM = "SLURM_ETC_RESUME_FROM"
DEFAULT_KEEP_CHECKPOINTS = 2
# A complete periodic checkpoint: `step-N` (written as `step-N.partial`, renamed once every
# rank wrote its part and rank 0 synced it).
_STEP_DIR = re.compile(r"step-(0|[1-9][0-9]{0,17})")


@dataclass(frozen=True)
class Recovery:
    """What a node lost without grace is rebuilt from when no dp replica holds its state.

    Attributes:
        peer_copy_every: every this many steps each rank copies its state to a rank on
            another node (0: off).
        checkpoint_every: a megatron-core checkpoint every this many steps (0: off) ...
        checkpoint_dir: ... into this directory (shared by every node).
        keep_checkpoints: how many of the newest complete checkpoints are kept (>= 1); an
            older one is deleted only once a newer one is complete.
        resume_from: a checkpoint directory the first layout loads before training (set
            by the coordinator; None: start from the providers' initial state).
    """

    peer_copy_every: int = 0
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS
    resume_from: str | None = None

    def __post_init__(self) -> None:
        if self.peer_copy_every < 0 or self.checkpoint_every < 0:
            raise ConfigError(f"peer copies every {self.peer_copy_every} and checkpoints every "
                              f"{self.checkpoint_every} steps: both must be >= 0 (0: off)")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"keep {self.keep_checkpoints} checkpoints: at least 1 (the "
                              "newest is never deleted)")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError(f"checkpoints every {self.checkpoint_every} steps need a "
                              "checkpoint directory (--checkpoint-dir)")

    @property
    def enabled(self) -> bool:
        """Whether anything can rebuild state no replica holds."""
        return bool(self.peer_copy_every or self.checkpoint_every)

    def env(self) -> dict[str, str]:
        """The workers' environment for these settings (nothing when all are off)."""
        out = {}
        if self.peer_copy_every:
            out[PEER_COPY_EVERY] = str(self.peer_copy_every)
        if self.checkpoint_every:
            out[CHECKPOINT_EVERY] = str(self.checkpoint_every)
            out[CHECKPOINT_DIR] = str(self.checkpoint_dir)
            if self.keep_checkpoints != DEFAULT_KEEP_CHECKPOINTS:
                out[KEEP_CHECKPOINTS] = str(self.keep_checkpoints)
        if self.resume_from:
            out[RESUME_FROM] = self.resume_from
        return out

    @classmethod
    def from_env(cls, env: Any, default: Recovery) -> Recovery:
        """Settings from a worker's environment; ``default`` (the trainer's own) for what
        it does not set. ConfigError names the variable and the value on a bad one."""
        def number(name: str, fallback: int) -> int:
            text = env.get(name)
            if text is None or text == "":
                return fallback
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"{name}={text!r}: expected a whole number of steps "
                                  "(0: off)") from None

        return cls(number(PEER_COPY_EVERY, default.peer_copy_every),
                   number(CHECKPOINT_EVERY, default.checkpoint_every),
                   env.get(CHECKPOINT_DIR) or default.checkpoint_dir,
                   number(KEEP_CHECKPOINTS, default.keep_checkpoints),
                   env.get(RESUME_FROM) or default.resume_from)


def checkpoint_steps(directory: str | os.PathLike[str] | None) -> list[int]:
    """The steps of the complete periodic checkpoints in ``directory``, ascending (a
    ``.partial`` one, or any other name, is not a checkpoint)."""
    if directory is None:
        return []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.fullmatch(n))
                  and os.path.isdir(os.path.join(directory, n)))


def newest_checkpoint(directory: str | os.PathLike[str] | None) -> int | None:
    """The step of the newest complete checkpoint in ``directory``, or None."""
    steps = checkpoint_steps(directory)
    return steps[-1] if steps else None


def checkpoints_to_delete(steps: Iterable[int], keep: int) -> list[int]:
    """Which complete checkpoints go once a new one is complete: all but the newest
    ``keep`` (>= 1) of ``steps`` (so the newest is never among them)."""
    if keep < 1:
        raise ConfigError(f"keep {keep} checkpoints: at least 1")
    ordered = sorted(set(steps))
    return ordered[:-keep] if len(ordered) > keep else []
