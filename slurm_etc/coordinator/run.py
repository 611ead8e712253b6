"""Start one job's coordinator: its record, secret, control channel and rendezvous store,
around a backend, then the reconcile loop (:mod:`.loop`)."""
from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurm_etc.alloc.topology import ClusterTopology
from slurm_etc.protocol.store import StoreServer
from slurm_etc.store import jobs as record

from .backend import Backend
from .channel import CoordinatorChannel, create_secret, split_bind
from .loop import Coordinator, JobSpec, owner

logger = logging.getLogger(__name__)


def run_job(spec: JobSpec, backend: Backend, topology: ClusterTopology, *,
            backend_name: str = "local", db: str | None = None,
            state_dir: str | None = None, bind: str = "127.0.0.1",
            advertise: str | None = None, secret_dir: Path | None = None,
            deadline_s: float | None = None,
            progress: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Run the job to its end; returns ``{"state", "reaction_s", "db"}``.

    The record is created before anything starts; the backend is closed (every worker
    stopped) whatever happens.
    """
    store = record.open_job_store(spec.job_id, db=db, state_dir=state_dir)
    secret = create_secret(spec.job_id, secret_dir, exist_ok=True)
    uid, name = owner()
    record.create_job(store, spec.job_id, name=spec.name, owner_uid=uid, owner_name=name,
                      backend=backend_name, model=spec.job.model.name)
    # The rendezvous store listens on the bind host only (any free port), over CURVE with
    # the job's keys; a committed generation retires the keys of those before it.
    bind_host = split_bind(bind)[0]
    rendezvous = StoreServer(secret.key, bind_host, job=spec.job_id)
    try:
        channel = CoordinatorChannel(spec.job_id, secret, bind, advertise=advertise,
                                     on_commit=rendezvous.retire_generations)
    except BaseException:
        rendezvous.close()
        raise
    channel.set_rendezvous(advertise or bind_host, rendezvous.port)
    record.set_coordinator(store, spec.job_id, channel.address)
    coordinator = Coordinator(spec, backend, store, channel, topology, progress=progress)
    # SIGTERM (scancel, the time limit, a requeue) ends the loop through the same clean
    # close as any other end: workers stopped, members cancelled, the record closed.
    previous = _on_sigterm(_terminate)
    try:
        state = coordinator.run(deadline_s=deadline_s)
    finally:
        _on_sigterm(signal.SIG_IGN)  # a second SIGTERM does not cut the close short
        try:
            backend.close()
            channel.close()
            rendezvous.close()
            store.close()
        finally:
            _on_sigterm(previous)
    return {"state": state, "reaction_s": coordinator.reaction_s,
            "generation": coordinator.generation, "step": coordinator.step}


def _terminate(signum: int, _frame: Any) -> None:
    logger.warning("coordinator: got SIGTERM; stopping the workers and closing")
    raise SystemExit(128 + signum)


def _on_sigterm(handler: Any) -> Any:
    """Install ``handler`` for SIGTERM (main thread only; elsewhere nothing), returning the
    previous one."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)
