"""Local processes standing in for srun-launched workers.

* :mod:`.local`: ``LocalWorkers``, a pool of spawned processes on this machine that run one
  function on every worker and return the results in worker order (``slurm-etc verify``,
  ``slurm-etc bench migrate`` and the multi-process tests).
"""
