"""megatron-core integration: build real training states, read their sharded state dicts.

* :mod:`.build`: a GPTModel + DDP + optimizer for a ModelDesc under a ParallelConfig, trained
  a few steps (``build_training_state``, ``teardown``).
* :mod:`.shards`: plain-JSON metadata of sharded state dicts (``shard_records``).
* :mod:`.cpu_compat`: the patches that let megatron-core run on CPU under gloo (CPU runs only).
* :mod:`.state`: a live state as the executor's shards and back (views, install, step/RNG).
* :mod:`.resize`: the in-place resize (``prepare_resize`` before the pause,
  ``resize_in_place`` at it).
* :mod:`.checkpoint`: megatron's checkpoint path (save/load), the baseline and a reference.
* :mod:`.reference`: verify's oracles, reading state through megatron-core and torch only
  (never through :mod:`.state`); :mod:`.oracles`: shard helpers over the adapter's view.
* :mod:`.phases`, :mod:`.verify`, :mod:`.bench` (shared bits: :mod:`.experiments`):
  ``slurm-etc verify`` and ``slurm-etc bench migrate`` on local worker processes.

Submodules import megatron-core lazily (inside functions); this package imports nothing.
"""
