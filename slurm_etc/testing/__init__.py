"""Fault injection, planted bugs and fakes, for the tests and ``slurm-etc demo --inject``.

The runtime takes faults only through hook parameters whose defaults do nothing (a
trainer's ``hooks``, the coordinator's ``crash``, ``verify_transition``'s ``relabel``,
whose bugs are in :mod:`.plants`); this package is the one place that reads
the injection and plant switches from the environment and sets those hooks. Nothing in the
runtime imports it, except the demo, which launches :mod:`slurm_etc.testing.worker` when
asked to inject a fault.

The fakes that behave: :mod:`.fake_state` (training state with known values, which the
executor's tests migrate and check bit for bit) and :mod:`.fake_slurm` (an in-memory
:class:`~slurm_etc.slurm.client.SlurmClient`).
"""
