"""The verify, bench and experiment drivers: the in-place resize of
:mod:`slurm_etc.megatron.resize` run on local worker processes
(:class:`~slurm_etc.pool.local.LocalWorkers`) and held against megatron-core's checkpoint
path. The CLI's ``slurm-etc verify`` and ``slurm-etc bench migrate`` and the tests use it;
the runtime (coordinator, trainer, backends) does not import it. One exception, inside
functions: :mod:`slurm_etc.worker.sequence` (the scripted resize sequences of
``run_local`` and ``verify --sequence``) digests and views a state through :mod:`.oracles`
and :mod:`.reference`.

* :mod:`.phases`: the worker-side phases (``w_*``) and :class:`~.phases.Transition`, one
  resize on local processes.
* :mod:`.verify`: ``slurm-etc verify``, every tensor checked bit for bit against
  :mod:`.reference`, the oracles that read state through megatron-core and torch only
  (never through :mod:`slurm_etc.megatron.state`); :mod:`.oracles`: shard helpers over the
  adapter's view.
* :mod:`.bench`: ``slurm-etc bench migrate``, both resize paths timed part by part.
* :mod:`.experiments`: the bits :mod:`.verify` and :mod:`.bench` share.

Submodules import megatron-core lazily (inside functions); this package imports nothing.
"""
