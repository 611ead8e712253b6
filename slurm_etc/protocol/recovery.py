"""What a node lost without grace is rebuilt from when no dp replica holds its state: the
settings of peer copies (:mod:`.redundancy`) and periodic megatron-core checkpoints, and how
``slurm-etc run`` hands them to the workers (no torch here: the CLI imports it).
"""
from __future__ import annotations

import math
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
# peer_copy_every: the interval chosen by the workers at start (:func:`peer_copy_interval`)
AUTO = -1
AUTO_WORD = "auto"
# the share of step time peer copies may cost, and of host memory they may hold
COPY_BUDGET = 0.02
HOST_SHARE = 0.5
# what a rank holds at a refresh, in copies of its own state: its snapshot and its ward's
# copy, two of each until the next step ends (worker/redundancy.py)
HELD_COPIES = 4
# A complete periodic checkpoint: `step-N` (written as `step-N.partial`, renamed once every
# rank wrote its part and rank 0 synced it).
_STEP_DIR = re.compile(r"step-(0|[1-9][0-9]{0,17})")


@dataclass(frozen=True)
class Recovery:
    """What a node lost without grace is rebuilt from when no dp replica holds its state.

    Attributes:
        peer_copy_every: every this many steps each rank copies its state to a rank on
            another node (0: off; ``AUTO``, the default: the workers choose the interval
            once, at start, with :func:`peer_copy_interval`).
        checkpoint_every: a megatron-core checkpoint every this many steps (0: off) ...
        checkpoint_dir: ... into this directory (shared by every node).
        keep_checkpoints: how many of the newest complete checkpoints are kept (>= 1); an
            older one is deleted only once a newer one is complete.
        resume_from: a checkpoint directory the first layout loads before training (set
            by the coordinator; None: start from the providers' initial state).
    """

    peer_copy_every: int = AUTO
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS
    resume_from: str | None = None

    def __post_init__(self) -> None:
        if self.peer_copy_every < AUTO or self.checkpoint_every < 0:
            raise ConfigError(f"peer copies every {self.peer_copy_every} and checkpoints every "
                              f"{self.checkpoint_every} steps: both must be >= 0 (0: off; "
                              f"peer copies also {AUTO_WORD})")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"keep {self.keep_checkpoints} checkpoints: at least 1 (the "
                              "newest is never deleted)")
        if self.checkpoint_every > 0 and not self.checkpoint_dir:
            raise ConfigError(f"checkpoints every {self.checkpoint_every} steps need a "
                              "checkpoint directory (--checkpoint-dir)")

    @property
    def enabled(self) -> bool:
        """Whether anything can rebuild state no replica holds."""
        return bool(self.peer_copy_every or self.checkpoint_every)

    def env(self) -> dict[str, str]:
        """The workers' environment for these settings (peer copies always said: a trainer's
        own default is ``auto``, so ``0`` must reach it)."""
        out = {PEER_COPY_EVERY: every_text(self.peer_copy_every)}
        if self.checkpoint_dir:  # also where copies that do not fit fall back to
            out[CHECKPOINT_DIR] = str(self.checkpoint_dir)
        if self.checkpoint_every:
            out[CHECKPOINT_EVERY] = str(self.checkpoint_every)
        if self.checkpoint_dir:
            if self.keep_checkpoints != DEFAULT_KEEP_CHECKPOINTS:
                out[KEEP_CHECKPOINTS] = str(self.keep_checkpoints)
        if self.resume_from:
            out[RESUME_FROM] = self.resume_from
        return out

    @classmethod
    def from_env(cls, env: Any, default: Recovery) -> Recovery:
        """Settings from a worker's environment; ``default`` (the trainer's own) for what
        it does not set (peer copies ``auto`` sets nothing: a trainer's own default is
        auto, and one its script fixed stands). ConfigError names the variable and the
        value on a bad one."""
        def number(name: str, fallback: int) -> int:
            text = env.get(name)
            if text is None or text == "":
                return fallback
            if name == PEER_COPY_EVERY and text.strip() == AUTO_WORD:
                return fallback  # the run fixed nothing: a trainer's own interval stands
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"{name}={text!r}: expected a whole number of steps "
                                  "(0: off" + (f"; or {AUTO_WORD}" if name == PEER_COPY_EVERY
                                               else "") + ")") from None

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


def every_text(every: int) -> str:
    """``peer_copy_every`` as the environment and the CLI say it."""
    return AUTO_WORD if every == AUTO else str(every)


@dataclass(frozen=True)
class CopyInterval:
    """The peer-copy interval the workers chose at start (:func:`peer_copy_interval`).

    Attributes:
        every: copies every this many steps; 0: the copies do not fit host memory.
        copy_seconds, step_seconds: one copy (snapshot, fingerprint and exchange) and one
            training step, as measured (the slowest rank's).
        held_bytes: host memory the copies hold on a rank at a refresh.
        host_bytes: host memory there is for them (the rank's share of its node's).
        line: what the job says about it, once.
    """

    every: int
    copy_seconds: float
    step_seconds: float
    held_bytes: int
    host_bytes: int
    line: str

    @property
    def fits(self) -> bool:
        return self.every > 0


def peer_copy_interval(copy_seconds: float, step_seconds: float, copy_bytes: int,
                       host_bytes: int, *, budget: float = COPY_BUDGET,
                       held: int = HELD_COPIES, host_share: float = HOST_SHARE) -> CopyInterval:
    """How often peer copies are taken: the fewest steps between copies such that a copy
    costs at most ``budget`` of the step time (``ceil(copy / (budget * step))``, at least
    1), provided the ``held`` copies of ``copy_bytes`` a rank keeps fit ``host_share`` of the
    ``host_bytes`` it has; else ``every`` is 0 (does not fit). Pure: every rank given the
    same measurements chooses the same."""
    if copy_seconds < 0 or step_seconds < 0 or copy_bytes < 0 or host_bytes < 0:
        raise ConfigError(f"peer copy of {copy_bytes} bytes in {copy_seconds} s, steps of "
                          f"{step_seconds} s, {host_bytes} bytes of host memory: none may be "
                          "negative")
    need = held * copy_bytes
    memory = f"{_gib(need)} of {_gib(host_bytes)} host memory"
    if need > host_share * host_bytes:
        return CopyInterval(0, copy_seconds, step_seconds, need, host_bytes,
                            f"peer copies do not fit host memory: {memory} ({held} copies of "
                            f"{_gib(copy_bytes)}; at most {host_share:.0%} of it)")
    if step_seconds <= 0:
        every = 1
    else:
        every = max(1, math.ceil(copy_seconds / (budget * step_seconds) - 1e-9))
    share = copy_seconds / (every * step_seconds) if step_seconds > 0 else 0.0
    return CopyInterval(every, copy_seconds, step_seconds, need, host_bytes,
                        f"peer copies every {every} step{'s' if every != 1 else ''}: a copy "
                        f"takes {_ms(copy_seconds)}, {share:.1%} of {_secs(step_seconds)} "
                        f"steps; {memory}")


def _gib(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.1f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s >= 0.01 else f"{s * 1e3:.2f} ms"


def _secs(s: float) -> str:
    return f"{s:.2f} s" if s >= 0.1 else f"{s * 1e3:.0f} ms"
