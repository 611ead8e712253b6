"""Build a real megatron-core GPT training state for a ModelDesc under a ParallelConfig.

This is the bridge between slurm-etc's descriptions (``ModelDesc``, ``ParallelConfig``) and a
live megatron-core model: ``GPTModel`` with the local (non Transformer-Engine) layer spec,
wrapped in megatron's ``DistributedDataParallel``, with megatron's Adam optimizer (distributed
or not), trained for a few steps through megatron's pipeline schedule so that every piece of
training state (weights, fp32 main weights, Adam moments, step) is real and non-trivial.

Used by multi-process tests and benchmarks, and as the source of truth the shard catalog is
checked against. Call it inside an initialised ``torch.distributed`` group whose world size is
``config.world``; on CPU, install :mod:`slurm_etc.megatron.cpu_compat` first.

Determinism: the global value of every parameter depends only on the seed and the model,
never on the parallel configuration. megatron's CPU initialisation
(``use_cpu_initialization=True``) draws each tensor's full global value and slices it, so it
does not depend on tp; it does depend on pp, because each pipeline stage draws only its own
layers from one shared generator stream. :func:`build_training_state` therefore re-draws every
randomly initialised tensor from a generator seeded by (seed, tensor key, layer), cutting the
rank's region out of the global value given by the sharded state dict (same distributions as
megatron's: normal with ``init_method_std``, scaled by ``1/sqrt(2*num_layers)`` for the
attention and MLP output projections; norms and biases keep their constant initial values).
The training batches are a function of the seed and the step only, split over dp ranks and
micro-batches, so the loss of a step is the same for every configuration (up to float
rounding).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slurm_etc.migrate.device import current, end_world
from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import ModelDesc

from .shards import iter_sharded_tensors

logger = logging.getLogger(__name__)

INIT_METHOD_STD = 0.02
LEARNING_RATE = 1e-3
DEFAULT_GLOBAL_BATCH = 8
# Optimizer sharded state dict format requested from the DistributedOptimizer: flat
# per-bucket tensors (the only format that saves and loads on CPU with torch's Adam).
DIST_OPT_SHARDING_TYPE = "dp_reshardable"

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def transformer_config(model: ModelDesc, config: ParallelConfig) -> Any:
    """The megatron-core ``TransformerConfig`` that builds ``model`` under ``config``.

    Fusions, dropout and gradient-accumulation fusion are off (none exist on CPU without
    Transformer Engine / Apex), and initialisation runs on the CPU, so the same config works on
    CPU and GPU.

    Raises:
        ConfigError: ``config`` cannot run ``model`` (e.g. tp does not divide the heads).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import init_method_normal, scaled_init_method_normal

    config.validate_for(model)
    refuse_on_local_spec(model, config)
    dtype = _DTYPES[model.param_dtype]
    mixed = model.mixed_precision
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden,
        ffn_hidden_size=model.ffn_hidden,
        num_attention_heads=model.num_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.kv_channels,
        tensor_model_parallel_size=config.tp,
        pipeline_model_parallel_size=config.pp,
        virtual_pipeline_model_parallel_size=config.vpp if config.vpp > 1 else None,
        batch_p2p_comm=batch_p2p_comm(config),
        context_parallel_size=config.cp,
        expert_model_parallel_size=config.ep,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=mixed,
        use_cpu_initialization=True,
        perform_initialization=True,
        init_method_std=INIT_METHOD_STD,
        init_method=init_method_normal(INIT_METHOD_STD),
        output_layer_init_method=scaled_init_method_normal(INIT_METHOD_STD, model.num_layers),
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        normalization="RMSNorm" if model.rmsnorm else "LayerNorm",
        add_bias_linear=model.add_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        qk_layernorm=model.qk_layernorm,
        **moe_settings(model),
    )


def batch_p2p_comm(config: ParallelConfig) -> bool:
    """megatron's ``TransformerConfig.batch_p2p_comm`` for ``config``: off with virtual
    pipeline chunks.

    The interleaved schedule's steady state sends an activation to the next stage and a
    gradient to the previous one in one call; at pp = 2 both are the other rank. Batched
    (``batch_isend_irecv``, megatron-core's default), rank 0 posts the gradient first and
    rank 1 receives the activation first: on gloo the two same-shaped messages cross, and
    every micro-batch after the first ``pp`` trains on a gradient as its activation (tiny,
    dp=1,pp=2,vpp=2, 8 micro-batches: the losses of micro-batches 2-7 differ from pp=2's
    by 1e-3, silently). Unbatched (``_p2p_ops``, Megatron-LM's default) sends the two
    directions over two groups at pp = 2, and the losses equal pp=2's bit for bit.
    """
    return config.vpp == 1


