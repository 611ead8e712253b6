"""Processes an earlier coordinator of the job started, watched through ``/proc``.

Both backends start processes on the coordinator's machine (the local backend its workers,
the Slurm backend one ``srun`` per step) and record each one's pid and start time at its
launch. A coordinator restarted on the same record takes up those still running: a
``(pid, start)`` pair names one process (a pid can be reused, the pair cannot), and since
such a process is not this coordinator's child it is polled, never waited for.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from .backend import UNKNOWN_EXIT


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat``); None
    when it is gone or has ended (a zombie). With the pid it names one process: a pid can
    be reused, a (pid, start) pair cannot."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if len(fields) < 20 or fields[0] in ("Z", "X") or not fields[19].isdigit():
        return None
    return int(fields[19])


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class PolledProcess:
    """A process that is not this process's child, the leader of a session of its own: the
    subset of ``Popen`` the backends use (``pid``, ``returncode``, ``poll``, ``wait``,
    ``kill``), with ``wait`` polling :meth:`poll` (what a subclass reads its end from)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        until = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if until is not None and time.monotonic() > until:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return code

    def kill(self) -> None:
        """SIGKILL, while it is still the process started (never a reused pid)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class AdoptedProcess(PolledProcess):
    """A process started by an earlier coordinator of the job. Its exit status is not this
    process's to read: an ended one reports ``UNKNOWN_EXIT``."""

    def __init__(self, pid: int, start: int) -> None:
        super().__init__(pid)
        self.start = start

    def poll(self) -> int | None:
        if self.returncode is None and process_start(self.pid) != self.start:
            if _zombie(self.pid):
                # ended, not reaped (its parent is gone): its pid, so its group id, is
                # not reused yet; what it spawned goes with it
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            self.returncode = UNKNOWN_EXIT
        return self.returncode
