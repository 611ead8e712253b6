"""Publishing a job's node-local database into the shared state directory, atomically.

After every committed change the coordinator copies its live (WAL-mode) database with
SQLite's backup API into a private file beside it, switches that copy to a rollback journal
(a WAL-mode header would make readers on a network filesystem need shared memory that
does not work there), writes it to a temporary file in the user's own directory of the
state directory, fsyncs it and renames it over ``<state dir>/<uid>/<job>.db``. A reader
therefore sees the old snapshot or the new one, never a torn one; it takes the owner from
the descriptor it reads (``location.open_owned``) and reads a private copy (``guard``).
"""
from __future__ import annotations

import functools
import logging
import os
import secrets
import shutil
import sqlite3
import threading
import time
import urllib.parse
from pathlib import Path

from ..errors import InternalError
from .location import LocationError, open_owned, open_private_dir, private_file

log = logging.getLogger(__name__)

_COPY_CHUNK = 1 << 20
# A publication copies the whole record: one right after the other (a commit a step, or one
# a message in a resize) holds a core whenever the record is large (12.8 MB at 16,384
# ranks: 12 % of the coordinator's samples in a grow, py-spy). After a copy that took t, the
# next waits PUBLISH_GAP_FACTOR x t, at most PUBLISH_GAP_MAX_S: copies take at most a tenth
# of a core, and `status` reads a record at most that much older. A flush does not wait.
PUBLISH_GAP_FACTOR = 9.0
PUBLISH_GAP_MAX_S = 5.0
# The largest job record read back from the state directory (restored, or read by
# `status`): a long job's record of every event is a few MiB; a file far larger is no
# record of ours, and reading it would cost the reader's memory and time.
MAX_RECORD_BYTES = 64 << 20


class SnapshotError(InternalError, RuntimeError):
    """A snapshot could not be written or restored (where and why, one line)."""