# Token dispatcher of MoE layers: megatron-core 0.16.1's "alltoall" dispatcher creates a
# torch.cuda.Stream in its constructor (RuntimeError without CUDA); "allgather" runs on gloo.
MOE_TOKEN_DISPATCHER = "allgather"


def moe_settings(model: ModelDesc) -> dict:
    """megatron ``TransformerConfig`` fields of a mixture-of-experts model (none if dense).

    Experts are megatron's ``SequentialMLP`` (``moe_grouped_gemm=False``: the grouped GEMM
    layers need Transformer Engine); the load-balancing loss is off, so a step's loss is the
    language-model loss alone and the same for every layout (docs/moe-vpp-cp.md).
    """
    if not model.moe:
        return {}
    _define_missing_te_names()
    return {
        "num_moe_experts": model.num_experts,
        "moe_router_topk": model.topk,
        "moe_ffn_hidden_size": model.expert_ffn_size,
        "moe_shared_expert_intermediate_size": model.shared_expert_ffn,
        "moe_token_dispatcher_type": MOE_TOKEN_DISPATCHER,
        "moe_grouped_gemm": False,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
    }


def refuse_on_local_spec(model: ModelDesc, config: ParallelConfig) -> None:
    """Refuse, in one line, the layouts megatron-core 0.16.1's local (non Transformer-Engine)
    layers cannot build or train; each message quotes megatron's own error.

    Raises:
        ConfigError: cp > 1, or a mixture-of-experts model with tp > 1 or linear biases.
    """
    if config.cp > 1:
        raise ConfigError(f"cp ({config.cp}) needs Transformer Engine: megatron-core's local "
                          "attention says 'Context parallelism is only supported by "
                          "TEDotProductAttention!'")
    if model.moe and config.tp > 1:
        raise ConfigError(f"tp ({config.tp}) with the experts of {model.name} needs Transformer "
                          "Engine or Apex: megatron-core's MoE layer requires sequence "
                          "parallelism with tp > 1, and its torch norms say 'sequence parallel "
                          "not supported by torch LayerNorm'")
    if model.moe and model.add_bias_linear:
        raise ConfigError(f"{model.name}: experts with linear biases fail in megatron-core "
                          "0.16.1's local experts ('Bias in Moe is only supported when "
                          "ETP==1'; with tp=1 an in-place add on a view in mlp.py): set "
                          "add_bias_linear false")


