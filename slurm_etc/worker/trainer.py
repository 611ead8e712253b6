# mypy: disable-error-code="misc, has-type"
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

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slurm_etc.megatron.build import TrainingState
from slurm_etc.migrate import connections, device
from slurm_etc.migrate.faults import KillSpec
from slurm_etc.plan import Layout, ParallelConfig
from slurm_etc.plan.catalog import Catalog
from slurm_etc.plan.errors import ConfigError
from slurm_etc.protocol.rendezvous import GenerationKeys
from slurm_etc.protocol.store import StoreInterrupted, StoreUnreachable

from ..lifecycle import ProcessOutcome
from ..protocol.messages import Exited, ModelReport, Order, Resize, Stop
from ..protocol.recovery import AUTO, CopyInterval, Recovery
from .agreement import StepAgreement, agree_slice_s, newest_order
from .building import Building, freeze_heap
from .checkpoints import Checkpoints, checkpoint_fingerprint
from .data import check_batch, microbatch_samples
from .extras import TrainerExtras
from .lifeline import children_die_with_me
from .outage import OutageHandling
from .preparation import STEP_TIMES_KEPT, Preparation, PreparationSteps
from .process import (
    CommitUnknown,
    CoordinatorLost,
    RebuiltStateMismatch,
    SchedulerConfig,
    TrainerHooks,
    WorkerProcess,
)
from .rebuild import Rebuild
from .recovery_points import RecoveryPoints
from .redundancy import PeerCopies
from .reporting import Reporting, ResizeRecord, Resumption, StepRecord
from .resizing import ResizeSteps

# what other modules and user scripts import from here (all but ElasticTrainer defined in
# the modules of their roles)
__all__ = ["CommitUnknown", "CoordinatorLost", "ElasticTrainer",
           "RebuiltStateMismatch", "ResizeRecord", "SchedulerConfig", "StepRecord",
           "TrainerHooks", "WorkerProcess", "agree_slice_s", "newest_order"]

logger = logging.getLogger(__name__)


class ElasticTrainer(StepAgreement, OutageHandling, ResizeSteps, PreparationSteps, Rebuild,
                     RecoveryPoints, Checkpoints, TrainerExtras, Building, Reporting):
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
        # peer_copy_every, checkpoint_every, checkpoint_dir (checked), keep_checkpoints and
        # resume_from (a checkpoint the first layout loads)
        self.recovery = Recovery(peer_copy_every, checkpoint_every, checkpoint_dir)
        check_batch(global_batch_size, micro_batch_size, 1)
        scheduler.check(train_steps)
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
        self.resumption = Resumption()  # what the next Resumed reports
        # a resize being prepared while the old layout trains (see _advance_preparation)
        self._preparing: Preparation | None = None
        # (seconds, preparing) of the last steps trained: the old layout's cost of preparing
        self.step_times: deque[tuple[float, bool]] = deque(maxlen=STEP_TIMES_KEPT)

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
            self.resumption.first_generation = proc.generation
            freeze_heap()
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

    def close(self) -> None:
        """Drop the state and this process's groups (after :meth:`run` returned)."""
        if dist.is_initialized():
            from slurm_etc.megatron.build import teardown_world

            self.state = None
            teardown_world()

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

    def _catalog(self) -> Catalog:
        if self.catalog is None:
            raise RuntimeError("this process has built no model")
        return self.catalog

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
        if why != "left":  # a process that left at a commit: the coordinator needs no word
            proc.control.report(Exited(proc.job, self.generation, proc.vrank, why, self.step))
        self._log("exiting (%s) at step %d", why, self.step)
        return why

    def _log(self, fmt: str, *args: Any) -> None:
        proc = self.proc
        prefix = (f"[job {proc.job} gen {self.generation} vrank {proc.vrank}] " if proc
                  else "")
        logger.info(prefix + fmt, *args)


def _stack(samples: list) -> Any:
    if isinstance(samples[0], dict):
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    return torch.stack(samples)
