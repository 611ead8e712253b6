"""An elastic trainer for a model preset: megatron-core's GPTModel on seeded token data.

What ``slurm-etc verify --sequence`` and ``slurm-etc demo`` train: the providers a user would
write for a ``ModelDesc`` (:func:`gpt_provider`, ``build.gpt_forward_step``), and a dataset
whose sample ``i`` is a function of (seed, i) alone, so every layout reads the same tokens.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.model import ModelDesc

from .trainer import ElasticTrainer, SchedulerConfig

LEARNING_RATE = 1e-3


class SeededTokens:
    """Map-style dataset: sample ``i`` is ``seq + 1`` token ids drawn from (seed, i)."""

    def __init__(self, vocab_size: int, seq: int, seed: int, size: int = 1 << 40) -> None:
        self.vocab_size, self.seq, self.seed, self.size = vocab_size, seq, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.size:
            raise IndexError(i)
        digest = hashlib.sha256(repr((self.seed, "sample", i)).encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        # a sample lives in host memory, as a data loader's do: the trainer moves each
        # micro-batch to the worker's device
        return torch.randint(0, self.vocab_size, (self.seq + 1,), generator=gen, device="cpu")


def gpt_provider(model: ModelDesc) -> Any:
    """A megatron model provider ``(tf_config, pre_process, post_process, vp_stage=None) ->
    GPTModel`` (Megatron-LM's convention: ``vp_stage``, the virtual pipeline chunk, given
    when the layout has vpp > 1; MoE layers with ``SequentialMLP`` experts for a
    mixture-of-experts model, as :func:`slurm_etc.megatron.build.transformer_config`
    configures them)."""

    def provide(tf_config: Any, pre_process: bool, post_process: bool,
                vp_stage: int | None = None) -> Any:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return GPTModel(
            config=tf_config,
            transformer_layer_spec=get_gpt_layer_local_spec(
                num_experts=model.num_experts, moe_grouped_gemm=False,
                qk_layernorm=model.qk_layernorm,
                normalization="RMSNorm" if model.rmsnorm else "LayerNorm"),
            vocab_size=model.padded_vocab, max_sequence_length=model.seq_length,
            pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
            share_embeddings_and_output_weights=model.tied_embeddings,
            position_embedding_type="learned_absolute" if model.learned_position_embeddings
            else "rope")

    return provide


def preset_trainer(model: ModelDesc, *, distributed_optimizer: bool, seed: int = 1234,
                   global_batch: int = 8, micro_batch: int = 1, seq: int | None = None,
                   train_steps: int = 10, lr: float = LEARNING_RATE,
                   warmup_steps: int = 2) -> ElasticTrainer:
    """An ElasticTrainer for ``model`` (Adam, clip 1.0, linear warmup then cosine decay;
    the warmup shortened to fewer steps than ``train_steps``)."""
    from megatron.core.optimizer import OptimizerConfig

    from slurm_etc.megatron.build import gpt_forward_step, transformer_config

    seq = min(model.seq_length, 64) if seq is None else seq
    template = transformer_config(model, ParallelConfig(1, distributed_optimizer=False))
    opt = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr / 10, weight_decay=0.01,
                          bf16=model.mixed_precision, clip_grad=1.0,
                          use_distributed_optimizer=distributed_optimizer)
    return ElasticTrainer(
        model_provider=gpt_provider(model), forward_step=gpt_forward_step,
        dataset_provider=lambda: SeededTokens(model.vocab_size, seq, seed),
        transformer_config=template, optimizer_config=opt,
        scheduler=SchedulerConfig(max_lr=lr, min_lr=lr / 10,
                                  warmup_steps=min(warmup_steps, max(train_steps - 1, 0)),
                                  decay_steps=train_steps, start_wd=0.01, end_wd=0.01),
        global_batch_size=global_batch, micro_batch_size=micro_batch, seq_length=seq,
        train_steps=train_steps, name=model.name, seed=seed)
