# mypy: disable-error-code="misc, has-type"
"""Building a layout's training state from the user's providers: megatron-core's model
(one chunk per virtual pipeline stage), DDP, optimizer and scheduler, the catalog checked
against the model, the model said once to the coordinator, and the layout's training group.

A mixin of :class:`~slurm_etc.worker.trainer.ElasticTrainer`: a build sets its catalog and
scheduler from its settings."""
from __future__ import annotations

import dataclasses
import gc
import inspect
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from slurm_etc.megatron.build import (
    TrainingState,
    batch_p2p_comm,
    initialize_parallel_state,
    skip_tied_embedding_sync,
    wrap_for_training,
)
from slurm_etc.megatron.live import check_catalog, check_chunk_layers, model_desc_of
from slurm_etc.migrate import device
from slurm_etc.plan import ParallelConfig
from slurm_etc.plan.catalog import Catalog, build_catalog
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import ModelDesc

from ..protocol.messages import ModelBuilt, ModelReport
from .data import check_interleaving

if TYPE_CHECKING:
    from .trainer import ElasticTrainer


class Building:
    """Building the training state of :class:`~slurm_etc.worker.trainer.ElasticTrainer`."""

    # trainer fields these steps set to another type than mypy would infer from them here
    # (ElasticTrainer.__init__ sets them first)
    catalog: Catalog | None
    _model_said: ModelReport | None

    def _build(self: ElasticTrainer, config: ParallelConfig, *, empty: bool) -> TrainingState:
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

    def _provide_chunks(self: ElasticTrainer, tf: Any, config: ParallelConfig) -> list[Any]:
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

    def _check_layout(self: ElasticTrainer, config: ParallelConfig) -> None:
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

    def _provider_takes_vp_stage(self: ElasticTrainer) -> bool:
        """Whether the model provider accepts ``vp_stage`` (by name or ``**kwargs``)."""
        try:
            params = inspect.signature(self.model_provider).parameters.values()
        except (TypeError, ValueError):  # no signature to read (a builtin): let it try
            return True
        return any(p.name == "vp_stage" and p.kind is not p.POSITIONAL_ONLY
                   or p.kind is p.VAR_KEYWORD for p in params)

    def _say_model(self: ElasticTrainer, desc: ModelDesc) -> None:
        """Tell the coordinator, once per process, the model this script built (checked
        against its catalog above) and its batch: what it plans with when not told."""
        proc = self.proc
        if proc is None or self._model_said is not None:
            return
        self._model_said = ModelReport.of(desc, self.global_batch, self.micro_batch)
        proc.control.report(ModelBuilt(proc.job, self.generation, proc.vrank,
                                       self._model_said, self._provider_takes_vp_stage()))

    def _make_scheduler(self: ElasticTrainer, optimizer: Any) -> Any:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        s, gb = self.scheduler_config, self.global_batch
        decay = s.decay_steps if s.decay_steps is not None else self.train_steps
        return OptimizerParamScheduler(
            optimizer, init_lr=s.init_lr, max_lr=s.max_lr, min_lr=s.min_lr,
            lr_warmup_steps=s.warmup_steps * gb, lr_decay_steps=max(decay, 1) * gb,
            lr_decay_style=s.decay_style, start_wd=s.start_wd, end_wd=s.end_wd,
            wd_incr_steps=max(decay, 1) * gb, wd_incr_style=s.wd_incr_style)

    def _start_group(self: ElasticTrainer, prefix: str, rank: int, world: int) -> None:
        proc = self._proc()
        dist.init_process_group(device.current().world_backend,
                                store=dist.PrefixStore(prefix, proc.store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=proc.timeout_s))


def freeze_heap() -> None:
    """Collect once, then move every object alive (torch, megatron-core, the model built)
    out of the cyclic collector's sight (``gc.freeze``), before training or a resize: a
    full collection of the ~400k objects of the imports takes 0.2-0.6 s on 2 cores, and the
    collector starts one whenever enough allocations came, in a step or in a pause. Later
    collections see only what came after (a resize's old model, collected as before)."""
    gc.collect()
    gc.freeze()


def _seed_cuda_tracker(seed: int) -> None:
    """On a GPU, megatron's CUDA RNG tracker (its model-parallel generator, forked for
    dropout in tensor-parallel regions) needs states before the first forward: seeded once
    as megatron's training does (``model_parallel_cuda_manual_seed``); a resize carries the
    states over (``rng_extras``). The device's default generator is left as it was."""
    from megatron.core import tensor_parallel

    if tensor_parallel.get_cuda_rng_tracker().get_states():
        return
    rng = torch.cuda.get_rng_state()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.cuda.set_rng_state(rng)
