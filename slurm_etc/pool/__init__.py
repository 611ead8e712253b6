"""Local processes: a pool of spawned worker processes on this machine.

* :mod:`.local`: ``LocalWorkers`` runs one function on every worker and returns the results
  in worker order (``slurm-etc verify``, ``slurm-etc bench migrate``, the multi-process
  tests). It sits below :mod:`slurm_etc.megatron`, which uses it, and
  :mod:`slurm_etc.worker` (the elastic trainer), which uses megatron: no import circle.
"""
