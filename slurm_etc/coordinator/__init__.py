"""The coordinator of one elastic job and the pieces its reconcile loop is built from.

* :mod:`.loop`: the reconcile loop (observe the backend and the workers, decide, act);
* :mod:`.reconcile`: its decisions on a resize (planning, settlement) as pure functions;
  :mod:`.resume`: what a restarted coordinator takes up; :mod:`.outlook`: whether a job
  with nothing training has anything left to wait for (pure);
* :mod:`.journal`: the job's record written in order, off the loop's thread;
* :mod:`.pause`: the pause each resize cost, measured from the workers' step times;
* :mod:`.backend`: the backend seam (events in, actions out, the ``Backend`` protocol);
  :mod:`.supervisor`: the one stop -> grace -> kill -> report supervisor both backends hand
  their workers to (they supply its ``do_*`` mechanism); :mod:`.processes`: the worker
  processes a backend started or adopted after a restart;
* :mod:`.run`: one job's coordinator around a backend (record, secret, channel, store).

The backends are beside it: :mod:`slurm_etc.local` (processes on this machine, scripted
resource events, the demo) and :mod:`slurm_etc.slurm` (member allocations, ``srun``).
Nothing is imported here, so that importing one piece does not pay for the rest.
"""