def _define_missing_te_names() -> None:
    """megatron-core 0.16.1's ``moe_utils`` imports ``te_general_gemm`` only when Transformer
    Engine is installed but its router tests ``te_general_gemm is not None`` either way
    (NameError without TE): define the name as absent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@dataclass
class TrainingState:
    """A built, trained megatron-core model and optimizer on this rank.

    Attributes:
        model_desc: the model description it was built from.
        config: its parallel configuration.
        model: the model chunks (one per virtual pipeline stage, in megatron's order), each a
            megatron ``DistributedDataParallel`` around a ``GPTModel`` (in a
            ``Float16Module`` for bf16).
        gpt: the unwrapped ``GPTModel`` of this rank's first (or only) chunk.
        optimizer: megatron's optimizer (a ``ChainedOptimizer`` around an ``FP32Optimizer``,
            ``Float16OptimizerWithFloat16Params`` or ``DistributedOptimizer``).
        transformer_config: the megatron ``TransformerConfig``.
        losses: the mean training loss of each step (the same value on every rank).
    """

    model_desc: ModelDesc
    config: ParallelConfig
    model: list[Any]
    gpt: Any
    optimizer: Any
    transformer_config: Any
    losses: list[float] = field(default_factory=list)
    chunks: list[Any] = field(default_factory=list)

    @property
    def gpts(self) -> list[Any]:
        """The unwrapped ``GPTModel`` of every virtual pipeline chunk of this rank."""
        return self.chunks or [self.gpt]

    def model_sharded_state_dict(self) -> dict:
        """megatron's ``sharded_state_dict()`` of the model (keys without a ``module.`` prefix).

        With vpp > 1, ``{"model0": chunk 0's, "model1": ...}`` as Megatron-LM saves them:
        chunks name their layers locally (``decoder.layers.0...`` in every chunk), so the
        dicts cannot merge; the ShardedTensors' keys and offsets are global either way.
        """
        gpts = self.gpts
        if len(gpts) == 1:
            return gpts[0].sharded_state_dict()
        return {f"model{v}": gpt.sharded_state_dict() for v, gpt in enumerate(gpts)}

    def load_model_state_dict(self, loaded: dict) -> None:
        """Put a loaded ``model_sharded_state_dict()`` into the chunks."""
        gpts = self.gpts
        if len(gpts) == 1:
            gpts[0].load_state_dict(loaded)
            return
        for v, gpt in enumerate(gpts):
            gpt.load_state_dict(loaded[f"model{v}"])

    def optimizer_sharded_state_dict(self, model_sharded_state_dict: dict | None = None) -> dict:
        """megatron's optimizer ``sharded_state_dict``; ``dp_reshardable`` when distributed."""
        model_sd = model_sharded_state_dict or self.model_sharded_state_dict()
        metadata = {"distrib_optim_sharding_type": DIST_OPT_SHARDING_TYPE}
        return self.optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=metadata)

    def sharded_state_dict(self) -> dict:
        """``{"model": ..., "optimizer": ...}``, the layout megatron's checkpoints use."""
        model_sd = self.model_sharded_state_dict()
        return {"model": model_sd, "optimizer": self.optimizer_sharded_state_dict(model_sd)}


def build_training_state(model: ModelDesc, config: ParallelConfig, *, seed: int = 1234,
                         steps: int = 2, micro_batch: int = 2, seq: int | None = None,
                         global_batch: int = DEFAULT_GLOBAL_BATCH) -> TrainingState:
    """Initialise model parallel state, build the model and optimizer, train ``steps`` steps.

    Must run on every rank of an initialised ``torch.distributed`` group of ``config.world``
    ranks. Call :func:`teardown` before building another configuration in the same processes.

    Args:
        model: the model to build.
        config: dp, tp, pp and whether the optimizer is distributed.
        seed: seeds the weights and the training data.
        steps: training steps to run (``0`` leaves Adam's moments empty).
        micro_batch: sequences per micro-batch.
        seq: sequence length (default: ``model.seq_length``).
        global_batch: sequences per step over all dp ranks; each dp rank runs
            ``global_batch / (dp * micro_batch)`` micro-batches through the pipeline.

    Raises:
        ConfigError: the world size, the batch sizes or ``config`` do not fit ``model``.
    """

    world = dist.get_world_size()
    config.validate_for(model, devices=world)
    seq = model.seq_length if seq is None else seq
    if seq > model.seq_length and model.learned_position_embeddings:
        raise ConfigError(f"seq ({seq}) exceeds the learned position table of {model.name} "
                          f"({model.seq_length})")
    if global_batch % (config.dp * micro_batch):
        raise ConfigError(f"global_batch ({global_batch}) must be a multiple of dp * micro_batch "
                          f"({config.dp} * {micro_batch})")

    initialize_parallel_state(config)
    try:
        state = build_modules(model, config, seed=seed)
        for step in range(steps):
            state.losses.append(_train_step(state, seed=seed, step=step,
                                            micro_batch=micro_batch, seq=seq,
                                            global_batch=global_batch))
    except BaseException:
        # Leave the processes able to build the next configuration.
        teardown()
        raise
    logger.info("built %s under %s: losses %s", model.name, config,
                ", ".join(f"{x:.4f}" for x in state.losses))
    return state


def initialize_parallel_state(config: ParallelConfig, timeout_s: float | None = None) -> None:
    """megatron's ``initialize_model_parallel`` for every degree of ``config`` (its groups'
    timeout ``timeout_s``, in whole minutes, at least one; None: megatron's default)."""
    from megatron.core import parallel_state

    timeout = {} if timeout_s is None else {
        "distributed_timeout_minutes": max(1, round(timeout_s / 60))}
    with one_gloo_group_per_membership():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.tp,
            pipeline_model_parallel_size=config.pp,
            virtual_pipeline_model_parallel_size=config.vpp if config.vpp > 1 else None,
            context_parallel_size=config.cp,
            expert_model_parallel_size=config.ep, **timeout)