def ensure_state_dir(state_dir: Path) -> Path:
    """Create the state directory owner-only (0700) if it does not exist. An existing one
    is used as it is (a site may share one, sticky like /tmp); snapshots are 0600."""
    try:
        Path(state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise SnapshotError(f"cannot create the state directory {state_dir}: "
                            f"{exc.strerror}") from None
    return Path(state_dir)


def publish_snapshot(db: Path, dest: Path) -> None:
    """Copy the SQLite database ``db`` to ``dest`` atomically (0600, rollback journal).

    ``dest``'s directory is the user's own (``<state dir>/<uid>``, :func:`user_state_dir`):
    created 0700, and refused when it belongs to someone else or others may write it. The
    temporary file and the rename are made relative to that directory's descriptor.

    Raises:
        SnapshotError: the copy or the rename failed, or the directory is not the user's;
            ``dest`` is then unchanged.
    """
    db, dest = Path(db), Path(dest)
    ensure_state_dir(dest.parent.parent)
    try:
        dir_fd = open_private_dir(dest.parent)
    except LocationError as exc:
        raise SnapshotError(f"cannot publish {dest}: {exc}") from None
    try:
        local = db.with_name(f".{db.name}.snapshot")
        try:
            private_file(local)
            src = sqlite3.connect("file:" + urllib.parse.quote(str(db.absolute())) + "?mode=ro",
                                  uri=True, timeout=10.0)
            try:
                dst = sqlite3.connect(local)
                try:
                    src.backup(dst)
                    dst.execute("PRAGMA journal_mode=DELETE").fetchone()
                finally:
                    dst.close()
            finally:
                src.close()
        except (sqlite3.Error, LocationError, OSError) as exc:
            raise SnapshotError(f"cannot copy {db} for publishing: {exc}") from None
        _replace_from(local, dest, dir_fd)
    finally:
        os.close(dir_fd)


def _replace_from(source: Path, dest: Path, dir_fd: int) -> None:
    tmp = None
    try:
        tmp = f".{dest.name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=dir_fd)
        with os.fdopen(fd, "wb") as out, open(source, "rb") as inp:
            shutil.copyfileobj(inp, out, _COPY_CHUNK)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        tmp = None
    except OSError as exc:
        raise SnapshotError(f"cannot publish {dest}: {exc.strerror or exc}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
    try:
        os.fsync(dir_fd)
    except OSError:
        pass  # some network filesystems refuse fsync on a directory; the rename stands


def restore_snapshot(snapshot: Path, db: Path) -> bool:
    """Start a job's node-local database from its published snapshot (a coordinator
    restarted on another node resumes from the record). ``db`` must not exist.

    Only a snapshot the caller owns, in a directory only the caller can write, is used: the
    owner is taken with ``fstat`` of the descriptor the bytes are then copied from (never
    the path opened again), so neither a planted file nor a swap between check and copy is
    adopted. The copy's content is checked by the caller (:mod:`.guard`).

    Returns:
        False when there is no snapshot to restore (nothing written).

    Raises:
        SnapshotError: the directory or the file is not the caller's alone, or the copy
            failed (``db`` is then removed).
    """
    snapshot, db = Path(snapshot), Path(db)
    if db.exists():
        raise SnapshotError(f"cannot restore {db} from {snapshot}: it exists already")
    try:
        dir_fd = open_private_dir(snapshot.parent, create=False)
    except FileNotFoundError:
        return False
    except LocationError as exc:
        raise SnapshotError(f"not restoring {snapshot}: {exc}") from None
    try:
        try:
            opened = open_owned(snapshot.name, dir_fd=dir_fd, max_bytes=MAX_RECORD_BYTES)
        except FileNotFoundError:
            return False
        except (LocationError, PermissionError) as exc:
            raise SnapshotError(f"not restoring {snapshot}: {exc}") from None
        if opened is None:
            raise SnapshotError(f"not restoring {snapshot}: it belongs to another user")
        try:
            private_file(db)
            with open(db, "r+b") as out:
                opened.read_into(out, MAX_RECORD_BYTES)
                out.flush()
                os.fsync(out.fileno())
        except (OSError, LocationError) as exc:
            try:
                db.unlink()
            except OSError:
                pass
            raise SnapshotError(f"cannot restore {db} from {snapshot}: {exc}") from None
        finally:
            opened.close()
    finally:
        os.close(dir_fd)
    return True


class Publisher:
    """Publishes one job's database after each commit, off the writer's path.

    A commit only asks for a publication (microseconds); a background thread copies the
    newest committed state, so several commits in quick succession coalesce into one copy
    and the coordinator never waits on the network filesystem's fsync. Copies are spaced
    (:data:`PUBLISH_GAP_FACTOR`): at most a tenth of a core, whatever the record's size and
    the rate of commits. A failure is logged and the next commit tries again (the record
    itself is safe on local disk).
    """

    def __init__(self, db: Path, dest: Path) -> None:
        self.db = Path(db)
        self.dest = Path(dest)
        self.failures = 0
        self._cond = threading.Condition()
        self._requested = 0  # publications asked for
        self._attempted = 0  # the request number the last finished attempt covered
        self._closed = False
        self._flushing = 0  # callers waiting in flush: the gap between copies is cut short
        self._thread: threading.Thread | None = None

    def __call__(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._requested += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"publish {self.dest.name}")
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every change committed so far has been published (or tried).

        Returns:
            True if the last attempt succeeded and nothing is pending.
        """
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                done = self._cond.wait_for(lambda: self._attempted >= self._requested,
                                           timeout)
            finally:
                self._flushing -= 1
            return done and self.failures == 0

    def close(self, timeout: float | None = 30.0) -> None:
        """Publish what is pending, then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _may_copy(self, gap_until: float) -> bool:
        return self._closed or self._flushing > 0 or time.monotonic() >= gap_until

    def _run(self) -> None:
        gap_until = 0.0  # no copy before this (monotonic), unless a flush or close waits
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._requested > self._attempted)
                if self._requested <= self._attempted:
                    return  # closed with nothing pending
                self._cond.wait_for(functools.partial(self._may_copy, gap_until),
                                    max(0.0, gap_until - time.monotonic()))
                target = self._requested
            began = time.monotonic()
            try:
                publish_snapshot(self.db, self.dest)
            except SnapshotError as exc:
                ok = False
                # one warning per outage (a full disk fails every commit's publication)
                log.log(logging.WARNING if not self.failures else logging.DEBUG,
                        "%s (the job record is safe in %s; retried on the next change)",
                        exc, self.db)
            except Exception:  # noqa: BLE001 - the thread must survive to publish again
                ok = False
                log.exception("publishing %s failed", self.dest)
            else:
                ok = True
                if self.failures:
                    log.warning("published %s again after %d failed attempts", self.dest,
                                self.failures)
            took = time.monotonic() - began
            gap_until = time.monotonic() + min(PUBLISH_GAP_MAX_S, PUBLISH_GAP_FACTOR * took)
            with self._cond:
                self.failures = 0 if ok else self.failures + 1
                self._attempted = target
                self._cond.notify_all()

    def __repr__(self) -> str:
        return f"Publisher({self.db} -> {self.dest})"
