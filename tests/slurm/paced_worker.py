"""The training command (TRAIN_CMD) of tests/slurm/test_elastic_training.py's Slurm job: the
preset worker (``python -m slurm_etc.worker.preset_worker``: megatron-core GPT ``tiny`` on
CPU), paced. While the pace file exists each forward pass sleeps ``--pace-s`` (sleeping
leaves the 2 cores to the other processes and does not change a loss), so that the job is
still training when the test's events come; the test removes the file after its last event.
A user's own training script stands in the same place (see examples/train_gpt.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--train-steps", type=int, required=True)
    p.add_argument("--pace-file", required=True)
    p.add_argument("--pace-s", type=float, default=0.05)
    args = p.parse_args()

    from slurm_etc.plan import load_model
    from slurm_etc.worker.entry import run_worker
    from slurm_etc.worker.gpt import preset_trainer

    trainer = preset_trainer(load_model("tiny"), distributed_optimizer=False, global_batch=8,
                             micro_batch=1, train_steps=args.train_steps)
    forward = trainer.forward_step

    def paced(data, model):  # type: ignore[no-untyped-def]
        if os.path.exists(args.pace_file):
            time.sleep(args.pace_s)
        return forward(data, model)

    trainer.forward_step = paced
    return run_worker(trainer)


if __name__ == "__main__":
    sys.exit(main())
