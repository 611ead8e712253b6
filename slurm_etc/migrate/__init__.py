"""Executor of migration plans: move training state GPU-to-GPU (gloo on CPU) between live
processes, two-phase, with bounded staging memory. See docs/migrate.md.

* :mod:`.shards` (pure): which shards a rank holds / needs (``shard_specs``), ``LocalShard``.
* :mod:`.program` (pure): a process's part of a plan as byte segments and steps; packing format
  and chunking.
* :mod:`.transport`: the transport seam; ``TorchTransport`` (batch_isend_irecv, gloo/NCCL),
  ``BackendTransport`` (gloo backends outside the default group) and ``ThreadTransport``
  (in-process).
* :mod:`.group`: the migration group over the plan's participants (old ∪ new, minus lost).
* :mod:`.executor`: ``execute_migration`` (two-phase; ``MigrationAborted`` on every rank).
* :mod:`.faults`, :mod:`.memory`, :mod:`.threads`: fault injection, peak memory, in-process
  runs. (The fake state with known values the tests migrate is
  :mod:`slurm_etc.testing.fake_state`.)

Names are exported lazily, so importing the pure modules does not import torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LocalShard": "shards", "ShardSpec": "shards", "shard_specs": "shards",
    "Program": "program", "compile_program": "program", "group_devices": "program",
    "chunk_bytes_for": "program", "DEFAULT_STAGING_BYTES": "program",
    "Transport": "transport", "TorchTransport": "transport", "ThreadTransport": "transport",
    "BackendTransport": "transport",
    "ThreadHub": "transport", "TransportError": "transport",
    "MigrationGroup": "group", "new_migration_group": "group",
    "connect_migration_group": "group",
    "execute_migration": "executor", "MigrationOptions": "executor",
    "MigrationResult": "executor", "MigrationStats": "executor",
    "MigrationError": "executor", "MigrationAborted": "executor", "RankFailure": "executor",
    "FaultInjector": "faults", "InjectedFault": "faults",
    "run_threads": "threads",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
