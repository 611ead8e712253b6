"""A small GPT trained with megatron-core, made elastic by slurm-etc.

Everything above ``main`` is what a Megatron training script already has: a model provider,
a forward step with its loss, a dataset. slurm-etc's ``ElasticTrainer`` takes them as they
are and keeps training through resizes, moving the state in memory.

The data: the bytes of a few Python standard library modules (byte-level tokens, vocabulary
256), so nothing is downloaded.

Run on this machine through a scripted sequence of layouts (4 local processes)::

    .venv/bin/python examples/train_gpt.py \
        --sequence "dp=2,tp=1,pp=2 -> dp=1,tp=2,pp=1 -> dp=4,tp=1,pp=1" --steps 4

(``vpp=2`` in a layout gives every pipeline rank two interleaved model chunks, the provider
called once per chunk with its ``vp_stage``.)

Started by the coordinator (``slurm-etc run ... -- python examples/train_gpt.py``, or the
default ``TRAIN_CMD`` of ``scripts/elastic.sbatch``), the same script is one worker of an
elastic job: it sees the worker's environment (``SLURM_ETC_JOB``, ``SLURM_ETC_SECRET_FILE``)
and ends in ``run_worker(trainer)``, as a user's own script does. The coordinator plans with
the model described in ``examples/train_gpt.model.json`` (this script's model) and a global
batch of 16 in micro-batches of 2::

    slurm-etc run --model examples/train_gpt.model.json --global-batch 16 --micro-batch 2 \
        --hardware cpu --nodes 2 --gpus-per-node 1 -- python examples/train_gpt.py
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

SEQ = 64
VOCAB = 256
GLOBAL_BATCH = 16
MICRO_BATCH = 2


class StdlibBytes:
    """Map-style dataset: sample ``i`` is ``SEQ + 1`` consecutive bytes of some stdlib
    sources, starting at a fixed stride."""

    def __init__(self) -> None:
        import argparse as a
        import json as j
        import textwrap as t

        text = b"".join(open(m.__file__, "rb").read() for m in (a, j, t))
        self.tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.count = (len(self.tokens) - SEQ - 1) // 37

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> torch.Tensor:
        start = (i % self.count) * 37
        return self.tokens[start:start + SEQ + 1]


def model_provider(config, pre_process: bool, post_process: bool, vp_stage=None):
    """megatron-core GPTModel for this rank's pipeline stage (``vp_stage``: which virtual
    pipeline chunk of it, given only with vpp > 1, as in Megatron-LM's model_provider)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=pre_process,
                    post_process=post_process, share_embeddings_and_output_weights=True,
                    vp_stage=vp_stage)


def forward_step(data_iterator, model):
    """Next-byte prediction loss of one micro-batch."""
    tokens = next(data_iterator)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0).expand_as(inputs)
    output = model(inputs, positions, None, labels=labels)

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def make_trainer(train_steps: int):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from slurm_etc.worker.trainer import ElasticTrainer, SchedulerConfig

    config = TransformerConfig(
        num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False)
    return ElasticTrainer(
        model_provider=model_provider, forward_step=forward_step,
        dataset_provider=StdlibBytes, transformer_config=config,
        optimizer_config=OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01,
                                         clip_grad=1.0),
        scheduler=SchedulerConfig(max_lr=1e-3, min_lr=1e-4, warmup_steps=2,
                                  start_wd=0.01, end_wd=0.01),
        global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seq_length=SEQ,
        train_steps=train_steps, name="example-gpt")


def started_by_coordinator(environ=os.environ) -> bool:
    """Whether a slurm-etc backend launched this process as a worker of a job."""
    from slurm_etc.protocol.env import JOB, SECRET_FILE

    return bool(environ.get(JOB)) and bool(environ.get(SECRET_FILE))


def main() -> int:
    from slurm_etc.plan.errors import ConfigError
    from slurm_etc.worker.local_run import run_local

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequence", default="dp=2,tp=1,pp=2 -> dp=1,tp=2,pp=1 -> "
                                              "dp=4,tp=1,pp=1")
    parser.add_argument("--steps", type=int, default=4, help="steps in each layout")
    parser.add_argument("--train-steps", type=int, default=100,
                        help="as a worker of a job: the steps the job trains")
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if started_by_coordinator():
        # one worker of an elastic job: the coordinator chooses the layouts
        from slurm_etc.worker.entry import run_worker

        # (the distributed optimizer comes with the layout: slurm-etc run's flag)
        return run_worker(make_trainer(args.train_steps))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = run_local(make_trainer, args.sequence, steps=args.steps,
                        distributed_optimizer=args.distributed_optimizer)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for h in out["history"]:
        print(f"step {h['step']:3d}  {h['layout']:16s}  loss {h['loss']:.4f}  "
              f"lr {h['lr']:.2e}  consumed {h['consumed_samples']}")
    for r in out["resizes"]:
        print(f"resize {r['old']} -> {r['new']} at step {r['step']}: moved "
              f"{r['moved_bytes'] / 2**20:.1f} MiB, pause {r['pause_seconds']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