@contextlib.contextmanager
def one_gloo_group_per_membership() -> Iterator[None]:
    """While it is entered, ``torch.distributed.new_group`` gives one gloo group per set of
    members (and timeout): megatron's ``initialize_model_parallel`` asks for some thirty
    groups, most of them with the same members on a small world (tp, model-parallel,
    tp-cp, tp-dp-cp, the embedding's, ...: 31 calls, 5 memberships for tp = 2 on 2 ranks),
    and each gloo group is a rendezvous over the store: 45-50 ms against 11-12 ms measured
    here, inside a loss's pause. Every rank asks for the same groups in the same order and
    issues its collectives on them in program order, so groups with the same members may
    be one. Gloo (CPU) only: with NCCL, groups stay apart (megatron overlaps them on
    streams), and any other backend is left to torch."""
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        yield
        return
    create = dist.new_group
    made: dict[tuple[Any, ...], Any] = {}

    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None,
                  pg_options: Any = None, *args: Any, **kwargs: Any) -> Any:
        if str(backend or "gloo").lower() != "gloo" or pg_options is not None or args:
            return create(ranks, timeout, backend, pg_options, *args, **kwargs)
        key = (None if ranks is None else tuple(ranks), timeout,
               kwargs.get("use_local_synchronization", False))
        if key not in made:
            made[key] = create(ranks, timeout, backend, pg_options, **kwargs)
        return made[key]

    dist.new_group = new_group  # megatron's create_group looks it up at each call
    try:
        yield
    finally:
        dist.new_group = create


def parallel_state_matches(config: ParallelConfig) -> bool:
    """Whether megatron's initialised model parallel state is the one of ``config``."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
            vpp) == (config.tp, config.pp, config.cp, config.ep, config.vpp)


def build_modules(model: ModelDesc, config: ParallelConfig, *, seed: int | None) -> TrainingState:
    """GPTModel, DDP wrapper and optimizer of this rank (model parallel state initialised).

    ``seed=None`` skips drawing initial weights (``perform_initialization=False``): the
    structures a resize or a checkpoint load fills.
    """
    tf_config = transformer_config(model, config)
    if seed is None:
        tf_config = dataclasses.replace(tf_config, perform_initialization=False)
    else:
        torch.manual_seed(seed)
    with skip_tied_embedding_sync(seed is None):
        gpts = [_gpt_model(model, tf_config, vp_stage=v if config.vpp > 1 else None)
                for v in range(config.vpp)]
    if seed is not None:
        for gpt in gpts:
            reinit_global_deterministic(gpt, seed=seed, num_layers=model.num_layers)
    return wrap_for_training(model, config, gpts, tf_config, optimizer_config(model, config))


def optimizer_config(model: ModelDesc, config: ParallelConfig) -> Any:
    """megatron's Adam settings of the states this module builds."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=LEARNING_RATE,
        bf16=model.mixed_precision,
        params_dtype=_DTYPES[model.param_dtype],
        use_distributed_optimizer=config.distributed_optimizer,
        clip_grad=1.0,
    )


