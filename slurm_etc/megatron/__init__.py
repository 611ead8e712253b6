"""megatron-core integration: build real training states, read their sharded state dicts.

* :mod:`.build`: a GPTModel + DDP + optimizer for a ModelDesc under a ParallelConfig, trained
  a few steps (``build_training_state``, ``teardown``).
* :mod:`.shards`: plain-JSON metadata of sharded state dicts (``shard_records``).
* :mod:`.cpu_compat`: the patches that let megatron-core run on CPU under gloo (CPU runs only).
* :mod:`.state`: a live state as the executor's shards and back (views, install, step/RNG).
* :mod:`.resize`: the in-place resize (``prepare_resize`` before the pause,
  ``resize_in_place`` at it).
* :mod:`.checkpoint`: megatron's checkpoint path (save/load), the baseline and a reference.

``slurm-etc verify`` and ``slurm-etc bench migrate``, which run the resize on local worker
processes against independent references, live in :mod:`slurm_etc.harness`.

Submodules import megatron-core lazily (inside functions); this package imports nothing.
"""
