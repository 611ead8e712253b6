"""A user's own training script, as a new user writes one: a megatron-core GPT that is no
preset (2 layers, hidden 96, 6 heads, rotary positions, an untied output layer, vocabulary
128, sequences of 32, a global batch of 8 in micro-batches of 2), its loss and its data,
ending in ``run_worker(trainer)``. Nothing describes it to the coordinator: ``slurm-etc run``
without ``--model`` plans with what its workers report.

    slurm-etc run --hardware cpu --nodes 2 --gpus-per-node 1 -- python tests/workers/own_gpt.py
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

SEQ = 32
VOCAB = 128
LAYERS, HIDDEN, HEADS, FFN = 2, 96, 6, 192
GLOBAL_BATCH, MICRO_BATCH = 8, 2


class CountingTokens:
    """Sample ``i``: ``SEQ + 1`` tokens counting up from ``i`` (mod VOCAB): learnable."""

    def __len__(self) -> int:
        return 16384  # 2,048 steps of 8 samples: one epoch for any run here

    def __getitem__(self, i: int) -> torch.Tensor:
        return (torch.arange(SEQ + 1) + i) % VOCAB


def model_provider(config, pre_process: bool, post_process: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=pre_process,
                    post_process=post_process, share_embeddings_and_output_weights=False,
                    position_embedding_type="rope")


def forward_step(data_iterator, model):
    tokens = next(data_iterator)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0).expand_as(inputs)
    output = model(inputs, positions, None, labels=labels)

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def main() -> int:
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from slurm_etc.testing.hooks import trainer_hooks_from_env
    from slurm_etc.worker.entry import run_worker
    from slurm_etc.worker.trainer import ElasticTrainer, SchedulerConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--pace-file", help="while this file exists, sleep --pace-s per "
                        "forward pass (the Slurm tier's events come while it trains)")
    parser.add_argument("--pace-s", type=float, default=0.1)
    args = parser.parse_args()
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False)
    trainer = ElasticTrainer(
        model_provider=model_provider, forward_step=forward_step,
        dataset_provider=CountingTokens, transformer_config=config,
        optimizer_config=OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0),
        scheduler=SchedulerConfig(max_lr=1e-3, min_lr=1e-4, warmup_steps=2),
        global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seq_length=SEQ,
        train_steps=args.train_steps, name="own-gpt")
    if args.pace_file:
        forward = trainer.forward_step

        def paced(data, model):
            if os.path.exists(args.pace_file):
                time.sleep(args.pace_s)
            return forward(data, model)

        trainer.forward_step = paced
    # the faults a test asks for in the environment (SLURM_ETC_INJECT); none otherwise
    trainer.hooks = trainer_hooks_from_env()
    return run_worker(trainer)


if __name__ == "__main__":
    sys.exit(main())