def wrap_for_training(model: ModelDesc, config: ParallelConfig, gpt: Any, tf_config: Any,
                      opt_config: Any) -> TrainingState:
    """What megatron's training loop puts around a GPTModel (or the list of a rank's vpp
    chunks): ``Float16Module`` in mixed precision, ``DistributedDataParallel`` per chunk and
    one ``get_megatron_optimizer`` over all, with the finalize/no-sync hooks the pipeline
    schedule calls after backward (a list of no-sync hooks for the interleaved schedule)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    gpts = gpt if isinstance(gpt, list) else [gpt]
    device = current().device
    if device.type == "cuda":  # megatron's DDP puts its gradient buffers on the current GPU
        gpts = [g.to(device) for g in gpts]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=model.mixed_precision,
        overlap_grad_reduce=False,
        use_distributed_optimizer=config.distributed_optimizer,
    )
    ddps = [DistributedDataParallel(
        tf_config, ddp_config, Float16Module(tf_config, g) if model.mixed_precision else g)
        for g in gpts]
    optimizer = get_megatron_optimizer(opt_config, ddps)
    tf_config.finalize_model_grads_func = finalize_model_grads
    tf_config.no_sync_func = ddps[0].no_sync if len(ddps) == 1 else [d.no_sync for d in ddps]
    return TrainingState(model_desc=model, config=config, model=ddps, gpt=gpts[0],
                         optimizer=optimizer, transformer_config=tf_config,
                         chunks=gpts if len(gpts) > 1 else [])


def _gpt_model(model: ModelDesc, tf_config: Any, vp_stage: int | None = None) -> Any:
    """megatron's GPTModel with the local (non Transformer-Engine) layer spec (MoE layers
    with ``SequentialMLP`` experts for a mixture-of-experts model); ``vp_stage``: which
    virtual pipeline chunk of this rank (None without vpp)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=tf_config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=model.num_experts, moe_grouped_gemm=False,
            qk_layernorm=model.qk_layernorm,
            normalization="RMSNorm" if model.rmsnorm else "LayerNorm"),
        vocab_size=model.padded_vocab,
        max_sequence_length=model.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                           vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                           vp_stage=vp_stage),
        vp_stage=vp_stage,
        share_embeddings_and_output_weights=model.tied_embeddings,
        position_embedding_type="learned_absolute" if model.learned_position_embeddings
        else "rope",
    )


@contextlib.contextmanager
def skip_tied_embedding_sync(skip: bool) -> Iterator[None]:
    """With ``skip``, build without megatron's all_reduce that makes the last pipeline
    stage's tied output layer start equal to the first stage's embedding: an empty build
    (resize, checkpoint load) writes both copies afterwards, and the sync would move the
    whole vocabulary matrix between the stages for nothing."""
    if not skip:
        yield
        return
    from megatron.core.models.common.language_module.language_module import LanguageModule

    saved = LanguageModule._is_in_embd_group
    LanguageModule._is_in_embd_group = lambda self: False
    try:
        yield
    finally:
        LanguageModule._is_in_embd_group = saved


def teardown() -> None:
    """Destroy megatron's model parallel state so the processes can build another config.

    Drop every reference to the previous :class:`TrainingState` first. Besides resetting
    megatron's globals (``destroy_model_parallel``), this shuts down the process groups megatron
    created: megatron leaves them alive, and each gloo group holds sockets, pipes and threads,
    so a process that builds dozens of configurations runs out of them and new groups hang.
    megatron keeps the groups this rank belongs to in ``parallel_state._global_process_group_list``
    (``None`` standing for the default group, which stays).
    """
    from megatron.core import parallel_state

    # Destroy the groups before destroy_model_parallel(): it destroys its gloo data-parallel
    # groups itself, but only those still registered, so nothing is destroyed twice.
    groups = list({id(g): g for g in parallel_state._global_process_group_list or []
                   if g is not None}.values())
    for group in groups:
        dist.destroy_process_group(group)
    parallel_state.destroy_model_parallel()
    gc.collect()
    logger.debug("destroyed megatron model parallel state and %d process groups", len(groups))


def teardown_world() -> None:
    """:func:`teardown` and the default group too: every process group of this process.
    On a GPU all are aborted together (:func:`slurm_etc.migrate.device.end_world`: a
    destroy waits for work a dead peer never completes), megatron's state reset."""
    from megatron.core import parallel_state

    if current().cuda:
        end_world()
        parallel_state.destroy_model_parallel()
        gc.collect()
        return
    teardown()
    if dist.is_initialized():
        dist.destroy_process_group()


