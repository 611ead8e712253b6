"""The fault-injecting preset worker (slurm_etc.testing.worker) with a planted bug in the
after-commit path: the shards a rank
holds when a new rank died before the install (``InstallInterrupted``) are perturbed by 1e-3,
as if the held copy were corrupted. test_inject.py runs a job of these to show that its
loss comparison catches it. Nothing in slurm-etc knows about this module.

    python -m tests.dist.inject_planted_worker --model tiny --global-batch 8 --train-steps 20
"""
from __future__ import annotations

import sys

import torch

from slurm_etc.megatron import resize


def _corrupting(original):
    def init(self, message, tag, new_rank, shards, resume):
        original(self, message, tag, new_rank, shards, resume)
        for sh in shards:
            if sh.tensor.is_floating_point():
                with torch.no_grad():
                    sh.tensor.add_(1e-3)
    return init


resize.InstallInterrupted.__init__ = _corrupting(resize.InstallInterrupted.__init__)

if __name__ == "__main__":
    from slurm_etc.testing.worker import main

    sys.exit(main())
