"""The coordinator of one elastic job and the pieces its reconcile loop is built from.

* :mod:`.channel`: the authenticated control channel to the workers (orders, rendezvous,
  reports) and the job's secret file;
* :mod:`.backend`: the backend seam (events in, actions out, the ``Backend`` protocol);
* :mod:`.events`: the local backend's events script (schema, validation, pure state);
* :mod:`.local_backend`: workers as local processes on simulated nodes;
* :mod:`.env`: the environment variables a launched worker is given.

Nothing is imported here, so that a worker importing the channel does not pay for the rest.
"""
