"""What a node lost without grace is rebuilt from when no dp replica holds its state: the
settings of peer copies (:mod:`.redundancy`) and periodic megatron-core checkpoints, and how
``slurm-etc run`` hands them to the workers (no torch here: the CLI imports it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slurm_etc.plan.errors import ConfigError

# How `slurm-etc run --peer-copy-every / --checkpoint-every / --checkpoint-dir` reach the
# workers (the coordinator sets them in every worker's environment; run_worker applies them).
PEER_COPY_EVERY = "SLURM_ETC_PEER_COPY_EVERY"
CHECKPOINT_EVERY = "SLURM_ETC_CHECKPOINT_EVERY"
CHECKPOINT_DIR = "SLURM_ETC_CHECKPOINT_DIR"


@dataclass(frozen=True)
class Recovery:
    """What a node lost without grace is rebuilt from when no dp replica holds its state.

    Attributes:
        peer_copy_every: every this many steps each rank copies its state to a rank on
            another node (0: off).
        checkpoint_every: a megatron-core checkpoint every this many steps (0: off) ...
        checkpoint_dir: ... into this directory (shared by every node; the last one kept).
    """

    peer_copy_every: int = 0
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None

    def __post_init__(self) -> None:
        if self.peer_copy_every < 0 or self.checkpoint_every < 0:
            raise ConfigError(f"peer copies every {self.peer_copy_every} and checkpoints every "
                              f"{self.checkpoint_every} steps: both must be >= 0 (0: off)")
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
                   env.get(CHECKPOINT_DIR) or default.checkpoint_dir)
