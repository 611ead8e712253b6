"""What the server that local workers are forked from imports once (multiprocessing's
``forkserver``, see :class:`slurm_etc.pool.local.LocalWorkers`): torch, torch.distributed,
megatron-core and the project's worker modules. A cold import of these takes about 5 s per
process on two cores; a worker forked from the server starts in a fraction of a second and
is still a fresh process (the server only imported: no tensors, no process groups, no
threads of torch's started).

One thread per process, as the workers run (set before torch is imported)."""
from __future__ import annotations

import importlib
import os

os.environ["OMP_NUM_THREADS"] = "1"

MODULES = ("torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.dist_checkpointing",
           "slurm_etc.protocol.store", "slurm_etc.worker.trainer",
           "slurm_etc.migrate.executor")

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except ImportError:  # a lighter install: the workers import what they need themselves
        pass
