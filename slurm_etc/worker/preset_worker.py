"""A worker that trains a model preset: what ``slurm-etc demo`` launches.

``python -m slurm_etc.worker.preset_worker --model tiny --global-batch 8 --train-steps 30``
(``--data text``: byte-level text the model learns, instead of seeded random tokens)
builds :func:`~slurm_etc.worker.gpt.preset_trainer` and hands it to
:func:`~slurm_etc.worker.entry.run_worker` (the job, vrank and channel come from the
environment the backend sets).
"""
from __future__ import annotations

import argparse
import sys

from slurm_etc.plan import load_model

from .entry import run_worker
from .gpt import preset_trainer
from .text_data import StdlibText
from .trainer import ElasticTrainer


def build(argv: list[str] | None = None, prog: str = "python -m slurm_etc.worker.preset_worker"
          ) -> ElasticTrainer:
    """The trainer the command line describes."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--model", default="tiny")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--train-steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--data", choices=("seeded", "text"), default="seeded")
    args = p.parse_args(argv)
    model = load_model(args.model)
    trainer = preset_trainer(model, distributed_optimizer=args.distributed_optimizer,
                             seed=args.seed, global_batch=args.global_batch,
                             micro_batch=args.micro_batch, train_steps=args.train_steps)
    if args.data == "text":
        seq, vocab = trainer.seq_length, model.vocab_size
        trainer.dataset_provider = lambda: StdlibText(seq, vocab)
    return trainer


def main(argv: list[str] | None = None) -> int:
    return run_worker(build(argv))


if __name__ == "__main__":
    sys.exit(main())
