"""The elastic trainer: a user's megatron-core training that continues through resizes.

The user hands over what a Megatron training script already has::

    trainer = ElasticTrainer(
        model_provider=model_provider,      # (tf_config, pre_process, post_process,
                                            #  vp_stage=None) -> GPTModel
        forward_step=forward_step,          # (data_iterator, model) -> (output, loss_func)
        dataset_provider=dataset_provider,  # () -> map-style dataset of samples
        transformer_config=tf_config,       # template; tp/pp/ep/vpp are set per layout
        optimizer_config=OptimizerConfig(optimizer="adam", lr=3e-4, ...),
        scheduler=SchedulerConfig(max_lr=3e-4, warmup_steps=..., decay_steps=...),
        global_batch_size=16, micro_batch_size=2, train_steps=100)
    trainer.run(process)                    # a WorkerProcess: job, vrank, store, control

and trains through megatron-core's own pipeline schedule (``get_forward_backward_func``),
optimizer (``get_megatron_optimizer``, distributed or not) and LR/weight-decay scheduler
(``OptimizerParamScheduler``). At every step boundary the ranks agree on whether an order
came (one rank being told is enough: the order travels from the lowest rank that has it);
a :class:`~slurm_etc.protocol.messages.Resize` moves the state in place
(:mod:`slurm_etc.megatron.resize`) and training goes on in the new layout; a
:class:`~slurm_etc.protocol.messages.Stop` ends it.

What moves or is re-derived exactly: parameters, fp32 main parameters and Adam moments (the
executor); the Adam step and each rank's torch RNG (the migration group's control exchange);
the iteration, consumed samples, scheduler state and grad-scaler state (identical on every
old rank; old rank 0 publishes them in the rendezvous store); the CUDA and megatron
tensor-parallel RNG tracker states where they exist (per old rank, taken by the new rank
that continues it). Each new data-parallel rank then reads exactly the samples a
checkpoint-restart would give it (:mod:`.data`). A layout that cannot keep the global batch
is refused before anything moves.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from slurm_etc.lifecycle import ProcessOutcome
from slurm_etc.megatron.build import (
    TrainingState,
    batch_p2p_comm,
    initialize_parallel_state,
    skip_tied_embedding_sync,
    wrap_for_training,
)
from slurm_etc.megatron.live import check_catalog, check_chunk_layers, model_desc_of
from slurm_etc.megatron.resize import InstallInterrupted
from slurm_etc.megatron.state import sub_optimizers
from slurm_etc.migrate import connections, device
from slurm_etc.migrate.faults import KillSpec
from slurm_etc.plan import Layout, MigrationPlan, ParallelConfig, Topology, plan_migration
from slurm_etc.plan.catalog import Catalog, build_catalog
from slurm_etc.plan.errors import ConfigError, StateLostError
from slurm_etc.plan.fingerprint import plan_digest
from slurm_etc.plan.model import ModelDesc
from slurm_etc.protocol.rendezvous import GenerationKeys
from slurm_etc.protocol.store import (
    StoreInterrupted,
    StoreUnreachable,
    Woken,
    agree_step,
    arrive_step,
    wait_for_keys,
)
from slurm_etc.protocol.values import decode_value, encode_value

from ..errors import InternalError

if TYPE_CHECKING:
    import threading

    from slurm_etc.megatron.resize import PreparedResize
    from slurm_etc.migrate.executor import MigrationOptions
from ..protocol.messages import (
    ENCODER,
    HOLD_AFTER_S,
    ORDER_DECODER,
    Abort,
    Control,
    CopiesChosen,
    Exited,
    ModelBuilt,
    ModelReport,
    Order,
    Progress,
    Ready,
    Resize,
    Resized,
    Resumed,
    Stop,
)
from ..protocol.recovery import (
    AUTO,
    DEFAULT_KEEP_CHECKPOINTS,
    CopyInterval,
    Recovery,
    checkpoint_steps,
    checkpoints_to_delete,
    newest_checkpoint,
    peer_copy_interval,
)
from .data import check_batch, check_interleaving, microbatch_samples
from .lifeline import children_die_with_me
from .redundancy import (
    PeerCopies,
    fingerprint_mismatch,
    fingerprint_totals,
    shards_fingerprint,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
# peer copies every "auto" steps: steps timed after the first copy before choosing
AUTO_TIMED_STEPS = 2


class RebuiltStateMismatch(InternalError):
    """A state rebuilt from peer copies or a checkpoint does not add up to the fingerprint
    taken with them: the job stops rather than train on it (one line)."""
# A new rank that waits this long for its peers to install a committed layout reports the
# commit at once: the coordinator can then settle it and name a peer that died meanwhile.
EARLY_COMMIT_REPORT_S = 2.0
# A rank waiting for its peers at the step agreement asks again (and looks at its orders)
# this often. The job's store answers at once when the decision is there and when the
# coordinator names the dead (the wake key), so the slice only bounds a wait on another
# store: short slices re-ask N times a second while a 16k-rank job arrives (seconds).
AGREE_SLICE_S = 1.0
# ...and in a large job at least world / AGREE_ASKS_PER_S seconds: the waiting ranks' slices
# together ask the store at most about this many times a second, whatever the job's size
# (at 4,096 ranks, slices of 1 s were more than half of a resize's requests at the store).
AGREE_ASKS_PER_S = 1024


def agree_slice_s(world: int) -> float:
    """How long one slice of a rank's wait at a step's decision lasts in a ``world``-rank
    layout (:data:`AGREE_SLICE_S`, longer past :data:`AGREE_ASKS_PER_S` ranks)."""
    return max(AGREE_SLICE_S, world / AGREE_ASKS_PER_S)

# The phases of resize_in_place that the worker's "resized" line shows, in their order.
PAUSE_PARTS = ("resume", "migrate", "train_group", "rebuild", "install", "switch")
# A worker whose coordinator died says Hello this often until a restarted one answers.
REJOIN_S = 1.0
# Step times kept to compare the old layout's steps while a resize is prepared with before.
STEP_TIMES_KEPT = 64


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


# A worker waiting for the order naming its dead peers takes the coordinator for dead once
# its link has been down this long (a killed coordinator's closes at once), and holds for
# the restarted one.
LINK_LOST_S = 2.0


class CommitUnknown(InternalError, RuntimeError):
    """The rendezvous store stopped answering at or after a resize's commit decision: this
    process cannot tell the decision (one line: which resize)."""


class CoordinatorLost(InternalError):
    """Nothing heard from the coordinator for the reattach wait (one line: how long)."""


@dataclass
class StepRecord:
    """One trained step as every rank sees it; ``started``/``ended``: when it began and
    ended on this rank (unix seconds)."""

    step: int
    loss: float
    lr: float
    consumed_samples: int
    layout: str
    generation: int
    started: float = 0.0
    ended: float = 0.0


@dataclass
class ResizeRecord:
    """One resize as this process saw it."""

    generation: int
    old: str
    new: str
    outcome: str
    step: int
    moved_bytes: int
    pause_seconds: float
    data_seconds: float
    error: str = ""
    lost_steps: tuple[int, int] | None = None  # (first, last) trained, lost with a node


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


class ElasticTrainer:
    """A megatron-core training loop that resizes in place on the coordinator's orders.

    Args:
        model_provider: ``(transformer_config, pre_process, post_process, vp_stage=None)
            -> GPTModel`` for this rank's pipeline stage (the config has this layout's tp,
            pp, ep and vpp set), Megatron-LM's ``model_provider`` convention. With virtual
            pipeline chunks (vpp > 1) it is called once per chunk ``v`` with ``vp_stage=v``
            (and that chunk's ``pre_process``/``post_process``) and must pass ``vp_stage`` to
            ``GPTModel``; at vpp = 1 ``vp_stage`` is not passed, so a provider of three
            parameters works there (and a layout with vpp > 1 is refused in one line).
        forward_step: megatron's ``forward_step_func``: ``(data_iterator, model) ->
            (output_tensor, loss_func)``; ``loss_func(output) -> (loss, {"lm loss": loss})``.
        dataset_provider: ``() -> dataset``; ``dataset[i]`` is sample ``i`` (a tensor or a
            dict of tensors), the same on every rank.
        transformer_config: megatron ``TransformerConfig`` template (tp, pp, ep, vpp and the
            interleaved schedule's ``microbatch_group_size_per_vp_stage`` are replaced;
            ``batch_p2p_comm`` is off with vpp > 1:
            :func:`slurm_etc.megatron.build.batch_p2p_comm`).
        optimizer_config: megatron ``OptimizerConfig`` (``use_distributed_optimizer`` is
            taken from the layout).
        scheduler: LR and weight-decay schedule.
        global_batch_size: samples per optimizer step, kept through every resize.
        micro_batch_size: samples per micro-batch.
        seq_length: tokens per sample (for the pipeline schedule's buffers).
        train_steps: optimizer steps to train in all.
        name: the model's name in plans and logs.
        seed: seeds torch's generators before the first build (initial weights).
        collate: stacks a micro-batch's samples (default: ``torch.stack`` per key).
        peer_copy_every: every this many steps each rank copies its state to a rank on
            another node (:mod:`.redundancy`), so that a node lost without grace loses at
            most these steps even where no dp replica survives; 0: off; ``AUTO`` (the
            default): chosen once, in the first layout on two nodes or more, so that copies
            cost about 2% of step time and fit host memory (:meth:`_choose_peer_copies`).
        checkpoint_every, checkpoint_dir: a megatron-core checkpoint every this many steps
            into ``checkpoint_dir`` (the newest ``recovery.keep_checkpoints`` kept): the
            fallback when neither a replica nor a peer copy survives a loss; 0: off.
    """

    def __init__(self, *, model_provider: Callable[..., Any], forward_step: Callable[..., Any],
                 dataset_provider: Callable[[], Any], transformer_config: Any,
                 optimizer_config: Any, scheduler: SchedulerConfig, global_batch_size: int,
                 micro_batch_size: int, seq_length: int, train_steps: int,
                 name: str = "user-model", seed: int = 1234,
                 collate: Callable[[list], Any] | None = None, peer_copy_every: int = AUTO,
                 checkpoint_every: int = 0, checkpoint_dir: str | None = None) -> None:
        if train_steps < 0:
            raise ConfigError(f"train_steps must be >= 0, got {train_steps}")
        Recovery(peer_copy_every, checkpoint_every, checkpoint_dir)  # checks the values
        check_batch(global_batch_size, micro_batch_size, 1)
        # megatron's scheduler asserts it; a trainer of no steps and no decay of its own is
        # one made to describe the model, which never builds a scheduler
        decay = scheduler.decay_steps if scheduler.decay_steps is not None else train_steps
        if (train_steps > 0 or scheduler.decay_steps is not None) and \
                scheduler.warmup_steps >= max(decay, 1):
            raise ConfigError(
                f"the scheduler's warmup_steps ({scheduler.warmup_steps}) must be fewer than "
                f"its decay steps ({max(decay, 1)}: decay_steps, else train_steps)")
        self.model_provider = model_provider
        self.forward_step = forward_step
        self.dataset_provider = dataset_provider
        self.tf_template = transformer_config
        self.optimizer_config = optimizer_config
        self.scheduler_config = scheduler
        self.global_batch = global_batch_size
        self.micro_batch = micro_batch_size
        self.seq_length = seq_length
        self.train_steps = train_steps
        self.name = name
        self.seed = seed
        self.collate = collate or _stack
        self.peer_copy_every = peer_copy_every
        self.checkpoint_every, self.checkpoint_dir = checkpoint_every, checkpoint_dir
        self.keep_checkpoints = DEFAULT_KEEP_CHECKPOINTS
        self.resume_from: str | None = None  # a checkpoint the first layout loads
        self.hooks = TrainerHooks()  # fault injection: set by slurm_etc.testing only
        self.peers: PeerCopies | None = None  # this layout's snapshots and peer copies
        self._peers_gen = -1
        self.lost_history: list[StepRecord] = []  # steps trained, then lost with a node
        self._rollback: tuple[int, int, int] | None = None  # (generation, first, last lost)
        self._rebuilt_from: dict[int, str] = {}  # generation -> peer-copies | checkpoint
        # generation -> per state tensor, the fingerprint its rebuilt state must add up to
        self._expected_fp: dict[int, dict[str, int]] = {}
        # peer copies every "auto": the generation measured in, the copy's seconds and
        # bytes, the step it was taken after; then the choice (said once)
        self._choosing: tuple[int, float, int, int] | None = None
        self.copy_interval: CopyInterval | None = None
        self.state: TrainingState | None = None
        self.scheduler: Any = None
        self.catalog: Catalog | None = None
        self.layout: Layout | None = None
        self.generation = 0
        self.step = 0
        self.consumed_samples = 0
        self.history: list[StepRecord] = []
        self.resizes: list[ResizeRecord] = []
        self._dataset: Any = None
        self._pending: Order | None = None
        self._lost: frozenset[int] = frozenset()
        self._aborted: set[int] = set()  # generations whose resize aborted here
        self._abort_told: set[int] = set()  # generations the coordinator said it aborted
        # what this rank published for the new ranks of its last resize (key -> value): set
        # again on a restarted coordinator's store
        self._published: dict[str, bytes] = {}
        self._woken_by = b""  # the last order naming the dead that ended a vote early
        self._agreeing = ("", "")  # the step agreement's own and stale keys (_arrive's)
        # resizes that ended without a new layout (aborted or refused, on every rank alike):
        # the agreement at the same step after one must not read the keys of the one before
        self._attempt = 0
        self._rejoined = False  # reattached to a restarted coordinator in this agreement
        # (generation, step, whether any rank held an order): carried by the step's own loss
        # all-reduce, it lets the boundary after that step skip the store's agreement
        self._gate: tuple[int, int, bool] | None = None
        self._base_sockets: frozenset[int] = frozenset()
        # a committed layout not installed (a new rank died first): shards and resume state,
        # the trainer state and this rank's RNG extras, moved on by the next resize
        self._held: tuple[list, Any] | None = None
        self._held_extras: tuple[dict, dict] = ({}, {})
        self._kill: KillSpec | None = None
        self.proc: WorkerProcess | None = None
        # the model this process said it built (ModelBuilt, once per process and again to
        # a restarted coordinator, which plans with it when not told a --model)
        self._model_said: ModelReport | None = None
        # (generation, unix end) of the last step this process trained; the generation it
        # first trained in without a resize (its first layout: no gap to report)
        self._ended_in: tuple[int, float] | None = None
        # the widest gap between two old-layout steps while a resize was prepared beside
        # training (the boundary that built the new world): reported with the first new step
        self._stalled = 0.0
        # when this process's step in flight failed (a peer died): reported with the first
        # new step, which tells the step lost with the node from the recovery
        self._failed_at: float | None = None
        self._first_generation: int | None = None
        # a resize being prepared while the old layout trains (see _advance_preparation)
        self._preparing: _Preparation | None = None
        # (seconds, preparing) of the last steps trained: the old layout's cost of preparing
        self.step_times: deque[tuple[float, bool]] = deque(maxlen=STEP_TIMES_KEPT)

    # -- the loop -------------------------------------------------------------------------

    def run(self, proc: WorkerProcess, *, resume_from: str | None = None) -> str:
        """Train until ``train_steps``, a Stop, or this process leaves the job in a resize.

        ``resume_from``: a checkpoint directory written by :meth:`save_checkpoint` (the
        checkpoint-restart path; any layout megatron can reshard it to).

        Returns why it ended: ``"done"``, ``"stopped"``, ``"left"``, or
        ``"coordinator-lost"`` (nothing heard from the coordinator for
        ``proc.reattach_wait_s``). The trained state stays in ``self.state`` until
        :meth:`close`.
        """
        # the sockets before any process group (the coordinator's, the user's own): never
        # closed when this rank leaves failed groups
        self._base_sockets = connections.snapshot()
        try:
            return self._run(proc, resume_from)
        except CoordinatorLost as lost:
            self._log("%s", lost)
            return self._exit("coordinator-lost")

    def _run(self, proc: WorkerProcess, resume_from: str | None) -> str:
        from slurm_etc.megatron import cpu_compat

        if not torch.cuda.is_available():
            cpu_compat.install()
        compute = device.use(device.select())
        # what this worker forks (megatron's checkpoint Manager, data loaders) ends with it
        children_die_with_me()
        self.proc = proc
        self._kill = self.hooks.kill
        self._dataset = self.dataset_provider()
        resume_from = resume_from or self.resume_from
        if proc.layout is not None and proc.vrank in proc.layout.devices:
            self.layout, self.generation = proc.layout, proc.generation
            self._start_group(GenerationKeys(proc.job, proc.generation).train_group,
                              proc.layout.devices.index(proc.vrank), proc.layout.config.world)
            torch.manual_seed(self.seed)
            self.state = self._build(proc.layout.config, empty=resume_from is not None)
            if resume_from is not None:
                self._load_checkpoint(resume_from)
                expected = checkpoint_fingerprint(resume_from)
                if expected is not None:
                    self._check_rebuilt(GenerationKeys(proc.job, proc.generation),
                                        proc.layout, expected, "the checkpoint")
            self._first_generation = proc.generation
            _freeze_heap()
            self._log("training %s on %d processes from step %d (on %s)", proc.layout.config,
                      proc.layout.config.world, self.step, compute)
        else:
            while self.layout is None:  # a joining process; an aborted resize: the next one
                first = self._first_order(proc)
                if isinstance(first, Stop):
                    return self._exit("stopped")
                self._warm_up(first)
                if self._carry_out(first) == "left":
                    return self._exit("left")
        while True:
            try:
                if self._preparing is not None and \
                        self._advance_preparation(self.step >= self.train_steps) == "left":
                    return self._exit("left")
                order = self._agree()
                if order is None and self.step < self.train_steps:
                    self._hold_while_silent()
                    t = time.perf_counter()
                    preparing = self._preparing is not None
                    self.train_step()
                    self.step_times.append((time.perf_counter() - t, preparing))
                    self._after_step()
                    continue
                if order is None and self._preparing is not None:
                    continue  # the last step trained: the resize prepared still runs
            except StoreUnreachable as err:  # the coordinator died: hold for its restart
                self._coordinator_died(err, None)
                continue
            except RuntimeError as err:  # a peer died inside a collective
                order = self._recover(err)
            if isinstance(order, Stop):
                return self._exit("stopped")
            if isinstance(order, Resize):
                if self._carry_out(order) == "left":
                    return self._exit("left")
                continue
            return self._exit("done")

    def _carry_out(self, order: Resize) -> str:
        """:meth:`_resize`, given up where the coordinator gave it up: a rendezvous wait
        in it (a dead peer's key never comes) ends once the coordinator aborts the resize or
        orders a newer one (:meth:`_superseded`), and a coordinator that died before this
        rank's vote ends it too (:meth:`_coordinator_died`)."""
        if self._preparing is not None:  # a newer order (one naming the dead) supersedes it
            self._drop_preparation()
        store = self._proc().store
        interruptible = hasattr(store, "interrupt")
        if interruptible:
            store.interrupt = functools.partial(self._superseded, order.generation)
        try:
            return self._resize(order)
        except StoreUnreachable as err:  # before this rank's commit vote
            return self._coordinator_died(err, order)
        except StoreInterrupted as err:
            self._aborted.add(order.generation)
            self._attempt += 1
            self._log("resize to generation %d given up before this process's commit vote: "
                      "%s", order.generation, err)
            self._record(order, ProcessOutcome.ABORTED, 0, 0.0, 0.0, str(err)[:300])
            return "stay"
        finally:
            if interruptible:
                store.interrupt = None

    def _superseded(self, generation: int) -> str | None:
        """Why the resize to ``generation`` this process carries out is over: the
        coordinator aborted it, or ordered a newer one (or the job's end); None while it
        stands. Asked between the slices of a rendezvous wait."""
        self._drain_orders(self._proc())
        if generation in self._abort_told:
            return f"the coordinator aborted the resize to generation {generation}"
        pending = self._pending
        if isinstance(pending, Stop):
            return "the coordinator stopped the job"
        if isinstance(pending, Resize) and pending.generation > generation:
            return f"the coordinator ordered generation {pending.generation} in its place"
        return None

    def _coordinator_died(self, err: StoreUnreachable, order: Resize | None) -> str:
        """The rendezvous store stopped answering (its coordinator died) outside a step's
        agreement: in the resize to ``order`` before this rank's commit vote (planning,
        connecting the migration group, publishing the trainer state: a vote that lost the
        store raises :class:`CommitUnknown` instead), or in a resize prepared beside
        training. Nothing is committed anywhere without this rank's vote, so the resize is
        given up here as an abort (the restarted coordinator records it so), and this rank
        holds in its old layout for the restarted coordinator (:meth:`_await_restart`),
        which takes it up and orders what comes next. A joiner has nothing to keep: the
        error stands (it exits; the restarted coordinator stops what it does not take)."""
        prep = self._preparing
        given_up = {o.generation for o in (order, prep.order if prep else None) if o}
        if prep is not None:
            self._drop_preparation()
        # (the attempt stays: the restarted coordinator's store holds no agreement of this
        # step, and a peer that waited at the boundary meanwhile did not count one)
        self._aborted |= given_up
        if self.layout is None:
            raise err
        self._log("the coordinator died in the resize to generation %s before this "
                  "process's commit vote: given up here, the old layout %s kept",
                  ", ".join(map(str, sorted(given_up))) or "(none)", self.layout.config)
        self._await_restart(err)
        return "stay"

    def _recover(self, err: RuntimeError) -> Order:
        """A collective failed (a peer died, e.g. its node failed). The step did not
        complete anywhere it failed, so this rank's state is the last step's. Wait for the
        coordinator's resize that names the dead; without one within the timeout, the
        original error stands. The training groups stay registered until the resize has
        read this rank's shards (megatron's sharded_state_dict asks them for tp/pp ranks),
        but their connections close at once (:func:`~slurm_etc.migrate.device.leave_groups`):
        a surviving peer blocked on this rank in another collective of the step fails now,
        not at the group's timeout (it would wait for this rank's part for minutes, and this
        rank for it in the resize)."""
        proc = self._proc()
        if self._failed_at is None:  # the first failure: the step in flight ended there
            self._failed_at = time.time()
            prep = self._preparing
            kept = (prep.prepared.world if prep is not None and prep.prepared is not None
                    else None)
            closed = device.leave_groups(kept.groups if kept is not None else (),
                                         base=self._base_sockets,
                                         spare_ports=self._coordinator_ports(proc),
                                         keep_sockets=kept.sockets if kept is not None else ())
            logger.debug("left the failed groups: %d closed", closed)
        self._log("a collective failed after step %d at unix %.6f (%s); waiting for the "
                  "coordinator", self.step, self._failed_at,
                  str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
        deadline = time.monotonic() + proc.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self._take_orders()
            if isinstance(self._pending, Stop) or self._names_the_dead(self._pending):
                order, self._pending = self._pending, None
                if order is not None:
                    return order
            if (silent := self._silence()) is not None and silent > LINK_LOST_S:
                # the coordinator died too: its order comes from the restarted one
                self._await_restart(StoreUnreachable(
                    f"the coordinator's link is down for {silent:.1f} s"))
                deadline = time.monotonic() + proc.timeout_s
                continue
            # Block on the channel, not a sleep: the order is taken the moment it comes
            # (a 50 ms sleep here was a third of a loss's recovery).
            if (order := proc.control.wait(min(left, 0.5))) is not None:
                self._consider(order)
        raise err

    def close(self) -> None:
        """Drop the state and this process's groups (after :meth:`run` returned)."""
        if dist.is_initialized():
            from slurm_etc.megatron.build import teardown_world

            self.state = None
            teardown_world()

    # -- the checkpoint path (the reference a resize is held against) ----------------------

    def save_checkpoint(self, directory: str) -> dict:
        """megatron ``dist_checkpointing`` save of model and optimizer, plus the trainer's
        own state (rank 0: step, consumed samples, scheduler, grad scalers, layout) and
        every rank's RNG, as Megatron-LM's checkpoints hold them. Collective."""
        from slurm_etc.megatron.checkpoint import save_checkpoint

        state, cfg = self._live()
        out = save_checkpoint(state, directory)
        rank = dist.get_rank()
        if rank == 0:
            torch.save({**self._trainer_state(), "config": str(cfg),
                        "num_layers": self.tf_template.num_layers},
                       os.path.join(directory, "trainer.pt"))
        os.makedirs(os.path.join(directory, "rng"), exist_ok=True)
        torch.save({"cpu": torch.get_rng_state(), **_rng_extras()},
                   os.path.join(directory, "rng", f"{rank}.pt"))
        # what a state loaded from it must add up to (checked before training on it)
        os.makedirs(os.path.join(directory, FINGERPRINT_DIR), exist_ok=True)
        with open(os.path.join(directory, FINGERPRINT_DIR, f"{rank}.json"), "w") as f:
            json.dump(shards_fingerprint(local_shards_of(state, self._catalog())), f)
        dist.barrier()
        return out

    def _load_checkpoint(self, directory: str) -> None:
        from slurm_etc.megatron.checkpoint import load_checkpoint
        from slurm_etc.megatron.state import rng_source

        state, cfg = self._live()
        load_checkpoint(state, directory, optimizer=True)
        saved = torch.load(os.path.join(directory, "trainer.pt"), weights_only=True)
        self._restore_trainer_state(saved)
        old = ParallelConfig.parse(saved["config"].replace(",dist-opt", ""),
                                   cfg.distributed_optimizer)
        src = rng_source(old, cfg, dist.get_rank(), saved["num_layers"])
        rng = torch.load(os.path.join(directory, "rng", f"{src}.pt"), weights_only=True)
        torch.set_rng_state(rng.pop("cpu"))
        _set_rng_extras(rng)

    def train_step(self) -> float:
        """One optimizer step over the next global batch; its mean loss (every rank)."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        started = time.time()
        state, cfg = self._live()
        dp_rank = parallel_state.get_data_parallel_rank()
        ranges = microbatch_samples(self.consumed_samples, self.global_batch,
                                    self.micro_batch, cfg.dp, dp_rank)
        on = device.current().device
        batches = [device.to_device(self.collate([self._dataset[i] for i in r]), on)
                   for r in ranges]
        for chunk in state.model:
            chunk.zero_grad_buffer()
        state.optimizer.zero_grad()
        # the interleaved schedule (vpp > 1) takes one iterator per model chunk, each over
        # the same micro-batches: chunk v's forward reads micro-batch k at its k-th call
        data = (iter(batches) if len(state.model) == 1
                else [iter(batches) for _ in state.model])
        losses = get_forward_backward_func()(
            forward_step_func=self.forward_step, data_iterator=data,
            model=state.model, num_microbatches=len(batches), seq_length=self.seq_length,
            micro_batch_size=self.micro_batch, forward_only=False)
        ok, _norm, _zeros = state.optimizer.step()
        if not ok:
            raise RuntimeError(f"step {self.step} was skipped (non-finite gradients)")
        self.scheduler.step(increment=self.global_batch)
        self.step += 1
        self.consumed_samples += self.global_batch
        trained = time.time()
        lr = float(state.optimizer.param_groups[0]["lr"])
        try:
            loss = self._reduce_loss(losses, cfg)
        except RuntimeError:
            # the step is trained here (its gradients were reduced and applied); only the
            # reduce of its loss failed, a peer dead since: the step ended before the
            # failure, not in the pause that follows (its loss is not known)
            self._step_ended(started, trained, float("nan"), lr, cfg, report=False)
            raise
        ended = time.time()  # the step's work is done here (what follows only reports it)
        self._step_ended(started, ended, loss, lr, cfg, report=True)
        return loss

    def _reduce_loss(self, losses: list[dict], cfg: ParallelConfig) -> float:
        """The step's mean loss (:func:`~slurm_etc.megatron.build.mean_loss`) and, in the
        same all-reduce, the gate of the step boundary after it: whether any rank holds an
        order (or saw its store close: a coordinator died). Nobody: that boundary trains on
        without asking the store anything (O(1) a rank, whatever the job's size); somebody:
        every rank agrees through the store, as before (:meth:`_agree`). Every rank reads
        the same sum, so all take the same path. On the step's device: over NCCL on a GPU
        (the world's gloo half then carries nothing per step), gloo on the CPU."""
        from megatron.core import parallel_state

        local = torch.zeros(2, dtype=torch.float64, device=device.current().device)
        if losses and parallel_state.is_pipeline_last_stage():
            local[0] = sum(float(x["lm loss"]) for x in losses) / len(losses)
        local[1] = 1.0 if self._holds_an_order() else 0.0
        dist.all_reduce(local)
        self._gate = (self.generation, self.step, bool(local[1] > 0))
        return float(local[0]) / (cfg.dp * cfg.tp)

    def _holds_an_order(self) -> bool:
        """Whether this rank needs the store's agreement at the next boundary: an order is
        pending (one of its own generation or older is done), or its store's connection
        closed. Reads the channel without the silence check (an exception here, on some
        ranks only, would split them)."""
        proc = self.proc
        if proc is None:
            return False
        self._drain_orders(proc)
        if isinstance(self._pending, Resize | Abort) and \
                self._pending.generation <= self.generation:
            self._pending = None
        disconnected = getattr(proc.store, "disconnected", None)
        return self._pending is not None or bool(disconnected and disconnected())

    def _step_ended(self, started: float, ended: float, loss: float, lr: float,
                    cfg: ParallelConfig, *, report: bool) -> None:
        """A step trained: the Resumed of a new layout's first step, the stall, the log line;
        with ``report`` (its loss known) its record and the coordinator's Progress (rank 0)."""
        proc = self._proc()
        if report:
            self.history.append(StepRecord(self.step, loss, lr, self.consumed_samples,
                                           str(cfg), self.generation, started, ended))
            self._live()[0].losses.append(loss)
            if dist.get_rank() == 0:
                proc.control.report(Progress(proc.job, self.generation, proc.vrank, self.step,
                                             loss, lr, self.consumed_samples, str(cfg),
                                             started, ended))
        self._report_resumed(started)
        if self._preparing is not None and self._ended_in is not None and \
                self._ended_in[0] == self.generation:  # training stopped at that boundary
            self._stalled = max(self._stalled, started - self._ended_in[1])
        self._ended_in = (self.generation, ended)
        self._log("step %d loss %.6f lr %.3e consumed %d started %.6f ended %.6f%s", self.step,
                  loss, lr, self.consumed_samples, started, ended,
                  "" if report else " (its loss's reduce failed: a peer died)")

    def _report_resumed(self, started: float) -> None:
        """The first step of a layout this process came to by a resize: report when it
        began and when this process's last step in the old layout ended (a joiner: the
        old layout's, as its publisher left it in the store), measured at the step
        boundaries, whatever the resize did in between."""
        if self._ended_in is not None and self._ended_in[0] == self.generation:
            return  # not the first step of this layout
        if self._ended_in is None and self.generation == self._first_generation:
            return  # the layout this process started in: no resize before it
        proc = self._proc()
        last: float | None = self._ended_in[1] if self._ended_in is not None else None
        if last is None:
            key = GenerationKeys(proc.job, self.generation).last_ended
            if proc.store.check([key]):
                last = float(proc.store.get(key).decode())
        proc.control.report(Resumed(proc.job, self.generation, proc.vrank, self.step, started,
                                    last, joined=self._ended_in is None,
                                    stalled=self._stalled, failed_at=self._failed_at))
        self._stalled = 0.0
        self._failed_at = None
        # the old layout's groups, retired at the switch, are shut down beside the next
        # steps: neither the pause nor a later step boundary waits for it
        from slurm_etc.megatron.world import retire_in_background

        retire_in_background()

    # -- orders ---------------------------------------------------------------------------

    def _first_order(self, proc: WorkerProcess) -> Resize | Stop:
        """A joining process waits for the resize that brings it in."""
        deadline = time.monotonic() + proc.timeout_s
        while time.monotonic() < deadline:
            self._check_coordinator()
            order = proc.control.wait(min(1.0, deadline - time.monotonic()))
            if isinstance(order, Stop) or isinstance(order, Resize) and \
                    order.generation > self.generation and \
                    order.generation not in self._aborted and proc.vrank in order.new.devices:
                return order
        raise TimeoutError(f"vrank {proc.vrank} of job {proc.job} got no order to join within "
                           f"{proc.timeout_s:.0f} s")

    def _warm_up(self, order: Resize) -> None:
        """A joiner, before the old layout is ordered: do aside what needs no peer (import
        what building the new layout, the migration and the schedule use; the data set is
        open already), then say Ready. The coordinator orders the old layout only once every
        joiner did, so the old layout trains through all of this. The new layout's groups,
        model, DDP and optimizer need the stayers in the rendezvous: they are built there
        (docs/zero-stall.md)."""
        import importlib

        proc = self._proc()
        t0 = time.perf_counter()
        for name in ("megatron.core.models.gpt", "megatron.core.optimizer",
                     "megatron.core.distributed", "megatron.core.pipeline_parallel",
                     "megatron.core.optimizer_param_scheduler", "slurm_etc.megatron.resize",
                     "slurm_etc.megatron.world", "slurm_etc.migrate.executor",
                     "slurm_etc.migrate.group", "slurm_etc.migrate.program"):
            importlib.import_module(name)
        _freeze_heap()
        seconds = time.perf_counter() - t0
        proc.control.report(Ready(proc.job, order.generation, proc.vrank, seconds))
        self._log("ready for generation %d (warm-up %.2f s)", order.generation, seconds)

    def _silence(self) -> float | None:
        """Seconds since the coordinator was last heard of (its heartbeats, orders); None
        where that is not known (a control seam without a clock, no reattach wait)."""
        proc = self._proc()
        heard = getattr(proc.control, "heard_at", None)
        if heard is None or not proc.reattach_wait_s:
            return None
        return time.monotonic() - heard

    def _check_coordinator(self) -> None:
        silent = self._silence()
        wait = self._proc().reattach_wait_s
        if silent is not None and wait is not None and silent > wait:
            raise CoordinatorLost(f"no word from the coordinator for {silent:.0f} s (it waits "
                                  f"{wait:.0f} s for a reattach): exiting at step {self.step}")

    def _hold_while_silent(self) -> None:
        """At a step boundary: while the coordinator is silent (killed, or stuck), train
        no step (none it could record); go on when it speaks again, exit past the
        reattach wait (CoordinatorLost from _take_orders)."""
        proc = self._proc()
        silent = self._silence()
        hold = min(HOLD_AFTER_S, (proc.reattach_wait_s or 0.0) / 2)
        if silent is None or silent < hold:
            return
        self._log("no word from the coordinator for %.0f s: holding at step %d (exiting "
                  "after %.0f s of silence)", silent, self.step, proc.reattach_wait_s)
        while (silent := self._silence()) is not None and silent >= hold:
            time.sleep(0.1)
            self._take_orders()
        self._log("the coordinator speaks again: training on")

    def _take_orders(self) -> None:
        """Drain the control seam into ``_pending`` (the newest order; an Abort cancels the
        pending resize of its generation). Raises CoordinatorLost once the coordinator has
        been silent past the reattach wait."""
        proc = self._proc()
        try:
            self._drain_orders(proc)
        finally:
            self._check_coordinator()  # after the drain: what just came counts as heard

    def _drain_orders(self, proc: WorkerProcess) -> None:
        while (order := proc.control.poll()) is not None:
            self._consider(order)

    def _consider(self, order: Order) -> None:
        """Keep ``order`` in ``_pending`` if it is the newest that applies (a Stop always
        does: its generation may be one whose resize aborted here)."""
        if isinstance(order, Stop):
            self._pending = order
            return
        if order.generation <= self.generation or order.generation in self._aborted:
            return
        prep = self._preparing
        if prep is not None and order.generation == prep.order.generation:
            if isinstance(order, Abort) and prep.stage == "transfer":
                # every rank gives it up together, at the next preparation agreement
                prep.error = RuntimeError(f"aborted by the coordinator: {order.reason}")
            return  # else the same order again (resent): it is being prepared
        if isinstance(order, Abort):
            self._abort_told.add(order.generation)
            if self._pending is not None and self._pending.generation == order.generation:
                self._log("resize to generation %d aborted by the coordinator: %s",
                          order.generation, order.reason)
                self._pending = None
            return
        if self._pending is None or order.generation >= self._pending.generation:
            self._pending = order

    def _agree(self) -> Order | None:
        """At a step boundary, every rank of the layout learns the same order, one that a
        rank holds (one rank being told is enough), or that there is none.

        Asked of the store only after a step whose gate (its loss all-reduce) said some rank
        holds an order: O(1) requests a rank then (:meth:`_arrive`: the first order proposed
        is the decision), none at all otherwise. Through the store rather than a collective:
        a peer that died never arrives, and the coordinator's resize naming the dead ends the
        wait on every survivor, which no blocked collective could."""
        proc = self._proc()
        layout = self.layout
        if layout is None:
            raise RuntimeError("agreement without a layout")
        self._take_orders()
        if isinstance(self._pending, Resize | Abort) and \
                self._pending.generation <= self.generation:
            # its own copy, come by the channel while this process carried out the order a
            # peer's agreement told it of: done already, not a new order to agree on
            self._pending = None
        gate, self._gate = self._gate, None
        if gate == (self.generation, self.step, False):
            # no rank held an order when the step ended (one come since is agreed on at the
            # next boundary: it joins that step's gate); nothing asked of the store
            return None
        rank = layout.devices.index(proc.vrank)
        names = GenerationKeys(proc.job, self.generation)
        own = names.agreement(self._attempt, self.step, rank)
        decided = names.agreement(self._attempt, self.step, "decided")
        # every peer read the key of step - 2 before the step after it could start
        stale = names.agreement(self._attempt, self.step - 2, rank) if self.step >= 2 else ""
        arrive = (decided, names.agreement(self._attempt, self.step, "arrived"),
                  layout.config.world)
        self._agreeing = (own, stale)
        values = self._arrive(*arrive)
        deadline = time.monotonic() + proc.timeout_s
        # the store answers when the decision is there (one round trip); each slice, orders
        # are looked at
        while values is None:
            if self._rejoined:
                # reattached to a restarted coordinator: its store is new, and this rank
                # arrives there once with what it holds now (the new coordinator's order)
                self._rejoined = False
                deadline = time.monotonic() + proc.timeout_s
                if (values := self._arrive(*arrive)) is not None:
                    break
            self._take_orders()
            if self._names_the_dead(self._pending):
                order, self._pending = self._pending, None
                return order
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks of {layout.config} did not reach step {self.step} "
                                   f"within {proc.timeout_s:.0f} s")
            values = self._agree_slice(own, b"-", stale, [decided])
        order = newest_order(values, self.generation, self._aborted)
        held = self._pending
        if held is None or (order is not None and held.generation <= order.generation) \
                or (not isinstance(held, Stop) and held.generation in self._aborted):
            self._pending = None
        # else: newer than the decision (another rank's proposal came first); it opens the
        # gate of the next boundary, where it is decided
        return order

    def _arrive(self, decided: str, arrived: str, world: int) -> list[bytes] | None:
        """This rank's part of a step's decision and the first slice of its wait
        (:meth:`_vote`), one request whatever the job's size (:func:`arrive_step`): it
        proposes the order it holds (the first proposal is the decision: compare-and-set),
        then counts itself in; the last rank in closes the decision with "no order" where
        nobody proposed one. A store that stopped answering (its coordinator died) is waited
        out and the part done again on the restarted one."""
        own, stale = self._agreeing
        while True:
            proposal = b"" if self._pending is None else ENCODER.encode(self._pending)
            try:
                return self._vote(own, b"-", stale, [decided],
                                  arrive=(decided, arrived, world, proposal))
            except StoreUnreachable as err:
                self._await_restart(err)
                self._rejoined = False

    def _agree_slice(self, own: str, mine: bytes, stale: str, keys: list[str]
                     ) -> list[bytes] | None:
        """One slice of the step's agreement; a store that stopped answering (its
        coordinator died) is waited out in :meth:`_await_restart` and the slice is None."""
        try:
            return self._vote(own, mine, stale, keys)
        except StoreUnreachable as err:
            self._await_restart(err)
            return None

    def _vote(self, own: str, mine: bytes, stale: str, keys: list[str], *,
              arrive: tuple[str, str, int, bytes] | None = None) -> list[bytes] | None:
        """Every rank's vote of ``keys`` (this rank's ``mine`` under ``own``), or None after
        a slice, or at once when the coordinator posts an order naming devices of this
        layout as lost (it is then in ``_pending``): a dead peer never votes, and the
        survivors learn of the loss without waiting out the slice. ``arrive`` (decided,
        arrived, world, proposal): this rank arrives at the decision in the same request
        (:func:`arrive_step`; ``mine`` is then "-")."""
        proc = self._proc()
        wake = GenerationKeys(proc.job, self.generation).lost
        slice_s = agree_slice_s(self.layout.config.world if self.layout is not None else 1)
        if arrive is not None:
            got = arrive_step(proc.store, *arrive, own, stale, slice_s, wake=wake,
                              seen=self._woken_by)
        else:
            got = agree_step(proc.store, own, mine, stale, keys, slice_s, wake=wake,
                             seen=self._woken_by)
        if isinstance(got, Woken):
            self._woken_by = got.value
            self._consider(ORDER_DECODER.decode(got.value))
            return None
        return got

    def _await_restart(self, err: StoreUnreachable) -> None:
        """The rendezvous store stopped answering at a step boundary: its coordinator died
        (SIGKILL, a crash). Train no step (none could be agreed on or recorded) and say
        Hello every REJOIN_S until a coordinator restarted on the job's record answers
        (it binds the address this worker's channel connects to); then point the store at
        the one it hosts and forget the orders of the coordinator before (a restart aborts
        every resize not begun: the record says so; what it orders meanwhile is kept).
        Past the reattach wait of silence, or told to stop, CoordinatorLost (the worker
        exits)."""
        proc = self._proc()
        rejoin = getattr(proc.control, "rejoin", None)
        if rejoin is None:
            raise err
        t0 = time.monotonic()
        # the orders of the coordinator before: a restart aborts every resize not begun
        if isinstance(self._pending, Resize):
            self._aborted.add(self._pending.generation)
        self._pending = None
        self._log("the rendezvous store stopped answering at step %d: holding for a "
                  "restarted coordinator (exiting after %.0f s of silence)", self.step,
                  proc.reattach_wait_s or 0.0)
        next_hello = 0.0
        while True:
            if time.monotonic() >= next_hello:
                rejoin(self.step, self.generation)
                next_hello = time.monotonic() + REJOIN_S
            time.sleep(0.05)
            self._take_orders()  # CoordinatorLost past the reattach wait
            if isinstance(self._pending, Stop):
                raise CoordinatorLost(f"the restarted coordinator does not take this process "
                                      f"up ({self._pending.reason}): exiting at step "
                                      f"{self.step}")
            welcome = getattr(proc.control, "rendezvous", None)
            if welcome is not None:
                break
        repoint = getattr(proc.store, "repoint", None)
        if repoint is not None:
            repoint(welcome.store_host, welcome.store_port)
        if self._published:  # what the new ranks of the last resize read after its commit
            proc.store.multi_set(list(self._published), list(self._published.values()))
        self._rejoined = True
        if self._model_said is not None:  # what the restarted coordinator may plan with
            proc.control.report(ModelBuilt(proc.job, self.generation, proc.vrank,
                                           self._model_said, self._provider_takes_vp_stage()))
        self._log("reattached to the coordinator at step %d after %.1f s; training on",
                  self.step, time.monotonic() - t0)

    def _names_the_dead(self, order: Order | None) -> bool:
        """A resize away from this layout that names some of its devices as lost."""
        return (isinstance(order, Resize) and bool(order.lost) and self.layout is not None
                and order.old.layout() == self.layout)

    # -- resize ---------------------------------------------------------------------------

    def _resize(self, order: Resize) -> str:
        """Move to ``order.new``; "left" if this process is not part of it, else "stay"."""
        from slurm_etc.megatron.resize import prepare_resize
        from slurm_etc.migrate.executor import MigrationOptions

        proc = self._proc()
        if self._preparing is not None:  # a newer order (one naming the dead) supersedes it
            self._drop_preparation()
        old, new = order.old.layout(), order.new.layout()
        gen = order.generation
        self._lost = frozenset(order.lost)
        keys = GenerationKeys(proc.job, gen)
        if self.layout is not None and old != self.layout:
            return self._refuse(order, f"order's old layout {old.config} on {old.devices} is "
                                       f"not the current {self.layout.config}")
        try:
            self._check_layout(new.config)
            plan = self._plan(order, keys, old, new)
        except StateLostError as err:
            rebuilt = self._rebuild_lost(order, keys, old, new, err)
            if isinstance(rebuilt, str):
                return rebuilt
            plan = rebuilt
        except ConfigError as err:
            return self._refuse(order, str(err))
        t0 = time.perf_counter()
        began = time.time()
        options = MigrationOptions(timeout_s=proc.timeout_s)
        if self._prepares_while_training(order):
            self._start_preparation(order, plan, options)
            return "stay"
        # The new layout's world (its groups, and the user's model, DDP and optimizer built
        # empty) is prepared first and the migration writes straight into it, the old state
        # that stays on this process moved in already (megatron/placement.py); the pause
        # then holds the data phase and the switch (see megatron/resize.py). Here (a
        # joiner, a loss without notice, a committed layout held) it is prepared where the
        # order was agreed; a process of a live old layout prepares while it trains.
        catalog = self.catalog  # _build sets the new one; an abort puts this back
        build_new = ((lambda cfg: self._build(cfg, empty=True))
                     if proc.vrank in new.devices else None)
        try:
            prepared = prepare_resize(plan, proc.vrank, proc.store, tag=keys.prefix,
                                      options=options, group_timeout_s=proc.timeout_s, world=True,
                                      build_new=build_new, state=self.state)
        except BaseException:
            self.catalog = catalog
            raise
        return self._pause(order, plan, prepared, catalog, t0, began)

    def _pause(self, order: Resize, plan: MigrationPlan, prepared: PreparedResize,
               catalog: Catalog | None,
               t0: float, began: float) -> str:
        """The resize's pause on this process, its preparation done: the data phase, the
        commit vote, the switch; "left" if this process is not in the new layout."""
        from slurm_etc.megatron.resize import resize_in_place
        from slurm_etc.migrate.executor import MigrationAborted
        from slurm_etc.migrate.transport import TransportError

        proc = self._proc()
        old, new = order.old.layout(), order.new.layout()
        gen = order.generation
        keys = GenerationKeys(proc.job, gen)
        t_publish = time.perf_counter()
        self._published = self._publish_extras(keys, old)
        published_s = time.perf_counter() - t_publish

        faults = self._kill.injector(plan, proc.vrank, gen) if self._kill else None
        early = _EarlyReport()
        held, self._held = self._held, None
        try:
            out = resize_in_place(prepared, self.state, faults=faults, held=held,
                                  install_wait=lambda waited: self._install_wait(
                                      order, new, waited, early),
                                  store_lost=self._await_restart)
        except (MigrationAborted, TransportError) as err:
            # TransportError: a peer died in the step and RNG exchange before the data phase
            # (soak seed 203: a preempted node's workers killed in the pause): nothing
            # moved, nothing voted, the old state is whole
            self.catalog = catalog
            self._aborted.add(gen)
            self._attempt += 1
            self._held = held
            self._log("resize to generation %d aborted, old layout kept: %s", gen,
                      str(err)[:300])
            self._record(order, ProcessOutcome.ABORTED, 0, 0.0, 0.0, str(err))
            return "stay"
        except InstallInterrupted as err:
            self._hold(err, order, old, new, plan)
            return "stay"
        except StoreUnreachable as err:  # at the vote's decision or after it
            raise CommitUnknown(f"the coordinator died while the resize to generation {gen} "
                                f"decided its commit ({err}): this process cannot know the "
                                "decision and exits; the restarted coordinator resizes "
                                "around it") from err
        pause = out.seconds["ready"] - began
        self.state = out.state
        self.generation, self._attempt = gen, 0
        if out.state is None:
            self.layout = None
            self._record(order, ProcessOutcome.LEFT, plan.moved_bytes, pause,
                         out.stats.get("data_seconds", 0.0), "", out.stats)
            return "left"
        self.layout = new
        t_adopt = time.perf_counter()
        self._adopt_extras(keys, old, new, plan)
        adopted_s = time.perf_counter() - t_adopt
        if not early.sent:
            self._record(order, ProcessOutcome.COMMITTED, plan.moved_bytes, pause,
                         out.stats.get("data_seconds", 0.0), "", out.stats)
        if gen in self._expected_fp:  # committed (nothing else holds the state): checked
            self._check_rebuilt(keys, new, self._expected_fp.pop(gen))
        parts = ", ".join(f"{k} {out.seconds[k]:.3f}" for k in PAUSE_PARTS if k in out.seconds)
        ready = ", ".join(f"{k} {v:.3f}" for k, v in prepared.seconds.items())
        self._log("resized %s -> %s: moved %.1f MiB (lower bound %.1f MiB), pause %.3f s, "
                  "total %.3f s (trainer state published %.3f, %s, data %.3f, trainer state "
                  "adopted %.3f; prepared: %s)", old.config, new.config,
                  plan.moved_bytes / 2**20, plan.lower_bound_moved_bytes / 2**20, pause,
                  time.perf_counter() - t0, published_s, parts,
                  out.stats.get("data_seconds", 0.0), adopted_s, ready)
        return "stay"

    def _prepares_while_training(self, order: Resize) -> bool:
        """Whether this process prepares the resize while its old layout trains on: the
        order asks for it, this process is in a live old layout (not a joiner), nobody is
        lost (the old layout cannot train without them), and no committed layout is
        held."""
        proc = self._proc()
        return (order.prepare_while_training and self.layout is not None
                and self.state is not None and not order.lost and self._held is None
                and proc.vrank in order.old.devices)

    def _start_preparation(self, order: Resize, plan: MigrationPlan,
                           options: MigrationOptions) -> None:
        """Start preparing the resize beside training: the migration group, the program
        and the staging buffers in a thread (collectives on the migration group's own gloo
        backends only: none on a group the training thread uses); the new world is built
        at a later step boundary (:meth:`_advance_preparation`)."""
        import threading

        from slurm_etc.megatron.resize import prepare_transfer

        proc = self._proc()
        prep = _Preparation(order, plan, time.perf_counter())
        self._stalled = 0.0  # this resize's, not an aborted one's before it

        def transfer() -> None:
            try:
                tag = GenerationKeys(proc.job, order.generation).prefix
                prep.prepared = prepare_transfer(plan, proc.vrank, proc.store, tag=tag,
                                                 options=options,
                                                 group_timeout_s=proc.timeout_s)
            except BaseException as err:  # reported at the next step boundary
                prep.error = err
        prep.thread = threading.Thread(target=transfer, name="slurm-etc-prepare",
                                       daemon=True)
        prep.thread.start()
        self._preparing = prep
        # the old layout agrees again at this step: not on the keys that carried the order
        self._attempt += 1
        self._log("preparing the resize to generation %d while training", order.generation)

    def _advance_preparation(self, last: bool) -> str:
        """At a step boundary with a resize being prepared: every rank of the old layout
        says whether its transfer preparation is done (the store; one round trip). Once all
        are, the new world is built (the new layout's ranks: groups, model, DDP, optimizer,
        staying state moved in) and the old layout trains one more step; at the boundary
        after it, the pause. ``last``: no step is left to train, so each stage runs at once.
        Returns "left" when this process left the job in the pause, else "stay"."""
        prep, proc, layout = self._preparing, self._proc(), self.layout
        if prep is None or layout is None:
            raise RuntimeError("no resize is being prepared in a live layout")
        if prep.stage == "world":
            return self._finish_preparation(prep)
        if prep.stage == "groups":
            self._build_new_world(prep)
            return self._finish_preparation(prep) if last else "stay"
        if last and prep.thread is not None:
            prep.thread.join(proc.timeout_s)
        done = prep.thread is not None and not prep.thread.is_alive()
        mine = b"E" if prep.error is not None else b"1" if done else b"0"
        rank = layout.devices.index(proc.vrank)
        names = GenerationKeys(proc.job, prep.order.generation)
        keys = [names.prepared(self.step, prep.polls, r) for r in range(layout.config.world)]
        prep.polls += 1
        deadline = time.monotonic() + proc.timeout_s
        while (values := self._vote(keys[rank], mine, "", keys)) is None:
            self._take_orders()
            if self._names_the_dead(self._pending) or time.monotonic() > deadline:
                self._drop_preparation()
                raise RuntimeError(f"ranks of {layout.config} did not say whether the resize "
                                   "was prepared")
        if b"E" in values:
            why = str(prep.error) if prep.error is not None else "a peer failed to prepare"
            self._drop_preparation()
            self._aborted.add(prep.order.generation)
            self._attempt += 1
            self._log("resize to generation %d aborted while preparing: %s",
                      prep.order.generation, why[:300])
            self._record(prep.order, ProcessOutcome.ABORTED, 0, 0.0, 0.0, why)
            return "stay"
        if b"0" in values:
            return "stay"
        prep.prepared_s = time.perf_counter() - prep.started
        self._start_new_world(prep)
        if last:
            self._build_new_world(prep)
            return self._finish_preparation(prep)
        return "stay"

    def _start_new_world(self, prep: _Preparation) -> None:
        """The new world's groups beside the live ones, at a step boundary (it swaps torch's
        default group and megatron's globals: not in a thread); its model, DDP and
        optimizer come at the next boundary (:meth:`_build_new_world`), so that training
        stops for each half, not for the whole. Every rank of the old layout takes the
        stages at the same steps; a leaving one has nothing to build."""
        from slurm_etc.megatron.resize import start_new_world

        prep.stage = "groups"
        if self._proc().vrank not in prep.order.new.devices:
            return
        t, wall = time.perf_counter(), time.time()
        assert prep.prepared is not None  # the transfer's preparation came first
        try:
            start_new_world(prep.prepared)
        except BaseException:
            self._preparing = None  # its migration group is destroyed
            raise
        took = time.perf_counter() - t
        prep.world_s += took
        assert prep.prepared.world is not None
        parts = prep.prepared.world.seconds
        self._log("built the new world of generation %d at a step boundary: %.3f s (training "
                  "stopped; unix %.3f to %.3f): part 1 of 2: group %.3f, megatron's groups "
                  "%.3f", prep.order.generation, took, wall, wall + took,
                  parts.get("group", 0.0), parts.get("megatron_groups", 0.0))

    def _build_new_world(self, prep: _Preparation) -> None:
        """The new world's model, DDP and optimizer, at the step boundary after its groups
        (:meth:`_start_new_world`), and the staying state moved in. The old layout trains
        on in it afterwards (its staying tensors now live in the new memory)."""
        from slurm_etc.megatron.resize import finish_new_world

        proc = self._proc()
        prep.stage = "world"
        if proc.vrank not in prep.order.new.devices:
            return
        t, wall = time.perf_counter(), time.time()
        catalog = self.catalog  # _build sets the new one: the old layout trains on with this
        assert prep.prepared is not None  # the transfer's preparation came first
        try:
            finish_new_world(prep.prepared, build_new=lambda cfg: self._build(cfg, empty=True),
                             state=self.state)
        except BaseException:
            self._preparing = None  # its migration group is destroyed
            raise
        finally:
            prep.new_catalog, self.catalog = self.catalog, catalog
        took = time.perf_counter() - t
        prep.world_s += took
        # training stops for each half: the widest gap is reported as the resize's stall
        parts = prep.prepared.seconds
        self._log("built the new world of generation %d at a step boundary: %.3f s (training "
                  "stopped; unix %.3f to %.3f): part 2 of 2: model + DDP + optimizer %.3f, "
                  "staying state placed %.3f", prep.order.generation, took, wall,
                  wall + took, parts.get("world_build", 0.0), parts.get("place", 0.0))

    def _finish_preparation(self, prep: _Preparation) -> str:
        """The pause of a resize prepared while training."""
        self._preparing = None
        catalog = self.catalog
        if prep.new_catalog is not None:
            self.catalog = prep.new_catalog
        during = [t for t, p in self.step_times if p]
        before = [t for t, p in self.step_times if not p]
        self._log("resize to generation %d prepared while training: transfer %.3f s, new "
                  "world %.3f s; %d step(s) trained meanwhile, %.3f s each against %.3f s "
                  "before", prep.order.generation, prep.prepared_s, prep.world_s, len(during),
                  sum(during) / max(1, len(during)), sum(before) / max(1, len(before)))
        self.step_times.clear()
        assert prep.prepared is not None  # finished: its transfer was prepared
        return self._pause(prep.order, prep.plan, prep.prepared, catalog,
                           time.perf_counter(), time.time())

    def _drop_preparation(self) -> None:
        """Give up the resize being prepared (its transfer's group, its new world)."""
        from slurm_etc.megatron.placement import give_back

        prep, self._preparing = self._preparing, None
        if prep is None:
            return
        if prep.thread is not None:
            # a rendezvous wait of the preparation (a dead peer's key never comes) ends
            # within a slice, not at the worker timeout
            store = self._proc().store
            interruptible = hasattr(store, "interrupt")
            if interruptible:
                before = store.interrupt
                store.interrupt = lambda: (f"the resize to generation "
                                           f"{prep.order.generation} is given up")
            try:
                prep.thread.join(self._proc().timeout_s)
            finally:
                if interruptible:
                    store.interrupt = before
        prepared = prep.prepared
        if prepared is None:
            return
        if prepared.placed is not None:
            give_back(prepared.placed)
        if prepared.world is not None:
            prepared.world.drop()
        prepared.group.destroy()

    def _install_wait(self, order: Resize, new: Layout, waited: float,
                      early: "_EarlyReport") -> bool:
        """Committed, waiting for the other new ranks to install: report the commit if the
        wait is long (the coordinator settles it), and give up when an order names one of
        the new layout's devices as dead."""
        if waited > EARLY_COMMIT_REPORT_S and not early.sent:
            early.sent = True
            self._record(order, ProcessOutcome.COMMITTED, 0, 0.0, 0.0, "")
        self._take_orders()
        p = self._pending
        return isinstance(p, Resize) and bool(p.lost) and p.old.layout() == new

    def _hold(self, err: InstallInterrupted, order: Resize, old: Layout, new: Layout,
              plan: MigrationPlan) -> None:
        """The migration committed but a new rank died before installing: keep this rank's
        committed shards for the resize that names the dead (no training meanwhile)."""
        proc = self._proc()
        keys = GenerationKeys(proc.job, order.generation)
        self._log("resize to generation %d committed, not installed: %s", order.generation,
                  err)
        trainer = decode_value(proc.store.get(keys.trainer))
        src = _rng_source(old, new, new.devices.index(proc.vrank), plan, self._lost)
        rng = decode_value(proc.store.get(keys.rng(src)))
        self._held = (err.shards, err.resume)
        self._held_extras = (trainer, rng)
        self.state = None  # its training groups are gone since the commit
        self.layout, self.generation, self._attempt = new, order.generation, 0
        self.catalog = build_catalog(plan.catalog.model, new.config)

    def _plan(self, order: Resize, keys: GenerationKeys, old: Layout,
              new: Layout) -> MigrationPlan:
        catalog = self._catalog_for(keys, old)
        proc = self._proc()
        topology = (dataclasses.replace(proc.topology, gpus_per_node=order.gpus_per_node)
                    if order.gpus_per_node else proc.topology)
        plan = _plan(catalog, old, new.config, tuple(sorted(order.pool or new.devices)),
                     topology, proc.keep_tp_in_node, tuple(sorted(order.lost)))
        if tuple(plan.new.devices) != tuple(new.devices):
            raise ConfigError(f"the plan places the new ranks on {list(plan.new.devices)}, the "
                              f"order on {list(new.devices)} (planner versions differ?)")
        if order.plan_digest and order.plan_digest != plan_digest(plan):
            raise ConfigError("this worker's plan differs from the coordinator's "
                              f"({plan_digest(plan)[:12]} != {order.plan_digest[:12]})")
        return plan

    def _catalog_for(self, keys: GenerationKeys, old: Layout) -> Catalog:
        """The live model's catalog. Old rank 0 publishes its ModelDesc under the resize's
        keys; a joining process, which has built nothing yet, plans from it (and checks it
        against its own model once built)."""
        proc = self._proc()
        if self.catalog is not None:
            if proc.vrank == self._publisher(old):
                proc.store.set(keys.model, json.dumps(self.catalog.model.to_json()))
            return self.catalog
        desc = ModelDesc.from_json(json.loads(proc.store.get(keys.model)), self.name)
        return build_catalog(desc, old.config)

    def _publisher(self, old: Layout) -> int:
        """The old vrank that publishes what every old rank holds alike: the lowest
        surviving one."""
        return next(v for v in old.devices if v not in self._lost)

    def _refuse(self, order: Resize, why: str) -> str:
        """Every rank computes the same refusal: nothing moves, the old layout trains on."""
        self._log("resize to generation %d refused: %s", order.generation, why)
        self._attempt += 1
        self._record(order, ProcessOutcome.ABORTED, 0, 0.0, 0.0, why)
        if self.layout is None:
            raise ConfigError(why)
        return "stay"

    def _publish_extras(self, keys: GenerationKeys, old: Layout) -> dict[str, bytes]:
        """Old ranks: trainer state (rank 0) and per-rank RNG extras into the store;
        returns what was set (key -> value)."""
        proc = self._proc()
        if self.layout is None or proc.vrank not in old.devices:
            return {}
        rank = old.devices.index(proc.vrank)
        trainer, rng = (self._held_extras if self._held is not None
                        else (self._trainer_state(), _rng_extras()))
        out: dict[str, bytes] = {}
        if proc.vrank == self._publisher(old):
            out[keys.trainer] = encode_value(trainer)
            if self._ended_in is not None:  # where the joiners' training gap begins
                out[keys.last_ended] = repr(self._ended_in[1]).encode()
        out[keys.rng(rank)] = encode_value(rng)
        for key, value in out.items():
            proc.store.set(key, value)
        return out

    def _trainer_state(self) -> dict:
        state, _cfg = self._live()
        return {"step": self.step, "consumed_samples": self.consumed_samples,
                # an "auto" choice, made once: joiners and later layouts keep it
                "peer_copy_every": self.peer_copy_every,
                "checkpoint_every": self.checkpoint_every,
                "scheduler": self.scheduler.state_dict(),
                "grad_scalers": [getattr(sub, "grad_scaler", None) and
                                 sub.grad_scaler.state_dict()
                                 for sub in sub_optimizers(state.optimizer)]}

    def _adopt_extras(self, keys: GenerationKeys, old: Layout, new: Layout,
                      plan: MigrationPlan) -> None:
        """The trainer state and RNG extras the old ranks published, once committed; a
        store that stopped answering (its coordinator died) is waited out, and the old
        ranks publish them again on the restarted one (:meth:`_await_restart`)."""
        proc = self._proc()
        src = _rng_source(old, new, new.devices.index(proc.vrank), plan, self._lost)
        while True:
            try:
                trainer = decode_value(proc.store.get(keys.trainer))
                rng = decode_value(proc.store.get(keys.rng(src)))
                break
            except StoreUnreachable as err:
                self._await_restart(err)
        self._restore_trainer_state(trainer)
        _set_rng_extras(rng)
        self._held_extras = ({}, {})

    def _restore_trainer_state(self, saved: dict) -> None:
        chosen = saved.get("peer_copy_every", AUTO)
        if self.peer_copy_every == AUTO and chosen != AUTO:
            self.peer_copy_every = int(chosen)
            if not self.checkpoint_every and self.checkpoint_dir:
                self.checkpoint_every = int(saved.get("checkpoint_every", 0))
        self.step = saved["step"]
        self.consumed_samples = saved["consumed_samples"]
        state, _cfg = self._live()
        self.scheduler = self._make_scheduler(state.optimizer)
        self.scheduler.load_state_dict(saved["scheduler"])
        for sub, scaler in zip(sub_optimizers(state.optimizer), saved["grad_scalers"],
                               strict=False):
            if scaler is not None and getattr(sub, "grad_scaler", None) is not None:
                sub.grad_scaler.load_state_dict(scaler)

    def _record(self, order: Resize, outcome: ProcessOutcome, moved: int, pause: float, data: float,
                error: str, stats: dict | None = None) -> None:
        proc = self._proc()
        stats = stats or {}
        lost = (self._rollback[1:] if self._rollback and self._rollback[0] == order.generation
                else None)
        rebuilt = (self._rebuilt_from.get(order.generation, "")
                   if outcome != ProcessOutcome.ABORTED else "")
        self.resizes.append(ResizeRecord(order.generation, order.old.config, order.new.config,
                                         outcome, self.step, moved, pause, data, error, lost))
        proc.control.report(Resized(proc.job, order.generation, proc.vrank,
                                    outcome,
                                    self.step, pause, data, int(stats.get("sent_bytes", 0)),
                                    int(stats.get("received_bytes", 0)), error, lost,
                                    rebuilt))  # type: ignore[arg-type]

    # -- node lost without grace: peer copies, periodic checkpoints, rebuilding ------------

    def _after_step(self) -> None:
        """After a step: refresh the peer copies and write the periodic checkpoint when due
        (both collective over the layout)."""
        if self.peer_copy_every == AUTO:
            self._choose_peer_copies()
        peers = self._peer_copies() if self.peer_copy_every else None
        if peers is not None:
            peers.prune(self.step)
            if self.peer_copy_every > 0 and peers.due(self.step):
                self._refresh(peers)
            for err in peers.join_stand_ins(0.0):
                self._log("a stand-in of the last resize failed: %s", err)
        if self.checkpoint_every and self.step % self.checkpoint_every == 0:
            self._save_periodic()

    def _refresh(self, peers: PeerCopies) -> None:
        from slurm_etc.megatron.state import local_shards

        state, _cfg = self._live()
        peers.refresh(self.step, local_shards(state, self._catalog()), self._snapshot_meta())

    def _choose_peer_copies(self) -> None:
        """Peer copies every "auto" steps: in the first layout on two nodes or more, take a
        copy at once (its buffers allocated, one more of each reserved), time the next
        ``AUTO_TIMED_STEPS`` steps, then a second copy (on the reserved buffers: timed as
        it costs once running); every rank agrees on the slowest rank's figures (one
        all-reduce) and chooses the interval
        (:func:`~slurm_etc.protocol.recovery.peer_copy_interval`): every rank the same,
        carried to later layouts and joiners in the trainer state. Where the copies do not
        fit host memory they are dropped; with a checkpoint directory and no
        ``checkpoint_every``, one checkpoint is timed and the same rule chooses its
        interval. Rank 0 says the choice once (to the coordinator: its log and the record)."""
        peers = self._peer_copies()
        if peers is None:  # one node: no copy would outlive it; choose in a wider layout
            return
        peers.prune(self.step)
        got = self._choosing
        if got is None or got[0] != self.generation:
            self._refresh(peers)
            peers.reserve()
            self._choosing = (self.generation, 0.0, peers.own[self.step].nbytes, self.step)
            return
        _gen, _s, copy_bytes, taken = got
        timed = [h.ended - h.started for h in self.history
                 if h.step > taken and h.generation == self.generation and h.ended]
        if len(timed) < AUTO_TIMED_STEPS:
            return
        t0 = time.perf_counter()
        self._refresh(peers)
        copy_s = time.perf_counter() - t0
        layout, proc = self.layout, self._proc()
        if layout is None:
            return
        node = proc.topology.node(proc.vrank)
        here = sum(1 for d in layout.devices if proc.topology.node(d) == node)
        host = (host_memory_available() + peers.host_bytes()) // max(here, 1)
        figures = torch.tensor([copy_s, sorted(timed)[len(timed) // 2], float(copy_bytes),
                                -float(host)], dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the slowest, the least memory
        copy_s, step_s, nbytes, neg_host = figures.tolist()
        choice = peer_copy_interval(copy_s, step_s, int(nbytes), int(-neg_host))
        self.copy_interval = choice
        self.peer_copy_every = choice.every
        line = choice.line
        if choice.fits:
            peers.every = choice.every
        else:
            self.peers = None  # the copies do not fit: none kept
            if self.checkpoint_dir and not self.checkpoint_every:
                t0 = time.perf_counter()
                self._save_periodic()
                save = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(save, op=dist.ReduceOp.MAX)
                ck = peer_copy_interval(float(save[0]), step_s, 0, 0)
                self.checkpoint_every = ck.every
                line += (f"; a checkpoint every {ck.every} steps instead (one takes "
                         f"{float(save[0]):.2f} s)")
            else:
                line += ("; no checkpoint directory (--checkpoint-dir): a node lost where no "
                         "replica holds its state ends the job")
        if layout.devices.index(proc.vrank) == 0:  # the coordinator says it (once)
            logger.debug("[job %s gen %d vrank %d] %s", proc.job, self.generation, proc.vrank,
                         line)
            proc.control.report(CopiesChosen(
                proc.job, self.generation, proc.vrank, choice.every, self.checkpoint_every,
                copy_s, step_s, choice.held_bytes, choice.host_bytes, line[:400]))

    @property
    def recovery(self) -> Recovery:
        """What a node lost without grace is rebuilt from (peer copies, checkpoints)."""
        return Recovery(self.peer_copy_every, self.checkpoint_every, self.checkpoint_dir,
                        self.keep_checkpoints, self.resume_from)

    @recovery.setter
    def recovery(self, value: Recovery) -> None:
        self.peer_copy_every = value.peer_copy_every
        self.checkpoint_every, self.checkpoint_dir = value.checkpoint_every, value.checkpoint_dir
        self.keep_checkpoints, self.resume_from = value.keep_checkpoints, value.resume_from

    def _peer_copies(self) -> PeerCopies | None:
        """This layout's PeerCopies (a new layout starts with none: a resize drops them);
        None when the layout is on one node (no copy would outlive it)."""
        from slurm_etc.plan.lost import peer_buddies

        layout, proc = self.layout, self._proc()
        if layout is None:
            raise RuntimeError("peer copies without a layout")
        if len({proc.topology.node(d) for d in layout.devices}) < 2:
            self.peers = None
            return None
        rank = layout.devices.index(proc.vrank)
        if self.peers is None or self.peers.rank != rank or self._peers_gen != self.generation:
            buddies = peer_buddies(layout.devices, proc.topology.gpus_per_node)
            self.peers = PeerCopies(max(self.peer_copy_every, 1), rank, buddies[rank],
                                    tuple(r for r, b in enumerate(buddies) if b == rank),
                                    stale_copies=self.hooks.stale_peer_copies,
                                    corrupt_copies=self.hooks.corrupt_peer_copies)
            self._peers_gen = self.generation
        return self.peers

    def _catalog(self) -> Catalog:
        if self.catalog is None:
            raise RuntimeError("this process has built no model")
        return self.catalog

    def _snapshot_meta(self) -> dict:
        from slurm_etc.megatron.state import optimizer_step

        state, _cfg = self._live()
        return {"adam_step": optimizer_step(state),
                "rng": bytes(torch.get_rng_state().numpy().tobytes()),
                "extras": _rng_extras(), "trainer": self._trainer_state()}

    def _save_periodic(self) -> None:
        """megatron-core checkpoint of this step into ``checkpoint_dir/step-N``.

        Written as ``step-N.partial`` and renamed by rank 0 once every rank wrote its part
        and it is synced, so a ``step-N`` is always complete; only then are the complete
        ones older than the newest ``keep_checkpoints`` deleted (the newest never). A step
        below the newest complete checkpoint is not written: a job resumed from it (or
        replaying steps after a rollback) never puts an older step beside a newer one."""
        import shutil

        root = str(self.checkpoint_dir)
        newest = newest_checkpoint(root)  # every rank reads the same: nothing is renamed now
        if newest is not None and newest > self.step:
            self._log("step %d: no checkpoint (the directory has the newer step %d)",
                      self.step, newest)
            return
        final = os.path.join(root, f"step-{self.step}")
        partial = final + ".partial"
        rank = dist.get_rank()
        if rank == 0:  # a save that died half-way left its files behind
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier()
        self.save_checkpoint(partial)  # ends with a barrier: every rank wrote its part
        if rank == 0:
            old = final + ".old"
            if os.path.isdir(final):  # the same step again (replayed after a rollback)
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(partial, final)
            _fsync_dir(root)
            shutil.rmtree(old, ignore_errors=True)
            tmp = os.path.join(root, "latest.tmp")
            with open(tmp, "w") as f:
                f.write(str(self.step))
            os.replace(tmp, os.path.join(root, "latest"))
            for step in checkpoints_to_delete(checkpoint_steps(root), self.keep_checkpoints):
                shutil.rmtree(os.path.join(root, f"step-{step}"), ignore_errors=True)
        # nobody reads the directory before this rank renamed it
        dist.barrier()

    def _latest_checkpoint(self) -> int | None:
        """The newest complete periodic checkpoint's step (None: none, or they are off)."""
        if not self.checkpoint_every:
            return None
        return newest_checkpoint(str(self.checkpoint_dir))

    def _rebuild_lost(self, order: Resize, keys: GenerationKeys, old: Layout, new: Layout,
                      err: StateLostError) -> MigrationPlan | str:
        """No survivor replicates what the lost devices held. Survivors agree on what they
        can roll back to: peer copies (returns the plan, every survivor rolled back, stand-ins
        started) or the last periodic checkpoint (loaded here: returns "stay" / "left").
        Refused (every rank alike: the coordinator stops the job with the reason) when
        neither is enabled or neither exists."""
        from slurm_etc.plan.lost import rollback_step

        if not (self.peer_copy_every or self.checkpoint_every):
            return self._refuse(order, str(err))  # nothing to rebuild from
        lost = set(order.lost)
        lost_ranks = [r for r, d in enumerate(old.devices) if d in lost]
        held = self._holdings(keys, old, lost)
        own = {r: h["own"] for r, h in held.items()}
        copies = {r: h["copies"] for r, h in held.items()}
        last = max(h["step"] for h in held.values())
        back = rollback_step(lost_ranks, own, copies) if self.peer_copy_every else None
        if back is not None:
            self._expected_fp[order.generation] = _expected_fingerprint(held, lost_ranks, back)
            return self._roll_back_to_copies(order, keys, old, new, back, last, lost_ranks,
                                             copies)
        ckpts = [h["checkpoint"] for h in held.values()]
        if any(c is None for c in ckpts):
            return self._refuse(order, f"no peer copy of the lost ranks {lost_ranks} (none "
                                       "refreshed in this layout, or their holders lost too) "
                                       f"and no periodic checkpoint: {err}")
        return self._load_lost_from_checkpoint(order, old, new, min(ckpts), last)

    def _holdings(self, keys: GenerationKeys, old: Layout, lost: set[int]) -> dict[int, dict]:
        """Every survivor's step, snapshots, peer copies and last checkpoint (the store)."""
        proc = self._proc()
        peers = self.peers if self.peers and self._peers_gen == self.generation else None
        mine = {"step": self.step, "checkpoint": self._latest_checkpoint(),
                **(peers.holdings() if peers else {"own": [], "copies": {}}),
                "fp": peers.fingerprints() if peers else {"own": {}, "copies": {}}}
        proc.store.set(keys.holdings(proc.vrank), encode_value(mine))
        survivors = [(r, d) for r, d in enumerate(old.devices) if d not in lost]
        theirs = [keys.holdings(d) for _r, d in survivors]
        if not wait_for_keys(proc.store, theirs, proc.timeout_s):
            raise RuntimeError(f"survivors of {old.config} did not publish what they hold "
                               f"within {proc.timeout_s:.0f} s")
        return {r: decode_value(v) for (r, _d), v in zip(
            survivors, proc.store.multi_get(theirs), strict=True)}

    def _roll_back_to_copies(self, order: Resize, keys: GenerationKeys, old: Layout, new: Layout,
                             back: int, last: int, lost_ranks: list[int],
                             copies: dict[int, dict]) -> MigrationPlan:
        """Restore this rank's snapshot of step ``back`` (state, RNG, data position), plan
        the resize as if the lost ranks were there, and start a stand-in for each lost rank
        whose copy this rank keeps (the lowest surviving holder stands in)."""
        from slurm_etc.megatron.state import local_shards, set_optimizer_step
        from slurm_etc.migrate.executor import MigrationOptions

        proc = self._proc()
        peers = self.peers
        survivor = self.state is not None  # a joiner of this resize holds nothing
        if survivor and peers is None:
            raise RuntimeError("rolling back to peer copies this rank does not have")
        if survivor and peers is not None:
            state, _cfg = self._live()
            meta = peers.restore(local_shards(state, self._catalog()), back)
            set_optimizer_step(state, meta["adam_step"])
            torch.set_rng_state(torch.frombuffer(bytearray(meta["rng"]), dtype=torch.uint8))
            _set_rng_extras(meta["extras"])
            self._restore_trainer_state(meta["trainer"])
        self._rebuilt_from[order.generation] = "peer-copies"
        self._forget_steps_after(back, order.generation, last)
        self._lost = frozenset()
        topology = (dataclasses.replace(proc.topology, gpus_per_node=order.gpus_per_node)
                    if order.gpus_per_node else proc.topology)
        pool = tuple(d for d in sorted(order.pool or new.devices) if d not in set(order.lost))
        catalog = self._catalog_for(keys, old)
        plan = _plan(catalog, old, new.config, pool, topology, proc.keep_tp_in_node, ())
        if tuple(plan.new.devices) != tuple(new.devices):
            raise ConfigError(f"rebuilt from peer copies, the plan places the new ranks on "
                              f"{list(plan.new.devices)}, the order on {list(new.devices)}")
        if order.plan_digest and order.plan_digest != plan_digest(plan):
            raise ConfigError("rebuilt from peer copies, this worker's plan differs from the "
                              f"coordinator's ({plan_digest(plan)[:12]} != "
                              f"{order.plan_digest[:12]})")
        if not survivor or peers is None:
            return plan
        me = old.devices.index(proc.vrank)
        for ward in lost_ranks:
            holders = sorted(r for r, c in copies.items() if back in c.get(ward, ()))
            if holders and holders[0] == me:
                peers.start_stand_in(
                    ward, back, plan=plan, device=old.devices[ward], store=proc.store,
                    tag=keys.prefix, options=MigrationOptions(timeout_s=proc.timeout_s),
                    timeout_s=proc.timeout_s,
                    publish=lambda m, w=ward: self._publish_for(keys, old, w, m))
        return plan

    def _check_rebuilt(self, keys: GenerationKeys, new: Layout, expected: dict[str, int],
                       source: str = "peer copies") -> None:
        """Before the first step on a state rebuilt from peer copies: every new rank
        publishes its shards' fingerprints, every rank adds them up per state tensor and
        compares with what the copies were when taken (the same verdict everywhere). A
        mismatch stops this process with one line (RebuiltStateMismatch), never training."""
        from slurm_etc.megatron.state import local_shards

        proc = self._proc()
        state, _cfg = self._live()
        t0 = time.perf_counter()
        rank = new.devices.index(proc.vrank)
        proc.store.set(keys.fingerprint(rank),
                       encode_value(shards_fingerprint(local_shards(state, self._catalog()))))
        theirs = [keys.fingerprint(r) for r in range(len(new.devices))]
        if not wait_for_keys(proc.store, theirs, proc.timeout_s):
            raise RuntimeError(f"the ranks of {new.config} did not publish the fingerprint of "
                               f"their rebuilt state within {proc.timeout_s:.0f} s")
        got = fingerprint_totals(row for v in proc.store.multi_get(theirs)
                                 for row in decode_value(v))
        bad = fingerprint_mismatch(expected, got)
        if bad is not None:
            line = (f"the state rebuilt from {source} of step {self.step} does not match "
                    f"their fingerprint, not training on it: {bad}")
            self._log("%s", line)
            proc.control.report(Exited(proc.job, self.generation, proc.vrank, line[:1000],
                                       self.step))
            raise RebuiltStateMismatch(line)
        self._log("the state rebuilt from %s at step %d matches its fingerprint (%d state "
                  "tensors, checked in %.3f s)", source, self.step, len(expected),
                  time.perf_counter() - t0)

    def _publish_for(self, keys: GenerationKeys, old: Layout, ward: int, meta: dict) -> None:
        """What old rank ``ward`` would publish in a resize, from its peer copy."""
        proc = self._proc()
        if ward == 0:  # the publisher when no device counts as lost
            proc.store.set(keys.trainer, encode_value(meta["trainer"]))
            if self.catalog is not None:
                proc.store.set(keys.model, json.dumps(self.catalog.model.to_json()))
        proc.store.set(keys.rng(ward), encode_value(meta["extras"]))

    def _forget_steps_after(self, back: int, generation: int, last: int) -> None:
        """Steps after ``back`` are lost: out of the history, reported, replayed."""
        self.lost_history += [h for h in self.history if h.step > back]
        self.history = [h for h in self.history if h.step <= back]
        self._rollback = (generation, back + 1, last) if last > back else None
        if last > back:
            self._log("lost steps %d-%d, replaying from step %d", back + 1, last, back)
        else:
            self._log("no step lost: the copies are of step %d", back)

    def _load_lost_from_checkpoint(self, order: Resize, old: Layout, new: Layout, step: int,
                                   last: int) -> str:
        """Neither replicas nor peer copies: the new layout loads the last periodic
        checkpoint (every survivor leaves its old groups; the others exit)."""
        from slurm_etc.megatron.build import teardown_world

        proc = self._proc()
        t0 = time.time()
        self._rebuilt_from[order.generation] = "checkpoint"
        self._forget_steps_after(step, order.generation, last)
        self.state, self.peers, self._held = None, None, None
        teardown_world()
        # a new generation's agreements start at attempt 0 on every rank (a survivor that
        # counted an aborted resize meets joiners that counted none: soak seed 102)
        self.generation, self._attempt = order.generation, 0
        if proc.vrank not in new.devices:
            self.layout = None
            self._record(order, ProcessOutcome.LEFT, 0, 0.0, 0.0, "")
            return "left"
        self.layout = new
        self._start_group(GenerationKeys(proc.job, order.generation).train_group,
                          new.devices.index(proc.vrank), new.config.world)
        self.state = self._build(new.config, empty=True)
        where = os.path.join(str(self.checkpoint_dir), f"step-{step}")
        self._load_checkpoint(where)
        self._record(order, ProcessOutcome.COMMITTED, 0, time.time() - t0, 0.0,
                     f"restored from the checkpoint of step {step}")
        self._log("restored %s from the checkpoint of step %d", new.config, step)
        expected = checkpoint_fingerprint(where)
        if expected is not None:
            self._check_rebuilt(GenerationKeys(proc.job, order.generation), new, expected,
                                "the checkpoint")
        return "stay"

    # -- building -------------------------------------------------------------------------

    def _build(self, config: ParallelConfig, *, empty: bool) -> TrainingState:
        """Model, DDP, optimizer (and scheduler) of ``config`` from the user's providers.

        ``empty``: no initial weights drawn (a resize fills them)."""
        from megatron.core import parallel_state

        self._check_layout(config)
        if not parallel_state.model_parallel_is_initialized():
            initialize_parallel_state(config)
        if device.current().cuda:
            _seed_cuda_tracker(self.seed)
        # the interleaved schedule's micro-batch groups: megatron's default, pp (the value in
        # the template was derived from the template's pp; the chooser assumes pp too)
        tf = dataclasses.replace(
            self.tf_template, tensor_model_parallel_size=config.tp,
            pipeline_model_parallel_size=config.pp, expert_model_parallel_size=config.ep,
            virtual_pipeline_model_parallel_size=config.vpp if config.vpp > 1 else None,
            microbatch_group_size_per_vp_stage=config.pp,
            # batched p2p crosses the interleaved schedule's messages at pp = 2 on gloo
            batch_p2p_comm=batch_p2p_comm(config) and self.tf_template.batch_p2p_comm)
        if empty:
            tf = dataclasses.replace(tf, perform_initialization=False)
        with skip_tied_embedding_sync(empty):
            if config.vpp == 1:
                gpts = [self.model_provider(
                    tf, pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())]
            else:
                gpts = self._provide_chunks(tf, config)
        desc = model_desc_of(tf, gpts, self.name)
        catalog = build_catalog(desc, config)
        check_catalog(catalog, gpts)
        check_chunk_layers(gpts, config, parallel_state.get_pipeline_model_parallel_rank())
        self.catalog = catalog
        self._say_model(desc)
        opt_config = dataclasses.replace(self.optimizer_config,
                                         use_distributed_optimizer=config.distributed_optimizer,
                                         bf16=bool(tf.bf16), params_dtype=tf.params_dtype)
        if opt_config.min_lr is None:  # megatron's param groups read it: the schedule's
            opt_config = dataclasses.replace(opt_config, min_lr=self.scheduler_config.min_lr)
        state = wrap_for_training(desc, config, gpts, tf, opt_config)
        if not empty:
            self.scheduler = self._make_scheduler(state.optimizer)
        return state

    def _provide_chunks(self, tf: Any, config: ParallelConfig) -> list[Any]:
        """Megatron-LM's convention for vpp > 1: one provider call per chunk ``v``, with
        ``vp_stage=v`` and that chunk's first/last-stage flags."""
        from megatron.core import parallel_state

        try:
            return [self.model_provider(
                tf, pre_process=parallel_state.is_pipeline_first_stage(
                    ignore_virtual=False, vp_stage=v),
                post_process=parallel_state.is_pipeline_last_stage(
                    ignore_virtual=False, vp_stage=v),
                vp_stage=v) for v in range(config.vpp)]
        except AssertionError as err:  # megatron's GPTModel built without its vp_stage
            if "vp_stage" not in str(err):
                raise
            raise ConfigError(f"vpp ({config.vpp}): the model provider must pass vp_stage to "
                              f"GPTModel (megatron-core: {str(err).splitlines()[0]})") from err

    def _check_layout(self, config: ParallelConfig) -> None:
        """What this trainer needs of a layout before it builds one.

        Raises:
            ConfigError: ``config`` cannot keep the global batch, the interleaved schedule
                cannot run its micro-batches, or it has vpp > 1 and the model provider takes
                no ``vp_stage``.
        """
        check_interleaving(self.global_batch, self.micro_batch, config.dp, config.pp,
                           config.vpp)
        if config.vpp > 1 and not self._provider_takes_vp_stage():
            raise ConfigError(f"vpp ({config.vpp}) builds one model chunk per virtual pipeline "
                              "stage: the model provider must take vp_stage "
                              "(model_provider(config, pre_process, post_process, "
                              "vp_stage=None)) and pass it to GPTModel")

    def _provider_takes_vp_stage(self) -> bool:
        """Whether the model provider accepts ``vp_stage`` (by name or ``**kwargs``)."""
        try:
            params = inspect.signature(self.model_provider).parameters.values()
        except (TypeError, ValueError):  # no signature to read (a builtin): let it try
            return True
        return any(p.name == "vp_stage" and p.kind is not p.POSITIONAL_ONLY
                   or p.kind is p.VAR_KEYWORD for p in params)

    def _say_model(self, desc: ModelDesc) -> None:
        """Tell the coordinator, once per process, the model this script built (checked
        against its catalog above) and its batch: what it plans with when not told."""
        proc = self.proc
        if proc is None or self._model_said is not None:
            return
        self._model_said = ModelReport.of(desc, self.global_batch, self.micro_batch)
        proc.control.report(ModelBuilt(proc.job, self.generation, proc.vrank,
                                       self._model_said, self._provider_takes_vp_stage()))

    def _make_scheduler(self, optimizer: Any) -> Any:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        s, gb = self.scheduler_config, self.global_batch
        decay = s.decay_steps if s.decay_steps is not None else self.train_steps
        return OptimizerParamScheduler(
            optimizer, init_lr=s.init_lr, max_lr=s.max_lr, min_lr=s.min_lr,
            lr_warmup_steps=s.warmup_steps * gb, lr_decay_steps=max(decay, 1) * gb,
            lr_decay_style=s.decay_style, start_wd=s.start_wd, end_wd=s.end_wd,
            wd_incr_steps=max(decay, 1) * gb, wd_incr_style=s.wd_incr_style)

    @staticmethod
    def _coordinator_ports(proc: WorkerProcess) -> set[int]:
        """The ports of the coordinator's channel and store (as they are now: a restarted
        coordinator's store may have moved), whose connections a rank leaving its groups
        keeps."""
        ports = {getattr(proc.store, "port", None)}
        address = getattr(proc.control, "address", None)
        if isinstance(address, str) and ":" in address:
            with contextlib.suppress(ValueError):
                ports.add(int(address.rsplit(":", 1)[1]))
        return {p for p in ports if isinstance(p, int)}

    def _start_group(self, prefix: str, rank: int, world: int) -> None:
        proc = self._proc()
        dist.init_process_group(device.current().world_backend,
                                store=dist.PrefixStore(prefix, proc.store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=proc.timeout_s))

    # -- helpers ---------------------------------------------------------------------------

    def _live(self) -> tuple[TrainingState, ParallelConfig]:
        if self.state is None or self.layout is None:
            raise RuntimeError("this process holds no training state")
        return self.state, self.layout.config

    def _proc(self) -> WorkerProcess:
        if self.proc is None:
            raise RuntimeError("the trainer is not running")
        return self.proc

    def _exit(self, why: str) -> str:
        proc = self._proc()
        proc.control.report(Exited(proc.job, self.generation, proc.vrank, why, self.step))
        self._log("exiting (%s) at step %d", why, self.step)
        return why

    def _log(self, fmt: str, *args: Any) -> None:
        proc = self.proc
        prefix = (f"[job {proc.job} gen {self.generation} vrank {proc.vrank}] " if proc
                  else "")
        logger.info(prefix + fmt, *args)


# -- module helpers -----------------------------------------------------------------------


def _expected_fingerprint(held: dict[int, dict], lost_ranks: list[int], back: int
                          ) -> dict[str, int]:
    """What a layout rebuilt from the copies of step ``back`` must add up to: the
    survivors' own snapshots and, for each lost rank, its copy (the lowest holder's: every
    rank reads the same), as fingerprinted when taken."""
    rows: list = []
    for r in sorted(held):
        rows += _steps(held[r]["fp"]["own"]).get(back, [])
    for w in lost_ranks:
        for r in sorted(held):
            kept = _steps(_steps(held[r]["fp"]["copies"]).get(w, {}))
            if back in kept:
                rows += kept[back]
                break
    return fingerprint_totals(rows)


FINGERPRINT_DIR = "fingerprint"  # in a checkpoint: <rank>.json, its shards' fingerprints


def checkpoint_fingerprint(directory: str) -> dict[str, int] | None:
    """What a state loaded from the checkpoint in ``directory`` must add up to, per state
    tensor (None: a checkpoint written before fingerprints, not checked)."""
    where = os.path.join(directory, FINGERPRINT_DIR)
    try:
        names = sorted(n for n in os.listdir(where) if n.endswith(".json"))
    except OSError:
        return None
    rows: list = []
    for name in names:
        with open(os.path.join(where, name)) as f:
            rows += json.load(f)
    return fingerprint_totals(rows) if names else None


def local_shards_of(state: Any, catalog: Catalog) -> list:
    from slurm_etc.megatron.state import local_shards

    return local_shards(state, catalog)


def _steps(d: dict) -> dict:
    """A dict read back from the store with its int keys (they may travel as text)."""
    return {int(k): v for k, v in d.items()}


def host_memory_available() -> int:
    """Bytes of host memory this node can still give (``MemAvailable``), 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # type: ignore[import-untyped]

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no psutil, or it cannot read: unknown
        return 0

def newest_order(values: Iterable[bytes], generation: int, aborted: Collection[int]
                 ) -> Order | None:
    """The newest order the ranks wrote into a step's agreement (``b"-"``: none) that is
    still ahead of a process at ``generation``: one of its own generation or older was
    carried out already (a copy that came twice is not a second resize), an aborted one is
    over; a Stop is never passed over (its generation may be an aborted resize's)."""
    orders = [o for o in (ORDER_DECODER.decode(v) for v in values if v != b"-")
              if isinstance(o, Stop) or o.generation > generation and o.generation not in aborted]
    stops = [o for o in orders if isinstance(o, Stop)]
    return stops[0] if stops else max(orders, key=lambda o: o.generation) if orders else None


@lru_cache(maxsize=16)
def _plan(catalog: Catalog, old: Layout, new_config: ParallelConfig, pool: tuple[int, ...],
          topology: Topology, keep_tp_in_node: bool, lost: tuple[int, ...] = ()
          ) -> MigrationPlan:
    return plan_migration(catalog.model, old, new_config, pool, topology,
                          keep_tp_in_node=keep_tp_in_node, catalog=catalog,
                          **({"lost": lost} if lost else {}))


def _freeze_heap() -> None:
    """Collect once, then move every object alive (torch, megatron-core, the model built)
    out of the cyclic collector's sight (``gc.freeze``), before training or a resize: a
    full collection of the ~400k objects of the imports takes 0.2-0.6 s on 2 cores, and the
    collector starts one whenever enough allocations came, in a step or in a pause. Later
    collections see only what came after (a resize's old model, collected as before)."""
    gc.collect()
    gc.freeze()


@dataclass
class _EarlyReport:
    sent: bool = False


@dataclass
class _Preparation:
    """A resize prepared while the old layout trains: the transfer (``thread``), then the
    new world's groups (``stage`` "groups") and its model (``stage`` "world") at two step
    boundaries, then the pause."""

    order: Resize
    plan: MigrationPlan
    started: float
    thread: threading.Thread | None = None
    prepared: PreparedResize | None = None
    error: BaseException | None = None
    stage: str = "transfer"
    polls: int = 0
    new_catalog: Catalog | None = None
    prepared_s: float = 0.0
    world_s: float = 0.0


def _seed_cuda_tracker(seed: int) -> None:
    """On a GPU, megatron's CUDA RNG tracker (its model-parallel generator, forked for
    dropout in tensor-parallel regions) needs states before the first forward: seeded once
    as megatron's training does (``model_parallel_cuda_manual_seed``); a resize carries the
    states over (``_rng_extras``). The device's default generator is left as it was."""
    from megatron.core import tensor_parallel

    if tensor_parallel.get_cuda_rng_tracker().get_states():
        return
    rng = torch.cuda.get_rng_state()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.cuda.set_rng_state(rng)


def _rng_source(old: Layout, new: Layout, new_rank: int, plan: MigrationPlan, lost: frozenset[int]
                ) -> int:
    """The old rank whose RNG extras ``new_rank`` continues (a survivor's)."""
    from slurm_etc.megatron.state import rng_source

    src = rng_source(old.config, new.config, new_rank, plan.catalog.model.num_layers)
    return _surviving_peer(old, src, lost) if old.devices[src] in lost else src


def _surviving_peer(old: Layout, rank: int, lost: frozenset[int]) -> int:
    """The surviving old rank with ``rank``'s tensor and pipeline coordinates and the lowest
    dp (its replica), else the lowest surviving rank."""
    t, _d, p = old.config.coords(rank)
    same = [old.config.rank(t, d, p) for d in range(old.config.dp)]
    alive = [r for r in same if old.devices[r] not in lost] or \
        [r for r in range(old.config.world) if old.devices[r] not in lost]
    return alive[0]


def _fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stack(samples: list) -> Any:
    if isinstance(samples[0], dict):
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    return torch.stack(samples)


def _rng_extras() -> dict:
    """RNG state beyond torch's CPU generator (which the migration's control exchange moves):
    CUDA generators and megatron's tensor-parallel RNG tracker, where they exist."""
    from megatron.core import tensor_parallel

    out: dict[str, Any] = {}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states() if getattr(tracker, "is_initialized", lambda: True)() else {}
    if states:
        out["tracker"] = states
    return out


def _set_rng_extras(extras: dict) -> None:
    from megatron.core import tensor_parallel

    if "cuda" in extras and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(extras["cuda"])
    if "tracker" in extras:
        tensor_parallel.get_cuda_rng_tracker().set_states(extras["tracker"])
