"""The local backend, beside the Slurm one (:mod:`slurm_etc.slurm.backend`): workers as
processes on this machine grouped into simulated nodes (:mod:`.backend`), the resource
events they see from a script (:mod:`.script`: schema, validation, pure state), and the
elastic demo's job on them (:mod:`.demo`). Both backends implement
:class:`slurm_etc.coordinator.backend.Backend`; the coordinator imports neither.
"""
