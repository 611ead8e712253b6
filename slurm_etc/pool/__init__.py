"""Local processes: a pool of spawned worker processes on this machine.

* :mod:`.local`: ``LocalWorkers`` runs one function on every worker and returns the results
  in worker order (``slurm-etc verify``, ``slurm-etc bench migrate``, the multi-process
  tests). It sits below :mod:`slurm_etc.harness` and :mod:`slurm_etc.worker` (the resize
  sequences of ``run_local``), which use it and megatron: no import circle.
"""
