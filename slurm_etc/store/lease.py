"""One coordinator per job: a lease on the job in its record, held for the coordinator's life.

Two coordinators on one job stop each other's workers and train the job twice. The lease is
taken before the coordinator writes anything and lasts until its process ends, however it
ends (a SIGKILL included: nothing to expire or clean up):

* SQLite (the record on node-local disk): an exclusive ``flock`` on ``<record>.lease``
  beside the file; the kernel releases it with the holder's last descriptor. The holder
  writes its host, pid and start time into the file for the refusal line.
* MariaDB / MySQL: ``GET_LOCK('slurm-etc:<job>', 0)``; PostgreSQL:
  ``pg_try_advisory_lock(<64 bits of the job's name>)``; each on a connection kept open for
  the lease, which the server releases when that connection ends (the holder died: its TCP
  connection closes).

A second coordinator is refused in one line (:class:`LeaseHeld`, exit 2) and writes nothing.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text

from slurm_etc.errors import InputError

from .db import Store


class LeaseHeld(InputError):
    """Another coordinator holds the job's lease."""


@dataclass
class JobLease:
    """The held lease of one job (:func:`take_lease`); :meth:`release` gives it up."""

    job_id: str
    where: str
    _handle: Any = field(default=None, repr=False)

    def release(self) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        if isinstance(handle, int):
            os.close(handle)  # the flock goes with the descriptor
        else:  # the server releases the lock with the connection: not back to the pool
            handle.invalidate()
            handle.close()

    def __enter__(self) -> JobLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_line() -> str:
    """Who holds a lease, as the refusal names them."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    return f"pid {os.getpid()} on {socket.gethostname()} since {started}"


def take_lease(store: Store, job_id: str) -> JobLease:
    """The lease of ``job_id`` in ``store``'s record, held until released or this process ends.

    Raises:
        LeaseHeld: another coordinator holds it (one line: who, and what to do).
    """
    if store.path is not None:
        return _file_lease(Path(store.path), job_id)
    return _server_lease(store, job_id)


def _refused(job_id: str, holder: str) -> LeaseHeld:
    return LeaseHeld(f"job {job_id} already has a coordinator ({holder}): one coordinator "
                     f"per job; wait for it to end, or stop it (slurm-etc status {job_id} "
                     "shows it); nothing was written")


def _file_lease(record: Path, job_id: str) -> JobLease:
    path = record.with_name(record.name + ".lease")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise _refused(job_id, holder) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder_line().encode() + b"\n", 0)
    return JobLease(job_id, str(path), fd)


def _lock_name(job_id: str) -> str:
    return f"slurm-etc:{job_id}"


def _server_lease(store: Store, job_id: str) -> JobLease:
    conn = store.engine.connect()
    try:
        dialect = store.engine.dialect.name
        if dialect in ("mysql", "mariadb"):
            got = conn.execute(text("SELECT GET_LOCK(:name, 0)"),
                               {"name": _lock_name(job_id)}).scalar()
        elif dialect == "postgresql":
            key = int.from_bytes(hashlib.blake2b(_lock_name(job_id).encode(),
                                                 digest_size=8).digest(), "big", signed=True)
            got = conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": key}).scalar()
        else:
            raise InputError(f"{store.url}: no lease for a {dialect} database (SQLite, "
                             "MariaDB/MySQL or PostgreSQL)")
        conn.commit()
    except BaseException:
        conn.close()
        raise
    if not got:
        conn.close()
        raise _refused(job_id, f"a coordinator connected to {store.url}")
    return JobLease(job_id, store.url, conn)