def _train_step(state: TrainingState, *, seed: int, step: int, micro_batch: int, seq: int,
                global_batch: int) -> float:
    """One optimizer step over the seeded global batch; returns its mean loss on every rank."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank = parallel_state.get_data_parallel_rank()
    per_dp = global_batch // state.config.dp
    tokens = _global_batch_tokens(state.model_desc, seed=seed, step=step, sequences=global_batch,
                                  seq=seq)[dp_rank * per_dp:(dp_rank + 1) * per_dp]
    micro_batches = list(tokens.split(micro_batch))

    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    # the interleaved schedule takes one iterator per chunk; each chunk's forward reads
    # micro-batch k at its k-th call (only the first chunk uses the tokens, the last the labels)
    data = (iter(micro_batches) if len(state.model) == 1
            else [iter(micro_batches) for _ in state.model])
    losses = get_forward_backward_func()(
        forward_step_func=gpt_forward_step,
        data_iterator=data,
        model=state.model,
        num_microbatches=len(micro_batches),
        seq_length=seq,
        micro_batch_size=micro_batch,
        forward_only=False,
    )
    ok, _grad_norm, _zeros = state.optimizer.step()
    if not ok:
        raise RuntimeError(f"optimizer step {step} of {state.model_desc.name} under "
                           f"{state.config} was skipped (non-finite gradients)")
    return mean_loss(losses, state.config)


def _global_batch_tokens(model: ModelDesc, *, seed: int, step: int, sequences: int,
                         seq: int) -> torch.Tensor:
    """Token ids ``[sequences, seq + 1]`` of one step: a function of (seed, step) only."""
    generator = torch.Generator().manual_seed(_stable_seed(seed, "batch", step))
    return torch.randint(0, model.vocab_size, (sequences, seq + 1), generator=generator)


def gpt_forward_step(data_iterator: Iterator[torch.Tensor], model: Any) -> tuple:
    """megatron ``forward_step_func``: next-token loss of one micro-batch."""
    tokens = next(data_iterator)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0).expand_as(inputs)
    output = model(inputs, positions, None, labels=labels)

    def loss_func(per_token_loss: torch.Tensor) -> tuple:
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def mean_loss(losses: list[dict], config: ParallelConfig) -> float:
    """The step's mean loss, averaged over micro-batches and dp ranks, known on every rank.

    Only last-stage ranks hold losses; each of their tp ranks holds the same value.
    """
    from megatron.core import parallel_state

    # a host scalar: over gloo, also on a GPU (the default group has both backends)
    local = torch.zeros(1, dtype=torch.float64, device="cpu")
    if losses and parallel_state.is_pipeline_last_stage():
        local[0] = sum(float(x["lm loss"]) for x in losses) / len(losses)
    dist.all_reduce(local)
    return float(local[0]) / (config.dp * config.tp)


# -- deterministic initialisation ---------------------------------------------------------------

# megatron draws these from output_layer_init_method (std / sqrt(2 * layers)): the attention
# and MLP output projections, the experts' and the shared expert's fc2 included.
_OUTPUT_PROJECTIONS = ("self_attention.linear_proj.weight", "linear_fc2.weight")


def reinit_global_deterministic(gpt: Any, *, seed: int, num_layers: int) -> None:
    """Re-draw every randomly initialised weight from its global value, independent of tp/pp.

    For each ShardedTensor of ``gpt.sharded_state_dict()`` with two or more dimensions per
    layer (weights, embeddings; norms and biases are constants and are left alone), draws the
    tensor's full global value for one layer from a generator seeded by (seed, key, layer) and
    copies this rank's region into the parameter. Tied output weights on the last pipeline
    stage carry the embedding's key, so they get the embedding's values.
    """
    scaled_std = INIT_METHOD_STD / math.sqrt(2.0 * num_layers)
    with torch.no_grad():
        sharded = gpt.sharded_state_dict()  # gpt: Any (a megatron module)
        for _path, sh in iter_sharded_tensors(sharded):
            layer_shape = tuple(sh.global_shape[sh.prepend_axis_num:])
            if len(layer_shape) < 2:
                continue
            std = scaled_std if sh.key.endswith(_OUTPUT_PROJECTIONS) else INIT_METHOD_STD
            layers = sh.global_offset[:sh.prepend_axis_num]
            generator = torch.Generator().manual_seed(_stable_seed(seed, sh.key, *layers))
            # drawn on the host from a seeded CPU generator: the same on every device
            full = torch.empty(layer_shape, device="cpu").normal_(0.0, std, generator=generator)
            region = tuple(slice(o, o + n) for o, n in
                           zip(sh.global_offset[sh.prepend_axis_num:], sh.local_shape))
            sh.data.copy_(full[region].to(sh.data.dtype))


def _stable_seed(*parts: object) -> int:
    """A 63-bit seed from its parts, the same in every process (unlike ``hash``)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
