"""Start one job's coordinator: its record, secret, control channel and rendezvous store,
around a backend, then the reconcile loop (:mod:`.loop`)."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from slurm_etc.alloc.topology import ClusterTopology
from slurm_etc.lifecycle import JobState, job_transition_error
from slurm_etc.migrate.decision import ABORT
from slurm_etc.protocol.store import StoreClient
from slurm_etc.protocol.store import StoreError as RendezvousStoreError
from slurm_etc.store import jobs as record
from slurm_etc.store.db import StoreError
from slurm_etc.store.lease import take_lease

from ..protocol.channel import ChannelError, CoordinatorChannel, create_secret, split_bind
from .backend import Backend
from .job import JobSpec
from .loop import Coordinator, owner

logger = logging.getLogger(__name__)


def run_job(spec: JobSpec, backend: Backend, topology: ClusterTopology, *,
            backend_name: str = "local", db: str | None = None,
            state_dir: str | None = None, bind: str = "127.0.0.1",
            advertise: str | None = None, secret_dir: Path | None = None,
            deadline_s: float | None = None,
            progress: Callable[[dict[str, Any]], None] | None = None,
            crash: Callable[[str], None] | None = None,
            metrics: tuple[str, int] | None = None) -> dict[str, Any]:
    """Run the job to its end; returns ``{"state", "reaction_s", "db"}``.

    The record is created before anything starts, once this coordinator holds the job's
    lease (:mod:`slurm_etc.store.lease`: a second coordinator on a live job is refused in
    one line, nothing written); the backend is closed (every worker stopped) whatever
    happens. ``metrics``: (address, port) where the job's metrics are served while it runs
    (:func:`slurm_etc.metrics.serve`; port 0: any free one, logged). ``crash``: the
    coordinator's crash hook (a test's SIGKILL at one of
    :data:`~slurm_etc.coordinator.loop.KILL_POINTS`; none by default).
    """
    store = _open_record(spec.job_id, db, state_dir)
    try:  # before anything is written: a second coordinator on a live job is refused
        lease = take_lease(store, spec.job_id)
    except BaseException:
        store.close()
        raise
    try:
        with _metrics_served(store, spec.job_id, metrics):
            return _coordinate(spec, backend, topology, store, backend_name=backend_name,
                               bind=bind, advertise=advertise, secret_dir=secret_dir,
                               deadline_s=deadline_s, progress=progress, crash=crash)
    finally:
        lease.release()


@contextlib.contextmanager
def _metrics_served(store: Any, job_id: str,
                    where: tuple[str, int] | None) -> Iterator[None]:
    """The job's metrics endpoint while the coordinator runs: each scrape reads the record
    (a read-only connection of its own for a SQLite file: the scrape's thread is not the
    coordinator's)."""
    if where is None:
        yield
        return
    from slurm_etc.metrics import serve
    from slurm_etc.store.db import open_store_readonly

    def read() -> list[Any]:
        reader = open_store_readonly(store.path) if store.path is not None else store
        try:
            detail = record.job_detail(reader, job_id)
        finally:
            if reader is not store:
                reader.close()
        return [detail] if detail is not None else []

    try:
        server = serve(read, where[0], where[1])
    except OSError as err:
        raise StoreError(f"cannot serve metrics on {where[0]}:{where[1]}: "
                         f"{err.strerror or err}") from None
    logger.info("[job %s] metrics on http://%s:%d/metrics", job_id, where[0],
                server.server_port)
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def _coordinate(spec: JobSpec, backend: Backend, topology: ClusterTopology, store: Any, *,
                backend_name: str, bind: str, advertise: str | None,
                secret_dir: Path | None, deadline_s: float | None,
                progress: Callable[[dict[str, Any]], None] | None,
                crash: Callable[[str], None] | None) -> dict[str, Any]:
    """:func:`run_job` once the record is open and its lease held."""
    known = record.job_detail(store, spec.job_id)
    refused = known and job_transition_error(spec.job_id, known.job.state, JobState.RUNNING)
    if refused:
        store.close()
        raise record.RecordError(f"{refused}; nothing was written")
    # a backend whose cluster lives in this process (the local one) keeps its state beside
    # the record; a coordinator restarted on the job takes it up (what was granted is held)
    backend.keep_state(cluster_state_path(store, spec.job_id), resume=known is not None)
    secret = create_secret(spec.job_id, secret_dir, exist_ok=True)
    uid, name = owner()
    record.create_job(store, spec.job_id, name=spec.name, owner_uid=uid, owner_name=name,
                      backend=backend_name, model=spec.job.model.name)
    # The channel hosts the rendezvous store on its own socket (one connection per worker
    # carries both), over CURVE with the job's keys; a committed generation retires the
    # keys of those before it.
    channel = _bind_channel(store, spec.job_id, secret, bind, advertise)
    record.set_coordinator(store, spec.job_id, channel.address)
    poster = StoreClient(split_bind(bind)[0], channel.port, secret.key)
    coordinator = coordinator_over(spec, backend, store, channel, topology, poster,
                                   progress=progress, crash=crash)
    # SIGTERM (scancel, the time limit, a requeue) and SIGINT end the loop at its next turn
    # through the same clean close as any other end: workers stopped, members cancelled,
    # the record ended as cancelled with the signal as its reason.
    got: list[int] = []

    def cancel(signum: int, _frame: Any) -> None:
        if got:
            return  # a second signal does not cut the close short
        got.append(signum)
        name = signal.Signals(signum).name
        logger.warning("coordinator: got %s; stopping the workers and closing", name)
        coordinator.cancel(f"cancelled by {name} ({_SIGNAL_CAUSES.get(signum, 'a signal')})")

    previous = _on_signals(cancel)
    try:
        state = coordinator.run(deadline_s=deadline_s)
    finally:
        _on_signals(signal.SIG_IGN)  # a signal now does not cut the close short
        try:
            backend.close()
            poster.close()
            channel.close()
            store.close()
        finally:
            _restore_signals(previous)
    out: dict[str, Any] = {"state": state, "reaction_s": coordinator.watch.reaction_s,
                           "generation": coordinator.generation, "step": coordinator.step}
    if got:
        out["signal"] = got[0]
    return out


def coordinator_over(spec: JobSpec, backend: Backend, store: Any, channel: CoordinatorChannel,
                     topology: ClusterTopology, poster: StoreClient, **kw: Any) -> Coordinator:
    """The job's Coordinator wired to the rendezvous store its channel hosts: its own writes
    there (an order naming the dead, a commit vote closed) go over the wire through
    ``poster``, like a worker's (the server's socket belongs to its thread), and the store's
    first values reach it (a resize decided commit, a step's decision holding the order).
    ``run_job`` and ``slurm-etc bench control`` both make theirs here."""
    job_id = spec.job_id

    def post(key: str, value: bytes) -> None:
        try:
            poster.set(key, value)
        except RendezvousStoreError as e:  # the workers still get the order over the channel
            logger.warning("[job %s] rendezvous store: %s not set (%s)", job_id, key, e)

    def close_vote(key: str) -> bytes:
        try:
            return bytes(poster.compare_set(key, b"", ABORT))
        except RendezvousStoreError as e:  # the resize is waited out as without a death
            logger.warning("[job %s] rendezvous store: %s not closed (%s)", job_id, key, e)
            return b""

    coordinator = Coordinator(spec, backend, store, channel, topology, post=post,
                              close_vote=close_vote, **kw)
    channel.store.on_first_set = coordinator.commit_decided
    return coordinator


def cluster_state_path(store: Any, job_id: str) -> Path:
    """Where a backend keeps the state of a cluster it simulates: beside the job's SQLite
    record (``<job>.db`` -> ``<job>.db.cluster.json``); for a record behind a URL, beside
    the default node-local one."""
    from slurm_etc.store.location import default_local_db, private_dir

    if getattr(store, "path", None):
        where = Path(store.path)
    else:
        where = default_local_db(job_id)
        private_dir(where.parent)
    return where.with_name(f"{where.name}.cluster.json")


def _bind_channel(store: Any, job_id: str, secret: Any, bind: str, advertise: str | None
                  ) -> CoordinatorChannel:
    """The job's control channel (and the rendezvous store on it). A coordinator restarted
    on the job's record binds the port the one before it recorded (unless ``bind`` names
    one): the workers it launched connect to that address and reconnect by themselves, so
    they are reattached (their store requests follow the connection). Where that port is taken,
    any free port, and the workers cannot be reattached (they exit after their reattach
    wait; the job starts again from its newest checkpoint)."""
    host, port = split_bind(bind)
    detail = record.job_detail(store, job_id)
    recorded = detail.job.coordinator if detail is not None else None
    tail = (recorded or "").rsplit(":", 1)[-1]
    if port or not tail.isdigit():
        return CoordinatorChannel(job_id, secret, bind, advertise=advertise)
    again = f"[{host}]:{tail}" if ":" in host else f"{host}:{tail}"
    try:
        return CoordinatorChannel(job_id, secret, again, advertise=advertise)
    except ChannelError as err:
        logger.warning("coordinator restarted: cannot listen where its workers look (%s); "
                       "they cannot be reattached", err)
        return CoordinatorChannel(job_id, secret, bind, advertise=advertise)


def _open_record(job_id: str, db: str | None, state_dir: str | None) -> Any:
    """The job's store; a disk that is full or failing at the start (SQLite's own errors,
    the OS's) is one StoreError line, never a traceback."""
    import sqlite3

    try:
        return record.open_job_store(job_id, db=db, state_dir=state_dir)
    except (sqlite3.Error, OSError) as err:
        where = db or state_dir or "the default location"
        raise StoreError(f"cannot open the record of job {job_id} in {where}: "
                         f"{getattr(err, 'strerror', None) or err}") from None


_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SIGNAL_CAUSES: dict[int, str] = {signal.SIGTERM: "scancel, the time limit or a requeue",
                  signal.SIGINT: "an interrupt"}


def _on_signals(handler: Any) -> dict[int, Any]:
    """Install ``handler`` for SIGTERM and SIGINT (main thread only; elsewhere nothing),
    returning the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in _SIGNALS}


def _restore_signals(previous: dict[int, Any]) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)
