"""Who a worker process is in the job (:class:`WorkerProcess`), what its trainer is handed
beside the user's providers (:class:`SchedulerConfig`, :class:`TrainerHooks`), and the ways
a trainer ends in one line (:class:`CommitUnknown`, :class:`CoordinatorLost`,
:class:`RebuiltStateMismatch`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slurm_etc.migrate.faults import KillSpec
from slurm_etc.plan import Layout, Topology
from slurm_etc.plan.errors import ConfigError

from ..errors import InternalError
from ..protocol.messages import Control

DEFAULT_TIMEOUT_S = 300.0


class RebuiltStateMismatch(InternalError):
    """A state rebuilt from peer copies or a checkpoint does not add up to the fingerprint
    taken with them: the job stops rather than train on it (one line)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """megatron-core ``OptimizerParamScheduler`` settings, in optimizer steps (converted to
    samples with the global batch, as Megatron-LM does)."""

    max_lr: float
    min_lr: float = 0.0
    init_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int | None = None
    decay_style: str = "cosine"
    start_wd: float = 0.0
    end_wd: float = 0.0
    wd_incr_style: str = "constant"

    def check(self, train_steps: int) -> None:
        """Refuse, in one line, what megatron's scheduler would assert: warmup steps not
        fewer than the decay steps (``decay_steps``, else ``train_steps``). A trainer of no
        steps and no decay of its own is one made to describe the model, which never builds
        a scheduler."""
        decay = self.decay_steps if self.decay_steps is not None else train_steps
        if (train_steps > 0 or self.decay_steps is not None) and \
                self.warmup_steps >= max(decay, 1):
            raise ConfigError(
                f"the scheduler's warmup_steps ({self.warmup_steps}) must be fewer than "
                f"its decay steps ({max(decay, 1)}: decay_steps, else train_steps)")


@dataclass
class WorkerProcess:
    """Who this process is in the job, and how it reaches the others.

    Attributes:
        job: the job id (prefixes every rendezvous key).
        vrank: this process's device (virtual rank).
        store: the job's rendezvous ``torch.distributed.Store``.
        control: where orders come from and reports go.
        layout: the layout this process starts in (None: it joins at its first Resize).
        generation: the generation of ``layout``.
        topology: devices per node (the plan's topology).
        keep_tp_in_node: plan with tensor-parallel groups inside a node.
        timeout_s: bound of every collective and rendezvous.
        reattach_wait_s: how long this process waits for a silent coordinator before it
            exits (None: no bound, e.g. a control seam without heartbeats).
    """

    job: str
    vrank: int
    store: Any  # a StoreClient: its values are bytes (torch's Store stub says str)
    control: Control
    layout: Layout | None
    generation: int = 0
    topology: Topology = field(default_factory=Topology)
    keep_tp_in_node: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    reattach_wait_s: float | None = None


class CommitUnknown(InternalError, RuntimeError):
    """The rendezvous store stopped answering at or after a resize's commit decision: this
    process cannot tell the decision (one line: which resize)."""


class CoordinatorLost(InternalError):
    """Nothing heard from the coordinator for the reattach wait (one line: how long)."""


@dataclass(frozen=True)
class TrainerHooks:
    """Faults a test plants in a trainer (:mod:`slurm_etc.testing` sets them; nothing in
    the runtime does): ``kill``, this process SIGKILLs itself at a phase of a resize;
    ``stale_peer_copies``, the peer copies it sends are a step stale;
    ``corrupt_peer_copies``, a byte of each shard of every copy it keeps changes after its
    fingerprint was taken. The defaults do nothing."""
    kill: KillSpec | None = None
    stale_peer_copies: bool = False
    corrupt_peer_copies: bool = False
