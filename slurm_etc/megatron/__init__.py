"""megatron-core integration: build real training states, read their sharded state dicts.

* :mod:`.build`: a GPTModel + DDP + optimizer for a ModelDesc under a ParallelConfig, trained
  a few steps (``build_training_state``, ``teardown``).
* :mod:`.shards`: plain-JSON metadata of sharded state dicts (``shard_records``).
* :mod:`.cpu_compat`: the patches that let megatron-core run on CPU under gloo (CPU runs only).

Submodules import megatron-core lazily (inside functions); this package imports nothing.
"""
